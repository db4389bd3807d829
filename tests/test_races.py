"""Races by schedule: the writer, compaction, GC's deletes and readers interleaved in chosen orders.

Each test stops one thread at a named pause point (cnrstore.engine.fs.pause_point; tests/support/schedule.py), runs
the competing work to completion in between, then lets the paused thread go on: the interleaving a
random stress test hits once in many runs happens every time. After each, every committed version
reads back exactly and ``verify()`` is clean.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

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


# -- keyed tables (issue 50) -------------------------------------------------------------------------------
# A keyed save whose chains at the parent hold KEYED_CHAIN_BOUND (3 here) records merges each into a baseline:
# it lists the chain on an index snapshot, reads the older runs, and appends the merged record; a second
# put_keys into a partition reads the version's own record back and merges into it. Retention, GC and
# compaction run beside it, at each point of the save, and the save at each point of theirs.

KEYED_DIM = 8
KEY_IDS = np.arange(32, dtype=np.int64) * 1_000_003 - 7  # spread over both partitions


def _keyed_rows(keys: np.ndarray, v: int) -> tuple[np.ndarray, dict]:
    values = (keys[:, None] % 1000 + np.arange(KEYED_DIM) + v * 0.25).astype(np.float32)
    return values, {"step": np.full(keys.size, v, np.int64)}


class _KeyedModel:
    """A keyed store with versions 1-3 (each partition's chain at 3 holds 3 records) and what each version
    reads; ``save`` writes version 4 in steps, so a schedule can stop it between any two."""

    def __init__(self, path: str):
        self.store = cnrstore.open(path, create=True)
        self.store.create_table("ids", dim=KEYED_DIM, keyed=True, partitions=2, columns={"step": "int64"})
        self.expected: dict[int, dict[int, tuple]] = {}
        live: dict[int, tuple] = {}
        for v, (puts, deletes) in enumerate([(KEY_IDS[:12], []), (KEY_IDS[4:16], KEY_IDS[:2]),
                                             (KEY_IDS[8:20], KEY_IDS[2:4])], 1):
            with self.store.checkpoint() as ck:
                self._put(ck, live, puts, v)
                if len(deletes):
                    self._delete(ck, live, deletes)
            self.expected[v] = dict(live)
        assert list(self.store.read_amplification()["ids"]) == [3, 3]
        self.live = live

    def _put(self, ck, live: dict, keys: np.ndarray, v: int) -> None:
        values, columns = _keyed_rows(keys, v)
        ck.put_keys("ids", keys, values, columns=columns)
        live.update({int(k): (values[i], columns["step"][i]) for i, k in enumerate(keys.tolist())})

    def _delete(self, ck, live: dict, keys: np.ndarray) -> None:
        ck.delete_keys("ids", keys)
        for k in keys.tolist():
            live.pop(int(k), None)

    def save(self, between_puts=None) -> int:
        """Version 4: new keys into both partitions (merging their chains into baselines), keys put again into
        both (merged into the version's own records), deletions; ``between_puts()`` runs after the first call."""
        live = dict(self.live)
        with self.store.checkpoint() as ck:
            self._put(ck, live, KEY_IDS[20:28], 4)
            if between_puts is not None:
                between_puts()
            self._put(ck, live, KEY_IDS[10:14], 4)
            self._delete(ck, live, KEY_IDS[4:8])
        self.expected[ck.version] = live
        return ck.version

    def check_after_gc_and_reopen(self, path: str, listed: list[int]) -> None:
        """``check`` after a gc that deletes what waited for the save, and again after closing and reopening."""
        self.store.gc()
        self.check(self.store, listed)
        self.store.close()
        with cnrstore.open(path, readonly=True) as store:
            self.check(store, listed)

    def check(self, store, listed: list[int]) -> None:
        assert [i.version for i in store.versions()] == listed
        for v in listed:
            want = self.expected[v]
            got = store.read_keyed("ids", version=v)
            assert got.keys.tolist() == sorted(want), f"version {v}"
            np.testing.assert_array_equal(got.values, np.array([want[k][0] for k in sorted(want)], np.float32)
                                          .reshape(-1, KEYED_DIM), err_msg=f"version {v}")
            assert got.columns["step"].tolist() == [want[k][1] for k in sorted(want)]
            assert store.keys("ids", version=v).tolist() == sorted(want)
            found = store.read_keys("ids", KEY_IDS, version=v).found
            assert found.tolist() == [k in want for k in KEY_IDS.tolist()], f"version {v}"
        report = store.verify()
        assert report.ok, report.problems


def _maintain(store, what: str) -> None:
    if "compact" in what:
        store.compact()
    if "retain" in what:
        store.retain(keep_last=1)
        store.gc()


@pytest.fixture
def keyed_races(monkeypatch):
    monkeypatch.setattr(knobs, "KEYED_CHAIN_BOUND", 3)
    monkeypatch.setattr(knobs, "SEGMENT_BYTES", 2 << 10)  # a save rolls over; gc frees and cleans


MAINTENANCE = ["retain_gc", "compact", "compact_retain_gc"]


@pytest.mark.usefixtures("keyed_races")
@pytest.mark.parametrize("what", MAINTENANCE)
@pytest.mark.parametrize("point,merges", [("keyed_chain_merge", True), ("between_puts", True), ("after_append", True),
                                          ("after_fsync", True), ("between_puts", False), ("after_fsync", False)])
def test_maintenance_at_each_point_of_a_keyed_save(tmp_path, monkeypatch, point, merges, what):
    """Retention and GC (reclaiming the older runs' segments), compaction (baselines at the parent), or all
    three, while a keyed save is stopped: after listing its chains at the parent and before reading their runs
    (``keyed_chain_merge``: a segment GC frees is deleted only once that snapshot ends), between two put_keys
    into the same partitions, after its records are appended, after their fsync. The save merges each chain
    into a baseline (``merges``), or puts runs on top of them (the bound at 32). Every version reads exactly
    afterwards, again after a gc that deletes what waited for the save, and after reopening."""
    if not merges:
        monkeypatch.setattr(knobs, "KEYED_CHAIN_BOUND", 32)
    path = str(tmp_path / "s")
    m = _KeyedModel(path)
    store = m.store
    try:
        if point == "between_puts":
            v = m.save(between_puts=lambda: _maintain(store, what))
        else:
            with Pause(point) as paused:
                save = run_in_thread(m.save)
                paused.wait_reached()
                _maintain(store, what)
                paused.release()
                v = save.result(timeout=60)
        listed = [3, v] if "retain" in what else [1, 2, 3, v]
        m.check(store, listed)
        amps = store.read_amplification()["ids"].tolist()
        # (a baseline, or a run on a chain; a save buffers its runs to its commit, so compaction between its
        # puts leaves a one-record chain there, on which the save puts a run)
        merged = merges and not (point == "between_puts" and "compact" in what)
        assert amps == [1, 1] if merged else all(a > 1 for a in amps), amps
        m.check_after_gc_and_reopen(path, listed)
    finally:
        store.close()


@pytest.mark.usefixtures("keyed_races")
@pytest.mark.parametrize("point", ["compact_after_append", "drop_after_append", "gc_planned", "gc_cleaned_segment"])
def test_a_keyed_save_that_merges_a_chain_at_each_point_of_maintenance(tmp_path, point):
    """The other way round: compact, retain and gc run in a thread, stopped after compaction appended its
    baselines, after retention appended its DROP, after GC planned on its snapshot, after GC copied a
    segment's live key runs; meanwhile the whole keyed save runs (merging the chains it finds, which the
    stopped step is about to replace, drop or move) and commits. Every version reads exactly afterwards."""
    path = str(tmp_path / "s")
    m = _KeyedModel(path)
    store = m.store
    try:
        with Pause(point) as paused:
            maintenance = run_in_thread(_maintain, store, "compact_retain_gc")
            paused.wait_reached()
            v = m.save()
            paused.release()
            maintenance.result(timeout=60)
        listed = [v] if point == "compact_after_append" else [3, v]  # (retain counted before or after the save)
        m.check(store, listed)
        m.check_after_gc_and_reopen(path, listed)
    finally:
        store.close()
