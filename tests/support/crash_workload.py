"""test_crash_states.py's workload (shared by test_crash_states_remote.py): a store of two tables driven through
the recording file system (support/crash_states.py), with the model of what every version reads; the base
store it starts from, and the new write each recovered crash state must take."""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest

from cnrstore import knobs
from cnrstore.maintenance.background import BackgroundCompactor
from cnrstore.maintenance.compaction import merge_chains
from cnrstore.maintenance import repair as repair_module
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
        new index is built beside the old one, the old one moved aside and the new one renamed in. (Repair
        leaves a store it verifies healthy as it is; here it is told the store is not, so that the rebuild an
        index that fails verification gets, with its renames and READY mark, is what the explorer records.)"""
        def run_repair():
            self.store.close()
            with mock.patch.object(repair_module, "_store_is_healthy", lambda *_a, **_k: False):
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


# -- a keyed table (issue 50) ------------------------------------------------------------------------------

KEYED_TABLE, KEYED_DIM, KEYED_PARTITIONS = "ids", 4, 4
KEYED_COLUMNS = {"score": "float32", "step": ("int64", 2)}
#: the ids the keyed workloads put and delete: far apart in the int64 space, negatives too
KEY_POOL = np.unique(np.random.default_rng(50).integers(-(1 << 62), 1 << 62, 48, dtype=np.int64))
#: ids never put: a read must find none of them
NEVER_PUT = np.array([0, 1, -1, 1 << 40], np.int64)


@pytest.fixture
def short_keyed_chains(monkeypatch):
    """A save merges a partition's chain into a baseline once it holds 3 records (32 in the engine)."""
    monkeypatch.setattr(knobs, "KEYED_CHAIN_BOUND", 3)


def make_keyed_base(path: str) -> None:
    """A store of keyed table "ids" (4 partitions, two columns), and version 1 putting 20 keys of KEY_POOL."""
    store = Store(path, create=True, readonly=False, filesystem=cs.fs.DEFAULT)
    try:
        store.create_table(KEYED_TABLE, dim=KEYED_DIM, keyed=True, partitions=KEYED_PARTITIONS,
                           columns=KEYED_COLUMNS)
        keys = KEY_POOL[::2][:20]
        with store.checkpoint() as ck:
            values, columns = _rows(keys, 1)
            ck.put_keys(KEYED_TABLE, keys, values, columns=columns)
    finally:
        store.close()


def _rows(keys: np.ndarray, salt: int) -> tuple[np.ndarray, dict]:
    """(values, columns) of ``keys`` put by save ``salt``: exact in fp32, different at every save."""
    rng = np.random.default_rng([salt, keys.size])
    values = rng.standard_normal((keys.size, KEYED_DIM)).astype(np.float32)
    columns = {"score": rng.standard_normal(keys.size).astype(np.float32),
               "step": np.stack([np.full(keys.size, salt, np.int64), keys], axis=1)}
    return values, columns


def keyed_content(store: Store, version: int) -> dict:
    """The content (support/crash_states.py) of ``version`` of a keyed store, as it reads now."""
    got = store.read_keyed(KEYED_TABLE, version=version)
    return {cs.KEYED + KEYED_TABLE: cs.KeyedContent(got.keys, got.values, got.columns,
                                                    np.setdiff1d(np.concatenate([KEY_POOL, NEVER_PUT]), got.keys))}


class KeyedWorkload(Workload):
    """Saves of keyed table "ids" (puts and deletions), with the model: every key's row at every version."""

    def __init__(self, path: str, rec: cs.RecordingFileSystem, seed: int, policy=None):
        super().__init__(path, rec, seed, policy)
        self.model = {}  # key -> (value row, score, step row): the newest version's live keys
        self.salt = 1

    def start_from(self, content: dict) -> None:
        """Take the model of the base store's newest version from its ``content``."""
        self.content.update(content)
        c = self.content[max(content)][cs.KEYED + KEYED_TABLE]
        self.model = {int(k): (c.values[i], c.columns["score"][i], c.columns["step"][i])
                      for i, k in enumerate(c.keys.tolist())}

    def save(self, puts: int, deletes: int, *, split: bool = False, shared: bool = True) -> int:
        """A save putting ``puts`` keys of KEY_POOL (live ones and new ones) and deleting ``deletes`` live keys
        it does not put; ``split``: the puts in two put_keys calls that share a partition (the version's
        record there merged from both; ``shared=False``: not checked) and the deletions in a third call."""
        keys = np.sort(self.rng.choice(KEY_POOL, size=puts, replace=False))
        live = np.setdiff1d(np.fromiter(self.model, np.int64, len(self.model)), keys)
        gone = np.sort(self.rng.choice(live, size=min(deletes, live.size), replace=False))
        self.salt += 1
        values, columns = _rows(keys, self.salt)

        def write():
            with self.store.checkpoint() as ck:
                if split:
                    first = np.arange(keys.size) % 2 == 0
                    parts = self.store.partition_of(KEYED_TABLE, keys)
                    assert not shared or set(parts[first].tolist()) & set(parts[~first].tolist()), "halves share one"
                    for half in (first, ~first):
                        ck.put_keys(KEYED_TABLE, keys[half], values[half],
                                    columns={n: c[half] for n, c in columns.items()})
                elif keys.size:
                    ck.put_keys(KEYED_TABLE, keys, values, columns=columns)
                if gone.size:
                    ck.delete_keys(KEYED_TABLE, gone)
            return ck.version

        v = self._op("checkpoint", write)
        for i, k in enumerate(keys.tolist()):
            self.model[k] = (values[i], columns["score"][i], columns["step"][i])
        for k in gone.tolist():
            del self.model[k]
        live = np.array(sorted(self.model), np.int64)
        want = cs.KeyedContent(live, np.array([self.model[k][0] for k in live.tolist()], np.float32).reshape(-1, KEYED_DIM),
                               {"score": np.array([self.model[k][1] for k in live.tolist()], np.float32),
                                "step": np.array([self.model[k][2] for k in live.tolist()], np.int64).reshape(-1, 2)},
                               np.setdiff1d(np.concatenate([KEY_POOL, NEVER_PUT]), live))
        self.content[v] = {cs.KEYED + KEYED_TABLE: want}
        cs._check_keyed(self.store, KEYED_TABLE, v, want, f"version {v} as saved")  # the model is right
        return v

    def merged_baselines(self, version: int) -> int:
        """Partitions where save ``version`` wrote a baseline on top of older records (a chain merged)."""
        from cnrstore.engine import record
        tid = self.store.engine.table_record(KEYED_TABLE).id
        with self.store.engine.read() as view:
            entries = [(b, v, loc.flags) for t, b, v, loc in view.row_entries(tid)]
        return sum(1 for b, v, flags in entries if v == version and flags & record.FLAG_BASELINE
                   and not flags & record.FLAG_COMPACTED and any(b2 == b and v2 < v for b2, v2, _f in entries))


def write_more_keyed(store: Store) -> None:
    """After recovery the keyed store takes a new save (put and delete, read back), and gc and compact run."""
    keys = np.array([7, 1 << 41], np.int64)
    values, columns = _rows(keys, 999)
    live = store.keys(KEYED_TABLE)
    with store.checkpoint() as ck:
        ck.put_keys(KEYED_TABLE, keys, values, columns=columns)
        if live.size:
            ck.delete_keys(KEYED_TABLE, live[:1])
    got = store.read_keys(KEYED_TABLE, np.concatenate([keys, live[:1]]))
    assert got.found.tolist() == [True, True] + [False] * min(1, live.size)
    np.testing.assert_array_equal(got.values[:2], values)
    store.gc()
    store.compact()
    store.gc()
