"""Plain IEEE codecs: ``fp32`` (lossless) and ``fp16`` (round to nearest even). numpy only."""

from __future__ import annotations

import numpy as np

from cnrstore.codecs.base import Codec

__all__ = ["FP32", "FP16"]

#: Largest finite fp16 value.
FP16_MAX = 65504.0


class FP32(Codec):
    """Bit-exact float32, -0.0, subnormals and all NaN payloads included.

    Layout of one row (``4 * dim`` bytes): ``dim`` IEEE-754 binary32 values, little-endian, in
    column order. Error: none. Every finite row is representable.
    """

    name = "fp32"
    codec_id = 1  # on disk: never renumber
    lossless = True
    fallback = None
    decode_bytes_per_s = 16e9  # a copy (17-22 GB/s measured)

    def row_bytes(self, dim: int) -> int:
        return 4 * dim

    def _encode(self, x: np.ndarray) -> np.ndarray:
        # astype copies, so the result never aliases the caller's array.
        return x.astype("<f4").view(np.uint8)

    def _decode(self, e: np.ndarray, dim: int) -> np.ndarray:
        return e.view("<f4").astype(np.float32)

    def _decode_into(self, e: np.ndarray, dim: int, out: np.ndarray) -> None:
        np.copyto(out, e.view("<f4"))  # one copy from the record's bytes (a memcpy on little-endian hosts)


class FP16(Codec):
    """IEEE half precision, rounded to nearest (ties to even).

    Layout of one row (``2 * dim`` bytes): ``dim`` IEEE-754 binary16 values, little-endian, in
    column order.

    Representable rows: every value in ``[-65504, 65504]`` (fp16's finite range); other rows fall
    back to ``fp32``. Error bound per value: ``|x - x̂| <= max(|x| * 2**-11, 2**-25)``, that is
    relative ``2**-11`` for normal fp16 values and absolute ``2**-25`` (half the subnormal spacing)
    below ``2**-14``. Signed zeros are kept; values below ``2**-25`` in magnitude flush to ±0.
    """

    name = "fp16"
    codec_id = 2  # on disk: never renumber
    lossless = False
    fallback = "fp32"
    decode_bytes_per_s = 1.1e9  # numpy's half -> single conversion (1.1-1.2 GB/s measured)
    _range_hint = "fp16 holds values within ±65504 only; use the fp32 codec for such rows"

    def row_bytes(self, dim: int) -> int:
        return 2 * dim

    def _encode(self, x: np.ndarray) -> np.ndarray:
        with np.errstate(over="ignore"):  # only with check=False: out-of-range values become +-inf
            return x.astype("<f2").view(np.uint8)

    def _decode(self, e: np.ndarray, dim: int) -> np.ndarray:
        return e.view("<f2").astype(np.float32)

    def _decode_into(self, e: np.ndarray, dim: int, out: np.ndarray) -> None:
        np.copyto(out, e.view("<f2"))  # float16 -> float32 is exact: the same bits as astype

    def _unrepresentable_range(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        return (lo < -FP16_MAX) | (hi > FP16_MAX)
