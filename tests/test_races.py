"""Races by schedule: the writer, compaction, GC's deletes and readers interleaved in chosen orders.

Each test stops one thread at a named pause point (cnrstore.fs.pause_point; tests/schedule.py), runs
the competing work to completion in between, then lets the paused thread go on: the interleaving a
random stress test hits once in many runs happens every time. After each, every committed version
reads back exactly and ``verify()`` is clean.
"""

from __future__ import annotations

import numpy as np
import pytest

import cnrstore
from cnrstore import knobs

from schedule import Pause, run_in_thread

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
