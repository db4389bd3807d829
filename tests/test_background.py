"""open(compaction=...): a background worker carries out a policy; reads never change."""

import numpy as np
import pytest

import cnrstore
from cnrstore.policy import CompactionPolicy, KeepEveryNSteps, KeepLast, MaxChain, Retention


def _write(store, rng, versions, rows=4000, dim=8):
    """Checkpoints of ~25% modified rows; returns what each version must read as."""
    expected = {}
    for i in range(versions):
        ids = np.arange(rows) if i == 0 else np.unique(rng.integers(0, rows, rows // 4))
        with store.checkpoint(step=10 * i) as ck:
            ck.put_rows("e", ids, rng.standard_normal((ids.size, dim)).astype(np.float32))
            ck.put_dense("d", np.full(2, i))
        expected[ck.version] = (store.read_table("e", ck.version), np.full(2, i))
        store._compactor.wait_idle(30)
    return expected


def _check(store, expected):
    for info in store.versions():
        table, dense = expected[info.version]
        assert np.array_equal(store.read_table("e", info.version).view(np.uint32), table.view(np.uint32))
        assert np.array_equal(store.read_dense("d", info.version), dense)
    assert store.verify().ok


@pytest.mark.parametrize("policy", ["auto", CompactionPolicy(materialize=MaxChain(2))])
def test_background_materialization_bounds_chains_and_keeps_reads(store_path, policy):
    rng = np.random.default_rng(3)
    with cnrstore.open(store_path, create=True, compaction=policy) as store:
        store.create_table("e", 4000, 8, codec="int4", block_rows=1024)
        expected = _write(store, rng, 12)
        assert store._compactor.errors == [] and store._compactor.steps > 0
        assert store.stats()["max_read_chain"] <= (2 if policy != "auto" else 4)
        assert len(store.versions()) == 12  # no retention: every version kept
        _check(store, expected)
    with cnrstore.open(store_path) as store:  # and after a restart
        _check(store, expected)


def test_background_retention_of_every_nth_step_and_gc(store_path, monkeypatch):
    monkeypatch.setattr(cnrstore.knobs, "SEGMENT_BYTES", 16 << 10)  # several segments for GC to free
    policy = CompactionPolicy(materialize=MaxChain(3), retention=Retention(KeepLast(2), KeepEveryNSteps(40)))
    rng = np.random.default_rng(4)
    with cnrstore.open(store_path, create=True, compaction=policy) as store:
        store.create_table("e", 4000, 8, codec="int4", block_rows=1024)
        expected = _write(store, rng, 10)
        kept = [v.step for v in store.versions()]
        assert kept == [0, 40, 80, 90]  # every 40th step, and the newest two
        _check(store, expected)
        stats = store.stats()  # GC freed segments: less on disk than was ever written
        assert stats["segment_bytes"] < stats["bytes_written"] and stats["live_bytes"] <= stats["segment_bytes"]
        assert store._compactor.errors == []


def test_checkpoints_proceed_while_the_worker_runs(store_path):
    # the trainer never gets CheckpointInProgress from background work, and close() waits for it
    rng = np.random.default_rng(5)
    with cnrstore.open(store_path, create=True, compaction=CompactionPolicy(materialize=MaxChain(1))) as store:
        store.create_table("e", 4000, 8, codec="int4", block_rows=1024)
        expected = {}
        for i in range(8):  # no wait_idle: commits race the worker
            ids = np.arange(4000) if i == 0 else np.unique(rng.integers(0, 4000, 1000))
            with store.checkpoint(step=i) as ck:
                ck.put_rows("e", ids, rng.standard_normal((ids.size, 8)).astype(np.float32))
                ck.put_dense("d", np.full(2, i))
            expected[ck.version] = (store.read_table("e", ck.version), np.full(2, i))
            store.compact()  # a foreground compaction racing the background one
    with cnrstore.open(store_path) as store:
        _check(store, expected)


def test_compaction_argument_is_checked(store_path):
    with pytest.raises(cnrstore.InvalidArgument):
        cnrstore.open(store_path, create=True, compaction="sometimes")
    cnrstore.open(store_path, create=True).close()
    with pytest.raises(cnrstore.InvalidArgument):
        cnrstore.open(store_path, readonly=True, compaction="auto")
