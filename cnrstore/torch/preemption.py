"""What a ``Checkpointer`` does on SIGTERM: clusters and schedulers send it to a job before they kill it
(Slurm, Kubernetes, torchrun to its workers), and its default action ends the process at once, skipping the
interpreter's exit hook, so the saves ``save()`` had returned and not yet committed were lost.

``Checkpointer(on_sigterm=...)``:

- ``"finish"`` (the default): SIGTERM raises ``SystemExit(143)`` in the main thread, as Ctrl-C raises
  KeyboardInterrupt: the trainer's ``with`` blocks and ``finally`` clauses run, ``close()`` (or the exit
  hook, within ``cnrstore.store.EXIT_WAIT_S``) commits every save ``save()`` returned, and the process exits
  with status 143, as a SIGTERM'd process does. Training state after the signal is not saved.
- ``"save"``: the same, after one more save: when every optimizer of the Checkpointer has finished the step
  in progress (their step post-hooks), the state is consistent, and it is saved as ``step`` = the last save's
  step plus the training steps completed since (one step: each optimizer stepped once). Without optimizers
  it is ``"finish"``.
- ``None``: SIGTERM is left alone.

Only the main thread can set signal handlers: a Checkpointer made elsewhere (or where the application set a
SIGTERM handler of its own) leaves SIGTERM as it is. A second SIGTERM while the first is handled gets the
handler that was there before (the default: the process ends at once), so a job that must die, dies.

**A signal never cancels a save that ``save()`` returned.** SIGTERM's exit and the first Ctrl-C propagate
out of whatever they interrupt -- ``save()`` waiting for room in the queue included -- and the queued saves
are committed by ``close()``, a ``with`` block's exit or the interpreter's exit hook, which wait for them.
Only a *second* Ctrl-C while cnrstore waits for them gives them up (:func:`second_interrupt` tells the two
apart): they abort at their next step and nothing of them commits.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import sys
import threading
import weakref

from ..errors import InvalidArgument

__all__ = ["ON_SIGTERM", "EXIT_STATUS", "deferred", "note_interrupt", "second_interrupt", "unwatch", "watch"]

ON_SIGTERM = ("finish", "save", None)
#: the status of a process that SIGTERM ended (128 + 15), which schedulers read as "terminated"
EXIT_STATUS = 128 + signal.SIGTERM

log = logging.getLogger("cnrstore.torch")

_lock = threading.Lock()
_watching: "weakref.WeakSet" = weakref.WeakSet()  # Checkpointers whose on_sigterm is not None
_previous = None  # the handler ours replaced (restored when the last Checkpointer closes, or at the signal)
_installed = False
_interrupted = False  # a Ctrl-C has reached cnrstore (a wait of its own, or a Checkpointer's exit)
_deferring = 0  # depth of deferred() blocks in the main thread: SIGTERM's exit waits for the outermost's end
_exit_pending = False  # a SIGTERM came inside one


@contextlib.contextmanager
def deferred():
    """SIGTERM's exit (``on_sigterm="finish"``) waits until the block has ended: for a collective save
    (``DistributedCheckpointer.save``), whose global commit needs every rank to have taken its part -- a rank
    stopped inside it would fail the save on the ranks where it had returned. A second SIGTERM still ends the
    process at once."""
    global _deferring, _exit_pending
    main = threading.current_thread() is threading.main_thread()
    if main:
        _deferring += 1
    try:
        yield
    finally:
        if main:
            _deferring -= 1
            if not _deferring and _exit_pending:
                _exit_pending = False
                log.warning("cnrstore: SIGTERM (received during a collective save): exiting with status %d "
                            "once the saves save() returned are committed", EXIT_STATUS)
                raise SystemExit(EXIT_STATUS)


def note_interrupt() -> None:
    """A Ctrl-C (KeyboardInterrupt) reached cnrstore: the next one it catches while waiting for saves is a
    second one."""
    global _interrupted
    _interrupted = True


def second_interrupt(exc: BaseException) -> bool:
    """Whether ``exc``, a KeyboardInterrupt caught while cnrstore waits for queued saves, is a *second*
    Ctrl-C, which gives those saves up: one reached cnrstore before (:func:`note_interrupt`), or one was
    already on its way when this one came (the wait runs in a ``with`` block's exit, an ``except`` or a
    ``finally`` handling it: ``exc``'s context), or the interpreter is exiting on an uncaught one (the exit
    hook)."""
    if _interrupted:
        return True
    seen, ctx = set(), exc.__context__
    while ctx is not None and id(ctx) not in seen:
        if isinstance(ctx, KeyboardInterrupt):
            return True
        seen.add(id(ctx))
        ctx = ctx.__context__
    return isinstance(getattr(sys, "last_value", None), KeyboardInterrupt)


def check(on_sigterm) -> str | None:
    if on_sigterm not in ON_SIGTERM:
        raise InvalidArgument(f"on_sigterm must be 'finish' (commit the saves save() returned, then exit 143), "
                              f"'save' (also save the step in progress) or None (leave SIGTERM alone); "
                              f"got {on_sigterm!r}")
    return on_sigterm


def watch(checkpointer) -> bool:
    """Handle SIGTERM for ``checkpointer`` (whose ``on_sigterm`` is not None); whether the handler is ours
    (False: not the main thread, or the application handles SIGTERM itself)."""
    global _previous, _installed
    with _lock:
        if not _installed:
            if threading.current_thread() is not threading.main_thread():
                return False
            current = signal.getsignal(signal.SIGTERM)
            if current not in (signal.SIG_DFL, None):
                log.info("cnrstore: SIGTERM already has a handler (%r); Checkpointer(on_sigterm=...) leaves it",
                         current)
                return False
            _previous = current
            signal.signal(signal.SIGTERM, _on_sigterm)
            _installed = True
        _watching.add(checkpointer)
        return True


def unwatch(checkpointer) -> None:
    """``checkpointer`` closed: the handler goes once no Checkpointer needs it."""
    global _installed
    with _lock:
        _watching.discard(checkpointer)
        if _installed and not len(_watching) and threading.current_thread() is threading.main_thread():
            if signal.getsignal(signal.SIGTERM) is _on_sigterm:
                signal.signal(signal.SIGTERM, _previous if _previous is not None else signal.SIG_DFL)
            _installed = False


def _on_sigterm(signum, frame) -> None:
    """The first SIGTERM: the previous handler back (a second one ends the process), then each Checkpointer
    asked to save the step in progress is told so (it raises the exit once saved), or the exit is raised."""
    global _installed
    with _lock:
        if signal.getsignal(signal.SIGTERM) is _on_sigterm:
            signal.signal(signal.SIGTERM, _previous if _previous is not None else signal.SIG_DFL)
        _installed = False
        savers = [c for c in _watching if c.on_sigterm == "save" and c.can_save_on_sigterm()]
    log.warning("cnrstore: SIGTERM: %s, then exiting with status %d",
                "saving the step in progress and committing the saves save() returned" if savers else
                "committing the saves save() returned", EXIT_STATUS)
    if savers:
        for c in savers:
            c.sigterm_received()
        return  # (the last optimizer step of the step in progress saves, then raises the exit)
    if _deferring:
        global _exit_pending
        _exit_pending = True  # (raised when the collective save in progress has done its part: deferred())
        return
    raise SystemExit(EXIT_STATUS)
