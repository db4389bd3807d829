"""Layer 3 — the index: one LMDB environment with the catalogs and the row-block index.

Named databases (keys big-endian so LMDB's byte order is numeric order; on disk, never change):

    meta        ascii name → msgpack value          format, next_version, next_table_id, next_dense_id
    tables      table name (utf-8) → msgpack dict   id, num_rows, dim, codec, block_rows, created
    versions    version u64 → msgpack dict          step, meta, created, parent, tables, dense, bytes
    segments    segment id u64 → msgpack dict       {"length": committed length}
    rows        table u32 · block u64 · version u64 → ROW_LOC (segment, offset, length, count, flags)
    dense_names name (utf-8) → dense id u32
    dense       dense id u32 · version u64 → DENSE_LOC (segment, offset, length)

"Newest record of block b at or before version v" is one ``set_range`` to (t, b, v+1) and one ``prev``.
Only this module imports lmdb; every lmdb error is wrapped here. The map grows on demand: callers
never see MapFullError.
"""

from __future__ import annotations

import contextlib
import errno
import os
import struct
import threading
from typing import Callable, Iterator, NamedTuple, TypeVar

import lmdb
import msgpack

from . import fs, knobs
from .errors import CorruptionError, PermissionDenied

T = TypeVar("T")

ROW_KEY = struct.Struct(">IQQ")
DENSE_KEY = struct.Struct(">IQ")
VERSION_KEY = struct.Struct(">Q")
ROW_LOC = struct.Struct("<IIIIB")  # segment, offset, length, count, flags
DENSE_LOC = struct.Struct("<III")  # segment, offset, length
#: Below this an empty store's catalogs do not fit the map (LMDB needs a few pages per database).
_MIN_MAP_BYTES = 64 << 10
_DBS = (b"meta", b"tables", b"versions", b"segments", b"rows", b"dense_names", b"dense")


class RowLoc(NamedTuple):
    """Where a row-block record lies, with its row count and record flags."""

    segment: int
    offset: int
    length: int
    count: int
    flags: int


class DenseLoc(NamedTuple):
    segment: int
    offset: int
    length: int


def _pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def _unpack(data) -> object:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


class _SharedExclusiveLock:
    """Many holders of the shared side (transactions), or one of the exclusive side (map resizes).

    LMDB's set_mapsize requires that no transaction of this process is active.
    """

    def __init__(self):
        self._cond = threading.Condition()
        self._shared = 0
        self._exclusive = False
        self._waiting = 0  # threads waiting for the exclusive side: new shared holders queue behind them

    def acquire_shared(self) -> None:
        with self._cond:
            while self._exclusive or self._waiting:  # else a stream of readers starves a map resize
                self._cond.wait()
            self._shared += 1

    def release_shared(self) -> None:
        with self._cond:
            self._shared -= 1
            self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self):
        with self._cond:
            self._waiting += 1
            try:
                while self._exclusive or self._shared:
                    self._cond.wait()
            finally:
                self._waiting -= 1
            self._exclusive = True
        try:
            yield
        finally:
            with self._cond:
                self._exclusive = False
                self._cond.notify_all()


class IndexView:
    """Reads of one LMDB transaction: every answer comes from one consistent committed state."""

    def __init__(self, txn: lmdb.Transaction, dbs: dict):
        self._txn = txn
        self._dbs = dbs

    # catalogs -------------------------------------------------------------------------------------
    def meta(self, key: str, default=None):
        raw = self._txn.get(key.encode(), db=self._dbs[b"meta"])
        return default if raw is None else _unpack(raw)

    def table(self, name: str) -> dict | None:
        raw = self._txn.get(name.encode(), db=self._dbs[b"tables"])
        return None if raw is None else _unpack(raw)

    def tables(self) -> dict[str, dict]:
        with self._txn.cursor(db=self._dbs[b"tables"]) as cur:
            return {k.decode(): _unpack(v) for k, v in cur}

    def version(self, version: int) -> dict | None:
        if not 0 <= version < 2**64:
            return None  # no such key can exist
        raw = self._txn.get(VERSION_KEY.pack(version), db=self._dbs[b"versions"])
        return None if raw is None else _unpack(raw)

    def versions(self) -> list[tuple[int, dict]]:
        with self._txn.cursor(db=self._dbs[b"versions"]) as cur:
            return [(VERSION_KEY.unpack(k)[0], _unpack(v)) for k, v in cur]

    def latest(self) -> tuple[int, dict] | None:
        with self._txn.cursor(db=self._dbs[b"versions"]) as cur:
            if not cur.last():
                return None
            return VERSION_KEY.unpack(cur.key())[0], _unpack(cur.value())

    def segments(self) -> dict[int, int]:
        with self._txn.cursor(db=self._dbs[b"segments"]) as cur:
            return {VERSION_KEY.unpack(k)[0]: _unpack(v)["length"] for k, v in cur}

    def dense_id(self, name: str) -> int | None:
        raw = self._txn.get(name.encode(), db=self._dbs[b"dense_names"])
        return None if raw is None else struct.unpack(">I", raw)[0]

    # row index ------------------------------------------------------------------------------------
    def row_chain(self, table_id: int, block: int, version: int) -> Iterator[tuple[int, RowLoc]]:
        """(version, location) of block's records at or before ``version``, newest first."""
        cur = self._txn.cursor(db=self._dbs[b"rows"])  # one per walk: walks may interleave
        ok = _seek_at_or_before(cur, ROW_KEY.pack(table_id, block, version))
        while ok:
            t, b, v = ROW_KEY.unpack(cur.key())
            if t != table_id or b != block:
                return
            yield v, RowLoc._make(ROW_LOC.unpack(cur.value()))
            ok = cur.prev()

    def row_entries(self, table_id: int | None = None) -> Iterator[tuple[int, int, int, RowLoc]]:
        """Every (table, block, version, location) of the row index, in key order."""
        with self._txn.cursor(db=self._dbs[b"rows"]) as cur:
            ok = cur.set_range(ROW_KEY.pack(table_id, 0, 0)) if table_id is not None else cur.first()
            while ok:
                t, b, v = ROW_KEY.unpack(cur.key())
                if table_id is not None and t != table_id:
                    return
                yield t, b, v, RowLoc._make(ROW_LOC.unpack(cur.value()))
                ok = cur.next()

    def dense_at(self, dense_id: int, version: int) -> tuple[int, DenseLoc] | None:
        """(version, location) of the newest record of a dense array at or before ``version``."""
        with self._txn.cursor(db=self._dbs[b"dense"]) as cur:
            ok = _seek_at_or_before(cur, DENSE_KEY.pack(dense_id, version))
            if not ok:
                return None
            d, v = DENSE_KEY.unpack(cur.key())
            if d != dense_id:
                return None
            return v, DenseLoc._make(DENSE_LOC.unpack(cur.value()))

    def dense_entries(self) -> Iterator[tuple[int, int, DenseLoc]]:
        with self._txn.cursor(db=self._dbs[b"dense"]) as cur:
            for k, val in cur:
                d, v = DENSE_KEY.unpack(k)
                yield d, v, DenseLoc._make(DENSE_LOC.unpack(val))

    def dense_names(self) -> dict[str, int]:
        with self._txn.cursor(db=self._dbs[b"dense_names"]) as cur:
            return {k.decode(): struct.unpack(">I", v)[0] for k, v in cur}

    def stat(self) -> dict[str, dict]:
        return {name.decode(): self._txn.stat(db) for name, db in self._dbs.items()}


def _seek_at_or_before(cur, key: bytes) -> bool:
    """Position ``cur`` on the greatest key <= ``key``; False if there is none.

    (Seeking to ``key + 1`` instead would overflow at the largest version, 2**64 - 1.)
    """
    if cur.set_range(key):
        return True if cur.key() == key else cur.prev()
    return cur.last()


class IndexWriter(IndexView):
    """A write transaction: the reads of IndexView plus puts. Runs inside ``Index.write``."""

    def put_meta(self, key: str, value) -> None:
        self._txn.put(key.encode(), _pack(value), db=self._dbs[b"meta"])

    def put_table(self, name: str, info: dict) -> None:
        self._txn.put(name.encode(), _pack(info), db=self._dbs[b"tables"])

    def put_version(self, version: int, info: dict) -> None:
        self._txn.put(VERSION_KEY.pack(version), _pack(info), db=self._dbs[b"versions"])

    def put_segment(self, segment: int, length: int) -> None:
        self._txn.put(VERSION_KEY.pack(segment), _pack({"length": length}), db=self._dbs[b"segments"])

    def put_row(self, table_id: int, block: int, version: int, loc: RowLoc) -> None:
        self._txn.put(ROW_KEY.pack(table_id, block, version), ROW_LOC.pack(*loc), db=self._dbs[b"rows"])

    def put_dense_name(self, name: str, dense_id: int) -> None:
        self._txn.put(name.encode(), struct.pack(">I", dense_id), db=self._dbs[b"dense_names"])

    def put_dense(self, dense_id: int, version: int, loc: DenseLoc) -> None:
        self._txn.put(DENSE_KEY.pack(dense_id, version), DENSE_LOC.pack(*loc), db=self._dbs[b"dense"])

    def delete_row(self, table_id: int, block: int, version: int) -> None:
        self._txn.delete(ROW_KEY.pack(table_id, block, version), db=self._dbs[b"rows"])

    def delete_dense(self, dense_id: int, version: int) -> None:
        self._txn.delete(DENSE_KEY.pack(dense_id, version), db=self._dbs[b"dense"])

    def delete_version(self, version: int) -> None:
        self._txn.delete(VERSION_KEY.pack(version), db=self._dbs[b"versions"])

    def delete_segment(self, segment: int) -> None:
        self._txn.delete(VERSION_KEY.pack(segment), db=self._dbs[b"segments"])

    def txn_id(self) -> int:
        """LMDB's id of this write transaction: readers that began before it commits have smaller ids."""
        return self._txn.id()


class Index:
    """The LMDB environment of a store. Thread-safe; one write transaction at a time."""

    def __init__(self, path: str, *, readonly: bool, create: bool = False):
        self.path = path
        self.readonly = readonly
        self._shared = _SharedEnv.acquire(path, readonly=readonly, create=create)
        self._env = self._shared.env
        self._dbs = self._shared.dbs
        self._resize = self._shared.resize  # set_mapsize needs no active txn in the whole process
        self._write_lock = self._shared.write_lock

    @contextlib.contextmanager
    def read(self) -> Iterator[IndexView]:
        """A read transaction, seeing the newest committed state as of its start."""
        txn = self._begin(write=False)
        try:
            yield IndexView(txn, self._dbs)
        except lmdb.Error as exc:
            raise CorruptionError(f"index read failed at {self.path}: {exc}", self.path, None) from exc
        finally:
            txn.abort()
            self._resize.release_shared()

    def write(self, body: Callable[[IndexWriter], T]) -> T:
        """Run ``body`` in one write transaction and commit it durably; returns body's result.

        If the map is full, the transaction is aborted, the map doubled and ``body`` run again, so
        ``body`` must only read and write through its argument. An exception from ``body`` aborts.
        """
        with self._write_lock:
            while True:
                txn = self._begin(write=True)
                try:
                    result = body(IndexWriter(txn, self._dbs))
                    txn.commit()
                    return result
                except lmdb.MapFullError:
                    failed, txn = txn, None
                    self._abort_alone(failed)
                    with self._resize.exclusive():
                        self._env.set_mapsize(self._env.info()["map_size"] * 2)
                except lmdb.Error as exc:
                    failed, txn = txn, None
                    self._abort_alone(failed)
                    raise CorruptionError(f"index write failed at {self.path}: {exc}", self.path, None) from exc
                except BaseException:
                    failed, txn = txn, None
                    self._abort_alone(failed)
                    raise
                finally:
                    if txn is not None:
                        self._resize.release_shared()

    def _abort_alone(self, txn: lmdb.Transaction) -> None:
        """Abort a write transaction (releasing its shared side) while no read of this process runs.

        py-lmdb 3 makes a write abort wait until no operation of any thread is in flight on the
        environment, which a steady stream of reader threads can postpone forever.
        """
        self._resize.release_shared()
        with self._resize.exclusive():
            txn.abort()

    def map_size(self) -> int:
        return self._env.info()["map_size"]

    def oldest_reader_txn(self) -> int | None:
        """The smallest transaction id any active reader (of any process) sees, or None if none reads.

        A reader with id t sees the state committed by transaction t; data a later transaction made
        unreachable may still be read by it.
        """
        oldest = None
        self._env.reader_check()  # free the slots of dead processes (a reader killed mid-read)
        for line in self._env.readers().splitlines()[1:]:
            fields = line.split()
            if len(fields) >= 3 and fields[-1].isdigit():
                txn = int(fields[-1])
                oldest = txn if oldest is None else min(oldest, txn)
        return oldest

    def _begin(self, write: bool) -> lmdb.Transaction:
        """Begin a transaction holding the shared side of the resize lock (the caller releases it)."""
        while True:
            self._resize.acquire_shared()
            try:
                return self._env.begin(write=write, buffers=False)
            except lmdb.MapResizedError:
                # another process grew the map: adopt its size with no transaction of ours active
                self._resize.release_shared()
                with self._resize.exclusive():
                    self._env.set_mapsize(0)
            except lmdb.Error as exc:
                self._resize.release_shared()
                raise CorruptionError(f"cannot begin an index transaction at {self.path}: {exc}", self.path, None) from exc
            except BaseException:
                self._resize.release_shared()
                raise

    def disk_bytes(self) -> int:
        return sum(os.path.getsize(os.path.join(self.path, n)) for n in os.listdir(self.path))

    def close(self) -> None:
        shared, self._shared = self._shared, None
        if shared is not None:
            shared.release()


class _SharedEnv:
    """One LMDB environment per index per process, shared by every Index open on it.

    LMDB (and py-lmdb, which refuses a second open) allows an environment to be open only once per
    process, so a readonly Store opened beside this process's writer shares the writer's environment.
    The environment is opened writable whenever the files allow it, so that a writer opened after a
    reader in this process can share it too; a readonly Index begins a write transaction only to open
    the database handles (py-lmdb invalidates handles opened in a read transaction).
    """

    _registry: dict = {}
    _registry_lock = threading.Lock()

    def __init__(self, key, env, dbs, writable: bool):
        self.key = key
        self.env = env
        self.dbs = dbs
        self.writable = writable
        self.resize = _SharedExclusiveLock()
        self.write_lock = threading.Lock()
        self.users = 0

    @classmethod
    def acquire(cls, path: str, *, readonly: bool, create: bool) -> "_SharedEnv":
        with cls._registry_lock:
            try:
                st = os.stat(path)
                key = (st.st_dev, st.st_ino)
            except OSError:
                key = None
            shared = cls._registry.get(key) if key is not None else None
            if shared is not None and not readonly and not shared.writable:
                raise _permission_error(path, readonly, None)
            if shared is None:
                writable = not readonly or _writable(path)
                try:
                    env = lmdb.open(
                        path,
                        subdir=True,
                        create=create,
                        readonly=not writable,
                        map_size=max(knobs.INDEX_MAP_BYTES, _MIN_MAP_BYTES),
                        max_dbs=len(_DBS),
                        max_readers=knobs.INDEX_MAX_READERS,
                        sync=True,
                        metasync=True,
                        readahead=False,
                        meminit=False,
                        lock=True,
                    )
                    try:
                        if writable:
                            with env.begin(write=True) as txn:
                                dbs = {name: env.open_db(name, txn=txn, create=not readonly) for name in _DBS}
                        else:
                            # py-lmdb: handles opened inside a read transaction die with it; without a
                            # transaction argument it opens them so that they stay valid
                            dbs = {name: env.open_db(name, create=False) for name in _DBS}
                    except BaseException:
                        env.close()
                        raise
                except lmdb.Error as exc:
                    if _is_permission_error(exc):
                        raise _permission_error(path, readonly, exc) from exc
                    raise CorruptionError(f"cannot open the index at {path}: {exc}", path, None) from exc
                st = os.stat(path)
                shared = cls(key=(st.st_dev, st.st_ino), env=env, dbs=dbs, writable=writable)
                cls._registry[shared.key] = shared
            shared.users += 1
            return shared

    def release(self) -> None:
        with self._registry_lock:
            self.users -= 1
            if self.users:
                return
            self._registry.pop(self.key, None)
        with self.resize.exclusive():
            self.env.close()


def _writable(path: str) -> bool:
    return all(os.access(os.path.join(path, name), os.R_OK | os.W_OK) for name in ("data.mdb", "lock.mdb"))


_DENIED = tuple(os.strerror(e) for e in (errno.EACCES, errno.EPERM, errno.EROFS))


def _is_permission_error(exc: lmdb.Error) -> bool:
    """py-lmdb raises ReadonlyError for EACCES and a plain Error naming strerror for EPERM/EROFS."""
    return isinstance(exc, lmdb.ReadonlyError) or any(text in str(exc) for text in _DENIED)


def _permission_error(path: str, readonly: bool, exc: lmdb.Error | None) -> PermissionDenied:
    """PermissionDenied naming the first index file (or the directory) this process may not use as needed.

    A writer needs to read and write data.mdb and lock.mdb; a reader needs to read data.mdb and to read
    and write lock.mdb (LMDB records its readers there).
    """
    root = os.path.dirname(path)
    what = f"cannot open store {root!r} " + ("readonly" if readonly else "for writing")
    needs = [(path, os.R_OK | os.X_OK, "read and search (r-x)"),
             (os.path.join(path, "data.mdb"), os.R_OK | (0 if readonly else os.W_OK),
              "read" if readonly else "read and write"),
             (os.path.join(path, "lock.mdb"), os.R_OK | os.W_OK, "read and write" + (
                 ": LMDB records its readers there, even for readonly opens" if readonly else ""))]
    code = errno.EROFS if exc is not None and os.strerror(errno.EROFS) in str(exc) else errno.EACCES
    for name, mode, what_needed in needs:
        if os.path.exists(name) and not os.access(name, mode):
            return fs.permission_denied(OSError(code, os.strerror(code)), what, name, needs=what_needed,
                                        writing=not readonly)
    return fs.permission_denied(OSError(code, os.strerror(code)), what, path, needs="read and write",
                                writing=not readonly)
