"""Copy points behind the commits: the bucket's lag, and the thread that keeps it short.

A store with a remote tier makes a copy point after each commit (remote.py). Inline, the commit's thread
waits for it: a trainer's save queue then waits for the bucket whenever uploads are slower than saves. Behind
the commits (``CopyPointsBehind``), a commit only marks a copy point due and returns; one thread of the store's
makes copy points while any is due. They coalesce: a copy point uploads what the index holds when it starts,
so every commit made while the previous one ran is carried by the next, and the bucket skips the versions in
between (it lists the newest committed one once the copy point ends).

``BucketLag`` counts the commits the bucket does not hold yet, whichever way the copy points run: the lag in
versions, and in seconds (the age of the oldest commit not in the bucket; 0 when the bucket is current). A
trainer bounds it (``cnrstore.torch.Checkpointer(remote_lag_s=...)``): past the bound a save waits, or raises
``RemoteLagging``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Callable

log = logging.getLogger("cnrstore.engine.remote")

__all__ = ["BucketLag", "CopyPointsBehind"]

#: How often a save waiting for the bucket logs that it still waits (seconds).
WAIT_LOG_S = 60.0


class BucketLag:
    """The commits not in the bucket yet: ``committed(txn)`` after each commit (the index transaction it
    committed in), ``copied(txn)`` after each copy point (the transaction its snapshot read). Thread-safe;
    ``wait_within(bound_s)`` blocks until the lag is at most ``bound_s`` seconds."""

    def __init__(self):
        self._cond = threading.Condition()
        self._pending: deque[tuple[int, float]] = deque()  # (txn, monotonic time) of commits not copied
        self._copied_txn = -1

    def committed(self, txn: int) -> None:
        with self._cond:
            if txn > self._copied_txn:
                self._pending.append((txn, time.monotonic()))

    def copied(self, txn: int) -> None:
        with self._cond:
            self._copied_txn = max(self._copied_txn, txn)
            while self._pending and self._pending[0][0] <= txn:
                self._pending.popleft()
            self._cond.notify_all()

    def wake(self) -> None:
        """Wake the waiters (the store closes, or lost its prefix: they look again)."""
        with self._cond:
            self._cond.notify_all()

    def versions(self) -> int:
        with self._cond:
            return len(self._pending)

    def seconds(self) -> float:
        with self._cond:
            return self._seconds()

    def _seconds(self) -> float:
        return time.monotonic() - self._pending[0][1] if self._pending else 0.0

    def wait_within(self, bound_s: float, stop: Callable[[], BaseException | None], what: str) -> float:
        """Block until the oldest commit not in the bucket is at most ``bound_s`` seconds old; returns the
        seconds waited. ``stop()`` is asked at each wake-up: an exception it returns is raised (the store
        closed, or lost its prefix). Logs a warning every ``WAIT_LOG_S`` while it waits (``what``: whose
        wait)."""
        start = time.monotonic()
        logged = start
        with self._cond:
            while self._pending and self._seconds() > bound_s:
                error = stop()
                if error is not None:
                    raise error
                now = time.monotonic()
                if now - logged >= WAIT_LOG_S:
                    logged = now
                    log.warning("cnrstore: %s has waited %.0f s for the bucket: %d version(s) not uploaded, the "
                                "oldest %.0f s ago (remote_lag_s=%g)", what, now - start, len(self._pending),
                                self._seconds(), bound_s)
                self._cond.wait(timeout=1.0)
        return time.monotonic() - start


class CopyPointsBehind:
    """One daemon thread making copy points (``copy_point()``) while any is ``due()``; a failure is given to
    ``failed(exc)``, which logs it and returns whether to try again (not once the store lost its prefix): then
    at ``retry_at()`` (a monotonic time), or at the next ``due()`` if that is later. ``stop()`` lets the copy
    point in flight end, then ends the thread."""

    def __init__(self, copy_point: Callable[[], None], failed: Callable[[BaseException], bool],
                 retry_at: Callable[[], float], name: str):
        self._copy_point = copy_point
        self._failed = failed
        self._retry_at = retry_at
        self._cond = threading.Condition()
        self._due = False
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def due(self) -> None:
        with self._cond:
            self._due = True
            self._cond.notify_all()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and (not self._due or time.monotonic() < self._retry_at()):
                    wait = None if not self._due else max(0.01, self._retry_at() - time.monotonic())
                    self._cond.wait(timeout=wait)
                if self._stopping:
                    return
                self._due = False
            try:
                self._copy_point()
            except BaseException as exc:  # noqa: BLE001 - the thread outlives any failure: retried later
                again = self._failed(exc)
                with self._cond:
                    self._due = self._due or again  # (what was due still is)
