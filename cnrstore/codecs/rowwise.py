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
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import torch

from cnrstore.codecs.base import Codec
from cnrstore.codecs.lossless import FP16_MAX

__all__ = ["Int8", "Int4", "Int2"]

_ops = torch.ops.quantized

#: int8 rows must stay within this magnitude: then ``M - m`` is finite and so is every decoded value
#: (past it, ``scale * 255 + bias`` can round up to inf even though ``M - m`` is finite).
INT8_MAX_ABS = 2.0**126


def _tensor(a: np.ndarray) -> torch.Tensor:
    # DLPack shares the memory and, unlike from_numpy, accepts read-only arrays (mmap views) without
    # a warning; the kernels only read their input.
    return torch.from_dlpack(a)


def value_range(x: np.ndarray) -> tuple[float, float]:
    """Global (min, max) of a non-empty float32 array in one multi-threaded pass; NaN if any is NaN."""
    lo, hi = torch.aminmax(_tensor(x))
    return lo.item(), hi.item()


class _Rowwise(Codec):
    lossless = False
    #: Values per byte of the packed levels.
    per_byte: ClassVar[int]
    #: Bytes of scale + bias at the end of each row.
    meta_bytes: ClassVar[int]

    @staticmethod
    def _prepack(t: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    @staticmethod
    def _unpack(t: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

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
        return self._prepack(_tensor(x)).numpy()

    def _decode(self, e: np.ndarray, dim: int) -> np.ndarray:
        out = self._unpack(_tensor(e)).numpy()
        if out.shape[1] != dim:
            out = np.ascontiguousarray(out[:, :dim])
        return out

    def _minmax(self, x: np.ndarray) -> tuple[float, float]:
        return value_range(x)

    def _row_minmax(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        lo, hi = torch.aminmax(_tensor(x), dim=1)
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
    fallback = "fp32"
    per_byte = 1
    meta_bytes = 8
    _range_hint = "int8 holds rows within ±2**126 (≈ ±8.5e37) only; use the fp32 codec for such rows"
    _prepack = staticmethod(_ops.embedding_bag_byte_prepack)
    _unpack = staticmethod(_ops.embedding_bag_byte_unpack)

    def _unrepresentable_range(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        return np.maximum(-lo, hi) > INT8_MAX_ABS


class _NBit(_Rowwise):
    """Row-wise uniform quantization with fp16 scale and bias (FBGEMM "fused n-bit rowwise SBHalf")."""

    bits: ClassVar[int]
    fallback = "int8"
    meta_bytes = 4

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
    _prepack = staticmethod(_ops.embedding_bag_4bit_prepack)
    _unpack = staticmethod(_ops.embedding_bag_4bit_unpack)
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
    _prepack = staticmethod(_ops.embedding_bag_2bit_prepack)
    _unpack = staticmethod(_ops.embedding_bag_2bit_unpack)
    __doc__ = (
        """2-bit row-wise uniform quantization with fp16 scale and bias.

    Layout of one row (``ceil(dim/4) + 4`` bytes): levels packed four per byte, value ``j`` in byte
    ``j // 4`` at bits ``2 * (j % 4)`` and ``2 * (j % 4) + 1`` (least significant pair first; padding
    pairs of the last byte repeat the last value's level); then ``scale`` as IEEE binary16
    little-endian, then ``bias`` as binary16 little-endian. ``x̂ = float32(scale) * q + float32(bias)``.
"""
        + _NBIT_BOUND.format(L=3)
    )
