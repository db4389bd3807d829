"""cnrstore/engine/writer.py: one version's writer (docs/API.md, "Writing a checkpoint"): commit on a normal
exit, abort (nothing visible, the appended bytes truncated) on an exception, bad input refused with the
version left as it was, one record per block however many puts touch it. Crashes mid-write are
test_crash*.py's, I/O faults test_disk_faults.py's."""

from __future__ import annotations

import numpy as np
import pytest

import cnrstore
from cnrstore import codecs, knobs
from cnrstore.engine import record
from cnrstore.errors import CheckpointInProgress, InvalidArgument, MissingRows, StoreClosed, TableNotFound
from cnrstore.engine.arguments import check_meta

DIM = 3
FP32_ROW = 4 * DIM


@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.setattr(knobs, "READ_CHAIN_BOUND", None)
    with cnrstore.open(tmp_path / "s", create=True) as s:
        s.create_table("t", 16, DIM, codec="fp32", block_rows=4)
        yield s


def ones(n: int, value: float = 1.0) -> np.ndarray:
    return np.full((n, DIM), value, np.float32)


def full_records(blocks: int, rows_per_block: int = 4) -> int:
    """Bytes of ``blocks`` full fp32 records (no offsets) of ``rows_per_block`` rows each."""
    return blocks * (record.HEADER_BYTES + record.TRAILER_BYTES + rows_per_block * FP32_ROW)


def test_a_normal_exit_commits_the_version_it_numbered_at_open(store):
    with store.checkpoint(step=7, meta={"lr": 0.5}) as ck:
        assert ck.version == 1 and not ck.committed
        ck.put_rows("t", [0], ones(1))
    assert ck.committed and ck.commit() == 1            # idempotent once committed
    (info,) = store.versions()
    assert (info.version, info.step, info.meta, info.parent, list(info.tables)) == (1, 7, {"lr": 0.5}, None, ["t"])


def test_an_exception_aborts_leaves_no_trace_and_truncates_what_was_appended(store, tmp_path):
    with store.checkpoint() as ck:
        ck.put_rows("t", [0], ones(1))
    before = store.stats()
    with pytest.raises(RuntimeError, match="trainer died"):
        with store.checkpoint() as ck:
            ck.put_rows("t", np.arange(16), ones(16, 2.0))
            raise RuntimeError("trainer died")
    assert [v.version for v in store.versions()] == [1]
    assert store.stats()["bytes_written"] == before["bytes_written"]
    with store.checkpoint() as ck:                      # a version number is never reused
        ck.put_rows("t", [1], ones(1))
    assert ck.version > 2 and store.read_rows("t", [0, 1]).tolist() == ones(2).tolist()
    # the log holds what a store that never saw the aborted version holds: its bytes were cut off
    with cnrstore.open(tmp_path / "ref", create=True) as ref:
        ref.create_table("t", 16, DIM, codec="fp32", block_rows=4)
        for row in (0, 1):
            with ref.checkpoint() as ck:
                ck.put_rows("t", [row], ones(1))
        assert store.stats()["segment_bytes"] == ref.stats()["segment_bytes"]


def test_a_writer_is_closed_once_committed_or_aborted(store):
    ck = store.checkpoint()
    ck.abort()
    ck.abort()                                          # idempotent
    with pytest.raises(StoreClosed, match="aborted"):
        ck.put_rows("t", [0], ones(1))
    with store.checkpoint() as ck:
        pass
    with pytest.raises(StoreClosed, match="committed"):
        ck.put_dense("d", np.zeros(2))


def test_one_writer_at_a_time(store):
    with store.checkpoint():
        with pytest.raises(CheckpointInProgress):
            store.checkpoint()


@pytest.mark.parametrize("rows,values,why", [
    ([3, 3], ones(2), "unique"),
    ([16], ones(1), "row"),
    ([2], np.array([[np.nan, 0, 0]], np.float32), "finite"),
    ([2], np.ones((1, DIM + 1), np.float32), "shape"),
])
def test_bad_input_is_refused_and_the_version_stays_as_it_was(store, rows, values, why):
    with store.checkpoint() as ck:
        ck.put_rows("t", [0, 1], ones(2))
        with pytest.raises(InvalidArgument):
            ck.put_rows("t", rows, values)
        with pytest.raises(TableNotFound):
            ck.put_rows("nope", [0], ones(1))
    assert store.read_rows("t", [0, 1]).tolist() == ones(2).tolist()
    with pytest.raises(MissingRows):
        store.read_rows("t", [2])
    assert store.latest().bytes == record.HEADER_BYTES + record.TRAILER_BYTES + 2 * FP32_ROW


def test_puts_touching_one_block_make_one_record_of_it(store):
    with store.checkpoint() as ck:
        ck.put_rows("t", [0, 2], ones(2, 1.0))
        ck.put_rows("t", [3, 1], ones(2, 2.0))          # unsorted: the writer sorts
        with pytest.raises(InvalidArgument, match="row 2 of table 't' is put twice"):
            ck.put_rows("t", [2, 5], ones(2, 3.0))
    assert store.read_rows("t", [0, 1, 2, 3])[:, 0].tolist() == [1, 2, 1, 2]
    with pytest.raises(MissingRows):
        store.read_rows("t", [5])                       # the refused put left nothing behind
    assert store.latest().bytes == sum([
        record.HEADER_BYTES + record.TRAILER_BYTES + 2 * (2 + FP32_ROW),   # the first put's record
        full_records(1)])                                                  # the merged one that replaced it


def test_parts_of_one_block_in_two_codecs_each_read_as_their_own_codec_stored_them(store):
    int4 = codecs.get("int4")
    values = np.array([[0.1, 0.2, 0.37]], np.float32)
    with store.checkpoint() as ck:
        ck.put_rows("t", [0], values, codec="int4")
        ck.put_rows("t", [1], values)                    # the table's fp32
    got = store.read_rows("t", [0, 1])
    assert np.array_equal(got[0], int4.decode(int4.encode(values), DIM)[0])
    assert np.array_equal(got[1], values[0])


def test_a_block_its_codec_cannot_hold_is_written_with_the_fallback(tmp_path):
    with cnrstore.open(tmp_path / "f", create=True) as s:
        s.create_table("h", 8, DIM, codec="fp16", block_rows=4)
        values = np.array([[1e6, 0, 0], [0.5, 0, 0], [0.25, 0, 0]], np.float32)   # 1e6 is past fp16's range
        with s.checkpoint() as ck:
            ck.put_rows("h", [0, 1, 4], values)
        got = s.read_rows("h", [0, 1, 4])
    assert got[0, 0] == 1e6 and got[1, 0] == 0.5         # block 0: the fallback (fp32), exact
    fp16 = codecs.get("fp16")
    assert np.array_equal(got[2], fp16.decode(fp16.encode(values[2:]), DIM)[0])


def test_encoding_in_chunks_never_splits_a_block(store, monkeypatch):
    monkeypatch.setattr(knobs, "ENCODE_CHUNK_ROWS", 3)
    values = np.arange(16 * DIM, dtype=np.float32).reshape(16, DIM)
    with store.checkpoint() as ck:
        ck.put_rows("t", np.arange(16), values)
    assert store.latest().bytes == full_records(4)      # four records, none merged from two chunks
    assert np.array_equal(store.read_table("t"), values)


def test_an_empty_put_lists_no_table(store):
    with store.checkpoint() as ck:
        ck.put_rows("t", np.zeros(0, np.int64), np.zeros((0, DIM), np.float32))
        ck.put_dense("d", np.zeros(3))
    assert list(store.latest().tables) == [] and list(store.latest().dense) == ["d"]


def test_dense_arrays_are_put_once_and_only_numeric(store):
    with store.checkpoint() as ck:
        ck.put_dense("d", np.arange(3))
        with pytest.raises(InvalidArgument, match="put twice"):
            ck.put_dense("d", np.arange(3))
        with pytest.raises(InvalidArgument, match="dtype"):
            ck.put_dense("s", np.array(["a"]))
    assert store.read_dense("d").tolist() == [0, 1, 2]


@pytest.mark.parametrize("meta", [None, {}, {"pos": [1, 2], "name": "x", "b": b"\0"}])
def test_check_meta_accepts_msgpack_able_dicts(meta):
    check_meta(meta)


@pytest.mark.parametrize("meta,why", [([1], "must be a dict"), ({"f": object()}, "msgpack-able"),
                                      ({"n": 2**70}, "msgpack-able")])
def test_check_meta_refuses_anything_else(meta, why, store):
    with pytest.raises(InvalidArgument, match=why):
        check_meta(meta)
    with pytest.raises(InvalidArgument, match=why):
        store.checkpoint(meta=meta)
