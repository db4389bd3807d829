"""Costs that must grow with what was written, never with versions x entries or with num_rows.

No timings here (benchmarks/bench_engine.py measures ``ls``/``stats`` at 10,000 versions): complexity is
tested by counting row-index entries visited and index walks, and memory with tracemalloc.
"""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cnrstore
from cnrstore import cli
from cnrstore.maintenance import compaction
from cnrstore.engine import record
from cnrstore.errors import MissingRows
from cnrstore.engine.index import IndexView, RowLoc


# -- helpers ----------------------------------------------------------------------------------------

def chains_by_definition(view, versions) -> list[int]:
    """The old, per-version definition: one block_chains walk of the whole row index per version."""
    return [max((len(c) for c in compaction.block_chains(view, v).values()), default=0) for v in versions]


def naive_chain_lengths(entries, versions) -> list[int]:
    out = []
    for v in versions:
        chains: dict = {}
        for t, b, ev, loc in entries:
            if ev <= v:
                chain = chains.setdefault((t, b), [])
                if loc.flags & record.FLAG_BASELINE:
                    chain.clear()
                chain.append(ev)
        out.append(max((len(c) for c in chains.values()), default=0))
    return out


class Visits:
    """Counts row-index entries visited through IndexView.row_entries and calls of block_chains."""

    def __init__(self, monkeypatch):
        self.entries = 0
        self.walks = 0
        self.block_chains = 0
        original = IndexView.row_entries
        original_chains = compaction.block_chains

        def row_entries(view, *args, **kwargs):
            self.walks += 1
            for entry in original(view, *args, **kwargs):
                self.entries += 1
                yield entry

        def block_chains(*args, **kwargs):
            self.block_chains += 1
            return original_chains(*args, **kwargs)

        monkeypatch.setattr(IndexView, "row_entries", row_entries)
        monkeypatch.setattr(compaction, "block_chains", block_chains)

    def reset(self):
        self.entries = self.walks = self.block_chains = 0


def many_versions(path, count: int):
    """A store of ``count`` versions over two tables, touching a few blocks each, with a compaction
    every 7 versions (so chain lengths rise and fall)."""
    store = cnrstore.open(path, create=True)
    store.create_table("a", 256, 4, codec="fp32", block_rows=64)
    store.create_table("b", 128, 2, codec="int8", block_rows=64)
    rng = np.random.default_rng(0)
    with store.checkpoint(step=0) as w:
        w.put_rows("a", np.arange(256), rng.standard_normal((256, 4), dtype=np.float32))
        w.put_rows("b", np.arange(128), rng.standard_normal((128, 2), dtype=np.float32))
    for i in range(1, count):
        with store.checkpoint(step=i) as w:
            rows = np.unique(rng.integers(0, 256, 5))
            w.put_rows("a", rows, rng.standard_normal((rows.size, 4), dtype=np.float32))
            if i % 3 == 0:
                w.put_rows("b", np.array([i % 128]), np.ones((1, 2), np.float32))
        if i % 7 == 0:
            store.compact()
    return store


# -- item 4: one pass over the row index for every version's read chain ------------------------------

def entry_histories():
    """Row-index entries in key order: per (table, block) strictly increasing versions, some baselines."""
    block = st.lists(st.tuples(st.integers(1, 60), st.booleans()), max_size=12)
    return st.lists(block, max_size=6)


@given(blocks=entry_histories(), versions=st.lists(st.integers(0, 70), max_size=25, unique=True))
def test_read_chain_lengths_match_the_per_version_definition(blocks, versions):
    entries = []
    for b, history in enumerate(blocks):
        seen = {}
        for v, baseline in history:
            seen[v] = baseline  # unique versions per block
        for v in sorted(seen):
            entries.append((b // 3, b, v, RowLoc(0, 0, 0, 1, record.FLAG_BASELINE if seen[v] else 0)))
    versions = sorted(versions)
    assert compaction.read_chain_lengths(iter(entries), versions).tolist() == naive_chain_lengths(entries, versions)


def test_read_chain_lengths_at_the_largest_versions():
    plain = RowLoc(0, 0, 0, 1, 0)
    entries = [(1, 0, 5, plain), (1, 0, 2**64 - 1, plain), (1, 1, 2**64 - 2, plain)]
    versions = [4, 5, 2**64 - 2, 2**64 - 1]
    assert compaction.read_chain_lengths(iter(entries), versions).tolist() == [0, 1, 1, 2]
    assert compaction.read_chain_lengths(iter([]), versions).tolist() == [0, 0, 0, 0]
    assert compaction.read_chain_lengths(iter(entries), []).tolist() == []


ops = st.lists(st.one_of(
    st.tuples(st.just("increment"), st.lists(st.integers(0, 47), min_size=1, max_size=12)),
    st.tuples(st.just("full"), st.just(None)),
    st.tuples(st.just("compact"), st.integers(0, 20)),
    st.tuples(st.just("retain"), st.integers(1, 6)),
    st.tuples(st.just("drop"), st.integers(0, 20)),
), min_size=1, max_size=14)


@settings(max_examples=15)
@given(history=ops)
def test_ls_and_stats_chain_lengths_match_block_chains_on_random_histories(tmp_path_factory, history):
    """Increments, full rewrites (baselines), compactions at old versions, retention and arbitrary
    drops: ``ls``'s read_chain of every version and stats' max_read_chain equal the old definition."""
    path = tmp_path_factory.mktemp("hist") / "s"
    with cnrstore.open(path, create=True) as store:
        store.create_table("t", 48, 2, codec="fp32", block_rows=16)
        store.create_table("u", 20, 2, codec="int8", block_rows=8)
        with store.checkpoint() as w:
            w.put_rows("t", np.arange(48), np.zeros((48, 2), np.float32))
        for op, arg in history:
            versions = [vi.version for vi in store.versions()]
            if op == "increment":
                rows = np.unique(arg)
                with store.checkpoint() as w:
                    w.put_rows("t", rows, np.full((rows.size, 2), len(versions), np.float32))
                    w.put_rows("u", rows[rows < 20], np.ones(((rows < 20).sum(), 2), np.float32))
            elif op == "full":
                with store.checkpoint() as w:
                    w.put_rows("t", np.arange(48), np.ones((48, 2), np.float32))
            elif op == "compact":
                store.compact(versions[arg % len(versions)])
            elif op == "retain":
                store.retain(keep_last=arg)
            elif op == "drop" and len(versions) > 1:
                with store.engine.maintenance() as m:
                    compaction.drop_versions(m, {versions[arg % (len(versions) - 1)]})
        versions = [vi.version for vi in store.versions()]
        with store.engine.read() as view:
            expected = chains_by_definition(view, versions)
        assert [r["read_chain"] for r in cli.versions_rows(store)] == expected
        assert store.stats()["max_read_chain"] == max(expected, default=0)


def test_ls_walks_the_row_index_once_however_many_versions(tmp_path, monkeypatch):
    store = many_versions(tmp_path / "s", 60)
    try:
        entries = store.stats()["index_entries"]
        assert entries > 60
        with store.engine.read() as view:
            expected = chains_by_definition(view, [vi.version for vi in store.versions()])
        assert max(expected) > 1 and min(expected) >= 1
        visits = Visits(monkeypatch)
        rows = cli.versions_rows(store)
        assert [r["read_chain"] for r in rows] == expected
        assert len(rows) == 60
        assert visits.block_chains == 0
        assert (visits.walks, visits.entries) == (1, entries), "one pass, not one per version"
    finally:
        store.close()


def test_stats_and_verify_visit_each_row_index_entry_a_bounded_number_of_times(tmp_path, monkeypatch):
    store = many_versions(tmp_path / "s", 40)
    try:
        entries = store.stats()["index_entries"]
        visits = Visits(monkeypatch)
        stats = store.stats()
        assert (visits.walks, visits.entries, visits.block_chains) == (1, entries, 0)
        with store.engine.read() as view:
            assert stats["max_read_chain"] == max(chains_by_definition(view, [v.version for v in store.versions()]))
        visits.reset()
        assert store.verify().ok
        assert visits.block_chains == 0 and visits.walks <= 2 and visits.entries <= 2 * entries
    finally:
        store.close()


def test_restore_does_not_walk_a_tables_history_to_see_whether_it_was_written(tmp_path, monkeypatch):
    """restore's _written_by used to scan every entry of a table (all its versions) per table; now it
    seeks the table's written blocks and stops at the first written at or before the version."""
    store = many_versions(tmp_path / "s", 30)
    try:
        store.create_table("late", 64, 2, codec="fp32", block_rows=64)
        with store.checkpoint() as w:
            w.put_rows("late", np.arange(64), np.ones((64, 2), np.float32))
        visits = Visits(monkeypatch)
        snap = store.restore(5)  # "late" has nothing at or before version 5: left out
        assert sorted(snap.tables) == ["a", "b"] and visits.entries == 0
        assert sorted(store.restore().tables) == ["a", "b", "late"] and visits.entries == 0
    finally:
        store.close()


def test_row_blocks_seeks_only_blocks_with_entries(tmp_path):
    with cnrstore.open(tmp_path / "s", create=True) as store:
        store.create_table("t", 64 * 1000, 2, codec="fp32", block_rows=64)
        store.create_table("next", 64, 2, codec="fp32", block_rows=64)
        for rows in ([5, 64 * 700], [64 * 700 + 1, 64 * 999 + 63]):
            with store.checkpoint() as w:
                w.put_rows("t", np.array(rows), np.ones((2, 2), np.float32))
                w.put_rows("next", np.array([0]), np.ones((1, 2), np.float32))
        tid = store.engine.table_record("t").id
        with store.engine.read() as view:
            assert list(view.row_blocks(tid)) == [(0, 1), (700, 1), (999, 2)]
            assert list(view.row_blocks(tid + 5)) == []


# -- item 5: errors cost memory proportional to what was written -------------------------------------

def test_sparse_huge_table_read_table_and_restore_raise_missing_rows_in_small_memory(tmp_path):
    """A table of 2^31 + 5 rows with 5 written: read_table and restore used to collect every absent
    row id (np.arange per block, ~16 GB) before raising; now they count missing rows per block
    arithmetically, name the first few, and raise before allocating the output."""
    num_rows = 2**31 + 5
    written = np.array([0, 7, 2**30, 2**31, 2**31 + 4])
    with cnrstore.open(tmp_path / "s", create=True) as store:
        store.create_table("huge", num_rows, 4, codec="fp32")  # default block_rows: 65536 -> 32769 blocks
        store.create_table("never", num_rows, 4, codec="fp32")
        with store.checkpoint() as w:
            w.put_rows("huge", written, np.arange(20, dtype=np.float32).reshape(5, 4))
        tracemalloc.start()
        try:
            for read in (lambda: store.read_table("huge"), lambda: store.restore()):
                with pytest.raises(MissingRows) as info:
                    read()
                message = str(info.value)
                assert message.startswith(f"{num_rows - 5} row(s) of table 'huge' were never written")
                assert "(first: 1, 2, 3, 4, 5, 6, 8, 9, ...)" in message and "read_rows" in message
            with pytest.raises(MissingRows, match=f"^{num_rows} row.*'never'.*first: 0, 1, 2"):
                store.read_table("never")
            # the written rows still read, and a request of many missing rows is counted, not listed
            np.testing.assert_array_equal(store.read_rows("huge", written[::-1]),
                                          np.arange(20, dtype=np.float32).reshape(5, 4)[::-1])
            with pytest.raises(MissingRows, match=r"^65534 row.*\(first: 1, 2, 3, 4, 5, 6, 8, 9, \.\.\.\)"):
                store.read_rows("huge", np.arange(65536))
            assert store.verify().ok and store.stats()["max_read_chain"] == 1
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < 64 << 20, f"peak {peak:,} bytes"


def test_restore_skips_a_table_written_only_after_the_version_even_if_huge(tmp_path):
    with cnrstore.open(tmp_path / "s", create=True) as store:
        store.create_table("small", 4, 2, codec="fp32")
        store.create_table("huge", 2**31 + 5, 2, codec="fp32")
        with store.checkpoint() as w:
            w.put_rows("small", np.arange(4), np.ones((4, 2), np.float32))
        with store.checkpoint() as w:
            w.put_rows("huge", np.array([2**31 + 4]), np.ones((1, 2), np.float32))
        assert sorted(store.restore(1).tables) == ["small"]
        with pytest.raises(MissingRows, match=f"^{2**31 + 5} row.*at or before version 1 .*first: 0, 1"):
            store.read_table("huge", 1)
        with pytest.raises(MissingRows, match=f"^{2**31 + 4} row.*at or before version 2 .*first: 0, 1"):
            store.restore(2)
