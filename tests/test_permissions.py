"""Permission faults give one typed error, PermissionDenied, naming the path and the permission (issue 11,
item 11): a store of another user, a mode-700 directory, read-only files or directories, an unwritable
parent at creation, a read-only file system.

Mode bits do not bind root, so when the tests run as root each check runs in a forked child that has
dropped to uid/gid ``nobody`` (65534); run as another user, they run in this process. Either way the
same files with the same modes are refused. A read-only file system is injected through the fs seam.
"""

from __future__ import annotations

import errno
import os
import pickle
import select
import shutil
import signal
import tempfile

import lmdb
import numpy as np
import pytest

import cnrstore
from cnrstore.engine import filenames
from cnrstore.engine.fs import FileSystem
from cnrstore.store import Store

NOBODY = 65534
ROOT = os.geteuid() == 0


@pytest.fixture
def base():
    """A directory that the unprivileged user can search (pytest's tmp_path lies under a mode-700 one)."""
    d = tempfile.mkdtemp(prefix="cnrstore-perm-")
    os.chmod(d, 0o755)
    yield d
    for root, dirs, _files in os.walk(d):
        for name in dirs:
            os.chmod(os.path.join(root, name), 0o755)
    shutil.rmtree(d, ignore_errors=True)


def _outcome(fn):
    try:
        value = fn()
    except BaseException as e:  # noqa: BLE001 - everything is reported to the parent
        return {"raised": type(e).__name__, "message": str(e), "path": getattr(e, "path", None),
                "cnr": isinstance(e, cnrstore.CnrError), "permission": isinstance(e, PermissionError)}
    return {"raised": None, "value": value}


def unprivileged(fn):
    """Run ``fn()`` as a user that file modes bind; returns what it returned or raised, as a dict."""
    if not ROOT:
        return _outcome(fn)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop root, run, report, exit without running the parent's cleanups
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            data = pickle.dumps(_outcome(fn))
            while data:
                data = data[os.write(w, data):]
        finally:
            os._exit(0)
    os.close(w)
    chunks = []
    try:
        while True:
            ready, _, _ = select.select([r], [], [], 60)
            if not ready:
                os.kill(pid, signal.SIGKILL)
                raise AssertionError("the unprivileged child hung")
            chunk = os.read(r, 1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(r)
        os.waitpid(pid, 0)
    return pickle.loads(b"".join(chunks))


def give_to_runner(path):
    """Make ``path`` (recursively) the unprivileged user's own, as a store it created would be."""
    if ROOT:
        for root, dirs, files in os.walk(path):
            for name in [root, *(os.path.join(root, n) for n in dirs + files)]:
                os.chown(name, NOBODY, NOBODY)


def chmod_tree(path, dir_mode, file_mode):
    for root, dirs, files in os.walk(path):
        os.chmod(root, dir_mode)
        for n in files:
            os.chmod(os.path.join(root, n), file_mode)


def make_store(path):
    with cnrstore.open(path, create=True) as s:
        s.create_table("emb", 10, 4, codec="fp32", block_rows=64)
        with s.checkpoint(step=1) as ck:
            ck.put_rows("emb", np.arange(10), np.arange(40, dtype=np.float32).reshape(10, 4))
    return ck.version


def assert_denied(out, path, *words):
    assert out["raised"] == "PermissionDenied", out
    assert out["cnr"] and out["permission"]
    assert out["path"] == path, out
    assert path in out["message"], out
    for w in words:
        assert w in out["message"], out


def _open(path, **kw):
    def fn():
        with cnrstore.open(path, **kw) as s:
            return [v.version for v in s.versions()]
    return fn


# -----------------------------------------------------------------------------------------------------
def test_store_of_another_user_writable_open_is_permission_denied_readonly_needs_lock_mdb(base):
    path = os.path.join(base, "store")
    v1 = make_store(path)
    chmod_tree(path, 0o555, 0o444)  # another user's store: readable, not writable
    os.chmod(path, 0o755)  # (even with a writable directory: its LOCK is not ours to write)
    assert_denied(unprivileged(_open(path)), filenames.lock_path(path), "for writing", "readonly=True",
                  "read and write")
    # LMDB writes its reader table even for readonly opens: that file is named
    lock_mdb = os.path.join(filenames.index_dir(path), "lock.mdb")
    assert_denied(unprivileged(_open(path, readonly=True)), lock_mdb, "readonly", "read and write")
    os.chmod(lock_mdb, 0o666)  # as a shared store would have it: then readonly opens work
    assert unprivileged(_open(path, readonly=True)) == {"raised": None, "value": [v1]}
    with cnrstore.open(path) as s:  # its owner still writes it
        assert [v.version for v in s.versions()] == [v1]


def test_mode_700_store_directory_is_permission_denied_not_store_not_found(base):
    path = os.path.join(base, "store")
    make_store(path)
    os.chmod(path, 0o700)
    for kw, words in (({}, ("for writing",)), ({"readonly": True}, ("readonly",))):
        assert_denied(unprivileged(_open(path, **kw)), path, "search", *words)
    assert_denied(unprivileged(_open(os.path.join(path, "inner"), readonly=True)), path, "search")


def test_an_unreadable_remote_file_is_permission_denied_not_a_local_store(base):
    """A store whose REMOTE file (its object-store URL) may not be read must not open as a local store:
    its sealed segments are elsewhere (engine/remote.py check_local_only)."""
    path = os.path.join(base, "store")
    make_store(path)
    remote_file = filenames.remote_path(path)
    with open(remote_file, "w") as f:
        f.write('{"url": "s3://bucket/prefix", "store_id": "x"}')
    give_to_runner(path)
    os.chmod(remote_file, 0o000)
    assert_denied(unprivileged(_open(path, readonly=True)), remote_file, "cannot open store", "read")


def test_create_under_unwritable_parent_is_permission_denied(base):
    parent = os.path.join(base, "parent")
    os.mkdir(parent, 0o555)
    out = unprivileged(_open(os.path.join(parent, "store"), create=True))
    assert_denied(out, parent, "cannot create store", "write")
    assert os.listdir(parent) == []


def test_create_in_an_unwritable_empty_directory_is_permission_denied_and_leaves_it_empty(base):
    path = os.path.join(base, "store")
    os.mkdir(path, 0o555)
    out = unprivileged(_open(path, create=True))
    assert out["raised"] == "PermissionDenied" and out["cnr"] and path in out["message"], out
    assert os.listdir(path) == []
    os.chmod(path, 0o755)
    give_to_runner(path)
    assert unprivileged(_open(path, create=True)) == {"raised": None, "value": []}


@pytest.mark.parametrize("target", ["segments_dir", "segment_file", "data.mdb"])
def test_writable_open_without_write_permission_is_permission_denied_at_open(base, target):
    path = os.path.join(base, "store")
    v1 = make_store(path)
    give_to_runner(path)
    seg_dir = filenames.segments_dir(path)
    refused = {"segments_dir": seg_dir,
               "segment_file": os.path.join(seg_dir, sorted(os.listdir(seg_dir))[0]),
               "data.mdb": os.path.join(filenames.index_dir(path), "data.mdb")}[target]
    os.chmod(refused, 0o555 if os.path.isdir(refused) else 0o444)
    assert_denied(unprivileged(_open(path)), refused, "for writing", "readonly=True")
    out = unprivileged(_open(path, readonly=True))  # reading needs no write permission there
    assert out == {"raised": None, "value": [v1]}


def test_unreadable_marker_is_permission_denied(base):
    path = os.path.join(base, "store")
    make_store(path)
    os.chmod(filenames.marker_path(path), 0o600)
    assert_denied(unprivileged(_open(path, readonly=True)), filenames.marker_path(path), "read")


def test_unreadable_segment_is_permission_denied_on_read(base):
    path = os.path.join(base, "store")
    make_store(path)
    os.chmod(os.path.join(filenames.index_dir(path), "lock.mdb"), 0o666)
    seg_dir = filenames.segments_dir(path)
    seg = os.path.join(seg_dir, sorted(os.listdir(seg_dir))[0])
    os.chmod(seg, 0o600)

    def read():
        with cnrstore.open(path, readonly=True) as s:
            return s.read_rows("emb", [0]).tolist()

    assert_denied(unprivileged(read), seg, "cannot read segment", "read")


# injected faults: a read-only file system, refused writes ------------------------------------------------
class _Refusing(FileSystem):
    def __init__(self, code):
        self.code = code

    def open_append(self, path, *, create):
        raise OSError(self.code, os.strerror(self.code), path)


@pytest.mark.parametrize("code", [errno.EROFS, errno.EACCES, errno.EPERM])
def test_refused_segment_append_is_permission_denied_and_keeps_committed_versions(store_path, code):
    v1 = make_store(store_path)
    store = Store(store_path, create=False, readonly=False, filesystem=_Refusing(code))
    try:
        store.engine._appender.seal()  # the next append opens a new segment file: refused
        with pytest.raises(cnrstore.PermissionDenied) as ei:
            with store.checkpoint(step=2) as ck:
                ck.put_rows("emb", [0], [[1.0] * 4])
        msg = str(ei.value)
        assert filenames.segments_dir(store_path) in msg and ei.value.errno == code
        assert ("read-only" in msg and "remount" in msg) if code == errno.EROFS else "chmod" in msg
        assert [v.version for v in store.versions()] == [v1]
    finally:
        store.close()
    with cnrstore.open(store_path) as s:
        assert [v.version for v in s.versions()] == [v1] and s.verify().ok


def test_index_on_read_only_file_system_is_permission_denied(store_path, monkeypatch):
    make_store(store_path)

    def refused(path, **kwargs):
        raise lmdb.Error(f"{path}: Read-only file system")

    monkeypatch.setattr(cnrstore.engine.index.lmdb, "open", refused)
    with pytest.raises(cnrstore.PermissionDenied) as ei:
        cnrstore.open(store_path)
    assert ei.value.errno == errno.EROFS and "remount" in str(ei.value)
    assert filenames.index_dir(store_path) in str(ei.value)
    monkeypatch.undo()
    cnrstore.open(store_path).close()  # the refused open released the lock


def test_permission_denied_is_exported_and_a_permission_error():
    assert cnrstore.PermissionDenied is cnrstore.errors.PermissionDenied
    assert "PermissionDenied" in cnrstore.errors.__all__ and "PermissionDenied" in cnrstore.__all__
    assert issubclass(cnrstore.PermissionDenied, PermissionError)
    assert issubclass(cnrstore.PermissionDenied, cnrstore.CnrError)


def test_distributed_root_in_a_mode_700_directory_is_permission_denied(base):
    from cnrstore.distributed.manifest import Root

    path = os.path.join(base, "root")
    Root(path).create()
    os.chmod(path, 0o700)
    assert_denied(unprivileged(lambda: Root(path).check()), path, "distributed root", "search")
    os.chmod(path, 0o755)
    marker = [n for n in os.listdir(path) if os.path.isfile(os.path.join(path, n))][0]
    os.chmod(os.path.join(path, marker), 0o600)
    assert_denied(unprivileged(lambda: Root(path).check()), os.path.join(path, marker), "read")
    parent = os.path.join(base, "ro")
    os.mkdir(parent, 0o555)
    out = unprivileged(lambda: Root(os.path.join(parent, "root")).create())
    assert out["raised"] == "PermissionDenied" and parent in out["message"] and "write" in out["message"], out
