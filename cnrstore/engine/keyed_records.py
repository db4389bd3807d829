"""Key-run records of keyed tables (format 4): a row of a run, and a run as a record's bytes and back.

A keyed table's row for one key is its value, encoded by the record's codec, followed by each of the
table's columns (catalog order) as raw little-endian bytes: ``width = codec.row_bytes(dim) + column bytes``.
A record is a ROWS record flagged ``FLAG_KEYS`` whose block is the partition (keyed_runs.partition_of) and
whose count is the run's entries (docs/FORMAT.md, "Key runs"); keyed_runs.py holds the run arithmetic.

Nothing here loops over keys: every step is a numpy array operation.
"""

from __future__ import annotations

import numpy as np

from .. import codecs
from . import keyed_runs, record
from ..errors import CorruptionError, InvalidArgument
from .schema import COLUMN_DTYPES, MAX_COLUMN_WIDTH, MAX_COLUMNS, TableRecord
from ..types import KeyedRows


def columns_arg(table: str, columns) -> tuple:
    """``create_table(columns=)`` ({name: dtype} or {name: (dtype, width)}) as the catalog's ((name, dtype
    string, width), ...); InvalidArgument saying what is allowed otherwise."""
    if columns is None:
        return ()
    if not isinstance(columns, dict) or len(columns) > MAX_COLUMNS:
        raise InvalidArgument(f"columns of table {table!r} must be a dict of at most {MAX_COLUMNS} name: dtype "
                              f"(or name: (dtype, width)), got {columns!r}")
    out = []
    for name, spec in columns.items():
        if not isinstance(name, str) or not 0 < len(name) <= 100:
            raise InvalidArgument(f"column names of table {table!r} are strings of 1-100 characters, got {name!r}")
        dt, width = spec if isinstance(spec, tuple) and len(spec) == 2 else (spec, 1)
        try:
            dtype = np.dtype(dt).newbyteorder("<") if np.dtype(dt).itemsize > 1 else np.dtype(dt)
        except TypeError:
            dtype = None
        if dtype is None or dtype.str not in COLUMN_DTYPES:
            raise InvalidArgument(f"column {name!r} of table {table!r}: dtype {dt!r} is not one of bool, "
                                  "int8-64, uint8-64, float16/32/64")
        if isinstance(width, bool) or not isinstance(width, (int, np.integer)) or not 0 < width <= MAX_COLUMN_WIDTH:
            raise InvalidArgument(f"column {name!r} of table {table!r}: width must be an int in "
                                  f"[1, {MAX_COLUMN_WIDTH}], got {width!r}")
        out.append((name, dtype.str, int(width)))
    return tuple(out)


def partitions_arg(partitions, info: TableRecord) -> np.ndarray:
    """``read_keyed(partitions=)`` as a sorted unique int64 array, each in [0, partitions)."""
    try:
        arr = np.unique(np.asarray(list(partitions) if not isinstance(partitions, np.ndarray) else partitions))
    except TypeError:
        raise InvalidArgument(f"partitions must be an iterable of partition numbers, got {partitions!r}") from None
    if arr.size and (arr.dtype.kind not in "iu" or arr.min() < 0 or arr.max() >= info.partitions):
        raise InvalidArgument(f"partitions of table {info.name!r} are ints in [0, {info.partitions}), got "
                              f"{arr[:5].tolist()}")
    return arr.astype(np.int64)


def column_bytes(info: TableRecord) -> int:
    """Bytes of one key's columns."""
    return sum(np.dtype(dt).itemsize * w for _n, dt, w in info.columns)


def value_bytes(info: TableRecord, codec) -> int:
    """Bytes of one key's encoded value (0 for a table of dim 0: its rows are their columns)."""
    return codec.row_bytes(info.dim) if info.dim else 0


def row_width(info: TableRecord, codec) -> int:
    """Bytes of one key's row in a record of ``codec``."""
    return value_bytes(info, codec) + column_bytes(info)


def check_columns(info: TableRecord, columns, n: int) -> dict:
    """``columns`` ({name: array-like}) as {name: C-contiguous array (n, width) of the column's dtype}: every
    column of the table given, none other, each value representable in its dtype; InvalidArgument otherwise."""
    from .arguments import to_numpy

    given = dict(columns or {})
    names = [c[0] for c in info.columns]
    unknown = sorted(set(given) - set(names))
    if unknown:
        raise InvalidArgument(f"table {info.name!r} has no column {unknown[0]!r}; its columns are {names}")
    missing = [c for c in names if c not in given]
    if missing:
        raise InvalidArgument(f"put_keys into table {info.name!r} needs every column; {missing[0]!r} is missing "
                              "(a key's row is its value and all its columns)")
    out = {}
    for name, dt, width in info.columns:
        arr = to_numpy(given[name], f"column {name!r} of table {info.name!r}")
        if arr.shape not in ((n, width),) + (((n,),) if width == 1 else ()):
            raise InvalidArgument(f"column {name!r} of table {info.name!r} must have shape ({n}, {width})"
                                  + (f" or ({n},)" if width == 1 else "") + f", got {arr.shape}")
        dtype = np.dtype(dt)
        if arr.dtype.kind not in "biuf":
            raise InvalidArgument(f"column {name!r} of table {info.name!r} must be numeric, got dtype {arr.dtype}")
        with np.errstate(all="ignore"):
            cast = np.ascontiguousarray(arr, dtype=dtype).reshape(n, width)
            same = cast.reshape(arr.shape).astype(arr.dtype) == arr
        if arr.dtype.kind == "f":
            same |= np.isnan(arr) & np.isnan(cast.reshape(arr.shape).astype(np.float64))
        if not np.all(same):
            i = int(np.flatnonzero(~same.reshape(n, -1).all(axis=1))[0])
            raise InvalidArgument(f"column {name!r} of table {info.name!r}: the value of entry {i} does not fit "
                                  f"its dtype {dtype} exactly")
        out[name] = cast
    return out


def encode_rows(info: TableRecord, codec, values: np.ndarray, columns: dict) -> np.ndarray:
    """uint8 (n, row_width): each key's encoded value, then its columns' bytes (``columns`` checked), laid out
    in one array written once (fp32 values and the columns are copied in, not concatenated)."""
    n = values.shape[0]
    width = value_bytes(info, codec)
    out = np.empty((n, width + column_bytes(info)), np.uint8)
    if width:
        if codec.name == "fp32":
            out[:, :width].view("<f4")[...] = values
        else:
            out[:, :width] = codec.encode(values, check=False).reshape(n, width)
    at = width
    for name, dt, w in info.columns:
        size = np.dtype(dt).itemsize * w
        out[:, at:at + size] = columns[name].view(np.uint8).reshape(n, size)
        at += size
    return out


def new_columns(columns: tuple, n: int, make=np.zeros) -> dict:
    """{name: array (n,) for a column of width 1, else (n, width), of its dtype} for catalog ``columns``
    ((name, dtype, width), ...): what reads return, made by ``make`` (np.zeros, or np.empty to be filled)."""
    return {name: make((n,) if w == 1 else (n, w), np.dtype(dt)) for name, dt, w in columns}


def decode_rows(info: TableRecord, codec, rows: np.ndarray, keys: np.ndarray) -> KeyedRows:
    """The KeyedRows of ``rows`` (uint8 (n, row_width) in ``codec``) of ``keys``: arrays of their own, never
    views of a segment."""
    n = rows.shape[0]
    values = np.zeros((n, info.dim), np.float32)
    columns = new_columns(info.columns, n)
    decode_into(info, codec, rows, slice(None), values, columns)
    return KeyedRows(keys, values, columns)


def decode_into(info: TableRecord, codec, rows: np.ndarray, dest: np.ndarray, values: np.ndarray,
                columns: dict) -> None:
    """Decode ``rows`` (uint8 (n, row_width) in ``codec``) straight into ``values[dest]`` and each
    ``columns[name][dest]``: fp32 values and the columns are viewed in place and copied once (a whole-table read
    of many partitions costs one copy of the table, not one per step)."""
    n = rows.shape[0]
    width = value_bytes(info, codec)
    if n and width:
        if codec.name == "fp32":
            values[dest] = rows[:, :width].view("<f4")
        else:
            values[dest] = codec.decode(np.ascontiguousarray(rows[:, :width]), info.dim)
    at = width
    for name, dt, w in info.columns:
        size = np.dtype(dt).itemsize * w
        col = rows[:, at:at + size].view(np.dtype(dt))
        columns[name][dest] = col[:, 0] if w == 1 else col
        at += size


def recode(info: TableRecord, run: keyed_runs.KeyRun, codec, to) -> keyed_runs.KeyRun:
    """``run`` (rows in ``codec``) with its values re-encoded in ``to``: only ever fp32, which holds every
    codec's decoded values exactly, so that the run reads back bit for bit."""
    if codec is to or not info.dim:
        return run
    assert to.name == "fp32"
    value_bytes = codec.row_bytes(info.dim)
    decoded = codec.decode(np.ascontiguousarray(run.values[:, :value_bytes]), info.dim)
    decoded[run.deleted] = 0
    rows = np.concatenate([to.encode(decoded, check=False).reshape(run.count, -1), run.values[:, value_bytes:]], axis=1)
    return run._replace(values=np.ascontiguousarray(rows))


def common_codec(info: TableRecord, runs: list) -> tuple:
    """(codec, runs in it) for ``runs`` ((codec, KeyRun) pairs, oldest first): their one codec, or fp32."""
    ids = {c.codec_id for c, _r in runs}
    if len(ids) == 1:
        return runs[0][0], [r for _c, r in runs]
    fp32 = codecs.get("fp32")
    return fp32, [recode(info, r, c, fp32) for c, r in runs]


def build(info: TableRecord, codec, partition: int, version: int, run: keyed_runs.KeyRun, *, baseline: bool,
          compacted: bool = False) -> tuple[tuple[int, int, int], list, int]:
    """((partition, count, flags), buffers, length) of the record holding ``run``: what writer._append and
    compaction append. A baseline holds no deletion (``keyed_runs.live`` first)."""
    flags = record.FLAG_KEYS | (record.FLAG_BASELINE if baseline else 0) | (record.FLAG_COMPACTED if compacted else 0)
    assert not baseline or not run.deleted.any()
    body = np.ascontiguousarray(run.values[~run.deleted]).reshape(-1).view(np.uint8) if run.deleted.any() \
        else np.ascontiguousarray(run.values).reshape(-1)
    buffers, length = record.keys_record(codec.codec_id, flags, info.id, partition, version, run.count,
                                         keyed_runs.encode_keys(run), body)
    if length > (1 << 32) - 1:
        raise InvalidArgument(f"partition {partition} of keyed table {info.name!r} encodes to {length} bytes, more "
                              "than a record holds; create the table with more partitions")
    return (partition, run.count, flags), buffers, length


def parse_run(rec: record.Record, info: TableRecord, where: str) -> tuple:
    """(codec, KeyRun) of key-run record ``rec`` of table ``info``; CorruptionError naming ``where`` if it is
    not one (no FLAG_KEYS, an unknown codec, lengths, key order, a key outside its partition)."""
    if not rec.flags & record.FLAG_KEYS:
        raise CorruptionError(f"{where}: the record of keyed table {info.name!r} partition {rec.block} holds "
                              "rows, not a key run: the store is damaged", where, None)
    try:
        codec = codecs.by_id(rec.codec_id)
    except InvalidArgument:
        raise CorruptionError(f"{where}: record names unknown codec id {rec.codec_id}", where, None) from None
    run = keyed_runs.decode_keys(rec.aux, rec.body, row_width(info, codec), where)
    if run.count and (keyed_runs.partition_of(run.keys, info.partitions) != rec.block).any():
        raise CorruptionError(f"{where}: the key run of partition {rec.block} of table {info.name!r} holds a key of "
                              "another partition: the store is damaged", where, None)
    if rec.flags & record.FLAG_BASELINE and run.deleted.any():
        raise CorruptionError(f"{where}: a baseline key run holds a deletion: the store is damaged", where, None)
    return codec, run
