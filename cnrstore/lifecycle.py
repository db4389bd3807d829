"""A store's life in this process: what ``close()`` and the interpreter's exit wait for, and how each ends.

A writable store may have background work writing into it: the saves a ``cnrstore.torch`` (or
distributed) checkpointer has returned from (registered as :class:`PendingWork`), and the background
compactor's step. ``close()`` waits for both, then closes the engine. The interpreter's exit does the same
for every writable store left open (store.py's ``atexit`` hook, within ``EXIT_WAIT_S``), but gives up at
its deadline or at an interrupt: the store is then *abandoned*, left as ``kill -9`` would leave it (every
committed version intact; the next writable open truncates the torn tail), never closed under a thread
still writing to it. A forked child never closes its parent's store.

``Store`` (store.py) owns one :class:`StoreLifecycle` and delegates to it.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import weakref

from .errors import CompactionFailed

__all__ = ["PendingWork", "StoreLifecycle", "writable_open"]

log = logging.getLogger("cnrstore.store")

_open: "weakref.WeakSet[StoreLifecycle]" = weakref.WeakSet()  # writable stores of this process not closed yet


def writable_open() -> list["StoreLifecycle"]:
    """The lifecycles of this process's writable stores still open, by path (what the exit hook closes)."""
    return sorted(_open, key=lambda life: life.path)


class PendingWork:
    """What ``Store.add_pending_work`` takes (for sibling packages): background work writing into a store,
    which ``close()`` and the interpreter's exit wait for. Subclass it or provide the same three methods."""

    def finish(self, timeout: float | None) -> bool:
        """Wait for the work in flight, for good (None) or at most ``timeout`` seconds; whether none is left.
        An interrupt while waiting may cancel the work (it then commits nothing) and is re-raised."""
        raise NotImplementedError

    def cancel(self) -> None:
        """Tell the work in flight to stop at its next step, committing nothing (an exit that cannot wait)."""

    def failure(self) -> BaseException | None:
        """The failure of background work that nobody has reported yet (logged at exit), or None."""
        return None


class StoreLifecycle:
    """One open store's background work and its end (module doc). ``engine``: the store's open engine;
    ``compactor``: its ``BackgroundCompactor``, or None (set by ``cnrstore.open`` with a policy)."""

    def __init__(self, path: str, engine, *, writable: bool):
        self.path = path
        self.engine = engine
        self.compactor = None
        self.closed = False
        self.abandoned = False  # an exit gave up on work in flight: nothing may close the engine under it
        #: the PendingWork of background saves into this store: close() and the exit first wait for them
        self.savers: "weakref.WeakSet" = weakref.WeakSet()
        self.pid = os.getpid()  # a forked child's exit must not close (and unlock) its parent's store
        if writable:
            _open.add(self)

    def add_pending_work(self, work: PendingWork) -> None:
        self.savers.add(work)

    def finish_saves(self, deadline: float | None) -> bool:
        """Wait for every registered saver's background save (until ``deadline``, a time.monotonic(),
        or for good); returns whether all finished."""
        for saver in list(self.savers):
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not saver.finish(timeout):
                return False
        return True

    def close(self, finish_compaction: bool) -> None:
        """``Store.close()``: the saves in flight, the compaction step in flight (and, with
        ``finish_compaction``, the one asked for), the engine; then a background-compaction failure not
        reported yet is raised (CompactionFailed). Idempotent."""
        if self.closed:
            return
        self.finish_saves(None)
        if self.compactor is not None:
            self.compactor.close(finish=finish_compaction)  # the step in flight, then the one asked for
        self._close_engine()
        self.raise_compaction_failure()

    def _close_engine(self) -> None:
        self.closed = True
        _open.discard(self)
        self.engine.close()

    def close_at_exit(self, deadline: float, exit_wait_s: float) -> None:
        """The interpreter is exiting with this store open: finish its saves and compaction as close()
        does, but give up at ``deadline`` or at an interrupt (``abandon``)."""
        if self.closed or self.abandoned or self.pid != os.getpid():
            return
        what = "waiting"
        try:
            if not self.finish_saves(deadline):
                return self.abandon("a checkpoint save still running", exit_wait_s)
            if self.compactor is not None:
                what = "compacting"
                if not self.compactor.close(finish=True, timeout=max(0.0, deadline - time.monotonic())):
                    return self.abandon("the background compaction step still running", exit_wait_s)
            writer = self.engine.open_writer
            if writer is not None:  # a thread of this program still writing: abort it from here would race it
                return self.abandon(f"checkpoint {writer.version} still open", exit_wait_s)
        except KeyboardInterrupt:
            return self.abandon(f"interrupted while {what}", exit_wait_s)
        for saver in list(self.savers):  # a save that failed while the exit waited: nobody else will say so
            failed = saver.failure()
            if failed is not None:
                log.warning("cnrstore: a background save into store %r failed before the exit: %s: %s; the "
                            "versions committed before it are intact", self.path, type(failed).__name__, failed)
        self._close_engine()
        try:
            self.raise_compaction_failure()
        except CompactionFailed as exc:  # nobody is left to catch it at exit: say it
            log.warning("cnrstore: %s", exc)

    def abandon(self, why: str, exit_wait_s: float) -> None:
        """Leave the store as ``kill -9`` would: stop the compactor and tell the saves to stop, close nothing."""
        self.abandoned = True
        _open.discard(self)
        if self.compactor is not None:
            self.compactor.halt()
        for saver in list(self.savers):
            saver.cancel()
        log.warning("cnrstore: exiting with store %r not closed (%s, after EXIT_WAIT_S=%gs or an interrupt): it "
                    "is left as kill -9 would leave it; every committed version is intact, and the next "
                    "writable open truncates what was not committed", self.path, why, exit_wait_s)

    @property
    def compaction_error(self) -> BaseException | None:
        errors = self.compactor.errors if self.compactor is not None else ()
        return errors[-1] if errors else None

    def wait_for_compaction(self, timeout: float | None) -> bool:
        return self.compactor is None or self.compactor.wait_idle(timeout)

    def raise_compaction_failure(self) -> None:
        """CompactionFailed for the background failures not reported yet (once), naming the newest."""
        compactor = self.compactor
        if compactor is None or compactor.failures <= compactor.reported:
            return
        new = compactor.failures - compactor.reported
        compactor.reported = compactor.failures
        cause = compactor.errors[-1]
        raise CompactionFailed(
            f"background compaction of store {self.path!r} failed {new} time(s); the newest failure: "
            f"{type(cause).__name__}: {cause}. Every committed version is intact (a failed step commits "
            "nothing), but read chains may be longer and space not reclaimed: fix the cause (e.g. free "
            "space), then run `cnrstore compact`/`cnrstore gc` or reopen with compaction on") from cause

    def collected(self) -> None:
        """The Store was garbage-collected while open: close it, unless the interpreter is finalizing
        (background threads are frozen by then, and close() would wait for them forever; the exit hook
        has closed or abandoned every writable store already) or an exit abandoned it."""
        if sys.is_finalizing() or self.abandoned or self.closed:
            return
        try:
            self.close(finish_compaction=True)
        except Exception:
            pass
