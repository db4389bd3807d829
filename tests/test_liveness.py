"""cnrstore/maintenance/liveness.py: which rows of each row record some retained version still reads, on a store
whose read chains are written by hand (plain increments: no merging). GC acting on it is
test_compaction.py's and test_delta.py's."""

from __future__ import annotations

import numpy as np
import pytest

import cnrstore
from cnrstore import knobs
from cnrstore.engine import record
from cnrstore.maintenance.liveness import row_liveness
from cnrstore.engine.storage import fetch

DIM = 16
EMPTY = record.HEADER_BYTES + record.TRAILER_BYTES


@pytest.fixture
def store(tmp_path, monkeypatch):
    """Table ``t`` of 8 rows in 2 blocks of 4; v1 writes every row, then each later version the rows the
    test names."""
    monkeypatch.setattr(knobs, "READ_CHAIN_BOUND", None)
    with cnrstore.open(tmp_path / "s", create=True) as s:
        s.create_table("t", 8, DIM, codec="fp32", block_rows=4)
        put(s, range(8))
        yield s


def put(store, rows) -> None:
    rows = np.asarray(list(rows), dtype=np.int64)
    with store.checkpoint() as ck:
        ck.put_rows("t", rows, np.ones((rows.size, DIM), np.float32))


def liveness(store, kept, pinned=frozenset()):
    """(Liveness, {(block, version): RowLoc}, table id)."""
    with store.engine.read() as view:
        entries = {(b, v): loc for _t, b, v, loc in view.row_entries()}
        tid = next(view.row_entries())[0]
        pinned = {(tid, b, v) for b, v in pinned}
        result = row_liveness(view, lambda loc: fetch(store.engine.storage, loc), kept, pinned)
    return result, entries, tid


def partial(result, tid) -> dict:
    assert all(t == tid for t, _b, _v in result.partial)
    return {(b, v): rows.tolist() for (_t, b, v), rows in result.partial.items()}


def test_a_record_that_newer_records_partly_shadow_is_live_for_the_rest_only(store):
    put(store, [0, 1])      # v2
    put(store, [2])         # v3
    result, entries, tid = liveness(store, kept=[3])
    assert partial(result, tid) == {(0, 1): [3]}            # v3 reads rows 0, 1 from v2 and 2 from v3
    # live bytes: the heads and v2 whole, v1's block 0 for one row of its four (never less than a header)
    (segment,) = {loc.segment for loc in entries.values()}
    whole = sum(entries[k].length for k in ((0, 2), (0, 3), (1, 1)))
    assert result.live_bytes == {segment: whole + max(entries[(0, 1)].length // 4, EMPTY)}


def test_what_any_kept_version_reads_is_live(store):
    put(store, [0, 1])      # v2
    put(store, [2])         # v3
    result, _entries, tid = liveness(store, kept=[2, 3])
    assert partial(result, tid) == {(0, 1): [2, 3]}         # v2 reads rows 2 and 3 of v1, v3 row 3
    result, _entries, tid = liveness(store, kept=[1, 3])
    assert partial(result, tid) == {}                       # v1 reads every row of itself


def test_a_pinned_entry_is_wholly_live(store):
    put(store, [0, 1])
    result, _entries, tid = liveness(store, kept=[2], pinned={(0, 1)})
    assert partial(result, tid) == {}


def test_a_record_a_chain_walks_through_without_reading_counts_as_a_header(store):
    put(store, [0, 1])          # v2
    put(store, [2, 3])          # v3: with v2, every row of block 0
    result, entries, tid = liveness(store, kept=[3])
    assert partial(result, tid) == {(0, 1): []}             # still on v3's chain: kept, emptied by GC
    (segment,) = result.live_bytes
    whole = sum(entries[k].length for k in ((0, 2), (0, 3), (1, 1)))
    assert result.live_bytes[segment] == whole + EMPTY


def test_records_behind_a_newer_baseline_are_left_alone(store):
    put(store, [0, 1])          # v2
    put(store, range(4))        # v3: a baseline of block 0 ends every chain at v3 or later
    result, entries, tid = liveness(store, kept=[3])
    assert partial(result, tid) == {}                       # v1, v2 of block 0: no kept version reads them,
    assert sum(result.live_bytes.values()) == sum(loc.length for loc in entries.values())   # never freed here
