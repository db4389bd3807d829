"""The storage engine beneath a Store: what the writer, compaction, GC, verify and the background worker
work on.

An ``Engine`` owns the index, the segment storage (storage.py: reads, sizes, listing, removal) and the
two appenders (the checkpoint writer's and compaction's, sharing one segment-id allocator), the
process lock, the maintenance lock (compact, retain and gc run one at a time), the open checkpoint and
the bases its deltas pin, the table catalog cache, the version history background compaction plans on,
and the one commit path (``Engine.commit``: leveldb's LogAndApply of a ``VersionEdit``, version_edit.py). ``Store`` (store.py) opens it, recovers it, and is the thin API façade of API.md over it.

Nothing here imports the writer, compaction, background or verify modules, nor store.py: they import
this module (for types only), so the package has no import circle.
"""

from __future__ import annotations

import threading
from typing import Callable, Optional

from . import fs, record, schema
from .errors import StoreClosed
from .index import DenseLoc, Index, IndexView, IndexWriter, RowLoc
from .reader import BlockResolver
from .policy import compaction as compaction_policy
from .schema import TableRecord
from .storage import SegmentStorage
from .types import VersionInfo
from .version_edit import VersionEdit


class Engine:
    """One open store's engine state. ``Store`` fills in the index, storage, appenders and lock at open."""

    def __init__(self, path: str, filesystem, readonly: bool):
        self.path = path
        self.fs = filesystem
        self.readonly = readonly
        self.closed = False
        self.lock = None  # lock.ProcessLock of a writable store
        self.index: Index | None = None
        self.segments: SegmentStorage | None = None
        self.appender = None  # segments.SegmentAppender of the checkpoint writer
        self.compaction_appender = None  # ... of compaction and GC
        self.maintenance_lock = threading.Lock()  # compact, retain, gc: one at a time
        self.writer_mutex = threading.Lock()  # guards ``writer``
        self.pin_lock = threading.Lock()  # a writer's delta pins against retention (writer._chain_merges)
        self.writer = None  # the open CheckpointWriter, if any
        #: Called after each committed checkpoint (the background compactor's ``notify``).
        self.on_commit: Optional[Callable[[], None]] = None
        self._tables: dict[str, TableRecord] = {}
        self._next_dense_id: int | None = None
        self._history: tuple[VersionInfo, ...] | None = None  # see history()

    # state ------------------------------------------------------------------------------------------
    def check_open(self) -> None:
        if self.closed:
            raise StoreClosed(f"store {self.path!r} is closed")

    def table_record(self, name: str, view: IndexView | None = None) -> TableRecord | None:
        """The catalog record of table ``name`` (None if absent); cached, since tables never change."""
        info = self._tables.get(name)
        if info is None:
            if view is not None:
                info = view.table(name)
            else:
                with self.index.read() as v:
                    info = v.table(name)
            if info is not None:
                self._tables[name] = info
        return info

    def remember_table(self, table: TableRecord) -> None:
        self._tables[table.name] = table

    def dense_id_for(self, name: str) -> int:
        """The id of dense array ``name``: its existing one, or a new one (recorded at commit)."""
        with self.index.read() as view:
            existing = view.dense_id(name)
            if existing is not None:
                return existing
            if self._next_dense_id is None:
                self._next_dense_id = schema.NEXT_DENSE_ID.get(view)
        dense_id = self._next_dense_id
        self._next_dense_id += 1
        return dense_id

    def load_pending(self, loc: RowLoc, info: TableRecord) -> record.Record:
        """A record this process appended but may not have committed yet (checksum-verified)."""
        return BlockResolver(None, self.segments, info).load(loc)

    def history(self) -> "compaction_policy.History":
        """Committed versions and the newest baseline, for compaction policies. Until the first
        compaction, the first version (a trainer's full checkpoint) counts as the baseline.

        Called after every commit (background compaction), so its cost must not grow with the number
        of versions: the versions are kept in memory and only those newer than the last one seen are
        read from the index. Versions only ever appear newest-last (commits) or disappear (drops):
        when the index holds fewer than the cache plus the new ones, something dropped versions, and
        the list is read afresh. Callers hold ``maintenance_lock``.
        """
        with self.index.read() as view:
            cached = self._history
            if cached is None:
                versions = tuple(version_info(v, info) for v, info in view.versions())
            else:
                newer = view.versions_after(cached[-1].version) if cached else view.versions()
                versions = cached + tuple(version_info(v, info) for v, info in newer)
                if len(versions) != view.version_count():  # versions were dropped (or repaired)
                    versions = tuple(version_info(v, info) for v, info in view.versions())
            baseline = schema.LAST_BASELINE.get(view)
        self._history = versions
        if baseline is not None:
            return compaction_policy.History(versions, baseline["version"], baseline["bytes"])
        if versions:
            return compaction_policy.History(versions, versions[0].version, versions[0].bytes)
        return compaction_policy.History(versions, None, 0)

    def pinned(self) -> set:
        """(table id, block, version) of the baselines the open checkpoint's cumulative deltas read.
        Call with ``pin_lock`` held."""
        writer = self.writer
        return set(writer.pins) if writer is not None else set()

    def writer_done(self, writer) -> None:
        """The open checkpoint committed, aborted or failed: another may open."""
        with self.writer_mutex:
            if self.writer is writer:
                self.writer = None
        if self.on_commit is not None and writer.committed:
            self.on_commit()

    # the one commit path ----------------------------------------------------------------------------
    def commit(self, appender, edit: VersionEdit, *, appended: bool, after_append: str, inside_index_commit: str,
               after_fsync: Optional[str] = None, on_failure: Optional[Callable[[BaseException], None]] = None) -> None:
        """Log and apply ``edit`` (leveldb's ``VersionSet::LogAndApply``): make what ``appender`` appended
        durable, with the log records the edit encodes, and record it in one index transaction.

        Every change to a store (a checkpoint, a compaction, a drop, a GC batch) ends here: (1) the caller
        appended its data records (``appended``: whether it did), (2) the edit's log records
        (``edit.encode()``: COMMIT, DROP, ANCHOR) are appended and their places noted in ``edit.log``, (3)
        fsync the appender's segments, (4) check the store's directory is still ours (StoreMoved: after a
        rename our paths may name another store's files), (5) one synced LMDB write transaction records
        the segments' committed lengths and meta ``segment_ids`` in the edit and runs ``edit.apply``. The
        change exists exactly when (5) has committed; then ``appender.mark_committed``.

        On any failure (including StoreMoved and KeyboardInterrupt) the appended bytes are thrown away
        and the exception re-raised: by ``appender.rollback()``, or by ``on_failure(exc)`` when given
        (the caller then owns the rollback; a failed fsync is never retried: the caller must not commit
        the same bytes again).

        Crash points (fs.crash_point), in order: ``after_append`` (before the fsync), ``after_fsync``
        (after it; only if named), ``inside_index_commit`` (inside the transaction, after the edit).

        Call it with no read transaction of this thread open: a commit that must grow the index map
        waits for every transaction of the process to end.
        """
        try:
            for rec in edit.encode():
                buffers, length = record.log_record(rec.kind, rec.version, rec.body)
                edit.log[(rec.kind, rec.key)] = DenseLoc(*appender.append(buffers, length), length)
                appended = True
            fs.crash_point(after_append)
            lengths = appender.sync() if appended else {}
            if after_fsync is not None:
                fs.crash_point(after_fsync)
            edit.segments.update(lengths)
            edit.meta[schema.SEGMENT_IDS] = appender.ids_state(lengths)

            def body(w: IndexWriter) -> None:
                edit.apply(w)
                fs.crash_point(inside_index_commit)

            if self.lock is not None:
                self.lock.verify()
            self.index.write(body)
        except BaseException as exc:
            if on_failure is None:
                appender.rollback()
            else:
                on_failure(exc)
            raise
        appender.mark_committed(lengths)

    def close(self) -> None:
        self.closed = True
        for appender in (self.appender, self.compaction_appender):
            if appender is not None:
                appender.close()
        if self.segments is not None:
            self.segments.close()
        if self.index is not None:
            self.index.close()
        if self.lock is not None:
            self.lock.release()


def version_info(version: int, info: dict) -> VersionInfo:
    """The public VersionInfo of a ``versions`` catalog entry."""
    return VersionInfo(version=version, step=info["step"], meta=info["meta"], created=info["created"],
                       parent=info["parent"], tables=tuple(info["tables"]), bytes=info["bytes"],
                       dense=tuple(info.get("dense", ())))
