"""cnrstore/engine/block_records.py: one ROWS record per block of the rows a checkpoint, a merge or a compaction
writes, with the flags a read relies on (baseline, full, compacted, delta)."""

from __future__ import annotations

import numpy as np
import pytest

import cnrstore
from cnrstore import codecs, knobs
from cnrstore.engine import record
from cnrstore.errors import InvalidArgument
from cnrstore.engine.block_records import block_records

FP32 = codecs.get("fp32")
DIM = 2


@pytest.fixture
def table(tmp_path):
    """The catalog record of a table of 10 rows in blocks of 4 (the last block holds rows 8 and 9)."""
    with cnrstore.open(tmp_path / "s", create=True) as store:
        store.create_table("t", 10, DIM, codec="fp32", block_rows=4)
        yield store.engine.table_record("t")


def _records(table, rows, **kw):
    rows = np.asarray(rows, dtype=np.int64)
    values = (rows[:, None] * 10 + np.arange(DIM)).astype(np.float32)
    out = []
    for (block, count, flags), buffers, length in block_records(table, FP32, rows, FP32.encode(values), 7, **kw):
        buf = np.frombuffer(b"".join(bytes(b) for b in buffers), dtype=np.uint8)
        assert buf.size == length
        rec = record.parse(buf, "seg", 0)
        assert (rec.block, rec.count, rec.flags, rec.version) == (block, count, flags, 7)
        got = FP32.decode(rec.body.reshape(rec.count, -1), DIM)
        assert np.array_equal(got[:, 0], (block * 4 + rec.offsets()) * 10), "each row's value at its offset"
        out.append(rec)
    return out


def test_one_record_per_block_holding_the_block_offsets_of_its_rows(table):
    recs = _records(table, [1, 3, 5, 8])
    assert [(r.block, r.offsets().tolist()) for r in recs] == [(0, [1, 3]), (1, [1]), (2, [0])]
    assert [r.flags for r in recs] == [0, 0, record.FLAG_FULL]    # row 8 alone is block 2's rows 0..0


def test_a_record_with_every_row_of_its_block_is_a_full_baseline_even_the_short_last_block(table):
    recs = _records(table, [0, 1, 2, 3, 8, 9])
    full_baseline = record.FLAG_FULL | record.FLAG_BASELINE
    assert [(r.block, r.flags, r.count) for r in recs] == [(0, full_baseline, 4), (2, full_baseline, 2)]
    assert all(r.aux.size == 0 for r in recs)


def test_a_prefix_of_a_block_is_stored_without_offsets_but_is_no_baseline(table):
    (rec,) = _records(table, [4, 5, 6])
    assert rec.flags == record.FLAG_FULL and rec.offsets().tolist() == [0, 1, 2]


def test_compacted_records_are_all_baselines(table):
    recs = _records(table, [1, 6], compacted=True)
    assert all(r.flags & record.FLAG_BASELINE and r.flags & record.FLAG_COMPACTED for r in recs)
    assert [r.offsets().tolist() for r in recs] == [[1], [2]]


def test_with_a_base_the_records_that_are_no_baseline_are_cumulative_deltas_on_it(table):
    partial, complete = _records(table, [4, 6, 8, 9], base=3, copied=5)
    assert partial.flags & record.FLAG_DELTA and (partial.base(), partial.copied()) == (3, 5)
    assert complete.flags & record.FLAG_BASELINE and not complete.flags & record.FLAG_DELTA
    assert complete.base() == 0


def test_baseline_marks_every_record_a_baseline(table):
    (rec,) = _records(table, [5], baseline=True)
    assert rec.flags == record.FLAG_BASELINE and rec.offsets().tolist() == [1]


def test_a_block_too_large_for_a_record_is_refused_before_anything_is_built(table, monkeypatch):
    monkeypatch.setattr(knobs, "MAX_RECORD_BYTES", record.HEADER_BYTES + record.TRAILER_BYTES + 2 * 8)
    assert len(_records(table, [0, 1])) == 1       # 2 fp32 rows of dim 2 in a full record: 16 bytes, fits
    with pytest.raises(InvalidArgument, match="smaller block_rows"):
        _records(table, [0, 1, 2])
