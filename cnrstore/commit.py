"""The one commit path: make what an appender appended durable and record it in one index transaction.

Every change to a store (a checkpoint, a compaction, a drop, a GC batch) ends here, as every change to a
leveldb ends in its one LogAndApply: (1) the caller appended its records, (2) fsync the appender's
segments, (3) check the store's directory is still ours (StoreMoved), (4) one synced LMDB write
transaction records the segments' committed lengths and meta ``segment_ids``, then the caller's updates.
The change exists exactly when (4) has committed; on any failure the appended bytes are thrown away.

This module sits beneath writer.py and compaction.py and imports neither.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

from . import fs
from .index import IndexWriter

if TYPE_CHECKING:
    from .store import Store


def commit_log(store: "Store", appender, appended: bool, update: Callable[[IndexWriter], None], *,
               after_append: str, inside_index_commit: str, after_fsync: Optional[str] = None,
               on_failure: Optional[Callable[[BaseException], None]] = None) -> None:
    """fsync what ``appender`` appended (if ``appended``), then record the segments' new lengths and
    ``segment_ids`` and run ``update`` in one synced index commit; then ``appender.mark_committed``.

    On any failure (including StoreMoved and KeyboardInterrupt) the appended bytes are thrown away and the
    exception re-raised: by ``appender.rollback()``, or by ``on_failure(exc)`` when given (the caller then
    owns the rollback; a failed fsync is never retried: the caller must not commit the same bytes again).

    Crash points (fs.crash_point), in order: ``after_append`` (before the fsync), ``after_fsync`` (after
    it; only if named), ``inside_index_commit`` (inside the transaction, after ``update``).

    Call it with no read transaction of this thread open: a commit that must grow the index map waits for
    every transaction of the process to end.
    """
    try:
        fs.crash_point(after_append)
        lengths = appender.sync() if appended else {}
        if after_fsync is not None:
            fs.crash_point(after_fsync)

        def body(w: IndexWriter) -> None:
            for seg, length in lengths.items():
                w.put_segment(seg, length)
            w.put_meta("segment_ids", appender.ids_state(lengths))
            update(w)
            fs.crash_point(inside_index_commit)

        if store._lock is not None:
            store._lock.verify()  # StoreMoved: after a rename our paths may name another store's files
        store._index.write(body)
    except BaseException as exc:
        if on_failure is None:
            appender.rollback()
        else:
            on_failure(exc)
        raise
    appender.mark_committed(lengths)
