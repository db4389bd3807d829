"""The codec interface: how a table's float32 rows become fixed-width byte rows and back.

A codec is stateless and thread-safe. Its ``codec_id`` is written into every record it encodes, so ids
are part of the on-disk format (see ``cnrstore/codecs/__init__.py`` for the registry). Each codec's
class docstring gives its byte layout and its error bound.

Shared contract of every codec:

- ``encode(values)`` takes ``(n, dim)`` float rows (any float dtype, taken as float32) and returns a new
  uint8 C-contiguous ``(n, row_bytes(dim))`` array, one encoded row per input row. The same float32 row
  always yields the same bytes, whatever other rows are in the call.
- ``decode(enc, dim)`` takes ``(n, row_bytes(dim))`` uint8 rows (any buffer-backed array, read-only
  mmap views included) and returns a new, writable, C-contiguous float32 ``(n, dim)`` array.
- ``decode_into(enc, dim, out)`` writes the same float32 bits into the caller's ``out`` instead, with
  temporaries bounded by ``DECODE_CHUNK_VALUES`` values whatever ``n`` is (fp32 rows are one copy).
- ``unrepresentable(values)`` flags the rows that ``encode`` cannot store faithfully (decoded within
  the codec's error bound, and finite); the store writes those with ``fallback`` instead.
"""

from __future__ import annotations

import abc
import math
import operator
from typing import ClassVar

import numpy as np

from cnrstore.errors import InvalidArgument

__all__ = ["Codec", "DECODE_CHUNK_VALUES", "as_out"]

#: Values a chunked ``decode_into`` decodes per step (1 MiB of float32): its temporaries stay in L2 cache
#: and never grow with the rows decoded.
DECODE_CHUNK_VALUES = 1 << 18

_FLOAT_KINDS = frozenset("fiu")  # float, signed and unsigned int: all convert to float32 meaningfully


class Codec(abc.ABC):
    """A row codec. Subclasses set the class attributes and implement ``row_bytes``, ``_encode`` and
    ``_decode``; lossy ones with a limited range also override ``_unrepresentable_range``."""

    #: Registry name, e.g. ``"int4"``.
    name: ClassVar[str]
    #: On disk: never renumber. Stored in every ROWS record this codec wrote.
    codec_id: ClassVar[int]
    #: True if ``decode(encode(x))`` is bit-exact.
    lossless: ClassVar[bool]
    #: Codec the store uses for rows this one flags as unrepresentable (None: every finite row fits).
    fallback: ClassVar[str | None]
    #: Tail of the error message for an unrepresentable row: why, and what to use instead.
    _range_hint: ClassVar[str] = ""
    #: Nominal decode rate: encoded bytes ``decode_into`` turns into float32 rows per second on one thread
    #: (measured at dim 16-128 on the 2-core CI machine). Only prices a record's fixed read cost in this
    #: codec's bytes (engine/merge.py); never used for correctness.
    decode_bytes_per_s: ClassVar[float] = 1e9

    # -- public API -------------------------------------------------------------------------------

    @abc.abstractmethod
    def row_bytes(self, dim: int) -> int:
        """Bytes of one encoded row of ``dim`` floats."""

    def encode(self, values, *, check: bool = True) -> np.ndarray:
        """Encode ``(n, dim)`` float rows into a new uint8 ``(n, row_bytes(dim))`` array.

        ``check=True`` raises :class:`InvalidArgument` if ``values`` is not 2-D, holds a NaN or an
        infinity, or has a row this codec cannot represent (the message gives the first such row).
        ``check=False`` skips the value checks (not the shape check): the caller promises every value
        is finite and no row is :meth:`unrepresentable`.
        """
        x = as_rows(values)
        if check:
            self._check_values(x)
        return self._encode(x)

    def decode(self, enc, dim: int) -> np.ndarray:
        """Decode uint8 ``(n, row_bytes(dim))`` rows into a new float32 ``(n, dim)`` array."""
        dim = check_dim(dim)
        return self._decode(self._encoded_rows(enc, dim), dim)

    def decode_into(self, enc, dim: int, out) -> np.ndarray:
        """Decode uint8 ``(n, row_bytes(dim))`` rows into ``out`` and return it (as a numpy array).

        ``out``: a writable, C-contiguous float32 ``(n, dim)`` numpy array or CPU torch tensor (written
        through its memory). Afterwards ``out`` holds exactly ``decode(enc, dim)``, bit for bit. Raises
        :class:`InvalidArgument` for a bad ``enc`` or ``out`` before writing anything; the temporaries
        are bounded (``DECODE_CHUNK_VALUES``), not proportional to ``n``. Safe to call from several
        threads at once on disjoint ``out`` (the kernels release the GIL).
        """
        dim = check_dim(dim)
        e = self._encoded_rows(enc, dim)
        o = as_out(out, (e.shape[0], dim), f"{self.name}: decode_into")
        if e.shape[0]:
            self._decode_into(e, dim, o)
        return o

    def _encoded_rows(self, enc, dim: int) -> np.ndarray:
        """``enc`` as uint8 C-contiguous ``(n, row_bytes(dim))``, else InvalidArgument."""
        width = self.row_bytes(dim)
        try:
            e = np.asarray(enc)
        except (TypeError, ValueError) as exc:
            raise InvalidArgument(
                f"{self.name}: encoded rows must be a uint8 array, got {type(enc).__name__}"
            ) from exc
        if e.dtype != np.uint8:
            raise InvalidArgument(f"{self.name}: encoded rows must be uint8, got dtype {e.dtype}")
        if e.ndim != 2 or e.shape[1] != width:
            raise InvalidArgument(
                f"{self.name}: encoded rows of dim {dim} must have shape (n, {width}), got {e.shape}"
            )
        if not e.flags.c_contiguous:
            e = np.ascontiguousarray(e)
        return e

    def unrepresentable(self, values, *, value_range: tuple[float, float] | None = None) -> np.ndarray:
        """Bool ``(n,)``: rows (finite float32, as ``encode`` takes them) this codec cannot store
        faithfully. Vectorized; one pass over ``values`` when no row is out of range, none when the
        caller passes the global ``value_range`` (min, max) of ``values`` it already computed."""
        x = as_rows(values)
        n = x.shape[0]
        if n == 0 or not self._may_be_unrepresentable(x, value_range):
            return np.zeros(n, dtype=bool)
        lo, hi = self._row_minmax(x)
        return np.asarray(self._unrepresentable_range(lo, hi), dtype=bool)

    def __repr__(self) -> str:
        return f"<Codec {self.name} id={self.codec_id}>"

    # -- hooks --------------------------------------------------------------------------------------

    @abc.abstractmethod
    def _encode(self, x: np.ndarray) -> np.ndarray:
        """``x`` is float32 C-contiguous 2-D (possibly read-only, possibly the caller's: never keep
        a view of it in the result)."""

    @abc.abstractmethod
    def _decode(self, e: np.ndarray, dim: int) -> np.ndarray:
        """``e`` is uint8 C-contiguous ``(n, row_bytes(dim))``, possibly read-only."""

    def _decode_into(self, e: np.ndarray, dim: int, out: np.ndarray) -> None:
        """``out[:] = _decode(e, dim)`` (``e`` as for ``_decode``, ``out`` float32 C-contiguous ``(n, dim)``,
        n >= 1), in chunks of ``DECODE_CHUNK_VALUES`` values; codecs with a kernel that writes in place
        override it."""
        step = max(1, DECODE_CHUNK_VALUES // dim)
        for i in range(0, e.shape[0], step):
            out[i : i + step] = self._decode(e[i : i + step], dim)

    def _unrepresentable_range(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """Bool per row from the rows' float32 minima ``lo`` and maxima ``hi``.

        Must be monotone: a row whose ``[lo, hi]`` lies inside a representable row's is representable.
        That lets one global min/max clear a whole batch at once.
        """
        return np.zeros(np.shape(lo), dtype=bool)

    def _minmax(self, x: np.ndarray) -> tuple[float, float]:
        """Global min and max of a non-empty ``x``, NaN if any value is NaN."""
        return float(x.min()), float(x.max())

    def _row_minmax(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per-row float32 min and max of ``x`` with at least one row."""
        return x.min(axis=1), x.max(axis=1)

    # -- shared checks ------------------------------------------------------------------------------

    def _may_be_unrepresentable(self, x: np.ndarray, value_range: tuple[float, float] | None = None) -> bool:
        lo, hi = self._minmax(x) if value_range is None else value_range
        return bool(self._unrepresentable_range(np.float32([lo]), np.float32([hi]))[0])

    def _check_values(self, x: np.ndarray) -> None:
        if x.shape[0] == 0:
            return
        lo, hi = self._minmax(x)
        if not (math.isfinite(lo) and math.isfinite(hi)):  # min and max propagate NaN and reach +-inf
            finite = np.isfinite(x)
            row = int(np.argmin(finite.all(axis=1)))
            bad = x[row][~finite[row]][0]
            raise InvalidArgument(
                f"{self.name}: row {row} holds a non-finite value ({bad}); only finite values can be stored"
            )
        if self._unrepresentable_range(np.float32([lo]), np.float32([hi]))[0]:
            flagged = np.asarray(self._unrepresentable_range(*self._row_minmax(x)), dtype=bool)
            if flagged.any():
                row = int(np.argmax(flagged))
                raise InvalidArgument(
                    f"{self.name}: row {row} (min {x[row].min()}, max {x[row].max()}) cannot be stored by "
                    f"the {self.name} codec: {self._range_hint}"
                )


def check_dim(dim) -> int:
    """``dim`` as a positive int, else :class:`InvalidArgument`."""
    try:
        d = operator.index(dim)
    except TypeError as exc:
        raise InvalidArgument(f"dim must be a positive integer, got {dim!r}") from exc
    if d < 1:
        raise InvalidArgument(f"dim must be a positive integer, got {d}")
    return d


def as_out(out, shape: tuple[int, int], what: str) -> np.ndarray:
    """``out`` as a numpy array sharing its memory, if it is a writable C-contiguous float32 array of
    ``shape`` (a numpy array, or a CPU torch tensor, duck-typed: this module needs no torch); else
    :class:`InvalidArgument` naming what was expected."""
    arr = out
    if not isinstance(out, np.ndarray):
        if not (hasattr(out, "detach") and hasattr(out, "numpy") and hasattr(out, "device")):
            raise InvalidArgument(f"{what}: out must be a numpy array or a CPU torch tensor, got {type(out).__name__}")
        if getattr(out.device, "type", None) != "cpu":
            raise InvalidArgument(f"{what}: out must be in host memory, got a tensor on {out.device}")
        try:
            arr = out.detach().numpy()
        except (TypeError, RuntimeError) as exc:  # e.g. a dtype numpy lacks (bfloat16)
            raise InvalidArgument(f"{what}: out must be float32, got a tensor of {out.dtype}") from exc
    if arr.dtype != np.float32 or tuple(arr.shape) != tuple(shape):
        raise InvalidArgument(f"{what}: out must be float32 of shape {tuple(shape)}, got {arr.dtype} {tuple(arr.shape)}")
    if not arr.flags.c_contiguous or not arr.flags.writeable:
        raise InvalidArgument(f"{what}: out must be writable and C-contiguous")
    return arr


def as_rows(values) -> np.ndarray:
    """``values`` as a float32 C-contiguous ``(n, dim)`` array, ``dim >= 1``; copies only if needed.

    Accepts numpy arrays, nested sequences and torch tensors (any float dtype, any device,
    ``requires_grad`` or not), duck-typed so that this module needs no torch.
    """
    if not isinstance(values, np.ndarray) and hasattr(values, "detach") and hasattr(values, "numpy"):
        values = values.detach().cpu().float().contiguous().numpy()  # a torch.Tensor
    try:
        a = np.asarray(values)
        if a.dtype.kind not in _FLOAT_KINDS:
            raise TypeError(f"dtype {a.dtype}")
        x = np.ascontiguousarray(a, dtype=np.float32)
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(
            f"values must be a 2-D array of floats (rows, dim), got {type(values).__name__}: {exc}"
        ) from exc
    if x.ndim != 2:
        raise InvalidArgument(f"values must be 2-D (rows, dim), got shape {x.shape}")
    if x.shape[1] < 1:
        raise InvalidArgument(f"values must have at least one column, got shape {x.shape}")
    return x
