"""Races by schedule: the writer, compaction, GC's deletes and readers interleaved in chosen orders.

Each test stops one thread at a named pause point (cnrstore.engine.fs.pause_point; tests/support/schedule.py), runs
the competing work to completion in between, then lets the paused thread go on: the interleaving a
random stress test hits once in many runs happens every time. After each, every committed version
reads back exactly and ``verify()`` is clean.
"""

from __future__ import annotations

import os

import numpy as np

import cnrstore
from cnrstore import knobs

from support.schedule import Pause, run_in_thread

ROWS, DIM = 512, 16  # fp32: a full put is 32 KiB of rows


def full(v: int, rows=ROWS) -> np.ndarray:
    return np.full((rows, DIM), float(v), dtype=np.float32) + np.arange(rows, dtype=np.float32)[:, None]


def check_all(store, expected: dict) -> None:
    assert [i.version for i in store.versions()] == sorted(expected)
    for v, tables in expected.items():
        for name, values in tables.items():
            np.testing.assert_array_equal(store.read_table(name, version=v), values)
    report = store.verify()
    assert report.ok, report.problems


def test_gc_never_frees_a_segment_that_a_commit_grew_after_gc_planned(tmp_path, monkeypatch):
    """Fault 2 of issue 21 ("a race loses a segment with no fault at all"), by schedule.

    GC judges segments on one index snapshot and commits its frees later. A checkpoint that was open
    when GC started appends to the writer's active segment S (not sealed: the writer is busy), rolls
    over to a new one and commits while GC is between its plan and its commit: S is no longer busy,
    and GC's snapshot does not know the records the commit put in S. Invariant: no commit takes a
    segment out of the catalog while an index entry points into it."""
    monkeypatch.setattr(knobs, "SEGMENT_BYTES", 3 * ROWS * DIM * 4 + 4096)  # three full puts fit, not four
    path = str(tmp_path / "s")
    expected = {}
    with cnrstore.open(path, create=True) as store:
        store.create_table("a", ROWS, DIM, codec="fp32", block_rows=ROWS)
        store.create_table("b", ROWS, DIM, codec="fp32", block_rows=ROWS)
        for v in (1, 2, 3):  # three full puts of "a" in segment S; v1, v2 die at retain(1)
            with store.checkpoint() as ck:
                ck.put_rows("a", np.arange(ROWS), full(v))
        store.retain(keep_last=1)
        expected[3] = {"a": full(3)}
        ck = store.checkpoint()
        ck.put_rows("a", np.arange(ROWS), full(4))  # into S: uncommitted, so S is busy when GC starts
        with Pause("gc_planned") as planned:
            gc = run_in_thread(store.gc)
            planned.wait_reached()
            ck.put_rows("b", np.arange(ROWS), full(40))  # S is full: rolls over to a new segment
            ck.commit()  # S's new length and v4's entry into it are committed; S is no longer busy
            expected[4] = {"a": full(4), "b": full(40)}
            planned.release()
            gc.result(timeout=60)
        check_all(store, expected)
    with cnrstore.open(path, readonly=True) as store:
        check_all(store, expected)


def test_background_gc_beside_the_next_checkpoint_loses_no_version_across_a_restart(tmp_path, monkeypatch):
    """Fault 1 of issue 21 ("SIGKILL during maintenance loses versions"), by schedule: its policy's
    background step materializes, drops, then collects. The trainer's next checkpoint opens while the
    step materializes, so collect finds the writer busy (its segment not sealed) and plans on a snapshot
    that misses what the checkpoint then commits into that segment. Before the fix, the version read
    fine in the writing process until the freed file was deleted, and after a restart (the kill in the
    issue) it raised "segment ... is missing" and verify named an entry into a segment the catalog lacks."""
    from cnrstore.policy import CompactionPolicy, KeepLast, MaxChain, Retention

    # 40 KiB: each step's gc seals the writer's idle segment, so v3's half put (16 KiB) starts one; v4's full
    # put (32 KiB) joins it, and "b" then rolls over to a new one
    monkeypatch.setattr(knobs, "SEGMENT_BYTES", 40 << 10)
    path = str(tmp_path / "s")
    policy = CompactionPolicy(materialize=MaxChain(1), retention=Retention(KeepLast(1)), gc=True)
    expected = {}
    store = cnrstore.open(path, create=True, compaction=policy)
    try:
        store.create_table("a", ROWS, DIM, codec="fp32", block_rows=ROWS)
        store.create_table("b", ROWS, DIM, codec="fp32", block_rows=ROWS)
        for v in (1, 2):
            with store.checkpoint() as ck:
                ck.put_rows("a", np.arange(ROWS), full(v))
            assert store._compactor.wait_idle(60)
        with Pause("background_before_collect") as materializing, Pause("gc_planned") as planned:
            with store.checkpoint() as ck3:  # its commit starts the background step
                ck3.put_rows("a", np.arange(ROWS // 2), full(3, ROWS // 2))
            materializing.wait_reached()
            ck = store.checkpoint()  # opens while the step materializes and drops
            ck.put_rows("a", np.arange(ROWS), full(4))  # into the writer's active segment, uncommitted
            materializing.release()
            planned.wait_reached()  # collect found the writer busy and planned on its snapshot
            segments = set(os.listdir(os.path.join(path, "segments")))
            ck.put_rows("b", np.arange(ROWS), full(40))  # rolls over
            assert len(set(os.listdir(os.path.join(path, "segments"))) - segments) == 1, "a new segment"
            ck.commit()
            planned.release()
            assert store._compactor.wait_idle(60)
        expected[4] = {"a": full(4), "b": full(40)}
        assert store.compaction_error is None, store.compaction_error
        check_all(store, {v: t for v, t in expected.items() if v in {i.version for i in store.versions()}})
    finally:
        store.close()
    with cnrstore.open(path, readonly=True) as store:
        assert store.latest().version == 4
        check_all(store, {v: expected[v] for v in (i.version for i in store.versions())})
