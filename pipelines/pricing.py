"""Token and device prices, and the arithmetic that turns token counts into dollars.

Pure functions. Money is computed in `Decimal` from integer token counts and rounded
once, to a nano-dollar, so a cost never drifts with the order of a float sum and the
same counts always give the same figures.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from decimal import ROUND_HALF_EVEN, Decimal

NANO = Decimal("0.000000001")
MILLION = Decimal(1_000_000)


@dataclass(frozen=True)
class Prices:
    """USD per 1M tokens (input, cached input, output) and optionally per device-hour.

    A price left out (None) is "not set": it charges nothing, and ledgers and reports
    say "not set" rather than showing a price of 0. `cached_input_per_1m` defaults to
    the input price: a cache hit is only cheaper when you say so.
    """

    input_per_1m: float | None = None
    cached_input_per_1m: float | None = None
    output_per_1m: float | None = None
    device_per_hour: float | None = None

    def __post_init__(self) -> None:
        for name in ("input_per_1m", "cached_input_per_1m", "output_per_1m", "device_per_hour"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{name} must be a number, got {type(value).__name__}")
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")

    @property
    def input(self) -> float:
        """The input price charged (0 when not set)."""
        return self.input_per_1m or 0.0

    @property
    def output(self) -> float:
        """The output price charged (0 when not set)."""
        return self.output_per_1m or 0.0

    @property
    def cached_input(self) -> float:
        """The cached-input price charged: its own, else the input price, else 0."""
        return self.input if self.cached_input_per_1m is None else self.cached_input_per_1m

    @property
    def cached_input_given(self) -> float | None:
        """The cached-input price in force when one was given (its own or the input's)."""
        return self.input_per_1m if self.cached_input_per_1m is None else self.cached_input_per_1m

    @property
    def has_token_prices(self) -> bool:
        """Whether any token price was given (else every token cost is 0 by omission)."""
        return any(
            p is not None for p in (self.input_per_1m, self.cached_input_per_1m, self.output_per_1m)
        )


@dataclass(frozen=True)
class CostSplit:
    """Dollar figures for one job (floats of nano-dollar-rounded decimals)."""

    cost_input: float  # uncached prompt tokens
    cost_cached_input: float
    cost_output: float
    cost_total: float
    cost_per_1k_requests: float | None  # None when no request succeeded
    cost_per_1m_tokens: float | None  # None when no token was processed
    cost_device: float | None = None  # None without a device price
    device_cost_per_1k_requests: float | None = None
    device_cost_per_1m_tokens: float | None = None


def _dec(value: float) -> Decimal:
    # via str so 0.15 means 0.15, not its binary approximation
    return Decimal(str(value))


def _round(value: Decimal) -> float:
    return float(value.quantize(NANO, rounding=ROUND_HALF_EVEN))


def _per(total: Decimal, count: int, unit: int) -> float | None:
    return None if count <= 0 else _round(total * unit / count)


def token_costs(
    prices: Prices,
    *,
    prompt_tokens: int,
    cached_tokens: int,
    completion_tokens: int,
    num_requests: int,
    device_seconds: float | None = None,
) -> CostSplit:
    """Cost split for a job's token counts.

    Args:
        prices: the prices in force.
        prompt_tokens: all prompt tokens, cached ones included.
        cached_tokens: the prompt tokens served from the prefix cache.
        completion_tokens: generated tokens.
        num_requests: requests that succeeded (the "per 1K requests" denominator).
        device_seconds: time the device spent on the job (for the device-hour cost).

    Returns:
        A CostSplit; cost_total is input + cached input + output (token prices only).
    """
    if min(prompt_tokens, cached_tokens, completion_tokens, num_requests) < 0:
        raise ValueError("token and request counts must be >= 0")
    if cached_tokens > prompt_tokens:
        raise ValueError(f"cached_tokens ({cached_tokens}) > prompt_tokens ({prompt_tokens})")
    uncached = prompt_tokens - cached_tokens
    c_in = Decimal(uncached) * _dec(prices.input) / MILLION
    c_cached = Decimal(cached_tokens) * _dec(prices.cached_input) / MILLION
    c_out = Decimal(completion_tokens) * _dec(prices.output) / MILLION
    # round the parts first and sum the rounded parts, so total == sum of the parts
    c_in, c_cached, c_out = (
        d.quantize(NANO, rounding=ROUND_HALF_EVEN) for d in (c_in, c_cached, c_out)
    )
    total = c_in + c_cached + c_out
    num_tokens = prompt_tokens + completion_tokens
    split = {
        "cost_input": float(c_in),
        "cost_cached_input": float(c_cached),
        "cost_output": float(c_out),
        "cost_total": float(total),
        "cost_per_1k_requests": _per(total, num_requests, 1000),
        "cost_per_1m_tokens": _per(total, num_tokens, 1_000_000),
    }
    if prices.device_per_hour is not None and device_seconds is not None:
        device = _dec(device_seconds) * _dec(prices.device_per_hour) / Decimal(3600)
        device = device.quantize(NANO, rounding=ROUND_HALF_EVEN)
        split["cost_device"] = float(device)
        split["device_cost_per_1k_requests"] = _per(device, num_requests, 1000)
        split["device_cost_per_1m_tokens"] = _per(device, num_tokens, 1_000_000)
    return CostSplit(**split)
