"""Order statistics for latency columns and repeated runs (pure functions)."""

from __future__ import annotations

import math
from dataclasses import dataclass


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between order statistics.

    The same definition as numpy's default ("linear"): rank q/100 * (n - 1) in the sorted
    values, interpolated between its two neighbours.
    """
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"q must be within [0, 100], got {q}")
    ordered = sorted(values)
    rank = q / 100 * (len(ordered) - 1)
    lo, hi = math.floor(rank), math.ceil(rank)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def median(values: list[float]) -> float:
    return percentile(values, 50)


@dataclass(frozen=True)
class Percentiles:
    """p50/p95/p99 of one latency measure, in seconds."""

    p50: float
    p95: float
    p99: float

    @classmethod
    def of(cls, values: list[float]) -> Percentiles:
        return cls(percentile(values, 50), percentile(values, 95), percentile(values, 99))

    @classmethod
    def median_of(cls, runs: list[Percentiles]) -> Percentiles:
        """Each percentile's median over repeated runs (each run's own batch)."""
        return cls(
            median([r.p50 for r in runs]),
            median([r.p95 for r in runs]),
            median([r.p99 for r in runs]),
        )
