"""Where a checkpointer's reports go: the ``on_report`` hook of ``Checkpointer`` and
``DistributedCheckpointer`` (a callable given each :class:`~cnrstore.torch.async_save.SaveReport` once its
save has committed, and each :class:`RestoreReport`), or, without one, the ``logging`` module at INFO on the
``cnrstore.torch`` logger (a child of ``cnrstore``: silent unless the application enables INFO there).

A hook's exception never fails the save or restore it reports (the version is committed, the state
loaded): it is logged on the same logger, with its traceback, and dropped.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from ..errors import InvalidArgument

__all__ = ["LOGGER", "RestoreReport", "check_hook", "deliver", "describe", "silent"]

#: The logger reports go to without an ``on_report`` hook, and where a failing hook is logged.
LOGGER = logging.getLogger("cnrstore.torch")


@dataclass
class RestoreReport:
    """What one restore loaded: the ``version`` (for a ``DistributedCheckpointer``, the global version), its
    training ``step``, and ``seconds`` from the call to the state being in place (waiting for queued saves
    included); what it ``restored`` (tables, dense arrays, ``extra`` names, ``optimizer N``), and, with
    ``strict=False``, the live state it left as it was (``missing``) and the stored state nothing took
    (``unexpected``)."""

    version: int
    step: int | None
    seconds: float
    restored: list = field(default_factory=list)
    missing: list = field(default_factory=list)
    unexpected: list = field(default_factory=list)


def check_hook(on_report, owner: str):
    """``on_report`` if it is None or callable; InvalidArgument saying what to pass otherwise."""
    if on_report is not None and not callable(on_report):
        raise InvalidArgument(f"{owner}(on_report=...) takes a callable, called with each SaveReport and "
                              "RestoreReport (e.g. one that calls SummaryWriter.add_scalar), or None to log them "
                              f"at INFO on the 'cnrstore.torch' logger; got {type(on_report).__name__}")
    return on_report


def silent(report) -> None:
    """A hook that drops every report (a checkpointer whose owner reports for it)."""


def describe(report) -> str:
    """One line for the log: ``save of step 100 -> version 7 (baseline): 1,234 rows, stall 3.1 ms, ...``."""
    if isinstance(report, RestoreReport):
        left = (f"; left as they were: {report.missing}" if report.missing else "") + (
            f"; not loaded: {report.unexpected}" if report.unexpected else "")
        return f"restored version {report.version} (step {report.step}) in {report.seconds * 1e3:.1f} ms{left}"
    kind = "baseline" if report.baseline else "priority" if report.priority else "increment"
    parts = [f"{sum(report.rows.values()):,} rows", f"stall {report.stall_s * 1e3:.1f} ms",
             f"write {report.write_s * 1e3:.1f} ms"]
    if report.bytes_written is not None:
        parts.append(f"{report.bytes_written:,} bytes")
    if report.dropped:
        parts.append(f"dropped versions {report.dropped}")
    return f"save of step {report.step} -> version {report.version} ({kind}): {', '.join(parts)}"


def deliver(hook, report, *, background: bool = False) -> None:
    """Hand ``report`` to ``hook`` (None: log it at INFO); a hook's exception is logged, not raised. On a
    ``background`` thread (a save's writer) that includes SystemExit, KeyboardInterrupt and GeneratorExit,
    which would otherwise end the thread that writes the saves queued behind; on the caller's own thread
    those are raised (they are the caller's: an interrupt, an exit)."""
    if hook is None:
        LOGGER.info("%s", describe(report))
        return
    try:
        hook(report)
    except Exception if not background else BaseException:
        LOGGER.exception("the on_report hook failed on: %s (the %s is not affected)", describe(report),
                         "restore" if isinstance(report, RestoreReport) else "save, which committed,")
