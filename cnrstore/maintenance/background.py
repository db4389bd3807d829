"""Background compaction: a worker thread in the writing process that carries out a CompactionPolicy.

At start (a writable open: it catches up on what the history asks for, e.g. versions a retention rule
should have dropped in an earlier process) and after each commit the store wakes the worker; it asks the
policy for a plan on the current history and materializes a baseline at the newest version, drops
versions and collects garbage as planned. ``close()`` runs the step a commit asked for and the worker
has not started yet (unless told to skip it), so that a job that saves once and closes still applies its
policy; what is skipped (or cut short by an exit) is caught up by the next writable open.
It appends to a segment of its own, so the trainer's next checkpoint never waits for it; the two
share only the cores and the (short) index commits. Failures are logged and kept in ``errors``; a
failed step leaves the store as it was (every step commits atomically or not at all), and the worker
keeps running: the next commit wakes it and it tries again. The store surfaces failures through
``Store.compaction_error``, ``stats()["compaction_errors"]`` and, once, ``Store.close()``.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

from . import compaction
from ..engine import fs
from .rate_limit import RateLimiter
from ..errors import StorageFull
from ..policy.compaction import CompactionPolicy

if TYPE_CHECKING:
    from ..engine.core import Engine

log = logging.getLogger("cnrstore.maintenance.background")
#: Failures kept in ``BackgroundCompactor.errors``; older ones are only counted (and logged).
KEEP_ERRORS = 8


class BackgroundCompactor:
    """Runs ``policy`` on the store of ``engine`` at start and after commits, in a daemon thread.
    ``close()`` stops it cleanly."""

    def __init__(self, engine: "Engine", policy: CompactionPolicy):
        self._engine = engine
        self.policy = policy
        #: the newest failures, oldest first (at most ``KEEP_ERRORS``: each holds its traceback's frames)
        self.errors: list[BaseException] = []
        self.failures = 0  # failed steps since start
        self.reported = 0  # failures the store has raised already (close() raises the rest once)
        self.steps = 0  # policy runs that did something (for tests and stats)
        self.merges: list = []  # the newest merge steps' MergeReports that merged something (tests, benchmarks)
        self._rate: RateLimiter | None = None
        self._wake = threading.Condition()
        self._pending = True  # the first step: catch up on what the history asks for
        self._stopping = False
        self._halt = False  # stop before the next phase of the step in flight (an exit that cannot wait)
        self._idle = True
        self._thread = threading.Thread(target=self._run, name="cnrstore-compactor", daemon=True)
        self._thread.start()

    def notify(self) -> None:
        """A version was committed: look at the policy again (soon, in the worker)."""
        with self._wake:
            self._pending = True
            self._wake.notify_all()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until no work is pending or running (for tests and benchmarks)."""
        with self._wake:
            return self._wake.wait_for(lambda: (not self._pending and self._idle) or self._stopping, timeout)

    @property
    def pending(self) -> bool:
        """Whether a step was asked for (a commit, or the catch-up at start) and has not started yet."""
        with self._wake:
            return self._pending

    def close(self, finish: bool = True, timeout: float | None = None) -> bool:
        """Stop the thread once the step in flight (if any) has finished.

        ``finish=True`` first runs the step that was asked for and has not started (a commit since the
        last step began): at most the step in flight plus one more, planned on the final history.
        ``finish=False`` skips it (the next writable open with a policy catches up). Returns whether the
        thread has stopped; with a ``timeout`` that ran out it is still working, and is told to stop
        before the next phase (materialize, drop, collect) of its step: every phase commits on its own,
        so what it leaves undone is only not done yet. Idempotent.
        """
        with self._wake:
            self._stopping = True
            if not finish:
                self._pending = False
            self._wake.notify_all()
        try:
            self._thread.join(timeout)
        except BaseException:  # e.g. KeyboardInterrupt while waiting: stop as early as is safe
            self.halt()
            raise
        if self._thread.is_alive():
            self.halt()
            return False
        return True

    def halt(self) -> None:
        """Stop at the next phase boundary and start no further step (an exit that cannot wait)."""
        with self._wake:
            self._halt = self._stopping = True
            self._pending = False
            self._wake.notify_all()

    def _limiter(self) -> RateLimiter:
        """The merges' rate limiter (the store's ``Options.merge_rate_bytes``), kept across steps."""
        if self._rate is None:
            self._rate = RateLimiter(self._engine.options.merge_rate_bytes)
        return self._rate

    def _run(self) -> None:
        while True:
            with self._wake:
                self._wake.wait_for(lambda: self._pending or self._stopping)
                if not self._pending:  # stopping, and nothing asked for (close(finish=True) runs what was)
                    self._idle = True
                    self._wake.notify_all()
                    return
                self._pending = False
                self._idle = False
            try:
                self._step()
            except BaseException as exc:  # noqa: BLE001 - a worker must not die silently
                self.errors.append(exc)
                del self.errors[:-KEEP_ERRORS]
                self.failures += 1
                log.exception("background compaction step failed; the store is unchanged by it")
            finally:
                with self._wake:
                    self._idle = True
                    self._wake.notify_all()

    def _step(self) -> None:
        with self._engine.maintenance() as m:
            written = m.take_written_blocks()  # before the history: a later commit's blocks wait for the next step
            history = m.history()
            if history.versions and m.options.merge_trigger is not None and not self._halt:
                # merges first: they keep the newest version's reads bounded (merge.py)
                try:
                    report = compaction.merge_chains(m, history.versions[-1].version, written,
                                                     limiter=self._limiter(), halted=lambda: self._halt)
                except BaseException:
                    m.look_at_every_block()  # the next step looks again at what this one could not merge
                    raise
                if report.blocks_merged:
                    self.merges.append(report)
                del self.merges[:-KEEP_ERRORS]
            plan = self.policy.plan(history)
            if not (plan.materialize or plan.drop):
                return
            # each phase commits on its own: a halt between them leaves the rest to the next open
            if plan.materialize and not self._halt:
                compaction.materialize(m, history.versions[-1].version)
            if plan.drop and not self._halt:
                compaction.drop_versions(m, set(plan.drop))
            if plan.collect and not self._halt:
                fs.pause_point("background_before_collect")
                report = compaction.collect(m)
                if report.incomplete:  # a full disk stopped the copies: surface it like a failed step
                    raise StorageFull(f"background gc: {report.incomplete}")
            self.steps += 1
