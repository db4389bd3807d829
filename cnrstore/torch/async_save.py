"""The asynchronous half of a ``Checkpointer`` save: the host copies its snapshot holds, the write of that
snapshot into the store on a background thread, and the handles the trainer and the store wait on.

``save()`` stalls the trainer only for :func:`gather` (device rows into reused host buffers); the version
is then written by :func:`write` while training goes on, and :class:`PendingSave` says when it has
committed. :class:`WeakPendingWork` is how ``Store.close()`` and the interpreter's exit find that work.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from .payload import DENSE_PREFIX, STATE_BLOB

__all__ = ["PendingSave", "SaveReport", "WeakPendingWork", "gather", "write"]


@dataclass
class SaveReport:
    """What one save wrote: rows per table (weights and row-wise optimizer state), whether it was a
    baseline or a priority save (``save(top=...)``), and how long ``save()`` held the trainer
    (``stall_s``)."""

    step: int | None
    baseline: bool
    rows: dict[str, int] = field(default_factory=dict)
    stall_s: float = 0.0
    version: int | None = None
    priority: bool = False


class PendingSave:
    """A save whose snapshot is taken and whose write runs in the background."""

    def __init__(self, report: SaveReport):
        self.report = report
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


def gather(src: torch.Tensor, rows, out: torch.Tensor) -> None:
    """Copy rows ``rows`` (an index tensor, or None for every row) of ``src`` into the host buffer ``out``."""
    src = src.detach()
    if src.device.type == "cpu" and src.dtype == torch.float32:
        # numpy: single-threaded copies (see Table.rows); out is a reused host buffer
        if rows is None:
            np.copyto(out.numpy(), src.numpy())
        else:
            np.take(src.numpy(), rows.numpy(), axis=0, out=out.numpy())
    elif rows is None:
        out.copy_(src)
    else:
        out.copy_(src.index_select(0, rows))


def write(store, pending: PendingSave, step, meta, row_jobs, dense: dict, blob: np.ndarray,
          on_failure: Callable[[BaseException], None]) -> None:
    """Write one snapshot as a version of ``store`` (the body of a save's background thread): ``row_jobs``
    ``(table, rows, host values, codec or None)``, the ``dense`` model arrays (under ``DENSE_PREFIX``) and
    the payload ``blob`` (``STATE_BLOB``). Notes the version in ``pending``, or its failure (then
    ``on_failure(exc)`` runs, before anyone waiting on ``pending`` wakes). A cancelled ``pending`` aborts at
    its next step with KeyboardInterrupt. Marks ``pending`` done in every case; raises nothing."""
    def check():  # an interrupt cancelled this save while the trainer waited for it: abort, commit nothing
        if pending._cancelled:
            raise KeyboardInterrupt(f"the save of step {step} was cancelled by an interrupt while waiting "
                                    "for it; nothing of it was committed")

    version, error = None, None
    try:
        with store.checkpoint(step, meta) as ck:
            for name, rows, values, codec in row_jobs:
                check()
                if rows.size:
                    ck.put_rows(name, rows, values.numpy(), codec=codec)
            for key, arr in dense.items():
                check()
                ck.put_dense(DENSE_PREFIX + key, arr)
            ck.put_dense(STATE_BLOB, blob)
            check()
        version = pending.report.version = ck.version
    except BaseException as exc:  # re-raised by wait() and the next save()
        if hasattr(exc, "add_note"):
            exc.add_note(f"(cnrstore.torch: the background write of the checkpoint of step {step} failed; "
                         "the next save() re-raises this once, without taking a snapshot, and the one "
                         "after writes a full baseline)")
        error = exc
        on_failure(exc)
    finally:
        pending.finish(version, error)
