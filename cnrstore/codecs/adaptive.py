"""Row-wise uniform quantization with a searched clipping range (``adaptive2``, ``adaptive3``,
``adaptive4``); numpy only, vectorized across rows.

Check-N-Run quantizes each row on a range narrower than ``[min, max]`` when that lowers the row's L2
error: a few extreme values are clipped, every other value gets a finer grid. FBGEMM implements their
greedy search (``embedding_bag_4bit_prepack(w, True, 200, 0.16)``: shrink ``[min, max]`` by
``(max - min) / 200`` from whichever end lowers the error, 32 steps, two full quantizations a step,
keep the best local optimum) one row at a time, at ~15 MB/s. Most of what that search wins beyond the
right amount of clipping is luck in where the grid falls among the row's values: with 64 values on 16
levels, nudging the grid by a fraction of a step changes the rounding error by several percent. This
module finds both directly, for all rows at once:

1. **Full range**: FBGEMM's plain parameters (those of ``int2``/``int3``/``int4``) and their exact
   error: the fallback that makes no row worse than the uniform codec.
2. **Clipping range** (:func:`_clip_range`): the ``[lo, hi]`` where the clipping error of the values
   beyond each end balances the rounding error inside, ``sum_{x > hi} (x - hi) = dim * s / (12 L)``
   with ``s = (hi - lo) / L`` (and likewise at ``lo``): the stationary point of
   ``sum_{clipped} (x - end)**2 + dim * s**2 / 12``. Solved on each row's sorted tails.
3. **Grid offset**: at that scale ``s``, the offset of the grid with the least rounding error, over
   all offsets at once. The squared distance of ``v`` to the nearest grid point is a periodic function
   of ``v``; the first two terms of its Fourier series, summed over the row, need four sums per row
   (``sum cos(2 pi v)``, ``sum sin(2 pi v)`` and the same at twice the frequency) and then give the
   error at every offset; 16 offsets per grid step are compared (8 below 64 values a row).
4. **Least-squares polish**: with that grid's levels ``q`` fixed, the ``(bias, scale)`` minimizing
   ``sum((x - bias - scale * q)**2)`` is a linear fit in closed form; re-quantizing with it can only
   lower the error further (one Lloyd step of a uniform quantizer).

The polished parameters are rounded to fp16, the levels computed against the rounded values, the
exact decoded error measured, and the polished row replaces the full-range one only where that error
is lower by more than float32 summation error could account for. So a row's decoded L2 error is at
most the uniform codec's at the same width.

Measured on embedding-like rows (Gaussian, Student-t and Laplace rows, rows with an outlier), the mean
L2 error at 4 bits is within 0.8% of FBGEMM's greedy search at dims 64 to 512 (usually within 0.5%)
and 1-3% below it at dims 16 and 32; at 2 bits it is ~30% below (FBGEMM's search stops at a 16%
shrink, far from the best range at 2 bits). Single-threaded encoding runs at ~330 MB/s, 20-26x
FBGEMM's search. The rows are processed in chunks, rows as columns so that numpy's loops run along
the chunk; each thread keeps the chunk's scratch memory (~10 MB) for its next call.
"""

from __future__ import annotations

import threading
from typing import ClassVar

import numpy as np

from cnrstore.codecs.base import Codec
from cnrstore.codecs.lossless import FP16_MAX
from cnrstore.codecs.nbit import decode_uniform, uniform_row_bytes
from cnrstore.codecs.rowwise import Int2, Int4

__all__ = ["Adaptive2", "Adaptive3", "Adaptive4", "search", "round_fp16", "uniform_qparams", "pack_columns_into",
           "Workspace", "GROUPS"]

#: Fraction of a row's values, per width, among which the clipping range looks for the values to clip
#: at each end (at least 2, at most all): enough for embedding-like rows, where the optimum clips
#: ~1 value of 64 and ~6 of 1024 at each end at 4 bits, ~4 of 64 and ~65 of 1024 at 2 bits.
_TAIL = {2: 1 / 4, 3: 1 / 8, 4: 1 / 16}
#: Fixed-point iterations of the clipping range.
_RANGE_ITERS = 4
#: Grid offsets compared (on the Fourier approximation) per grid step: 16, or 8 for rows of fewer
#: than 64 values (whose rounding error varies less smoothly with the offset anyway).
_PHASES = 16
#: Values per chunk: large enough to amortize numpy's per-call overhead over a dozen ``(dim, rows)``
#: temporaries (about 10 MB with the sort buffer).
_CHUNK_VALUES = 1 << 18



def _phase_table(phases: int) -> tuple[np.ndarray, np.ndarray]:
    """Offsets ``t`` (grid steps) and the ``(phases, 4)`` weights of ``(c1, s1, c2, s2)`` giving
    ``pi**2 * error(t)`` up to a constant: ``-(c1 cos a + s1 sin a) + (c2 cos 2a + s2 sin 2a) / 4``,
    ``a = 2 pi t``."""
    t = (np.arange(phases) / phases - 0.5).astype(np.float32)
    a = 2 * np.pi * t.astype(np.float64)
    return t, np.stack([-np.cos(a), -np.sin(a), 0.25 * np.cos(2 * a), 0.25 * np.sin(2 * a)], axis=1).astype(np.float32)


_PHASE_TABLES = {p: _phase_table(p) for p in (8, _PHASES)}
_TWO_PI = np.float32(2 * np.pi)
_F16_MIN_NORMAL = np.float32(2.0**-14)


def round_fp16(a: np.ndarray) -> np.ndarray:
    """float32 -> the nearest fp16 value (ties to even; past ±65504 -> ±inf), still as float32.

    Equal to ``a.astype(np.float16).astype(np.float32)`` for finite ``a``, at a fraction of its cost:
    normal fp16 values by rounding away the low 13 significand bits, subnormal ones by adding and
    subtracting ``0.5`` (whose float32 spacing is fp16's subnormal step ``2**-24``)."""
    a = np.asarray(a, dtype=np.float32)
    bits = a.view(np.uint32)
    r = bits >> np.uint32(13)
    r &= np.uint32(1)
    r += np.uint32(0x0FFF)
    r += bits
    r &= np.uint32(0xFFFFE000)
    out = r.view(np.float32)
    mag = np.abs(a)
    small = mag < _F16_MIN_NORMAL
    if small.any():
        out = np.where(small, np.copysign((mag + np.float32(0.5)) - np.float32(0.5), a), out)
    big = np.abs(out) > np.float32(FP16_MAX)  # (NaN compares False: NaN stays NaN)
    if big.any():
        out = np.where(big, np.copysign(np.float32(np.inf), a), out)
    return out


def uniform_qparams(lo: np.ndarray, hi: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """FBGEMM's n-bit ``(scale, bias)`` from float32 row minima and maxima, as float32 arrays holding
    fp16 values (as :func:`cnrstore.codecs.nbit.qparams`, whose rule and ``-0.0`` handling this
    follows): ``bias = fp16(lo)``, ``scale = fp16((hi - bias) / L)``, a zero scale replaced by 1."""
    with np.errstate(over="ignore", invalid="ignore"):
        bias = round_fp16(lo + np.float32(0.0))
        scale = round_fp16((hi - bias) / np.float32((1 << bits) - 1))
    scale[scale == 0] = 1.0
    return scale, bias


def _levels(xt, scale, bias, L, out):
    """``out[:] = clamp(rint((x - bias) * (1 / scale)), 0, L)`` in float32 (FBGEMM's rule), rows as
    columns: ``xt`` is ``(dim, k)``, ``scale``/``bias`` float32 ``(k,)`` holding fp16 values."""
    np.subtract(xt, bias, out=out)
    np.multiply(out, np.float32(1.0) / scale, out=out)
    np.rint(out, out=out)  # half to even, as FBGEMM's lrintf
    return np.clip(out, 0, L, out=out)


def _sq_error(xt, q, scale, bias, tmp):
    """Per-column ``sum((x - x̂)**2)`` (float32 ``(k,)``) with ``x̂ = scale * q + bias`` computed exactly
    as decoding does (``scale * q`` is exact); ``tmp`` is scratch. numpy sums each column in order
    down axis 0, whatever the other columns."""
    np.multiply(q, scale, out=tmp)
    np.add(tmp, bias, out=tmp)
    np.subtract(xt, tmp, out=tmp)
    return np.einsum("dk,dk->k", tmp, tmp)


def _clip_range(ends, lo, hi, dim, L):
    """Per column, the clipping range ``[lo, hi]`` (module docstring, step 2) from ``ends``: the
    ``tail`` largest values, descending, and the negated ``tail`` smallest, as ``(2, tail, k)``.

    ``g(e) = sum (v - e)`` over the values ``v >= e`` is convex and piecewise linear in ``e``, so
    Newton's method, ``e = (sum of the v >= e - target) / #(v >= e)``, reaches the root of
    ``g(e) = target`` from the left in a few steps. The target ``c * (hi - lo)`` is taken from the
    full range first (the largest it gets), then from the current ends: it only shrinks, so the
    iterates only move outwards, to the fixed point. (``#(v >= e) >= 1`` throughout: each iterate is
    at most the mean of the values at or above the previous one.)"""
    c = np.float32(dim / (12.0 * L * L))  # the excess beyond an end that balances: c * (hi - lo)
    e = ends[:, -1].copy()  # start left of the root: at the tail's last value
    target = c * (hi - lo)
    mask = np.empty(ends.shape, dtype=np.float32)
    for _ in range(_RANGE_ITERS):
        np.greater_equal(ends, e[:, None, :], out=mask, casting="unsafe")
        e = np.einsum("etk,etk->ek", ends, mask)
        e -= target
        e /= mask.sum(axis=1)
        target = c * (e[0] + e[1])
    return -e[1], e[0]


def _fit(u, q, dim):
    """Least-squares ``(slope, intercept)`` (float32 ``(k,)``) of ``u ≈ intercept + slope * q`` per
    column, and whether the fit is usable (``u`` in grid steps: sums of the order of ``dim * L**2``)."""
    sq = q.sum(axis=0).astype(np.float64)  # integers below 2**24: exact
    su = u.sum(axis=0).astype(np.float64)
    var = np.einsum("dk,dk->k", q, q).astype(np.float64) - sq * sq / dim
    cov = np.einsum("dk,dk->k", u, q).astype(np.float64) - su * sq / dim
    with np.errstate(divide="ignore", invalid="ignore"):
        slope = cov / var
        icpt = (su - slope * sq) / dim
    ok = (var > 0) & np.isfinite(slope) & np.isfinite(icpt)
    return slope.astype(np.float32), icpt.astype(np.float32), ok


#: Per width: values per packing group (16 or 24 bits, exact as a float32 sum) and its bytes.
GROUPS = {1: (16, 2), 2: (8, 2), 3: (8, 3), 4: (4, 2)}


def pack_columns_into(q, bits, out, pad, acc, w):
    """Pack float32 levels ``q`` (``(dim, k)``, one row per column) into ``out`` (uint8
    ``(k, ceil(dim * bits / 8))``): per row the little-endian bitstream, value ``j`` at bits
    ``[j * bits, (j + 1) * bits)``, zero padding bits. ``pad`` (``(groups * g, k)`` float32), ``acc``
    (``(groups, k)`` float32) and ``w`` (``(groups, k)`` uint32) are scratch."""
    dim, k = q.shape
    g, gbytes = GROUPS[bits]
    groups = acc.shape[0]
    if groups * g != dim:
        pad[dim:] = 0
        pad[:dim] = q
        q = pad
    weights = np.float32(2.0) ** (bits * np.arange(g, dtype=np.float32))
    np.einsum("gjk,j->gk", q.reshape(groups, g, k), weights, out=acc)  # < 2**24: exact in any order
    nbytes = out.shape[1]
    dst = out if nbytes == groups * gbytes else np.empty((k, groups * gbytes), dtype=np.uint8)
    if gbytes == 2:
        np.copyto(dst.view("<u2"), acc.T, casting="unsafe")
    else:
        np.copyto(w, acc, casting="unsafe")
        d3 = dst.reshape(k, groups, 3)
        np.copyto(d3[:, :, 0], w.T, casting="unsafe")  # uint32 -> uint8 keeps the low byte
        w >>= np.uint32(8)
        np.copyto(d3[:, :, 1], w.T, casting="unsafe")
        w >>= np.uint32(8)
        np.copyto(d3[:, :, 2], w.T, casting="unsafe")
    if dst is not out:
        out[:] = dst[:, :nbytes]


class Workspace(threading.local):
    """Per-thread scratch memory, reused across calls: the temporaries of one chunk are a few MB, and
    the page faults of allocating them afresh cost as much as the arithmetic done in them."""

    def __init__(self) -> None:
        self.buf = np.empty(0, dtype=np.uint8)

    def arrays(self, specs):
        """Fresh views, one per ``(shape, dtype)`` in ``specs``, on this thread's scratch memory."""
        # 64-byte aligned, and staggered by an odd number of cache lines so that same-index elements
        # of different arrays do not map to the same cache sets (power-of-two sized arrays would)
        sizes = [(-(-int(np.prod(shape)) * np.dtype(dt).itemsize // 64) + 5) * 64 for shape, dt in specs]
        if self.buf.size < sum(sizes) + 64:
            self.buf = np.empty(sum(sizes) + 64, dtype=np.uint8)
        out, off = [], -self.buf.ctypes.data % 64
        for (shape, dt), size in zip(specs, sizes):
            nb = int(np.prod(shape)) * np.dtype(dt).itemsize
            out.append(self.buf[off : off + nb].view(dt).reshape(shape))
            off += size
        return out


_WORKSPACE = Workspace()


def search(x: np.ndarray, bits: int, out: np.ndarray | None = None, polish: bool = True) -> np.ndarray:
    """Encode float32 rows ``x`` (finite, within fp16's range) at ``bits`` bits by the search in the
    module docstring into ``out`` (uint8 ``(n, uniform_row_bytes(dim, bits))``, allocated if None):
    packed levels, fp16 scale, fp16 bias per row. ``polish=False`` (for experiments only) skips
    step 4."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    n, dim = x.shape
    L = (1 << bits) - 1
    nbytes = -(-dim * bits // 8)
    if out is None:
        out = np.empty((n, nbytes + 4), dtype=np.uint8)
    if n == 0:
        return out
    if n == 1:
        # Chunks hold at least two rows: numpy reduces a single column in a different order (SIMD
        # partial sums) than columns of a wider array, and a row's bytes must not depend on that.
        out[:] = search(np.concatenate([x, x]), bits, polish=polish)[:1]
        return out
    tail = int(min(dim, max(2, np.ceil(dim * _TAIL[bits]))))
    step = max(2, _CHUNK_VALUES // dim)
    rows = min(step, n)
    phase_t, table = _PHASE_TABLES[_PHASES if dim >= 64 else 8]
    g = GROUPS[bits][0]
    f4 = np.float32
    groups = -(-dim // g)
    (xt_buf, qb_buf, q_buf, u_buf, c_buf, s_buf, srt_buf, ends_buf, e_buf, e_tmp_buf, pad_buf, acc_buf, w_buf) = (
        _WORKSPACE.arrays(
            [((dim, rows), f4)] * 6
            + [((rows, dim), f4), ((2, tail, rows), f4)]
            + [((len(phase_t), rows), f4)] * 2
            + [((groups * g, rows), f4), ((groups, rows), f4), ((groups, rows), np.uint32)]
        )
    )
    # A polished row replaces the full-range one only if its error is lower by more than the float32
    # summation error of both sums (relative <= dim * 2**-24 each): "lower" is then true exactly.
    margin = f4(1.0 - 4.0 * dim * 2.0**-24)
    Lf = f4(L)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        for i in range(0, n, step):
            start = i if n - i > 1 else i - 1  # never a chunk of one row (see above)
            xs = x[start : start + step]
            k = len(xs)
            xt, qb, q, u, cb, sn = (b[:, :k] for b in (xt_buf, qb_buf, q_buf, u_buf, c_buf, s_buf))
            ends, e, e_tmp = ends_buf[:, :, :k], e_buf[:, :k], e_tmp_buf[:, :k]
            srt = srt_buf[:k]
            np.copyto(srt, xs)
            srt.sort(axis=1)
            np.copyto(ends[0], srt[:, : dim - tail - 1 if tail < dim else None : -1].T)
            np.negative(srt[:, :tail].T, out=ends[1])
            lo, hi = -ends[1, 0], ends[0, 0].copy()
            np.copyto(xt, xs.T)
            # 1. full range: the uniform codec's parameters, levels and exact error
            sb, bb = uniform_qparams(lo, hi, bits)
            _levels(xt, sb, bb, L, qb)
            eb = _sq_error(xt, qb, sb, bb, sn)
            # 2. clipping range
            clo, chi = _clip_range(ends, lo, hi, dim, L)
            s = (chi - clo) / Lf
            s = np.where(s > 0, s, sb)
            # 3. grid offset at that scale: u = (x - clo) / s in grid steps; cos and sin are periodic,
            # so the phase 2 pi u needs no reduction
            np.subtract(xt, clo, out=u)
            u *= f4(1.0) / s
            np.multiply(u, _TWO_PI, out=sn)
            np.cos(sn, out=cb)
            np.sin(sn, out=sn)
            stats = np.empty((4, k), dtype=f4)
            cb.sum(axis=0, out=stats[0])
            sn.sum(axis=0, out=stats[1])
            np.einsum("dk,dk->k", cb, cb, out=stats[2])  # sum cos 2a = 2 sum cos**2 a - dim
            np.einsum("dk,dk->k", sn, cb, out=stats[3])  # sum sin 2a = 2 sum sin a cos a
            stats[2:] *= f4(2)
            stats[2] -= f4(dim)
            # the error at each offset (phases, k), and the first offset where it is least
            np.multiply(table[:, 0:1], stats[0], out=e)
            for j in range(1, 4):
                np.multiply(table[:, j : j + 1], stats[j], out=e_tmp)
                np.add(e, e_tmp, out=e)
            np.equal(e, e.min(axis=0), out=e_tmp, casting="unsafe")
            t = phase_t[np.argmax(e_tmp, axis=0)]
            # 4. least-squares polish: fit u ≈ a + b * q on the levels of that grid
            np.subtract(u, t, out=q)
            np.rint(q, out=q)
            np.clip(q, 0, L, out=q)
            if polish:
                slope, icpt, ok = _fit(u, q, dim)
                params = round_fp16(np.stack([s * slope, clo + s * icpt]))
            else:
                ok = np.ones(k, dtype=bool)
                params = round_fp16(np.stack([s, clo + s * t]))
            sp, bp = params
            ok &= (sp > 0) & np.isfinite(sp) & np.isfinite(bp)
            if not ok.all():
                sp, bp = np.where(ok, sp, sb), np.where(ok, bp, bb)
            _levels(xt, sp, bp, L, q)
            ep = _sq_error(xt, q, sp, bp, sn)
            keep = ~(ep < eb * margin)  # rows where the full range stays
            if keep.any():
                cols = np.flatnonzero(keep)
                q[:, cols] = qb[:, cols]
                sp[cols], bp[cols] = sb[cols], bb[cols]
            o = out[start : start + k]
            pack_columns_into(q, bits, o[:, :nbytes], pad_buf[:, :k], acc_buf[:, :k], w_buf[:, :k])
            o[:, nbytes:].view("<f2")[:] = np.stack([sp, bp], axis=1)
    return out


class _Adaptive(Codec):
    bits: ClassVar[int]
    lossless = False
    fallback = "int8"
    decode_bytes_per_s = 0.8e9  # as the FBGEMM n-bit codecs (0.4-2.1 GB/s measured)

    def row_bytes(self, dim: int) -> int:
        return uniform_row_bytes(dim, self.bits)

    def _encode(self, x: np.ndarray) -> np.ndarray:
        n, dim = x.shape
        out = np.empty((n, self.row_bytes(dim)), dtype=np.uint8)
        if n:
            search(x, self.bits, out)
        return out

    def _decode(self, e: np.ndarray, dim: int) -> np.ndarray:
        return decode_uniform(e, dim, self.bits)

    def _unrepresentable_range(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        # As the uniform codec at this width: the full-range parameters must be finite fp16.
        lo = np.asarray(lo, dtype=np.float32)
        hi = np.asarray(hi, dtype=np.float32)
        with np.errstate(over="ignore", invalid="ignore"):
            scale, _ = uniform_qparams(lo, hi, self.bits)
        return (np.maximum(-lo, hi) > FP16_MAX) | ~np.isfinite(scale)


def _doc(bits: int, uniform: str, layout: str) -> str:
    L = (1 << bits) - 1
    return f"""{bits}-bit row-wise uniform quantization with a searched clipping range, fp16 scale and bias.

    Layout of one row (``ceil(dim * {bits} / 8) + 4`` bytes), the same as ``{uniform}``'s: {layout};
    then ``scale`` as IEEE binary16 little-endian, then ``bias`` as binary16 little-endian.
    ``x̂ = float32(scale) * q + float32(bias)`` with ``q`` in ``[0, {L}]``; decoding is ``{uniform}``'s.
    Only the choice of ``scale`` and ``bias`` differs (module docstring); the levels are the nearest,
    ``clamp(rint((x - bias) / scale), 0, {L})``, on the grid those fp16 values define. Encoding is
    deterministic and each row's bytes depend on that row only.

    Representable rows: as ``{uniform}``, every value within ``±65504`` (fp16's range); others fall
    back to ``int8``.

    Error bound, per row: ``||x - x̂||_2 <= ||x - {uniform}(x)||_2``, the L2 error of ``{uniform}``
    on the same row (rows where the search finds nothing better are encoded exactly as ``{uniform}``
    encodes them, up to the padding bits). So each value's error is at most that row error; it is not
    bounded by ``{uniform}``'s per-value bound, since clipped values lie beyond the grid's ends.
    Constant fp16-representable rows decode exactly.
    """


class Adaptive4(_Adaptive):
    name = "adaptive4"
    codec_id = 13  # on disk: never renumber
    bits = 4
    _range_hint = "adaptive4 holds rows within ±65504 only (fp16 scale and bias); use int8 or fp32 for such rows"
    __doc__ = _doc(4, "int4", "levels packed two per byte, value ``j`` in byte ``j // 2``, low nibble "
                   "for even ``j`` (FBGEMM's 4-bit row layout; for odd ``dim`` the last high nibble is 0)")

    def _decode(self, e: np.ndarray, dim: int) -> np.ndarray:
        return _INT4._decode(e, dim)


class Adaptive3(_Adaptive):
    name = "adaptive3"
    codec_id = 12  # on disk: never renumber
    bits = 3
    _range_hint = "adaptive3 holds rows within ±65504 only (fp16 scale and bias); use int8 or fp32 for such rows"
    __doc__ = _doc(3, "int3", "the levels as one little-endian bitstream, value ``j`` at bits ``[3j, "
                   "3j + 3)``, bit ``i`` being bit ``i % 8`` of byte ``i // 8``, zero bits padding the last byte")


class Adaptive2(_Adaptive):
    name = "adaptive2"
    codec_id = 11  # on disk: never renumber
    bits = 2
    _range_hint = "adaptive2 holds rows within ±65504 only (fp16 scale and bias); use int8 or fp32 for such rows"
    __doc__ = _doc(2, "int2", "levels packed four per byte, value ``j`` in byte ``j // 4`` at bits "
                   "``2 * (j % 4)`` and ``2 * (j % 4) + 1`` (FBGEMM's 2-bit row layout; padding pairs are 0)")

    def _decode(self, e: np.ndarray, dim: int) -> np.ndarray:
        return _INT2._decode(e, dim)


_INT4, _INT2 = Int4(), Int2()
