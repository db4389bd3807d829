"""Cumulative delta records written by the save path (format 3, cnrstore/engine/merge.py) under the count
bound alone (``knobs.READ_CHAIN_BOUND``, with the cost bound and background merges off: test_merge_chains
covers those): every block's read chain stays within knobs.READ_CHAIN_BOUND, every version reads bit-exactly as its puts say, merged bytes are copies of the
stored ones, a block whose deltas copied knobs.DELTA_RESET_FRACTION of it gets a new baseline, and retention never drops
the baseline an open checkpoint's deltas read."""

from __future__ import annotations

import os

import numpy as np
import pytest

import cnrstore
from cnrstore import codecs, knobs
from cnrstore.engine import record
from cnrstore.errors import CorruptionError


@pytest.fixture(autouse=True)
def _count_bound_only(monkeypatch):
    monkeypatch.setattr(knobs, "READ_CHAIN_BOUND", 3)
    monkeypatch.setattr(knobs, "READ_AMP_BOUND", None)
    monkeypatch.setattr(knobs, "MERGE_TRIGGER", None)


def _entries(store, table: str):
    """{(block, version): RowLoc} of a table's index entries."""
    with store.engine.read() as view:
        tid = view.table(table).id
        return {(b, v): loc for t, b, v, loc in view.row_entries(tid)}


def _record(store, loc) -> record.Record:
    return record.parse(store.engine.storage.read(loc.segment, loc.offset, loc.length), "seg", loc.offset)


class Model:
    """What every version of a table must read as: the decoded value of each row's newest put."""

    def __init__(self, num_rows: int, dim: int):
        self.state = np.full((num_rows, dim), np.nan, np.float32)
        self.versions: dict[int, np.ndarray] = {}

    def put(self, rows, values, codec_name: str) -> None:
        codec = codecs.get(codec_name)
        self.state[rows] = codec.decode(codec.encode(values), values.shape[1])

    def commit(self, version: int) -> None:
        self.versions[version] = self.state.copy()


@pytest.mark.parametrize("bound", [2, 3, 5])
def test_every_read_chain_stays_within_the_bound_and_every_version_reads_exactly(tmp_path, monkeypatch, bound):
    """40 versions of random Zipf-like touches, several puts per version (some with another codec, some
    overriding rows a merged record carries): after every commit the longest read chain of any version is
    at most the bound, and every version reads bit-exactly as the model says (whole table and rows)."""
    monkeypatch.setattr(knobs, "READ_CHAIN_BOUND", bound)
    monkeypatch.setattr(knobs, "DELTA_RESET_FRACTION", 0.6)
    num_rows, dim = 300, 8
    rng = np.random.default_rng(bound)
    model = Model(num_rows, dim)
    with cnrstore.open(tmp_path / "s", create=True) as store:
        store.create_table("t", num_rows, dim, codec="int4", block_rows=64)
        for i in range(40):
            with store.checkpoint(step=i) as ck:
                if i == 0:
                    rows = np.arange(num_rows)
                else:
                    hot = rng.zipf(1.3, size=40) % num_rows
                    rows = np.unique(np.concatenate([hot, rng.choice(num_rows, 5, replace=False)]))
                parts = np.array_split(rng.permutation(rows), int(rng.integers(1, 4)))
                for j, part in enumerate(parts):
                    if not part.size:
                        continue
                    values = rng.standard_normal((part.size, dim)).astype(np.float32) * (1 + i % 3)
                    codec = "int8" if (j == 1 and i % 4 == 1) else "int4"
                    ck.put_rows("t", part, values, codec=codec)
                    model.put(part, values, codec)
            model.commit(ck.version)
            assert store.stats()["max_read_chain"] <= bound
        entries = _entries(store, "t")
        assert any(loc.flags & record.FLAG_DELTA for loc in entries.values()), "deltas were written"
        if bound >= 3:  # two levels: some delta is a delta on another delta
            assert any(loc.base and entries.get((b, loc.base), loc).base for (b, _v), loc in entries.items())
        for v, expect in model.versions.items():
            assert store.read_table("t", version=v).tobytes() == expect.tobytes(), v
            ids = rng.choice(num_rows, 50)
            assert store.read_rows("t", ids, version=v).tobytes() == expect[ids].tobytes(), v
        assert store.verify().ok


def test_a_delta_copies_the_stored_bytes_of_the_rows_it_carries(tmp_path):
    """The third increment of a block is written as one record holding its rows and the rows of the two
    increments before it (not the baseline's), each carried row's encoded bytes copied unchanged, flagged
    as a delta on the baseline; a read of it visits two records."""
    with cnrstore.open(tmp_path / "s", create=True) as store:
        store.create_table("t", 64, 4, codec="int4", block_rows=64)
        rng = np.random.default_rng(1)
        for rows in (np.arange(64), [1, 2], [3], [4, 1]):
            with store.checkpoint() as ck:
                ck.put_rows("t", rows, rng.standard_normal((len(rows), 4)).astype(np.float32))
        entries = _entries(store, "t")
        delta = entries[(0, 4)]
        assert delta.flags & record.FLAG_DELTA and delta.base == 1 and delta.count == 4
        rec = _record(store, delta)
        assert rec.base() == 1 and rec.offsets().tolist() == [1, 2, 3, 4]
        row_bytes = codecs.get("int4").row_bytes(4)
        body = rec.body.reshape(4, row_bytes)
        inc2, inc3 = _record(store, entries[(0, 2)]), _record(store, entries[(0, 3)])
        assert body[1].tobytes() == inc2.body.reshape(2, row_bytes)[1].tobytes()  # row 2, from version 2
        assert body[2].tobytes() == inc3.body.tobytes()  # row 3, from version 3
        assert store.stats()["max_read_chain"] == 3
        with store.engine.read() as view:
            assert [v for v, _loc in view.row_chain(1, 0, 4)] == [4, 1]


def test_a_delta_on_a_delta_copies_only_the_rows_above_it(tmp_path, monkeypatch):
    """Two levels: with a cumulative delta D on the baseline in the chain, the next merge writes a delta
    on D holding only the rows above D (while they are fewer than DELTA_TIER_RATIO times D's rows), read
    as it, D and the baseline: three records; D's rows are not copied again."""
    monkeypatch.setattr(knobs, "DELTA_FULL_FRACTION", 1.0)
    with cnrstore.open(tmp_path / "s", create=True) as store:
        store.create_table("t", 64, 4, codec="fp32", block_rows=64)
        state = np.zeros((64, 4), np.float32)
        puts = (np.arange(64), np.arange(0, 8), np.arange(8, 16), np.arange(16, 20), np.arange(20, 22),
                np.arange(22, 24))
        for v, rows in enumerate(puts, 1):
            state[rows] = v
            with store.checkpoint() as ck:
                ck.put_rows("t", rows, np.full((len(rows), 4), float(v), np.float32))
        entries = _entries(store, "t")
        d = entries[(0, 4)]  # versions 2-4 merged: a cumulative delta on the baseline
        assert d.flags & record.FLAG_DELTA and d.base == 1 and d.count == 20
        top = entries[(0, 6)]  # versions 5-6 merged: a delta on version 4's delta
        assert top.flags & record.FLAG_DELTA and top.base == 4 and top.count == 4
        with store.engine.read() as view:
            assert [v for v, _loc in view.row_chain(1, 0, 6)] == [6, 4, 1]
        assert store.stats()["max_read_chain"] == 3
        assert store.read_table("t").tobytes() == state.tobytes()
        store.retain(keep_last=1)
        store.gc()
        assert store.read_table("t").tobytes() == state.tobytes()
        assert store.verify().ok
    report = cnrstore.repair(tmp_path / "s")
    assert report.ok and report.versions_recovered == [6]
    with cnrstore.open(tmp_path / "s", readonly=True) as store:
        assert store.read_table("t").tobytes() == state.tobytes()


def test_copies_past_the_reset_fraction_make_a_new_baseline(tmp_path, monkeypatch):
    """Once the rows a block's deltas copied since its baseline reach DELTA_RESET_FRACTION of the block
    (here 16 of 64: version 4 would copy the 16 rows of versions 2 and 3), the merged record takes the
    baseline's other rows too: a full baseline, read alone."""
    monkeypatch.setattr(knobs, "DELTA_RESET_FRACTION", 0.25)
    monkeypatch.setattr(knobs, "DELTA_FULL_FRACTION", 1.0)
    with cnrstore.open(tmp_path / "s", create=True) as store:
        store.create_table("t", 64, 4, codec="fp32", block_rows=64)
        values = {}
        for v, rows in enumerate((np.arange(64), np.arange(0, 8), np.arange(8, 16), np.arange(16, 20)), 1):
            vals = np.full((len(rows), 4), float(v), np.float32)
            with store.checkpoint() as ck:
                ck.put_rows("t", rows, vals)
            values[v] = vals
        loc = _entries(store, "t")[(0, 4)]
        assert loc.flags & record.FLAG_BASELINE and not loc.flags & record.FLAG_DELTA and loc.count == 64
        expect = np.ones((64, 4), np.float32)
        expect[0:8], expect[8:16], expect[16:20] = 2, 3, 4
        assert store.read_table("t").tobytes() == expect.tobytes()


def test_retention_beside_an_open_checkpoint_keeps_the_baseline_its_delta_reads(tmp_path):
    """A checkpoint whose delta reads the baseline at version 1 is open while compact() makes a new
    baseline at the newest version and retain(keep_last=1) drops version 1: the entry at version 1 is kept
    (pinned) and the checkpoint commits a version that reads exactly."""
    with cnrstore.open(tmp_path / "s", create=True) as store:
        store.create_table("t", 64, 4, codec="fp32", block_rows=64)
        state = np.zeros((64, 4), np.float32)
        for v, rows in enumerate((np.arange(64), [1], [2]), 1):
            state[rows] = v
            with store.checkpoint() as ck:
                ck.put_rows("t", rows, np.full((len(rows), 4), v, np.float32))
        ck = store.checkpoint()
        ck.put_rows("t", [3], np.full((1, 4), 4.0, np.float32))  # chain 3 at the parent: a delta on 1
        state[3] = 4
        assert ck.pins == {(1, 0, 1)}
        store.compact()
        assert store.retain(keep_last=1) == [1, 2]
        store.gc()
        assert (0, 1) in _entries(store, "t")
        assert store.verify().ok
        ck.commit()
        assert store.read_table("t").tobytes() == state.tobytes()
        assert store.verify().ok


def test_a_delta_whose_base_entry_is_gone_raises_corruption(tmp_path):
    """An index that names a delta whose base entry is missing is damage, reported, never read past."""
    with cnrstore.open(tmp_path / "s", create=True) as store:
        store.create_table("t", 64, 4, codec="fp32", block_rows=64)
        for rows in (np.arange(64), [1], [2], [3]):
            with store.checkpoint() as ck:
                ck.put_rows("t", rows, np.ones((len(rows), 4), np.float32))
        store.engine._index.write(lambda w: w.delete_row(1, 0, 1))
        with pytest.raises(CorruptionError, match="delta on version 1"):
            store.read_table("t")
        assert store.read_rows("t", [1], version=2).tolist() == [[1.0] * 4]  # no delta on its way
        assert not store.verify().ok


def test_a_flipped_byte_of_a_delta_is_reported(tmp_path):
    with cnrstore.open(tmp_path / "s", create=True) as store:
        store.create_table("t", 64, 4, codec="fp32", block_rows=64)
        for rows in (np.arange(64), [1], [2], [3]):
            with store.checkpoint() as ck:
                ck.put_rows("t", rows, np.ones((len(rows), 4), np.float32))
        loc = _entries(store, "t")[(0, 4)]
        assert loc.flags & record.FLAG_DELTA
        path = store.engine.storage.path(loc.segment)
    with open(path, "r+b") as f:  # the base version field, first in the aux
        f.seek(loc.offset + record.HEADER_BYTES)
        byte = f.read(1)
        f.seek(loc.offset + record.HEADER_BYTES)
        f.write(bytes([byte[0] ^ 0x01]))
    with cnrstore.open(tmp_path / "s", readonly=True) as store:
        with pytest.raises(CorruptionError):
            store.read_table("t")
        assert store.read_table("t", version=3).shape == (64, 4)  # reads no delta
        report = store.verify()
        assert not report.ok and any(path in p for p in report.problems)


def test_write_and_space_amplification_are_reported(tmp_path):
    """stats() reports write amplification (all bytes appended over the checkpoints' own rows) and space
    amplification (disk over live bytes); a delta's carried rows count as amplification."""
    with cnrstore.open(tmp_path / "s", create=True) as store:
        assert store.stats()["write_amplification"] is None
        store.create_table("t", 1024, 16, codec="fp32", block_rows=1024)
        with store.checkpoint() as ck:
            ck.put_rows("t", np.arange(1024), np.ones((1024, 16), np.float32))
        assert store.stats()["write_amplification"] == 1.0
        for i in range(4):
            with store.checkpoint() as ck:
                ck.put_rows("t", np.arange(10 * i, 10 * i + 10), np.ones((10, 16), np.float32))
        st = store.stats()
        assert 1.0 < st["write_amplification"] < 1.5
        assert st["space_amplification"] >= 1.0


def test_gc_after_gc_cleans_its_own_segment_down_to_the_live_rows(tmp_path, monkeypatch):
    """retain(5); gc(); retain(1); gc(): the second GC finds the live rows in the segment the first one
    copied to (compaction's own, more than half live): the space bound makes it clean that one too, and the
    disk ends within knobs.GC_SPACE_BOUND of the live rows (records rewritten with their live rows)."""
    monkeypatch.setattr(knobs, "READ_CHAIN_BOUND", 6)
    rng = np.random.default_rng(0)
    with cnrstore.open(tmp_path / "s", create=True) as store:
        store.create_table("a", 4000, 8, codec="int4", block_rows=1024)
        for v in range(12):
            with store.checkpoint() as ck:
                rows = np.arange(4000) if v == 0 else np.unique(rng.integers(0, 4000, 1200))
                ck.put_rows("a", rows, rng.standard_normal((rows.size, 8)).astype(np.float32))
        expect = store.read_table("a")
        store.retain(keep_last=5)
        store.gc()
        store.retain(keep_last=1)
        store.gc()
        st = store.stats()
        one_version = 4000 * codecs.get("int4").row_bytes(8)
        # partly live records were rewritten: one version's rows, their offsets and record headers
        assert st["live_bytes"] < one_version + 4000 * 2 + 4096
        segment_bytes = sum(os.path.getsize(os.path.join(tmp_path / "s" / "segments", n))
                            for n in os.listdir(tmp_path / "s" / "segments"))
        assert segment_bytes <= knobs.GC_SPACE_BOUND * st["live_bytes"] + 64 * 1024
        assert store.read_table("a").tobytes() == expect.tobytes()
        assert store.verify().ok


def test_gc_keeps_a_chain_record_whose_rows_newer_records_all_shadow(tmp_path, monkeypatch):
    """A kept version's chain passes through a record none of whose rows it reads (every row is in a
    newer record of the chain), alone in its segment once retention pruned the log records beside it:
    the segment holds no live row, yet the index entry is still walked. GC must not free the segment
    under the entry (found by the random-kill maintenance test: 'segment ... is missing'); it rewrites
    the record with no rows instead, and every kept version reads as before."""
    monkeypatch.setattr(knobs, "SEGMENT_BYTES", 512)       # about one record per segment
    rng = np.random.default_rng(5)
    with cnrstore.open(tmp_path / "s", create=True) as store:
        store.create_table("t", 64, 4, codec="fp32", block_rows=64)
        with store.checkpoint() as ck:
            ck.put_rows("t", np.arange(64), rng.standard_normal((64, 4)).astype(np.float32))
        with store.checkpoint() as ck:                     # row 5 only: shadowed by the next version
            ck.put_rows("t", [5], rng.standard_normal((1, 4)).astype(np.float32))
        with store.checkpoint() as ck:
            ck.put_rows("t", [5, 6], rng.standard_normal((2, 4)).astype(np.float32))
        expect = store.read_table("t")
        store.retain(keep_last=1)
        report = store.gc()
        assert store.verify().ok, store.verify().problems
        assert store.read_table("t").tobytes() == expect.tobytes()
        assert report.bytes_reclaimed > 0
        emptied = _entries(store, "t")[(0, 2)]
        assert emptied.count == 0 and _record(store, emptied).count == 0
    with cnrstore.open(tmp_path / "s") as store:           # and after a reopen, a second GC
        store.gc()
        assert store.read_table("t").tobytes() == expect.tobytes()
        assert store.verify().ok
