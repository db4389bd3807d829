"""The file-system seam: every write-side effect of the engine goes through a ``FileSystem``.

Tests substitute a subclass to inject faults (a full disk, a crash at a named point) the way
leveldb's fault_injection_test drops unsynced data. Reads use mmap/pread directly: they have no
effects to inject.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
from typing import Callable

from .. import errors

#: Environment variable naming a crash point; the process SIGKILLs itself on reaching it (tests only).
CRASH_ENV = "CNRSTORE_CRASH_AT"

_NO_SPACE = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
#: errnos of a refused permission: file modes or ownership, an immutable file, a read-only file system
NO_PERMISSION = {errno.EACCES, errno.EPERM, errno.EROFS}


#: name -> hook run when a thread reaches that point (``pause_at``); empty outside tests.
_PAUSE_HOOKS: dict[str, Callable[..., None]] = {}


def crash_point(name: str) -> None:
    """Kill this process with SIGKILL if ``$CNRSTORE_CRASH_AT`` names this point (crash tests).

    Every crash point is also a pause point (``pause_point``): a schedule test can stop a thread there
    and run another one in between, deterministically."""
    if os.environ.get(CRASH_ENV) == name:
        os.kill(os.getpid(), signal.SIGKILL)
    pause_point(name)


def pause_point(name: str, *detail) -> None:
    """Run the hook a test installed for ``name`` (``pause_at``), if any: races by schedule, not by luck.

    The hook is called as ``hook(name, *detail)`` (``index_committed`` passes the environment's path)
    and typically blocks the calling thread until the test releases it (tests/schedule.py). A point
    costs one dict lookup when no hook is installed."""
    if _PAUSE_HOOKS:
        hook = _PAUSE_HOOKS.get(name)
        if hook is not None:
            hook(name, *detail)


def pause_at(name: str, hook: Callable[..., None] | None) -> None:
    """Install (or with None remove) the hook run at pause point ``name`` (tests only)."""
    if hook is None:
        _PAUSE_HOOKS.pop(name, None)
    else:
        _PAUSE_HOOKS[name] = hook


def wrap_os_error(exc: OSError, what: str) -> errors.CnrError | OSError:
    """Turn a full-disk OSError into StorageFull, an I/O error (EIO, e.g. a failed fsync: the data may be
    gone, so nothing written since the last commit is trusted) into StorageIOError and a refused
    permission into PermissionDenied; leave other OSErrors as they are."""
    if exc.errno in _NO_SPACE:
        err = errors.StorageFull(f"{what}: {os.strerror(exc.errno)}; free disk space and retry; nothing of the operation was committed")
        err.errno = exc.errno
        return err
    if exc.errno == errno.EIO:
        err = errors.StorageIOError(f"{what}: input/output error; nothing of the operation was committed: check "
                                    "the device (dmesg), run `cnrstore verify`, then retry")
        err.errno = exc.errno
        return err
    if exc.errno in NO_PERMISSION:
        return permission_denied(exc, what, needs="write")
    return exc


def permission_denied(exc: OSError | None, what: str, path: str | None = None, *, needs: str = "read and write",
                      writing: bool = True) -> errors.PermissionDenied:
    """The PermissionDenied for a refused ``exc`` (or for a check that found ``path`` lacking ``needs``).

    ``what`` says what was being done ("cannot open store X for writing"); ``writing`` picks the advice
    (a refused write can still be read with ``readonly=True``). An error that already is a CnrError is
    returned as it is.
    """
    if isinstance(exc, errors.CnrError):
        return exc
    code = exc.errno if exc is not None and exc.errno else errno.EACCES
    path = path or (exc.filename if exc is not None else None)
    why = "the file system is read-only" if code == errno.EROFS else os.strerror(code).lower()
    where = f" on {path}" if path else ""
    fix = "fix the permissions (chown/chmod)"
    if code == errno.EROFS:
        fix = "remount the file system read-write"
    if writing:
        fix = f"open it readonly=True to read it, or {fix}"
    err = errors.PermissionDenied(f"{what}: {why}{where} (needs {needs}); {fix}", path)
    err.errno = code
    return err


def allocated_bytes(directory: str) -> int:
    """Bytes of disk allocated to the regular files directly in ``directory`` (what ``du`` counts)."""
    with os.scandir(directory) as entries:
        return sum(e.stat().st_blocks * 512 for e in entries if e.is_file(follow_symlinks=False))


def same_file(fd: int, path: str) -> bool:
    """Whether ``path`` still names the file open as ``fd``."""
    try:
        a, b = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


class FileSystem:
    """Real file-system effects. Subclass and override to inject faults."""

    def open_append(self, path: str, *, create: bool) -> int:
        """Open ``path`` for writing (creating it if ``create``); returns a raw fd."""
        flags = os.O_WRONLY | (os.O_CREAT | os.O_EXCL if create else 0)
        return os.open(path, flags, 0o644)

    def pwritev(self, fd: int, buffers: list, offset: int) -> int:
        """Write all ``buffers`` at ``offset``; returns bytes written (all of them) or raises OSError."""
        total = sum(memoryview(b).nbytes for b in buffers)
        written = os.pwritev(fd, buffers, offset)
        while written < total:  # short write: finish it byte-exactly
            rest = b"".join(bytes(memoryview(b).cast("B")) for b in buffers)[written:]
            n = os.pwrite(fd, rest, offset + written)
            if n == 0:
                raise OSError(errno.ENOSPC, "short write")
            written += n
        return written

    def fsync(self, fd: int) -> None:
        os.fsync(fd)

    def fsync_dir(self, path: str) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def truncate(self, path: str, length: int) -> None:
        os.truncate(path, length)

    def close(self, fd: int) -> None:
        os.close(fd)

    def write_file_atomic(self, path: str, tmp_path: str, data: bytes) -> None:
        """Write ``data`` to ``tmp_path``, fsync it, rename it over ``path`` and fsync the directory.

        A full disk (StorageFull) or I/O error (StorageIOError) while writing leaves ``path`` as it was.
        """
        try:
            fd = os.open(tmp_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                self.pwritev(fd, [data], 0)
                self.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.remove(tmp_path)
            raise wrap_os_error(exc, f"writing {path}") from exc
        os.replace(tmp_path, path)
        self.fsync_dir(os.path.dirname(path) or ".")

    def remove(self, path: str) -> None:
        os.remove(path)

    def rename(self, src: str, dst: str) -> None:
        """Rename ``src`` (a file or a directory) to ``dst``; durable once the directories are fsynced."""
        os.rename(src, dst)

    def mkdir(self, path: str) -> None:
        os.mkdir(path, 0o755)

    def remove_tree(self, path: str) -> None:
        """Remove the directory ``path`` and everything in it; nothing if it does not exist."""
        shutil.rmtree(path, ignore_errors=True)


DEFAULT = FileSystem()
