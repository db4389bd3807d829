"""I2 for maintenance: ``compact``, ``retain`` and ``gc`` never change what a retained version reads.

The workload (``Workload``) writes versions whose puts are a function of (seed, version): tables of
several block sizes, with codec overrides and several puts per table per version (so that a block's
read chain, and even one record, mixes codecs), sparse tables whose never-written rows must stay
``MissingRows``, and dense arrays. ``Workload.check`` reads every retained version completely
(read_table / read_rows / read_dense / restore / versions()) and compares it bit for bit with the
model, returning the bytes it read, so a test also compares the reads before and after each operation.

Segments are made small (``knobs.SEGMENT_BYTES``) so that a store has many, and GC has sealed segments
to free and rewrite. Also: retain's results and argument checks, GC refusing to copy a damaged record
(and changing nothing), maintenance beside an open checkpoint (docs/DESIGN.md: it never waits for one)
and on a readonly store, and index map growth inside compaction commits.

Reader safety: a readonly reader in another process reads every retained version in a loop while this
process checkpoints, compacts, retains and collects; an LMDB read transaction held open across a
``gc`` (in this process or another) keeps the segments it can see on disk until it ends, but a reader
process killed mid-read does not; and a readonly store that stays open across a writer restart never
sees a segment id reused.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import cnrstore
from cnrstore import codecs, knobs
from cnrstore.maintenance import compaction
from cnrstore.engine import filenames, reader, record
from cnrstore.errors import (
    CheckpointInProgress,
    CorruptionError,
    InvalidArgument,
    MissingRows,
    ReadOnlyError,
    VersionNotFound,
)

#: name -> (num_rows, dim, codec, block_rows)
TABLES = {
    "full_i4": (640, 8, "int4", 64),  # every row from version 1; codec overrides and merged puts later
    "sparse_f16": (1000, 4, "fp16", 128),  # only rows of SPARSE_POOL are ever written: partial blocks
    "pairs_i8": (90, 3, "int8", 2),  # many two-row blocks; odd rows >= 80 are never written
    "wide_f32": (300, 5, "fp32", 4096),  # one block larger than the table; half written at version 1
    "default_i2": (200, 16, "int2", None),  # the default block size
}
#: Tables with every row written at version 1: restore() reads whole versions of these.
FULL_TABLES = {n: TABLES[n] for n in ("full_i4", "default_i2")}
SPARSE_POOL = np.flatnonzero((np.arange(1000) % 7 < 2) & (np.arange(1000) < 900))
PAIRS_POOL = np.r_[0:80, 80:90:2]
OVERRIDES = [None, None, "int8", "fp16", "fp32", "int2", "int4"]
CHILD_ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
CHILD_ENV.pop("CNRSTORE_CRASH_AT", None)


#: FBGEMM on one thread: its OpenMP barriers slow each of the many small decode calls here (conftest.py)
pytestmark = pytest.mark.usefixtures("single_threaded_torch")


@pytest.fixture(autouse=True)
def small_segments(monkeypatch):
    """Segments of 8 KiB: a version of the workload spans one or two, so a store has many."""
    monkeypatch.setattr(knobs, "SEGMENT_BYTES", 8 << 10)


# -- the workload and its model -------------------------------------------------------------------------

def version_puts(tables: dict, seed: int, v: int) -> list[tuple]:
    """The puts of version ``v``: ("rows", table, rows, values, codec) or ("dense", name, array)."""
    rng = np.random.default_rng([seed, v])
    puts: list[tuple] = []
    for name, (num_rows, dim, _codec, _b) in tables.items():
        pool = {"sparse_f16": SPARSE_POOL, "pairs_i8": PAIRS_POOL}.get(name, np.arange(num_rows))
        if name == "wide_f32" and v == 1:
            pool = np.arange(150)
        if v == 1:
            rows = rng.permutation(pool)
        elif rng.random() < 0.2:
            continue  # the table is not touched by this version
        else:
            rows = rng.choice(pool, size=int(rng.integers(1, max(2, pool.size // 3))), replace=False)
        calls = 1 if rows.size < 3 else int(rng.integers(1, 4))
        for part in np.array_split(rows, calls):
            if not part.size:
                continue
            values = (rng.standard_normal((part.size, dim)) * rng.uniform(0.01, 3.0)
                      + rng.uniform(-1, 1)).astype(np.float32)
            codec = None
            if v > 1 and name in ("full_i4", "default_i2", "sparse_f16"):
                codec = OVERRIDES[int(rng.integers(len(OVERRIDES)))]
            puts.append(("rows", name, part, values, codec))
    puts.append(("dense", "step", np.array([v, 2 * v], dtype=np.int64)))
    if v == 1 or rng.random() < 0.5:
        puts.append(("dense", "weights", rng.standard_normal((7, 3))))
    if rng.random() < 0.3:  # may first appear after version 1: earlier versions miss it
        puts.append(("dense", "mask", rng.random(13) < 0.5))
    return puts


class Workload:
    """Writes versions into a store and knows what every committed version reads as."""

    def __init__(self, store, tables: dict = TABLES, seed: int = 1, create: bool = True):
        self.store = store
        self.tables = tables
        self.seed = seed
        self.states: dict[int, tuple[dict, dict]] = {}  # version -> ({table: (values, written)}, dense)
        self.info: dict[int, tuple] = {}  # version -> (step, meta)
        self.head: tuple[dict, dict] = ({n: (np.zeros((r, d), np.float32), np.zeros(r, bool))
                                         for n, (r, d, _c, _b) in tables.items()}, {})
        if create:
            for name, (num_rows, dim, codec, block_rows) in tables.items():
                store.create_table(name, num_rows, dim, codec=codec, block_rows=block_rows)

    def commit(self, count: int = 1) -> list[int]:
        out = []
        for _ in range(count):
            step = 100 * self.seed + len(self.states)
            with self.store.checkpoint(step=step, meta={"w": self.seed, "n": len(self.states)}) as ck:
                v = ck.version
                tables = {n: (a.copy(), w.copy()) for n, (a, w) in self.head[0].items()}
                dense = dict(self.head[1])
                for put in version_puts(self.tables, self.seed, v):
                    if put[0] == "rows":
                        _, name, rows, values, codec = put
                        ck.put_rows(name, rows, values, codec=codec)
                        c = codecs.get(codec or self.tables[name][2])
                        tables[name][0][rows] = c.decode(c.encode(values), self.tables[name][1])
                        tables[name][1][rows] = True
                    else:
                        ck.put_dense(put[1], put[2])
                        dense[put[1]] = put[2]
            self.states[v] = self.head = (tables, dense)
            self.info[v] = (step, {"w": self.seed, "n": len(self.states) - 1})
            out.append(v)
        return out

    def retained(self) -> list[int]:
        return [i.version for i in self.store.versions()]

    def check(self, versions=None, store=None) -> dict:
        """Read every retained version (or those given) in full and compare it bit for bit with the
        model; returns {(version, what): bytes read} for before/after comparisons."""
        store = store or self.store
        got: dict = {}
        infos = {i.version: i for i in store.versions()}
        for v in infos if versions is None else versions:
            tables, dense = self.states[v]
            step, meta = self.info[v]
            assert (infos[v].step, infos[v].meta) == (step, meta), v
            got[v, "info"] = (infos[v].parent, infos[v].tables, infos[v].dense, infos[v].bytes, infos[v].created)
            for name, (values, written) in tables.items():
                rows = np.flatnonzero(written)
                if written.all():
                    arr = store.read_table(name, version=v)
                    assert arr.dtype == np.float32
                    assert arr.tobytes() == values.tobytes(), f"read_table({name}, {v})"
                    got[v, name] = arr.tobytes()
                else:
                    with pytest.raises(MissingRows):
                        store.read_table(name, version=v)
                    arr = store.read_rows(name, rows, version=v)
                    assert arr.tobytes() == values[rows].tobytes(), f"read_rows({name}, {v})"
                    got[v, name] = arr.tobytes()
                    # every never-written row is missing (the message counts them), alone or mixed in
                    unwritten = np.flatnonzero(~written)
                    with pytest.raises(MissingRows, match=f"^{unwritten.size} row"):
                        store.read_rows(name, unwritten, version=v)
                    mixed = np.r_[rows[::5], unwritten[::3]]
                    with pytest.raises(MissingRows, match=f"^{unwritten[::3].size} row"):
                        store.read_rows(name, mixed, version=v)
                if rows.size:  # a point read of a few rows, repeated and unsorted
                    pick = np.random.default_rng(v).choice(rows, size=min(9, rows.size))
                    assert store.read_rows(name, pick, version=v).tobytes() == values[pick].tobytes()
            for name in ("step", "weights", "mask"):
                if name in dense:
                    arr = store.read_dense(name, version=v)
                    assert (arr.dtype, arr.shape, arr.tobytes()) == \
                        (dense[name].dtype, dense[name].shape, dense[name].tobytes()), (name, v)
                    got[v, "dense", name] = arr.tobytes()
                else:
                    with pytest.raises(MissingRows):
                        store.read_dense(name, version=v)
            if all(w.all() for _a, w in tables.values()):
                snap = store.restore(v)
                assert (snap.version, snap.step, snap.meta) == (v, step, meta)
                assert set(snap.tables) == set(tables) and set(snap.dense) == set(dense)
                for name, arr in snap.tables.items():
                    assert arr.tobytes() == tables[name][0].tobytes(), (name, v)
                for name, arr in snap.dense.items():
                    assert arr.tobytes() == dense[name].tobytes() and arr.dtype == dense[name].dtype
                got[v, "restore"] = b"".join(snap.tables[n].tobytes() for n in sorted(snap.tables)) + \
                    b"".join(snap.dense[n].tobytes() for n in sorted(snap.dense))
            else:
                with pytest.raises(MissingRows):
                    store.restore(v)
        return got


def same_reads(before: dict, after: dict) -> None:
    """Every read in ``after`` returned the bytes it returned ``before`` (for the versions in after)."""
    assert after, "nothing was read"
    for key, value in after.items():
        assert before[key] == value, f"{key} reads differently"


def check_dropped(store, dropped: list[int]) -> None:
    listed = {i.version for i in store.versions()}
    for v in dropped:
        assert v not in listed
        with pytest.raises(VersionNotFound):
            store.read_table("full_i4", version=v)
        with pytest.raises(VersionNotFound):
            store.read_rows("full_i4", [0, 1], version=v)
        with pytest.raises(VersionNotFound):
            store.read_dense("step", version=v)
        with pytest.raises(VersionNotFound):
            store.restore(v)
        if not store.readonly:
            with pytest.raises(VersionNotFound):
                store.compact(v)


def segment_files(path: str) -> dict[int, int]:
    out = {}
    for name in os.listdir(filenames.segments_dir(path)):
        seg = filenames.parse_segment_name(name)
        if seg is not None:
            out[seg] = os.path.getsize(os.path.join(filenames.segments_dir(path), name))
    return out


def index_state(store) -> tuple:
    """Every catalog and index entry: equal before and after means the operation changed nothing."""
    with store.engine.read() as view:
        return (view.versions(), view.segments(), list(view.row_entries()), list(view.dense_entries()),
                view.meta("doomed_segments", {}), view.meta("bytes_written"))


def assert_consistent(store) -> None:
    """verify() passes, and segments/ holds exactly the index's segments plus doomed ones."""
    report = store.verify()
    assert report.ok, report.problems[:5]
    with store.engine.read() as view:
        committed = view.segments()
        doomed = {int(k) for k in view.meta("doomed_segments", {})}
    files = segment_files(store.path)
    assert set(committed) <= set(files) <= set(committed) | doomed, (sorted(files), sorted(committed), doomed)
    for seg, length in committed.items():
        assert files[seg] >= length


def reopen(store, workload: Workload):
    store.close()
    store = cnrstore.open(store.path)
    workload.store = store
    return store


def expected_max_read_chain(store) -> int:
    """The longest read chain of any retained version, computed here from the index."""
    with store.engine.read() as view:
        return max((len(chain) for v in [i.version for i in store.versions()]
                    for chain in compaction.block_chains(view, v).values()), default=0)


# -- compact, retain, gc: reads unchanged -------------------------------------------------------------

def test_compact_retain_gc_keep_every_retained_version(store):
    w = Workload(store)
    w.commit(8)
    before = w.check()
    assert len(segment_files(store.path)) > 4
    assert store.stats()["max_read_chain"] > 2

    report = store.compact(4)
    assert report.version == 4 and report.blocks_materialized > 0 and report.bytes_written > 0
    same_reads(before, w.check())
    assert_consistent(store)
    store = reopen(store, w)
    same_reads(before, w.check())

    report = store.compact()  # the newest
    assert report.version == 8 and report.blocks_materialized > 0
    assert store.compact(8).blocks_materialized == 0, "a second compaction at a version has nothing to do"
    same_reads(before, w.check())
    assert_consistent(store)

    versions_before = store.stats()["versions"]
    dropped = store.retain(keep_last=5)
    assert dropped == [1, 2, 3]
    assert w.retained() == [4, 5, 6, 7, 8]
    assert store.stats()["versions"] == versions_before - 3 == 5
    check_dropped(store, dropped)
    same_reads(before, w.check())
    assert_consistent(store)

    gc = store.gc()
    assert gc.bytes_reclaimed > 0 and gc.segments_deleted > 0 and gc.bytes_pending == 0
    same_reads(before, w.check())
    assert_consistent(store)
    store = reopen(store, w)
    same_reads(before, w.check())
    check_dropped(store, dropped)
    assert_consistent(store)

    # checkpoints on top of compacted and collected data, then another round
    new = w.commit(3)
    assert new[0] > 8 and store.versions()[-1].parent == new[-2]
    before = w.check()
    store.compact(6)
    assert store.retain(keep_last=2) == [4, 5, 6, 7, 8, 9]
    store.gc()
    same_reads(before, w.check())
    assert_consistent(store)
    store = reopen(store, w)
    same_reads(before, w.check())
    w.commit(1)
    w.check()
    assert_consistent(store)
    store.close()


def test_restore_of_whole_versions_unchanged(store):
    """Tables written whole at version 1: restore() of each retained version, before and after."""
    w = Workload(store, tables=FULL_TABLES, seed=2)
    w.commit(6)
    before = w.check()
    assert all((v, "restore") in before for v in range(1, 7))
    store.compact(3)
    store.compact()
    same_reads(before, w.check())
    assert store.retain(keep_last=3) == [1, 2, 3]
    store.gc()
    same_reads(before, w.check())
    assert_consistent(store)


@pytest.mark.parametrize("keep_last", [1, 2, 4])
def test_retain_keeps_exactly_the_newest(store, keep_last):
    w = Workload(store, seed=3)
    w.commit(6)
    before = w.check()
    entries = index_state(store)
    assert store.retain(keep_last=6) == [] and store.retain(keep_last=100) == []
    assert index_state(store) == entries, "retaining every version changes nothing"
    dropped = store.retain(keep_last=keep_last)
    assert dropped == list(range(1, 7 - keep_last))
    assert w.retained() == list(range(7 - keep_last, 7))
    assert store.stats()["versions"] == keep_last
    assert store.retain(keep_last=keep_last) == []
    check_dropped(store, dropped)
    same_reads(before, w.check())
    assert_consistent(store)
    # version numbers are never reused after versions are dropped
    assert w.commit(1) == [7]
    assert store.versions()[-1].parent == 6
    w.check()
    assert_consistent(store)


@pytest.mark.parametrize("bad", [0, -1, "x", 1.5, True, None, [2]])
def test_retain_rejects_bad_keep_last(store, bad):
    w = Workload(store, tables=FULL_TABLES)
    w.commit(3)
    entries = index_state(store)
    with pytest.raises(InvalidArgument):
        store.retain(keep_last=bad)
    assert index_state(store) == entries
    w.check()


def test_compact_of_unknown_versions(store):
    w = Workload(store, tables=FULL_TABLES)
    w.commit(3)
    ck = store.checkpoint()
    aborted = ck.version
    ck.abort()
    entries = index_state(store)
    for v in (aborted, aborted + 1, 10**6, 2**64 - 1):
        with pytest.raises(VersionNotFound):
            store.compact(v)
    for bad in (-1, "3", 2.0):
        with pytest.raises(InvalidArgument):
            store.compact(bad)
    assert index_state(store) == entries
    store.retain(keep_last=1)
    for v in (1, 2):
        with pytest.raises(VersionNotFound):
            store.compact(v)
    assert store.compact(3).version == 3


def test_empty_store_maintenance(store):
    """retain and gc of a store with no version: nothing to do, nothing changes."""
    assert store.retain(keep_last=1) == []
    report = store.gc()
    assert report.bytes_reclaimed == report.bytes_copied == report.segments_deleted == 0
    store.create_table("t", 10, 2)
    assert store.retain(keep_last=3) == []
    store.gc()
    assert store.versions() == [] and store.verify().ok


# -- mixed codecs, sparse tables, dense arrays ---------------------------------------------------------

def _entry(store, table: str, block: int, version: int):
    """(version, RowLoc, parsed record) of the newest index entry of the block at or before ``version``."""
    tid = store.engine.table_record(table).id
    with store.engine.read() as view:
        v, loc = next(view.row_chain(tid, block, version))
    rec = record.parse(store.engine.storage.read(loc.segment, loc.offset, loc.length), "", loc.offset)
    return v, loc, rec


@pytest.fixture
def plain_store(store_path):
    """A store that writes plain increments (no read-chain bound: chains of any length, no merges)."""
    with cnrstore.open(store_path, create=True, options=cnrstore.Options(read_chain_bound=None)) as store:
        yield store


def test_compacted_baselines_copy_encoded_bytes(plain_store):
    """A chain of one codec is materialized as that codec's stored bytes (never quantized again); a chain
    mixing codecs (overrides, and a record merging two codecs) as fp32 of each row's decoded value."""
    store = plain_store  # plain increments: the chains compaction merges
    dim = 8
    store.create_table("one", 16, dim, codec="int4", block_rows=16)
    store.create_table("mix", 16, dim, codec="int4", block_rows=16)
    rng = np.random.default_rng(5)
    vals = {v: rng.standard_normal((16, dim)).astype(np.float32) for v in range(1, 6)}
    i4, i8, f16, i2 = (codecs.get(n) for n in ("int4", "int8", "fp16", "int2"))
    expect_one = i4.decode(i4.encode(vals[1]), dim)
    enc_one = i4.encode(vals[1])
    expect_mix = expect_one.copy()
    with store.checkpoint() as ck:  # version 1: every row, int4
        ck.put_rows("one", np.arange(16), vals[1])
        ck.put_rows("mix", np.arange(16), vals[1])
    with store.checkpoint() as ck:  # version 2: int8 override
        ck.put_rows("one", [0, 1, 2, 3], vals[2][:4])
        ck.put_rows("mix", [0, 1, 2, 3], vals[2][:4], codec="int8")
    enc_one[:4] = i4.encode(vals[2][:4])
    expect_one[:4] = i4.decode(i4.encode(vals[2][:4]), dim)
    expect_mix[:4] = i8.decode(i8.encode(vals[2][:4]), dim)
    with store.checkpoint() as ck:  # version 3: one record merging fp16 and int4 rows
        ck.put_rows("one", [9, 4, 5], vals[3][[9, 4, 5]])
        ck.put_rows("mix", [4, 5, 6, 7], vals[3][4:8], codec="fp16")
        ck.put_rows("mix", [8, 9], vals[3][8:10])
    enc_one[[4, 5, 9]] = i4.encode(vals[3][[4, 5, 9]])
    expect_one[[4, 5, 9]] = i4.decode(i4.encode(vals[3][[4, 5, 9]]), dim)
    expect_mix[4:8] = f16.decode(f16.encode(vals[3][4:8]), dim)
    expect_mix[8:10] = i4.decode(i4.encode(vals[3][8:10]), dim)
    with store.checkpoint() as ck:  # version 4: int2 override
        ck.put_rows("mix", [10, 11], vals[4][10:12], codec="int2")
    expect_mix[10:12] = i2.decode(i2.encode(vals[4][10:12]), dim)
    with store.checkpoint() as ck:  # version 5: dense only
        ck.put_dense("x", np.arange(3))
    reads = {v: (store.read_table("one", version=v).tobytes(), store.read_table("mix", version=v).tobytes())
             for v in range(1, 6)}
    assert reads[5] == (expect_one.tobytes(), expect_mix.tobytes())

    for v in (5, 2, 3, 4):
        store.compact(v)
        for u in range(1, 6):
            assert (store.read_table("one", version=u).tobytes(),
                    store.read_table("mix", version=u).tobytes()) == reads[u], (v, u)
    # the compacted baselines at version 5 (a version that wrote no row)
    for table, codec_name in (("one", "int4"), ("mix", "fp32")):
        v, loc, rec = _entry(store, table, 0, 5)
        assert v == 5 and loc.flags & record.FLAG_COMPACTED and loc.flags & record.FLAG_BASELINE
        assert rec.count == 16 and rec.codec_id == codecs.get(codec_name).codec_id
    _v, _loc, rec = _entry(store, "one", 0, 5)
    assert rec.body.tobytes() == enc_one.tobytes(), "int4 bytes copied as stored, not re-quantized"
    _v, _loc, rec = _entry(store, "mix", 0, 5)
    assert rec.body.view(np.float32).reshape(16, dim).tobytes() == expect_mix.tobytes()
    # version 3 wrote block 0 of "mix": its compacted baseline replaced that version's record
    v, loc, rec = _entry(store, "mix", 0, 3)
    assert v == 3 and loc.flags & record.FLAG_COMPACTED and rec.count == 16
    assert store.stats()["max_read_chain"] == expected_max_read_chain(store) == 1
    assert store.retain(keep_last=1) == [1, 2, 3, 4]
    store.gc()
    assert store.read_table("mix").tobytes() == expect_mix.tobytes()
    assert store.read_table("one").tobytes() == expect_one.tobytes()
    assert_consistent(store)


def test_sparse_rows_stay_missing_after_compaction(store):
    """A compacted baseline holds the rows written at or before its version, nothing more."""
    store.create_table("s", 40, 2, codec="fp32", block_rows=16)
    with store.checkpoint() as ck:
        ck.put_rows("s", [3, 5, 20], [[1.0, 1], [2, 2], [3, 3]])
    with store.checkpoint() as ck:
        ck.put_rows("s", [7, 36], [[4.0, 4], [5, 5]])
    with store.checkpoint() as ck:
        ck.put_rows("s", [5], [[6.0, 6]])

    def check():
        assert store.read_rows("s", [3, 5, 20], version=1).tolist() == [[1, 1], [2, 2], [3, 3]]
        assert store.read_rows("s", [7, 5, 36], version=2).tolist() == [[4, 4], [2, 2], [5, 5]]
        assert store.read_rows("s", [7, 5, 3], version=3).tolist() == [[4, 4], [6, 6], [1, 1]]
        for v, missing in ((1, [0, 4, 7, 15, 16, 36, 39]), (2, [0, 4, 15, 21, 39]), (3, [0, 6, 8, 37])):
            for row in missing:
                with pytest.raises(MissingRows):
                    store.read_rows("s", [row], version=v)
            with pytest.raises(MissingRows, match=f"^{len(missing)} row"):
                store.read_rows("s", missing, version=v)
            with pytest.raises(MissingRows):
                store.read_table("s", version=v)
        with pytest.raises(MissingRows):
            store.restore(3)

    check()
    store.compact(2)
    check()
    store.compact(3)
    check()
    assert store.retain(keep_last=2) == [1]
    store.gc()
    with pytest.raises(VersionNotFound):
        store.read_rows("s", [3], version=1)
    for v, missing in ((2, [0, 4, 15, 21, 39]), (3, [0, 6, 8, 37])):
        with pytest.raises(MissingRows, match=f"^{len(missing)} row"):
            store.read_rows("s", missing, version=v)
    assert store.read_rows("s", [7, 5, 36, 20, 3], version=2).tolist() == [[4, 4], [2, 2], [5, 5], [3, 3], [1, 1]]
    assert store.read_rows("s", [7, 5, 36, 20, 3], version=3).tolist() == [[4, 4], [6, 6], [5, 5], [3, 3], [1, 1]]
    assert_consistent(store)


def test_dense_only_store(store):
    arrays = {v: (np.arange(v * 3, dtype=np.int16).reshape(v, 3), np.full(4, v, dtype=np.float64))
              for v in range(1, 8)}
    for v in range(1, 8):
        with store.checkpoint() as ck:
            ck.put_dense("a", arrays[v][0])
            if v % 3 == 1:
                ck.put_dense("b", arrays[v][1])

    def check(retained):
        assert [i.version for i in store.versions()] == retained
        for v in retained:
            assert store.read_dense("a", version=v).tobytes() == arrays[v][0].tobytes()
            assert store.read_dense("a", version=v).shape == (v, 3)
            b = arrays[max(u for u in (1, 4, 7) if u <= v)][1]
            assert store.read_dense("b", version=v).tobytes() == b.tobytes()
            snap = store.restore(v)
            assert snap.tables == {} and set(snap.dense) == {"a", "b"}

    check(list(range(1, 8)))
    store.compact(3)
    assert store.retain(keep_last=3) == [1, 2, 3, 4]
    check([5, 6, 7])  # "b" of version 4, a dropped version, is still what 5 and 6 read
    store.gc()
    check([5, 6, 7])
    assert_consistent(store)


def test_max_read_chain(plain_store):
    """stats()["max_read_chain"] is the longest chain a read of any retained version walks; compact(v)
    makes every chain at v one record long; after retaining only the newest, it is 1."""
    store = plain_store  # plain increments: chains of any length
    store.create_table("t", 256, 4, codec="int8", block_rows=32)
    store.create_table("u", 64, 4, codec="fp32", block_rows=64)
    rng = np.random.default_rng(9)
    with store.checkpoint() as ck:
        ck.put_rows("t", np.arange(256), rng.standard_normal((256, 4)))
        ck.put_rows("u", np.arange(64), rng.standard_normal((64, 4)))
    for v in range(2, 9):
        with store.checkpoint() as ck:
            rows = rng.choice(256, size=20, replace=False)
            ck.put_rows("t", rows, rng.standard_normal((20, 4)))
            if v % 2:
                ck.put_rows("u", [v], rng.standard_normal((1, 4)))
    reads = {v: store.read_table("t", version=v).tobytes() + store.read_table("u", version=v).tobytes()
             for v in range(1, 9)}
    assert store.stats()["max_read_chain"] == expected_max_read_chain(store) >= 5
    store.compact()
    with store.engine.read() as view:
        assert all(len(c) == 1 for c in compaction.block_chains(view, 8).values())
    assert store.stats()["max_read_chain"] == expected_max_read_chain(store)
    store.compact(4)
    with store.engine.read() as view:
        assert all(len(c) == 1 for c in compaction.block_chains(view, 4).values())
    assert store.stats()["max_read_chain"] == expected_max_read_chain(store)
    for v in range(1, 9):
        assert store.read_table("t", version=v).tobytes() + store.read_table("u", version=v).tobytes() == reads[v]
    store.retain(keep_last=1)
    assert store.stats()["max_read_chain"] == 1
    # a fresh store compacted at its newest version: every read walks one record
    with store.checkpoint() as ck:
        ck.put_rows("t", [1, 2], np.ones((2, 4)))
    assert store.stats()["max_read_chain"] == 2
    store.compact()
    store.retain(keep_last=1)
    assert store.stats()["max_read_chain"] == 1
    assert store.read_table("t").tobytes() != reads[8][:256 * 16]


# -- gc ------------------------------------------------------------------------------------------------

def test_gc_reclaims_space_after_retain(store):
    w = Workload(store, seed=4)
    w.commit(10)
    before = w.check()
    store.gc()  # (puts merged into a block of their version left dead records before anything is dropped)
    same_reads(before, w.check())
    stats0 = store.stats()
    dropped = store.retain(keep_last=2)
    assert dropped == list(range(1, 9))
    stats1 = store.stats()
    assert stats1["live_bytes"] < stats0["live_bytes"]
    report = store.gc()
    stats2 = store.stats()
    assert report.bytes_reclaimed > 0 and report.segments_deleted > 0 and report.bytes_pending == 0
    assert report.segments_rewritten > 0 and report.bytes_copied > 0, "partly live segments are rewritten"
    assert stats2["bytes_on_disk"] < stats1["bytes_on_disk"]
    assert stats2["segment_bytes"] < stats1["segment_bytes"]
    # records the kept versions read only partly were rewritten with their live rows only
    assert stats2["live_bytes"] < stats1["live_bytes"]
    assert stats2["bytes_written"] == stats1["bytes_written"] + report.bytes_copied
    # (plus the headers of segments the copies went to)
    assert 0 <= stats2["segment_bytes"] - (stats1["segment_bytes"] - report.bytes_reclaimed + report.bytes_copied) \
        <= 32 * len(segment_files(store.path))
    with store.engine.read() as view:
        assert set(segment_files(store.path)) == set(view.segments())
        assert not view.meta("doomed_segments", {})
    same_reads(before, w.check())
    assert_consistent(store)
    store = reopen(store, w)
    same_reads(before, w.check())
    w.commit(2)
    w.check()
    assert_consistent(store)


def test_gc_of_a_corrupted_live_record_changes_nothing(store):
    """GC copies live records checksum-verified: a damaged one raises CorruptionError, and the store is
    left as it was (what the damage does not touch still reads; verify reports the damage)."""
    w = Workload(store, seed=6)
    w.commit(10)
    store.retain(keep_last=3)
    with store.engine.read() as view:
        committed = view.segments()
        live: dict[int, list] = {}
        for tid, block, v, loc in view.row_entries():
            live.setdefault(loc.segment, []).append(("rows", tid, block, v, loc))
        for dense_id, v, loc in view.dense_entries():
            live.setdefault(loc.segment, []).append(("dense", dense_id, None, v, loc))
        dense_names = {i: n for n, i in view.dense_names().items()}
    newest_seg = max(committed)
    candidates = [s for s in sorted(committed) if s != newest_seg and live.get(s) and
                  sum(e[4].length for e in live[s]) / (committed[s] - 32) < knobs.GC_LIVE_FRACTION]
    assert len(candidates) >= 2, "the workload leaves partly live sealed segments"
    seg = candidates[-1]  # GC copies the other candidates first: those copies must be undone
    kind, obj, block, v, loc = live[seg][-1]
    if kind == "rows":
        damaged = next(n for n in TABLES if store.engine.table_record(n).id == obj)
    else:
        damaged = dense_names[obj]
    path = filenames.segment_path(store.path, seg)
    with open(path, "r+b") as f:
        f.seek(loc.offset + loc.length - 12)  # a body byte (the checksum is the last 8)
        byte = f.read(1)
        f.seek(loc.offset + loc.length - 12)
        f.write(bytes([byte[0] ^ 0x5A]))
    store.close()
    store = cnrstore.open(w.store.path)  # no stale mapping of the damaged file
    w.store = store
    state, files = index_state(store), segment_files(store.path)

    with pytest.raises(CorruptionError):
        store.gc()
    # GC frees the wholly dead segments first (no version reads them); the batch of copies the damage
    # interrupted is undone: no index entry moved, no copy left on disk, the candidates still indexed
    after, files_after = index_state(store), segment_files(store.path)
    assert after[0] == state[0] and after[2:4] == state[2:4] and set(candidates) <= set(after[1])
    assert all(files.get(seg) == size for seg, size in files_after.items()), "copies made before the damage are undone"
    state, files = after, files_after
    # the version that reads the damaged record first reports it
    oldest = store.versions()[0].version
    with pytest.raises(CorruptionError):
        if kind == "rows":
            block_rows = store.tables()[damaged].block_rows
            store.read_rows(damaged, [block * block_rows], version=max(v, oldest))
        else:
            store.read_dense(damaged, version=max(v, oldest))
    # every other read is exact
    intact = 0
    for u in w.retained():
        tables, dense = w.states[u]
        for name, (values, written) in tables.items():
            rows = np.flatnonzero(written)
            try:
                assert store.read_rows(name, rows, version=u).tobytes() == values[rows].tobytes()
                intact += 1
            except CorruptionError:
                assert name == damaged
        for name, arr in dense.items():
            try:
                assert store.read_dense(name, version=u).tobytes() == arr.tobytes()
                intact += 1
            except CorruptionError:
                assert name == damaged
    assert intact > 10
    report = store.verify()
    assert not report.ok and any(os.path.basename(path) in p for p in report.problems), report.problems
    with pytest.raises(CorruptionError):
        store.gc()  # still refused, still nothing changed
    assert index_state(store) == state and segment_files(store.path) == files
    store.close()


def test_maintenance_beside_an_open_checkpoint(store):
    """compact, retain and gc run while a checkpoint is being written (docs/DESIGN.md: the trainer never
    waits for them): the open version, whose records span several of the writer's segments and are
    merged with later puts, commits intact, and every retained version reads as before."""
    w = Workload(store, seed=11)
    w.commit(6)
    before = w.check()
    tables, dense = w.head
    rng = np.random.default_rng(3)
    ck = store.checkpoint(step=1, meta={"open": True})
    v = ck.version
    a = rng.standard_normal((640, 8)).astype(np.float32)
    ck.put_rows("full_i4", np.arange(0, 640, 2), a[0::2])
    b = rng.standard_normal((200, 16)).astype(np.float32)
    ck.put_rows("default_i2", np.arange(200), b)
    c = rng.standard_normal((300, 5)).astype(np.float32)
    ck.put_rows("wide_f32", np.arange(300), c)  # 6 KiB: the open version spans the writer's segments
    assert store.compact().blocks_materialized > 0
    same_reads(before, w.check())
    dropped = store.retain(keep_last=2)
    assert dropped == [1, 2, 3, 4]
    report = store.gc()
    assert report.segments_deleted > 0
    with pytest.raises(CheckpointInProgress):
        store.checkpoint()  # the open checkpoint is still the one writer
    ck.put_rows("full_i4", np.arange(1, 640, 2), a[1::2])  # merged into the blocks put above
    ck.put_dense("step", np.array([v, 2 * v], dtype=np.int64))
    store.gc()
    assert ck.commit() == v
    with store.engine.read() as view:
        assert len({loc.segment for _t, _b, u, loc in view.row_entries() if u == v}) > 1
    assert store.versions()[-1].parent == 6
    i4, i2 = codecs.get("int4"), codecs.get("int2")

    def check_open_version():
        assert store.read_table("full_i4", version=v).tobytes() == i4.decode(i4.encode(a), 8).tobytes()
        assert store.read_table("default_i2", version=v).tobytes() == i2.decode(i2.encode(b), 16).tobytes()
        assert store.read_table("wide_f32", version=v).tobytes() == c.tobytes()
        for name in ("sparse_f16", "pairs_i8"):  # not put: as at version 6
            rows = np.flatnonzero(tables[name][1])
            assert store.read_rows(name, rows, version=v).tobytes() == tables[name][0][rows].tobytes()
        assert store.read_dense("weights", version=v).tobytes() == dense["weights"].tobytes()

    check_open_version()
    same_reads(before, w.check(versions=[5, 6]))
    check_dropped(store, dropped)
    assert_consistent(store)
    store = reopen(store, w)
    same_reads(before, w.check(versions=[5, 6]))
    check_open_version()
    assert_consistent(store)
    store.close()


def test_maintenance_refused_on_a_readonly_store(store):
    w = Workload(store, tables=FULL_TABLES)
    w.commit(3)
    entries = index_state(store)
    with cnrstore.open(store.path, readonly=True) as ro:
        for call in (lambda: ro.compact(), lambda: ro.compact(1), lambda: ro.retain(keep_last=1), lambda: ro.gc()):
            with pytest.raises(ReadOnlyError):
                call()
    store.close()
    with cnrstore.open(store.path, readonly=True) as ro:
        with pytest.raises(ReadOnlyError):
            ro.retain(keep_last=1)
        with pytest.raises(ReadOnlyError):
            ro.gc()
        w.check(store=ro)
        assert index_state(ro) == entries


def test_compaction_grows_the_index_map(tmp_path):
    """compact/retain/gc commits that need a larger LMDB map grow it (no MapFullError, no hang)."""
    script = textwrap.dedent('''
        import sys, numpy as np, cnrstore
        from cnrstore import knobs
        knobs.INDEX_MAP_BYTES = 16 << 10
        knobs.SEGMENT_BYTES = 64 << 10
        n = 24000
        with cnrstore.open(sys.argv[1], create=True) as s:
            s.create_table("a", n, 1, codec="fp32", block_rows=2)
            with s.checkpoint() as ck:  # even rows, then odd rows: every block's chain is 2 long
                ck.put_rows("a", np.arange(0, n, 2), np.arange(0, n, 2, dtype=np.float32)[:, None])
            with s.checkpoint() as ck:
                ck.put_rows("a", np.arange(1, n, 2), np.arange(1, n, 2, dtype=np.float32)[:, None])
            for v in (3, 4):
                with s.checkpoint() as ck:
                    ck.put_dense("x", np.zeros(3))
            size = s.engine._index.map_size()
            s.compact(3)  # a new index entry per block
            s.compact(4)
            s.retain(keep_last=1)
            s.gc()
            assert s.engine._index.map_size() > size
            assert s.read_table("a").ravel().tolist() == list(range(n))
            assert s.verify().ok
        print("ok")
    ''')
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path / "s")], env=CHILD_ENV,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", (proc.returncode, proc.stdout, proc.stderr[-3000:])


# -- readers and GC ------------------------------------------------------------------------------------

#: Shared with the reader subprocess: version v's rows and values are functions of v.
READER_WORKLOAD = textwrap.dedent('''
    import numpy as np
    from cnrstore import codecs

    TABLES = {"t": (256, 6, "fp32", 32), "q": (128, 8, "int4", 16)}

    def puts(v):
        rng = np.random.default_rng(v)
        out = {}
        for name, (n, dim, _c, _b) in TABLES.items():
            rows = np.arange(n) if v == 1 else rng.choice(n, size=int(rng.integers(1, n // 2)), replace=False)
            vals = np.empty((rows.size, dim), dtype=np.float32)
            vals[:, 0] = v
            vals[:, 1] = rows
            vals[:, 2:] = rng.standard_normal((rows.size, dim - 2))
            out[name] = (rows, vals)
        return out

    class States:
        """What version v reads as, given that versions 1..v all committed."""

        def __init__(self):
            self.states = {0: {n: np.full((r, d), np.nan, np.float32) for n, (r, d, _c, _b) in TABLES.items()}}

        def at(self, v):
            while v not in self.states:
                u = max(self.states) + 1
                s = {n: a.copy() for n, a in self.states[u - 1].items()}
                for name, (rows, vals) in puts(u).items():
                    c = codecs.get(TABLES[name][2])
                    s[name][rows] = c.decode(c.encode(vals), TABLES[name][1])
                self.states[u] = s
            return self.states[v]
''')
_ns: dict = {}
exec(READER_WORKLOAD, _ns)

READER = READER_WORKLOAD + textwrap.dedent('''
    import os, sys, time
    import cnrstore
    from cnrstore.errors import VersionNotFound

    path, stop, progress = sys.argv[1], sys.argv[2], sys.argv[3]
    states = States()
    reads = notfound = 0
    with cnrstore.open(path, readonly=True) as store:
        print("ready", flush=True)
        while not os.path.exists(stop):
            for info in store.versions():
                v = info.version
                try:
                    got = {name: store.read_table(name, version=v) for name in TABLES}
                    snap = store.restore(v)
                except VersionNotFound:
                    # acceptable only for a version dropped meanwhile: it never comes back
                    if v in [i.version for i in store.versions()]:
                        print("error: VersionNotFound for retained version", v, flush=True)
                        sys.exit(1)
                    notfound += 1
                    continue
                expect = states.at(v)
                for name in TABLES:
                    if got[name].tobytes() != expect[name].tobytes() or \\
                            snap.tables[name].tobytes() != expect[name].tobytes():
                        print("error: version", v, "table", name, "reads wrong", flush=True)
                        sys.exit(1)
                if snap.dense["v"].tolist() != [v]:
                    print("error: dense of version", v, flush=True)
                    sys.exit(1)
                reads += 1
                with open(progress + ".tmp", "w") as f:  # how far it got, for the writer's loop
                    f.write(str(reads))
                os.replace(progress + ".tmp", progress)
    print("done", reads, notfound, flush=True)
''')


def _reader_checkpoint(store, states) -> int:
    with store.checkpoint() as ck:
        for name, (rows, vals) in _ns["puts"](ck.version).items():
            ck.put_rows(name, rows, vals)
        ck.put_dense("v", np.array([ck.version]))
    return ck.version


def test_reader_in_another_process_during_retain_and_gc(tmp_path, monkeypatch):
    """A readonly reader in another process reads every retained version in a loop (and reads each
    exactly) while this process checkpoints, compacts, retains and collects, deleting segments. The writer
    goes on for at least 4 s and 12 rounds, and until the reader has read 21 versions (a loaded machine
    slows the reader, not the test's verdict), at most 300 s."""
    monkeypatch.setattr(knobs, "SEGMENT_BYTES", 2048)
    path, stop = str(tmp_path / "store"), str(tmp_path / "stop")
    progress = str(tmp_path / "reads")

    def reader_reads() -> int:
        try:
            return int(open(progress).read())
        except FileNotFoundError:
            return 0

    states = _ns["States"]()
    store = cnrstore.open(path, create=True)
    for name, (n, dim, codec, block) in _ns["TABLES"].items():
        store.create_table(name, n, dim, codec=codec, block_rows=block)
    for _ in range(3):
        _reader_checkpoint(store, states)
    proc = subprocess.Popen([sys.executable, "-c", READER, path, stop, progress], env=CHILD_ENV,
                            stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
        rng = np.random.default_rng(0)
        reclaimed = pending = deleted = 0
        dropped: list[int] = []
        start = time.monotonic()
        rounds = 0
        while (time.monotonic() < start + 4.0 or rounds < 12 or reader_reads() <= 20) \
                and time.monotonic() < start + 300:
            v = _reader_checkpoint(store, states)
            if rng.random() < 0.5:
                retained = [i.version for i in store.versions()]
                store.compact(int(rng.choice(retained)))
            dropped += store.retain(keep_last=int(rng.integers(2, 5)))
            report = store.gc()
            reclaimed += report.bytes_reclaimed
            pending += report.bytes_pending
            deleted += report.segments_deleted
            rounds += 1
            assert proc.poll() is None, proc.stdout.read() + proc.stderr.read()
        assert deleted > 0 and reclaimed > 0, "GC deleted segment files while the reader read"
        open(stop, "w").close()
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, (out, err[-3000:])
    words = out.split()
    assert words[0] == "done", out
    reads, notfound = int(words[1]), int(words[2])
    assert reads > 20, out
    retained = [i.version for i in store.versions()]
    assert set(retained).isdisjoint(dropped) and retained[-1] == v
    for u in retained:
        for name in _ns["TABLES"]:
            assert store.read_table(name, version=u).tobytes() == states.at(u)[name].tobytes()
    store.gc()  # the reader is gone: nothing is pending any more
    with store.engine.read() as view:
        assert not view.meta("doomed_segments", {})
        assert set(segment_files(path)) == set(view.segments())
    assert store.verify().ok
    store.close()


def _prepared(path: str, versions: int = 6):
    """A store of the workload whose retain(keep_last=1) + gc frees segments."""
    store = cnrstore.open(path, create=True)
    w = Workload(store, seed=8)
    w.commit(versions)
    return store, w


def test_gc_keeps_segments_a_reader_transaction_can_see(store_path):
    """A read transaction begun before a GC keeps the segments it can see: GC leaves them on disk
    (bytes_pending), reads through that transaction still work, and the next gc() deletes them."""
    store, w = _prepared(store_path)
    old = w.check(versions=[1])
    tinfo = store.engine.table_record("full_i4")
    files_before = set(segment_files(store_path))
    with store.engine.read() as view:  # held across retain and gc, like a reader in the middle of a read
        dropped = store.retain(keep_last=1)
        assert 1 in dropped
        report = store.gc()
        assert report.bytes_pending > 0 and report.bytes_reclaimed == 0 and report.segments_deleted == 0
        with store.engine.read() as now:
            doomed = {int(k) for k in now.meta("doomed_segments", {})}
            live = set(now.segments())
        assert doomed and doomed <= files_before and doomed.isdisjoint(live)
        assert doomed <= set(segment_files(store_path)), "freed segments stay on disk while read"
        # the old transaction still reads the dropped version 1, through the freed segments
        got = reader.read_table(view, store.engine.storage, tinfo, 1)
        assert got.tobytes() == old[1, "full_i4"]
        sparse = store.engine.table_record("sparse_f16")
        rows = np.flatnonzero(w.states[1][0]["sparse_f16"][1])
        assert reader.read_rows(view, store.engine.storage, sparse, rows, 1).tobytes() == old[1, "sparse_f16"]
        assert store.gc().segments_deleted == 0, "still read"
    report = store.gc()
    assert report.segments_deleted == len(doomed) and report.bytes_reclaimed > 0 and report.bytes_pending == 0
    assert not doomed & set(segment_files(store_path))
    w.check()
    assert_consistent(store)
    store.close()


HOLDER = textwrap.dedent('''
    import sys, cnrstore
    with cnrstore.open(sys.argv[1], readonly=True) as store:
        with store.engine.read() as view:
            print("holding", view.latest()[0], flush=True)
            sys.stdin.readline()
    print("released", flush=True)
''')


def _holder(path: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, path], env=CHILD_ENV, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert line.startswith("holding"), proc.stderr.read()
    return proc


def test_freed_segments_wait_for_a_reader_in_another_process(store_path):
    """A read transaction of another process keeps freed segments on disk, across a writable reopen;
    once it ends, a writable open deletes them."""
    store, w = _prepared(store_path)
    proc = _holder(store_path)
    try:
        store.retain(keep_last=1)
        report = store.gc()
        assert report.bytes_pending > 0 and report.segments_deleted == 0
        with store.engine.read() as view:
            doomed = {int(k) for k in view.meta("doomed_segments", {})}
        assert doomed and doomed <= set(segment_files(store_path))
        store.close()
        store = cnrstore.open(store_path)  # the reader still reads: nothing is deleted at open
        assert doomed <= set(segment_files(store_path))
        assert_consistent(store)
        store.close()
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "released"
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    store = cnrstore.open(store_path)  # writable open: deletes what no reader needs
    w.store = store
    with store.engine.read() as view:
        assert not view.meta("doomed_segments", {})
        assert set(segment_files(store_path)) == set(view.segments())
    assert not doomed & set(segment_files(store_path))
    w.check()
    assert_consistent(store)
    store.close()


def test_a_killed_reader_does_not_keep_segments_forever(store_path):
    """A reader process killed in the middle of a read transaction leaves a stale LMDB reader slot;
    it must not keep freed segments on disk once the process is gone."""
    store, w = _prepared(store_path)
    proc = _holder(store_path)
    try:
        store.retain(keep_last=1)
        assert store.gc().bytes_pending > 0
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    report = store.gc()  # this process still has the environment open: the dead slot is still listed
    assert report.bytes_pending == 0 and report.segments_deleted > 0
    with store.engine.read() as view:
        assert not view.meta("doomed_segments", {})
        assert set(segment_files(store_path)) == set(view.segments())
    w.check()
    store.close()


def test_a_long_lived_reader_across_a_writer_restart(store_path):
    """Segment ids are never reused, even after GC deleted the newest segment and the writer restarted:
    a readonly store that stays open (and keeps the old file mapped) reads the new data right."""
    store = cnrstore.open(store_path, create=True)
    store.create_table("t", 64, 4, codec="fp32", block_rows=64)
    with store.checkpoint() as ck:
        ck.put_rows("t", np.arange(64), np.zeros((64, 4)))
    with store.checkpoint() as ck:
        ck.put_rows("t", [1, 2], np.ones((2, 4)))
    store.compact(2)  # a segment of compaction's own, the newest, holding the baseline at version 2
    with cnrstore.open(store_path, readonly=True) as ro:
        assert ro.read_table("t", version=2)[:3, 0].tolist() == [0, 1, 1]  # maps every segment
        with store.checkpoint() as ck:
            ck.put_rows("t", np.arange(64), np.full((64, 4), 3.0))
        assert store.retain(keep_last=1) == [1, 2]
        newest = max(segment_files(store_path))
        # the compaction segment, the newest (nothing in it is read any more), and the idle writer's
        # segment, cleaned as well (its live records copied to a new segment)
        assert store.gc().segments_deleted >= 1 and newest not in segment_files(store_path)
        used = max(segment_files(store_path))
        before = set(segment_files(store_path))
        store.close()
        store = cnrstore.open(store_path)
        with store.checkpoint() as ck:
            ck.put_rows("t", [5], np.full((1, 4), 7.0))
        store.compact()
        assert min(set(segment_files(store_path)) - before) > used
        assert ro.read_table("t")[4:7, 0].tolist() == [3, 7, 3]
        assert ro.read_table("t", version=3)[5, 0] == 3
    assert_consistent(store)
    store.close()


def test_store_drop_versions_is_the_seam_for_sibling_packages(store):
    """Store.drop_versions (what cnrstore.distributed calls): drops the versions present, keeps what kept
    versions read, and drops the newest one only when allowed; gc then reclaims the space."""
    store.create_table("t", 64, 4, codec="fp32", block_rows=16)
    for v in range(1, 5):
        with store.checkpoint() as ck:
            ck.put_rows("t", np.arange(v, 64, 4), np.full((len(range(v, 64, 4)), 4), v, np.float32))
    rows = np.arange(1, 64)  # (row 0 is written first by the last checkpoint below)
    newest = store.read_rows("t", rows, 4)
    with pytest.raises(cnrstore.CnrError, match="newest"):
        store.drop_versions([4])
    assert store.drop_versions([2, 3, 99]) == [2, 3]
    assert [v.version for v in store.versions()] == [1, 4]
    assert np.array_equal(store.read_rows("t", rows, 4), newest)
    assert store.drop_versions([4], allow_newest=True) == [4]
    assert [v.version for v in store.versions()] == [1]
    store.gc()
    assert store.verify().ok
    with store.checkpoint() as ck:  # version numbers are never reused
        ck.put_rows("t", [0], np.zeros((1, 4), np.float32))
    assert store.latest().version == 5
