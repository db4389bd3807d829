"""The storage engine beneath a Store: what the writer, compaction, GC, verify and the background worker
work on.

``Engine.open`` (leveldb's ``DB::Open``) opens a store, or creates it, and the engine then owns its parts,
all private:
the process lock, the index (rolling forward a repair killed between its renames), the segment storage
(storage.py: reads, sizes, listing, removal), crash recovery of the segments, the two appenders (the
checkpoint writer's and compaction's, sharing one segment-id allocator), the writer slot (the one open
checkpoint, ``begin_writer`` / ``writer_done``) and the bases its deltas pin, the maintenance lock
(compact, retain and gc run one at a time), the table catalog cache, the version history background
compaction plans on, the deletion of freed segments (``_delete_doomed``), and the one commit path
(``_commit``: leveldb's LogAndApply of a ``VersionEdit``, version_edit.py). ``Store`` (store.py)
validates each call's arguments and delegates to it: the thin API façade of API.md.

Outside ``cnrstore/engine/``, code uses the public methods below and, for compaction, retention, GC and
merges, the maintenance handle (``with engine.maintenance() as m:``, handle.py), which holds the
maintenance lock. The checkpoint writer and the handle get the parts they work on handed to them
(``EngineParts``, parts.py); no other module touches them.

Nothing here imports the writer, compaction, background or verify modules, nor store.py: they import
this module (for types only), so the package has no import circle.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Callable, ContextManager, Iterator, Optional, TypeVar

from . import filenames, fs, opening, record, schema, segments
from ..errors import CheckpointInProgress, IndexDamaged, InvalidArgument, ReadOnlyError, StorageFull, StoreClosed
from ..options import Options
from .index import DenseLoc, Index, IndexView, IndexWriter, RowLoc, damage_hint, finish_interrupted_install
from .chain_costs import ChainCosts
from .handle import MaintenanceHandle
from .parts import EngineParts
from .replication import Replicator
from .lock import ProcessLock
from .marker import FORMAT_VERSION, marker_bytes
from .reader import BlockResolver
from ..policy import compaction as compaction_policy
from .schema import TableRecord
from .storage import LocalSegmentStorage, SegmentStorage
from ..types import GCReport, VersionInfo
from .version_edit import ParentPin, VersionEdit, crash_points

W = TypeVar("W")
_UNRECORDED = "the index could not record the deletion of freed segments"


class Engine:
    """One open store's engine (see the module docstring). Open one with ``Engine.open``."""

    def __init__(self, path: str, filesystem, readonly: bool, options: Options | None = None):
        self.path = path
        #: this store's tunables (cnrstore.Options): what its parts read, never the process's knobs
        self._options = options if options is not None else Options()
        self._fs = filesystem
        self.readonly = readonly
        self._closed = False
        #: what opening for writing recovered or repaired (torn tails truncated, leftovers removed, ...)
        self.recovery_notes: list[str] = []
        self._lock: ProcessLock | None = None  # of a writable store
        self._index: Index | None = None
        self._storage: SegmentStorage | None = None
        self._replicator: Replicator | None = None  # what keeps a copy elsewhere current (replication.py)
        self._appender = None  # segments.SegmentAppender of the checkpoint writer
        self._compaction_appender = None  # ... of compaction and GC
        self._maintenance_lock = threading.Lock()  # compact, retain, gc: one at a time
        self._writer_mutex = threading.Lock()  # guards ``writer``
        self._pin_lock = threading.Lock()  # a writer's delta pins against retention (writer._chain_merges)
        self._writer = None  # the open CheckpointWriter, if any
        #: Called after each committed checkpoint (the background compactor's ``notify``).
        self._on_commit: Optional[Callable[[], None]] = None
        #: (table id, block) pairs committed checkpoints wrote since the background merges last looked
        #: (None: look at every block: nothing was looked at in this process yet); see take_written_blocks
        self._written_blocks: set | None = None
        #: what each block's read chain costs, for the save path's bound check (chain_costs.py)
        self._chain_costs = ChainCosts()
        self._tables: dict[str, TableRecord] = {}
        self._next_dense_id: int | None = None
        self._history: tuple[VersionInfo, ...] | None = None  # see history()

    def _parts(self) -> EngineParts:
        """The parts the checkpoint writer and the maintenance handle work on (parts.py)."""
        return EngineParts(self._index.read, self._storage, self._appender, self._compaction_appender,
                           self._pin_lock, self._pinned, self._commit, self._chain_costs, self._options,
                           self._versions_and_baseline, self._seal_idle_writer_segment, self._delete_doomed,
                           self._take_written_blocks, self._look_at_every_block)

    # open -------------------------------------------------------------------------------------------
    @classmethod
    def open(cls, path: str, filesystem: fs.FileSystem, storage: SegmentStorage | None = None, *,
             readonly: bool, create: bool = False, create_wait_s: float = 10.0,
             replicator: Replicator | None = None, options: Options | None = None) -> "Engine":
        """Open the store at ``path`` (an absolute path): with ``create``, make it first if it has no
        marker (``opening.create``; another process creating it meanwhile is waited for up to
        ``create_wait_s``). ``storage``: where segments live (default: the local files, written through
        ``filesystem``); ``replicator``: what keeps a copy of the store elsewhere current (replication.py),
        told when the engine opened, before each checkpoint, after each commit and at close (None: the
        storage itself if it is a Replicator, as the remote tier's is; else no copy);
        ``options``: the store's tunables (None: ``Options()``).

        A writable open takes the store's lock, installs the index a repair killed between its renames
        had built (``index.finish_interrupted_install``), checks the storage takes appends and that this
        process may write, truncates torn tails and removes provable leftovers (``storage.recover``),
        starts the two appenders past every segment id ever used, deletes freed segments no reader
        needs, and upgrades an older format's marker; ``recovery_notes`` says what it did. A readonly
        open changes nothing. Raises StoreNotFound, FormatVersionError, StoreLocked, PermissionDenied,
        ReadOnlyError or IndexDamaged, having released whatever it took.
        """
        engine = cls(path, filesystem, readonly, options)
        if replicator is None and isinstance(storage, Replicator):
            replicator = storage  # (a remote tier's storage makes its own copy points)
        engine._replicator = replicator
        try:
            if not opening.find(path, readonly):
                if not create or readonly:
                    raise opening.not_found(path, readonly)
                engine._lock = opening.create(path, filesystem, create_wait_s)  # held for writing from here
            fmt = opening.check_format(path, readonly)
            if not readonly and engine._lock is None:
                engine._lock = ProcessLock(path)
                engine._lock.acquire()
            engine._open_index(storage)
            if not readonly:
                engine._recover(fmt)
            if replicator is not None:
                replicator.attach(engine._index, engine._seal_idle_writer_segment)
        except BaseException:
            engine.close()
            raise
        return engine

    def _open_index(self, storage: SegmentStorage | None) -> None:
        if not self.readonly and finish_interrupted_install(self.path, self._fs):
            self.recovery_notes.append("installed the index an interrupted `cnrstore repair` had built "
                                       "(index.repair-tmp/)")
        self._index = Index(filenames.index_dir(self.path), readonly=self.readonly,
                            map_bytes=self._options.index_map_bytes)
        self._storage = storage if storage is not None else LocalSegmentStorage(self.path, self._fs)
        self._storage.use_options(self._options)
        if not self.readonly:  # a store this process may only read fails here, not at its first checkpoint
            if not self._storage.supports_appends:
                raise ReadOnlyError(f"{type(self._storage).__name__} takes no appends: open store {self.path!r} "
                                    "readonly=True")
            self._storage.check_writable(opening.opening(self.path, False))
        with self._index.read() as view:
            if schema.FORMAT.get(view) is None:  # an empty environment LMDB made in place of a lost one
                raise IndexDamaged(f"the index of store {self.path!r} holds no catalog (was index/data.mdb "
                                   f"replaced?); {damage_hint(self._index.path)}", self._index.path, None)

    def _recover(self, fmt: int) -> None:
        """Crash recovery of a writable open: the segments back to their committed lengths, the appenders,
        the freed segments no reader needs deleted, the marker brought to this format."""
        with self._index.read() as view:
            committed = view.segments()
            doomed = set(schema.DOOMED_SEGMENTS.get(view))
            deleted = schema.MAX_DELETED_SEGMENT.get(view)
            seg_ids = schema.SEGMENT_IDS.get(view)
        self.recovery_notes += self._storage.recover(committed, doomed, max_deleted=deleted, ids=seg_ids)
        # never reuse the id of a deleted segment: a long-lived reader may still map the old file
        high, _pending = segments.leftover_rule(committed, doomed, deleted, seg_ids)
        ids = segments.SegmentIds(self._storage.segment_ids_from(high))
        # the checkpoint writer and compaction append to active segments of their own
        storage = self._storage
        self._appender = storage.appender(committed, FORMAT_VERSION, ids, resume=True, on_sealed=storage.sealed)
        self._compaction_appender = storage.appender({}, FORMAT_VERSION, ids, active=None, on_sealed=storage.sealed)
        if doomed:  # segments GC freed before a restart: delete those no reader needs now
            self._delete_doomed(GCReport())
        if fmt < FORMAT_VERSION:  # from now on it holds format-2 records an older GC would drop
            self._fs.write_file_atomic(filenames.marker_path(self.path), filenames.marker_tmp_path(self.path),
                                      marker_bytes())
            self.recovery_notes.append(f"upgraded the store's format from {fmt} to {FORMAT_VERSION}")

    # what outside code may use -------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def options(self) -> Options:
        """This store's tunables (cnrstore.Options), fixed at open."""
        return self._options

    def check_open(self) -> None:
        if self._closed:
            raise StoreClosed(f"store {self.path!r} is closed")

    def read(self) -> ContextManager[IndexView]:
        """A read transaction of the index: ``with engine.read() as view:`` sees one committed state
        (an LMDB snapshot) until the block ends, whatever commits meanwhile."""
        return self._index.read()

    @property
    def storage(self) -> SegmentStorage:
        """Where the segments live (storage.py): what reads of the index's locations go through."""
        return self._storage

    def index_bytes(self) -> int:
        """The bytes the index's files take on disk."""
        return self._index.disk_bytes()

    def index_space(self) -> dict[str, int]:
        """The index's pages in use, its high-water mark and its file size, in bytes (Index.space)."""
        return self._index.space()

    def check_still_ours(self) -> None:
        """StoreMoved once the store's directory was renamed away (our paths may name another store's
        files); nothing for a readonly store, which holds no lock."""
        if self._lock is not None:
            self._lock.verify()

    def copy_point(self) -> None:
        """Make a copy point now (replication.py): InvalidArgument for a store without a remote copy;
        RemoteStorageError if the object store fails (the copy then still reads at its previous one)."""
        if self._replicator is None:
            raise InvalidArgument(f"store {self.path!r} has no remote tier: open it with remote=URL")
        self._replicator.copy_point()

    def copy_points_behind(self) -> bool:
        """Make the remote copy points in a thread of their own, behind the commits (replication.py); False
        if there is no remote tier or its copy points stay as they are (readonly, or all explicit)."""
        return self._replicator is not None and not self.readonly and self._replicator.run_behind()

    def wait_for_bucket(self, bound_s: float, what: str) -> float:
        """Block until the oldest commit the remote copy lacks is at most ``bound_s`` seconds old; the
        seconds waited (0.0 without a remote tier). RemoteTakenOver if the store lost its prefix."""
        return 0.0 if self._replicator is None else self._replicator.wait_for_bucket(bound_s, what)

    def replication_status(self) -> dict | None:
        """The remote copy's state and counters (``Store.stats()["remote"]``); None without one."""
        return None if self._replicator is None else self._replicator.status()

    def set_commit_listener(self, listener: Optional[Callable[[], None]]) -> None:
        """Call ``listener()`` after each committed checkpoint (the background compactor's ``notify``)."""
        self._on_commit = listener

    @property
    def open_writer(self):
        """The open CheckpointWriter, or None."""
        return self._writer

    def pinned(self) -> frozenset:
        """(table id, block, version) of the baselines the open checkpoint's cumulative deltas read, at
        this moment (the pin lock is held while they are read)."""
        with self._pin_lock:
            return self._pinned()

    @contextmanager
    def maintenance(self) -> Iterator["MaintenanceHandle"]:
        """Hold the maintenance lock (compact, retain, gc, merges and dense rewrites run one at a time)
        and hand out what maintenance works on: ``with engine.maintenance() as m:`` (handle.py). The
        handle is dead once the block ends."""
        with self._maintenance_lock:
            handle = MaintenanceHandle(self._parts())
            try:
                yield handle
            finally:
                handle.release()

    def table_record(self, name: str, view: IndexView | None = None) -> TableRecord | None:
        """The catalog record of table ``name`` (None if absent); cached, since tables never change."""
        info = self._tables.get(name)
        if info is None:
            if view is not None:
                info = view.table(name)
            else:
                with self._index.read() as v:
                    info = v.table(name)
            if info is not None:
                self._tables[name] = info
        return info

    def remember_table(self, table: TableRecord) -> None:
        self._tables[table.name] = table

    def create_table(self, name: str, num_rows: int, dim: int, codec: str, block_rows: int, *, keyed: bool = False,
                     columns: tuple = ()) -> TableRecord:
        """Record a new table in the catalog, durably, in one synced index transaction (the Store has checked
        the arguments): InvalidArgument for a name in use, or when the store has used up its u32 table ids.
        A table is in no log record until a checkpoint writes it (the COMMIT names its tables)."""

        def body(w: IndexWriter) -> TableRecord:
            if w.table(name) is not None:
                raise InvalidArgument(f"a table named {name!r} already exists; choose another name")
            tid = schema.NEXT_TABLE_ID.get(w)
            if tid > 0xFFFFFFFF:  # the index keys hold table ids as u32
                raise InvalidArgument(f"store {self.path!r} has used up its 2**32 table ids; put new tables "
                                      "in a new store")
            schema.NEXT_TABLE_ID.put(w, tid + 1)
            table = TableRecord(tid, name, num_rows, dim, codec, block_rows, time.time(), keyed, columns)
            w.put_table(table)
            return table

        table = self._index.write(body)
        self.remember_table(table)
        return table

    def dense_id_for(self, name: str) -> int:
        """The id of dense array ``name``: its existing one, or a new one (recorded at commit)."""
        with self._index.read() as view:
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
        return BlockResolver(None, self._storage, info).load(loc)

    def history(self) -> "compaction_policy.History":
        """``MaintenanceHandle.history()``, taking the maintenance lock for it."""
        with self.maintenance() as m:
            return m.history()

    def _versions_and_baseline(self) -> "compaction_policy.History":
        """Committed versions and the newest baseline, for compaction policies. Until the first
        compaction, the first version (a trainer's full checkpoint) counts as the baseline.

        Called after every commit (background compaction), so its cost must not grow with the number
        of versions: the versions are kept in memory and only those newer than the last one seen are
        read from the index. Versions only ever appear newest-last (commits) or disappear (drops):
        when the index holds fewer than the cache plus the new ones, something dropped versions, and
        the list is read afresh. Callers hold ``_maintenance_lock``.
        """
        with self._index.read() as view:
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

    def seal_idle_writer_segment(self) -> None:
        """Seal the checkpoint writer's active segment if no checkpoint is open: the next checkpoint starts
        a new segment. *For the distributed checkpointer*: a rank store of a bucket root seals each save's
        segment before the next save opens, so that the copy point running behind that save uploads the
        segment whole, once."""
        self._seal_idle_writer_segment()

    def _seal_idle_writer_segment(self) -> None:
        """Seal the checkpoint writer's active segment when no checkpoint is open, so that GC may clean it
        like a sealed one (the next checkpoint starts a new segment). A small store lives in that one
        segment: without this, GC could never reclaim any of its space."""
        with self._writer_mutex:  # no checkpoint can open meanwhile
            if self._writer is None and self._appender is not None and not self._appender.dirty():
                self._appender.seal()

    def _pinned(self) -> frozenset:
        """``pinned()``, for a caller holding ``_pin_lock``."""
        writer = self._writer
        if writer is None:
            return frozenset()
        parent = getattr(writer, "parent", None)
        parent = () if parent is None else (ParentPin(writer.version, parent),)
        return frozenset(writer.pins).union(parent)

    def begin_writer(self, make: Callable[[int, int | None, EngineParts], W]) -> W:
        """Put ``make(version, parent, parts)`` (a CheckpointWriter) in the writer slot and return it:
        ``version`` the next version number, allocated in a synced transaction so that it is never handed
        out twice (even to a checkpoint that aborts or is lost in a crash), ``parent`` the newest committed
        version, ``parts`` what the writer appends and commits through (parts.py). CheckpointInProgress
        while the slot holds another; ``writer_done`` empties it."""
        if self._replicator is not None:
            self._replicator.before_checkpoint()
        with self._writer_mutex:
            if self._writer is not None:
                raise CheckpointInProgress(f"checkpoint {self._writer.version} is still open; commit or abort it "
                                           "before starting another")

            def allocate(w: IndexWriter) -> tuple[int, int | None]:
                v = schema.NEXT_VERSION.get(w)
                if v >= (1 << 64) - 1:  # versions are u64 (the last one would leave no next_version to store)
                    raise InvalidArgument(f"store {self.path!r} has used up its 2**64 version numbers; write new "
                                          "checkpoints in a new store")
                schema.NEXT_VERSION.put(w, v + 1)
                latest = w.latest()
                return v, (latest[0] if latest else None)

            self._writer = make(*self._index.write(allocate), self._parts())
            return self._writer

    def writer_done(self, writer) -> None:
        """The open checkpoint committed, aborted or failed: another may open."""
        with self._writer_mutex:
            if self._writer is writer:
                self._writer = None
            if writer.committed and self._written_blocks is not None:
                self._written_blocks.update(writer.blocks_written())
        if writer.committed:
            try:
                if self._replicator is not None:
                    self._replicator.after_commit()  # a copy point, if one is due (replication.py)
            finally:
                if self._on_commit is not None:
                    self._on_commit()

    def _take_written_blocks(self) -> set | None:
        """The (table id, block) pairs checkpoints committed since the last call (None on the first call of
        this process: every block may need a look), and start collecting afresh."""
        with self._writer_mutex:
            written, self._written_blocks = self._written_blocks, set()
        return written

    def _look_at_every_block(self) -> None:
        """Make the next ``take_written_blocks`` return None (a merge step failed, or was cut short)."""
        with self._writer_mutex:
            self._written_blocks = None

    def _delete_doomed(self, report: GCReport) -> GCReport:
        """Delete the freed segment files (meta ``doomed_segments``) no reader of any process can need any
        more (LMDB's reader table), adding to ``report``; the rest wait for a later call (gc, or open)."""
        self.check_still_ours()  # never delete files under a path that no longer names this store
        with self._index.read() as view:
            doomed = schema.DOOMED_SEGMENTS.get(view)
        if not doomed:
            return report
        oldest = self._index.oldest_reader_txn()
        deletable = [seg for seg, freed_by in doomed.items() if oldest is None or oldest >= freed_by]
        storage = self._storage
        for seg in deletable:
            size = storage.size(seg) or 0
            try:
                storage.remove(seg)
            except FileNotFoundError:
                size = 0
            report.bytes_reclaimed += size
            report.segments_deleted += 1
        for seg in doomed:
            if seg not in deletable:
                report.bytes_pending += storage.size(seg) or 0
        if deletable:
            storage.sync_removals()

            def body(w: IndexWriter) -> None:
                current = schema.DOOMED_SEGMENTS.get(w)
                schema.DOOMED_SEGMENTS.put(w, {s: t for s, t in current.items() if s not in deletable})
                # the open after a restart allocates ids past this one (_recover)
                schema.MAX_DELETED_SEGMENT.put(w, max(schema.MAX_DELETED_SEGMENT.get(w), *deletable))

            try:
                self._index.write(body)
            except StorageFull as exc:
                # the files are gone (their space is free); doomed_segments still lists them, which keeps
                # their ids from being reused, and the next gc or open drops them from it
                report.incomplete = report.incomplete or f"{_UNRECORDED} ({exc}); free disk space and run gc again"
            else:
                if report.incomplete and report.incomplete.startswith(_UNRECORDED):
                    report.incomplete = None  # a later call of this pass recorded them after all
        return report

    # the one commit path ----------------------------------------------------------------------------
    def _commit(self, appender, edit: VersionEdit, *, appended: bool,
               on_failure: Optional[Callable[[BaseException], None]] = None) -> None:
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

        Crash points (fs.crash_point), named by ``edit.operation`` (``version_edit.crash_points``), in
        order: after the append (before the fsync), after the fsync (a checkpoint's only), inside the
        transaction (after the edit).

        Call it with no read transaction of this thread open: a commit that must grow the index map
        waits for every transaction of the process to end.
        """
        after_append, after_fsync, inside_index_commit = crash_points(edit.operation)
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

            self.check_still_ours()
            self._index.write(body)
        except BaseException as exc:
            if on_failure is None:
                appender.rollback()
            else:
                on_failure(exc)
            raise
        appender.mark_committed(lengths)
        if edit.rewrites_chains:
            self._chain_costs.clear()

    def close(self) -> None:
        """Abort the open checkpoint writer, if any, then close every part (idempotent)."""
        if self._writer is not None:
            self._writer.abort()
        flush_error = None
        if not self._closed and not self.readonly and self._appender is not None and self._replicator is not None:
            try:
                self._replicator.flush()  # the last copy point
            except Exception as exc:  # noqa: BLE001 - close everything first, then report it
                flush_error = exc
        self._closed = True
        for appender in (self._appender, self._compaction_appender):
            if appender is not None:
                appender.close()
        if self._storage is not None:
            self._storage.close()
        if self._index is not None:
            self._index.close()
        if self._lock is not None:
            self._lock.release()
        if flush_error is not None:
            raise flush_error


def version_info(version: int, info: dict) -> VersionInfo:
    """The public VersionInfo of a ``versions`` catalog entry."""
    return VersionInfo(version=version, step=info["step"], meta=info["meta"], created=info["created"],
                       parent=info["parent"], tables=tuple(info["tables"]), bytes=info["bytes"],
                       dense=tuple(info.get("dense", ())))
