"""I4: damaged stored bytes are reported as CorruptionError, never returned as data.

One named test per shape of damage, in the manner of leveldb's log_test (TruncatedTrailingRecord,
BadLength, ChecksumMismatch, ...). Each test damages a copy of one small store with several versions
and segments, then checks, for every version, table, block and dense array:

- a read whose read chain visits a damaged record raises CorruptionError naming the file (``.path``)
  and, where known, the record (``.offset``);
- every other read returns exactly the expected values;
- ``verify()`` reports ``ok=False`` with a problem naming each damaged record, and does not raise.

A torn tail (bytes past a segment's committed length, as a crash leaves) is no damage: a writable
open truncates it, a readonly open reads past it.
"""

from __future__ import annotations

import os
import shutil
import struct

import numpy as np
import pytest
import xxhash

import cnrstore
from cnrstore import codecs, knobs
from cnrstore.engine import filenames, record, segments
from cnrstore.errors import CorruptionError

#: table -> (num_rows, dim, codec, block_rows)
TABLES = {"a": (256, 4, "fp32", 64), "b": (128, 8, "int8", 64)}
VERSIONS = [1, 2, 3, 4]
DENSE = {"d": [1, 2, 3, 4], "e": [1, 3]}  # dense name -> versions that put it

KNOWN = object()  # expected offset: any int (the engine knows where, but the exact byte is its choice)
ANY = object()  # expected offset: None or any int


def _offsets(v: int, block_len: int) -> np.ndarray:
    """Block offsets written by version v: all (baseline), even < 32, odd < 32, then 0..7 (FULL)."""
    if v == 1:
        return np.arange(block_len)
    if v == 2:
        return np.arange(0, 32, 2)
    if v == 3:
        return np.arange(1, 32, 2)
    return np.arange(8)


def _dense_value(name: str, v: int) -> np.ndarray:
    rng = np.random.default_rng([v, ord(name)])
    if name == "d":
        return rng.standard_normal(10).astype(np.float32)
    return rng.integers(-(2**40), 2**40, size=(3, 4), dtype=np.int64)


class Built:
    """The template store and what it must read as."""

    def __init__(self, path: str):
        self.path = path
        self.expect: dict[int, dict[str, np.ndarray]] = {}
        self.written: dict[tuple[str, int, int], set[int]] = {}  # (table, block, version) -> offsets
        state = {t: np.full((n, d), np.nan, np.float32) for t, (n, d, _c, _b) in TABLES.items()}
        old, old_bound = knobs.SEGMENT_BYTES, knobs.READ_CHAIN_BOUND
        knobs.SEGMENT_BYTES = 3000  # several segments; a version's records straddle rolls
        knobs.READ_CHAIN_BOUND = None  # plain increments: read chains as this file's model computes them
        try:
            with cnrstore.open(path, create=True) as store:
                for t, (n, d, c, b) in TABLES.items():
                    store.create_table(t, n, d, codec=c, block_rows=b)
                for v in VERSIONS:
                    rng = np.random.default_rng(v)
                    with store.checkpoint(step=10 * v, meta={"v": v}) as ck:
                        assert ck.version == v
                        for t, (n, d, c, b) in TABLES.items():
                            rows = []
                            for block in range(n // b):
                                offs = _offsets(v, b)
                                self.written[(t, block, v)] = set(offs.tolist())
                                rows.append(block * b + offs)
                            rows = np.concatenate(rows)
                            values = rng.standard_normal((rows.size, d)).astype(np.float32)
                            ck.put_rows(t, rows, values)
                            codec = codecs.get(c)
                            state[t][rows] = codec.decode(codec.encode(values), d)
                        for name, puts in DENSE.items():
                            if v in puts:
                                ck.put_dense(name, _dense_value(name, v))
                    self.expect[v] = {t: a.copy() for t, a in state.items()}
        finally:
            knobs.SEGMENT_BYTES, knobs.READ_CHAIN_BOUND = old, old_bound
        self.rows, self.dense = locate(path)
        assert len({loc.segment for loc in self.rows.values()}) >= 3, "the template spans several segments"

    def newest_dense(self, name: str, v: int) -> int:
        return max(u for u in DENSE[name] if u <= v)


def locate(path: str):
    """{(table, block, version): RowLoc} and {(dense name, version): DenseLoc}, from the index."""
    with cnrstore.open(path, readonly=True) as store:
        with store.engine.read() as view:
            names = {info.id: name for name, info in view.tables().items()}
            rows = {(names[t], b, v): loc for t, b, v, loc in view.row_entries()}
            dense_names = {i: n for n, i in view.dense_names().items()}
            dense = {(dense_names[d], v): loc for d, v, loc in view.dense_entries()}
    return rows, dense


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    return Built(str(tmp_path_factory.mktemp("template") / "store"))


@pytest.fixture
def built(template, tmp_path):
    """A fresh copy of the template store (closed): damage it at will."""
    path = str(tmp_path / "store")
    shutil.copytree(template.path, path)
    copy = object.__new__(Built)
    copy.__dict__.update(template.__dict__)
    copy.path = path
    return copy


# -- damage and checks ----------------------------------------------------------------------------------

def seg_path(built: Built, seg: int) -> str:
    return filenames.segment_path(built.path, seg)


def xor_byte(path: str, offset: int, mask: int = 0x5A) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        assert len(b) == 1
        f.seek(offset)
        f.write(bytes([b[0] ^ mask]))


def overwrite(path: str, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def read_bytes(path: str, offset: int, length: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(length)


def copy_record(built: Built, src, dst) -> None:
    """Overwrite the record at location ``dst`` with the bytes of the record at ``src``."""
    overwrite(seg_path(built, dst.segment), dst.offset, read_bytes(seg_path(built, src.segment), src.offset, src.length))


def rewrite_header(built: Built, loc, **fields) -> None:
    """Change header fields of the record at ``loc`` and recompute its checksum (a well-formed lie)."""
    path = seg_path(built, loc.segment)
    buf = bytearray(read_bytes(path, loc.offset, loc.length))
    names = ["magic", "kind", "codec", "flags", "object_id", "count", "block", "version", "aux_len", "body_len"]
    vals = dict(zip(names, record.HEADER.unpack_from(buf, 0)))
    vals.update(fields)
    record.HEADER.pack_into(buf, 0, *[vals[n] for n in names])
    struct.pack_into("<Q", buf, len(buf) - 8, xxhash.xxh3_64_intdigest(bytes(buf[:-8])))
    overwrite(path, loc.offset, bytes(buf))


def _walk_hit(built: Built, damaged: dict, table: str, block: int, v: int, want: set[int]):
    """The first damaged record a read of ``want`` (block offsets) at version v visits, or None.

    A read visits the block's records newest first until every wanted row is found.
    """
    remaining = set(want)
    for u in sorted(VERSIONS, reverse=True):
        key = (table, block, u)
        if u > v or key not in built.written:
            continue
        if key in damaged:
            return key
        remaining -= built.written[key]
        if not remaining:
            return None
    return None


def _expect_corruption(fn, where: tuple) -> None:
    path, offset = where
    with pytest.raises(CorruptionError) as info:
        fn()
    err = info.value
    assert err.path == path, (str(err), err.path, path)
    if offset is KNOWN:
        assert isinstance(err.offset, int), str(err)
    elif offset is not ANY:
        assert err.offset == offset, (str(err), err.offset, offset)


def check_damage(built: Built, damaged_rows: dict, damaged_dense: dict, *, readonly: bool = True) -> list[str]:
    """Check every read of every version against the damage; returns verify's problems.

    ``damaged_rows`` maps (table, block, version) and ``damaged_dense`` (name, version) of each
    damaged record to the (path, offset) its CorruptionError must carry.
    """
    with cnrstore.open(built.path, readonly=readonly) as store:
        assert [i.version for i in store.versions()] == VERSIONS
        for v in VERSIONS:
            expect = built.expect[v]
            version_hit = False
            for t, (n, _d, _c, b) in TABLES.items():
                table_hit = None
                for block in range(n // b):
                    rows = np.arange(block * b, (block + 1) * b)
                    hit = _walk_hit(built, damaged_rows, t, block, v, set(range(b)))
                    if hit:
                        _expect_corruption(lambda: store.read_rows(t, rows, version=v), damaged_rows[hit])
                        table_hit = table_hit or hit
                    else:
                        np.testing.assert_array_equal(store.read_rows(t, rows, version=v), expect[t][rows])
                    # a narrow read: only rows of the newest record, which ends the walk there
                    newest = max(u for u in VERSIONS if u <= v)
                    narrow = np.array(sorted(built.written[(t, block, newest)])) + block * b
                    hit = _walk_hit(built, damaged_rows, t, block, v, set((narrow - block * b).tolist()))
                    if hit:
                        _expect_corruption(lambda: store.read_rows(t, narrow, version=v), damaged_rows[hit])
                    else:
                        np.testing.assert_array_equal(store.read_rows(t, narrow, version=v), expect[t][narrow])
                if table_hit:
                    with pytest.raises(CorruptionError):
                        store.read_table(t, version=v)
                else:
                    np.testing.assert_array_equal(store.read_table(t, version=v), expect[t])
                version_hit = version_hit or bool(table_hit)
            for name in DENSE:
                key = (name, built.newest_dense(name, v))
                if key in damaged_dense:
                    _expect_corruption(lambda: store.read_dense(name, version=v), damaged_dense[key])
                    version_hit = True
                else:
                    got = store.read_dense(name, version=v)
                    want = _dense_value(*key)
                    assert got.dtype == want.dtype and got.shape == want.shape
                    np.testing.assert_array_equal(got, want)
            if version_hit:
                with pytest.raises(CorruptionError):
                    store.restore(v)
            else:
                snap = store.restore(v)
                for t in TABLES:
                    np.testing.assert_array_equal(snap.tables[t], expect[t])
        report = store.verify()  # must not raise
    problems = report.problems
    if damaged_rows or damaged_dense:
        assert not report.ok and problems
        for key in damaged_rows:
            loc = built.rows[key]
            assert any(_names(p, built, loc, f"block {key[1]} version {key[2]}") for p in problems), (key, problems)
        for key in damaged_dense:
            loc = built.dense[key]
            assert any(_names(p, built, loc, f"{key[0]!r} version {key[1]}") for p in problems), (key, problems)
    else:
        assert report.ok, problems
    return problems


def _names(problem: str, built: Built, loc, entry: str) -> bool:
    """Whether a verify problem names the damaged record: by its file and offset, or by its index entry."""
    base = os.path.basename(seg_path(built, loc.segment))
    return f"{base}:{loc.offset}" in problem or entry in problem or (base in problem and str(loc.offset) in problem)


def records_in(built: Built, seg: int, start: int = 0, stop: int | None = None):
    """Damage map entries of every record of segment ``seg`` overlapping bytes [start, stop)."""
    stop = 1 << 62 if stop is None else stop
    path = seg_path(built, seg)
    rows = {k: (path, loc.offset) for k, loc in built.rows.items()
            if loc.segment == seg and loc.offset < stop and loc.offset + loc.length > start}
    dense = {k: (path, loc.offset) for k, loc in built.dense.items()
             if loc.segment == seg and loc.offset < stop and loc.offset + loc.length > start}
    return rows, dense


def partial_record(built: Built, table="a", block=1, version=3):
    """A record with row offsets (not FULL), and its location."""
    key = (table, block, version)
    loc = built.rows[key]
    assert not loc.flags & record.FLAG_FULL
    return key, loc


def _where(built: Built, loc):
    return seg_path(built, loc.segment), loc.offset


# -- the undamaged store ------------------------------------------------------------------------------------

def test_undamaged_store_reads_and_verifies(built):
    check_damage(built, {}, {}, readonly=True)
    check_damage(built, {}, {}, readonly=False)


# -- one byte of one record --------------------------------------------------------------------------------

def test_header_byte_flipped(built):
    key, loc = partial_record(built)
    xor_byte(seg_path(built, loc.segment), loc.offset + 21)  # inside the count / block fields
    check_damage(built, {key: _where(built, loc)}, {})


def test_magic_byte_flipped(built):
    key, loc = partial_record(built, "b", 0, 2)
    xor_byte(seg_path(built, loc.segment), loc.offset)
    check_damage(built, {key: _where(built, loc)}, {})


def test_row_offsets_byte_flipped(built):
    key, loc = partial_record(built)
    xor_byte(seg_path(built, loc.segment), loc.offset + record.HEADER_BYTES + 3, 0x01)
    check_damage(built, {key: _where(built, loc)}, {})


def test_body_byte_flipped(built):
    key, loc = partial_record(built, "b", 1, 2)
    xor_byte(seg_path(built, loc.segment), loc.offset + record.HEADER_BYTES + 2 * loc.count + 5, 0x80)
    check_damage(built, {key: _where(built, loc)}, {})


def test_baseline_body_byte_flipped(built):
    key = ("a", 2, 1)
    loc = built.rows[key]
    assert loc.flags & record.FLAG_BASELINE
    xor_byte(seg_path(built, loc.segment), loc.offset + loc.length - 20, 0x01)
    check_damage(built, {key: _where(built, loc)}, {}, readonly=False)


def test_checksum_trailer_flipped(built):
    key, loc = partial_record(built, "a", 3, 2)
    xor_byte(seg_path(built, loc.segment), loc.offset + loc.length - 1, 0x01)
    check_damage(built, {key: _where(built, loc)}, {})


def test_dense_record_flipped(built):
    key = ("e", 3)
    loc = built.dense[key]
    xor_byte(seg_path(built, loc.segment), loc.offset + loc.length - 9)  # last body byte
    check_damage(built, {}, {key: _where(built, loc)})


def test_dense_descriptor_flipped(built):
    key = ("d", 2)
    loc = built.dense[key]
    xor_byte(seg_path(built, loc.segment), loc.offset + record.HEADER_BYTES + 2)
    check_damage(built, {}, {key: _where(built, loc)}, readonly=False)


def test_every_byte_of_a_record_is_checked(built):
    """Flip each byte of one rows record and one dense record in turn: every flip is caught."""
    key, loc = partial_record(built, "b", 1, 3)
    path = seg_path(built, loc.segment)
    rows = np.arange(64, 96)
    dkey = ("e", 1)
    dloc = built.dense[dkey]
    dpath = seg_path(built, dloc.segment)
    cases = [(path, loc.offset + i, lambda s: s.read_rows("b", rows, version=3)) for i in range(loc.length)]
    cases += [(dpath, dloc.offset + i, lambda s: s.read_dense("e", version=2)) for i in range(dloc.length)]
    for file, offset, read in cases:
        xor_byte(file, offset, 0x10)
        with cnrstore.open(built.path, readonly=True) as store:
            with pytest.raises(CorruptionError):
                read(store)
        xor_byte(file, offset, 0x10)
    check_damage(built, {}, {})


# -- well-formed records that lie (checksum recomputed) ----------------------------------------------------

@pytest.mark.parametrize("field,value", [
    ("magic", b"CNRx"),
    ("kind", 9),
    ("flags", 0x80),
    ("flags", record.FLAG_BASELINE | record.FLAG_FULL),  # claims to be a baseline without offsets
    ("aux_len", 30),       # BadLength: lengths disagree with the record's extent
    ("body_len", 1),
    ("count", 15),          # the offsets no longer match the count
    ("object_id", 99),      # a record of another table
    ("codec", 200),         # an unknown codec
    ("codec", 2),           # another codec: the body no longer fits its rows
    ("block", 2),           # a record of another block
    ("version", 2),         # a record of another version
])
def test_header_field_with_valid_checksum(built, field, value):
    key, loc = partial_record(built, "a", 1, 3)
    rewrite_header(built, loc, **{field: value})
    check_damage(built, {key: _where(built, loc)}, {})


def test_record_written_to_the_wrong_place(built):
    """A misdirected write: a valid record of another block, of equal length, lies where the index points."""
    key, loc = partial_record(built, "a", 1, 2)
    other = built.rows[("a", 2, 2)]
    assert other.length == loc.length
    copy_record(built, other, loc)
    check_damage(built, {key: _where(built, loc)}, {})


def test_stale_record_of_an_older_version(built):
    """The record of version 3 replaced by the same block's (equally long) record of version 2."""
    key, loc = partial_record(built, "b", 0, 3)
    older = built.rows[("b", 0, 2)]
    assert older.length == loc.length
    copy_record(built, older, loc)
    check_damage(built, {key: _where(built, loc)}, {})


# -- damage to whole ranges and files ----------------------------------------------------------------------

def test_zeroed_byte_range(built):
    """Zeros from the middle of one record to the middle of a later one (a lost page)."""
    key, loc = partial_record(built, "a", 1, 3)
    path = seg_path(built, loc.segment)
    start = loc.offset + loc.length // 2
    size = os.path.getsize(path)
    stop = min(size, start + 700)
    overwrite(path, start, bytes(stop - start))
    rows, dense = records_in(built, loc.segment, start, stop)
    assert key in rows and len(rows) + len(dense) >= 2
    check_damage(built, rows, dense)


def test_segment_truncated_inside_a_committed_record(built):
    """TruncatedTrailingRecord of a committed record: it and every later record of the segment are gone."""
    key, loc = partial_record(built, "a", 1, 3)
    path = seg_path(built, loc.segment)
    cut = loc.offset + loc.length // 2
    os.truncate(path, cut)
    rows, dense = records_in(built, loc.segment, cut)
    assert key in rows
    rows = {k: (p, KNOWN) for k, (p, _o) in rows.items()}
    dense = {k: (p, KNOWN) for k, (p, _o) in dense.items()}
    problems = check_damage(built, rows, dense)
    assert any(os.path.basename(path) in p for p in problems)
    # a writable open does not "repair" it by forgetting committed data, and still reports it
    problems = check_damage(built, rows, dense, readonly=False)
    assert any(os.path.basename(path) in p for p in problems)


def test_segment_file_missing(built):
    key, loc = partial_record(built, "a", 1, 3)
    path = seg_path(built, loc.segment)
    os.remove(path)
    rows, dense = records_in(built, loc.segment)
    rows = {k: (p, ANY) for k, (p, _o) in rows.items()}
    dense = {k: (p, ANY) for k, (p, _o) in dense.items()}
    problems = check_damage(built, rows, dense)
    assert any(os.path.basename(path) in p and "missing" in p for p in problems), problems


@pytest.mark.parametrize("offset", [0, 9, 24, 31], ids=["magic", "segment_id", "checksum_lo", "checksum_hi"])
def test_segment_header_corrupt(built, offset):
    key, loc = partial_record(built, "a", 1, 3)
    path = seg_path(built, loc.segment)
    xor_byte(path, offset)
    rows, dense = records_in(built, loc.segment)
    rows = {k: (p, KNOWN) for k, (p, _o) in rows.items()}
    dense = {k: (p, KNOWN) for k, (p, _o) in dense.items()}
    problems = check_damage(built, rows, dense)
    assert any(os.path.basename(path) in p and "header" in p for p in problems), problems


def test_segment_header_of_another_segment(built):
    """A segment file renamed over another: its header names another segment id."""
    segs = sorted({loc.segment for loc in built.rows.values()})
    victim, other = segs[1], segs[2]
    overwrite(seg_path(built, victim), 0, read_bytes(seg_path(built, other), 0, segments.SEGMENT_HEADER_BYTES))
    rows, dense = records_in(built, victim)
    rows = {k: (p, KNOWN) for k, (p, _o) in rows.items()}
    dense = {k: (p, KNOWN) for k, (p, _o) in dense.items()}
    check_damage(built, rows, dense)


# -- the store marker --------------------------------------------------------------------------------------

@pytest.mark.parametrize("damage", ["flip_magic", "flip_payload", "flip_checksum", "truncate", "extend", "empty"])
def test_store_marker_corrupt(built, damage):
    path = filenames.marker_path(built.path)
    size = os.path.getsize(path)
    if damage == "flip_magic":
        xor_byte(path, 0)
    elif damage == "flip_payload":
        xor_byte(path, size - 12)
    elif damage == "flip_checksum":
        xor_byte(path, size - 1)
    elif damage == "truncate":
        os.truncate(path, size - 3)
    elif damage == "extend":
        with open(path, "ab") as f:
            f.write(b"\0")
    else:
        os.truncate(path, 0)
    for readonly in (True, False):
        with pytest.raises(CorruptionError) as info:
            cnrstore.open(built.path, readonly=readonly)
        assert info.value.path == path
    assert not os.path.exists(filenames.lock_path(built.path)) or os.path.getsize(filenames.lock_path(built.path)) == 0


# -- torn tails: no damage ---------------------------------------------------------------------------------

def _active_segment(built: Built) -> int:
    return max(loc.segment for loc in list(built.rows.values()) + list(built.dense.values()))


@pytest.mark.parametrize("tail", ["garbage", "zeros", "half_record", "whole_record"])
def test_torn_tail_is_not_an_error(built, tail):
    """Bytes past the committed length (a crash mid-append) are ignored readonly and truncated writable."""
    seg = _active_segment(built)
    path = seg_path(built, seg)
    committed = os.path.getsize(path)
    some = built.rows[("a", 1, 3)]
    rec = read_bytes(seg_path(built, some.segment), some.offset, some.length)
    data = {
        "garbage": np.random.default_rng(5).integers(0, 256, 777, dtype=np.uint8).tobytes(),
        "zeros": bytes(4096),
        "half_record": rec[: len(rec) // 2],
        "whole_record": rec,
    }[tail]
    with open(path, "ab") as f:
        f.write(data)
    check_damage(built, {}, {}, readonly=True)
    assert os.path.getsize(path) == committed + len(data), "a readonly open changes nothing"
    with cnrstore.open(built.path) as store:
        assert store.recovery_notes
        assert os.path.getsize(path) == committed
        with store.checkpoint() as ck:
            ck.put_rows("a", [5, 70], np.ones((2, 4), np.float32))
            ck.put_dense("d", np.arange(3))
        v = ck.version
        np.testing.assert_array_equal(store.read_rows("a", [5, 70, 6]),
                                      np.r_[np.ones((2, 4), np.float32), built.expect[4]["a"][[6]]])
        np.testing.assert_array_equal(store.read_dense("d", version=v), np.arange(3))
        assert store.verify().ok
    assert locate(built.path)[0][("a", 0, v)].offset == committed, "the new version starts at the old tail"


def test_uncommitted_segment_file_is_ignored_and_removed(built):
    """A segment created by a checkpoint that never committed: readonly ignores it, writable removes it."""
    seg = _active_segment(built) + 1
    path = seg_path(built, seg)
    some = built.rows[("a", 1, 3)]
    with open(path, "wb") as f:
        f.write(segments.segment_header(seg, cnrstore.FORMAT_VERSION))
        f.write(read_bytes(seg_path(built, some.segment), some.offset, some.length))
    check_damage(built, {}, {}, readonly=True)
    assert os.path.exists(path)
    with cnrstore.open(built.path) as store:
        assert store.recovery_notes
        assert not os.path.exists(path)
    check_damage(built, {}, {}, readonly=False)


# -- reads into the caller's arrays ---------------------------------------------------------------------------

def test_body_byte_flipped_leaves_read_table_out_untouched(built):
    """The damaged record is in the table's last block: every record is verified before the first block
    is decoded, so ``out`` keeps its bytes (and so does the other table's ``out`` of a read_tables call)."""
    key, loc = partial_record(built, "a", 3, 2)
    xor_byte(seg_path(built, loc.segment), loc.offset + record.HEADER_BYTES + 2 * loc.count + 5, 0x80)
    with cnrstore.open(built.path, readonly=True) as store:
        out = np.full((256, 4), np.float32(-3.25))
        with pytest.raises(CorruptionError):
            store.read_table("a", 4, out=out)
        assert (out == np.float32(-3.25)).all()
        outs = {"b": np.full((128, 8), np.float32(2.5)), "a": np.full((256, 4), np.float32(2.5))}
        with pytest.raises(CorruptionError):
            store.read_tables(outs, 4)
        assert all((o == np.float32(2.5)).all() for o in outs.values())
        # a version whose read chains miss the damaged record reads into out as before
        assert np.array_equal(store.read_table("a", 1, out=out), built.expect[1]["a"])
        assert np.array_equal(out, built.expect[1]["a"])
