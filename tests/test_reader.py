"""cnrstore/engine/reader.py: point-in-time reads along each block's read chain (the newest record holding a row
wins; a baseline ends the chain), MissingRows counted exactly, and the chain rule ``unread_versions``
applies for retention. Reads are driven through ``Store`` (the reader's one caller) against a model of
what every version holds."""

from __future__ import annotations

import re

import numpy as np
import pytest

import cnrstore
from cnrstore import codecs, knobs
from cnrstore.engine import record, reader
from cnrstore.errors import CorruptionError, MissingRows

DIM = 3
ROWS = 22       # blocks of 4: the last holds rows 20 and 21


@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.setattr(knobs, "READ_CHAIN_BOUND", None)   # plain chains, as many records as written
    with cnrstore.open(tmp_path / "s", create=True) as s:
        s.create_table("t", ROWS, DIM, codec="fp32", block_rows=4)
        yield s


def _write(store, rows, values, codec=None, dense=None) -> int:
    with store.checkpoint() as ck:
        if len(rows):
            ck.put_rows("t", rows, values, codec=codec)
        if dense is not None:
            ck.put_dense("d", dense)
    return ck.version


def test_every_version_reads_the_newest_value_of_each_row_at_or_before_it(store):
    rng = np.random.default_rng(5)
    state = np.full((ROWS, DIM), np.nan, np.float32)
    history = {}
    for v in range(1, 9):
        rows = np.arange(ROWS) if v == 1 else rng.choice(ROWS, int(rng.integers(1, 8)), replace=False)
        values = rng.standard_normal((rows.size, DIM)).astype(np.float32)
        codec = "int4" if v % 3 == 0 else None      # some blocks' chains mix codecs
        c = codecs.get(codec or "fp32")
        state[rows] = c.decode(c.encode(values), DIM)
        assert _write(store, rows, values, codec) == v
        history[v] = state.copy()
    for v, want in history.items():
        assert np.array_equal(store.read_table("t", v), want), v
        asked = rng.integers(0, ROWS, 30)                   # unsorted, repeated
        assert np.array_equal(store.read_rows("t", asked, v), want[asked]), v


@pytest.mark.parametrize("codec", ["fp32", "int4"])
def test_a_long_chain_of_one_codec_reads_each_row_from_its_newest_record(store, codec):
    """A whole-table read resolves a chain of one codec on a full baseline per block, not per record
    (reader.Piece.over): rows written in many records, the newest wins, bit for bit as a row read."""
    rng = np.random.default_rng(11)
    c = codecs.get(codec)
    state = np.zeros((ROWS, DIM), np.float32)
    history = {}
    for v in range(1, 21):
        rows = np.arange(ROWS) if v == 1 else rng.choice(ROWS, int(rng.integers(1, 12)), replace=False)
        values = rng.standard_normal((rows.size, DIM)).astype(np.float32)
        state[rows] = c.decode(c.encode(values), DIM)
        assert _write(store, rows, values, codec) == v
        history[v] = state.copy()
    assert store.stats()["max_read_chain"] > 5  # (long chains: the knob is off)
    for v, want in history.items():
        got = store.read_table("t", v)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), v
        assert np.array_equal(store.read_rows("t", np.arange(ROWS), v).view(np.uint32), got.view(np.uint32)), v


def test_a_baseline_ends_the_chain(store):
    _write(store, [1], np.full((1, DIM), 1, np.float32))
    _write(store, [0, 1, 2, 3], np.full((4, DIM), 2, np.float32))    # every row of block 0
    _write(store, [2], np.full((1, DIM), 3, np.float32))
    assert store.read_rows("t", [0, 1, 2, 3])[:, 0].tolist() == [2, 2, 3, 2]
    assert store.read_rows("t", [1], 1)[:, 0].tolist() == [1]


def test_rows_never_written_are_counted_exactly_and_the_first_named(store):
    _write(store, np.arange(10), np.ones((10, DIM), np.float32))
    with pytest.raises(MissingRows) as e:
        store.read_rows("t", [3, 21, 12, 11, 10, 13, 14, 15, 16, 17, 18, 19])
    assert "11 row(s)" in str(e.value)
    first = re.search(r"first: ([0-9, .]+)\)", str(e.value)).group(1)
    assert first == ", ".join(map(str, range(10, 10 + reader.MISSING_SHOWN))) + ", ..."
    with pytest.raises(MissingRows, match="12 row"):
        store.read_table("t")


def test_a_block_first_written_later_is_missing_at_an_earlier_version(store):
    v1 = _write(store, np.arange(0, 20), np.ones((20, DIM), np.float32))
    _write(store, [20, 21], np.ones((2, DIM), np.float32))
    with pytest.raises(MissingRows, match="2 row.*20, 21\\)"):
        store.read_table("t", v1)
    assert store.read_table("t").shape == (ROWS, DIM)


def test_a_sparse_table_of_a_billion_rows_reports_its_missing_rows_without_allocating_them(tmp_path):
    with cnrstore.open(tmp_path / "big", create=True) as s:
        s.create_table("huge", 10**9, 4, codec="fp32")
        with s.checkpoint() as ck:
            ck.put_rows("huge", [123_456_789], np.ones((1, 4), np.float32))
        with pytest.raises(MissingRows, match=f"{10**9 - 1} row"):
            s.read_table("huge")
        assert s.read_rows("huge", [123_456_789]).tolist() == [[1, 1, 1, 1]]


def test_a_dense_array_reads_as_its_newest_put_at_or_before_the_version(store):
    a, b = np.arange(4, dtype=np.int16), np.eye(2, dtype=np.float64)
    v1 = _write(store, [], None, dense=a)
    v2 = _write(store, [0], np.ones((1, DIM), np.float32))
    v3 = _write(store, [], None, dense=b)
    for v, want in ((v1, a), (v2, a), (v3, b)):
        got = store.read_dense("d", v)
        assert got.dtype == want.dtype and np.array_equal(got, want)
    with pytest.raises(MissingRows, match="never put"):
        store.read_dense("other")


@pytest.mark.parametrize("kept,unread", [
    ([3], [4, 5, 6]),           # 3 -> 2 -> 1 (baseline)
    ([5], [1, 2, 3, 6]),        # 5 -> 4 (baseline)
    ([2, 5], [3, 6]),
    ([6], [1, 2, 3, 5]),        # 6 is a delta on 4: it skips 5
    ([0], [1, 2, 3, 4, 5, 6]),  # before every entry
])
def test_unread_versions_follows_each_kept_versions_chain(kept, unread):
    entries = [(1, True), (2, False), (3, False), (4, True), (5, False), (6, False, 4)]
    assert reader.unread_versions(entries, kept) == unread


def test_unread_versions_of_no_entries_is_empty():
    assert reader.unread_versions([], [1, 2]) == []


def _rows_record(offsets, flags=0) -> record.Record:
    fp32 = codecs.get("fp32")
    body = fp32.encode(np.zeros((len(offsets), 1), np.float32))
    stored = None if flags & record.FLAG_FULL else np.asarray(offsets)
    buffers, _length = record.rows_record(fp32.codec_id, flags, 1, 2, 1, stored, body)
    return record.parse(np.frombuffer(b"".join(bytes(b) for b in buffers), dtype=np.uint8), "seg", 0)


def test_check_offsets_refuses_a_row_beyond_its_block():
    reader.check_offsets(_rows_record([0, 3]), 4, "seg", 0)
    reader.check_offsets(_rows_record(range(4), record.FLAG_FULL), 4, "seg", 0)
    with pytest.raises(CorruptionError, match="row offset 4 of block 2, which has 4 rows"):
        reader.check_offsets(_rows_record([1, 4]), 4, "seg", 0)
    with pytest.raises(CorruptionError, match="row offset 3"):
        reader.check_offsets(_rows_record(range(4), record.FLAG_FULL), 3, "seg", 0)
