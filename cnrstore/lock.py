"""One writing process per store: an advisory ``flock`` on the LOCK file, which holds the pid."""

from __future__ import annotations

import fcntl
import os

from . import errors, filenames


class ProcessLock:
    """Exclusive lock of a store for one writing process (also exclusive within a process)."""

    def __init__(self, root: str):
        self.path = filenames.lock_path(root)
        self._fd: int | None = None

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_pid(fd)
            os.close(fd)
            who = f"process {holder}" if holder else "another process"
            raise errors.StoreLocked(
                f"store {os.path.dirname(self.path)!r} is held for writing by {who} (pid {holder}); "
                "close it there, or open with readonly=True to read alongside it",
                pid=holder,
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.ftruncate(fd, 0)  # a stale pid must not be reported later
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode().strip()
        return int(text) if text else None
    except (OSError, ValueError):
        return None
