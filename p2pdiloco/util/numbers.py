"""What counts as a number in a value that came from elsewhere (a peer's header or record, a file, a snapshot)."""

from __future__ import annotations

import math


def finite_number(value: object) -> bool:
    """Whether `value` is an int or float that is finite; a bool is no number here (JSON's true is not 1)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def number_or_none(value: object) -> float | None:
    """`value` as a float if it is a `finite_number`, else None."""
    return float(value) if finite_number(value) else None
