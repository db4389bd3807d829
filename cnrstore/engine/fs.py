"""The file-system seam: every write-side effect of the engine goes through a ``FileSystem``.

Tests substitute a subclass to inject faults (a full disk, a crash at a named point) the way
leveldb's fault_injection_test drops unsynced data. Reads use mmap/pread directly: they have no
effects to inject. But every file a store (or an import) reads by path is opened through
``open_regular`` / ``read_regular`` here, which refuse anything but a regular file: a store's files are
data that whoever can write its directory controls, and a FIFO would block the reader for ever, a link
to ``/dev/zero`` feed it without end, a link elsewhere make it read (or write) outside the store
(docs/DESIGN.md "Security").
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
import stat
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
    and typically blocks the calling thread until the test releases it (tests/support/schedule.py). A point
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


# -- reading a file by path: regular files only -----------------------------------------------------------
#: The fix a message about a store file that is not a regular file gives, where no better one is known.
STORE_FILE_FIX = "a store's files are regular files: restore it from a copy, or run `cnrstore repair`"


def file_kind(mode: int) -> str:
    """What a file of ``st_mode`` ``mode`` is, for a message: "a regular file", "a FIFO", "a directory", ..."""
    for test, name in ((stat.S_ISREG, "a regular file"), (stat.S_ISLNK, "a symbolic link"),
                       (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a regular file"


def _refusal(error: type, what: str, path: str, why: str, fix: str) -> errors.CnrError:
    message = f"{what} {path} {why}; {fix}"
    if issubclass(error, errors.CorruptionError):
        return error(message, path, None)
    return error(message)


def _describe(path: str, st: os.stat_result, *, dir_fd: int | None = None, name: str | None = None) -> str:
    """"is a FIFO, not a regular file"; a link: "is a symbolic link (to '/dev/zero'), not a regular file";
    ``st`` of a link's target: "is a symbolic link to '/dev/zero', a character device, not a regular file"."""
    kind = file_kind(st.st_mode)
    try:
        link = os.readlink(name if dir_fd is not None else path, dir_fd=dir_fd)
    except OSError:
        link = None
    if link is not None:
        kind = f"a symbolic link (to {link!r})" if stat.S_ISLNK(st.st_mode) else f"a symbolic link to {link!r}, {kind}"
    return f"is {kind}, not a regular file"


def check_kind(path: str, what: str, fix: str = STORE_FILE_FIX, *, directory: bool = False,
               error: type = errors.CorruptionError) -> os.stat_result | None:
    """``os.lstat(path)`` if ``path`` is a regular file (with ``directory``: a directory), None if nothing
    is there; ``error`` (CorruptionError by default, or a subclass such as IndexDamaged, or InvalidArgument)
    naming ``what`` and ``path``, what it is instead and ``fix`` for anything else: a symbolic link (never
    followed), a FIFO, a socket, a device, a directory (a file, with ``directory``).

    For paths that something else opens by name (LMDB opens ``data.mdb`` and ``lock.mdb`` itself), and for
    a store's directories. PermissionError and other OSErrors of the ``lstat`` propagate unchanged."""
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    if (stat.S_ISDIR(st.st_mode) if directory else stat.S_ISREG(st.st_mode)):
        return st
    why = _describe(path, st)
    if directory:
        why = why.replace("not a regular file", "not a directory")
    raise _refusal(error, what, path, why, fix)


def open_regular(path: str, what: str, fix: str = STORE_FILE_FIX, *, flags: int = os.O_RDONLY, mode: int = 0o644,
                 dir_fd: int | None = None, name: str | None = None, follow_symlinks: bool = False,
                 error: type = errors.CorruptionError) -> int:
    """Open the regular file ``path``; returns a raw fd (close-on-exec, in blocking mode) the caller closes.

    Before: nothing. After: the fd names a regular file (``fstat`` of the file opened, so a file swapped in
    between the check and the open is caught too). Anything else is refused with ``error`` (CorruptionError
    by default; InvalidArgument for a file the user names, such as an import source), whose message names
    ``what``, ``path``, what the file is and ``fix``: a symbolic link (unless ``follow_symlinks``: then a
    link to a regular file is read and a link to anything else refused), a FIFO (never waited on: it is
    refused before it is opened, and opened with ``O_NONBLOCK`` if it appears between), a socket, a device
    (never opened: opening some has effects) or a directory.

    ``flags``: ``os.O_RDONLY`` (default) or e.g. ``os.O_RDWR | os.O_CREAT`` (the file is made, with ``mode``,
    when missing). ``dir_fd`` and ``name``: open ``name`` relative to the open directory ``dir_fd`` instead
    (``path`` still names the file in messages). FileNotFoundError, NotADirectoryError, PermissionError and
    every other OSError propagate unchanged, so callers keep turning them into StoreNotFound or
    PermissionDenied as before.
    """
    target = name if dir_fd is not None else path
    try:
        st = os.stat(target, dir_fd=dir_fd, follow_symlinks=follow_symlinks)
    except FileNotFoundError:
        if not flags & os.O_CREAT:
            raise
        st = None
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise _refusal(error, what, path, _describe(path, st, dir_fd=dir_fd, name=name), fix)
    nofollow = 0 if follow_symlinks else os.O_NOFOLLOW
    try:
        fd = os.open(target, flags | nofollow | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC, mode, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.ENXIO):  # (ENXIO: a socket)
            raise
        try:  # swapped for a link or a socket since the stat
            st = os.stat(target, dir_fd=dir_fd, follow_symlinks=False)
        except OSError:
            raise exc from None
        raise _refusal(error, what, path, _describe(path, st, dir_fd=dir_fd, name=name), fix) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _refusal(error, what, path, _describe(path, st), fix)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_regular(path: str, max_bytes: int, what: str, fix: str = STORE_FILE_FIX, *, follow_symlinks: bool = False,
                 error: type = errors.CorruptionError) -> bytes:
    """The whole content of the regular file ``path``, which holds at most ``max_bytes`` bytes.

    Refuses what ``open_regular`` refuses, and a file larger than ``max_bytes`` (never silently cut
    short), with ``error``. Memory: proportional to what the file holds (at most ``max_bytes`` + 64 KiB
    per read), never a buffer sized by a claim. FileNotFoundError, PermissionError and other OSErrors
    propagate unchanged."""
    fd = open_regular(path, what, fix, follow_symlinks=follow_symlinks, error=error)
    try:
        size = os.fstat(fd).st_size
        limit = max_bytes + 1  # one byte past the bound tells a file that grew past it since the fstat
        parts, got = [], 0
        while got < limit:
            chunk = os.read(fd, min(limit - got, max(size - got, 1 << 16)))
            if not chunk:
                break
            parts.append(chunk)
            got += len(chunk)
    finally:
        os.close(fd)
    if got > max_bytes:
        held = f"{size:,} bytes" if size > max_bytes else f"more than {max_bytes:,} bytes"
        raise _refusal(error, what, path, f"holds {held}, more than any {what} can ({max_bytes:,})", fix)
    return parts[0] if len(parts) == 1 else b"".join(parts)


class FileSystem:
    """Real file-system effects. Subclass and override to inject faults."""

    def open_append(self, path: str, *, create: bool) -> int:
        """Open ``path`` for writing (creating it if ``create``); returns a raw fd. Never through a symbolic
        link (ELOOP), nor waiting on a FIFO (the writable open checked the segments: ``segments.recover``)."""
        flags = os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_CREAT | os.O_EXCL if create else 0)
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
        Whatever lies at ``tmp_path`` (the leftover of a crashed write; or a link, a FIFO someone put there) is
        removed, and the file is created anew (``O_EXCL``): never written through a link out of the store,
        never waited on.
        """
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp_path)
            fd = os.open(tmp_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
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
        """Remove the directory ``path`` and everything in it; nothing if it does not exist. Anything else
        there (a file, a FIFO, a symbolic link: never followed) is removed too, since the callers' paths are
        a store's own scratch directories (``index.repair-tmp``, ``remote-snapshot.tmp``)."""
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return
        if not stat.S_ISDIR(st.st_mode):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            return
        shutil.rmtree(path, ignore_errors=True)


DEFAULT = FileSystem()
