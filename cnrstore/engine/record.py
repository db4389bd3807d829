"""Layer 1 — the bytes of one record. docs/FORMAT.md is the byte-level specification; keep both in step.

A record is::

    header  40 bytes, little-endian (HEADER below)
    aux     aux_len bytes   ROWS: with FLAG_DELTA, first the base version and the rows copied since
                            it (u64 LE each); then the row
                            offsets in the block, u16 LE, sorted, unique (absent when FLAG_FULL:
                            the record holds rows 0..count-1)
                            DENSE: msgpack {"dtype": str, "shape": [int, ...]}
                            COMMIT, ANCHOR, DROP: empty
    body    body_len bytes  ROWS: count encoded rows of the codec, row after row
                            DENSE: the array's raw bytes, C order
                            COMMIT, ANCHOR, DROP: a msgpack map (docs/FORMAT.md), what repair rebuilds from
    xxh3    8 bytes, u64 LE: XXH3-64 (seed 0) of every preceding byte of the record
"""

from __future__ import annotations

import struct
from typing import NamedTuple

import msgpack
import numpy as np
import xxhash

from ..errors import CorruptionError
from .msgpack_safe import unpack_bounded

# On disk: never change these values. -------------------------------------------------------------
MAGIC = b"CNRr"
KIND_ROWS = 1
KIND_DENSE = 2
#: A version's catalog facts (step, meta, parent, tables, blocks written): appended by each commit.
KIND_COMMIT = 3
#: The head of every block's read chain at a version after compaction there: appended by compaction.
KIND_ANCHOR = 4
#: The versions kept after versions were dropped (retain, a retention policy): appended by each drop.
KIND_DROP = 5
_KINDS = (KIND_ROWS, KIND_DENSE, KIND_COMMIT, KIND_ANCHOR, KIND_DROP)
#: The record holds every row of its block as of its version: a read walking back stops here.
FLAG_BASELINE = 0x1
#: Rows are 0..count-1 of the block; no offsets are stored.
FLAG_FULL = 0x2
#: Written by compaction (a materialized baseline) rather than by a checkpoint.
FLAG_COMPACTED = 0x4
#: Format 3: a cumulative delta. The record holds every row of its block written in (base, version], where
#: base (u64, first in aux) is the version of a baseline record of the block: a read walking back from here
#: goes on at the block's record at version base, skipping the records in between.
FLAG_DELTA = 0x8
#: Format 4: a key run of a keyed table (engine/keyed_records.py): the block is a hash partition, aux holds
#: the run's keys and deletion flags, the body the rows of the keys put. Never with FULL or DELTA.
FLAG_KEYS = 0x10
_KNOWN_FLAGS = FLAG_BASELINE | FLAG_FULL | FLAG_COMPACTED | FLAG_DELTA | FLAG_KEYS
#: The head of a DELTA record's aux: base version u64, rows copied by the block's deltas since that base u64.
BASE = struct.Struct("<QQ")

#: magic, kind u8, codec u8, flags u16, object_id u32, count u32, block u64, version u64,
#: aux_len u32, body_len u32
HEADER = struct.Struct("<4sBBHIIQQII")
CHECKSUM = struct.Struct("<Q")
HEADER_BYTES = HEADER.size  # 40
TRAILER_BYTES = CHECKSUM.size  # 8
OFFSET_DTYPE = np.dtype("<u2")

assert HEADER_BYTES == 40


class Record(NamedTuple):
    """A parsed, checksum-verified record. ``aux`` and ``body`` are read-only uint8 views.

    (A NamedTuple rather than a dataclass: a read builds one per record it visits, and this is the
    cheapest immutable record Python has.)
    """

    kind: int
    codec_id: int
    flags: int
    object_id: int
    count: int
    block: int
    version: int
    aux: np.ndarray
    body: np.ndarray

    def offsets(self) -> np.ndarray:
        """Row offsets inside the block (int64, sorted); for a FULL record, 0..count-1. Not for a key run
        (FLAG_KEYS): keyed_records.parse_run reads those."""
        assert not self.flags & FLAG_KEYS, "a key run has no row offsets"
        if self.flags & FLAG_FULL:
            return np.arange(self.count, dtype=np.int64)
        return self.stored_offsets().astype(np.int64)

    def stored_offsets(self) -> np.ndarray:
        """The stored u16 row offsets as a view (no copy); only for records without FLAG_FULL."""
        return self.aux[BASE.size:].view(OFFSET_DTYPE) if self.flags & FLAG_DELTA else self.aux.view(OFFSET_DTYPE)

    def base(self) -> int:
        """The base version of a cumulative delta (FLAG_DELTA), else 0."""
        return BASE.unpack_from(self.aux, 0)[0] if self.flags & FLAG_DELTA else 0

    def copied(self) -> int:
        """Rows the block's deltas copied from older records since the delta's base, this one's included
        (what merge.py's reset rule weighs against a new baseline); 0 for other records."""
        return BASE.unpack_from(self.aux, 0)[1] if self.flags & FLAG_DELTA else 0

    def dense_descriptor(self) -> dict:
        """The DENSE record's ``{"dtype", "shape"}``, checked as untrusted data: a numeric or bool dtype
        string, a shape of at most 64 non-negative ints whose product times the itemsize is the body's
        length. CorruptionError otherwise (without path: callers add theirs)."""
        desc = unpack_bounded(self.aux, what="dense descriptor")
        try:
            if not isinstance(desc, dict) or not isinstance(desc.get("dtype"), str) or len(desc["dtype"]) > 16:
                raise ValueError("not a map with a dtype string")
            dtype = np.dtype(desc["dtype"])
            shape = desc.get("shape")
            if dtype.hasobject or dtype.fields is not None or dtype.subdtype is not None or dtype.kind not in "biufc":
                raise ValueError(f"dtype {desc['dtype']!r} is not numeric")
            if not isinstance(shape, list) or len(shape) > 64 or not all(
                    isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2 ** 63 for d in shape):
                raise ValueError(f"shape {shape!r} is not a list of sizes")
            size = dtype.itemsize
            for d in shape:
                size *= d
            if size != self.body.size:
                raise ValueError(f"dtype {dtype} and shape {shape} make {size} bytes, the body holds {self.body.size}")
        except (ValueError, TypeError) as exc:
            raise CorruptionError(f"bad dense descriptor: {exc}", None, None) from None
        return {"dtype": desc["dtype"], "shape": shape}


def rows_aux_bytes(flags: int, count: int) -> int:
    """The aux length a ROWS record of ``count`` rows (or keys) with ``flags`` has: u16 offsets unless FULL,
    a delta's base and copied count; a key run's count, keys and deletion bitmap (FLAG_KEYS). -1 (no length)
    for flags a record never has together."""
    if flags & FLAG_KEYS:
        return -1 if flags & (FLAG_FULL | FLAG_DELTA) else 8 + 8 * count + (count + 7) // 8
    return (0 if flags & FLAG_FULL else 2 * count) + (BASE.size if flags & FLAG_DELTA else 0)


def keys_record(codec_id: int, flags: int, table_id: int, partition: int, version: int, count: int, aux: bytes,
                body: np.ndarray) -> tuple[list, int]:
    """Buffers of one key-run record (FLAG_KEYS set in ``flags``): ``aux`` the run's keys and deletion
    flags (keyed_runs.encode_keys), ``body`` C-contiguous uint8 rows of the keys put; and its length."""
    assert flags & FLAG_KEYS and not flags & (FLAG_FULL | FLAG_DELTA)
    return _assemble(KIND_ROWS, codec_id, flags, table_id, count, partition, version, aux, body)


def rows_record(
    codec_id: int, flags: int, object_id: int, block: int, version: int, offsets: np.ndarray | None,
    body: np.ndarray, base: int = 0, copied: int = 0,
) -> tuple[list, int]:
    """Buffers of one ROWS record (header+offsets, body, checksum) and its total length.

    ``offsets`` (row offsets in the block, sorted) must be None exactly when ``flags`` has FLAG_FULL;
    ``base`` (> 0) exactly when ``flags`` has FLAG_DELTA (and then ``copied``, see Record.copied);
    ``body`` is a C-contiguous uint8 ``(count, row_bytes)`` array of the encoded rows. The body is not
    copied: the buffers are written with one gathered write.
    """
    count = body.shape[0]
    aux = b"" if offsets is None else np.ascontiguousarray(offsets, dtype=OFFSET_DTYPE).tobytes()
    if flags & FLAG_DELTA:
        aux = BASE.pack(base, copied) + aux
    return _assemble(KIND_ROWS, codec_id, flags, object_id, count, block, version, aux, body)


def dense_record(object_id: int, version: int, array: np.ndarray) -> tuple[list, int]:
    """Buffers of one DENSE record holding ``array`` exactly (dtype, shape and bytes), and its length."""
    arr = np.ascontiguousarray(array).reshape(np.shape(array))  # ascontiguousarray makes 0-d arrays 1-d
    aux = msgpack.packb({"dtype": arr.dtype.str, "shape": list(arr.shape)})
    body = arr.reshape(-1).view(np.uint8)
    return _assemble(KIND_DENSE, 0, 0, object_id, 0, 0, version, aux, body)


def log_record(kind: int, version: int, body: dict) -> tuple[list, int]:
    """Buffers of one COMMIT, ANCHOR or DROP record (msgpack ``body``, stamped with ``version``) and its length."""
    payload = np.frombuffer(msgpack.packb(body, use_bin_type=True), dtype=np.uint8)
    return _assemble(kind, 0, 0, 0, 0, 0, version, b"", payload)


def log_body(rec: Record) -> dict:
    """The msgpack map of a COMMIT, ANCHOR or DROP record, decoded within bounds and checked against its
    layout (docs/FORMAT.md): CorruptionError for anything else."""
    body = unpack_bounded(rec.body, what="log record body")
    check_log_body(rec.kind, body)
    return body


def _is_uint(x, bits: int = 64) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1 << bits


def _check_arrays(packed, dtypes: tuple) -> None:
    """A "blocks array" list: byte strings of little-endian arrays of ``dtypes``, of equal length."""
    if not isinstance(packed, list) or len(packed) != len(dtypes) or not all(isinstance(b, bytes) for b in packed):
        raise ValueError("not a list of packed arrays")
    lengths = set()
    for b, dt in zip(packed, dtypes):
        if len(b) % np.dtype(dt).itemsize:
            raise ValueError("a packed array's length is not a multiple of its item size")
        lengths.add(len(b) // np.dtype(dt).itemsize)
    if len(lengths) != 1:
        raise ValueError("packed arrays of unequal length")


def _check_catalog(catalog) -> None:
    if not isinstance(catalog, list):
        raise ValueError("catalog is not a list")
    for info in catalog:
        if not isinstance(info, dict) or not _is_uint(info.get("id"), 32) or not isinstance(info.get("name"), str) \
                or not _is_uint(info.get("num_rows"), 63) or not _is_uint(info.get("dim"), 32) \
                or not isinstance(info.get("codec"), str) or not _is_uint(info.get("block_rows"), 32):
            raise ValueError("a catalog entry is not {id, name, num_rows, dim, codec, block_rows}")


def _check_id_map(m, key_is_str: bool) -> None:
    if not isinstance(m, dict) or not all((isinstance(k, str) if key_is_str else _is_uint(k)) and _is_uint(v)
                                          for k, v in m.items()):
        raise ValueError("an id map is malformed")


def check_log_body(kind: int, body) -> None:
    """CorruptionError unless ``body`` has the layout docs/FORMAT.md gives a COMMIT, ANCHOR or DROP body
    (the fields readers use, of their types; unknown fields are allowed)."""
    try:
        if not isinstance(body, dict):
            raise ValueError("not a map")
        if kind == KIND_COMMIT:
            if not _is_uint(body.get("version")) or not (body.get("parent") is None or _is_uint(body.get("parent"))):
                raise ValueError("version or parent is not a version number")
            for key in ("tables", "dense"):
                if not isinstance(body.get(key, []), list) or not all(isinstance(n, str) for n in body.get(key, [])):
                    raise ValueError(f"{key} is not a list of names")
            if not (body.get("meta") is None or isinstance(body.get("meta"), dict)):
                raise ValueError("meta is not a map")
            _check_catalog(body.get("catalog", []))
            _check_id_map(body.get("dense_ids", {}), True)
            blocks = body.get("blocks", {})
            if not isinstance(blocks, dict) or not all(_is_uint(k, 32) for k in blocks):
                raise ValueError("blocks is not a map of table ids")
            for packed in blocks.values():
                _check_arrays(packed, ("<u8", "<u4", "<u1"))
        elif kind == KIND_ANCHOR:
            if not _is_uint(body.get("version")) or not _is_uint(body.get("dropped_below", 0)):
                raise ValueError("version or dropped_below is not a version number")
            _check_catalog(body.get("catalog", []))
            _check_id_map(body.get("dense_names", {}), True)
            _check_id_map(body.get("dense", {}), False)
            heads = body.get("heads", {})
            if not isinstance(heads, dict) or not all(_is_uint(k, 32) for k in heads):
                raise ValueError("heads is not a map of table ids")
            for packed in heads.values():
                _check_arrays(packed, ("<u8", "<u8", "<u4", "<u1"))
        elif kind == KIND_DROP:
            if not _is_uint(body.get("seq")) or not _is_uint(body.get("latest")) \
                    or not isinstance(body.get("kept"), list) or not all(_is_uint(v) for v in body["kept"]):
                raise ValueError("seq, latest or kept is malformed")
        else:
            raise ValueError(f"record kind {kind} has no log body")
    except (ValueError, TypeError, AttributeError) as exc:
        raise CorruptionError(f"bad log record body: {exc}", None, None) from None


def _assemble(kind, codec_id, flags, object_id, count, block, version, aux: bytes, body: np.ndarray):
    """Buffers of one record (header+aux, body, checksum) and its length; ``body`` is C-contiguous uint8."""
    body_len = body.nbytes
    header = HEADER.pack(MAGIC, kind, codec_id, flags, object_id, count, block, version, len(aux), body_len)
    h = xxhash.xxh3_64(header)
    h.update(aux)
    h.update(body)
    trailer = CHECKSUM.pack(h.intdigest())
    buffers = [header + aux, body, trailer] if body_len else [header + aux + trailer]
    return buffers, HEADER_BYTES + len(aux) + body_len + TRAILER_BYTES


def parse(buf: np.ndarray, path: str, offset: int) -> Record:
    """Verify and parse the record that is exactly ``buf`` (a uint8 array), found at ``path``:``offset``.

    Raises CorruptionError if the checksum, magic, kind, flags or lengths are wrong.
    """
    n = buf.shape[0]
    if n < HEADER_BYTES + TRAILER_BYTES:
        raise CorruptionError(f"record of {n} bytes is shorter than a header at {path}:{offset}", path, offset)
    (stored,) = CHECKSUM.unpack_from(buf, n - TRAILER_BYTES)
    if xxhash.xxh3_64_intdigest(buf[: n - TRAILER_BYTES]) != stored:
        raise CorruptionError(f"record checksum mismatch at {path}:{offset} ({n} bytes)", path, offset)
    magic, kind, codec_id, flags, object_id, count, block, version, aux_len, body_len = HEADER.unpack_from(buf, 0)
    if magic != MAGIC or kind not in _KINDS or flags & ~_KNOWN_FLAGS:
        raise CorruptionError(f"bad record header at {path}:{offset}", path, offset)
    if HEADER_BYTES + aux_len + body_len + TRAILER_BYTES != n:
        raise CorruptionError(f"record lengths disagree with its extent at {path}:{offset}", path, offset)
    if kind == KIND_ROWS and aux_len != rows_aux_bytes(flags, count):
        raise CorruptionError(f"record offsets length disagrees with its row count at {path}:{offset}", path, offset)
    aux = buf[HEADER_BYTES : HEADER_BYTES + aux_len]
    body = buf[HEADER_BYTES + aux_len : n - TRAILER_BYTES]
    return Record(kind, codec_id, flags, object_id, count, block, version, aux, body)
