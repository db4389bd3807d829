"""Layer 3, the LMDB index: key order and chain lookups at their boundaries, map growth, sharing."""

from __future__ import annotations

import itertools
import os
import tempfile
import threading
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cnrstore import knobs
from cnrstore.errors import CorruptionError
from cnrstore.engine import record
from cnrstore.engine.index import DenseLoc, Index, RowLoc
from cnrstore.engine.schema import TableRecord

U32 = 2**32 - 1
U64 = 2**64 - 1


@pytest.fixture
def index(tmp_path):
    ix = Index(str(tmp_path / "index"), readonly=False, create=True)
    yield ix
    ix.close()


def loc_for(t, b, v, flags=None) -> RowLoc:
    """A distinct, recognisable location per key (fields within their on-disk widths); its flags mix
    baselines (record.FLAG_BASELINE, bit 0) with other records unless ``flags`` is given."""
    return RowLoc(segment=t % 1000, offset=b % 100_000, length=v % 1_000_000, count=(t + b + v) % 65536,
                  flags=(t + v) % 8 if flags is None else flags)


def put_rows(index, keys, flags=None):
    def body(w):
        for t, b, v in keys:
            w.put_row(t, b, v, loc_for(t, b, v, flags))
    index.write(body)


def expected_chain(keys, t, b, v, flags=None):
    """The read chain the rule gives (engine/chain.py): every entry of the block at or before v, newest
    first, up to and including the first baseline."""
    chain = []
    for kv in sorted((kv for kt, kb, kv in keys if (kt, kb) == (t, b) and kv <= v), reverse=True):
        chain.append(kv)
        if loc_for(t, b, kv, flags).flags & record.FLAG_BASELINE:
            break
    return chain


# row_chain ------------------------------------------------------------------------------------------
TABLES = [0, 1, 2, U32 - 1, U32]
BLOCKS = [0, 1, 2, U64 - 1, U64]
VERSIONS = [0, 1, 5, 2**32, U64 - 1, U64]
QUERY_VERSIONS = sorted({0, 1, 2, 4, 5, 6, 2**32 - 1, 2**32, 2**32 + 1, U64 - 2, U64 - 1, U64})


def test_row_chain_boundaries_exhaustive(index):
    # neighbours in key space: adjacent blocks and tables, the first and last of each, versions at
    # both ends of u64 (a seek to version + 1 would overflow at the top)
    keys = set()
    for t, b in itertools.product(TABLES, BLOCKS):
        for v in VERSIONS:
            if (t + b + v) % 3:  # leave holes so some chains are short or empty
                keys.add((t, b, v))
    keys.discard((1, 1, 0))
    keys = sorted(keys)
    put_rows(index, keys)
    with index.read() as view:
        for t, b, v in itertools.product(TABLES + [3], BLOCKS + [3], QUERY_VERSIONS):
            got = list(view.row_chain(t, b, v))
            assert [x[0] for x in got] == expected_chain(keys, t, b, v), (t, b, v)
            assert all(loc == loc_for(t, b, ver) for ver, loc in got)
        # entries come back whole, in key order
        entries = list(view.row_entries())
        assert [(t, b, v) for t, b, v, _ in entries] == keys
        assert all(loc == loc_for(t, b, v) for t, b, v, loc in entries)
        for t in TABLES:
            assert [(e[0], e[1], e[2]) for e in view.row_entries(t)] == [k for k in keys if k[0] == t]


def test_row_chain_on_empty_index(index):
    with index.read() as view:
        for v in (0, 7, U64):
            assert list(view.row_chain(1, 0, v)) == []
        assert list(view.row_entries()) == []


def test_row_chain_only_one_block_present(index):
    put_rows(index, [(5, 9, 3), (5, 9, 8)], flags=0)
    with index.read() as view:
        assert [v for v, _ in view.row_chain(5, 9, 2)] == []
        assert [v for v, _ in view.row_chain(5, 9, 3)] == [3]
        assert [v for v, _ in view.row_chain(5, 9, 100)] == [8, 3]
        assert [v for v, _ in view.row_chain(5, 8, U64)] == []  # before every key
        assert [v for v, _ in view.row_chain(5, 10, 0)] == []   # after every key
        assert [v for v, _ in view.row_chain(6, 0, U64)] == []


def test_row_chain_can_be_stopped_early_and_restarted(index):
    keys = [(1, 0, v) for v in range(10)] + [(1, 1, v) for v in range(10)]
    put_rows(index, keys, flags=0)
    with index.read() as view:
        it = view.row_chain(1, 1, 6)
        assert next(it)[0] == 6
        assert next(it)[0] == 5
        # a new lookup in the same view (the reader's pattern: one block after another)
        assert [v for v, _ in view.row_chain(1, 0, 3)] == [3, 2, 1, 0]
        assert [v for v, _ in view.row_chain(1, 1, U64)] == list(range(9, -1, -1))


@given(keys=st.sets(st.tuples(st.integers(0, 3), st.integers(0, 5), st.sampled_from([0, 1, 2, 3, 7, U64 - 1, U64])),
                    max_size=40),
       queries=st.lists(st.tuples(st.integers(0, 4), st.integers(0, 6), st.sampled_from([0, 1, 2, 3, 6, 7, U64])),
                        min_size=1, max_size=20))
def test_row_chain_matches_model(keys, queries):
    with tempfile.TemporaryDirectory() as d:
        ix = Index(os.path.join(d, "index"), readonly=False, create=True)
        try:
            put_rows(ix, sorted(keys))
            with ix.read() as view:
                for t, b, v in queries:
                    assert [x for x, _ in view.row_chain(t, b, v)] == expected_chain(keys, t, b, v)
        finally:
            ix.close()


# dense ----------------------------------------------------------------------------------------------
def test_dense_at_boundaries(index):
    entries = {(0, 0): 1, (1, 0): 2, (1, 4): 3, (1, U64): 4, (2, 3): 5, (U32, 0): 6, (U32, U64): 7}

    def body(w):
        for (d, v), n in entries.items():
            w.put_dense(d, v, DenseLoc(n, n * 10, n * 100))
        w.put_dense_name("alpha", 1)
        w.put_dense_name("omega", U32)
    index.write(body)

    def model(d, v):
        found = [ev for (ed, ev) in entries if ed == d and ev <= v]
        if not found:
            return None
        n = entries[(d, max(found))]
        return max(found), DenseLoc(n, n * 10, n * 100)

    with index.read() as view:
        for d in (0, 1, 2, 3, U32 - 1, U32):
            for v in (0, 1, 3, 4, 5, U64 - 1, U64):
                assert view.dense_at(d, v) == model(d, v), (d, v)
        assert view.dense_names() == {"alpha": 1, "omega": U32}
        assert view.dense_id("alpha") == 1 and view.dense_id("beta") is None
        assert [(d, v) for d, v, _ in view.dense_entries()] == sorted(entries)


# catalogs -------------------------------------------------------------------------------------------
def _table(tid, name, num_rows=10):
    return {"id": tid, "name": name, "num_rows": num_rows, "dim": 4, "codec": "int4", "block_rows": 64,
            "created": 1.5}


def _version(v):
    return {"step": v, "meta": {"a": [1, 2]}, "created": 2.0, "parent": None, "tables": ["emb"], "dense": [],
            "bytes": 100}


def test_catalogs_round_trip(index):
    def body(w):
        w.put_meta("next_version", 7)
        w.put_table(TableRecord(**_table(1, "emb")))
        w.put_table(TableRecord(**_table(2, "ém")))
        for v in (3, 1, 2**40):
            w.put_version(v, _version(v))
        w.put_segment(1, 4096)
        w.put_segment(2**33, 32)
        return "done"
    assert index.write(body) == "done"
    with index.read() as view:
        assert view.meta("next_version") == 7 and view.meta("absent", 5) == 5
        assert view.table("emb") == TableRecord(**_table(1, "emb")) and view.table("nope") is None
        assert sorted(view.tables()) == ["emb", "ém"]
        assert [v for v, _ in view.versions()] == [1, 3, 2**40]  # numeric order
        assert view.latest() == (2**40, _version(2**40))
        assert view.version(3) == _version(3)
        for missing in (0, 2, U64, 2**64, 2**70, -1):
            assert view.version(missing) is None
        assert view.segments() == {1: 4096, 2**33: 32}


def test_latest_on_empty_index(index):
    with index.read() as view:
        assert view.latest() is None and view.versions() == [] and view.segments() == {}


# write transactions and map growth ---------------------------------------------------------------
def test_write_body_exception_aborts(index):
    class Boom(Exception):
        pass

    def body(w):
        w.put_meta("a", 1)
        w.put_row(1, 0, 1, loc_for(1, 0, 1))
        raise Boom()
    with pytest.raises(Boom):
        index.write(body)
    with index.read() as view:
        assert view.meta("a") is None and list(view.row_entries()) == []
    index.write(lambda w: w.put_meta("a", 2))  # the index still writes
    with index.read() as view:
        assert view.meta("a") == 2


def test_map_growth_retries_the_body(tmp_path, monkeypatch):
    monkeypatch.setattr(knobs, "INDEX_MAP_BYTES", 64 << 10)
    ix = Index(str(tmp_path / "index"), readonly=False, create=True)
    try:
        map0 = ix.map_size()
        calls = []

        def body(w):
            calls.append(1)
            w.put_meta("counter", w.meta("counter", 0) + 1)  # an aborted attempt must leave no trace
            for i in range(3000):
                w.put_row(1, i, 1, loc_for(1, i, 1))
            w.put_meta("blob", "x" * 100_000)
            return len(calls)

        attempts = ix.write(body)
        assert attempts == len(calls) >= 2
        assert ix.map_size() >= 4 * map0
        with ix.read() as view:
            assert view.meta("counter") == 1
            assert len(list(view.row_entries())) == 3000
            assert view.meta("blob") == "x" * 100_000
        # later writes keep growing it as needed, and every earlier write survives
        for round_ in range(5):
            ix.write(lambda w, r=round_: [w.put_row(2, r, i, loc_for(2, r, i, flags=0)) for i in range(2000)])
        with ix.read() as view:
            assert view.meta("counter") == 1
            assert len(list(view.row_entries(2))) == 10_000
            assert [v for v, _ in view.row_chain(2, 4, U64)][:3] == [1999, 1998, 1997]
    finally:
        ix.close()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(knobs, "INDEX_MAP_BYTES", 64 << 10)  # reopening with a small knob still sees it all
        ix = Index(str(tmp_path / "index"), readonly=True)
        try:
            with ix.read() as view:
                assert len(list(view.row_entries())) == 13_000
        finally:
            ix.close()


def test_map_growth_waits_for_open_readers(tmp_path, monkeypatch):
    monkeypatch.setattr(knobs, "INDEX_MAP_BYTES", 64 << 10)
    ix = Index(str(tmp_path / "index"), readonly=False, create=True)
    try:
        ix.write(lambda w: w.put_meta("v", 0))
        seen = []
        entered = threading.Event()

        def reader():
            with ix.read() as view:
                entered.set()
                time.sleep(0.2)
                seen.append(view.meta("v"))  # a consistent snapshot, from before the write

        th = threading.Thread(target=reader)
        th.start()
        entered.wait(5)
        ix.write(lambda w: [w.put_meta("v", 1)] + [w.put_meta(f"k{i}", "y" * 500) for i in range(600)])
        th.join(5)
        assert seen == [0]
        with ix.read() as view:
            assert view.meta("v") == 1 and view.meta("k599") == "y" * 500
    finally:
        ix.close()


def test_two_indexes_on_one_path_share_the_environment(tmp_path, monkeypatch):
    """A readonly Index opened beside a writer in the same process (LMDB allows one env per process)."""
    monkeypatch.setattr(knobs, "INDEX_MAP_BYTES", 64 << 10)
    path = str(tmp_path / "index")
    w = Index(path, readonly=False, create=True)
    r = Index(path, readonly=True)
    try:
        for i in range(20):  # enough to grow the map several times
            w.write(lambda x, i=i: [x.put_row(1, i, j, loc_for(1, i, j)) for j in range(300)])
            with r.read() as view:
                assert [v for v, _ in view.row_chain(1, i, U64)][0] == 299
        w.close()
        with r.read() as view:  # closing the writer leaves the reader working
            assert len(list(view.row_entries())) == 6000
        w2 = Index(path, readonly=False)  # and a writer may open again beside it
        w2.write(lambda x: x.put_meta("again", True))
        with r.read() as view:
            assert view.meta("again") is True
        w2.close()
    finally:
        r.close()
        w.close()  # idempotent
    r = Index(path, readonly=True)
    with r.read() as view:
        assert view.meta("again") is True
    r.close()


def test_open_missing_index_readonly_raises(tmp_path):
    with pytest.raises(CorruptionError):
        Index(str(tmp_path / "nope"), readonly=True)


@pytest.mark.parametrize("files_writable", [True, False])
def test_readonly_index_opened_first(tmp_path, monkeypatch, files_writable):
    """A readonly Index that is the first in this process to open the environment (read-only media
    included: then the environment itself is opened readonly)."""
    import cnrstore.engine.index as index_module

    path = str(tmp_path / "index")
    w = Index(path, readonly=False, create=True)
    w.write(lambda x: [x.put_meta("m", 1), x.put_row(1, 2, 3, loc_for(1, 2, 3))])
    w.close()
    monkeypatch.setattr(index_module, "_writable", lambda p: files_writable)
    r = Index(path, readonly=True)
    try:
        for _ in range(2):  # the database handles outlive the transaction that opened them
            with r.read() as view:
                assert view.meta("m") == 1
                assert list(view.row_chain(1, 2, U64)) == [(3, loc_for(1, 2, 3))]
                assert view.versions() == []
    finally:
        r.close()
