"""Argument checks shared by writes and reads. Each raises InvalidArgument saying what to fix."""

from __future__ import annotations

import math
import reprlib

import msgpack
import numpy as np

from . import blocks as blocks_math
from .. import codecs, knobs
from . import record
from ..checks import number  # noqa: F401 (the engine's argument checks include it: serving.py)
from ..errors import InvalidArgument

#: Row ids are int64 (in memory and as the index's block keys), so a table has fewer than 2**63 rows.
MAX_NUM_ROWS = (1 << 63) - 1
#: Steps are stored as msgpack integers (int64 or uint64).
MIN_STEP, MAX_STEP = -(1 << 63), (1 << 64) - 1


def to_numpy(array, what: str) -> np.ndarray:
    """A numpy view or copy of an array-like or a torch tensor (duck-typed: no torch import here)."""
    if hasattr(array, "detach") and hasattr(array, "cpu"):
        try:
            return array.detach().cpu().numpy()
        except (TypeError, RuntimeError) as exc:
            raise InvalidArgument(f"{what}: tensor of dtype {array.dtype} has no numpy equivalent ({exc}); "
                                  "convert it (e.g. .float()) first") from exc
    return np.asarray(array)


def row_ids(rows, num_rows: int, table: str) -> np.ndarray:
    """``rows`` as a 1-D int64 array, each in [0, num_rows); duplicates allowed (checked elsewhere)."""
    try:
        arr = to_numpy(rows, f"rows of table {table!r}")
    except OverflowError as exc:  # e.g. a torch or array-like int beyond int64
        raise InvalidArgument(f"rows of table {table!r} hold an id beyond int64 ({exc}); row ids are in "
                              f"[0, {num_rows})") from exc
    if arr.dtype == object and arr.ndim == 1:  # Python ints beyond int64 (or mixed objects)
        big = next((r for r in arr if isinstance(r, int) and not isinstance(r, bool)
                    and not 0 <= r < num_rows), None)
        if big is not None:
            raise InvalidArgument(f"row {big} of table {table!r} is outside [0, {num_rows})")
    if arr.ndim != 1:
        raise InvalidArgument(f"rows of table {table!r} must be a 1-D integer array, got shape {arr.shape}")
    if arr.size and not (np.issubdtype(arr.dtype, np.integer) and arr.dtype != np.bool_):
        raise InvalidArgument(f"rows of table {table!r} must be integers, got dtype {arr.dtype} "
                              f"(first row {arr.flat[0]!r})")
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.dtype == np.uint64 and arr.max() > np.iinfo(np.int64).max:
        bad = int(np.flatnonzero(arr > np.iinfo(np.int64).max)[0])
        raise InvalidArgument(f"row {arr[bad]} of table {table!r} is outside [0, {num_rows})")
    arr = arr.astype(np.int64, copy=False)
    if arr.min() < 0 or arr.max() >= num_rows:
        bad = int(np.flatnonzero((arr < 0) | (arr >= num_rows))[0])
        raise InvalidArgument(f"row {int(arr[bad])} of table {table!r} is outside [0, {num_rows})")
    return arr


def sorted_unique_rows(rows: np.ndarray, table: str) -> np.ndarray | None:
    """The permutation that sorts ``rows`` (None if already strictly increasing); raises on duplicates."""
    if rows.size < 2 or bool(np.all(rows[1:] > rows[:-1])):
        return None
    order = np.argsort(rows, kind="stable")
    srt = rows[order]
    dup = np.flatnonzero(srt[1:] == srt[:-1])
    if dup.size:
        raise InvalidArgument(f"row {int(srt[dup[0]])} of table {table!r} is put twice in one call; "
                              "rows must be unique within a call and a version")
    return order


def row_values(values, rows: np.ndarray, dim: int, table: str) -> tuple[np.ndarray, tuple[float, float]]:
    """``values`` as C-contiguous float32 (len(rows), dim), all finite, and their global (min, max)."""
    if hasattr(values, "detach") and callable(getattr(values, "is_floating_point", None)) \
            and values.is_floating_point():
        values = values.detach().float()  # any float tensor dtype (bfloat16 has no numpy equivalent)
    arr = to_numpy(values, f"values of table {table!r}")
    if arr.ndim != 2 or arr.shape != (rows.size, dim):
        raise InvalidArgument(f"values of table {table!r} must have shape ({rows.size}, {dim}) "
                              f"(one row of dim {dim} per row id), got {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.floating):
        raise InvalidArgument(f"values of table {table!r} must be floating point, got dtype {arr.dtype}")
    with np.errstate(over="ignore"):  # float64 beyond float32's range becomes inf: reported below
        arr = np.ascontiguousarray(arr, dtype=np.float32)
    if not arr.size:
        return arr, (0.0, 0.0)
    lo, hi = codecs.value_range(arr)  # one multi-threaded pass; NaN and +-inf show up in min or max
    if not (math.isfinite(lo) and math.isfinite(hi)):
        i = int(np.flatnonzero(~np.isfinite(arr).all(axis=1))[0])
        raise InvalidArgument(f"values of row {int(rows[i])} of table {table!r} are not finite "
                              f"(NaN or Inf, or beyond float32 range); fix the model before checkpointing")
    return arr, (lo, hi)


def name(value, what: str) -> str:
    if not isinstance(value, str) or not value or "\x00" in value or len(value.encode()) > 400:
        raise InvalidArgument(f"{what} must be a non-empty string of at most 400 bytes without NUL, got {value!r}")
    return value


def positive_int(value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise InvalidArgument(f"{what} must be a positive integer, got {value!r}")
    return int(value)


def version_arg(value, what: str = "version", *, least: int = 0, optional: bool = True) -> int | None:
    """None (where ``optional``), or an integer >= ``least`` (0; 1 where 0, no version, means nothing):
    numpy's too, never a bool, a float or a str. One beyond what was ever committed (2**64 and up included)
    is left for the read to report as VersionNotFound (API.md). InvalidArgument naming ``what`` otherwise."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < least:
        none = " or None" if optional else ""
        raise InvalidArgument(f"{what} must be a version number (an integer >= {least}){none}, got {value!r}")
    return int(value)


def table_names(value, what: str = "tables") -> list[str] | None:
    """None, or ``value`` (one name, or an iterable of names: a list, a tuple, a set, a dict's keys, ...) as a
    list of str; InvalidArgument naming ``what`` for anything else (bytes, a number, an iterable holding a
    non-str). Whether each name exists is the caller's to check."""
    if value is None:
        return None
    if isinstance(value, str):
        return [value]
    names = None
    if not isinstance(value, (bytes, bytearray, memoryview)):
        try:
            names = list(value)
        except TypeError:
            pass
    if names is None or not all(isinstance(n, str) for n in names):
        bad = value if names is None else next(n for n in names if not isinstance(n, str))
        raise InvalidArgument(f"{what} must be None, a name or an iterable of names (str), got "
                              f"{reprlib.repr(bad)}" + ("" if names is None else f" in {reprlib.repr(value)}"))
    return names


def flag(value, what: str) -> bool:
    """``value`` as a bool: True or False (numpy's too); InvalidArgument naming ``what`` for anything else
    (None, 0, a str: a truthy "no" would read as True)."""
    if not isinstance(value, (bool, np.bool_)):
        raise InvalidArgument(f"{what} must be True or False, got {value!r}")
    return bool(value)


def widest_row_bytes(dim: int) -> int:
    """Bytes of one encoded row of ``dim`` floats in the widest codec: any codec may be chosen per
    ``put_rows`` (or a fallback / an fp32 merge), so the table's records must fit in every one."""
    return max(codecs.get(n).row_bytes(dim) for n in codecs.names())


def _record_bytes(rows: int, row_bytes: int) -> int:
    """Bytes of a ROWS record of ``rows`` rows, with row offsets (its largest form)."""
    return record.HEADER_BYTES + record.TRAILER_BYTES + rows * (2 + row_bytes)


def table_shape(name: str, num_rows: int, dim: int) -> None:
    """Raise InvalidArgument unless a table of ``num_rows`` rows of ``dim`` floats fits the format:
    row ids are int64 and one encoded row (in any codec) must fit a record (u32 length)."""
    if num_rows > MAX_NUM_ROWS:
        raise InvalidArgument(f"table {name!r}: num_rows {num_rows} is beyond the format's limit of 2**63-1 "
                              "rows (row ids are int64); use a smaller num_rows (e.g. hash ids into a smaller "
                              "table) or split the table")
    if _record_bytes(1, widest_row_bytes(dim)) > knobs.MAX_RECORD_BYTES:
        most = (knobs.MAX_RECORD_BYTES - _record_bytes(1, 0)) // 4
        raise InvalidArgument(f"table {name!r}: a row of dim {dim} does not fit one record (at most "
                              f"{knobs.MAX_RECORD_BYTES} bytes, u32 lengths); use a smaller dim (at most {most}) "
                              "or store such arrays with put_dense in pieces")


def max_block_rows(dim: int) -> int:
    """The largest power of two of rows whose block record fits MAX_RECORD_BYTES in every codec."""
    fit = (knobs.MAX_RECORD_BYTES - _record_bytes(0, 0)) // (2 + widest_row_bytes(dim))
    return blocks_math.floor_pow2(fit)


def max_dense_bytes() -> int:
    """The most bytes one dense array may hold: a record (u32 length) less its header, trailer and the
    msgpack descriptor of dtype and shape (at most 656 bytes for numpy's 64 dimensions)."""
    return knobs.MAX_RECORD_BYTES - record.HEADER_BYTES - record.TRAILER_BYTES - 656


def dense_size(name: str, arr) -> None:
    """Raise InvalidArgument unless ``arr`` (a numpy array or a tensor: anything with ``nbytes`` and
    ``shape``) fits one DENSE record. Uses the logical size only: nothing is copied or touched."""
    nbytes = getattr(arr, "nbytes", None)
    if nbytes is None:
        return
    nbytes = int(nbytes)
    limit = max_dense_bytes()
    if nbytes > limit:
        raise InvalidArgument(f"dense array {name!r} is {nbytes:,} bytes (shape {tuple(arr.shape)}); one dense "
                              f"array is one record of at most {limit:,} bytes (u32 lengths on disk): split the "
                              f"dense array into several put_dense names (e.g. {name + '/0'!r}, "
                              f"{name + '/1'!r}, ...) or store it as a table with put_rows")


def step_arg(value) -> int | None:
    """None, or an integer step that the version record can store (int64 or uint64)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise InvalidArgument(f"step must be an integer or None, got {value!r}")
    if not MIN_STEP <= int(value) <= MAX_STEP:
        raise InvalidArgument(f"step {value} is outside [-2**63, 2**64-1], the range a step is stored in; "
                              "pass a smaller step (e.g. the training iteration)")
    return int(value)


def version_set(values, name: str) -> set[int]:
    """``values`` (an iterable of version numbers, or one) as a set; InvalidArgument naming ``name``."""
    if isinstance(values, (int, np.integer)) and not isinstance(values, bool):
        values = [values]
    try:
        out = {int(v) for v in values if not isinstance(v, bool) and isinstance(v, (int, np.integer)) and v >= 1}
        ok = len(out) == len(set(values))
    except TypeError:
        ok = False
    if not ok:
        raise InvalidArgument(f"{name}= takes version numbers (ints >= 1); got {values!r}")
    return out


def check_meta(meta) -> None:
    """Raise InvalidArgument unless ``meta`` is None or a msgpack-able dict (what a version's meta
    holds: it is packed with the version's record when the checkpoint commits)."""
    if meta is None:
        return
    if not isinstance(meta, dict):
        raise InvalidArgument(f"meta must be a dict (or None), got {type(meta).__name__}")
    try:
        msgpack.packb(meta, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise InvalidArgument(f"meta must be msgpack-able (dicts, lists, str, bytes, numbers, bool, None): {exc}") from exc
