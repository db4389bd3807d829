"""The maintenance handle: what compaction, retention, GC, background merges and dense rewrites may touch
of an engine, and only while they hold its maintenance lock.

``with engine.maintenance() as m:`` takes the lock and hands out a ``MaintenanceHandle``; the block's end
releases the lock and kills the handle (a use after it raises). The locking rules that were docstrings
("the caller holds the maintenance lock") are this object's existence: there is no other way to reach
the compaction appender or to commit a maintenance edit. leveldb runs compaction inside ``DBImpl``
under ``mutex_``; here it runs outside the engine, through this handle.

What it gives:
- ``read()``: an index read transaction; ``storage``: the segment storage reads go through;
- ``appender``: compaction's own appender (a checkpoint may be written meanwhile, to another segment);
- ``commit(edit)``: the engine's one commit path for a maintenance edit, with the bases the open
  checkpoint's deltas read pinned against deletion (``pin=True``) where the edit may prune entries;
- ``history()`` and the written-blocks feed the background merges plan on;
- ``writer_segments()``, ``seal_idle_writer_segment()`` and ``delete_doomed()``, for GC.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ContextManager

from ..errors import CnrError
from .parts import EngineParts

if TYPE_CHECKING:
    from ..options import Options
    from ..policy.compaction import History
    from ..types import GCReport
    from .index import IndexView
    from .storage import SegmentStorage
    from .version_edit import VersionEdit


class MaintenanceHandle:
    """One holding of an engine's maintenance lock (see the module docstring); made by
    ``Engine.maintenance()`` only, with the engine's ``parts`` (parts.py)."""

    def __init__(self, parts: EngineParts):
        self._parts: EngineParts | None = parts

    def _live(self) -> EngineParts:
        parts = self._parts
        if parts is None:
            raise CnrError("this maintenance handle was used after its `with engine.maintenance()` block ended")
        return parts

    def release(self) -> None:
        """End the handle (the engine calls it as it releases the lock)."""
        self._parts = None

    # reads ------------------------------------------------------------------------------------------
    def read(self) -> ContextManager["IndexView"]:
        """An index read transaction (one committed state until the block ends)."""
        return self._live().read()

    @property
    def storage(self) -> "SegmentStorage":
        """Where the segments live: what checked reads (``storage.fetch``) go through."""
        return self._live().storage

    @property
    def appender(self):
        """Compaction's appender (segments.SegmentAppender): maintenance appends its records here, to a
        segment of its own, and ``commit`` makes them durable; on a failure before the commit, its ``rollback()``."""
        return self._live().compaction_appender

    @property
    def options(self) -> "Options":
        """The store's tunables (cnrstore.Options)."""
        return self._live().options

    def pinned(self) -> frozenset:
        """The (table id, block, version) bases the open checkpoint's deltas read, at this moment."""
        parts = self._live()
        with parts.pin_lock:
            return parts.pinned()

    def history(self) -> "History":
        """Committed versions and the newest baseline, for compaction policies (cached by the engine, so
        that its cost after every commit does not grow with the versions)."""
        return self._live().history()

    # writes -----------------------------------------------------------------------------------------
    def commit(self, edit: "VersionEdit", *, appended: bool = True, pin: bool = False) -> None:
        """Log and apply ``edit`` (``edit.operation`` names its crash points) through the engine's one commit
        path, with what ``appender`` appended (``appended``: whether anything was). With ``pin``, the edit's
        ``pinned`` is the open checkpoint's bases, read and held under the pin lock through the commit, so
        that a checkpoint cannot pin a base while the edit decides what to prune. On any failure the
        appended bytes are thrown away and the exception re-raised."""
        parts = self._live()
        if not pin:
            parts.commit(parts.compaction_appender, edit, appended=appended)
            return
        with parts.pin_lock:
            edit.pinned = parts.pinned()
            parts.commit(parts.compaction_appender, edit, appended=appended)

    # GC ---------------------------------------------------------------------------------------------
    def writer_segments(self) -> set:
        """The segments the checkpoint writer may be appending to (possibly uncommitted bytes)."""
        return self._live().writer_appender.busy()

    def seal_idle_writer_segment(self) -> None:
        """Seal the checkpoint writer's active segment if no checkpoint is open (GC may then clean it)."""
        self._live().seal_idle_writer_segment()

    def delete_doomed(self, report: "GCReport") -> "GCReport":
        """Delete the freed segments no reader needs any more, adding to ``report``."""
        return self._live().delete_doomed(report)

    # background merges ------------------------------------------------------------------------------
    def take_written_blocks(self) -> set | None:
        """The (table id, block) pairs checkpoints committed since the last call (None: look at every block)."""
        return self._live().take_written_blocks()

    def look_at_every_block(self) -> None:
        """Make the next ``take_written_blocks`` return None (a merge step failed, or was cut short)."""
        self._live().look_at_every_block()
