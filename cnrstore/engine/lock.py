"""One writing process per store: an exclusive ``flock`` on the store DIRECTORY; LOCK holds the pid.

The lock is taken on the directory itself, not on a file in it: a file can be unlinked (or replaced)
while locked, and a second writer would then lock the new inode and get in beside the first. A store
directory holds files, so it cannot be removed while open, and renaming it keeps its inode (the
holder checks at each commit that the path still names the directory it locked: ``verify``). The LOCK
file is only where the holder writes its pid for ``StoreLocked`` messages; it is also flocked, which
keeps out a writer of an older cnrstore that locks only the file. The holder's pid for the message comes
from /proc/locks (true even when LOCK was deleted), else from LOCK.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from typing import Callable

from .. import errors
from . import filenames, fs


#: What to do about a LOCK that is not a regular file (it holds only a pid: removing it loses nothing).
LOCK_FIX = "a store's files are regular files: remove it (the next writer makes a new one)"


class ProcessLock:
    """Exclusive lock of a store for one writing process (also exclusive within a process)."""

    def __init__(self, root: str):
        self.root = root
        self.path = filenames.lock_path(root)
        self._dir_fd: int | None = None
        self._fd: int | None = None
        self.dir_locked = True  #: False where the file system cannot flock the directory (LOCK is the lock)

    def acquire(self, *, write_pid: bool = True, wait: Callable[[], bool] | None = None,
                timeout: float = 0.0) -> None:
        """Lock the store or raise StoreLocked (PermissionDenied if the process may not write it).

        While another process holds it and ``wait()`` is true, retry for up to ``timeout`` seconds
        (a creator waits out another's creation). ``write_pid=False`` locks the directory only and
        creates no file (store creation checks the directory's contents under the lock first).
        """
        what = f"cannot open store {self.root!r} for writing"
        try:
            dir_fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except PermissionError as exc:
            raise fs.permission_denied(exc, what, self.root, needs="read and search (r-x)") from None
        deadline = time.monotonic() + timeout
        unknown = 0  # tries that found no holder: it may just have let go, so try again a few times
        while True:
            try:
                fcntl.flock(dir_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if wait is not None and wait() and time.monotonic() < deadline:
                    time.sleep(0.01)
                    continue
                holder = _flock_holder(dir_fd) or _read_pid(self.path)
                if holder is None and unknown < 20:
                    unknown += 1
                    time.sleep(0.005)
                    continue
                os.close(dir_fd)
                raise _locked(self.root, holder) from None
            except OSError:
                # a file system that cannot flock a directory (NFS turns flock into an fcntl lock, which
                # needs a writable fd): lock LOCK alone, as before, and check at each commit that it was
                # not deleted or replaced (verify)
                self.dir_locked = False
                write_pid = True
                break
        self._dir_fd = dir_fd
        if write_pid:
            try:
                self.lock_pid_file()
            except BaseException:
                self.release()
                raise

    def lock_pid_file(self) -> None:
        """Lock LOCK too and write this process's pid there (``acquire`` does it unless write_pid=False)."""
        if self._fd is not None:
            return
        try:
            # never through a link or into a FIFO or device someone left at LOCK: truncating and writing the pid
            # would go to the link's target (outside the store), and opening a FIFO or device may block or act
            fd = fs.open_regular(self.path, "the lock file", LOCK_FIX, flags=os.O_RDWR | os.O_CREAT)
        except OSError as exc:
            if exc.errno in fs.NO_PERMISSION:
                raise fs.permission_denied(exc, f"cannot open store {self.root!r} for writing", self.path) from None
            raise
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # a writer of an older cnrstore, which locks only this file
            holder = _read_pid(self.path)
            os.close(fd)
            raise _locked(self.root, holder) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def verify(self) -> None:
        """Raise StoreMoved unless the store's path still names the directory this lock holds (and, where
        LOCK is the lock, StoreLocked if LOCK was deleted or replaced).

        Called before each commit: a writer whose directory was renamed away would otherwise create its
        next segment files under the old path (perhaps in another store made there since).
        """
        if self._dir_fd is None:
            return
        if not self.dir_locked and self._fd is not None and not fs.same_file(self._fd, self.path):
            raise errors.StoreLocked(
                f"the LOCK file of store {self.root!r} was deleted or replaced while this process held it, on "
                "a file system where the store directory cannot be locked: another process may be writing "
                "the store now, so nothing more is committed here; close this store and reopen it",
                pid=_read_pid(self.path))
        held = os.fstat(self._dir_fd)
        try:
            st = os.stat(self.root)
            same = (st.st_dev, st.st_ino) == (held.st_dev, held.st_ino)
        except OSError:
            same = False
        if not same:
            try:
                now = os.readlink(f"/proc/self/fd/{self._dir_fd}")
            except OSError:
                now = "an unknown path"
            raise errors.StoreMoved(
                f"store {self.root!r} was moved or removed while open for writing (its directory is now at "
                f"{now!r}); nothing more can be committed there: close the store and reopen it at its new path")

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.ftruncate(fd, 0)  # a stale pid must not be reported later
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
        if self._dir_fd is not None:
            fd, self._dir_fd = self._dir_fd, None
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)


class SharedLock:
    """A shared ``flock`` on a store directory, held briefly by a reader while it opens a read cache (the remote
    tier): a process installing a newer snapshot there takes the exclusive lock (``ProcessLock``), so that no
    reader opens the index in the instant it is being swapped. Release it once the index is open."""

    def __init__(self, root: str, timeout: float):
        self._fd: int | None = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    holder = _flock_holder(self._fd)
                    self.release()
                    raise _locked(root, holder) from None
                time.sleep(0.01)
            except OSError:  # a file system that cannot flock a directory: no install lock to honour
                return

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)


def describe_holder(pid: int | None) -> str:
    """Who holds a store, for a message: "process 1234 (python train.py --steps 10)" with the holder's
    command line where /proc shows it (cut to about 80 characters), "process 1234" where it does not, and
    "another process (its pid is unknown)" without a pid."""
    if not pid:
        return "another process (its pid is unknown)"
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = [a.decode(errors="replace") for a in f.read(4096).split(b"\0") if a]
    except OSError:
        argv = []
    if not argv:
        return f"process {pid}"
    argv[0] = os.path.basename(argv[0])
    cmd = " ".join(argv)
    return f"process {pid} ({cmd if len(cmd) <= 80 else cmd[:77] + '...'})"


def _locked(root: str, holder: int | None) -> errors.StoreLocked:
    return errors.StoreLocked(
        f"store {root!r} is held for writing by {describe_holder(holder)}; close it there (or wait for that "
        "process to finish), or open with readonly=True to read alongside it",
        pid=holder,
    )


def _read_pid(path: str) -> int | None:
    """The pid in LOCK, or None (no LOCK, not a regular file, not a pid)."""
    try:
        fd = fs.open_regular(path, "the lock file", LOCK_FIX)
    except (OSError, errors.CnrError):
        return None
    try:
        text = os.read(fd, 32).decode().strip()
        return int(text) if text else None
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)


def _flock_holder(fd: int) -> int | None:
    """Pid of the process holding a flock on ``fd``'s inode, from /proc/locks (None if not found)."""
    st = os.fstat(fd)
    dev = (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)
    try:
        with open("/proc/locks") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split()  # "1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF" (waiters: "1: -> FLOCK")
        if len(fields) < 6 or fields[1] != "FLOCK" or fields[3] != "WRITE":
            continue
        try:
            major, minor, ino = fields[5].split(":")
            if (int(major, 16), int(minor, 16), int(ino)) == dev and int(fields[4]) > 0:
                return int(fields[4])
        except ValueError:
            continue
    return None
