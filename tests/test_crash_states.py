"""Crash states enumerated, not sampled (issue 21): named deterministic workloads of checkpoints
(increments and merged deltas), compact, retain, gc (freeing and cleaning segments) and repair, each
recorded through the file-system seam and checked in every crash state of every prefix
(tests/support/crash_states.py); for some workloads every crash state is also repaired from its log alone.

``make test`` runs each named workload over every prefix and prints how many distinct crash states it
checked. The deep sweep (``pytest --runslow tests/test_crash_states.py -k deep_sweep -s``) runs random
workloads over many seeds; its count is recorded in docs/DESIGN.md.
"""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from cnrstore import knobs
from cnrstore.policy import CompactionPolicy, KeepLast, MaxChain, Retention
from cnrstore.store import Store

from support import crash_states as cs
from support.options import options_changed
from support.crash_workload import TABLES, Workload, make_base, small_segments, write_more  # noqa: F401 (a fixture)
from support.crash_workload import (KeyedWorkload, keyed_content, make_keyed_base, short_keyed_chains,  # noqa: F401
                                    write_more_keyed)

pytestmark = pytest.mark.usefixtures("single_threaded_torch")


def run(tmp_path, seed: int, script, policy=None, keep_last=None, repair_from_log=False, keyed=False) -> cs.Sweep:
    """Record ``script(workload)`` on a fresh base store, then explore every crash state of it. ``keyed``: the
    store of one keyed table (support/crash_workload.py, ``KeyedWorkload``) instead of the positional one."""
    path = str(tmp_path / "store")
    (make_keyed_base if keyed else make_base)(path)
    base = str(tmp_path / "base")
    shutil.copytree(path, base)
    with Store(base, create=False, readonly=True, filesystem=cs.fs.DEFAULT) as s:
        initial = frozenset(v.version for v in s.versions())
        content = {v: keyed_content(s, v) if keyed else {name: s.read_table(name, version=v) for name in TABLES}
                   for v in initial}
    with cs.RecordingFileSystem(path) as rec:
        w = (KeyedWorkload if keyed else Workload)(path, rec, seed, policy)
        if keyed:
            w.start_from(content)
        else:
            w.content.update(content)
        try:
            script(w)
        finally:
            w.store.close()
    work = str(tmp_path / "states")
    os.makedirs(work)
    sweep = cs.explore(base, rec.effects, w.content, work, write_more_keyed if keyed else write_more,
                       initial=initial, keep_last=keep_last, repair_from_log=repair_from_log)
    print(f"\n{script.__name__}{' (each also repaired from the log)' if repair_from_log else ''}: "
          f"{sweep.effects} effects, {sweep.states} distinct crash states checked "
          f"{sweep.by_variant}")
    assert not sweep.failures, "\n".join(sweep.failures)
    return sweep


# -- named workloads -------------------------------------------------------------------------------------

def _checkpoints_with_maintenance(w: Workload, checkpoints: int, keep_last: int) -> None:
    """Issue 21's fault 1, scaled down: retain every 3rd checkpoint, gc every 4th, compact every 5th."""
    for i in range(1, checkpoints + 1):
        w.checkpoint(60)
        if i % 3 == 0:
            w.retain(keep_last)
        if i % 4 == 0:
            w.gc()
        if i % 5 == 0:
            w.compact()


def maintenance_mix(w: Workload) -> None:
    """8 checkpoints (10 before: 229 crash states, now 191), then a last compaction: it appends to the writer's
    open segment before rolling over, as the 10th checkpoint's did. The named workloads together still record
    every (operation, effect, file) kind and every distinct effect sequence of an operation that they did
    with the longer workloads (segment rolls, a gc that frees then cleans, retain's rewrite)."""
    _checkpoints_with_maintenance(w, 8, keep_last=4)
    w.compact()


def clean_after_drop(w: Workload) -> None:
    """Versions dropped, then GC cleans partly live segments (rewriting partly live records), twice. (3 and 2
    checkpoints: the same effect sequences of every operation as 5 and 3 had, 131 crash states instead of 200.)"""
    for _ in range(3):
        w.checkpoint(40)
    w.retain(2)
    w.gc()
    for _ in range(2):
        w.checkpoint(120)
    w.retain(1)
    w.gc()
    w.checkpoint(10)




def deltas_then_compact(w: Workload) -> None:
    """Long read chains turned into merged deltas by the writer (the count bound alone, at 3: the engine
    before issue 25), then a baseline, a drop and a gc. (6 checkpoints, several past the bound: the same effect
    sequences as 7 had, 174 crash states instead of 207.)"""
    with options_changed(w.store, read_chain_bound=3, read_amp_bound=None, merge_trigger=None):
        for _ in range(6):
            w.checkpoint(25)
        w.compact()
        w.retain(3)
        w.gc()
        w.checkpoint(25)


def merges_then_gc(w: Workload) -> None:
    """Background merges (issue 25) of chains past a low trigger, beside saves that merge past the hard
    bound themselves, then a drop that leaves the merged records' old inputs unread, gc's cleaning, and
    merges again. (3 saves before the merges, not 4: 162 crash states instead of 194, the same effect sequences.)"""
    merged = 0
    with options_changed(w.store, read_amp_bound=1.2, read_record_cost_s=0):  # the save path merges past the hard bound
        for _ in range(3):
            w.checkpoint(40)
    with options_changed(w.store, merge_trigger=1.1, read_amp_bound=None, read_record_cost_s=0):
        for i in range(4):
            w.checkpoint(40)
            if i % 2:
                merged += w.merge().blocks_merged
        w.retain(2)
        w.gc()
        w.checkpoint(40)
        merged += w.merge().blocks_merged
        w.gc()
        st = w.store.stats()
    assert merged and st["merge_bytes"], "the workload merged in the background"
    assert st["save_bytes"] > st["increment_bytes"], "and some save merged past the hard bound itself"


def rewrite_dense_then_gc(w: Workload) -> None:
    """Dense arrays of committed versions rewritten (migrate-payload's replace_dense), the old records
    reclaimed by gc, beside checkpoints and a drop."""
    versions = [w.checkpoint(30) for _ in range(4)]
    w.rewrite_dense(versions[1])
    w.rewrite_dense(versions[-1])
    w.retain(3)
    w.gc()
    w.rewrite_dense(w.checkpoint(30))
    w.gc()


def repair_amid_maintenance(w: Workload) -> None:
    """Repair of a store with its index intact, between checkpoints, a drop, gc's cleaning and a
    compaction, twice (idempotent): repair's new index, its renames and its READY mark recorded too."""
    for _ in range(3):
        w.checkpoint(40)
    w.retain(2)
    w.gc()
    w.repair()
    w.checkpoint(60)
    w.compact()
    w.repair()
    w.gc()
    w.checkpoint(20)


#: workloads whose every crash state is also checked with its index lost and repaired from the log
REPAIRED_FROM_LOG = {"maintenance_mix", "clean_after_drop", "deltas_then_compact", "merges_then_gc"}


@pytest.mark.parametrize("script", [maintenance_mix, clean_after_drop, deltas_then_compact, merges_then_gc,
                                    rewrite_dense_then_gc, repair_amid_maintenance],
                         ids=lambda s: s.__name__)
def test_every_crash_state_of_a_named_workload_recovers(ram_tmp_path, script):
    """Every crash state opens with the versions before or after the operation in flight, bit for bit;
    for the REPAIRED_FROM_LOG workloads each state, its index lost, also repairs from the segment log
    alone to the same (issue 21: "repair's index never reads differently from the committed history")."""
    sweep = run(ram_tmp_path, 0, script, repair_from_log=script.__name__ in REPAIRED_FROM_LOG)
    assert sweep.states > 50  # the workload did record effects to explore


# -- keyed tables (issue 50) ------------------------------------------------------------------------------
# KEYED_CHAIN_BOUND is 3 here (32 in the engine): a partition's chain crosses it in three saves.

def keyed_saves(w: KeyedWorkload) -> None:
    """Saves of a keyed table with puts and deletions: plain runs on a partition's chain; a save whose chains
    at the parent hold 3 records, so it merges each into a baseline (reading the older runs while it writes)
    and puts each partition twice (two put_keys calls) and deletes in it (a third), merging its own record
    each time; a save of deletions only; saves on top of the merged baselines, and one of deletions only that
    merges the chains again."""
    w.save(10, 3)
    w.save(8, 2)
    v = w.save(12, 4, split=True)  # the chains at the parent hold 3 records: merged into baselines
    assert w.merged_baselines(v), "the save merged a chain into a baseline"
    w.save(0, 5)
    w.save(9, 2, split=True)
    v = w.save(0, 4)  # deletions only, past the bound: baselines of the keys left
    assert w.merged_baselines(v)
    w.save(10, 2)


def keyed_maintenance(w: KeyedWorkload) -> None:
    """A keyed table's saves beside compact (its baselines: the live keys of each partition), retain (a drop
    that leaves older runs unread) and gc (freeing and cleaning segments of key runs), then a save that merges
    a chain past the bound after the drop, and maintenance again."""
    w.save(10, 3)
    w.save(8, 2)
    w.compact()
    w.save(10, 4, split=True)
    w.retain(2)
    assert w.gc().segments_rewritten, "gc cleaned segments: verified copies of live key runs"
    w.save(8, 3)
    v = w.save(6, 2)  # chains at the parent: compacted baseline, 2 runs: merged
    assert w.merged_baselines(v), "the save merged a chain into a baseline"
    w.retain(1)
    assert w.gc().segments_rewritten
    w.compact()


@pytest.mark.usefixtures("short_keyed_chains")
@pytest.mark.parametrize("script", [keyed_saves, keyed_maintenance], ids=lambda s: s.__name__)
def test_every_crash_state_of_a_keyed_workload_recovers(ram_tmp_path, script):
    """Every crash state of a keyed table's saves and maintenance opens with the versions before or after the
    operation in flight, each reading exactly as the model says (read_keyed, keys, read_keys of live and
    absent keys, one partition's read_keyed), and takes a new save; each state, its index lost, also repairs
    from the segment log alone to the same (issue 50)."""
    sweep = run(ram_tmp_path, 0, script, repair_from_log=True, keyed=True)
    assert sweep.states > 50


def background_policy(w: Workload) -> None:
    """Issue 21's fault 1 with its policy: background materialization, retention and GC beside the
    writer (effects of both threads recorded in the order they happened), plus explicit maintenance."""
    _checkpoints_with_maintenance(w, 12, keep_last=8)


def test_every_crash_state_of_background_maintenance_recovers(ram_tmp_path):
    policy = CompactionPolicy(materialize=MaxChain(3), retention=Retention(KeepLast(6)), gc=True)
    run(ram_tmp_path, 0, background_policy, policy=policy, keep_last=6)


def random_workload(seed: int):
    def script(w: Workload) -> None:
        rng = np.random.default_rng(seed)
        for _ in range(14):
            op = rng.choice(["ck", "ck", "ck", "compact", "retain", "gc", "repair"])
            if op == "ck" or len(w.listed()) < 2:
                w.checkpoint(int(rng.integers(5, 200)))
            elif op == "compact":
                w.compact()
            elif op == "retain":
                w.retain(int(rng.integers(1, 4)))
            elif op == "repair":
                w.repair()
            else:
                w.gc()
    script.__name__ = f"random_workload_{seed}"
    return script


@pytest.mark.slow
def test_deep_sweep_random_workloads(ram_tmp_path):
    """The opt-in sweep (``pytest --runslow -k deep_sweep``): random workloads of 14 operations (repair
    among them) over ``CNRSTORE_CRASH_SEEDS`` seeds (default 40), every prefix of each; with an odd seed
    every state is also repaired from its log alone."""
    total = repaired = 0
    for seed in range(int(os.environ.get("CNRSTORE_CRASH_SEEDS", "40"))):
        states = run(ram_tmp_path / f"seed{seed}", seed, random_workload(seed), repair_from_log=seed % 2 == 1).states
        total += states
        repaired += states if seed % 2 else 0
        shutil.rmtree(ram_tmp_path / f"seed{seed}")
    print(f"\ndeep sweep: {total} distinct crash states checked ({repaired} also repaired from the log), 0 failures")


def random_keyed_workload(seed: int):
    def script(w: KeyedWorkload) -> None:
        rng = np.random.default_rng(seed)
        for _ in range(12):
            op = rng.choice(["save", "save", "save", "split", "compact", "retain", "gc"])
            if op in ("save", "split") or len(w.listed()) < 2:
                w.save(int(rng.integers(0, 14)), int(rng.integers(0, 6)), split=op == "split", shared=False)
            elif op == "compact":
                w.compact()
            elif op == "retain":
                w.retain(int(rng.integers(1, 4)))
            else:
                w.gc()
    script.__name__ = f"random_keyed_workload_{seed}"
    return script


@pytest.mark.slow
@pytest.mark.usefixtures("short_keyed_chains")
def test_deep_sweep_random_keyed_workloads(ram_tmp_path):
    """The keyed tables' opt-in sweep (``pytest --runslow -k deep_sweep``): random workloads of 12 saves (split
    into two put_keys and a delete_keys, or not), compactions, drops and gcs over ``CNRSTORE_CRASH_SEEDS`` seeds
    (default 40), every prefix of each, every state of an odd seed also repaired from its log alone."""
    total = 0
    for seed in range(int(os.environ.get("CNRSTORE_CRASH_SEEDS", "40"))):
        total += run(ram_tmp_path / f"seed{seed}", seed, random_keyed_workload(seed), repair_from_log=seed % 2 == 1,
                     keyed=True).states
        shutil.rmtree(ram_tmp_path / f"seed{seed}")
    print(f"\nkeyed deep sweep: {total} distinct crash states checked, 0 failures")
