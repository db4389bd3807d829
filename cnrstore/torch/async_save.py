"""The asynchronous half of a ``Checkpointer`` save: the host copies its snapshot holds, the write of that
snapshot into the store on a background thread, and the handles the trainer and the store wait on.

``save()`` stalls the trainer only for the snapshot (``staging``: device rows into host buffers, enqueued
on a side stream for a CUDA device); the version is then written by :func:`write` while training goes on, and :class:`PendingSave` says when it has committed.
Saves queue: :class:`SaveQueue` holds the snapshots not yet written, writes them one after the other in
save order, and counts the host bytes they hold, so that a save waits only when the bound would be
passed. :class:`WeakPendingWork` is how ``Store.close()`` and the interpreter's exit find that work.
"""

from __future__ import annotations

import collections
import threading
import time
import weakref
from dataclasses import dataclass, field

import numpy as np
import torch

from ..engine import fs
from ..errors import SaveSkipped
from . import mc_saves
from .payload import DENSE_PREFIX, STATE_BLOB
from .streamed import StreamedTable
from .keyed_save import KeyedJob, write_job as write_keyed

__all__ = ["PendingSave", "SaveQueue", "SaveReport", "WeakPendingWork", "write"]


@dataclass
class SaveReport:
    """What one save wrote: rows per table (weights and row-wise optimizer state), whether it was a
    baseline or a priority save (``save(top=...)``), how long ``save()`` held the trainer (``stall_s``,
    including any wait for room in the save queue) and the host bytes its snapshot holds until written
    (``host_bytes``; a streamed save's rows preserved during its write are added once it has ended).
    ``streamed``: the tables this save wrote from the live tensors (``streamed``), copying aside only the
    rows training changed meanwhile (``preserved_bytes``: the most they held at once). Once the save has
    committed: its ``version``, how long the background write took (``write_s``, from its start to the
    commit), how long the save trailed ``save()`` (``lag_s``: from the end of its snapshot to its commit,
    queueing behind earlier saves included; what a ``kill -9`` in that window loses), the bytes the version
    appended to the store's log (``bytes_written``, ``VersionInfo.bytes``) and the versions the
    Checkpointer's retention dropped after it (``dropped``). ``superseded``: the steps of the queued saves this
    one superseded (``on_backpressure="coalesce"``), whose rows it writes too. On a store with a remote tier,
    as ``save()`` began: how far the bucket trailed the committed versions (``bucket_lag_s``: the age of the
    oldest one it lacked; ``bucket_lag_versions``: how many; None without a bucket) and how long ``save()``
    waited for it (``bucket_wait_s``, past ``remote_lag_s``; part of ``stall_s``)."""

    step: int | None
    baseline: bool
    rows: dict[str, int] = field(default_factory=dict)
    stall_s: float = 0.0
    version: int | None = None
    priority: bool = False
    host_bytes: int = 0
    write_s: float = 0.0
    bytes_written: int | None = None
    dropped: list[int] = field(default_factory=list)
    streamed: list[str] = field(default_factory=list)
    preserved_bytes: int = 0
    lag_s: float = 0.0
    superseded: list = field(default_factory=list)
    bucket_lag_s: float | None = None
    bucket_lag_versions: int | None = None
    bucket_wait_s: float = 0.0


class PendingSave:
    """A save whose snapshot is taken and whose write runs in the background. ``seq``: which save of its
    Checkpointer it is (1, 2, ...: error messages name a save by it)."""

    def __init__(self, report: SaveReport, seq: int = 0, picks: list | None = None):
        self.report = report
        self.seq = seq
        self.picks = picks  # per table, the rows it writes (None: every row): what a save superseding it adds
        self.created = time.perf_counter()  # the end of its snapshot (the lag is counted from here)
        self._done = threading.Event()
        self._version: int | None = None
        self._error: BaseException | None = None
        self._reported = False
        self._cancelled = False  # an interrupt while waiting for it: abort at the next step, commit nothing

    def done(self) -> bool:
        """True once the background write has committed or failed."""
        return self._done.is_set()

    def wait(self) -> int:
        """Block until the write ends; return the committed version, or re-raise its failure (the
        exception the store raised)."""
        self._done.wait()
        if self._error is not None:
            self._reported = True
            raise self._error
        assert self._version is not None
        return self._version

    def finish(self, version: int | None, error: BaseException | None = None) -> None:
        """Note how the write ended -- the ``version`` it committed, or its failure ``error`` -- and wake
        whoever waits for it (the write's last step)."""
        self._version, self._error = version, error
        self._done.set()

    def wait_done(self, timeout: float | None) -> bool:
        """Block until the write ends (or ``timeout`` seconds); whether it has ended. Raises nothing of its
        own: the write's failure is for :meth:`wait` and the next save."""
        return self._done.wait(timeout)

    def cancel(self) -> None:
        """Make the write abort at its next step: nothing of it commits (an interrupt while waiting for it)."""
        self._cancelled = True

    def failure(self) -> BaseException | None:
        """The write's failure once it has ended (None while it runs, or if it committed); unlike
        :meth:`wait`, this does not count as reporting it."""
        return self._error if self._done.is_set() else None

    def describe(self) -> str:
        """``"save #3 (step 120)"``: this save, for messages."""
        return f"save #{self.seq} (step {self.report.step})"

    @property
    def failure_reported(self) -> bool:
        """Whether :meth:`wait` has raised this save's failure to someone."""
        return self._reported


class WeakPendingWork:
    """Background work of ``owner`` as a store's ``PendingWork`` (``Store.add_pending_work``): what
    ``store.close()`` and the interpreter's exit wait for, cancel or report. It refers to its owner weakly,
    as the store refers to it: an owner that is gone has no work in flight (the work's thread holds it).
    ``finish(owner, timeout)``, ``cancel(owner)`` and ``failure(owner)`` do the work's part for a live owner.
    *For sibling packages*: the Checkpointer's saves and the DistributedCheckpointer's global commits."""

    def __init__(self, owner, finish, cancel=None, failure=None):
        self._owner = weakref.ref(owner)
        self._finish, self._cancel, self._failure = finish, cancel, failure

    def finish(self, timeout: float | None) -> bool:
        owner = self._owner()
        return True if owner is None else self._finish(owner, timeout)

    def cancel(self) -> None:
        owner = self._owner()
        if owner is not None and self._cancel is not None:
            self._cancel(owner)

    def failure(self) -> BaseException | None:
        owner = self._owner()
        return None if owner is None or self._failure is None else self._failure(owner)


def write(store, pending: PendingSave, step, meta, row_jobs, dense: dict, blob: np.ndarray,
          after: PendingSave | None = None, after_commit=None, staged=None) -> None:
    """Write one snapshot as a version of ``store`` (the body of a save's background thread): ``row_jobs``
    ``(table, rows, host values, codec or None)``, the ``dense`` model arrays (under ``DENSE_PREFIX``) and
    the payload ``blob`` (``STATE_BLOB``). First waits for ``staged`` (a ``staging.Staged``, if given):
    the host values and dense arrays hold the snapshot only once its copies have landed, so nothing of them
    is read before (and the write ends, and its buffers are lent again, only after they have landed, even
    when it fails). Starts once ``after`` (the save queued before, if any) has ended;
    if that one did not commit, a snapshot that is no baseline is not written (:class:`SaveSkipped`: it is
    an increment on rows that never reached the store). Notes the version in ``pending``, or its failure. A
    cancelled ``pending`` aborts at its next step with KeyboardInterrupt. Once committed, fills in the
    report's ``version``, ``write_s`` and ``bytes_written`` and calls ``after_commit(store, report)`` (if
    given; it must raise nothing: the version is committed). Marks ``pending`` done in every case (after
    ``after_commit``); raises nothing."""
    def check():  # an interrupt cancelled this save while the trainer waited for it: abort, commit nothing
        if pending._cancelled:
            raise KeyboardInterrupt(f"the save of step {step} was cancelled by an interrupt while waiting "
                                    "for it; nothing of it was committed")

    version, error = None, None
    streams = [job for job in row_jobs if isinstance(job, StreamedTable)]
    try:
        if staged is not None:
            staged.wait()  # the device-to-host copies have landed: the buffers hold the snapshot
        if after is not None:
            while not after.wait_done(0.05):  # (polled: a cancel must not wait for the one before)
                check()
            before = after.failure()
            if before is not None and not pending.report.baseline:
                raise SaveSkipped(
                    f"{pending.describe()} was not written: {after.describe()}, queued before it, did not "
                    f"commit ({type(before).__name__}: {before}), and this one holds only the rows changed "
                    "since then; nothing of it was committed, the next save() writes a baseline") from before
        check()
        start = time.perf_counter()
        with store.checkpoint(step, meta) as ck:
            for job in row_jobs:
                check()
                if isinstance(job, StreamedTable):
                    _write_streamed(ck, job, check, step)
                    continue
                if isinstance(job, KeyedJob):  # (a KeyedEmbedding's ids: keyed_save.py)
                    write_keyed(store, ck, job)
                    continue
                name, rows, values, codec = job
                if rows.size:
                    ck.put_rows(name, rows, values.numpy(), codec=codec)
            dense, keyed = mc_saves.put_groups(ck, store, dense)  # MCH / MPZCH buffers: their changed ids
            for key, arr in dense.items():
                check()
                ck.put_dense(DENSE_PREFIX + key, arr)
            ck.put_dense(STATE_BLOB, blob)
            check()
        mc_saves.written(store, ck.version, keyed)
        version = pending.report.version = ck.version
        pending.report.write_s = time.perf_counter() - start
        pending.report.lag_s = time.perf_counter() - pending.created
    except BaseException as exc:  # re-raised by wait() and the next save()
        if hasattr(exc, "add_note") and not isinstance(exc, SaveSkipped):
            exc.add_note(f"(cnrstore.torch: the background write of {pending.describe()} failed; the next "
                         "save() re-raises this once, without taking a snapshot, and the one after writes "
                         "a full baseline)")
        error = exc
    finally:
        for s in streams:  # (committed or not: training stops preserving rows for it)
            s.close()
        if streams:
            pending.report.preserved_bytes = sum(s.peak_bytes for s in streams)
            pending.report.host_bytes += pending.report.preserved_bytes
        try:
            if version is not None:
                _note_commit(store, pending.report, after_commit)
        finally:
            pending.finish(version, error)


def _write_streamed(ck, stream: StreamedTable, check, step=None) -> None:
    """Write a streamed save of one table (``streamed``) into the open version ``ck``: chunk by chunk, in row
    order, each source's rows as of the save (``StreamedTable.take``), each chunk checked against their
    fingerprints at ``save()`` first (``StreamedTable.check``: ``SaveRefused`` if one changed unseen)."""
    bufs: list = []
    for start, stop in stream.chunks():
        n = stop - start
        if not bufs or bufs[0].shape[0] < n:
            bufs = [torch.empty((n, src.shape[1]), dtype=torch.float32) for _n, src, _c in stream.sources]
        chunk = [b[:n] for b in bufs]
        stream.take(start, stop, chunk)
        stream.check(start, stop, chunk, step)  # (refused if a row changed unseen)
        rows = stream.row_ids(start, stop)
        for (name, _src, codec), values in zip(stream.sources, chunk):
            ck.put_rows(name, rows, values.numpy(), codec=codec)  # (encoded and appended now: bufs are reused)
        fs.pause_point("streamed_chunk_written", stream, stop)  # (tests: training between two chunks)
        check()


def _note_commit(store, report: SaveReport, after_commit) -> None:
    """The committed version's bytes into ``report``, then ``after_commit``."""
    try:
        latest = store.latest()  # this version: the queue's worker is the store's one committer meanwhile
        if latest is not None and latest.version == report.version:
            report.bytes_written = latest.bytes
    except Exception:  # (a count for the report only: the version is committed whatever happens here)
        pass
    if after_commit is not None:
        after_commit(store, report)


class SaveQueue:
    """The saves of one Checkpointer whose snapshots are taken and not yet written, oldest first, with the
    host bytes each snapshot holds. :meth:`start` queues a save's write; one worker thread writes them in
    order (so versions commit in save order, and a save does not pay for starting a thread: under load
    that took tens of ms); it ends after ``IDLE_S`` without work and the next save starts another. The
    owner (the trainer's thread) takes the ended saves out with :meth:`reap`, which is when their bytes
    stop counting."""

    IDLE_S = 2.0

    def __init__(self):
        self._saves: list[tuple[PendingSave, int, object]] = []  # (pending, bytes, what it holds)
        self._jobs: collections.deque = collections.deque()  # write arguments not yet taken by the worker
        self._lock = threading.Condition()
        self._worker: threading.Thread | None = None
        self._stopping = False  # stop(): the worker ends as soon as no write is queued
        self._writing: list = []  # the streamed saves of the write in progress

    def __len__(self) -> int:
        return len(self._saves)

    @property
    def held_bytes(self) -> int:
        """Host bytes the queued snapshots hold (counted until reaped), the rows streamed saves have
        preserved so far included."""
        with self._lock:
            streams = [job for j in self._jobs for job in j[4] if isinstance(job, StreamedTable)]
            streams += self._writing
        return sum(n for _p, n, _h in self._saves) + sum(s.preserved_bytes for s in streams)

    @property
    def held_bytes_beside_baselines(self) -> int:
        """:attr:`held_bytes` less the snapshots of queued baselines (the rows streamed saves preserved
        still count): what the bound on the increments behind a baseline counts."""
        return self.held_bytes - sum(n for p, n, _h in self._saves if p.report.baseline)

    @property
    def last(self) -> PendingSave | None:
        return self._saves[-1][0] if self._saves else None

    def pending(self) -> list[PendingSave]:
        """The saves queued, oldest first."""
        return [p for p, _n, _h in self._saves]

    def start(self, store, pending: PendingSave, nbytes: int, holds, step, meta, row_jobs, dense: dict,
              blob: np.ndarray, after_commit=None, staged=None) -> None:
        """Queue ``pending`` (its snapshot holds ``nbytes`` host bytes; ``holds`` is returned by
        :meth:`reap` once it has ended); its write starts after the last queued one has ended
        (``after_commit``, ``staged``: see :func:`write`)."""
        after = self.last
        self._saves.append((pending, nbytes, holds))
        with self._lock:
            self._jobs.append((store, pending, step, meta, row_jobs, dense, blob, after, after_commit, staged))
            self._stopping = False
            self._lock.notify()
            if self._worker is None or not self._worker.is_alive():
                self._worker = threading.Thread(target=self._work, name="cnrstore-save", daemon=True)
                self._worker.start()

    def _work(self) -> None:
        """The worker: write the queued snapshots in order; end after IDLE_S without one (at once once
        ``stop`` asked)."""
        while True:
            with self._lock:
                if not self._jobs and not self._stopping:
                    self._lock.wait(self.IDLE_S)
                if not self._jobs:
                    self._worker = None
                    return
                job = self._jobs.popleft()
                self._writing = [j for j in job[4] if isinstance(j, StreamedTable)]
            try:
                write(*job)
            except BaseException as exc:  # (write raises nothing of its own: this escaped a hook, or the exit)
                self._fail_queued(job[1], exc)
                return
            with self._lock:
                self._writing = []
            del job  # (the snapshot's host copies go with the reaped save, not with this frame)

    def _fail_queued(self, pending: PendingSave, exc: BaseException) -> None:
        """The worker is ending on ``exc``: every save still queued fails with it (their ``wait()`` and the
        next ``save()`` raise it), so that none waits for a worker that is gone; the next ``start`` makes a
        new one."""
        with self._lock:
            jobs, self._jobs = list(self._jobs), collections.deque()
            self._worker = None
        for job in jobs:
            for s in job[4]:
                if isinstance(s, StreamedTable):
                    s.close()
            job[1].finish(None, SaveSkipped(f"{job[1].describe()} was not written: the thread writing saves ended "
                                            f"while writing {pending.describe()} ({type(exc).__name__}: {exc}); "
                                            "the next save() writes a baseline"))

    def stop(self, timeout: float | None = None) -> bool:
        """End the worker thread once the queued writes are done, and join it (for good, or ``timeout``
        seconds); whether no worker is left. A Checkpointer's ``close()`` (and the store's, and the
        interpreter's exit through them) calls it: no thread of cnrstore outlives them, so none is left to
        release torch objects while the interpreter shuts down (which aborts the process: "terminate called
        without an active exception"). The next ``start`` makes a new worker."""
        with self._lock:
            self._stopping = True
            self._lock.notify_all()
            worker = self._worker
        if worker is None or worker is threading.current_thread():
            return True
        worker.join(timeout)
        return not worker.is_alive()

    def supersede(self) -> list[tuple[PendingSave, object, list]]:
        """Take the queued saves whose write has not started (the newest: the worker has not taken them) out
        of the queue: (pending, holds, row jobs) of each, oldest first. Their bytes stop counting now; the
        caller ends them."""
        with self._lock:
            jobs, self._jobs = list(self._jobs), collections.deque()
        taken = {id(job[1]): job for job in jobs}
        out = [(p, h, taken[id(p)][4]) for p, _n, h in self._saves if id(p) in taken]
        self._saves = [entry for entry in self._saves if id(entry[0]) not in taken]
        return out

    def reap(self) -> list[tuple[PendingSave, object]]:
        """Take out the saves that have ended at the head of the queue (in save order): (pending, holds)."""
        ended = []
        while self._saves and self._saves[0][0].done():
            p, _n, holds = self._saves.pop(0)
            ended.append((p, holds))
        return ended

    def wait_oldest(self) -> None:
        """Block until the oldest queued save has ended (not reaped)."""
        if self._saves:
            self._saves[0][0].wait_done(None)

    def wait_all(self, timeout: float | None) -> bool:
        """Block until every queued save has ended (for good, or ``timeout`` seconds); whether they have.
        (They end in order: the last one ending means all have.)"""
        last = self.last
        return True if last is None else last.wait_done(timeout)

    def cancel(self) -> None:
        """Make every queued save abort at its next step: nothing of them commits."""
        for p, _n, _h in self._saves:
            p.cancel()
