"""Row-wise asymmetric uniform quantization at any width 1..8 bits, packed tightly; numpy only.

Codecs ``int1``, ``int3``, ``int5``, ``int6`` and ``int7`` (``int2``/``int4``/``int8`` run on FBGEMM's
kernels, see ``rowwise.py``). Quantization is FBGEMM's "fused n-bit rowwise SBHalf" rule, computed
the same way step by step, so that at 4 and 2 bits :func:`quantize` gives FBGEMM's levels, scale and
bias bit for bit (but for the sign of a zero bias, below). Per row with float32 minimum ``m`` and
maximum ``M`` and ``L = 2**bits - 1``:

- ``bias = fp16(m)`` (round to nearest even, so it may lie above ``m``; a minimum of ``-0.0`` gives
  ``+0.0``, where FBGEMM stores whichever zero its reduction found, and both decode alike);
- ``scale = fp16(float32(M - float32(bias)) / L)``, replaced by 1.0 when it is 0 (constant rows, and
  rows whose ``(M - bias) / L`` underflows fp16); negative when the bias rounded above ``M``;
- ``q = clamp(rint((x - bias) * float32(1 / scale)), 0, L)`` in float32, ``rint`` rounding half to
  even (FBGEMM multiplies by the inverse; it does not divide by the scale);
- ``x̂ = float32(scale) * q + float32(bias)``: ``scale * q`` is exact in float32 (an 11-bit fp16
  significand times a level of at most 8 bits), so only the add rounds, and FBGEMM's decode (fused
  or not) gives the same floats.

Levels are packed as one little-endian bitstream per row: value ``j`` occupies bits
``[j*bits, (j+1)*bits)``, bit ``i`` of the stream being bit ``i % 8`` (0 = least significant) of byte
``i // 8``. At 4 and 2 bits this is FBGEMM's nibble / bit-pair order. The stream is padded with zero
bits to a whole byte. Packing works on groups of 8 levels (``bits`` bytes) as one little-endian
uint64, squeezed or spread with three SWAR shift-and-mask steps.
"""

from __future__ import annotations

import functools
from typing import ClassVar

import numpy as np

from cnrstore.codecs.base import Codec
from cnrstore.codecs.lossless import FP16_MAX
from cnrstore.errors import InvalidArgument

__all__ = ["Int1", "Int3", "Int5", "Int6", "Int7", "quantize", "pack_levels", "unpack_levels",
           "encode_uniform", "decode_uniform", "uniform_row_bytes"]

#: Rows processed per inner step: small enough that the float32 temporaries stay in L2 cache.
_CHUNK_VALUES = 1 << 16
_U64 = np.dtype("<u8")


def _check_bits(bits: int) -> int:
    if isinstance(bits, bool) or not (isinstance(bits, (int, np.integer)) and 1 <= bits <= 8):
        raise InvalidArgument(f"bits must be an integer in 1..8, got {bits!r}")
    return int(bits)


def uniform_row_bytes(dim: int, bits: int) -> int:
    """Bytes of one row: ``ceil(dim * bits / 8)`` of packed levels, then fp16 scale and fp16 bias."""
    return -(-dim * _check_bits(bits) // 8) + 4


def qparams(lo: np.ndarray, hi: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """FBGEMM's per-row ``(scale, bias)`` as float16 arrays, from float32 row minima and maxima."""
    levels = np.float32((1 << _check_bits(bits)) - 1)
    with np.errstate(over="ignore", invalid="ignore"):  # only rows past fp16's range (unchecked)
        # + 0.0 turns a minimum of -0.0 into +0.0: which zero a reduction returns for a row holding
        # both is unspecified (SIMD order), and a row's bytes must not depend on where it lies.
        bias = (lo.astype(np.float32) + np.float32(0.0)).astype(np.float16)
        span = hi.astype(np.float32) - bias.astype(np.float32)
        scale = (span / levels).astype(np.float16)
    # scale 0 (a constant row, or (M - bias) / L below half fp16's smallest subnormal): FBGEMM uses
    # 1.0, which maps every value of such a row to level 0, i.e. to the bias. 1/scale is finite for
    # every other fp16 scale (the smallest subnormal gives 2**24): FBGEMM's inf-inverse guard never fires.
    scale[scale == 0] = np.float16(1.0)
    return scale, bias


def quantize(x: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Levels uint8 ``(n, dim)`` and fp16 ``scale``, ``bias`` ``(n,)`` of float32 rows ``x``.

    Equal to FBGEMM's at ``bits`` 2 and 4 (its levels, scale and bias, bit for bit, but that a zero
    bias is always +0.0)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    n, dim = x.shape
    q = np.empty((n, dim), dtype=np.uint8)
    scale = np.empty(n, dtype=np.float16)
    bias = np.empty(n, dtype=np.float16)
    step = max(1, _CHUNK_VALUES // dim)
    buf = np.empty((min(step, n), dim), dtype=np.float32)
    for i in range(0, n, step):
        xs = x[i : i + step]
        k = len(xs)
        s, b = qparams(xs.min(axis=1), xs.max(axis=1), bits)
        scale[i : i + k], bias[i : i + k] = s, b
        _levels(xs, s, b, bits, buf[:k], q[i : i + k])
    return q, scale, bias


def _levels(xs, scale16, bias16, bits, buf, out) -> None:
    """``out[:] = clamp(rint((xs - bias) * (1/scale)), 0, L)``, float32 as FBGEMM computes it."""
    inv = np.float32(1.0) / scale16.astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):  # unchecked rows past fp16's range: garbage in
        np.subtract(xs, bias16.astype(np.float32)[:, None], out=buf)
        np.multiply(buf, inv[:, None], out=buf)
        np.rint(buf, out=buf)
        np.clip(buf, 0, (1 << bits) - 1, out=buf)
        np.copyto(out, buf, casting="unsafe")


# -- bit packing ------------------------------------------------------------------------------------------
# A group of 8 levels sits in one uint64, level k in byte k. Squeezing moves the odd byte of each
# 16-bit lane down next to the even one, then the odd 2-level field of each 32-bit lane, then the upper
# 4-level field: 8 * bits contiguous bits, i.e. the group's ``bits`` bytes of the bitstream. Spreading
# is the same three steps backwards.

@functools.lru_cache(maxsize=None)
def _swar_steps(bits: int) -> tuple[tuple[np.uint64, np.uint64, np.uint64, np.uint64], ...]:
    """Per step (16-, 32-, 64-bit lanes): (shift, mask of each lane's upper half, mask of a field at
    the bottom of each lane, the same field mask at the lane's upper half)."""
    steps = []
    for lane, field in ((16, bits), (32, 2 * bits), (64, 4 * bits)):
        half = lane // 2
        starts = range(0, 64, lane)
        upper = sum(((1 << half) - 1) << (s + half) for s in starts)
        low = sum(((1 << field) - 1) << s for s in starts)
        steps.append((np.uint64(half - field), np.uint64(upper), np.uint64(low), np.uint64(low << half)))
    return tuple(steps)


def _squeeze(v: np.ndarray, bits: int) -> np.ndarray:
    tmp = np.empty_like(v)
    for shift, upper, _, _ in _swar_steps(bits):
        np.bitwise_and(v, upper, out=tmp)  # the upper field of each lane
        np.bitwise_xor(v, tmp, out=v)  # leaves the lower one
        np.right_shift(tmp, shift, out=tmp)  # upper field right after the lower one
        np.bitwise_or(v, tmp, out=v)
    return v


def _spread(v: np.ndarray, bits: int) -> np.ndarray:
    tmp = np.empty_like(v)
    for shift, _, low, low_up in reversed(_swar_steps(bits)):
        np.left_shift(v, shift, out=tmp)  # the field's upper part to the lane's upper half
        np.bitwise_and(tmp, low_up, out=tmp)
        np.bitwise_and(v, low, out=v)
        np.bitwise_or(v, tmp, out=v)
    return v


def pack_levels(q: np.ndarray, bits: int) -> np.ndarray:
    """Pack uint8 levels ``(n, dim)``, each ``< 2**bits``, into ``(n, ceil(dim * bits / 8))`` bytes."""
    bits = _check_bits(bits)
    q = np.asarray(q, dtype=np.uint8)
    n, dim = q.shape
    nbytes = -(-dim * bits // 8)
    out = np.empty((n, nbytes), dtype=np.uint8)
    step = max(1, _CHUNK_VALUES // dim)
    groups = -(-dim // 8)
    grouped = np.zeros((min(step, n), groups * 8), dtype=np.uint8)
    for i in range(0, n, step):
        qs = q[i : i + step]
        k = len(qs)
        grouped[:k, :dim] = qs
        _pack_chunk(grouped[:k], bits, out[i : i + k])
    return out


@functools.lru_cache(maxsize=None)
def _group_bytes(bits: int) -> np.dtype:
    """A view of a uint64 that exposes its first ``bits`` bytes as one opaque item: copying those is a
    memcpy per group, not a ``bits``-long inner loop per group."""
    return np.dtype({"names": ["b"], "formats": [f"V{bits}"], "offsets": [0], "itemsize": 8})


def _pack_chunk(grouped: np.ndarray, bits: int, out: np.ndarray) -> None:
    """``grouped``: uint8 ``(k, 8 * groups)`` levels, zero past ``dim`` (squeezed in place: its contents
    are garbage after the call); fills ``out`` ``(k, nbytes)``, whose last axis is contiguous."""
    k = len(grouped)
    groups = grouped.shape[1] // 8
    nbytes = out.shape[1]
    if bits == 8:
        out[:] = grouped[:, :nbytes]
        return
    v = _squeeze(grouped.view(_U64), bits)
    packed = v.view(_group_bytes(bits))["b"]  # (k, groups) items of `bits` bytes
    if nbytes == groups * bits:
        out.view(f"V{bits}")[:] = packed
    else:  # the last group's trailing bytes hold only padding bits
        tmp = np.empty((k, groups * bits), dtype=np.uint8)
        tmp.view(f"V{bits}")[:] = packed
        out[:] = tmp[:, :nbytes]


def unpack_levels(packed: np.ndarray, dim: int, bits: int) -> np.ndarray:
    """Inverse of :func:`pack_levels`: uint8 ``(n, ceil(dim * bits / 8))`` -> levels ``(n, dim)``."""
    bits = _check_bits(bits)
    packed = np.ascontiguousarray(packed, dtype=np.uint8)
    n = packed.shape[0]
    q = np.empty((n, dim), dtype=np.uint8)
    step = max(1, _CHUNK_VALUES // dim)
    for i in range(0, n, step):
        ps = packed[i : i + step]
        q[i : i + len(ps)] = _unpack_chunk(ps, dim, bits)
    return q


def _unpack_chunk(ps: np.ndarray, dim: int, bits: int) -> np.ndarray:
    """``ps``: packed ``(k, nbytes)`` with a contiguous last axis. Returns ``(k, dim)`` levels (a view
    of new memory)."""
    k, nbytes = ps.shape
    if bits == 8:
        return ps[:, :dim]
    groups = -(-dim // 8)
    if nbytes != groups * bits:  # pad the stream to whole groups
        flat = np.zeros((k, groups * bits), dtype=np.uint8)
        flat[:, :nbytes] = ps
        ps = flat
    v = np.zeros((k, groups), dtype=_U64)
    v.view(_group_bytes(bits))["b"] = ps.view(f"V{bits}")
    return _spread(v, bits).view(np.uint8)[:, :dim]


# -- whole rows -------------------------------------------------------------------------------------------

def encode_uniform(x: np.ndarray, bits: int) -> np.ndarray:
    """Encode float32 ``(n, dim)`` rows at ``bits`` bits: packed levels, fp16 scale, fp16 bias per row.

    Unchecked: the caller has rejected NaN, infinities and rows past fp16's range."""
    bits = _check_bits(bits)
    x = np.ascontiguousarray(x, dtype=np.float32)
    n, dim = x.shape
    nbytes = -(-dim * bits // 8)
    out = np.empty((n, nbytes + 4), dtype=np.uint8)
    step = max(1, _CHUNK_VALUES // dim)
    groups = -(-dim // 8)
    rows = min(step, n)
    buf = np.empty((rows, dim), dtype=np.float32)
    grouped = np.zeros((rows, groups * 8), dtype=np.uint8)
    meta = out[:, nbytes:].view("<f2")  # (n, 2): scale, bias (unaligned where nbytes is odd: fine)
    for i in range(0, n, step):
        xs = x[i : i + step]
        k = len(xs)
        scale, bias = qparams(xs.min(axis=1), xs.max(axis=1), bits)
        if dim % 8:
            grouped[:k, dim:] = 0  # packing squeezed the previous chunk's in place
        _levels(xs, scale, bias, bits, buf[:k], grouped[:k, :dim])
        _pack_chunk(grouped[:k], bits, out[i : i + k, :nbytes])
        meta[i : i + k, 0] = scale
        meta[i : i + k, 1] = bias
    return out


def decode_uniform(enc: np.ndarray, dim: int, bits: int, out: np.ndarray | None = None) -> np.ndarray:
    """Decode ``(n, uniform_row_bytes(dim, bits))`` uint8 rows into float32 ``(n, dim)``: into ``out``
    (float32 ``(n, dim)``, C-contiguous; returned) if given, else a new array. Temporaries: one chunk."""
    bits = _check_bits(bits)
    n = enc.shape[0]
    nbytes = -(-dim * bits // 8)
    if out is None:
        out = np.empty((n, dim), dtype=np.float32)
    step = max(1, _CHUNK_VALUES // dim)
    enc = np.ascontiguousarray(enc, dtype=np.uint8)
    meta = enc[:, nbytes:].view("<f2")  # (n, 2): scale, bias
    for i in range(0, n, step):
        es = enc[i : i + step]
        k = len(es)
        scale = meta[i : i + k, 0:1].astype(np.float32)  # (k, 1)
        bias = meta[i : i + k, 1:2].astype(np.float32)
        q = _unpack_chunk(es[:, :nbytes], dim, bits)
        o = out[i : i + k]
        np.copyto(o, q)  # one plain cast: a mixed uint8 x float32 ufunc would go through buffering
        np.multiply(o, scale, out=o)  # exact: fp16 significand x level < 2**24
        np.add(o, bias, out=o)
    return out


# -- codecs -----------------------------------------------------------------------------------------------

class _Uniform(Codec):
    """Row-wise uniform quantization with fp16 scale and bias at ``bits`` bits, packed tightly."""

    bits: ClassVar[int]
    lossless = False
    fallback = "int8"
    decode_bytes_per_s = 0.35e9  # numpy unpacking (0.17 GB/s at int1 to 0.7 at int7 measured)

    def row_bytes(self, dim: int) -> int:
        return uniform_row_bytes(dim, self.bits)

    def _encode(self, x: np.ndarray) -> np.ndarray:
        return encode_uniform(x, self.bits)

    def _decode(self, e: np.ndarray, dim: int) -> np.ndarray:
        return decode_uniform(e, dim, self.bits)

    def _decode_into(self, e: np.ndarray, dim: int, out: np.ndarray) -> None:
        decode_uniform(e, dim, self.bits, out)

    def _unrepresentable_range(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        # fp16 bias and scale: every value within fp16's range, and a finite fp16 scale. The second
        # test matters at 1 bit only (scale = M - bias can reach 2 * 65504); it is monotone, as the
        # scale grows with hi and shrinks as lo (hence the rounded bias) grows.
        lo = np.asarray(lo, dtype=np.float32)
        hi = np.asarray(hi, dtype=np.float32)
        with np.errstate(over="ignore", invalid="ignore"):
            scale, _ = qparams(lo, hi, self.bits)
        return (np.maximum(-lo, hi) > FP16_MAX) | ~np.isfinite(scale)


def _doc(bits: int, summary: str, extra: str = "") -> str:
    L = (1 << bits) - 1
    where = "at bit ``j``" if bits == 1 else f"at bits ``[{bits}j, {bits}j + {bits})``"
    return f"""{summary}

    Layout of one row (``ceil(dim * {bits} / 8) + 4`` bytes): the levels ``q`` in ``[0, {L}]`` as a
    little-endian bitstream, value ``j`` {where}, bit ``i`` of the stream being bit
    ``i % 8`` (least significant first) of byte ``i // 8``, zero bits padding the last byte; then
    ``scale`` as IEEE binary16 little-endian, then ``bias`` as binary16 little-endian.
    ``x̂ = float32(scale) * q + float32(bias)``. Quantization as FBGEMM's n-bit rule (module docstring).

    Representable rows: every value within ``±65504`` (fp16's range, for the bias) and an fp16-finite
    scale{extra}; others fall back to ``int8``.

    Error bound per value, for a row with minimum ``m``, maximum ``M``, ``d = M - m``, ``L = {L}``, and
    ``u(t) = max(|t| * 2**-11, 2**-25)`` the largest fp16 rounding error at ``t``::

        |x - x̂| <= d / (2L) + (1 + 1/(2L)) * u(m) + (L + 1) * u(d/L + u(m)) + 2**-20 * (|m| + |M|)

    Half a level; the fp16 rounding of the bias (values between ``m`` and a bias rounded above it clamp
    to level 0); the fp16 rounding of the scale, times up to ``L`` levels (values past the top of a
    scale rounded down clamp to level ``L``); fp32 arithmetic. Constant fp16-representable rows decode
    exactly.
    """


def _hint(name: str, extra: str = "") -> str:
    return (f"{name} holds rows within ±65504{extra} only (fp16 scale and bias); use the int8 or fp32 codec "
            "for such rows")


class Int1(_Uniform):
    name = "int1"
    codec_id = 6  # on disk: never renumber
    bits = 1
    _range_hint = _hint("int1", " with max - min < 65520")
    __doc__ = _doc(1, "1-bit row-wise uniform quantization: each value to the nearer end of its row's range.",
                   " (at 1 bit the scale is\n    ``M - bias``, so rows with ``M - fp16(m) >= 65520`` are refused)")


class Int3(_Uniform):
    name = "int3"
    codec_id = 7  # on disk: never renumber
    bits = 3
    _range_hint = _hint("int3")
    __doc__ = _doc(3, "3-bit row-wise uniform quantization with fp16 scale and bias.")


class Int5(_Uniform):
    name = "int5"
    codec_id = 8  # on disk: never renumber
    bits = 5
    _range_hint = _hint("int5")
    __doc__ = _doc(5, "5-bit row-wise uniform quantization with fp16 scale and bias.")


class Int6(_Uniform):
    name = "int6"
    codec_id = 9  # on disk: never renumber
    bits = 6
    _range_hint = _hint("int6")
    __doc__ = _doc(6, "6-bit row-wise uniform quantization with fp16 scale and bias.")


class Int7(_Uniform):
    name = "int7"
    codec_id = 10  # on disk: never renumber
    bits = 7
    _range_hint = _hint("int7")
    __doc__ = _doc(7, "7-bit row-wise uniform quantization with fp16 scale and bias.")
