"""Background merges and reads bounded by cost (issue 25; cnrstore/engine/merge.py, compaction.merge_chains):
saves write only their own rows, merges run in the background and are counted apart, every version reads
bit-exactly and within knobs.READ_AMP_BOUND, repair from the log alone keeps every version after merges and
gc, and by schedule: a merge beside a save that merges the same chain itself, and a save whose merge reads
an entry a background merge replaces, lose nothing. Crash states: tests/test_crash_states.py
``merges_then_gc``."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

import cnrstore
from cnrstore import knobs
from cnrstore.engine import merge, record
from cnrstore.maintenance.compaction import merge_chains
from cnrstore.maintenance.rate_limit import RateLimiter

from support.options import options_changed
from support.schedule import Pause, run_in_thread

ROWS, DIM, BLOCK = 2048, 8, 256


def _save(store, rng, model: dict, fraction: float) -> int:
    rows = np.sort(rng.choice(ROWS, int(ROWS * fraction), replace=False))
    values = rng.standard_normal((rows.size, DIM)).astype(np.float32)
    with store.checkpoint() as ck:
        ck.put_rows("t", rows, values)
    model["state"][rows] = values
    model[ck.version] = model["state"].copy()
    return ck.version


def _new(path, compaction="auto"):
    store = cnrstore.open(path, create=True, compaction=compaction)
    store.create_table("t", ROWS, DIM, codec="fp32", block_rows=BLOCK)
    rng = np.random.default_rng(7)
    model = {"state": rng.standard_normal((ROWS, DIM)).astype(np.float32)}
    with store.checkpoint() as ck:
        ck.put_rows("t", np.arange(ROWS), model["state"])
    model[ck.version] = model["state"].copy()
    return store, rng, model


def _check(store, model: dict) -> None:
    for info in store.versions():
        np.testing.assert_array_equal(store.read_table("t", info.version), model[info.version])


@pytest.fixture
def low_trigger(monkeypatch):
    monkeypatch.setattr(knobs, "READ_RECORD_COST_S", 0)
    monkeypatch.setattr(knobs, "MERGE_TRIGGER", 1.3)
    monkeypatch.setattr(knobs, "READ_AMP_BOUND", 2.0)


def test_background_merges_bound_reads_and_saves_write_their_own_rows(tmp_path, low_trigger):
    store, rng, model = _new(tmp_path / "s")
    with store:
        for _ in range(30):
            _save(store, rng, model, 0.03)
            store._compactor.wait_idle()
        st = store.stats()
        assert st["save_bytes"] == st["increment_bytes"], "no save merged: the background kept up"
        assert st["merge_bytes"] > 0 and st["bytes_written"] == st["save_bytes"] + st["merge_bytes"]
        assert store._compactor.merges and store._compactor.errors == []
        for info in store.versions():
            amp = store.read_amplification(info.version)["t"]
            assert amp.size == ROWS // BLOCK and amp.min() >= 1.0 and amp.max() <= knobs.READ_AMP_BOUND
        with store.engine.read() as view:
            merged = [loc for *_k, loc in view.row_entries() if loc.flags & record.FLAG_COMPACTED]
        assert merged, "merged records sit under the keys of the versions they merged at"
        _check(store, model)
        assert store.verify().ok


def test_without_background_merges_the_save_path_holds_the_hard_bound(tmp_path, low_trigger):
    store, rng, model = _new(tmp_path / "s", compaction=None)
    with store:
        for _ in range(30):
            _save(store, rng, model, 0.03)
        st = store.stats()
        assert st["merge_bytes"] == 0 and st["save_bytes"] > st["increment_bytes"]
        for info in store.versions():
            assert store.read_amplification(info.version)["t"].max() <= knobs.READ_AMP_BOUND
        _check(store, model)


def _walked_costs(store) -> dict:
    """{(table id, block): (head, records, cost)} of every block's chain at the newest version, walked."""
    info = store.engine.table_record("t")
    newest = store.versions()[-1].version
    found = {}
    with store.engine.read() as view:
        for block in range(ROWS // BLOCK):
            chain = merge.walk_chain(view, info.id, block, newest)
            found[(info.id, block)] = (merge.chain_head(view, info.id, block, newest),
                                       len(chain.records) + (chain.baseline is not None),
                                       merge.chain_cost(info, block, chain, store.options)[0])
    return found


@pytest.mark.parametrize("compaction", [None, "auto"])
def test_the_remembered_chain_costs_match_the_chains_or_overstate_them(tmp_path, low_trigger, compaction):
    """The save path checks its bound against the engine's remembered chain costs (chain_costs.py), not a
    walk: each entry naming a block's current head holds exactly the walked chain's records and cost
    without background merges, and never less with them (a merge below the head only makes it cheaper)."""
    store, rng, model = _new(tmp_path / "s", compaction=compaction)
    with store:
        used = 0
        for _ in range(30):
            _save(store, rng, model, 0.03)
            if compaction:
                store._compactor.wait_idle()
            for key, (head, records, cost) in _walked_costs(store).items():
                known = store.engine._chain_costs.get(key, head)
                if known is None:
                    continue  # a merged or new head: the next save walks the chain
                used += 1
                if compaction is None:
                    assert (known.records, known.cost) == (records, cost), key
                else:
                    assert known.records >= records and known.cost >= cost, key
        assert used > 30, "the remembered costs were used"
        _check(store, model)


def test_merged_stores_repair_from_the_log_alone(tmp_path, low_trigger):
    """After merges, a drop and gc's cleaning (the merged records' old inputs reclaimed), the index is
    lost: repair proves every kept version from the log, merged deltas included."""
    path = tmp_path / "s"
    store, rng, model = _new(path)
    with store:
        for _ in range(25):
            _save(store, rng, model, 0.03)
            store._compactor.wait_idle()
        store.retain(keep_last=6)
        with options_changed(store, gc_live_fraction=0.99):
            store.gc()
        kept = [info.version for info in store.versions()]
    shutil.rmtree(os.path.join(path, "index"))
    report = cnrstore.repair(path)
    assert report.versions_recovered == kept and not report.versions_lost
    with cnrstore.open(path, readonly=True) as ro:
        _check(ro, model)
        assert ro.verify().ok


def test_a_merge_beside_a_save_that_merges_the_same_chain(tmp_path, low_trigger):
    """By schedule: a background merge at v has appended its records (not committed) when a save on
    parent v merges the same chain past the hard bound itself and commits; then the merge commits, and a
    drop and gc follow. Every version reads exactly, before and after repair from the log."""
    path = tmp_path / "s"
    store, rng, model = _new(path, compaction=None)
    with store:
        with options_changed(store, read_amp_bound=None):
            for _ in range(8):
                _save(store, rng, model, 0.03)  # a long chain: plain increments
        newest = store.latest().version
        with Pause("merge_appended") as appended:
            def merge():
                with store.engine.maintenance() as m:
                    return merge_chains(m, newest)
            merging = run_in_thread(merge)
            appended.wait_reached()
            with options_changed(store, read_amp_bound=1.2):  # past it: the save merges itself, reading v's chain
                _save(store, rng, model, 0.05)
            appended.release()
            assert merging.result(timeout=60).blocks_merged > 0
        assert store.stats()["save_bytes"] > store.stats()["increment_bytes"]
        _save(store, rng, model, 0.03)
        _check(store, model)
        store.retain(keep_last=2)
        store.gc()
        kept = [info.version for info in store.versions()]
        _check(store, model)
    shutil.rmtree(os.path.join(path, "index"))
    assert cnrstore.repair(path).versions_recovered == kept
    with cnrstore.open(path, readonly=True) as ro:
        _check(ro, model)


def test_a_save_merging_an_entry_that_a_background_merge_replaces(tmp_path, low_trigger):
    """By schedule: a save's merge has read and appended (crash point after_delta_merge) from the chain at
    its parent v when a background merge replaces v's entries and a gc runs; the save then commits. Its
    pinned bases survive, and every version reads exactly."""
    store, rng, model = _new(tmp_path / "s", compaction=None)
    with store:
        with options_changed(store, read_amp_bound=None):
            for _ in range(8):
                _save(store, rng, model, 0.03)
        newest = store.latest().version
        with options_changed(store, read_amp_bound=1.2), Pause("after_delta_merge") as merged:  # the save merges
            saving = run_in_thread(_save, store, rng, model, 0.05)
            merged.wait_reached()
            with store.engine.maintenance() as m:
                assert merge_chains(m, newest).blocks_merged > 0
            store.gc()
            merged.release()
            saving.result(timeout=60)
        _check(store, model)
        store.retain(keep_last=1)
        store.gc()
        _check(store, model)
        assert store.verify().ok


def test_the_rate_limiter_spreads_writes_over_time():
    now = [0.0]
    slept = []

    def sleep(s):
        slept.append(s)
        now[0] += s

    limiter = RateLimiter(1000, clock=lambda: now[0], sleep=sleep)
    limiter.acquire(1000)  # the first second's burst: no wait
    assert not slept
    limiter.acquire(3000)  # 3 s of debt
    assert sum(slept) == pytest.approx(3.0) and max(slept) <= 0.1 + 1e-9
    assert limiter.waited == pytest.approx(3.0)
    limiter.acquire(500, halted=lambda: True)  # a halt cuts the wait short
    assert limiter.waited == pytest.approx(3.0)
    RateLimiter(None).acquire(1 << 40)  # no limit: never waits

