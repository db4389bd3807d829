"""Row-wise asymmetric uniform quantization (``int8``, ``int4``, ``int2``) on FBGEMM's CPU kernels.

The kernels are ``torch.ops.quantized.embedding_bag_{byte,4bit,2bit}_prepack`` / ``_unpack``; they are
multi-threaded (ATen ``parallel_for``) and release the GIL. Each row gets its own bias (the row
minimum) and scale; a value is stored as a level ``q`` in ``[0, 2**bits - 1]`` and decodes to
``scale * q + bias`` in float32.

What FBGEMM does, per row with float32 minimum ``m`` and maximum ``M`` (``L = 2**bits - 1``):

- int8: ``bias = m`` and ``scale = (M - m) / 255`` both in fp32; ``q = rint((x - m) * 255 / (M - m + 1e-8))``.
  The ``1e-8`` guard compresses the levels of rows whose range is near or below ``1e-8``.
- int4 / int2: ``bias = fp16(m)`` (round to nearest even, so it may lie above ``m``); ``scale =
  fp16((M - bias) / L)``, replaced by 1.0 when it is 0 (constant or tiny rows); ``q = clamp(rint((x -
  bias) / scale), 0, L)``. If ``bias`` rounded above ``M`` the scale is negative, and the grid runs
  downwards from ``bias``: still correct.
- Constant rows: int8 decodes every finite constant exactly (scale 0, bias ``m``). int4/int2 decode a
  constant exactly when it is an fp16 value (scale 1, every level 0); any other constant decodes
  within the bound below (in practice within a few fp32 ulps, as the negative or tiny scale absorbs
  the bias rounding). ``-0.0`` decodes as ``+0.0`` (``0 * scale + -0.0``).

4-bit packs two values per byte and 2-bit four, so those kernels need ``dim`` to be a multiple of 2 or
4. A row of another ``dim`` is padded to the next multiple by repeating its last value, which keeps the
row's minimum and maximum and therefore its bias, scale and levels; ``decode`` drops the padding.
Encoded bytes are bit-identical to FBGEMM's for the padded row.

Torch is imported lazily, so that ``import cnrstore`` and the read-only commands (``cnrstore ls``,
``info``, ``verify``, ``rows``) never pay its import (~2-3 s). Encoding always runs FBGEMM's prepack
kernels and imports torch on first use. Decoding runs FBGEMM's unpack kernel when torch is already
imported in the process (a trainer: the kernels are multi-threaded), else a numpy decode of the same
formats that gives the same float32 bits (tests/test_codecs_decode.py compares the two, bit for bit,
over random and edge-value rows of every width and many dims, and over arbitrary finite scales and
biases), so the choice never changes a decoded value:

- int4 / int2: ``nbit.decode_uniform`` (FBGEMM's nibble and bit-pair order): ``scale * q`` is exact
  in float32 (an 11-bit fp16 significand times a level below 16), so the only rounding is the add,
  as in FBGEMM.
- int8: FBGEMM computes ``fma(scale, q, bias)`` (one rounding; its AVX2 kernel fuses the multiply-add,
  and ``scale * q`` is not exact in float32). The numpy decode forms ``scale * q`` exactly in float64,
  adds the bias with round-to-odd (``TwoSum`` gives the add's rounding error; an inexact sum is
  truncated toward zero and its last bit set), and rounds that once to float32: round-to-odd at 53
  bits followed by a rounding to 24 bits equals one rounding of the exact value. On a CPU where
  FBGEMM's kernel does not fuse (no AVX2: its scalar reference path rounds the product first) the
  kernel's bits differ from both, and the equality test says so there.

Row minima and maxima (for the representable-range checks of every write) use ``torch.aminmax`` (one
multi-threaded pass) when torch is loaded and numpy otherwise; both are exact.
"""

from __future__ import annotations

import sys
from typing import ClassVar

import numpy as np

from cnrstore.codecs.base import DECODE_CHUNK_VALUES, Codec
from cnrstore.codecs.lossless import FP16_MAX
from cnrstore.codecs.nbit import decode_uniform

__all__ = ["Int8", "Int4", "Int2", "value_range", "decode_int8"]

#: int8 rows must stay within this magnitude: then ``M - m`` is finite and so is every decoded value
#: (past it, ``scale * 255 + bias`` can round up to inf even though ``M - m`` is finite).
INT8_MAX_ABS = 2.0**126

#: Values per chunk of the numpy int8 decode: its float64 temporaries stay in L2 cache.
_CHUNK_VALUES = 1 << 15


def _torch():
    """The torch module, imported on first use (encoding needs FBGEMM's kernels)."""
    import torch

    return torch


def _loaded_torch():
    """The torch module if this process has already imported it (fully), else None: reads use the
    kernels only where they cost no import."""
    torch = sys.modules.get("torch")
    if torch is None or getattr(getattr(torch, "__spec__", None), "_initializing", False):
        return None
    return torch


def _tensor(torch, a: np.ndarray):
    # DLPack shares the memory and, unlike from_numpy, accepts read-only arrays (mmap views) without
    # a warning; the kernels only read their input.
    return torch.from_dlpack(a)


def value_range(x: np.ndarray) -> tuple[float, float]:
    """Global (min, max) of a non-empty float32 array in one pass (multi-threaded when torch is
    loaded); NaN if any is NaN."""
    torch = _loaded_torch()
    if torch is None:
        return float(x.min()), float(x.max())
    lo, hi = torch.aminmax(_tensor(torch, x))
    return lo.item(), hi.item()


def decode_int8(e: np.ndarray, dim: int, out: np.ndarray | None = None) -> np.ndarray:
    """Numpy decode of FBGEMM's fused 8-bit row-wise rows ``(n, dim + 8)`` into float32 ``(n, dim)``:
    ``fma(scale, q, bias)``, rounded once, as FBGEMM's kernel computes it (see the module docstring).
    Into ``out`` (float32 ``(n, dim)``; returned) if given, else a new array."""
    n = e.shape[0]
    if out is None:
        out = np.empty((n, dim), dtype=np.float32)
    meta = np.ascontiguousarray(e[:, dim : dim + 8]).view("<f4")  # (n, 2): scale, bias
    step = max(1, _CHUNK_VALUES // dim)
    rows = min(step, n)
    p, s, bb, t = (np.empty((rows, dim)) for _ in range(4))
    for i in range(0, n, step):
        k = min(step, n - i)
        if k < rows:
            p, s, bb, t = p[:k], s[:k], bb[:k], t[:k]
        scale = meta[i : i + k, 0:1].astype(np.float64)
        bias = meta[i : i + k, 1:2].astype(np.float64)
        np.copyto(p, e[i : i + k, :dim])
        # float64 never overflows here (|scale|, |bias| < 2**128, q < 256); only damaged (non-finite)
        # scales or biases make inf - inf, and those decode to NaN or inf as in the kernel
        with np.errstate(all="ignore"):
            np.multiply(p, scale, out=p)  # exact: 24-bit significand x 8-bit level
            np.add(p, bias, out=s)
            # TwoSum: the add's exact rounding error t = (p - (s - bb)) + (bias - bb), bb = s - p
            np.subtract(s, p, out=bb)
            np.subtract(s, bb, out=t)
            np.subtract(p, t, out=t)
            np.subtract(bias, bb, out=bb)
            np.add(t, bb, out=t)
            inexact = (t != 0) & np.isfinite(t)
            # round to odd: a sum rounded away from zero steps back one ulp toward zero (same-sign
            # floats order as their bit patterns), then an inexact sum gets its last bit set
            bits = s.view(np.int64)
            bits -= inexact & (np.signbit(t) != np.signbit(s))
            bits |= inexact
            np.copyto(out[i : i + k], s, casting="same_kind")  # the one rounding to float32
    return out


class _Rowwise(Codec):
    lossless = False
    #: Values per byte of the packed levels.
    per_byte: ClassVar[int]
    #: Bytes of scale + bias at the end of each row.
    meta_bytes: ClassVar[int]
    #: Names of FBGEMM's kernels in ``torch.ops.quantized``.
    _prepack_op: ClassVar[str]
    _unpack_op: ClassVar[str]

    def row_bytes(self, dim: int) -> int:
        return -(-dim // self.per_byte) + self.meta_bytes

    def _encode(self, x: np.ndarray) -> np.ndarray:
        n, dim = x.shape
        pad = -dim % self.per_byte
        if pad:
            padded = np.empty((n, dim + pad), dtype=np.float32)
            padded[:, :dim] = x
            padded[:, dim:] = x[:, dim - 1 : dim]
            x = padded
        torch = _torch()
        return getattr(torch.ops.quantized, self._prepack_op)(_tensor(torch, x)).numpy()

    def _decode(self, e: np.ndarray, dim: int) -> np.ndarray:
        torch = _loaded_torch()
        if torch is None:
            return self._decode_numpy(e, dim)
        return self._decode_kernel(torch, e, dim)

    def _decode_kernel(self, torch, e: np.ndarray, dim: int) -> np.ndarray:
        """FBGEMM's unpack kernel (multi-threaded)."""
        out = getattr(torch.ops.quantized, self._unpack_op)(_tensor(torch, e)).numpy()
        if out.shape[1] != dim:
            out = np.ascontiguousarray(out[:, :dim])
        return out

    def _decode_numpy(self, e: np.ndarray, dim: int, out: np.ndarray | None = None) -> np.ndarray:
        """The same floats as :meth:`_decode_kernel`, without torch (into ``out`` if given)."""
        raise NotImplementedError

    def _decode_into(self, e: np.ndarray, dim: int, out: np.ndarray) -> None:
        torch = _loaded_torch()
        if torch is None:
            self._decode_numpy(e, dim, out)
            return
        # the kernel has no out= form: chunks keep its result in cache on the way into ``out``
        unpack = getattr(torch.ops.quantized, self._unpack_op)
        step = max(1, DECODE_CHUNK_VALUES // dim)
        for i in range(0, e.shape[0], step):
            out[i : i + step] = unpack(_tensor(torch, e[i : i + step])).numpy()[:, :dim]

    def _minmax(self, x: np.ndarray) -> tuple[float, float]:
        return value_range(x)

    def _row_minmax(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        torch = _loaded_torch()
        if torch is None:
            return x.min(axis=1), x.max(axis=1)
        lo, hi = torch.aminmax(_tensor(torch, x), dim=1)
        return lo.numpy(), hi.numpy()


class Int8(_Rowwise):
    """8-bit row-wise uniform quantization with fp32 scale and bias (FBGEMM "fused 8-bit rowwise").

    Layout of one row (``dim + 8`` bytes): ``dim`` uint8 levels ``q`` in column order, then ``scale``
    as IEEE binary32 little-endian, then ``bias`` as binary32 little-endian. ``x̂ = scale * q + bias``.

    Representable rows: every value within ``±2**126`` (≈ ±8.5e37); others fall back to ``fp32``.

    Error bound per value, for a row with minimum ``m``, maximum ``M``, ``d = M - m``::

        |x - x̂| <= d / 510 + min(d, 1e-8) + 2**-20 * (|m| + |M|)

    (half a level; FBGEMM's ``1e-8`` range guard; fp32 rounding of the scale, the level arithmetic and
    the decode.) Constant rows decode exactly.
    """

    name = "int8"
    codec_id = 3  # on disk: never renumber
    decode_bytes_per_s = 4e9  # FBGEMM (3.6-4.7 GB/s measured)
    fallback = "fp32"
    per_byte = 1
    meta_bytes = 8
    _range_hint = "int8 holds rows within ±2**126 (≈ ±8.5e37) only; use the fp32 codec for such rows"
    _prepack_op = "embedding_bag_byte_prepack"
    _unpack_op = "embedding_bag_byte_unpack"

    def _decode_numpy(self, e: np.ndarray, dim: int, out: np.ndarray | None = None) -> np.ndarray:
        return decode_int8(e, dim, out)

    def _unrepresentable_range(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        return np.maximum(-lo, hi) > INT8_MAX_ABS


class _NBit(_Rowwise):
    decode_bytes_per_s = 0.8e9  # FBGEMM (int4: 0.5 GB/s at dim 16, 1.8-2.0 at 64-128; int2: 0.35-1.1)
    """Row-wise uniform quantization with fp16 scale and bias (FBGEMM "fused n-bit rowwise SBHalf")."""

    bits: ClassVar[int]
    fallback = "int8"
    meta_bytes = 4

    def _decode_numpy(self, e: np.ndarray, dim: int, out: np.ndarray | None = None) -> np.ndarray:
        return decode_uniform(e, dim, self.bits, out)

    def _unrepresentable_range(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        # fp16 bias and scale: every value within fp16's range, and the scale FBGEMM computes finite.
        # (For bits >= 2 the second test follows from the first; kept for the general rule.)
        with np.errstate(over="ignore", invalid="ignore"):
            bias = lo.astype(np.float16).astype(np.float32)
            scale = ((hi - bias) / np.float32((1 << self.bits) - 1)).astype(np.float16)
        return (np.maximum(-lo, hi) > FP16_MAX) | np.isinf(scale)


_NBIT_BOUND = """
    Representable rows: every value within ``±65504`` (fp16's range, for the bias) and an fp16-finite
    scale; others fall back to ``int8``.

    Error bound per value, for a row with minimum ``m``, maximum ``M``, ``d = M - m``, ``L = {L}``, and
    ``u(t) = max(|t| * 2**-11, 2**-25)`` the largest fp16 rounding error at ``t``::

        |x - x̂| <= d / (2L) + (1 + 1/(2L)) * u(m) + (L + 1) * u(d/L + u(m)) + 2**-20 * (|m| + |M|)

    Half a level; the fp16 rounding of the bias (values between ``m`` and a bias rounded above it clamp
    to level 0); the fp16 rounding of the scale, times up to ``L`` levels (values past the top of a
    scale rounded down clamp to level ``L``); fp32 arithmetic. Constant fp16-representable rows decode
    exactly.
"""


class Int4(_NBit):
    name = "int4"
    codec_id = 4  # on disk: never renumber
    bits = 4
    per_byte = 2
    _range_hint = (
        "int4 holds rows within ±65504 only (fp16 scale and bias); use the int8 or fp32 codec for such rows"
    )
    _prepack_op = "embedding_bag_4bit_prepack"
    _unpack_op = "embedding_bag_4bit_unpack"
    __doc__ = (
        """4-bit row-wise uniform quantization with fp16 scale and bias.

    Layout of one row (``ceil(dim/2) + 4`` bytes): levels packed two per byte, value ``j`` in byte
    ``j // 2``, low nibble for even ``j``, high nibble for odd ``j`` (for odd ``dim`` the last high
    nibble repeats the last value's level); then ``scale`` as IEEE binary16 little-endian, then
    ``bias`` as binary16 little-endian. ``x̂ = float32(scale) * q + float32(bias)``.
"""
        + _NBIT_BOUND.format(L=15)
    )


class Int2(_NBit):
    name = "int2"
    codec_id = 5  # on disk: never renumber
    bits = 2
    per_byte = 4
    _range_hint = (
        "int2 holds rows within ±65504 only (fp16 scale and bias); use the int8 or fp32 codec for such rows"
    )
    _prepack_op = "embedding_bag_2bit_prepack"
    _unpack_op = "embedding_bag_2bit_unpack"
    __doc__ = (
        """2-bit row-wise uniform quantization with fp16 scale and bias.

    Layout of one row (``ceil(dim/4) + 4`` bytes): levels packed four per byte, value ``j`` in byte
    ``j // 4`` at bits ``2 * (j % 4)`` and ``2 * (j % 4) + 1`` (least significant pair first; padding
    pairs of the last byte repeat the last value's level); then ``scale`` as IEEE binary16
    little-endian, then ``bias`` as binary16 little-endian. ``x̂ = float32(scale) * q + float32(bias)``.
"""
        + _NBIT_BOUND.format(L=3)
    )
