"""The single-writer lock and store creation under faults (issue 11, items 2 and 9).

The lock is a flock on the store directory, so deleting or replacing LOCK (which only carries the pid)
cannot let a second writer in; concurrent ``open(create=True)`` calls create the store once; a creation
killed before its marker leaves a directory that the next ``create=True`` finishes; a store whose
directory is renamed while open refuses to commit (StoreMoved) instead of writing to the old path.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import cnrstore
from cnrstore.engine import filenames

_TRY_WRITE = """
    import json, sys, cnrstore
    out = {}
    try:
        s = cnrstore.open(sys.argv[1])
    except cnrstore.StoreLocked as e:
        out = {"outcome": "locked", "pid": e.pid, "message": str(e)}
    else:
        with s.checkpoint(step=99) as ck:
            ck.put_rows("emb", [0], [[42.0] * 4])
        out = {"outcome": "opened", "committed": ck.version}
        s.close()
    with cnrstore.open(sys.argv[1], readonly=True) as s:  # readonly opens never conflict
        out["readonly_versions"] = [v.version for v in s.versions()]
    print(json.dumps(out))
"""


def _python(code: str, *args, env=None, timeout=120) -> subprocess.CompletedProcess:
    full = dict(os.environ)
    full.pop(cnrstore.engine.fs.CRASH_ENV, None)
    full.update(env or {})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, env=full)


def _json(proc: subprocess.CompletedProcess):
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _values(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((10, 4)).astype(np.float32)


def _writer_with_one_version(path):
    s = cnrstore.open(path, create=True)
    s.create_table("emb", 10, 4, codec="fp32", block_rows=64)
    with s.checkpoint(step=1) as ck:
        ck.put_rows("emb", np.arange(10), _values(1))
    return s, ck.version


# item 2: LOCK deleted under a writer ----------------------------------------------------------------
@pytest.mark.parametrize("replace", [False, True], ids=["deleted", "replaced"])
def test_deleted_lock_file_does_not_let_a_second_writer_in(store_path, replace):
    s, v1 = _writer_with_one_version(store_path)
    try:
        os.remove(filenames.lock_path(store_path))
        if replace:  # a new LOCK with a wrong pid in it: the holder is still found (in /proc/locks)
            with open(filenames.lock_path(store_path), "w") as f:
                f.write("1\n")
        out = _json(_python(_TRY_WRITE, store_path))
        assert out["outcome"] == "locked", out
        assert out["pid"] == os.getpid() and str(os.getpid()) in out["message"]
        assert out["readonly_versions"] == [v1]
        with pytest.raises(cnrstore.StoreLocked) as ei:  # and in this process too
            cnrstore.open(store_path)
        assert ei.value.pid == os.getpid()
        with pytest.raises(cnrstore.StoreLocked):
            cnrstore.open(store_path, create=True)
        with cnrstore.open(store_path, readonly=True) as r:  # readonly is unaffected
            assert r.read_table("emb").tobytes() == _values(1).tobytes()
        # the first writer goes on writing, and nothing it acknowledged is lost
        with s.checkpoint(step=2) as ck:
            ck.put_rows("emb", np.arange(5), _values(2)[:5])
        v2 = ck.version
    finally:
        s.close()
    with cnrstore.open(store_path) as s:
        assert [v.version for v in s.versions()] == [v1, v2]
        assert s.read_table("emb", version=v1).tobytes() == _values(1).tobytes()
        want = _values(1)
        want[:5] = _values(2)[:5]
        assert s.read_table("emb", version=v2).tobytes() == want.tobytes()
        assert s.verify().ok  # (and this process could open it for writing again once it was closed)


def test_readonly_open_of_a_store_without_lock_file(store_path):
    s, v1 = _writer_with_one_version(store_path)
    s.close()
    os.remove(filenames.lock_path(store_path))
    with cnrstore.open(store_path, readonly=True) as r:
        assert [v.version for v in r.versions()] == [v1]
        assert r.read_table("emb").tobytes() == _values(1).tobytes()
    assert not os.path.exists(filenames.lock_path(store_path)), "a readonly open must not create LOCK"
    with cnrstore.open(store_path) as s:  # a writer makes a new one
        assert open(filenames.lock_path(store_path)).read().strip() == str(os.getpid())


def test_writer_of_older_cnrstore_holding_only_the_lock_file_keeps_writers_out(store_path):
    _writer_with_one_version(store_path)[0].close()
    fd = os.open(filenames.lock_path(store_path), os.O_RDWR)  # what an older cnrstore writer holds
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.pwrite(fd, b"4242\n", 0)
        with pytest.raises(cnrstore.StoreLocked) as ei:
            cnrstore.open(store_path)
        assert ei.value.pid == 4242
    finally:
        os.close(fd)
    cnrstore.open(store_path).close()  # neither lock leaked from the refused open


def test_store_directory_renamed_while_writing_refuses_commit_with_store_moved(tmp_path):
    old, new = str(tmp_path / "a"), str(tmp_path / "b")
    s, v1 = _writer_with_one_version(old)
    try:
        os.rename(old, new)
        with cnrstore.open(old, create=True) as other:  # another store now lives at the old path, with
            other.create_table("x", 1000, 4, codec="fp32")  # segment files of the same ids, and longer
            with other.checkpoint() as ck:
                ck.put_rows("x", np.arange(1000), np.ones((1000, 4)))
        with pytest.raises(cnrstore.errors.StoreMoved) as ei:
            with s.checkpoint(step=2) as ck:
                ck.put_rows("emb", np.arange(10), _values(2))
        assert old in str(ei.value) and new in str(ei.value) and "reopen" in str(ei.value)
        for write in (s.gc, s.compact, lambda: s.create_table("y", 4, 2), lambda: s.checkpoint()):
            with pytest.raises(cnrstore.errors.StoreMoved):  # nor does any other write touch the old path
                write()
        assert s.read_table("emb").tobytes() == _values(1).tobytes()  # reads go on
    finally:
        s.close()
    with cnrstore.open(new) as s:  # the moved store keeps its versions and took nothing of the failed one
        assert [v.version for v in s.versions()] == [v1]
        assert s.read_table("emb").tobytes() == _values(1).tobytes()
        assert s.verify().ok
    with cnrstore.open(old) as other:  # and the store at the old path was not touched (nor truncated)
        assert len(other.versions()) == 1 and list(other.tables()) == ["x"]
        assert other.verify().ok and other.read_table("x").tolist() == np.ones((1000, 4)).tolist()


def test_marker_deleted_while_open_is_restored_by_create_and_keeps_versions(store_path, monkeypatch):
    s, v1 = _writer_with_one_version(store_path)
    os.remove(filenames.marker_path(store_path))
    with s.checkpoint(step=2) as ck:  # the open writer is unaffected
        ck.put_rows("emb", [0], _values(2)[:1])
    # a creator finds it held with no marker: it waits (briefly here) as for a creation, then is locked out
    monkeypatch.setattr(cnrstore.store, "CREATE_WAIT_S", 0.2)
    with pytest.raises(cnrstore.StoreLocked) as ei:
        cnrstore.open(store_path, create=True)
    assert ei.value.pid == os.getpid()
    s.close()
    with pytest.raises(cnrstore.StoreNotFound) as ei:
        cnrstore.open(store_path)
    assert "create=True" in str(ei.value) and "kept" in str(ei.value)
    with cnrstore.open(store_path, create=True) as s:
        assert [v.version for v in s.versions()] == [v1, ck.version]
        assert s.read_table("emb", version=v1).tobytes() == _values(1).tobytes()
    cnrstore.open(store_path, readonly=True).close()


# item 9: concurrent and interrupted creation ---------------------------------------------------------
_CREATE = """
    import json, os, sys, time, cnrstore
    paths, me, n = sys.argv[1].split(","), int(sys.argv[2]), int(sys.argv[3])
    real_listdir = os.listdir

    def slow_listdir(p="."):  # odd rounds: all but process 0 look at the store directory late
        if me and p in paths[1::2]:
            time.sleep(0.2)
        return real_listdir(p)

    os.listdir = slow_listdir
    out = []
    for path in paths:
        gate = path + ".gate"  # a barrier: every process starts its open at once
        open(os.path.join(gate, str(me)), "w").close()
        while len(os.listdir(gate)) < n:
            time.sleep(0.001)
        try:
            s = cnrstore.open(path, create=True)
        except cnrstore.StoreLocked as e:
            out.append({"outcome": "locked", "pid": e.pid})
        except Exception as e:
            out.append({"outcome": "error", "error": f"{type(e).__name__}: {e}"})
        else:
            s.create_table(f"t{me}", 4, 2, codec="fp32")
            with s.checkpoint(step=me) as ck:
                ck.put_rows(f"t{me}", [0, 1, 2, 3], [[float(me)] * 2] * 4)
            s.close()
            out.append({"outcome": "opened", "version": ck.version})
    print(json.dumps(out))
"""


def test_concurrent_creates_one_creates_the_others_open_or_get_store_locked(tmp_path):
    """Processes racing open(create=True) each open the one store or get StoreLocked (its creator holds
    it for writing), never InvalidArgument for another's half-made or just-finished files."""
    n, rounds = 4, 4
    paths = [str(tmp_path / f"s{i}") for i in range(rounds)]
    for p in paths:
        os.mkdir(p + ".gate")
    env = dict(os.environ)
    env.pop(cnrstore.engine.fs.CRASH_ENV, None)
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(_CREATE), ",".join(paths), str(i), str(n)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for i in range(n)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    pids = {p.pid for p in procs}
    for r, path in enumerate(paths):
        outcomes = [results[i][r] for i in range(n)]
        assert all(o["outcome"] in ("opened", "locked") for o in outcomes), outcomes
        assert all(o["pid"] in pids for o in outcomes if o["outcome"] == "locked"), outcomes
        opened = [o["version"] for o in outcomes if o["outcome"] == "opened"]
        assert opened, outcomes
        with cnrstore.open(path) as s:  # one valid store, holding exactly what the openers wrote
            assert sorted(v.version for v in s.versions()) == sorted(opened)
            assert len(s.tables()) == len(opened)
            assert s.verify().ok
        assert sorted(os.listdir(path)) == sorted([filenames.MARKER, filenames.LOCK, filenames.INDEX_DIR,
                                                   filenames.SEGMENTS_DIR])


def test_creation_killed_before_its_marker_is_finished_by_the_next_create(store_path):
    proc = _python("import sys, cnrstore; cnrstore.open(sys.argv[1], create=True)", store_path,
                   env={cnrstore.engine.fs.CRASH_ENV: "create_before_marker"})
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert not os.path.exists(filenames.marker_path(store_path))
    assert os.path.isdir(filenames.index_dir(store_path))
    for readonly in (False, True):
        with pytest.raises(cnrstore.StoreNotFound) as ei:
            cnrstore.open(store_path, readonly=readonly)
        assert "create=True" in str(ei.value)
    with cnrstore.open(store_path, create=True) as s:
        s.create_table("t", 4, 2, codec="fp32")
        with s.checkpoint() as ck:
            ck.put_rows("t", [0], [[1.0, 2.0]])
    with cnrstore.open(store_path, readonly=True) as s:
        assert s.read_rows("t", [0]).tolist() == [[1.0, 2.0]] and s.verify().ok


def test_create_waits_while_another_creator_holds_the_directory(store_path, monkeypatch):
    """A creator that finds the directory locked and no marker yet waits (polling for the marker) instead
    of failing with StoreLocked or on the other's half-made files; here the other gives up after a few
    polls, and this creator makes the store."""
    os.makedirs(store_path)
    other = cnrstore.engine.lock.ProcessLock(store_path)
    other.acquire(write_pid=False)  # "another creator" holds the directory
    os.makedirs(filenames.index_dir(store_path))
    open(filenames.marker_tmp_path(store_path), "wb").close()
    waits = []
    real_exists = os.path.exists

    def exists(p):  # the other creator finishes after a few polls
        if p == filenames.marker_path(store_path) and other._dir_fd is not None:
            waits.append(p)
            if len(waits) == 3:
                os.rmdir(filenames.index_dir(store_path))
                os.remove(filenames.marker_tmp_path(store_path))
                other.release()
        return real_exists(p)

    monkeypatch.setattr(os.path, "exists", exists)
    with cnrstore.open(store_path, create=True) as s:
        assert s.versions() == []
    assert len(waits) >= 3


def test_file_system_that_cannot_lock_a_directory_falls_back_to_lock_file_and_refuses_commit_once_lost(
        store_path, monkeypatch):
    """On a file system where flock of a directory fails (NFS: EBADF), LOCK is the lock again: a second
    writer is kept out while LOCK lives, and a writer whose LOCK was deleted refuses to commit."""
    real_flock = fcntl.flock

    def flock(fd, op):
        if os.path.isdir(f"/proc/self/fd/{fd}") and op & fcntl.LOCK_EX:
            raise OSError(9, "Bad file descriptor")
        return real_flock(fd, op)

    monkeypatch.setattr(cnrstore.engine.lock.fcntl, "flock", flock)
    s, v1 = _writer_with_one_version(store_path)
    try:
        with pytest.raises(cnrstore.StoreLocked) as ei:
            cnrstore.open(store_path)
        assert ei.value.pid == os.getpid()
        os.remove(filenames.lock_path(store_path))
        with pytest.raises(cnrstore.StoreLocked) as ei:
            with s.checkpoint(step=2) as ck:
                ck.put_rows("emb", [0], _values(2)[:1])
        assert "LOCK" in str(ei.value) and "reopen" in str(ei.value)
    finally:
        s.close()
    with cnrstore.open(store_path) as s:
        assert [v.version for v in s.versions()] == [v1] and s.verify().ok


def test_segment_deleted_under_the_writer_never_acknowledges_a_version_stored_in_the_lost_file(store_path):
    """The writer's open fd would happily append to the unlinked file: the appender notices, seals it and
    writes the next version to a new segment, so what it acknowledges is on disk (test_disk_faults covers
    an operation already writing into the file when it goes)."""
    s, v1 = _writer_with_one_version(store_path)
    seg_dir = filenames.segments_dir(store_path)
    (seg,) = os.listdir(seg_dir)
    os.remove(os.path.join(seg_dir, seg))  # the writer still appends to it through its open fd
    try:
        with s.checkpoint(step=2) as ck:
            ck.put_rows("emb", [0], _values(2)[:1])
        v2 = ck.version
        assert [v.version for v in s.versions()] == [v1, v2]
        assert os.listdir(seg_dir) and seg not in os.listdir(seg_dir)  # v2 went to a new segment
        np.testing.assert_array_equal(s.read_rows("emb", [0], v2), _values(2)[:1])
    finally:
        s.close()
    with cnrstore.open(store_path) as s:
        assert [v.version for v in s.versions()] == [v1, v2]
        np.testing.assert_array_equal(s.read_rows("emb", [0], v2), _values(2)[:1])
        assert not s.verify().ok  # what the deleted file held is reported lost, never returned
        with pytest.raises(cnrstore.CorruptionError):
            s.read_table("emb", v1)


def test_background_compaction_of_a_renamed_store_touches_nothing_under_the_old_path(tmp_path):
    """The background worker calls compaction directly, not through Store's write checks: its commits and
    file deletions check the lock's directory too, so a store made at the old path is left alone."""
    from cnrstore.policy import CompactionPolicy, KeepLast, MaxChain, Retention

    old, new = str(tmp_path / "a"), str(tmp_path / "b")
    s = cnrstore.open(old, create=True, compaction=CompactionPolicy(materialize=MaxChain(10)))
    try:
        s.create_table("emb", 10, 4, codec="fp32", block_rows=64)
        with s.checkpoint(step=1) as ck:
            ck.put_rows("emb", np.arange(10), _values(1))
        with s.checkpoint(step=2) as ck:
            ck.put_rows("emb", np.arange(5), _values(2)[:5])
        s._compactor.wait_idle(30)
        os.rename(old, new)
        with cnrstore.open(old, create=True) as other:
            other.create_table("x", 100, 4, codec="fp32")
            with other.checkpoint() as ck:
                ck.put_rows("x", np.arange(100), np.ones((100, 4)))
        before = sorted(os.listdir(filenames.segments_dir(old)))
        # now a plan that materializes, drops and collects runs, as after a commit
        s._compactor.policy = CompactionPolicy(materialize=MaxChain(2), retention=Retention(KeepLast(1)))
        s._compactor.notify()
        s._compactor.wait_idle(30)
        assert isinstance(s.compaction_error, cnrstore.errors.StoreMoved)
        assert sorted(os.listdir(filenames.segments_dir(old))) == before
    finally:
        try:
            s.close()
        except cnrstore.errors.CompactionFailed:
            pass
    with cnrstore.open(old) as other:
        assert list(other.tables()) == ["x"] and other.verify().ok
    with cnrstore.open(new) as moved:
        assert moved.verify().ok
        assert moved.read_rows("emb", np.arange(5)).tobytes() == _values(2)[:5].tobytes()
