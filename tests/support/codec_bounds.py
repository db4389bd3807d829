"""The codecs' documented error bounds, transcribed from their docstrings, and the round trip they bound: shared
by test_codecs.py, test_codecs_nbit.py and test_codecs_adaptive.py."""

from __future__ import annotations

import numpy as np

from cnrstore import codecs


def u16(t):
    """Largest fp16 rounding error at t (|t| <= 65504)."""
    return np.maximum(np.abs(t) * 2.0**-11, 2.0**-25)


def uniform_error_bound(bits: int, x: np.ndarray) -> np.ndarray:
    """Per-value bound on |x - decode(encode(x))| of the ``bits``-bit uniform codec (fp16 scale and minimum),
    broadcastable to x's shape (float64)."""
    x = x.astype(np.float64)
    m, M = x.min(axis=1, keepdims=True), x.max(axis=1, keepdims=True)
    d = M - m
    L = (1 << bits) - 1
    slop = 2.0**-20 * (np.abs(m) + np.abs(M))
    return d / (2 * L) + (1 + 1 / (2 * L)) * u16(m) + (L + 1) * u16(d / L + u16(m)) + slop


def roundtrip(name: str, x: np.ndarray) -> np.ndarray:
    """``x`` encoded and decoded by codec ``name``."""
    c = codecs.get(name)
    return c.decode(c.encode(x), x.shape[1])
