"""Argument checks every layer shares (a leaf, as ``errors``: imports nothing of cnrstore but the errors), so that
one rule is written once: the engine's (``engine/arguments.py``), the policies' and the serving follower's.
"""

from __future__ import annotations

import math
import numbers

from .errors import InvalidArgument

__all__ = ["number"]


def number(value, what: str, *, positive: bool = False) -> float:
    """``value`` (a real number: int, float, numpy's; never a bool or a str) as a finite float >= 0 (> 0 with
    ``positive``), else InvalidArgument naming ``what``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidArgument(f"{what} must be a number, got {value!r}")
    v = float(value)
    if not math.isfinite(v) or v < 0 or (positive and v == 0):
        want = "a finite number > 0" if positive else "a finite number >= 0"
        raise InvalidArgument(f"{what} must be {want}, got {value!r}")
    return v
