"""open(compaction=...): a background worker carries out a policy; reads never change."""

import threading

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
        assert store.wait_for_compaction(30)
    return expected


def _check(store, expected):
    for info in store.versions():
        table, dense = expected[info.version]
        assert np.array_equal(store.read_table("e", info.version).view(np.uint32), table.view(np.uint32))
        assert np.array_equal(store.read_dense("d", info.version), dense)
    assert store.verify().ok


@pytest.mark.parametrize("policy,bound", [("auto", None), (CompactionPolicy(materialize=MaxChain(2)), 3)])
def test_background_materialization_bounds_chains_and_keeps_reads(store_path, policy, bound, monkeypatch):
    """"auto" with the writer's chain bound off (plain increments) materializes Check-N-Run's intermittent
    baselines in the background; an explicit rule materializes beside the bound."""
    monkeypatch.setattr(cnrstore.knobs, "READ_CHAIN_BOUND", bound)
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


def test_auto_with_the_default_bounds_merges_in_the_background_only(store_path):
    """With the default bounds "auto" materializes no baseline: saves write their own rows only, the
    background merges blocks whose read amplification passes knobs.MERGE_TRIGGER, counted apart
    (``merge_bytes``), and every version reads within knobs.READ_AMP_BOUND, exactly."""
    rng = np.random.default_rng(3)
    with cnrstore.open(store_path, create=True, compaction="auto") as store:
        store.create_table("e", 4000, 8, codec="int4", block_rows=1024)
        expected = _write(store, rng, 12)
        store._compactor.wait_idle()
        assert store._compactor.errors == [] and store._compactor.steps == 0  # no policy step did anything
        st = store.stats()
        assert st["max_read_chain"] <= cnrstore.knobs.READ_CHAIN_BOUND
        assert st["save_bytes"] == sum(v.bytes for v in store.versions())
        assert st["save_bytes"] == st["increment_bytes"]  # nothing merged on the save path
        assert st["merge_bytes"] == st["bytes_written"] - st["save_bytes"]
        if st["merge_bytes"]:
            assert store._compactor.merges
        for info in store.versions():
            assert store.read_amplification(info.version)["e"].max() <= cnrstore.knobs.READ_AMP_BOUND
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


# --- hardening (issue 11, item 15): background compaction failures reach the caller --------------------------

def _failing_materialize(monkeypatch, failures):
    """compaction.materialize raises StorageFull for its first ``failures`` calls, then works."""
    from cnrstore.maintenance import compaction

    real = compaction.materialize
    calls = {"n": 0}

    def materialize(store, version, progress=None):
        calls["n"] += 1
        if calls["n"] <= failures:
            raise cnrstore.StorageFull(f"injected: no space left on device while compacting at {version}")
        return real(store, version, progress)

    monkeypatch.setattr(compaction, "materialize", materialize)
    return calls


def test_background_compaction_failure_is_surfaced_then_raised_once_at_close(store_path, monkeypatch):
    from cnrstore.errors import CompactionFailed

    calls = _failing_materialize(monkeypatch, failures=1)
    rng = np.random.default_rng(5)
    store = cnrstore.open(store_path, create=True, compaction=CompactionPolicy(materialize=MaxChain(2)))
    store.create_table("e", 4000, 8, codec="int4", block_rows=1024)
    assert store.compaction_error is None and store.stats()["compaction_errors"] == 0
    expected = _write(store, rng, 3)  # the third commit makes a chain of 3: the first step fails
    assert calls["n"] >= 1
    assert isinstance(store.compaction_error, cnrstore.StorageFull)
    assert store.stats()["compaction_errors"] == 1
    # the store is intact and training keeps checkpointing; the worker is alive and retries, and succeeds
    expected.update(_write(store, rng, 3))
    assert store._compactor._thread.is_alive() and store._compactor.steps > 0
    assert store.stats()["compaction_errors"] == 1  # the retry did not fail
    _check(store, {v.version: expected[v.version] for v in store.versions()})
    with pytest.raises(CompactionFailed, match="failed 1 time") as info:
        store.close()
    assert isinstance(info.value.__cause__, cnrstore.StorageFull) and store_path in str(info.value)
    store.close()  # raised once: a second close is quiet
    with cnrstore.open(store_path) as again:  # nothing was lost
        _check(again, expected)


def test_compaction_failure_does_not_mask_the_with_blocks_own_error(store_path, monkeypatch):
    _failing_materialize(monkeypatch, failures=100)
    rng = np.random.default_rng(6)
    with pytest.raises(KeyError, match="the trainer's own failure"):
        with cnrstore.open(store_path, create=True, compaction=CompactionPolicy(materialize=MaxChain(2))) as store:
            store.create_table("e", 4000, 8, codec="int4", block_rows=1024)
            _write(store, rng, 4)
            assert store.stats()["compaction_errors"] >= 1
            raise KeyError("the trainer's own failure")
    with cnrstore.open(store_path) as store:  # no compactor: nothing to report
        assert store.compaction_error is None and store.stats()["compaction_errors"] == 0
        assert len(store.versions()) == 4 and store.verify().ok


def test_a_compaction_failing_at_every_commit_keeps_few_exceptions_and_counts_all(store_path, monkeypatch):
    """Each kept exception holds its traceback's frames (and their arrays): a long run of failures must not
    grow memory; the count stays exact."""
    from cnrstore.maintenance import background
    from cnrstore.errors import CompactionFailed

    monkeypatch.setattr(background, "KEEP_ERRORS", 2)
    _failing_materialize(monkeypatch, failures=10**6)
    store = cnrstore.open(store_path, create=True, compaction=CompactionPolicy(materialize=MaxChain(1)))
    store.create_table("e", 4000, 8, codec="int4", block_rows=1024)
    _write(store, np.random.default_rng(8), 7)
    assert store.stats()["compaction_errors"] == 6 and len(store._compactor.errors) == 2
    with pytest.raises(CompactionFailed, match="failed 6 time"):
        store.close()


def test_wait_for_compaction_says_whether_the_worker_is_idle(store_path, monkeypatch):
    """``wait_for_compaction(0)`` asks; with no timeout it waits until no step is pending or running, after
    which the steps it ran show in stats(); without a policy it is always idle."""
    from cnrstore.maintenance import compaction

    rng = np.random.default_rng(9)
    started, release = threading.Event(), threading.Event()
    materialize = compaction.materialize

    def held(*args, **kwargs):  # the background step's baseline, held until the test lets it go
        started.set()
        assert release.wait(30)
        return materialize(*args, **kwargs)

    monkeypatch.setattr(compaction, "materialize", held)
    with cnrstore.open(store_path, create=True, compaction=CompactionPolicy(materialize=MaxChain(1))) as store:
        store.create_table("e", 4000, 8, codec="int4", block_rows=1024)
        try:
            _write_some(store, rng, 3)
            assert started.wait(30)
            assert store.wait_for_compaction(0) is False  # a step is running
            assert store.wait_for_compaction(0.05) is False
        finally:
            release.set()
        assert store.wait_for_compaction()
        assert store.wait_for_compaction(0) and store.stats()["compaction_steps"] >= 1
    with cnrstore.open(store_path) as store:
        assert store.wait_for_compaction(0) and store.stats()["compaction_steps"] == 0


def _write_some(store, rng, versions):
    for i in range(versions):
        ids = np.arange(4000) if i == 0 else np.unique(rng.integers(0, 4000, 1000))
        with store.checkpoint(step=i) as ck:
            ck.put_rows("e", ids, rng.standard_normal((ids.size, 8)).astype(np.float32))
