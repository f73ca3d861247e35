"""Figures as people read them: rounded, with separators, and words for what is missing.

Pure functions, shared by the terminal summary (`tokenmill run`), the ledger listing
(`tokenmill ledger show`) and the flow's artifacts, so a figure reads the same in each.
The ledger itself keeps exact values; these are only how they are shown.

    a price never given           "not set"        (not 0, not blank)
    a cost when no price is set   "no prices set"  (not $0.000000)
    a figure that does not apply  "n/a"
"""

from __future__ import annotations

import math
from typing import Any

NOT_SET = "not set"
NO_PRICES = "no prices set"
NOT_APPLICABLE = "n/a"

PRICE_FIELDS = (
    "price_input_per_1m",
    "price_cached_input_per_1m",
    "price_output_per_1m",
    "price_device_per_hour",
)


def prices_given(ledger: Any) -> bool:
    """Whether the job was given any price (a ledger, or its dict)."""
    get = ledger.get if isinstance(ledger, dict) else lambda name: getattr(ledger, name, None)
    return any(get(name) is not None for name in PRICE_FIELDS)


def count(value: int | None) -> str:
    return NOT_APPLICABLE if value is None else f"{value:,}"


def money(value: float | None) -> str:
    """Dollars: $1,234.57 from a dollar up; three significant digits below ($0.0123,
    $0.0000120), never in exponent notation."""
    if value is None:
        return NOT_APPLICABLE
    if value == 0 or abs(value) >= 1:
        return f"${value:,.2f}"
    decimals = max(4, 2 - math.floor(math.log10(abs(value))))
    return f"${value:.{decimals}f}"


def price(value: float | None, unit: str) -> str:
    """A price as given, with its unit; "not set" when it was not given."""
    return NOT_SET if value is None else f"${value:,.6g} {unit}"


def seconds(value: float | None) -> str:
    return NOT_APPLICABLE if value is None else f"{value:,.2f} s"


def rate(value: float | None, unit: str = "tok/s") -> str:
    return NOT_APPLICABLE if value is None else f"{value:,.0f} {unit}"


def percent(value: float | None) -> str:
    return NOT_APPLICABLE if value is None else f"{value:.1%}"
