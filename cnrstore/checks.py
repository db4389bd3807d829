"""Argument checks every layer shares (a leaf, as ``errors``: imports nothing of cnrstore but the errors), so that
one rule is written once: the engine's (``engine/arguments.py``), the policies' and the serving follower's.
"""

from __future__ import annotations

import math
import numbers

from .errors import InvalidArgument

__all__ = ["number"]


def number(value, what: str, *, positive: bool = False, finite: bool = True) -> float:
    """``value`` (a real number: int, float, numpy's; never a bool or a str) as a float >= 0 (> 0 with
    ``positive``), finite unless ``finite=False`` (then ``math.inf`` passes; NaN never does), else
    InvalidArgument naming ``what``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidArgument(f"{what} must be a number, got {value!r}")
    v = float(value)
    if math.isnan(v) or (finite and math.isinf(v)) or v < 0 or (positive and v == 0):
        want = ("a finite number" if finite else "a number") + (" > 0" if positive else " >= 0")
        raise InvalidArgument(f"{what} must be {want}, got {value!r}")
    return v
