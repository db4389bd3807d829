"""Faults of the disk and of the index's resources (issue 11): a full disk or an I/O error during an index
commit, GC on a full disk, a segment file deleted by hand, many threads reading at once, a failed fsync.

Each fault must surface as a typed error saying what to do, leave every committed version reading back
bit for bit, and leave the store usable once the fault is gone.
"""

from __future__ import annotations

import errno
import os
import threading
import time

import lmdb
import numpy as np
import pytest

import cnrstore
from cnrstore import errors, knobs
from cnrstore.engine import filenames, index as index_mod, reader
from cnrstore.engine.fs import FileSystem
from cnrstore.store import Store

DIM = 8


def rand(n, dim=DIM, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, dim)).astype(np.float32)


def state(store) -> dict:
    """Every table at every committed version, as bytes."""
    out = {}
    for info in store.versions():
        for name in store.tables():
            try:
                out[(info.version, name)] = store.read_table(name, version=info.version).tobytes()
            except cnrstore.MissingRows:
                out[(info.version, name)] = None
    return out


class FaultFS(FileSystem):
    """pwritev fails with ENOSPC while ``full``; fsync fails with ``fsync_errno`` while it is set."""

    def __init__(self):
        self.full = False
        self.fsync_errno: int | None = None
        self.faults = 0

    def pwritev(self, fd, buffers, offset):
        if self.full:
            self.faults += 1
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return super().pwritev(fd, buffers, offset)

    def fsync(self, fd):
        if self.fsync_errno is not None:
            self.faults += 1
            raise OSError(self.fsync_errno, os.strerror(self.fsync_errno))
        super().fsync(fd)


class _FailingCommitTxn:
    """A write transaction whose commit fails the way py-lmdb reports a failed LMDB commit."""

    def __init__(self, txn, code: int):
        self._txn = txn
        self._code = code

    def __getattr__(self, name):
        return getattr(self._txn, name)

    def commit(self):
        self._txn.abort()
        exc = (lmdb.DiskError if self._code == errno.ENOSPC else lmdb.Error)(
            f"mdb_txn_commit: {os.strerror(self._code)}")
        exc.code = self._code
        raise exc


def _fail_index_commits(monkeypatch, code: int):
    """Make every index write transaction's commit fail with ``code``; returns a function lifting it."""
    real_begin = index_mod.Index._begin

    def begin(self, write):
        txn = real_begin(self, write)
        return _FailingCommitTxn(txn, code) if write else txn

    monkeypatch.setattr(index_mod.Index, "_begin", begin)
    return lambda: monkeypatch.setattr(index_mod.Index, "_begin", real_begin)


def _two_versions(s):
    s.create_table("emb", 512, DIM, codec="int8", block_rows=64)
    with s.checkpoint(step=1) as ck:
        ck.put_rows("emb", np.arange(512), rand(512, seed=1))
    with s.checkpoint(step=2) as ck:
        ck.put_rows("emb", np.arange(0, 512, 3), rand(171, seed=2))
        ck.put_dense("d", np.arange(5.0))


# 7. a full disk during the index commit -------------------------------------------------------------
@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT, "EIO_full"])
def test_full_disk_during_index_commit_raises_storage_full_and_keeps_store(store_path, monkeypatch, code):
    s = cnrstore.open(store_path, create=True)
    _two_versions(s)
    before = state(s)
    if code == "EIO_full":  # LMDB's EIO from a failed page write, on a file system with no space left
        code = errno.EIO
        monkeypatch.setattr(index_mod, "_free_bytes", lambda path: 0)
    lift = _fail_index_commits(monkeypatch, code)

    with pytest.raises(cnrstore.StorageFull) as ei:
        s.create_table("other", 10, DIM)
    assert "free disk space" in str(ei.value) and ei.value.errno in (errno.ENOSPC, errno.EDQUOT)
    assert "other" not in s.tables()
    with pytest.raises(cnrstore.StorageFull):  # the version-number allocation commits too
        s.checkpoint(step=3)
    lift()
    ck = s.checkpoint(step=3)
    ck.put_rows("emb", [0, 1], rand(2, seed=3))
    _fail_index_commits(monkeypatch, code)
    with pytest.raises(cnrstore.StorageFull):
        ck.commit()
    assert ck.version not in [v.version for v in s.versions()]
    assert state(s) == before

    lift()  # space returns: the same store works on
    s.create_table("other", 10, DIM)
    with s.checkpoint(step=4) as ck4:
        ck4.put_rows("emb", [5], rand(1, seed=4))
    assert {k: v for k, v in state(s).items() if k[1] == "emb" and k[0] != ck4.version} == before
    assert s.verify().ok
    s.close()
    with cnrstore.open(store_path) as s2:
        assert {k: v for k, v in state(s2).items() if k[1] == "emb" and k[0] != ck4.version} == before


def test_io_error_during_index_commit_with_free_space_is_storage_io_error(store_path, monkeypatch):
    s = cnrstore.open(store_path, create=True)
    _two_versions(s)
    before = state(s)
    monkeypatch.setattr(index_mod, "_free_bytes", lambda path: 10 << 30)
    lift = _fail_index_commits(monkeypatch, errno.EIO)
    with pytest.raises(errors.StorageIOError) as ei:
        s.create_table("other", 10, DIM)
    assert not isinstance(ei.value, cnrstore.StorageFull) and isinstance(ei.value, cnrstore.CnrError)
    assert "cnrstore verify" in str(ei.value) and ei.value.errno == errno.EIO
    lift()
    assert state(s) == before
    with s.checkpoint(step=3) as ck:
        ck.put_rows("emb", [0], rand(1, seed=5))
    assert s.verify().ok
    s.close()


def test_real_lmdb_disk_error_is_mapped_by_errno():
    """py-lmdb's own exceptions carry LMDB's return code: the mapping must read it, not the class."""
    idx_err = lmdb.Error("mdb_txn_commit: Input/output error")
    assert index_mod._lmdb_errno(idx_err) == errno.EIO
    assert index_mod._lmdb_errno(lmdb.DiskError("mdb_txn_commit")) == errno.ENOSPC
    assert index_mod._lmdb_errno(lmdb.ReadersFullError("mdb_txn_begin")) is None


# a failed fsync (fsyncgate) -------------------------------------------------------------------------
@pytest.mark.parametrize("code", [errno.EIO, errno.ENOSPC])
def test_failed_fsync_never_commits_the_version_and_is_not_retried(store_path, code):
    fs = FaultFS()
    s = Store(store_path, create=True, readonly=False, filesystem=fs)
    _two_versions(s)
    before = state(s)
    fs.fsync_errno = code
    ck = s.checkpoint(step=3)
    ck.put_rows("emb", np.arange(512), rand(512, seed=6))
    expected = errors.StorageIOError if code == errno.EIO else cnrstore.StorageFull
    with pytest.raises(expected) as ei:
        ck.commit()
    assert ei.value.errno == code
    fs.fsync_errno = None
    faults = fs.faults
    with pytest.raises(cnrstore.CnrError, match="failed earlier"):  # never "retried" into a commit
        ck.commit()
    assert fs.faults == faults
    assert ck.version not in [v.version for v in s.versions()] and state(s) == before
    with s.checkpoint(step=4) as ck4:
        ck4.put_rows("emb", [3], rand(1, seed=7))
    assert s.verify().ok
    s.close()


# 10. many threads reading at once --------------------------------------------------------------------
def test_many_threads_reading_at_once_never_exhaust_reader_slots(store_path, monkeypatch):
    monkeypatch.setattr(knobs, "INDEX_MAX_READERS", 4)
    s = cnrstore.open(store_path, create=True)
    _two_versions(s)
    expected = s.read_rows("emb", np.arange(10), version=1)
    real = reader.read_rows

    def slow_read_rows(*args, **kwargs):
        time.sleep(0.01)  # inside the read transaction: the 16 threads' reads overlap
        return real(*args, **kwargs)

    monkeypatch.setattr(reader, "read_rows", slow_read_rows)
    failures, results = [], []

    def work():
        try:
            for _ in range(3):
                results.append(s.read_rows("emb", np.arange(10), version=1))
        except BaseException as exc:  # noqa: BLE001 - collected and asserted below
            failures.append(exc)

    threads = [threading.Thread(target=work) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []
    assert len(results) == 48 and all(r.tobytes() == expected.tobytes() for r in results)
    s.close()


def test_reader_slots_held_elsewhere_are_waited_for(store_path, monkeypatch):
    """MDB_READERS_FULL (slots held by other processes) is retried with backoff, not raised."""
    s = cnrstore.open(store_path, create=True)
    _two_versions(s)
    real_begin = lmdb.Environment.begin
    calls = {"n": 0}

    class Env:
        def __init__(self, env):
            self._env = env

        def __getattr__(self, name):
            return getattr(self._env, name)

        def begin(self, write=False, buffers=False):
            calls["n"] += 1
            if not write and calls["n"] <= 3:
                raise lmdb.ReadersFullError("mdb_txn_begin")
            return self._env.begin(write=write, buffers=buffers)

    s.engine._index._env = Env(s.engine._index._env)
    assert s.read_rows("emb", [0], version=1).shape == (1, DIM)
    assert calls["n"] == 4
    monkeypatch.setattr(index_mod, "_READER_WAIT_S", 0.05)
    s.engine._index._env = Env(s.engine._index._env._env)
    calls["n"] = -10**9  # always full now
    with pytest.raises(errors.IndexBusy, match="fewer threads"):
        s.read_rows("emb", [0], version=1)
    s.engine._index._env = s.engine._index._env._env
    assert real_begin is lmdb.Environment.begin
    s.close()


# 8. a segment file deleted by hand --------------------------------------------------------------------
def _newest_segment(store_path) -> str:
    seg_dir = filenames.segments_dir(store_path)
    return os.path.join(seg_dir, max(n for n in os.listdir(seg_dir) if filenames.parse_segment_name(n) is not None))


@pytest.mark.parametrize("while_open", [False, True])
def test_deleted_segment_file_fails_its_reads_but_not_later_checkpoints(store_path, while_open):
    s = cnrstore.open(store_path, create=True)
    s.create_table("emb", 512, DIM, codec="int8", block_rows=64)
    with s.checkpoint(step=1) as ck:
        ck.put_rows("emb", np.arange(512), rand(512, seed=1))
    if not while_open:
        s.close()
    os.remove(_newest_segment(store_path))  # the only segment: version 1's records are gone
    if not while_open:
        s = cnrstore.open(store_path)  # the writable open must not crash on it
    for attempt in range(3):  # not once, and not forever: every later checkpoint works
        new = rand(512, seed=10 + attempt)
        with s.checkpoint(step=2 + attempt) as ck:
            ck.put_rows("emb", np.arange(512), new)
        assert s.read_rows("emb", np.arange(512), version=ck.version).tobytes() == \
            s.read_table("emb", version=ck.version).tobytes()
    assert any("missing" in note for note in s.engine._appender.notes)
    last = ck.version
    last_read = s.read_table("emb", version=last).tobytes()
    s.close()
    with cnrstore.open(store_path) as s2:
        with pytest.raises(cnrstore.CorruptionError, match="missing"):
            s2.read_table("emb", version=1)
        report = s2.verify()
        assert not report.ok and any("missing" in p for p in report.problems)
        assert s2.read_table("emb", version=last).tobytes() == last_read
        with s2.checkpoint(step=9) as ck:
            ck.put_rows("emb", [0], rand(1, seed=99))


def test_segment_deleted_during_a_checkpoint_aborts_it_once(store_path):
    s = cnrstore.open(store_path, create=True)
    s.create_table("emb", 512, DIM, codec="int8", block_rows=64)
    with s.checkpoint(step=1) as ck:
        ck.put_rows("emb", np.arange(512), rand(512, seed=1))
    ck = s.checkpoint(step=2)
    ck.put_rows("emb", np.arange(64), rand(64, seed=2))
    os.remove(_newest_segment(store_path))  # the file this checkpoint is appending to
    with pytest.raises(cnrstore.CorruptionError, match="retry") as ei:
        ck.commit()
    assert "cnrstore verify" in str(ei.value)
    assert [v.version for v in s.versions()] == [1]
    with s.checkpoint(step=3) as ck3:  # the retry goes to a new segment
        ck3.put_rows("emb", np.arange(64), rand(64, seed=3))
    s.close()
    with cnrstore.open(store_path) as s2:
        assert s2.read_rows("emb", np.arange(64), version=ck3.version).shape == (64, DIM)
        with pytest.raises(cnrstore.CorruptionError):
            s2.read_table("emb", version=1)


# 6. gc on a full disk -------------------------------------------------------------------------------
def _gc_layout(s):
    """Versions whose retention leaves wholly dead segments and one under-full (1/4 live) segment."""
    s.create_table("emb", 512, DIM, codec="int8", block_rows=64)
    with s.checkpoint(step=1) as ck:
        ck.put_rows("emb", np.arange(256), rand(256, seed=1))  # blocks 0-3: a segment of its own
        ck.put_rows("emb", np.arange(256, 512), rand(256, seed=2))  # blocks 4-7
    with s.checkpoint(step=2) as ck:
        ck.put_rows("emb", np.arange(256), rand(256, seed=3))
        ck.put_rows("emb", np.arange(256, 448), rand(192, seed=4))  # blocks 4-6: block 7 stays live
    with s.checkpoint(step=3) as ck:
        ck.put_dense("d", np.arange(7.0))
    s.retain(keep_last=1)


def _segment_census(s):
    """(wholly dead segments, under-full segments) as GC will see them."""
    with s.engine.read() as view:
        committed = view.segments()
        live = {}
        for *_k, loc in view.row_entries():
            live[loc.segment] = live.get(loc.segment, 0) + loc.length
        for *_k, loc in view.dense_entries():
            live[loc.segment] = live.get(loc.segment, 0) + loc.length
        for *_k, loc in view.log_entries():  # COMMIT / ANCHOR / DROP records repair needs
            live[loc.segment] = live.get(loc.segment, 0) + loc.length
    busy = s.engine._appender.busy() | {s.engine._compaction_appender.active}
    dead = [g for g in committed if g not in busy and not live.get(g)]
    under = [g for g in committed if g not in busy and live.get(g) and
             live[g] / (committed[g] - 32) < knobs.GC_LIVE_FRACTION]
    return dead, under


def test_gc_on_full_disk_reclaims_dead_segments_and_finishes_later(store_path, monkeypatch):
    monkeypatch.setattr(knobs, "SEGMENT_BYTES", 1024)
    fs = FaultFS()
    s = Store(store_path, create=True, readonly=False, filesystem=fs)
    _gc_layout(s)
    before = state(s)
    dense = s.read_dense("d").tobytes()
    dead, under = _segment_census(s)
    assert len(dead) >= 1 and len(under) == 1, (dead, under)
    dead_bytes = sum(os.path.getsize(filenames.segment_path(store_path, g)) for g in dead)

    fs.full = True
    report = s.gc()
    assert fs.faults >= 1
    assert report.segments_deleted == len(dead) and report.bytes_reclaimed == dead_bytes
    assert report.segments_rewritten == 0 and report.bytes_copied == 0
    assert report.incomplete and "free disk space" in report.incomplete and "gc again" in report.incomplete
    assert not any(os.path.exists(filenames.segment_path(store_path, g)) for g in dead)
    assert state(s) == before and s.read_dense("d").tobytes() == dense
    assert s.verify().ok

    fs.full = False  # space returns: a second gc finishes the job
    report = s.gc()
    assert report.incomplete is None
    # the under-full segment, and any other the space bound (knobs.GC_SPACE_BOUND) makes worth cleaning
    assert report.segments_rewritten >= 1 and report.bytes_copied > 0
    assert report.segments_deleted == report.segments_rewritten
    assert _segment_census(s) == ([], [])
    assert state(s) == before and s.read_dense("d").tobytes() == dense
    assert s.verify().ok
    s.close()
    with cnrstore.open(store_path, readonly=True) as s2:
        assert state(s2) == before


def test_gc_when_even_the_index_is_full_raises_storage_full_and_changes_nothing(store_path, monkeypatch):
    monkeypatch.setattr(knobs, "SEGMENT_BYTES", 1024)
    s = cnrstore.open(store_path, create=True)
    _gc_layout(s)
    before = state(s)
    files = sorted(os.listdir(filenames.segments_dir(store_path)))
    lift = _fail_index_commits(monkeypatch, errno.ENOSPC)
    with pytest.raises(cnrstore.StorageFull, match="free disk space"):
        s.gc()
    lift()
    assert sorted(os.listdir(filenames.segments_dir(store_path))) == files
    assert state(s) == before
    report = s.gc()
    assert report.incomplete is None and report.segments_deleted >= 2 and state(s) == before  # dead + rewritten
    s.close()


def test_full_disk_while_writing_the_marker_at_create_is_storage_full_and_create_can_retry(store_path):
    fs = FaultFS()
    fs.full = True
    with pytest.raises(cnrstore.StorageFull, match="free disk space"):
        Store(store_path, create=True, readonly=False, filesystem=fs)
    with pytest.raises(cnrstore.StoreNotFound):  # no marker: no store, half-made or not
        cnrstore.open(store_path)
    fs.full = False
    s = Store(store_path, create=True, readonly=False, filesystem=fs)
    _two_versions(s)
    assert s.verify().ok
    s.close()


@pytest.mark.parametrize("op", ["compact", "retain"])
@pytest.mark.parametrize("where", ["segment", "index"])
def test_full_disk_during_compact_or_retain_is_storage_full_and_changes_nothing(store_path, monkeypatch, op, where):
    fs = FaultFS()
    s = Store(store_path, create=True, readonly=False, filesystem=fs)
    _two_versions(s)
    with s.checkpoint(step=3) as ck:
        ck.put_rows("emb", np.arange(1, 512, 2), rand(256, seed=8))
    before = state(s)
    files = sorted(os.listdir(filenames.segments_dir(store_path)))
    if where == "segment":
        fs.full = True
        lift = lambda: setattr(fs, "full", False)  # noqa: E731
    else:
        lift = _fail_index_commits(monkeypatch, errno.ENOSPC)
    with pytest.raises(cnrstore.StorageFull, match="free disk space"):
        s.compact() if op == "compact" else s.retain(keep_last=1)
    lift()
    assert state(s) == before and sorted(os.listdir(filenames.segments_dir(store_path))) == files
    assert s.stats()["max_read_chain"] > 1  # nothing was materialized
    latest = s.latest().version
    if op == "compact":  # space returns: it works
        assert s.compact().blocks_materialized > 0
    else:
        assert s.retain(keep_last=1) and [v.version for v in s.versions()] == [latest]
    assert {k: v for k, v in state(s).items()} == {k: v for k, v in before.items() if op == "compact" or k[0] == latest}
    assert s.verify().ok
    s.close()


def test_full_disk_when_gc_records_deleted_segments_loses_nothing(store_path, monkeypatch):
    """The files are deleted first, then the index forgets them: if that commit hits a full disk, the
    space is free all the same, the report says the rest is pending, and the next gc records it."""
    monkeypatch.setattr(knobs, "SEGMENT_BYTES", 1024)
    s = cnrstore.open(store_path, create=True)
    _gc_layout(s)
    before = state(s)
    dead, _under = _segment_census(s)
    real_begin = index_mod.Index._begin
    writes = {"n": 0}

    def begin(self, write):
        txn = real_begin(self, write)
        if write:
            writes["n"] += 1
            if writes["n"] >= 2:  # 1: free the dead segments; then every commit fails
                return _FailingCommitTxn(txn, errno.ENOSPC)
        return txn

    monkeypatch.setattr(index_mod.Index, "_begin", begin)
    report = s.gc()
    monkeypatch.setattr(index_mod.Index, "_begin", real_begin)
    assert report.segments_deleted >= len(dead) and report.incomplete and "gc again" in report.incomplete
    assert not any(os.path.exists(filenames.segment_path(store_path, g)) for g in dead)
    with s.engine.read() as view:
        assert set(dead) <= {int(k) for k in view.meta("doomed_segments", {})}  # ids stay reserved
    assert state(s) == before and s.verify().ok
    report = s.gc()
    assert report.incomplete is None
    with s.engine.read() as view:
        assert view.meta("doomed_segments", {}) == {} and view.meta("max_deleted_segment") >= max(dead)
    s.close()
    with cnrstore.open(store_path) as s2:
        assert state(s2) == before and s2.verify().ok


def test_cli_gc_stopped_by_a_full_disk_says_so_and_exits_2(store_path, monkeypatch, capsys):
    """`cnrstore gc` prints what it reclaimed, then the unfinished part on stderr, and exits 2."""
    from cnrstore import cli
    from cnrstore.maintenance import compaction

    with cnrstore.open(store_path, create=True) as s:
        s.create_table("t", 64, DIM, codec="fp32")
        with s.checkpoint() as ck:
            ck.put_rows("t", np.arange(64), rand(64))

    def stopped(store, progress=None):
        return compaction.GCReport(bytes_reclaimed=4096, segments_deleted=1,
                                   incomplete="1 of 1 under-full segments were not rewritten (no space); "
                                              "free disk space and run gc again to reclaim them")

    monkeypatch.setattr(compaction, "collect", stopped)
    assert cli.main(["gc", store_path]) == 2
    out, err = capsys.readouterr()
    assert "reclaimed 4,096 bytes" in out
    assert "incomplete" in err and "run gc again" in err and "Traceback" not in err


def test_background_gc_stopped_by_a_full_disk_is_a_surfaced_compaction_failure(store_path, monkeypatch):
    """A background gc that a full disk stopped part way counts as a failed step (StorageFull), so the
    trainer sees it through compaction_error / stats() and close(), and checkpoints keep working."""
    from cnrstore.maintenance import compaction
    from cnrstore.policy import CompactionPolicy, KeepLast, MaxChain, Retention

    monkeypatch.setattr(compaction, "collect",
                        lambda store, progress=None: compaction.GCReport(incomplete="free disk space and run gc again"))
    store = cnrstore.open(store_path, create=True,
                          compaction=CompactionPolicy(materialize=MaxChain(2), retention=Retention(KeepLast(2))))
    store.create_table("t", 64, DIM, codec="fp32", block_rows=64)
    for i in range(4):
        with store.checkpoint() as ck:
            ck.put_rows("t", np.arange(i, 64, 4), rand(16, seed=i))
        store._compactor.wait_idle(30)
    assert isinstance(store.compaction_error, cnrstore.StorageFull)
    assert "run gc again" in str(store.compaction_error) and store.stats()["compaction_errors"] >= 1
    with pytest.raises(cnrstore.CompactionFailed):
        store.close()
