"""Finding and making a store's files, before its engine opens them (``Engine.open``, core.py).

A store exists exactly when its marker does (docs/DESIGN.md "File kinds"). ``find`` says whether it
does (and names the directory this process may not search, if that is why it cannot tell), ``create``
makes a new store (or finishes a half-made one) and returns its lock held for writing, and
``check_format`` reads the marker's format version and refuses one this cnrstore cannot read.
"""

from __future__ import annotations

import os

from . import filenames, fs
from ..errors import FormatVersionError, InvalidArgument, StoreNotFound
from .index import Index
from .lock import ProcessLock
from .marker import FORMAT_VERSION, marker_bytes, read_marker
from .schema import BYTES_WRITTEN, FORMAT, NEXT_DENSE_ID, NEXT_TABLE_ID, NEXT_VERSION
from .storage import LocalSegmentStorage


def opening(root: str, readonly: bool) -> str:
    """How an error of opening ``root`` begins."""
    return f"cannot open store {root!r} " + ("readonly" if readonly else "for writing")


def find(root: str, readonly: bool) -> bool:
    """Whether the store's marker exists (as anything: a marker that is a link, even a dangling one, or a
    FIFO is then refused by ``check_format``, never taken for no store); PermissionDenied if a directory on
    the way may not be searched."""
    try:
        os.lstat(filenames.marker_path(root))
        return True
    except (FileNotFoundError, NotADirectoryError):
        return False
    except PermissionError as exc:
        path = _denied_dir(root) or root
        raise fs.permission_denied(exc, opening(root, readonly), path, needs="search (x)",
                                   writing=not readonly) from None


def not_found(root: str, readonly: bool) -> StoreNotFound:
    """The StoreNotFound for a path with no marker, saying how to finish a half-made store there."""
    if os.path.isdir(filenames.index_dir(root)) and os.path.isdir(filenames.segments_dir(root)):
        return StoreNotFound(
            f"no cnrstore store at {root!r}: it holds a store's index/ and segments/ but no marker "
            f"{filenames.MARKER} (its creation did not finish, or the marker was deleted); open it with "
            "create=True (and readonly=False) to finish it: the files there are kept")
    hint = "" if readonly else "; pass create=True to make a new store there"
    return StoreNotFound(f"no cnrstore store at {root!r}{hint}")


def check_format(root: str, readonly: bool) -> int:
    """The marker's format version; FormatVersionError if it is newer than this cnrstore reads,
    PermissionDenied if the marker may not be read."""
    try:
        fmt = read_marker(root)
    except PermissionError as exc:
        raise fs.permission_denied(exc, opening(root, readonly), filenames.marker_path(root), needs="read",
                                   writing=not readonly) from None
    if fmt > FORMAT_VERSION:
        raise FormatVersionError(f"store {root!r} has format version {fmt}, but this cnrstore reads up to "
                                 f"{FORMAT_VERSION}: upgrade cnrstore to open it")
    return fmt


def create(root: str, filesystem: fs.FileSystem, wait_s: float) -> ProcessLock:
    """Make the store at ``root`` (or finish a half-made one); returns its lock, held for writing.

    Concurrent creators are safe: the directory is locked before its contents are checked, so one
    process creates while the others wait (up to ``wait_s``) for its marker; they then open the store it
    made, or get StoreLocked while the creator holds it for writing. A directory with no marker and only
    a store's own files (a creation that crashed) is created over, keeping them.
    """
    what = f"cannot create store {root!r}"
    if os.path.exists(root) and not os.path.isdir(root):
        raise InvalidArgument(f"{root!r} is a file, not a directory; choose another path for the store")
    try:
        os.makedirs(root, exist_ok=True)
    except FileExistsError:
        raise InvalidArgument(f"{root!r} is a file, not a directory; choose another path for the store") from None
    except OSError as exc:
        if exc.errno in fs.NO_PERMISSION:
            parent = _denied_dir(os.path.dirname(root)) or os.path.dirname(root)
            raise fs.permission_denied(exc, what, parent, needs="write and search (-wx)", writing=False) from None
        raise
    marker = filenames.marker_path(root)
    lock = ProcessLock(root)
    lock.acquire(write_pid=False, wait=lambda: not os.path.exists(marker), timeout=wait_s)
    try:
        if not os.path.exists(marker):  # (else another process created it while we waited)
            check_no_leftovers(root, "choose an empty or new directory")
            try:
                _create_files(root, filesystem)
            except OSError as exc:
                if exc.errno in fs.NO_PERMISSION:
                    raise fs.permission_denied(exc, what, needs="write", writing=False) from None
                raise
        lock.lock_pid_file()
    except BaseException:
        lock.release()
        raise
    return lock


def check_no_leftovers(root: str, fix: str) -> None:
    """InvalidArgument (saying ``fix``) if the directory ``root`` holds anything but what a store being
    created (or recovered) leaves before its marker exists (``filenames.BEFORE_MARKER``)."""
    leftovers = set(os.listdir(root)) - filenames.BEFORE_MARKER
    if leftovers:
        raise InvalidArgument(f"{root!r} is a non-empty directory that is not a store "
                              f"(it holds {sorted(leftovers)[:3]}); {fix}")


def _create_files(root: str, filesystem: fs.FileSystem) -> None:
    LocalSegmentStorage.create(root, filesystem)
    index = Index(filenames.index_dir(root), readonly=False, create=True)
    try:
        def init(w):
            if FORMAT.get(w) is None:
                FORMAT.put(w, FORMAT_VERSION)
                for key in (NEXT_VERSION, NEXT_TABLE_ID, NEXT_DENSE_ID, BYTES_WRITTEN):
                    key.put(w, key.default)
        index.write(init)
    finally:
        index.close()
    filesystem.fsync_dir(filenames.index_dir(root))  # data.mdb's entry, before the marker exists
    filesystem.fsync_dir(root)
    fs.crash_point("create_before_marker")
    # the marker is written last: a store exists exactly when its marker does
    filesystem.write_file_atomic(filenames.marker_path(root), filenames.marker_tmp_path(root), marker_bytes())


def _denied_dir(path: str) -> str | None:
    """The outermost directory on ``path`` this process may not search (None if it may search all)."""
    parts = os.path.abspath(path).split(os.sep)
    for i in range(2, len(parts) + 1):
        d = os.sep.join(parts[:i]) or os.sep
        if os.path.isdir(d) and not os.access(d, os.X_OK):
            return d
    return None
