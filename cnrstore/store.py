"""The Store: opening, tables, checkpoints, point-in-time reads, verify and stats (API.md's contract)."""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import time
from collections.abc import Iterator, Mapping

import numpy as np

from . import codecs, knobs, lifecycle
from .options import Options, resolve as resolve_options
from .engine import arguments, filenames, fs, keyed_reader, keyed_runs, keyed_writer, merge, reader, schema, table_decode
from .engine.keyed_records import columns_arg as keyed_columns, partitions_arg as keyed_partitions
from .engine import changes as changes_rule
from .engine import remote as remote_tier
from .engine import blocks as blocks_math
from .engine.core import Engine, version_info as _version_info
from .engine.index import IndexView
from .engine.schema import TableRecord
from .engine.replication import Replicator
from .engine.storage import SegmentStorage
from .engine.writer import CheckpointWriter
from .errors import (CompactionFailed, InvalidArgument, MissingRows, ReadOnlyError, TableNotFound, VersionNotFound,
                     VersionNotRetained, RemoteTakenOver)
from .maintenance import compaction
from .maintenance.background import BackgroundCompactor
from .policy import compaction as compaction_policy
from .lifecycle import PendingWork
from .types import KeyedRows, KeyLookup, Snapshot, TableInfo, VerifyReport, VersionInfo


def open(path, *, create: bool = False, readonly: bool = False, compaction=None, remote=None,  # noqa: A001
         remote_options: dict | None = None, cache_bytes: int | None = None,
         remote_every: int | None = None, remote_timeout_s: float | None = None,
         options: Options | None = None) -> "Store":
    """Open the store at ``path`` (see API.md). ``create=True`` makes it if absent.

    ``remote`` (an fsspec URL such as ``s3://bucket/prefix``; ``remote_options`` go to its file system) keeps
    the sealed segments in an object store, with at most ``cache_bytes`` of them cached in ``path``, and a
    copy of the index there as of every ``remote_every``-th commit (default 1) and of close (API.md, "The
    remote tier"); every request to it finishes within ``remote_timeout_s`` (default 60) plus a second per
    8 MiB it moves. On an empty ``path`` it recovers the store from the remote's last copy point (a read
    cache; opened writable, it takes the prefix over). ``remote`` may also be a connected
    ``cnrstore.engine.objects.ObjectStore`` (a multi-rank root hands each rank store its sub-prefix).

    Processes racing ``create=True`` on one path create it once; the others open it, or get StoreLocked
    while another holds it for writing. A file the process may not read or write raises PermissionDenied.

    ``compaction`` is None (off), "auto" (``cnrstore.policy.CompactionPolicy()``: the paper's intermittent
    rule) or a ``CompactionPolicy``: a background thread then carries it out after each commit, and
    catches up at once on what the history asks for (versions an earlier process committed and did not
    get to apply the policy to, e.g. a job that saves once per process); ``close()`` finishes it.

    ``options`` (a ``cnrstore.Options``) are this store's tunables: segment size, merge trigger and read
    bounds, GC thresholds, decode threads, ...; None: ``Options()``, the ``cnrstore.knobs`` values as they
    are now. The store keeps them (``Store.options``) and reads nothing else.
    """
    options = resolve_options(options)
    policy = compaction_policy.resolve(compaction, options)
    if policy is not None and readonly:
        raise InvalidArgument("compaction= needs a writable store; open with readonly=False")
    path = os.path.abspath(os.fspath(path))
    if remote is None:
        if any(x is not None for x in (remote_options, cache_bytes, remote_every, remote_timeout_s)):
            raise InvalidArgument("remote_options, cache_bytes, remote_every and remote_timeout_s need remote= (the "
                                  "object store's URL)")
        remote_tier.check_local_only(path, "open")
        store = Store(path, create=create, readonly=readonly, filesystem=fs.DEFAULT, options=options)
    else:
        store = _open_remote(path, remote, remote_options, readonly=readonly, create=create, cache_bytes=cache_bytes,
                             every=remote_every, timeout_s=remote_timeout_s, options=options)
    if policy is not None:
        store._life.compactor = BackgroundCompactor(store._engine, policy)
        store._engine.set_commit_listener(store._life.compactor.notify)
    return store


log = logging.getLogger("cnrstore.store")


def _open_remote(path: str, remote, remote_options, *, readonly: bool, create: bool, cache_bytes, every, timeout_s,
                 options) -> "Store":
    """``open`` of a store with a remote tier. A writable open of an empty (or absent) ``path`` recovers the
    store from the bucket and takes the prefix over; if the writer it takes over from went on past what was
    recovered (a stale writer's copy point between the recovery and the claim, deleting what the recovery reads),
    nothing was claimed: the directory is discarded and recovered again, ``CLAIM_TRIES`` times at most."""
    fresh = not readonly and (not os.path.exists(path) or (os.path.isdir(path) and not os.listdir(path)))
    existed = os.path.isdir(path)
    for tries in range(1, remote_tier.CLAIM_TRIES + 1):
        try:
            storage = remote_tier.open_storage(path, remote, remote_options, fs.DEFAULT, readonly=readonly,
                                               create=create, cache_bytes=cache_bytes, every=every,
                                               timeout_s=timeout_s)
            return Store(path, create=create, readonly=readonly, filesystem=fs.DEFAULT, storage=storage,
                         options=options)
        except RemoteTakenOver as exc:
            if not (fresh and getattr(exc, "recover_again", False)) or tries == remote_tier.CLAIM_TRIES:
                raise
            log.warning("cnrstore: %s: %s; recovering from the bucket again", path, exc)
            shutil.rmtree(path, ignore_errors=True)
            if existed:
                os.makedirs(path, exist_ok=True)
    raise AssertionError("unreachable")

#: The most seconds the interpreter's exit waits, over all stores together, for what this process has in
#: flight on its writable stores: saves a ``cnrstore.torch`` / ``cnrstore.distributed`` checkpointer has
#: returned from, and the pending background-compaction step. Past it (or at an interrupt while waiting)
#: the exit abandons that work: the store is left as ``kill -9`` would leave it (every committed version
#: intact; the next writable open truncates the torn tail and catches up on compaction). The environment
#: variable ``CNRSTORE_EXIT_WAIT_S`` sets it at import; assign it to change it later.
EXIT_WAIT_S = float(os.environ.get("CNRSTORE_EXIT_WAIT_S", "300"))

def _close_at_exit() -> None:
    """atexit: finish (within ``EXIT_WAIT_S``) and close every writable store this process left open
    (lifecycle.py)."""
    deadline = time.monotonic() + EXIT_WAIT_S
    for life in lifecycle.writable_open():
        try:
            life.close_at_exit(deadline, EXIT_WAIT_S)
        except BaseException as exc:  # noqa: BLE001 - one store's trouble must not stop the others' close
            log.warning("cnrstore: closing store %r at exit failed: %s: %s", life.path, type(exc).__name__, exc)


atexit.register(_close_at_exit)


#: How long ``open(create=True)`` waits for another process's creation of the same store to finish.
CREATE_WAIT_S = 10.0


class Store:
    """An open checkpoint store. Thread-safe for reads; one checkpoint writer at a time."""

    def __init__(self, root: str, *, create: bool, readonly: bool, filesystem: fs.FileSystem,
                 storage: SegmentStorage | None = None, replicator: Replicator | None = None,
                 options: Options | None = None):
        """Open (``create``: or make) the store at ``root`` (``Engine.open``). ``storage``: where segments are
        read and removed (storage.py); default the local files. ``replicator``: what keeps a remote copy
        current (replication.py; None: the storage, if it is one, as the remote tier's storage is).
        ``options``: its tunables (None: ``Options()``)."""
        self.path = os.path.abspath(root)
        self.readonly = readonly
        self._engine = Engine.open(self.path, filesystem, storage, readonly=readonly, create=create,
                                   create_wait_s=CREATE_WAIT_S, replicator=replicator,
                                   options=resolve_options(options))
        #: what close() and the interpreter's exit wait for, and how each ends (lifecycle.py)
        self._life = lifecycle.StoreLifecycle(self.path, self._engine, writable=not readonly)
        #: what opening for writing recovered or repaired (API.md)
        self.recovery_notes: list[str] = self._engine.recovery_notes

    # lifecycle --------------------------------------------------------------------------------------
    def close(self, *, finish_compaction: bool = True) -> None:
        """Close the store; idempotent.

        First it waits for the saves a ``cnrstore.torch`` (or distributed) checkpointer of this store
        has in flight: a save that returned commits. Then, with a compaction policy, it finishes the
        background work: the step in flight, and (``finish_compaction=True``, the default) the step a
        commit asked for that has not started, so that the policy applies to every committed version even
        when a process saves once and closes. That costs at most one more step on the final history: a
        drop is one index transaction; a baseline rewrites each block whose read chain is longer than
        one record (up to the size of the model); a GC pass walks the index and copies the live rows of
        the segments it cleans. ``finish_compaction=False`` skips that step when close must be quick: the
        next writable open with a policy catches up. Then an open checkpoint writer (one this program
        opened itself) is aborted.

        An interrupt (KeyboardInterrupt) while close waits leaves the store open and consistent: the
        interrupted save is told to abort at its next step, the compaction step to stop at its next
        phase, and a second ``close()`` (or the interpreter's exit) finishes the job.

        If background compaction failed since the last report, the store is still closed completely
        and then CompactionFailed is raised (once; ``__cause__`` is the newest failure). Every committed
        version is intact: a failed compaction step commits nothing.
        """
        self._life.close(finish_compaction)

    def add_pending_work(self, work: "PendingWork") -> None:
        """*For sibling packages* (``cnrstore.torch``, ``cnrstore.distributed``), not for applications:
        register background work that writes into this store (a checkpointer's saves in flight), so that
        ``close()`` and the interpreter's exit wait for it (see :class:`PendingWork`). The store holds
        ``work`` weakly: its owner keeps it alive as long as it may have work in flight."""
        self._life.add_pending_work(work)

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            self.close()
        except CompactionFailed:
            if exc_type is None:
                raise  # else the failure in the with-block matters more; compaction's is logged

    @property
    def compaction_error(self) -> BaseException | None:
        """The newest failure of background compaction since open (the exception a step raised), or None.
        A failure leaves the store intact and checkpoints working; the worker retries after the next commit."""
        return self._life.compaction_error

    def wait_for_compaction(self, timeout: float | None = None) -> bool:
        """Block until background compaction has no step pending or running, for good (None) or at most
        ``timeout`` seconds (0: just ask); whether it is idle (always True without a compaction policy).
        For programs that measure or copy the settled store; checkpoints never need it."""
        self._check_open()
        return self._life.wait_for_compaction(timeout)

    @property
    def _compactor(self):
        """The background compactor, or None (tests and tools look at it)."""
        return self._life.compactor

    @_compactor.setter
    def _compactor(self, compactor) -> None:
        self._life.compactor = compactor

    @property
    def _closed(self) -> bool:
        return self._life.closed

    def __del__(self):
        life = getattr(self, "_life", None)  # (None: the open failed)
        if life is not None:
            life.collected()

    def _check_open(self) -> None:
        self._engine.check_open()

    @property
    def options(self) -> Options:
        """The tunables this store was opened with (``cnrstore.Options``, frozen)."""
        return self._engine.options

    @property
    def engine(self) -> Engine:
        """The storage engine beneath this store (``cnrstore.engine.Engine``, engine/core.py), for tools
        such as the CLI; not part of API.md's contract."""
        return self._engine

    def _table_record(self, name: str, view: IndexView | None = None) -> TableRecord | None:
        return self._engine.table_record(name, view)

    def _check_writable(self) -> None:
        self._check_open()
        if self.readonly:
            raise ReadOnlyError(f"store {self.path!r} is open readonly; open it with readonly=False to write")
        self._engine.check_still_ours()  # StoreMoved once the directory was renamed away: paths would name another

    # tables -----------------------------------------------------------------------------------------
    def create_table(self, name: str, num_rows: int | None = None, dim: int | None = None, *, codec: str = "fp32",
                     block_rows: int | None = None, exist_ok: bool = False, keyed: bool = False,
                     partitions: int | None = None, columns=None) -> TableInfo:
        """Create a table (durably, at once); ``codec`` defaults to lossless fp32. Bad sizes raise
        InvalidArgument, and so does a name in use -- unless ``exist_ok`` and the table there has this
        shape and codec (its TableInfo is then returned; another shape or codec is still InvalidArgument).

        ``keyed=True`` makes a keyed table (API.md, "Keyed tables"): rows addressed by int64 keys, no
        ``num_rows``; ``partitions`` (default ``knobs.DEFAULT_PARTITIONS``, fixed forever) and ``columns``
        ({name: dtype} or {name: (dtype, width)}: per-key numbers stored losslessly beside each value)."""
        if keyed:
            return self._create_keyed(name, num_rows, dim, codec, block_rows, exist_ok, partitions, columns)
        if partitions is not None or columns is not None:
            raise InvalidArgument(f"table {name!r}: partitions= and columns= are for keyed tables (keyed=True)")
        if num_rows is None or dim is None:
            raise InvalidArgument(f"table {name!r}: a positional table needs num_rows and dim")
        if exist_ok:
            existing = self.tables().get(name)
            if existing is not None:
                if (existing.num_rows, existing.dim, existing.codec) != (num_rows, dim, codec):
                    raise InvalidArgument(
                        f"table {name!r} exists with {existing.num_rows} rows x {existing.dim} dims in "
                        f"{existing.codec}, not {num_rows} x {dim} in {codec}; choose another name")
                return existing
        self._check_writable()
        arguments.name(name, "table name")
        num_rows = arguments.positive_int(num_rows, "num_rows")
        dim = arguments.positive_int(dim, "dim")
        arguments.table_shape(name, num_rows, dim)  # int64 row ids; a row must fit a record
        c = codecs.get(codec)
        most = arguments.max_block_rows(dim)  # a block's record must fit its u32 length in every codec
        if block_rows is None:
            block_rows = blocks_math.default_block_rows(c.row_bytes(dim), most, self.options.block_target_bytes,
                                                        self.options.min_block_rows)
        else:
            block_rows = arguments.positive_int(block_rows, "block_rows")
            if block_rows & (block_rows - 1) or block_rows > knobs.MAX_BLOCK_ROWS:
                raise InvalidArgument(f"block_rows must be a power of two at most {knobs.MAX_BLOCK_ROWS}, "
                                      f"got {block_rows}")
            if block_rows > most:
                raise InvalidArgument(f"table {name!r}: a block of {block_rows} rows of dim {dim} does not fit "
                                      f"one record (at most {knobs.MAX_RECORD_BYTES} bytes); choose block_rows "
                                      f"at most {most}, or leave it to the default")

        return self._engine.create_table(name, num_rows, dim, c.name, block_rows).info()

    def _create_keyed(self, name, num_rows, dim, codec, block_rows, exist_ok, partitions, columns) -> TableInfo:
        if num_rows is not None or block_rows is not None:
            raise InvalidArgument(f"keyed table {name!r} has no num_rows or block_rows (its rows are keys); pass "
                                  "dim= and, if you like, partitions=")
        if dim is None:
            raise InvalidArgument(f"keyed table {name!r} needs dim= (0: a key's row is its columns alone)")
        dim = 0 if dim == 0 and not isinstance(dim, bool) else arguments.positive_int(dim, "dim")
        arguments.table_shape(name, 1, dim)
        parts = knobs.DEFAULT_PARTITIONS if partitions is None else arguments.positive_int(partitions, "partitions")
        if parts > keyed_runs.MAX_PARTITIONS:
            raise InvalidArgument(f"partitions must be at most {keyed_runs.MAX_PARTITIONS}, got {parts}")
        cols = keyed_columns(name, columns)
        c = codecs.get(codec)
        if not dim and (not cols or c.name != "fp32"):
            raise InvalidArgument(f"keyed table {name!r} of dim 0 needs columns= (its rows are its columns) and the "
                                  "default codec")
        if exist_ok:
            existing = self.tables().get(name)
            if existing is not None:
                if (existing.keyed, existing.dim, existing.codec, existing.partitions, existing.columns) != (
                        True, dim, c.name, parts, cols):
                    raise InvalidArgument(f"table {name!r} exists with another shape ({existing}); choose another name")
                return existing
        self._check_writable()
        arguments.name(name, "table name")
        return self._engine.create_table(name, parts, dim, c.name, 1, keyed=True, columns=cols).info()

    def tables(self) -> dict[str, TableInfo]:
        self._check_open()
        with self._engine.read() as view:
            return {name: table.info() for name, table in sorted(view.tables().items())}

    def dense_names(self) -> list[str]:
        """The names of every dense array any retained version holds or held, sorted (``read_dense`` says
        whether a given version holds one: MissingRows otherwise)."""
        self._check_open()
        with self._engine.read() as view:
            return sorted(view.dense_names())

    # checkpoints ------------------------------------------------------------------------------------
    def checkpoint(self, step: int | None = None, meta: dict | None = None) -> CheckpointWriter:
        """Begin a new version; see API.md. Only one writer may be open at a time."""
        self._check_writable()
        arguments.check_meta(meta)
        step = arguments.step_arg(step)
        step = None if step is None else int(step)
        engine = self._engine
        return engine.begin_writer(lambda version, parent, parts: CheckpointWriter(engine, parts, version, parent, step,
                                                                                  meta))

    # reads ------------------------------------------------------------------------------------------
    def versions(self) -> list[VersionInfo]:
        self._check_open()
        with self._engine.read() as view:
            return [_version_info(v, info) for v, info in view.versions()]

    def latest(self) -> VersionInfo | None:
        self._check_open()
        with self._engine.read() as view:
            found = view.latest()
        return None if found is None else _version_info(*found)

    def read_rows(self, table: str, rows, version: int | None = None) -> np.ndarray:
        """float32 (len(rows), dim): the rows as of ``version`` (default: newest committed)."""
        with self._read(version, table) as (view, v):
            info = self._table_or_raise(table, view)
            ids = arguments.row_ids(rows, info.num_rows, table)
            return reader.read_rows(view, self._engine.storage, info, ids, v)

    def read_table(self, table: str, version: int | None = None, *, out=None) -> np.ndarray:
        """float32 (num_rows, dim): the whole table as of ``version``, decoded in parallel over its blocks.

        ``out`` (a writable C-contiguous float32 (num_rows, dim) numpy array or CPU torch tensor) receives
        the rows instead of a new array, and is returned (as numpy). Every record is verified before
        ``out`` is written: an error leaves it untouched (API.md, "Reading into your own arrays").
        """
        return self.read_tables({table: out}, version)[table]

    def read_tables(self, tables, version: int | None = None) -> dict[str, np.ndarray]:
        """{name: float32 array}: each table of ``tables`` as of ``version``, in one read transaction. Each
        value of ``tables`` says where its rows go: None, the whole table into a new array; an out array
        (as ``read_table`` takes it), the whole table into it; ``(start, out)``, rows ``start .. start +
        len(out) - 1`` into ``out`` (float32 C-contiguous ``(n, dim)``), every one of them written. Every
        record of every table is verified before any ``out`` is written; then the blocks of all tables are
        decoded in parallel into the ``out`` arrays (distinct memory). ``tables`` may also be names alone (a
        name, or an iterable of them): each whole table into a new array."""
        if not isinstance(tables, Mapping):
            tables = dict.fromkeys(arguments.table_names(tables))
        with self._read(version, list(tables)) as (view, v):
            jobs = []
            for name, out in tables.items():
                info = self._table_or_raise(name, view)
                if isinstance(out, tuple):
                    if len(out) != 2:
                        raise InvalidArgument(f"read_tables: the value for table {name!r} must be None, an out "
                                              f"array or (start, out), got a tuple of {len(out)}")
                    start, out = out
                    jobs.append((info, table_decode.check_out(out, info, "out", start), int(start)))
                else:
                    jobs.append((info, None if out is None else table_decode.check_out(out, info, "out"), 0))
            return dict(zip(tables, table_decode.read_tables(view, self._engine.storage, jobs, v,
                                                             options=self.options)))

    # keyed tables ----------------------------------------------------------------------------------
    def read_keys(self, table: str, keys, version: int | None = None) -> KeyLookup:
        """KeyLookup(found, values, columns) of ``keys`` of keyed table ``table`` as of ``version`` (default:
        newest): ``found[i]`` whether key i is live there; values float32 (n, dim) and each column, zeros
        where not found. Keys may repeat and come in any order."""
        with self._read(version, table) as (view, v):
            info = self._keyed_or_raise(table, view, "read_keys")
            k = keyed_writer.keys_arg(keys, table)
            found, rows = keyed_reader.read_keys(view, self._engine.storage, info, k, v)
            return KeyLookup(found, rows.values, rows.columns)

    def keys(self, table: str, version: int | None = None) -> np.ndarray:
        """int64, ascending: every key of keyed table ``table`` live at ``version`` (default: newest)."""
        with self._read(version, table) as (view, v):
            info = self._keyed_or_raise(table, view, "keys")
            return keyed_reader.read_all(view, self._engine.storage, info, v, keys_only=True).keys

    def read_keyed(self, table: str, version: int | None = None, *, partitions=None) -> KeyedRows:
        """KeyedRows(keys, values, columns): every key of keyed table ``table`` live at ``version``
        (default: newest), ascending, with its value (float32 (n, dim)) and columns. ``partitions`` (an
        iterable of partition numbers, ``partition_of`` tells a key's) reads only those: what a rank that
        owns them reads, and nothing else."""
        with self._read(version, table) as (view, v):
            info = self._keyed_or_raise(table, view, "read_keyed")
            parts = None if partitions is None else keyed_partitions(partitions, info)
            return keyed_reader.read_all(view, self._engine.storage, info, v, parts)

    def partition_of(self, table: str, keys) -> np.ndarray:
        """int64: the partition of each key of keyed table ``table`` (fixed for the table's life)."""
        self._check_open()
        with self._engine.read() as view:
            info = self._keyed_or_raise(table, view, "partition_of")
        return keyed_runs.partition_of(keyed_writer.keys_arg(keys, table), info.partitions)

    def _keyed_or_raise(self, table: str, view: IndexView, what: str) -> TableRecord:
        info = self._table_or_raise(table, view, positional=False)
        keyed_reader.check_keyed(info, what)
        return info

    def read_dense(self, name: str, version: int | None = None) -> np.ndarray:
        """The dense array as put (dtype, shape, bytes), as of ``version``."""
        with self._read(version) as (view, v):
            dense_id = view.dense_id(name)
            arr = None if dense_id is None else reader.read_dense(view, self._engine.storage, dense_id, name, v)
            if arr is None:
                raise MissingRows(f"dense array {name!r} was never put at or before version {v}")
            return arr

    def restore(self, version: int | None = None, progress=None) -> Snapshot:
        """Every table and dense array as of ``version``, with its step and meta.

        A table with no row written at or before the version is left out; a table only partly
        written raises MissingRows (use read_rows for sparse tables). ``progress(done, total)``, if given,
        is called as the read advances, in bytes: the tables' fp32 bytes as their blocks are decoded, then
        each dense array's record as it is read (``total`` is their sum, known before the first call).
        """
        with self._read(version) as (view, v):
            info = view.version(v)
            snap = Snapshot(version=v, step=info["step"], meta=info["meta"])
            written = [tinfo for _name, tinfo in sorted(view.tables().items()) if _written_by(view, tinfo, v)]
            jobs = [(tinfo, None, 0) for tinfo in written if not tinfo.keyed]
            snap.keyed.update((t.name, keyed_reader.read_all(view, self._engine.storage, t, v)) for t in written
                              if t.keyed)
            snap.partitions.update((t.name, int(t.partitions)) for t in written if t.keyed)
            dense = [(name, dense_id, found[1]) for name, dense_id in sorted(view.dense_names().items())
                     if (found := view.dense_at(dense_id, v)) is not None]
            table_bytes = sum(tinfo.num_rows * tinfo.dim * 4 for tinfo, _, _ in jobs)
            total = table_bytes + sum(loc.length for _, _, loc in dense)
            tables_progress = None if progress is None else (lambda done, _total: progress(done, total))
            storage = self._engine.storage
            # every record of the version, the dense arrays' after the tables', fetched ahead in that order
            with table_decode.fetch_ahead(view, storage, jobs, v, then=[loc for _, _, loc in dense], bounded=True):
                arrays = table_decode.read_tables(view, storage, jobs, v, tables_progress, options=self.options,
                                                  fetched=True)
                snap.tables.update((tinfo.name, arr) for (tinfo, _, _), arr in zip(jobs, arrays))
                done = table_bytes
                for name, dense_id, loc in dense:
                    arr = reader.read_dense(view, storage, dense_id, name, v)
                    if arr is not None:
                        snap.dense[name] = arr
                    if progress is not None:
                        done += loc.length
                        progress(done, total)
            return snap

    # changes between versions (engine/changes.py) ------------------------------------------------------
    def changes(self, since: int | None, until: int | None = None, tables=None, *,
                encoded: bool = False) -> Iterator[changes_rule.TableChanges]:
        """What a replica holding version ``since`` needs to read as ``until`` (default: the newest): an
        iterator of one ``TableChanges`` per table (every table, or the names in ``tables``; name order),
        each with the rows whose value at ``until`` came from a version newer than ``since`` (sorted int64
        ``rows``) and their values at ``until`` -- float32 ``values``, or with ``encoded=True`` the rows as
        stored (``parts``: ``EncodedRows`` per codec, which the codec's ``decode`` turns into the same
        float32 bits). Apply each table's rows over the replica's copy at ``since`` and it equals the table
        at ``until``. ``since`` None or 0: every row written at or before ``until`` (a full sync).

        It costs what those rows cost: only blocks with an index entry in ``(since, until]`` are read, and
        in each only the records newer than ``since`` (docs/DESIGN.md, "Changes between versions"). Never
        under-reports. It over-reports rows a checkpoint in ``(since, until]`` put with the value they
        already had; rows a merge, a new baseline or ``compact`` carried over unchanged are compared with
        their value at ``since`` (a read of those rows there) and left out when equal.

        Checked before the iterator is returned: ``until`` must be retained (``VersionNotFound``),
        ``since`` too (``VersionNotRetained``, a ``VersionNotFound``: re-sync with ``since=None``), ``until
        >= since`` (``InvalidArgument``), and every name in ``tables`` a table (``TableNotFound``). Each
        table is read in a read transaction of its own, at the same two versions; one of them dropped
        meanwhile raises the same errors from ``next()``. Works on readonly stores and remote tiers alike.
        Dense arrays: ``dense_changes``.
        """
        names, since, until, encoded = self._changes_args(since, until, tables, encoded)

        def each() -> Iterator[changes_rule.TableChanges]:
            for name in names:
                self._check_open()
                with self._engine.read() as view:  # (ended before the yield: no transaction waits on the caller)
                    _check_changes_versions(view, since, until, self.path)
                    info = self._table_or_raise(name, view, positional=False)
                    if info.keyed:
                        found = keyed_reader.keyed_changes(view, self._engine.storage, info, since, until)
                    else:
                        found = changes_rule.table_changes(view, self._engine.storage, info, since, until,
                                                           encoded=encoded)
                yield found  # (its arrays are copies: nothing of it points into a segment's map)

        return each()

    def dense_changes(self, since: int | None, until: int | None = None, names=None) -> dict[str, np.ndarray]:
        """{name: array at ``until``} of the dense arrays (every one, or ``names``) whose value at ``until``
        (default: the newest) was put by a version newer than ``since`` (None or 0: every array ``until``
        holds): exact, an array put again with the same bytes included. Versions are checked as
        ``changes`` checks them; an unknown name raises ``MissingRows``."""
        self._check_open()
        since, until = _changes_versions(since, until)
        names = arguments.table_names(names, "names")
        with self._engine.read() as view:
            since, until = _check_changes_versions(view, since, until, self.path)
            if names is not None:
                known = view.dense_names()
                unknown = [n for n in names if n not in known]
                if unknown:
                    raise MissingRows(f"no dense array named {unknown[0]!r} in this store (see dense_names())")
            return changes_rule.dense_changes(view, self._engine.storage, since, until, names)

    def _changes_args(self, since, until, tables, encoded) -> tuple[list[str], int, int, bool]:
        """(table names, since, until, encoded) of a ``changes`` call, every argument checked (the types
        before the store is read)."""
        self._check_open()
        since, until = _changes_versions(since, until)
        tables = arguments.table_names(tables)
        encoded = arguments.flag(encoded, "encoded")
        with self._engine.read() as view:
            since, until = _check_changes_versions(view, since, until, self.path)
            if tables is None:
                names = sorted(view.tables())
            else:
                names = tables
                for name in names:
                    self._table_or_raise(name, view, positional=False)
        return names, since, until, encoded

    def _table_or_raise(self, table: str, view: IndexView, *, positional: bool = True) -> TableRecord:
        info = self._engine.table_record(table, view)
        if info is None:
            raise TableNotFound(f"no table {table!r} in this store (tables: {sorted(view.tables())[:10]})")
        if positional:
            keyed_reader.check_positional(info, "reading rows by position")
        return info

    def _read(self, version, table: str | list[str] | None = None):
        """A read transaction and the version it reads; an unknown ``table`` (or one of a list) is named
        before any version."""
        self._check_open()
        version = arguments.version_arg(version)
        names = arguments.table_names(table, "table")  # (a name that is no str: InvalidArgument, not TypeError)
        check = None if not names else (lambda view: [self._table_or_raise(name, view, positional=False)
                                                      for name in names])
        return _ReadContext(self._engine, version, check)

    def read_amplification(self, version: int | None = None) -> dict[str, np.ndarray]:
        """{table name: float64 array, one entry per block with a record at or before ``version`` (default:
        newest), in block order}: what reading that block's chain at ``version`` costs over what one baseline
        of the block costs (engine/merge.py ``read_amplification``; 1.0 for a lone baseline): each record at
        its own bytes whatever its codec, one baseline every row in the table's codec or the block's
        baseline record if larger. The arrays' maximum is what the store's ``Options.read_amp_bound`` bounds
        and ``Options.merge_trigger`` aims below."""
        with self._read(version) as (view, v):
            out = {}
            for name, info in sorted(view.tables().items()):
                if info.keyed:  # a keyed table: the records a read of each partition walks
                    out[name] = np.asarray([sum(1 for _ in view.row_chain(info.id, p, v))
                                            for p, oldest in view.row_blocks(info.id) if oldest <= v], np.float64)
                    continue
                amps = [merge.read_amplification(info, block, merge.walk_chain(view, info.id, block, v), self.options)
                        for block, oldest in view.row_blocks(info.id) if oldest <= v]
                out[name] = np.asarray(amps, dtype=np.float64)
            return out

    # maintenance ------------------------------------------------------------------------------------
    def compact(self, version: int | None = None, progress=None) -> "compaction.CompactReport":
        """Materialize a baseline at ``version`` (default: newest) for every block whose read chain there
        is longer than one record. What every version reads is unchanged, bit for bit. May run while a
        checkpoint is being written."""
        self._check_writable()
        with self._engine.maintenance() as m:
            with self._read(version) as (_view, v):
                pass
            return compaction.materialize(m, v, progress)

    def retain(self, keep_last: int | None = None, *, keep_every_n_steps: int | None = None, keep=(),
               drop=()) -> list[int]:
        """Drop versions by the same rules as a Checkpointer's retention; returns the dropped versions, oldest
        first.

        ``keep_last`` keeps the newest N, ``keep_every_n_steps`` those whose step is a multiple of N, ``keep``
        (version numbers) pins those: with any of these, every version none of them keeps is dropped (the
        newest is always kept). ``drop`` (version numbers) drops those -- alone, or on top of the rules --
        except one a rule keeps, and never the newest (InvalidArgument names it). At least one argument.

        Nothing is materialized: the index keeps exactly the entries some kept version reads, and ``gc``
        then reclaims the rest, down to the rows (a record kept versions read only partly is rewritten
        with those rows). What every kept version reads is unchanged, bit for bit.
        """
        if keep_last is not None:
            keep_last = arguments.positive_int(keep_last, "keep_last")
        if keep_every_n_steps is not None:
            keep_every_n_steps = arguments.positive_int(keep_every_n_steps, "keep_every_n_steps")
        pinned = arguments.version_set(keep, "keep")
        dropping = arguments.version_set(drop, "drop")
        rules = ([compaction_policy.KeepLast(keep_last)] if keep_last else []) + (
            [compaction_policy.KeepEveryNSteps(keep_every_n_steps)] if keep_every_n_steps else []) + (
            [compaction_policy.KeepVersions(frozenset(pinned))] if pinned else [])
        if not rules and not dropping:
            raise InvalidArgument("retain needs a rule: keep_last=N, keep_every_n_steps=N, keep=[versions] (pinned) "
                                  "or drop=[versions]")
        self._check_writable()
        with self._engine.maintenance() as m:
            with m.read() as view:
                history = tuple(_version_info(v, info) for v, info in view.versions())
            present = {v.version for v in history}
            unknown = sorted((pinned | dropping) - present)
            if unknown:
                raise VersionNotFound(f"version(s) {unknown} are not in store {self.path!r} (see `cnrstore ls`)")
            if history and history[-1].version in dropping:
                raise InvalidArgument(f"version {history[-1].version} is the newest: retain never drops it (a trainer "
                                      "resumes from it); write a newer version first")
            kept = set(present) - compaction_policy.Retention(*rules).to_drop(history) if rules else set(present)
            clash = sorted(dropping & (kept if rules else pinned))
            if rules and clash:
                raise InvalidArgument(f"version(s) {clash} are both kept by a rule and named in drop=; drop them "
                                      "with a rule that does not keep them")
            doomed = (set(present) - kept) | dropping
            if not doomed:
                return []
            return compaction.drop_versions(m, doomed)

    def drop_versions(self, versions, *, allow_newest: bool = False) -> list[int]:
        """*For sibling packages* (``cnrstore.distributed``), not for applications: drop ``versions`` (those
        present) and every index entry no kept version reads, as ``retain`` does; returns the dropped
        versions, oldest first. The newest version is dropped only with ``allow_newest`` (a local version
        no global version refers to); version numbers are never reused either way. Runs under the
        maintenance lock, one at a time with compact, retain and gc; ``gc`` then reclaims the space."""
        self._check_writable()
        with self._engine.maintenance() as m:
            return compaction.drop_versions(m, set(versions), allow_newest=allow_newest)

    def replace_dense(self, name: str, version: int, array) -> None:
        """*For sibling packages* (``cnrstore.torch.migrate``), not for applications: rewrite dense array
        ``name`` of committed ``version`` as ``array`` (a new record; the old one is dead bytes for ``gc``),
        under the maintenance lock. InvalidArgument if the version holds no such array."""
        self._check_writable()
        with self._engine.maintenance() as m:
            compaction.replace_dense(m, name, version, array)

    def gc(self, progress=None) -> "compaction.GCReport":
        """Reclaim the space of dropped and shadowed records (see compaction.collect)."""
        self._check_writable()
        with self._engine.maintenance() as m:
            return compaction.collect(m, progress)

    def verify(self, progress=None) -> VerifyReport:
        """Check every checksum of live data and the index against the log; never raises for damage."""
        from .maintenance.verify import verify_store

        self._check_open()
        return verify_store(self._engine, progress)

    def stats(self) -> dict:
        """Sizes and shape of the store (API.md lists the keys)."""
        self._check_open()
        with self._engine.read() as view:
            versions = view.versions()
            live, max_chain = _scan_row_index(view, [v for v, _info in versions])
            live += sum(loc.length for *_k, loc in view.dense_entries())
            seg_bytes = sum(view.segments().values())
            entries = view.stat()["rows"]["entries"]
            stats = {
                "bytes_written": schema.BYTES_WRITTEN.get(view),
                "bytes_on_disk": self._disk_bytes(),
                "live_bytes": live,
                "segment_bytes": seg_bytes,
                "index_bytes": self._engine.index_bytes(),
                "index_entries": entries,
                "versions": len(versions),
                "tables": len(view.tables()),
                "max_read_chain": max_chain,
                "compaction_errors": self._life.compactor.failures if self._life.compactor is not None else 0,
                "compaction_steps": self._life.compactor.steps if self._life.compactor is not None else 0,
            }
            increments = schema.INCREMENT_BYTES.get(view, stats["bytes_written"])
            stats["increment_bytes"] = increments
            stats["save_bytes"] = schema.SAVE_BYTES.get(view, stats["bytes_written"])
            stats["merge_bytes"] = schema.MERGE_BYTES.get(view)
        # all bytes appended over the bytes of the checkpoints' own rows; the saves' own share of it; disk
        # over what the index names
        stats["write_amplification"] = stats["bytes_written"] / increments if increments else None
        stats["save_write_amplification"] = stats["save_bytes"] / increments if increments else None
        stats["space_amplification"] = stats["bytes_on_disk"] / live if live else None
        remote = self._engine.replication_status()
        if remote is not None:
            stats["remote"] = remote
        return stats

    def sync_remote(self) -> None:
        """Make a copy point now (a store opened with ``remote=``): every segment the index references
        uploaded, the index snapshot uploaded, the pointer replaced. RemoteStorageError if the object store
        fails (the remote then still reads at its previous copy point); InvalidArgument without a remote."""
        self._check_writable()
        self._engine.copy_point()

    def _disk_bytes(self) -> int:
        return self._engine.storage.disk_bytes() + sum(
            fs.allocated_bytes(d) for d in (self.path, filenames.index_dir(self.path)))


class _ReadContext:
    """One read transaction and the version it reads (resolving None to the newest committed)."""

    def __init__(self, engine: Engine, version: int | None, check=None):
        self._engine = engine
        self._version = version
        self._check = check
        self._cm = None

    def __enter__(self):
        self._cm = self._engine.read()
        view = self._cm.__enter__()
        try:
            if self._check is not None:
                self._check(view)
            if self._version is None:
                latest = view.latest()
                if latest is None:
                    raise VersionNotFound("the store has no committed version yet")
                version = latest[0]
            else:
                version = self._version
                if view.version(version) is None:
                    raise VersionNotFound(f"version {version} does not exist (never committed, or dropped)")
            return view, version
        except BaseException:
            self._cm.__exit__(None, None, None)
            raise

    def __exit__(self, *exc):
        return self._cm.__exit__(*exc)


def _changes_versions(since, until) -> tuple[int, int | None]:
    """``since`` (None -> 0) and ``until`` of a changes call as non-negative ints (or None)."""
    since = arguments.version_arg(since, "since")
    return (0 if since is None else since), arguments.version_arg(until, "until")


def _check_changes_versions(view: IndexView, since: int, until: int | None, path: str) -> tuple[int, int]:
    """(since, until) once both are checked in ``view``: ``until`` (None: the newest) retained, ``since`` 0 or
    retained, and not after ``until``."""
    if until is None:
        latest = view.latest()
        if latest is None:
            raise VersionNotFound("the store has no committed version yet")
        until = latest[0]
    elif view.version(until) is None:
        raise VersionNotFound(f"version {until} does not exist (never committed, or dropped)")
    if since > until:
        raise InvalidArgument(f"changes since version {since} until version {until}: since must not be after "
                              "until: pass since <= until (since None or 0 for every row)")
    if since and view.version(since) is None:
        raise VersionNotRetained(
            f"version {since} is not retained in store {path!r} (dropped by retention, or never committed), so what "
            f"changed since it cannot be told: re-sync with a full read (since=None, or `cnrstore diff STORE 0`) and follow the store from the "
            f"version that read returns (keep the replica's version from being dropped, e.g. retain(keep=[...]))",
            since)
    return since, until


def _written_by(view: IndexView, tinfo: TableRecord, version: int) -> bool:
    """Whether any row of the table was written at or before ``version``: one index seek per block
    that has records (usually the first answers), however many versions or rows the table has."""
    return any(oldest <= version for _block, oldest in view.row_blocks(tinfo.id))


def _scan_row_index(view: IndexView, versions: list[int]) -> tuple[int, int]:
    """(bytes of every row record the index names, the longest read chain of any block at any of
    ``versions``) in one pass over the row index."""
    live = 0

    def entries():
        nonlocal live
        for entry in view.row_entries():
            live += entry[3].length
            yield entry

    chains = compaction.read_chain_lengths(entries(), versions)
    return live, int(chains.max(initial=0))

