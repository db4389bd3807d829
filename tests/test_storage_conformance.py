"""The segment storage seam's conformance suite (tests/support/storage_conformance.py, ``StorageTests``) run
against each implementation: the local files, the object-store tier (engine/remote.py) on the session's moto
endpoint with every sealed segment uploaded and its local copy evicted, a recording stand-in that delegates to
the local files, and a storage without appends. Then: the engine reaches segments only through the seam (a
store whose storage records every call), and each test of the suite fails against a storage that breaks the
rule it states."""

from __future__ import annotations

import contextlib
import os
import time

import numpy as np
import pytest

import cnrstore
from cnrstore.engine import filenames, fs
from cnrstore.engine.storage import LocalSegmentStorage, SegmentStorage
from cnrstore.errors import CorruptionError
from cnrstore.store import Store

from support.s3_remote import s3_options
from support.recording_storage import NOT_IN_SEAM, SEAM, RecordingStorage
from support.storage_conformance import StorageTests, payloads


@pytest.fixture
def root(tmp_path):
    """A directory with an empty segments/ (what a store's storage reads and appends to)."""
    path = str(tmp_path / "store")
    os.mkdir(path)
    LocalSegmentStorage.create(path)
    return path


class TestLocalSegmentStorage(StorageTests):
    @pytest.fixture
    def storage(self, root):
        local = LocalSegmentStorage(root)
        yield local
        local.close()


class TestRemoteSegmentStorage(StorageTests):
    """A writer's storage of a store on moto (cache_bytes=0): ``committed`` records the segments in the store's
    index and makes a copy point, which uploads them and evicts their local copies, so the suite's reads of
    committed segments go to the object store."""

    @pytest.fixture
    def storage(self, tmp_path, s3_endpoint, s3_bucket):
        store = cnrstore.open(str(tmp_path / "store"), create=True, remote=f"s3://{s3_bucket}/ckpt",
                              remote_options=s3_options(s3_endpoint), cache_bytes=0)
        self.index = store.engine._index  # (the suite records segments in the store's index)
        yield store.engine.storage
        store.close()

    def committed(self, storage, lengths):
        def record(w):
            for seg, length in lengths.items():
                w.put_segment(seg, length)
        self.index.write(record)
        storage.copy_point()
        assert storage.last_error is None
        for seg in lengths:  # evicted: every read of these goes to the object store
            assert not os.path.exists(filenames.segment_path(storage.root, seg)), seg
            assert storage.path(seg).startswith("s3://"), storage.path(seg)

    def removal_pending(self, storage, seg):
        """``removes_at_once`` is False: the local copy is gone at once; the object stays (and is served)
        until a later copy point (test_a_removed_segment_is_gone_after_the_next_copy_point)."""
        assert not os.path.exists(filenames.segment_path(storage.root, seg))
        assert storage.size(seg) is not None and seg in storage.list()

    def local_bytes(self, storage, written, sizes):
        return sum(os.path.getsize(filenames.segment_path(storage.root, seg)) for seg in written
                   if os.path.exists(filenames.segment_path(storage.root, seg)))

    def test_a_removed_segment_is_gone_after_the_next_copy_point(self, storage):
        """The remote tier's own rule for removal: once the index no longer names the segment (GC dropped
        it), the next copy point deletes its object; then it is gone and removing it again raises."""
        written = self.write(storage, [payloads(9, [80]), payloads(10, [90])])
        gone, kept = sorted(written)
        storage.remove(gone)
        storage.sync_removals()
        self.index.write(lambda w: w.delete_segment(gone))
        storage.copy_point()
        assert storage.size(gone) is None and storage.list() == [kept]
        with pytest.raises(CorruptionError):
            storage.read(gone, 0, 32)
        with pytest.raises(FileNotFoundError):
            storage.remove(gone)
        off, payload = written[kept][0]
        assert storage.read(kept, off, len(payload)).tobytes() == payload


class TestRecordingStorage(StorageTests):
    """The recording stand-in over the local files: it passes what they pass, and calls nothing else."""

    @pytest.fixture
    def storage(self, root):
        recording = RecordingStorage(LocalSegmentStorage(root))
        yield recording
        recording.close()
        assert recording.calls and recording.names() <= SEAM


class TestStorageWithoutAppends(StorageTests):
    """A storage without appends (a reader of segments another storage wrote): appender raises ReadOnlyError,
    the rest of the contract holds."""

    @pytest.fixture
    def storage(self, root):
        readonly = RecordingStorage(LocalSegmentStorage(root), appends=False)
        yield readonly
        readonly.close()

    def writer(self, storage):
        return storage.inner


# -- the engine goes through the seam -----------------------------------------------------------------

def test_a_store_reaches_its_segments_only_through_the_seam(tmp_path, monkeypatch):
    """Checkpoints (rolling over segments), reads, retain, gc, verify, stats and close of a store whose storage
    records every call: each is a method of the seam, the engine never asks for anything else of it, and
    what it did shows in the calls (segments sealed, read, removed)."""
    assert {"read", "path", "size", "list", "remove", "appender", "recover", "sealed", "supports_appends"} <= SEAM
    assert SEAM - {"supports_appends", "removes_at_once"} <= set(vars(RecordingStorage)), \
        "the stand-in delegates every method"
    monkeypatch.setattr(cnrstore.knobs, "SEGMENT_BYTES", 2048)  # appenders roll over: segments are sealed
    path = str(tmp_path / "s")
    cnrstore.open(path, create=True).close()
    recording = RecordingStorage(LocalSegmentStorage(path))
    store = Store(path, create=False, readonly=False, filesystem=fs.DEFAULT, storage=recording)
    try:
        store.create_table("t", 256, 4, codec="fp32", block_rows=64)
        for v in range(4):
            rows = np.arange(256) if v == 0 else np.arange(v, 256, 7)
            with store.checkpoint() as ck:
                ck.put_rows("t", rows, np.full((len(rows), 4), v, np.float32))
        assert store.read_table("t")[3, 0] == 3.0
        store.retain(keep_last=1)
        report = store.gc()
        assert store.verify().ok
        store.stats()
    finally:
        store.close()
    names = recording.names()
    assert NOT_IN_SEAM not in names, [c for c in recording.calls if c[0] == NOT_IN_SEAM]
    assert names <= SEAM
    assert {"check_writable", "recover", "segment_ids_from", "appender", "sealed", "read", "size", "remove",
            "sync_removals", "disk_bytes", "close"} <= names, sorted(names)
    assert not names & {"attach", "after_commit", "before_checkpoint", "flush", "copy_point"}, \
        "copy points are the replicator's (replication.py), not the storage's"
    removed = [c[1][0] for c in recording.calls if c[0] == "remove"]
    assert report.segments_deleted == len(removed) > 0
    assert not any(os.path.exists(filenames.segment_path(path, seg)) for seg in removed)


# -- each test of the suite can fail ------------------------------------------------------------------

class _Broken(RecordingStorage):
    """The recording stand-in over the local files, with one rule of the seam broken (``how``)."""

    def __init__(self, root, how):
        super().__init__(LocalSegmentStorage(root))
        self.how = how

    def read(self, seg, offset, length):
        if self.how == "read-wrong-bytes":
            return np.zeros(length, np.uint8)
        if self.how == "read-missing-quietly":
            with contextlib.suppress(cnrstore.CorruptionError):
                return super().read(seg, offset, length)
            return np.zeros(length, np.uint8)
        if self.how == "release-drops-bytes" and (seg, offset) in getattr(self, "dropped", ()):
            return np.zeros(length, np.uint8)  # (what dropping the pages of a private copy would give)
        if self.how == "read-racy":  # one shared request slot: another thread's request may replace it
            self.slot = (seg, offset, length)
            time.sleep(0.0005)
            return super().read(*self.slot)
        return super().read(seg, offset, length)

    def release(self, ranges):
        super().release(ranges)
        if self.how == "release-drops-bytes":
            self.dropped = getattr(self, "dropped", set()) | {(r[0], r[1]) for r in ranges}

    def size(self, seg):
        got = super().size(seg)
        return 0 if self.how == "size-zero-when-missing" and got is None else got

    def list(self):
        got = super().list()
        return got[::-1] if self.how == "list-descending" else got

    def remove(self, seg):
        if self.how == "remove-nothing":
            return None
        if self.how == "remove-quietly":
            with contextlib.suppress(FileNotFoundError):
                return super().remove(seg)
            return None
        return super().remove(seg)

    def appender(self, committed, format_version, ids, **kwargs):
        app = super().appender(committed, format_version, ids, **kwargs)
        if self.how == "rollback-nothing":
            app.rollback = lambda: None
        return app

    def recover(self, committed, doomed=(), **kwargs):
        return ["did nothing"] if self.how == "recover-nothing" else super().recover(committed, doomed, **kwargs)

    @contextlib.contextmanager
    def scan(self, seg):
        with super().scan(seg) as data:
            yield data[:-1] if self.how == "scan-short" else data

    def disk_bytes(self):
        return 0 if self.how == "disk-bytes-zero" else super().disk_bytes()

    def path(self, seg):
        return "segment" if self.how == "path-anonymous" else super().path(seg)

    @contextlib.contextmanager
    def prefetch(self, ranges, *, bounded):
        if self.how != "prefetch-stale-bytes":
            with super().prefetch(ranges, bounded=bounded):
                yield
            return
        stale = {(r.segment, r.offset): np.zeros(r.length, np.uint8) for r in ranges}  # served, never fetched
        real, self.read = self.read, lambda seg, off, n: stale.get((seg, off), real(seg, off, n))
        try:
            yield
        finally:
            self.read = real


class _NoAppendsClaimed(_Broken):
    """Says it takes no appends, yet hands out an appender."""

    def appender(self, committed, format_version, ids, **kwargs):
        return self.inner.appender(committed, format_version, ids, **kwargs)


BREAKS = {
    "test_appended_bytes_read_back_exactly": "read-wrong-bytes",
    "test_read_of_a_missing_segment_raises_corruption_error": "read-missing-quietly",
    "test_read_past_the_end_raises_corruption_error": "read-missing-quietly",
    "test_size_is_none_for_a_missing_segment_and_the_stored_length_otherwise": "size-zero-when-missing",
    "test_list_is_ascending_and_exactly_the_stored_ids": "list-descending",
    "test_remove_then_sync_removals_makes_it_gone": "remove-nothing",
    "test_removing_a_segment_again_raises_file_not_found": "remove-quietly",
    "test_rollback_throws_away_uncommitted_appends": "rollback-nothing",
    "test_recover_truncates_a_torn_tail_past_the_committed_length": "recover-nothing",
    "test_scan_yields_the_whole_segment": "scan-short",
    "test_disk_bytes_is_at_least_the_stored_sizes": "disk-bytes-zero",
    "test_path_names_the_segment": "path-anonymous",
    "test_concurrent_reads_of_different_ranges_give_the_right_bytes": "read-racy",
    "test_appender_is_given_exactly_when_appends_are_supported": "claims-no-appends",
    "test_prefetched_reads_give_the_bytes_of_plain_reads": "prefetch-stale-bytes",
    "test_released_ranges_stay_readable": "release-drops-bytes",
}


def test_every_test_of_the_suite_is_broken_by_some_storage():
    tests = {name for name in vars(StorageTests) if name.startswith("test_")}
    assert tests == set(BREAKS), "each test of the suite has a storage that breaks it"


@pytest.mark.parametrize("name", sorted(BREAKS))
def test_each_test_of_the_suite_fails_against_a_storage_that_breaks_its_rule(name, root):
    how = BREAKS[name]
    broken = _NoAppendsClaimed(root, how) if how == "claims-no-appends" else _Broken(root, how)
    if how == "claims-no-appends":
        broken.supports_appends = False
    suite = StorageTests()
    try:
        with pytest.raises((AssertionError, pytest.fail.Exception)):
            getattr(suite, name)(broken)
    finally:
        broken.close()


def test_the_seam_s_abstract_methods_are_the_ones_every_storage_must_give():
    assert SegmentStorage.__abstractmethods__ == {"read", "path", "size", "list", "remove"}
