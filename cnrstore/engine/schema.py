"""The index schema: what each value of the index holds, named and checked in one place (docs/FORMAT.md,
"Index (LMDB)").

index.py keeps the bytes under their keys (only it imports lmdb); this module says what the values are:

* ``MetaKey``: each key of the ``meta`` database with its default, its check and (for a map) how it reads
  back. ``BYTES_WRITTEN.get(view)`` reads one, ``BYTES_WRITTEN.put(w, n)`` writes it: no other module
  spells a meta key.
* ``TableRecord``: a ``tables`` entry (the table catalog), frozen: tables never change once created.
  COMMIT and ANCHOR records carry the same entries (``as_dict`` / ``table_from_log``).
* The checks of every msgpack value, applied where index.py decodes it: a well-formed value of the wrong
  shape -- a string for an int, a negative row count, a dim of 2**40, an unknown codec -- is IndexDamaged
  naming the database, key and field, never an untyped error (or a huge allocation) in the code that uses
  it (docs/DESIGN.md "Security"). A few type and range comparisons per value; extra fields are ignored (a
  newer writer may add some).

On disk: the key names and field names here are never renamed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .. import codecs
from . import record
from ..errors import CorruptionError, IndexDamaged
from ..types import TableInfo

_U32, _U64 = (1 << 32) - 1, (1 << 64) - 1
#: Rows a ROWS record (and so a block) holds at most: its row offsets are u16.
MAX_ROW_COUNT = 1 << 16
#: One fp32 row (the widest codec at large dims) must fit a record: u32 length less header, trailer and
#: one u16 offset (docs/FORMAT.md, "Limits").
MAX_DIM = (_U32 - record.HEADER_BYTES - record.TRAILER_BYTES - 2) // 4
_MAX_NUM_ROWS = (1 << 63) - 1  # row ids are int64
#: A committed segment length: a record starts at a u32 offset and is at most u32 bytes long.
_MAX_SEGMENT_LENGTH = 2 * _U32
#: Unix seconds before the year 10000 (what datetime can show).
_MAX_TIME = 253402300799.0
_MIN_STEP = -(1 << 63)
_MAX_BYTE_COUNT = 1 << 62


def damaged(db: str, key, field: str | None, value, want: str) -> IndexDamaged:
    """The IndexDamaged for index value ``db[key]`` (its ``field``, if given) holding ``value`` instead of ``want``."""
    what = f"index value {db}[{key!r}]" + (f" field {field!r}" if field is not None else "")
    return IndexDamaged(f"{what} is {_shown(value)}, not {want}: the index is damaged; run `cnrstore verify`, "
                        "then `cnrstore repair`", None, None)


def _shown(value) -> str:
    shown = repr(value)
    return shown if len(shown) <= 80 else shown[:77] + "..."


def _is_int(value, lo: int, hi: int) -> bool:
    return type(value) is int and lo <= value <= hi  # noqa: E721 - bool is not an int here


def _is_time(value) -> bool:
    return (type(value) is float or type(value) is int) and 0 <= value <= _MAX_TIME  # noqa: E721 (NaN fails)


def _is_str_list(value) -> bool:
    return type(value) is list and all(type(x) is str for x in value)  # noqa: E721


def _field(db: str, key, info, field: str, ok, want: str, fail: Callable = damaged):
    if field not in info:
        raise fail(db, key, field, "missing", want)
    value = info[field]
    if not ok(value):
        raise fail(db, key, field, value, want)
    return value


def _check_map(db: str, key, info, fail: Callable = damaged) -> dict:
    if type(info) is not dict:  # noqa: E721
        raise fail(db, key, None, info, "a map")
    return info


# the table catalog -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TableRecord:
    """A table's catalog record: its id (u32, the first field of its row-index keys), name, shape
    (``num_rows`` rows of ``dim`` values), default codec, rows per block (a power of two) and creation time
    (unix seconds). The fields are the ``tables`` entry's msgpack map, in the order it is stored."""

    id: int
    name: str
    num_rows: int
    dim: int
    codec: str
    block_rows: int
    created: float
    #: Format 4: a keyed table (rows addressed by int64 keys, engine/keyed_records.py). Its ``num_rows`` is its
    #: partition count and ``block_rows`` 1, so that its blocks are its partitions.
    keyed: bool = False
    #: A keyed table's per-key columns stored beside each value, losslessly: (name, numpy dtype string, width).
    columns: tuple = ()

    def as_dict(self) -> dict:
        """The entry as stored (in ``tables``, and in COMMIT and ANCHOR records): on disk, never reorder. A
        keyed table's entry adds "keyed" and "columns" (a positional table's is as format 3 wrote it)."""
        out = {"id": self.id, "name": self.name, "num_rows": self.num_rows, "dim": self.dim, "codec": self.codec,
               "block_rows": self.block_rows, "created": self.created}
        if self.keyed:
            out["keyed"] = True
            out["columns"] = [list(c) for c in self.columns]
        return out

    @property
    def partitions(self) -> int:
        """A keyed table's partition count (its blocks)."""
        return self.num_rows

    def info(self) -> TableInfo:
        """The public TableInfo (API.md) of this table."""
        if self.keyed:
            return TableInfo(self.name, 0, self.dim, self.codec, 1, keyed=True, partitions=self.num_rows,
                             columns=self.columns)
        return TableInfo(self.name, self.num_rows, self.dim, self.codec, self.block_rows)


_CODEC_NAMES = frozenset(codecs.names())


def check_table(name: str, info, fail: Callable = damaged) -> TableRecord:
    """The TableRecord of ``tables`` value ``info`` under key ``name``: id in [1, 2**32), name (its key),
    num_rows in [1, 2**63-1], dim in [1, MAX_DIM], a known codec, block_rows a power of two in [1, 2**16],
    created unix seconds. ``fail(db, key, field, value, want)`` builds the error (default: IndexDamaged)."""
    _check_map("tables", name, info, fail)
    return TableRecord(
        _field("tables", name, info, "id", lambda v: _is_int(v, 1, _U32), "a table id in [1, 2**32)", fail),
        _field("tables", name, info, "name", lambda v: v == name, f"the table's key {name!r}", fail),
        _field("tables", name, info, "num_rows", lambda v: _is_int(v, 1, _MAX_NUM_ROWS), "a row count in [1, 2**63-1]",
               fail),
        _field("tables", name, info, "dim", lambda v: _is_int(v, 0 if "keyed" in info else 1, MAX_DIM),
               f"a dim in [1, {MAX_DIM}] (a keyed table's: [0, {MAX_DIM}])", fail),
        _field("tables", name, info, "codec", lambda v: type(v) is str and v in _CODEC_NAMES,  # noqa: E721
               "the name of a codec this cnrstore knows", fail),
        _field("tables", name, info, "block_rows", lambda v: _is_int(v, 1, MAX_ROW_COUNT) and not v & (v - 1),
               f"a power of two in [1, {MAX_ROW_COUNT}]", fail),
        _field("tables", name, info, "created", _is_time, "unix seconds", fail),
        *_keyed_fields(name, info, fail))


#: numpy dtypes a keyed table's column may have (little-endian numbers and bools)
COLUMN_DTYPES = frozenset(["|b1", "|i1", "|u1", "<i2", "<u2", "<i4", "<u4", "<i8", "<u8", "<f2", "<f4", "<f8"])
#: at most this many columns, each at most this wide (elements per key)
MAX_COLUMNS, MAX_COLUMN_WIDTH = 64, 1 << 16


def _is_column(c) -> bool:
    return (type(c) is list and len(c) == 3 and type(c[0]) is str and 0 < len(c[0]) <= 100  # noqa: E721
            and c[1] in COLUMN_DTYPES and _is_int(c[2], 1, MAX_COLUMN_WIDTH))


def _keyed_fields(name: str, info: dict, fail: Callable) -> tuple:
    """(keyed, columns) of a catalog entry: absent in a positional table's; a keyed table's has 1 row per
    block and unique column names."""
    if "keyed" not in info:
        return ()
    _field("tables", name, info, "keyed", lambda v: v is True, "true", fail)
    _field("tables", name, info, "block_rows", lambda v: v == 1, "1 (a keyed table's blocks are its partitions)",
           fail)
    _field("tables", name, info, "num_rows", lambda v: _is_int(v, 1, 1 << 31), "a partition count in [1, 2**31]",
           fail)
    columns = _field("tables", name, info, "columns",
                     lambda v: type(v) is list and len(v) <= MAX_COLUMNS and all(map(_is_column, v))  # noqa: E721
                     and len({c[0] for c in v}) == len(v),
                     f"a list of at most {MAX_COLUMNS} [name, dtype, width] with unique names", fail)
    return True, tuple((c[0], c[1], c[2]) for c in columns)


def table_from_log(info) -> TableRecord:
    """The TableRecord of a catalog entry of a COMMIT or ANCHOR record, checked as a ``tables`` value is;
    CorruptionError (a bad log record body) otherwise."""
    name = info.get("name") if type(info) is dict else None  # noqa: E721
    if type(name) is not str:  # noqa: E721 - (the index's key is the name: check_table compares with it)
        raise _bad_log_entry("tables", None, "name", name, "a table name")
    return check_table(name, info, _bad_log_entry)


def _bad_log_entry(_db, key, field, value, want) -> CorruptionError:
    what = f"catalog entry {key!r}" + (f" field {field!r}" if field is not None else "")
    return CorruptionError(f"bad log record body: {what} is {_shown(value)}, not {want}", None, None)


# versions and segments ---------------------------------------------------------------------------------
def check_version(version: int, info) -> dict:
    """A ``versions`` value: step (int64 or uint64, or nil), meta (map or nil), created, parent (a smaller
    version, or nil), tables and dense (lists of names), bytes (u64)."""
    _check_map("versions", version, info)
    _field("versions", version, info, "step", lambda v: v is None or _is_int(v, _MIN_STEP, _U64),
           "an integer step or nil")
    _field("versions", version, info, "meta", lambda v: v is None or type(v) is dict, "a map or nil")  # noqa: E721
    _field("versions", version, info, "created", _is_time, "unix seconds")
    _field("versions", version, info, "parent", lambda v: v is None or _is_int(v, 0, version - 1),
           f"a version below {version}, or nil")
    _field("versions", version, info, "tables", _is_str_list, "a list of table names")
    _field("versions", version, info, "dense", _is_str_list, "a list of dense array names")
    _field("versions", version, info, "bytes", lambda v: _is_int(v, 0, _U64), "a byte count")
    return info


def check_segment(segment: int, info) -> int:
    """A ``segments`` value: {"length": committed length}; returns the length."""
    _check_map("segments", segment, info)
    return _field("segments", segment, info, "length", lambda v: _is_int(v, 0, _MAX_SEGMENT_LENGTH),
                  f"a segment length in [0, {_MAX_SEGMENT_LENGTH}]")


def _count(v) -> bool:
    return _is_int(v, 0, _U64)


def _byte_count(v) -> bool:  # a counter that commits add to: far below 2**64, so that a sum never overflows
    return _is_int(v, 0, _MAX_BYTE_COUNT)


def _segment_id(v) -> bool:  # row and dense index values hold segment ids as u32
    return _is_int(v, 0, _U32)


def _id_map(v) -> bool:  # doomed_segments: segment id -> id of the transaction that freed it
    return type(v) is dict and all(_segment_id(k) and _count(t) for k, t in v.items())  # noqa: E721


def _segment_ids(v) -> bool:
    return (type(v) is dict and _segment_id(v.get("high"))  # noqa: E721
            and type(v.get("pending")) is list and all(map(_segment_id, v["pending"])))  # noqa: E721


def _last_baseline(v) -> bool:
    return type(v) is dict and _count(v.get("version")) and _count(v.get("bytes"))  # noqa: E721


def _damaged_item(item) -> bool:
    if type(item) is not dict or type(item.get("why")) is not str:  # noqa: E721
        return False
    if "table" in item:
        return _is_int(item["table"], 0, _U32) and _count(item.get("block"))
    return _is_int(item.get("dense"), 0, _U32)


def _damaged_map(v) -> bool:  # {version: [{"table": id, "block": b, "why": str} or {"dense": id, "why": str}]}
    return type(v) is dict and all(_count(k) and type(items) is list and all(map(_damaged_item, items))  # noqa: E721
                                   for k, items in v.items())


# meta --------------------------------------------------------------------------------------------------
class MetaKey:
    """One key of the ``meta`` database: its name (on disk), the default ``get`` returns while it is
    absent, its check (``ok(value)``; ``want`` says what it must be) and, for a map, how it reads back."""

    def __init__(self, name: str, ok: Callable[[object], bool], want: str, default=None,
                 convert: Callable | None = None):
        self.name, self.ok, self.want, self.default, self._convert = name, ok, want, default, convert

    def get(self, view, default=None):
        """The value in ``view`` (an IndexView or IndexWriter), checked; absent: ``default``, else the key's."""
        value = view.meta(self.name)
        if value is None:
            value = self.default if default is None else default
            return dict(value) if type(value) is dict else value  # noqa: E721 - never the shared default
        return self._convert(value) if self._convert is not None else value

    def put(self, w, value) -> None:
        """Write ``value`` in the write transaction ``w``."""
        w.put_meta(self.name, value)

    def __repr__(self) -> str:
        return f"MetaKey({self.name!r})"


FORMAT = MetaKey("format", lambda v: _is_int(v, 1, _U32), "a format version")
#: the next version number a checkpoint gets (advanced durably when its writer opens: never reused)
NEXT_VERSION = MetaKey("next_version", lambda v: _is_int(v, 1, _U64), "a version in [1, 2**64)", 1)
NEXT_TABLE_ID = MetaKey("next_table_id", lambda v: _is_int(v, 1, 1 << 32), "a table id in [1, 2**32]", 1)
NEXT_DENSE_ID = MetaKey("next_dense_id", lambda v: _is_int(v, 1, 1 << 32), "a dense id in [1, 2**32]", 1)
#: every byte appended to the log (checkpoints, compaction, GC copies)
BYTES_WRITTEN = MetaKey("bytes_written", _byte_count, "a byte count below 2**62", 0)
#: the bytes the checkpoints' records would take holding only their own rows (format 3; absent in a store
#: written before it: read it with bytes_written as the default)
INCREMENT_BYTES = MetaKey("increment_bytes", _byte_count, "a byte count below 2**62")
#: the bytes checkpoints appended (their records, merges a save had to write itself, COMMIT records;
#: absent in a store written before it: read it with bytes_written as the default)
SAVE_BYTES = MetaKey("save_bytes", _byte_count, "a byte count below 2**62")
#: the bytes background merges appended (merge.py, compaction.merge_chains)
MERGE_BYTES = MetaKey("merge_bytes", _byte_count, "a byte count below 2**62", 0)
DROPPED_BELOW = MetaKey("dropped_below", _count, "a version", 0)
DROP_SEQ = MetaKey("drop_seq", _count, "a sequence number", 0)
MAX_DELETED_SEGMENT = MetaKey("max_deleted_segment", _segment_id, "a segment id (u32)", 0)
#: segment id -> id of the transaction that freed it (its file waits for readers older than that)
DOOMED_SEGMENTS = MetaKey("doomed_segments", _id_map, "a map of segment id to transaction id", {},
                          lambda v: {int(k): t for k, t in v.items()})
SEGMENT_IDS = MetaKey("segment_ids", _segment_ids, '{"high": segment id, "pending": [segment id, ...]} (u32 ids)')
#: {"version", "bytes"} of the newest materialized baseline
LAST_BASELINE = MetaKey("last_baseline", _last_baseline, '{"version": version, "bytes": byte count}')
#: written by repair only: {version: [{"table": id, "block": b, "why": str} or {"dense": id, "why": str}]}
DAMAGED = MetaKey("damaged", _damaged_map, 'a map of version to [{"table", "block", "why"} or {"dense", "why"}, ...]',
                  {})

#: every ``meta`` key this cnrstore reads (docs/FORMAT.md), by name
META_KEYS = {key.name: key for key in (FORMAT, NEXT_VERSION, NEXT_TABLE_ID, NEXT_DENSE_ID, BYTES_WRITTEN,
                                       INCREMENT_BYTES, SAVE_BYTES, MERGE_BYTES, DROPPED_BELOW, DROP_SEQ, MAX_DELETED_SEGMENT,
                                       DOOMED_SEGMENTS, SEGMENT_IDS, LAST_BASELINE, DAMAGED)}


def check_meta(name: str, value):
    """``value`` of meta key ``name``, checked (a key this cnrstore does not know passes unchecked)."""
    key = META_KEYS.get(name)
    if key is not None and not key.ok(value):
        raise damaged("meta", name, None, value, key.want)
    return value
