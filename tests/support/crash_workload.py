"""test_crash_states.py's workload (shared by test_crash_states_remote.py): a store of two tables driven through
the recording file system (support/crash_states.py), with the model of what every version reads; the base
store it starts from, and the new write each recovered crash state must take."""

from __future__ import annotations

import numpy as np
import pytest

from cnrstore import knobs
from cnrstore.maintenance.background import BackgroundCompactor
from cnrstore.maintenance.compaction import merge_chains
from cnrstore.maintenance.repair import repair
from cnrstore.store import Store

from . import crash_states as cs

ROWS, BLOCK = 512, 64
TABLES = {"f": (4, "fp32"), "q": (8, "int4")}


@pytest.fixture(autouse=True)
def small_segments(monkeypatch):
    """4 KiB segments: a version spans one to three, so GC frees and cleans many, and writers roll over."""
    monkeypatch.setattr(knobs, "SEGMENT_BYTES", 4 << 10)


class Workload:
    """Drives a store through the recording file system and keeps the model: what every version reads."""

    def __init__(self, path: str, rec: cs.RecordingFileSystem, seed: int, policy=None):
        self.rec = rec
        self.rng = np.random.default_rng(seed)
        self.store = Store(path, create=False, readonly=False, filesystem=rec)
        if policy is not None:  # as cnrstore.open(compaction=policy) does
            self.store._compactor = BackgroundCompactor(self.store.engine, policy)
            self.store.engine.set_commit_listener(self.store._compactor.notify)
        self.model = {name: np.full((ROWS, dim), 0.5, np.float32) for name, (dim, _c) in TABLES.items()}
        self.content: dict[int, dict[str, np.ndarray]] = {}

    def listed(self) -> frozenset:
        return frozenset(v.version for v in self.store.versions())

    def _op(self, name: str, fn):
        self.rec.op_start(name, self.listed())
        result = fn()
        self.rec.op_end(self.listed())
        return result

    def checkpoint(self, rows_per_table: int) -> int:
        def write():
            with self.store.checkpoint() as ck:
                for name, (dim, _codec) in TABLES.items():
                    rows = np.sort(self.rng.choice(ROWS, size=rows_per_table, replace=False))
                    values = self.rng.standard_normal((rows.size, dim)).astype(np.float32)
                    ck.put_rows(name, rows, values)
                    self.model[name][rows] = values
                ck.put_dense("d", np.arange(ck.version, ck.version + 40, dtype=np.int64))
            return ck.version

        v = self._op("checkpoint", write)
        self.content[v] = {name: self.store.read_table(name, version=v) for name in TABLES}
        self.content[v][cs.DENSE + "d"] = np.arange(v, v + 40, dtype=np.int64)
        np.testing.assert_array_equal(self.content[v]["f"], self.model["f"])  # fp32 is exact
        return v

    def compact(self):
        return self._op("compact", self.store.compact)

    def retain(self, keep_last: int):
        return self._op("retain", lambda: self.store.retain(keep_last=keep_last))

    def gc(self):
        return self._op("gc", self.store.gc)

    def repair(self):
        """``cnrstore repair`` of the store with its index intact (closed first, reopened after): the
        new index is built beside the old one, the old one moved aside and the new one renamed in."""
        def run_repair():
            self.store.close()
            report = repair(self.store.path, filesystem=self.rec)
            assert report.ok, report.versions_lost
            self.store = Store(self.store.path, create=False, readonly=False, filesystem=self.rec)
        return self._op("repair", run_repair)

    def merge(self):
        """A background merge step (issue 25) at the newest version, as the compactor runs it."""
        def run_merges():
            engine = self.store.engine
            with engine.maintenance() as m:
                return merge_chains(m, self.store.latest().version)
        return self._op("merge", run_merges)

    def rewrite_dense(self, version: int):
        """``Store.replace_dense`` (what ``cnrstore migrate-payload`` does to a trainer payload): the array of
        ``version`` rewritten, here with the same values, so every version reads the same."""
        def rewrite():
            self.store.replace_dense("d", version, self.content[version][cs.DENSE + "d"])
        return self._op("rewrite_dense", rewrite)


def make_base(path: str) -> None:
    """The store before the recorded workload: tables, and version 1 writing every row."""
    store = Store(path, create=True, readonly=False, filesystem=cs.fs.DEFAULT)
    try:
        for name, (dim, codec) in TABLES.items():
            store.create_table(name, ROWS, dim, codec=codec, block_rows=BLOCK)
        with store.checkpoint() as ck:
            for name, (dim, _codec) in TABLES.items():
                ck.put_rows(name, np.arange(ROWS), np.full((ROWS, dim), 0.5, np.float32))
    finally:
        store.close()


def write_more(store: Store) -> None:
    """After recovery the store takes a new checkpoint (read back), and gc and compact run."""
    rows = np.array([1, 70, 300])
    values = np.full((3, 4), 7.25, np.float32)
    with store.checkpoint() as ck:
        ck.put_rows("f", rows, values)
    np.testing.assert_array_equal(store.read_rows("f", rows), values)
    store.gc()
    store.compact()
    store.gc()
