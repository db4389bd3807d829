"""Crash states of a store with a remote tier, enumerated (tests/support/crash_states.py, section 4): checkpoints
that roll, seal and upload segments, copy points after each commit, evictions (cache_bytes=0), retain and gc
(remote deletes after the pointer moved) and the copy point at close, recorded with the object store's
puts and deletes in the same log. Every prefix's state is checked by local recovery against the remote as
of that prefix, and by recovery from the remote alone (exactly the last pointer's versions, bit for bit).
Plus race schedules (tests/support/schedule.py): a seal's upload racing GC's removal, and a reader of a segment
being evicted."""

from __future__ import annotations

import contextlib
import os
import shutil

import numpy as np
import pytest

from cnrstore.engine import filenames
from cnrstore.errors import RemoteStorageError

from support import crash_states as cs
from support.schedule import Pause, run_in_thread

from support.crash_workload import BLOCK, ROWS, TABLES, small_segments, write_more  # noqa: F401 (a fixture)
from support.crash_workload import Workload as LocalWorkload

pytestmark = pytest.mark.usefixtures("single_threaded_torch")


class Workload(LocalWorkload):
    """test_crash_states' workload (support/crash_workload.py) on a store whose segments go to a recording object
    store (cache_bytes=0: every sealed segment is evicted once uploaded)."""

    def __init__(self, path: str, rec: cs.RecordingFileSystem, objects: dict, seed: int, *, every: int = 1,
                 cache_bytes: int = 0, behind: bool = False):  # (not super().__init__: it opens the store without its remote)
        self.rec, self.rng, self.store = rec, np.random.default_rng(seed), None
        self.objects = cs.RecordingObjectStore(rec, self.listed)
        self.objects.objects.update(objects)
        self.store = cs.remote_store(path, self.objects, rec, cache_bytes=cache_bytes, every=every)
        #: copy points in the store's own thread behind the commits (what a Checkpointer asks for): each
        #: checkpoint op then waits for the copy point its commit marked due, so the effects stay in one order
        self.behind = behind and self.store.engine.copy_points_behind()
        self.model = {name: np.full((ROWS, dim), 0.5, np.float32) for name, (dim, _c) in TABLES.items()}
        self.content: dict = {}

    def checkpoint(self, rows_per_table: int) -> int:
        if not self.behind:
            return super().checkpoint(rows_per_table)
        real = self.store.checkpoint

        def checkpoint_then_its_copy_point():
            @contextlib.contextmanager
            def ck():
                with real() as writer:
                    yield writer
                self.store.engine.wait_for_bucket(0.0, "the workload")

            return ck()

        self.store.checkpoint = checkpoint_then_its_copy_point
        try:
            return super().checkpoint(rows_per_table)
        finally:
            del self.store.checkpoint

    def listed(self) -> frozenset:
        return super().listed() if self.store is not None else frozenset()

    def close(self):
        self.rec.op_start("close", self.listed())
        listed = self.listed()
        self.store.close()
        self.rec.op_end(listed)


def make_base(path: str) -> tuple[dict, dict, frozenset]:
    """The store before the workload, with its remote (a copy point made): its objects, content, versions."""
    objects = cs.DictObjectStore()
    store = cs.remote_store(path, objects, create=True, cache_bytes=0)
    with store:
        for name, (dim, codec) in TABLES.items():
            store.create_table(name, ROWS, dim, codec=codec, block_rows=BLOCK)
        with store.checkpoint() as ck:
            for name, (dim, _codec) in TABLES.items():
                ck.put_rows(name, np.arange(ROWS), np.full((ROWS, dim), 0.5, np.float32))
        content = {1: {name: store.read_table(name, version=1) for name in TABLES}}
    return objects.objects, content, frozenset(content)


@pytest.mark.parametrize("every, cache_bytes, behind", [(1, 0, False), (2, 1 << 20, False), (1, 0, True)],
                         ids=["copy-each-commit-evict-all", "copy-every-2nd-cache-all", "copy-points-behind"])
def test_every_crash_state_of_a_remote_workload(ram_tmp_path, every, cache_bytes, behind):
    """Copy points after every commit with every sealed segment evicted (reads go remote); after every
    second commit with everything cached (the writer appends on between copy points: torn appends too); and
    behind the commits, in the store's own thread (engine/uploads.py: each commit seals its segment, the copy
    point uploads it)."""
    base = str(ram_tmp_path / "base")
    objects, content, initial = make_base(base)
    live = str(ram_tmp_path / "live")
    shutil.copytree(base, live)
    with cs.RecordingFileSystem(live) as rec:
        w = Workload(live, rec, objects, seed=3, every=every, cache_bytes=cache_bytes, behind=behind)
        assert w.behind == behind
        w.content.update(content)
        w.checkpoint(60)
        w.checkpoint(200)
        w._op("retain", lambda: w.store.retain(keep_last=2))
        w._op("gc", w.store.gc)
        w.checkpoint(30)  # its copy point deletes the segments GC freed, after the pointer moved
        evicted = w.store.stats()["remote"]["segments_evicted"]
        w.close()
    kinds = [e.kind for e in rec.effects]
    assert kinds.count("put") > 5 and "delete" in kinds  # uploads, and the remote GC after the pointer moved
    assert (evicted > 0) == (cache_bytes == 0)
    work = ram_tmp_path / "states"
    work.mkdir()
    sweep = cs.explore_remote(base, objects, rec.effects, w.content, str(work), write_more, initial=initial,
                              initial_pointer=initial)
    print(f"\nremote workload (every={every}, cache_bytes={cache_bytes}, behind={behind}): {sweep.effects} effects, {sweep.states} crash states checked {sweep.by_variant}")
    assert not sweep.failures, "\n".join(sweep.failures)
    assert sweep.states > 40


# -- races by schedule ------------------------------------------------------------------------------------

class FlakyObjectStore(cs.DictObjectStore):
    """Puts fail while ``failing`` (an endpoint that is down)."""

    failing = False

    def put(self, key, data):
        if self.failing:
            raise RemoteStorageError(f"uploading {self.where(key)} failed (test: endpoint down)")
        super().put(key, data)


def _three_versions(path, objects, failing=False):
    store = cs.remote_store(path, objects, create=True, cache_bytes=0)  # (its creation claims the prefix)
    objects.failing = failing
    store.create_table("f", ROWS, 4, codec="fp32", block_rows=BLOCK)
    content = {}
    for i in range(3):
        _save(store, content, float(i))
    return store, content


def _save(store, content, value):
    rows = np.arange(ROWS)
    with store.checkpoint() as ck:
        ck.put_rows("f", rows, np.full((ROWS, 4), value, np.float32))
    content[ck.version] = np.full((ROWS, 4), value, np.float32)


def test_a_copy_point_upload_racing_gc_removal(tmp_path):
    """A copy point uploading segments whose upload at seal failed, paused mid-way, while retain and GC free
    and try to delete those very segments: GC leaves the local copies the copy point's snapshot needs (it
    reads the index), the upload completes, the remote reads back at that snapshot, and only a later GC and
    copy point delete them (locally, then remotely)."""
    objects = FlakyObjectStore()
    store, content = _three_versions(str(tmp_path / "a"), objects, failing=True)
    with store:
        assert store.stats()["remote"]["last_error"]  # nothing reached the remote
        snapshot_versions = sorted(content)
        old = {s for s in store.engine.storage.list()}
        objects.failing = False
        with Pause("remote_upload") as paused:
            copy = run_in_thread(store.sync_remote)
            paused.wait_reached()  # inside the copy point's index read, before its first upload
            store.retain(keep_last=1)
            report = store.gc()
            assert report.bytes_pending > 0  # freed, but the copy point still reads them: not deleted
            paused.release()
            copy.result()
        uploaded = cs.segment_ids(objects.objects)
        assert old <= uploaded
        with cs.remote_store(str(tmp_path / "fresh"), cs.DictObjectStore(objects.objects), readonly=True) as fresh:
            assert [v.version for v in fresh.versions()] == snapshot_versions
            for v in snapshot_versions:
                np.testing.assert_array_equal(fresh.read_table("f", version=v), content[v])
        store.gc()  # no reader now: the freed local copies go
        store.sync_remote()  # the pointer moves past them: the remote copies go
        remaining = cs.segment_ids(objects.objects)
        assert old - remaining
        np.testing.assert_array_equal(store.read_table("f"), content[max(content)])
        assert not store.verify().problems


def test_a_reader_of_a_segment_being_evicted(tmp_path):
    """A read that resolved a record to a local segment, paused, then finds the local copy evicted: it reads
    the record from the remote instead (never a CorruptionError for a segment the remote holds)."""
    store, content = _three_versions(str(tmp_path / "a"), FlakyObjectStore())
    with store:
        storage = store.engine.storage
        storage.cache_bytes = 1 << 40  # keep local copies for now
        v = max(content)
        _save(store, content, 9.0)  # local copies of the new segments, uploaded whole
        segs = [s for s in storage.list() if os.path.exists(filenames.segment_path(store.path, s))]
        assert segs
        with Pause("remote_read_local") as paused:
            reader = run_in_thread(lambda: store.read_table("f", version=max(content)))
            paused.wait_reached()
            storage.cache_bytes = 0
            storage.sync_cache()  # evicts every uploaded local copy while the reader is paused
            assert not [s for s in segs if os.path.exists(filenames.segment_path(store.path, s))]
            paused.release()
            np.testing.assert_array_equal(reader.result(), content[max(content)])
        np.testing.assert_array_equal(store.read_table("f", version=v), content[v])


def test_a_fetch_beside_an_eviction(tmp_path):
    """A point read of an evicted segment fetches it whole into the cache; an eviction that deletes that very
    copy before the read uses it (cache_bytes lowered meanwhile) never fails the read: it reads the fetched
    bytes. (A whole-table read fetches its records ahead into memory instead: test_remote.py.)"""
    store, content = _three_versions(str(tmp_path / "a"), FlakyObjectStore())
    with store:
        storage = store.engine.storage
        storage.cache_bytes = 1 << 20  # segments are fetched whole (each under a quarter of it)
        assert store.stats()["remote"]["evicted_segments"]  # (cache_bytes=0 until now: all evicted)
        v = min(content)
        with Pause("remote_fetched") as paused:
            reader = run_in_thread(lambda: store.read_rows("f", np.arange(ROWS), version=v))
            paused.wait_reached()  # the segment is in the cache, the read has not used it yet
            storage.cache_bytes = 0
            storage.sync_cache()  # evicts every covered local copy, the one just fetched too
            fetched = [s for s in storage.list() if not os.path.exists(filenames.segment_path(store.path, s))]
            assert fetched
            paused.release()
            np.testing.assert_array_equal(reader.result(), content[v])
        for version, values in content.items():
            np.testing.assert_array_equal(store.read_table("f", version=version), values)


def test_a_readonly_reader_beside_uploads_and_evictions(tmp_path):
    """A readonly store of the writer's directory, opened before the writer's next saves: it resolves a record to
    a local segment the writer has not uploaded yet, pauses, and the writer's copy point uploads and evicts that
    segment; the reader then reads it from the remote (it never lists the remote, never writes the directory)."""
    objects = FlakyObjectStore()
    store, content = _three_versions(str(tmp_path / "a"), objects)
    with store:
        store.engine.storage.cache_bytes = 1 << 40  # the next save's segments stay local for now
        with cs.remote_store(str(tmp_path / "a"), objects, readonly=True) as reader:
            _save(store, content, 7.0)
            v = max(content)
            local = set(os.listdir(filenames.segments_dir(store.path)))
            with Pause("remote_read_local") as paused:
                read = run_in_thread(lambda: reader.read_table("f", version=v))
                paused.wait_reached()
                store.engine.storage.cache_bytes = 0
                store.sync_remote()  # uploads (nothing new) and evicts what the last pointer names
                assert set(os.listdir(filenames.segments_dir(store.path))) < local
                paused.release()
                np.testing.assert_array_equal(read.result(), content[v])
            for version, values in content.items():
                np.testing.assert_array_equal(reader.read_table("f", version=version), values)
            assert reader.verify().ok
        assert not [n for n in os.listdir(filenames.segments_dir(store.path)) if n.endswith(".download")]


def test_a_read_cache_opened_while_another_process_installs_a_newer_snapshot(tmp_path):
    """A read cache opening while another opener of it swaps in the bucket's newest snapshot (paused between
    moving the old index aside and renaming the new one in) waits for the install (the directory's lock),
    then reads the newest versions: never an index that is missing for that instant."""
    objects = FlakyObjectStore()
    store, content = _three_versions(str(tmp_path / "a"), objects)
    with store:
        cs.remote_store(str(tmp_path / "cache"), objects, readonly=True).close()  # a cache at version 3
        _save(store, content, 5.0)
        with Pause("remote_install_swapping") as paused:
            installing = run_in_thread(lambda: cs.remote_store(str(tmp_path / "cache"), objects, readonly=True))
            paused.wait_reached()
            assert not os.path.exists(filenames.index_dir(str(tmp_path / "cache")))
            opening = run_in_thread(lambda: cs.remote_store(str(tmp_path / "cache"), objects, readonly=True))
            paused.release()
            for future in (installing, opening):
                with future.result() as cache:
                    assert [v.version for v in cache.versions()] == sorted(content)
                    np.testing.assert_array_equal(cache.read_table("f"), content[max(content)])


def test_processes_recovering_into_one_directory_at_once_lay_it_out_once(tmp_path):
    objects = FlakyObjectStore()
    store, content = _three_versions(str(tmp_path / "a"), objects)
    store.close()
    with Pause("remote_install_swapping"):  # (not reached: nothing to swap on a first recovery)
        futures = [run_in_thread(lambda: cs.remote_store(str(tmp_path / "cache"), objects, readonly=True))
                   for _ in range(4)]
        caches = [f.result() for f in futures]
    for cache in caches:
        with cache:
            assert [v.version for v in cache.versions()] == sorted(content)
    assert sorted(os.listdir(tmp_path / "cache")) == sorted(["CNRSTORE", "REMOTE", "index", "segments"])


def test_every_crash_state_of_a_read_cache_installing_a_newer_snapshot(ram_tmp_path):
    """A read cache opened again while the bucket moved on (saves, retain, gc) installs the newest snapshot: the
    snapshot and INSTALLED into index.repair-tmp/, READY, the old index moved aside, the new renamed in, stale
    cached segments deleted. Every prefix of those effects, in every crash variant: the cache opened again
    follows the bucket (the newest versions, bit for bit, verify clean), and nothing is left behind."""
    objects = FlakyObjectStore()
    store, content = _three_versions(str(ram_tmp_path / "a"), objects)
    base = str(ram_tmp_path / "base")
    with cs.remote_store(base, objects, readonly=True, cache_bytes=1 << 30) as cache:
        for v in content:
            cache.read_table("f", version=v)  # segments fetched into the cache (some to be dropped as stale)
    with store:
        _save(store, content, 5.0)
        store.retain(keep_last=2)
        store.gc()
        _save(store, content, 6.0)
        content = {v.version: content[v.version] for v in store.versions()}
    live = str(ram_tmp_path / "live")
    shutil.copytree(base, live)
    with cs.RecordingFileSystem(live) as rec:
        cs.remote_store(live, objects, rec, readonly=True).close()
    kinds = [e.kind for e in rec.effects]
    assert "rename" in kinds and "remove" in kinds, kinds  # the swap, and a stale cached segment deleted
    model = cs.FileModel.of_directory(base)
    sweep, seen = cs.Sweep(effects=len(rec.effects)), set()
    work = ram_tmp_path / "states"
    work.mkdir()

    def check(root, _files):
        with cs.remote_store(root, objects, readonly=True) as again:
            assert [v.version for v in again.versions()] == sorted(content)
            for v, values in content.items():
                np.testing.assert_array_equal(again.read_table("f", version=v), values)
            assert again.verify().ok
        assert sorted(os.listdir(root)) == ["CNRSTORE", "REMOTE", "index", "segments"], os.listdir(root)

    for k in range(len(rec.effects) + 1):
        if k:
            model.apply(rec.effects[k - 1])
        assert cs._check_prefix(sweep, seen, str(work), model, ("kill", "power", "torn"), rec.effects, k, None, check, 5)
    print(f"\nread cache install: {sweep.effects} effects, {sweep.states} crash states checked {sweep.by_variant}")
    assert not sweep.failures, "\n".join(sweep.failures)
    assert sweep.states > 5
