"""Sizes the format cannot hold are refused up front with InvalidArgument saying the limit and what to do
(issue 11, item 13): never a raw OverflowError or struct.error, and the store is left unchanged."""

from __future__ import annotations

import numpy as np
import pytest

import cnrstore
from cnrstore import knobs
from cnrstore.engine import record, arguments


@pytest.mark.parametrize("num_rows", [2**63, 2**64, 2**70])
def test_create_table_with_num_rows_beyond_int64_is_invalid_argument(store, num_rows):
    with pytest.raises(cnrstore.InvalidArgument, match=r"num_rows .* 2\*\*63-1 .*smaller num_rows"):
        store.create_table("t", num_rows, 4)
    assert store.tables() == {}


@pytest.mark.parametrize("dim", [2**30, 2**64, 2**70])
def test_create_table_with_a_dim_whose_row_cannot_fit_a_record_is_invalid_argument(store, dim):
    with pytest.raises(cnrstore.InvalidArgument, match="smaller dim"):
        store.create_table("t", 10, dim)
    assert store.tables() == {}


def test_block_rows_whose_block_cannot_fit_a_record(store):
    dim = 1 << 24  # 64 MiB per fp32 row
    with pytest.raises(cnrstore.InvalidArgument, match="block_rows at most 32"):
        store.create_table("t", 1000, dim, block_rows=1024)
    info = store.create_table("t", 1000, dim)  # the default shrinks below MIN_BLOCK_ROWS to fit
    assert info.block_rows == 32 < knobs.MIN_BLOCK_ROWS
    assert info.block_rows * (2 + arguments.widest_row_bytes(dim)) + 48 <= knobs.MAX_RECORD_BYTES


def test_a_table_of_2_63_minus_1_rows_writes_and_reads_its_last_row(store):
    last = 2**63 - 2
    store.create_table("t", 2**63 - 1, 4, codec="fp32")
    rows = np.array([last, 0, 2**62], dtype=np.int64)
    values = np.arange(12, dtype=np.float32).reshape(3, 4)
    with store.checkpoint() as ck:
        ck.put_rows("t", rows, values)
    assert np.array_equal(store.read_rows("t", rows), values)
    assert store.verify().ok


@pytest.mark.parametrize("rows", [[2**63 - 1], [2**64], [2**70], np.array([2**64 - 1], dtype=np.uint64)])
def test_read_rows_ids_beyond_the_table_or_int64_are_invalid_argument(store, rows):
    store.create_table("t", 2**63 - 1, 2, codec="fp32")
    with store.checkpoint() as ck:
        ck.put_rows("t", [0], np.zeros((1, 2), np.float32))
    with pytest.raises(cnrstore.InvalidArgument, match="outside"):
        store.read_rows("t", rows)
    with pytest.raises(cnrstore.InvalidArgument, match="outside"):
        with store.checkpoint() as ck:
            ck.put_rows("t", rows, np.zeros((1, 2), np.float32))
    assert len(store.versions()) == 1


def test_put_dense_of_more_than_4_gib_is_refused_before_any_copy(store, monkeypatch):
    torch = pytest.importorskip("torch")

    def no_copy(*a, **k):
        raise AssertionError("the array was touched before its size was checked")

    monkeypatch.setattr(record, "dense_record", no_copy)
    huge_views = [np.broadcast_to(np.float32(1), (2**30 + 16,)),  # 4 GiB + 64 bytes, zero-stride: free
                  np.broadcast_to(np.zeros(1, np.float64), (2**20, 2**10, 2**3)),  # 8 GiB
                  torch.zeros(1).expand(2**31)]  # a tensor: checked before .numpy()
    with store.checkpoint() as ck:
        for arr in huge_views:
            with pytest.raises(cnrstore.InvalidArgument, match="split the dense array"):
                ck.put_dense("w", arr)
        monkeypatch.undo()
        ck.put_dense("w", np.arange(3))  # the version is still usable
    assert np.array_equal(store.read_dense("w"), np.arange(3))


@pytest.mark.parametrize("step", [2**64, -(2**63) - 1, 2**70])
def test_step_beyond_what_a_version_stores_is_invalid_argument(store, step):
    with pytest.raises(cnrstore.InvalidArgument, match="step"):
        store.checkpoint(step=step)
    with store.checkpoint(step=2**64 - 1) as ck:  # the extremes work
        pass
    with store.checkpoint(step=-(2**63)) as ck2:
        pass
    assert [v.step for v in store.versions()] == [2**64 - 1, -(2**63)]
    assert ck.version == 1 and ck2.version == 2  # the refused call allocated no version


def test_table_ids_beyond_u32_are_invalid_argument(store):
    store.engine._index.write(lambda w: w.put_meta("next_table_id", 2**32))
    with pytest.raises(cnrstore.InvalidArgument, match="table ids"):
        store.create_table("t", 10, 4)
    assert store.tables() == {}


def test_appends_past_the_u32_offset_limit_go_on_in_a_new_segment(store, monkeypatch):
    """A put whose records would start beyond the index's u32 offsets (a batch of > 4 GiB, emulated with
    a small limit) spreads over segments instead of failing its commit with struct.error."""
    monkeypatch.setattr(knobs, "MAX_SEGMENT_OFFSET", 3000)
    store.create_table("t", 64 * 10, 8, codec="fp32", block_rows=64)
    values = np.random.default_rng(0).standard_normal((640, 8)).astype(np.float32)
    with store.checkpoint() as ck:
        ck.put_rows("t", np.arange(640), values)  # one batch of 10 records of 2104 bytes each
    with store.engine.read() as view:
        locs = [loc for *_key, loc in view.row_entries()]
    assert len({loc.segment for loc in locs}) >= 5
    assert max(loc.offset for loc in locs) <= 3000
    assert np.array_equal(store.read_table("t"), values) and store.verify().ok
