"""Row-wise non-uniform quantization with a per-row codebook (``kmeans2``, ``kmeans3``, ``kmeans4``):
each row gets ``C = 2**bits`` centroids fit by Lloyd's algorithm (1-D k-means) on its own values;
numpy only, all rows at once.

Per row, vectorized across the rows of a chunk (rows as columns, ``(dim, rows)``):

1. Sort the row. In one dimension every k-means cluster is a run of consecutive sorted values, so a
   cluster is given by its boundaries, the number of values at or below the midpoint between two
   consecutive centroids, and its sum by prefix sums of the sorted values (float64).
2. Start from the uniform grid: ``C`` centroids evenly spaced over ``[min, max]`` (deterministic, and
   the grid of the uniform codec at the same width, so Lloyd's steps, which never raise the error,
   start from the uniform codec's error).
3. :data:`ITERATIONS` Lloyd steps: boundaries at the midpoints, each centroid moved to its cluster's
   mean. A cluster left empty keeps its centroid; centroids are re-sorted after each step.
4. Round the centroids to fp16 and assign each value of the (unsorted) row to the nearest rounded
   centroid, so decoding ``centroids[level]`` gives exactly what was measured.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from cnrstore.codecs.adaptive import GROUPS, Workspace, pack_columns_into, round_fp16
from cnrstore.codecs.base import Codec
from cnrstore.codecs.lossless import FP16_MAX
from cnrstore.codecs.nbit import unpack_levels

__all__ = ["KMeans2", "KMeans3", "KMeans4", "ITERATIONS", "kmeans_encode", "kmeans_row_bytes"]

#: Lloyd iterations per row (on embedding-like rows the error has settled to within 0.1% by then;
#: part of what the codecs' bytes are: changing it changes the encoding, not the format).
ITERATIONS = 8
#: Values per chunk: the ``(dim, C - 1, rows)`` comparison temporaries stay within L2 cache.
_CHUNK_VALUES = 1 << 16

_WORKSPACE = Workspace()


def kmeans_row_bytes(dim: int, bits: int) -> int:
    """``ceil(dim * bits / 8)`` bytes of packed levels, then ``2**bits`` fp16 centroids."""
    return -(-dim * bits // 8) + 2 * (1 << bits)


def _prefix_sums(xs, out):
    """``out[j] = sum(xs[:j])`` down each column, in float64 (``out`` is ``(dim + 1, k)``)."""
    dim = xs.shape[0]
    out[0] = 0
    if dim <= 256:
        for j in range(dim):
            np.add(out[j], xs[j], out=out[j + 1])
    else:  # log-step scan: fewer, larger numpy calls
        out[1:] = xs
        s = 1
        while s <= dim:
            out[s:] += out[:-s].copy()
            s *= 2


def kmeans_encode(x: np.ndarray, bits: int, out: np.ndarray | None = None, iterations: int = ITERATIONS) -> np.ndarray:
    """Encode float32 rows ``x`` (finite, within fp16's range) into ``out`` (uint8
    ``(n, kmeans_row_bytes(dim, bits))``, allocated if None) as in the module docstring.
    ``iterations`` is for experiments only: the codecs use :data:`ITERATIONS`."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    n, dim = x.shape
    C = 1 << bits
    nbytes = -(-dim * bits // 8)
    if out is None:
        out = np.empty((n, kmeans_row_bytes(dim, bits)), dtype=np.uint8)
    if n == 0:
        return out
    if n == 1:
        # Chunks hold at least two rows: numpy reduces a single column in a different order (SIMD
        # partial sums) than columns of a wider array, and a row's bytes must not depend on that.
        out[:] = kmeans_encode(np.concatenate([x, x]), bits, iterations=iterations)[:1]
        return out
    step = max(2, _CHUNK_VALUES // dim)
    g = GROUPS[bits][0]
    groups = -(-dim // g)
    f4 = np.float32
    grid = np.arange(C, dtype=np.float64)[:, None] / (C - 1)
    count_dtype = np.uint8 if dim < 256 else np.uint16 if dim < 65536 else np.uint32
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        for i in range(0, n, step):
            start = i if n - i > 1 else i - 1  # never a chunk of one row (see above)
            xs = x[start : start + step]
            k = len(xs)
            (s, xt, q, psum, below, pad, acc, w) = _WORKSPACE.arrays(
                [((k, dim), f4), ((dim, k), f4), ((dim, k), f4), ((dim + 1, k), np.float64),
                 ((dim, C - 1, k), np.bool_), ((groups * g, k), f4), ((groups, k), f4), ((groups, k), np.uint32)]
            )
            np.copyto(s, xs)
            s.sort(axis=1)
            np.copyto(xt, s.T)  # sorted values down each column
            _prefix_sums(xt, psum)
            lo, hi = xt[0].astype(np.float64), xt[-1].astype(np.float64)
            c = lo + (hi - lo) * grid  # (C, k): the uniform grid
            col = np.arange(k, dtype=np.intp)
            psum_flat = psum.ravel()
            bounds = np.empty((C + 1, k), dtype=np.intp)
            bounds[0], bounds[C] = 0, dim
            for _ in range(iterations):
                mid = ((c[1:] + c[:-1]) * 0.5).astype(f4)  # (C - 1, k), ascending
                # cluster boundaries: how many sorted values lie at or below each midpoint
                np.less_equal(xt[:, None, :], mid, out=below)
                bounds[1:C] = np.add.reduce(below.view(np.uint8), axis=0, dtype=count_dtype)
                count = np.diff(bounds, axis=0)
                sums = np.diff(psum_flat.take(bounds * k + col), axis=0)
                # a cluster left empty keeps its centroid, which stays between its neighbours'
                c = np.where(count > 0, sums / np.maximum(count, 1), c)
            cents = np.maximum.accumulate(round_fp16(c.astype(f4)), axis=0)  # ascending (rounding is monotone)
            # levels of the unsorted rows: nearest rounded centroid (ties to the lower one)
            np.copyto(xt, xs.T)
            mid = (cents[1:] + cents[:-1]) * f4(0.5)
            np.greater(xt[:, None, :], mid, out=below)
            np.add.reduce(below.view(np.uint8), axis=1, dtype=f4, out=q)
            o = out[start : start + k]
            pack_columns_into(q, bits, o[:, :nbytes], pad, acc, w)
            o[:, nbytes:].view("<f2")[:] = cents.T
    return out


def kmeans_decode(enc: np.ndarray, dim: int, bits: int) -> np.ndarray:
    """Decode ``(n, kmeans_row_bytes(dim, bits))`` uint8 rows into float32 ``(n, dim)``."""
    nbytes = -(-dim * bits // 8)
    q = unpack_levels(enc[:, :nbytes], dim, bits)
    cents = np.ascontiguousarray(enc[:, nbytes:]).view("<f2").astype(np.float32)
    return np.take_along_axis(cents, q.astype(np.intp), axis=1)


class _KMeans(Codec):
    bits: ClassVar[int]
    lossless = False
    fallback = "int8"
    decode_bytes_per_s = 0.2e9  # a codebook gather (0.1-0.34 GB/s measured)

    def row_bytes(self, dim: int) -> int:
        return kmeans_row_bytes(dim, self.bits)

    def _encode(self, x: np.ndarray) -> np.ndarray:
        return kmeans_encode(x, self.bits)

    def _decode(self, e: np.ndarray, dim: int) -> np.ndarray:
        return kmeans_decode(e, dim, self.bits)

    def _unrepresentable_range(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        # fp16 centroids: means of the row's values, so every value within fp16's range suffices.
        return np.maximum(-np.asarray(lo, dtype=np.float32), np.asarray(hi, dtype=np.float32)) > FP16_MAX


def _doc(bits: int) -> str:
    C = 1 << bits
    return f"""{bits}-bit row-wise non-uniform quantization: a codebook of {C} fp16 centroids per row (k-means).

    Layout of one row (``ceil(dim * {bits} / 8) + {2 * C}`` bytes): the levels ``q`` in ``[0, {C - 1}]``
    as a little-endian bitstream, value ``j`` at bits ``[{bits}j, {bits}j + {bits})``, bit ``i`` being bit
    ``i % 8`` of byte ``i // 8``, zero bits padding the last byte (at 4 bits: two levels per byte, low
    nibble first, as FBGEMM's 4-bit rows); then the {C} centroids as IEEE binary16 little-endian, in
    ascending order. ``x̂ = float32(centroid[q])``, exactly.

    Encoding: {ITERATIONS} Lloyd iterations from the uniform grid over ``[min, max]`` (module
    docstring); each value gets the nearest fp16-rounded centroid (a value within float32 rounding of
    the midpoint between two may get either). Deterministic; each row's bytes depend on that row only.

    Representable rows: every value within ``±65504`` (fp16's range); others fall back to ``int8``.

    Error bound: ``|x - x̂|`` is at most the distance from ``x`` to the nearest fp16-rounded centroid,
    and every centroid lies within the row's range ``[m, M]`` widened by fp16 rounding, so
    ``|x - x̂| <= (M - m) + max(|m|, |M|) * 2**-11 + 2**-25``. Per row, Lloyd's steps never raise the
    error of the uniform {bits}-bit grid over ``[m, M]`` they start from; the final rounding of the
    centroids to fp16 moves each by up to ``2**-11`` of its magnitude, which on rows far from zero
    relative to their spread can leave the error above ``int{bits}``'s (whose fp16 scale is relative to
    its bias). On embedding-like rows the mean error is 19-33% below ``int{bits}``'s. Constant
    fp16-representable rows decode exactly.
    """


class KMeans4(_KMeans):
    name = "kmeans4"
    codec_id = 16  # on disk: never renumber
    bits = 4
    _range_hint = "kmeans4 holds rows within ±65504 only (fp16 centroids); use int8 or fp32 for such rows"
    __doc__ = _doc(4)


class KMeans3(_KMeans):
    name = "kmeans3"
    codec_id = 15  # on disk: never renumber
    bits = 3
    _range_hint = "kmeans3 holds rows within ±65504 only (fp16 centroids); use int8 or fp32 for such rows"
    __doc__ = _doc(3)


class KMeans2(_KMeans):
    name = "kmeans2"
    codec_id = 14  # on disk: never renumber
    bits = 2
    _range_hint = "kmeans2 holds rows within ±65504 only (fp16 centroids); use int8 or fp32 for such rows"
    __doc__ = _doc(2)
