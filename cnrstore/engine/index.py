"""Layer 3 — the index: one LMDB environment with the catalogs and the row-block index.

Named databases (keys big-endian so LMDB's byte order is numeric order; on disk, never change):

    meta        ascii name → msgpack value          schema.py's MetaKeys: format, next_version, ...
    tables      table name (utf-8) → msgpack dict   schema.TableRecord: id, num_rows, dim, codec, ...
    versions    version u64 → msgpack dict          step, meta, created, parent, tables, dense, bytes
    segments    segment id u64 → msgpack dict       {"length": committed length}
    rows        table u32 · block u64 · version u64 → ROW_LOC (segment, offset, length, count, flags), or
                for a cumulative delta (format 3) ROW_LOC_DELTA: the same and its base version u64
    dense_names name (utf-8) → dense id u32
    dense       dense id u32 · version u64 → DENSE_LOC (segment, offset, length)
    log         record kind u8 · version u64 → DENSE_LOC of the COMMIT / ANCHOR record (format 2; a
                format-1 index opened readonly may lack it: it then reads as empty)

"Newest record of block b at or before version v" is one ``set_range`` to (t, b, v+1) and one ``prev``.
Only this module imports lmdb; every lmdb error is wrapped here. The map grows on demand: callers
never see MapFullError. What the values mean, and their checks, are in schema.py.
"""

from __future__ import annotations

import contextlib
import errno
import os
import struct
import threading
import time
from typing import Callable, Iterator, NamedTuple, TypeVar

import lmdb
import msgpack

from . import chain as chain_rule
from . import filenames, fs, record
from .. import knobs
from ..options import Options
from .msgpack_safe import unpack_bounded
from ..errors import CorruptionError, IndexBusy, IndexDamaged, PermissionDenied, StorageFull, StorageIOError
from .schema import MAX_ROW_COUNT, TableRecord, check_meta, check_segment, check_table, check_version, damaged

T = TypeVar("T")


class _Fixed(struct.Struct):
    """A fixed-size key or value of the index: one of another size is damage (CorruptionError), never a
    bare ``struct.error`` (docs/DESIGN.md "Security": every parser of store bytes fails typed)."""

    def unpack(self, buffer):
        try:
            return super().unpack(buffer)
        except struct.error:
            raise IndexDamaged(f"an index key or value of {len(buffer)} bytes where {self.size} are stored (format "
                               f"{self.format!r}): the index is damaged; run `cnrstore verify`, then "
                               "`cnrstore repair`", None, None) from None


ROW_KEY = _Fixed(">IQQ")
DENSE_KEY = _Fixed(">IQ")
VERSION_KEY = _Fixed(">Q")
LOG_KEY = _Fixed(">BQ")
ROW_LOC = _Fixed("<IIIIB")  # segment, offset, length, count, flags
ROW_LOC_DELTA = _Fixed("<IIIIBQ")  # ... and the base version of a cumulative delta
DENSE_LOC = _Fixed("<III")  # segment, offset, length
_DENSE_ID = _Fixed(">I")
#: Below this an empty store's catalogs do not fit the map (LMDB needs a few pages per database).
_MIN_MAP_BYTES = 64 << 10
_DBS = (b"meta", b"tables", b"versions", b"segments", b"rows", b"dense_names", b"dense", b"log")
_OPTIONAL_DBS = (b"log",)  # added by format 2: absent from a format-1 index until a writable open
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
#: An EIO from a commit counts as a full disk when the file system has less than this free.
_FULL_MARGIN_BYTES = 1 << 20
#: How long a reader waits, in all, for a free LMDB reader slot before raising IndexBusy.
_READER_WAIT_S = 30.0


class RowLoc(NamedTuple):
    """Where a row-block record lies, with its row count and record flags; ``base`` is the base version of
    a cumulative delta (record.FLAG_DELTA), else 0."""

    segment: int
    offset: int
    length: int
    count: int
    flags: int
    base: int = 0


#: Flags a ROWS record may carry (record.FLAG_*); u16 row offsets bound a record's rows.
_ROW_FLAGS = record.FLAG_BASELINE | record.FLAG_FULL | record.FLAG_COMPACTED | record.FLAG_DELTA | record.FLAG_KEYS


def _row_loc(raw: bytes, version: int | None = None) -> RowLoc:
    """The row-index value ``raw`` of the entry at ``version``, checked field by field (docs/FORMAT.md,
    "Index (LMDB)"): a row count of at most 2**16 (u16 offsets), only known flags, and a delta's base
    version below its own (a base at or above it would make a read chain loop)."""
    if len(raw) == ROW_LOC.size:
        loc = RowLoc(*ROW_LOC.unpack(raw))
    else:
        loc = RowLoc(*ROW_LOC_DELTA.unpack(raw))
    most = MAX_ROW_COUNT if not loc.flags & record.FLAG_KEYS else (1 << 32) - 1  # a key run: u32 entries
    if loc.count > most or loc.flags & ~_ROW_FLAGS or (loc.base and version is not None and loc.base >= version):
        field = ("count" if loc.count > most else "flags" if loc.flags & ~_ROW_FLAGS else "base")
        raise damaged("rows", f"entry at version {version}", field, getattr(loc, field),
                       {"count": f"at most {most}", "flags": f"only bits of {_ROW_FLAGS:#x}",
                        "base": "a version below the entry's"}[field])
    return loc


def _row_loc_bytes(loc: RowLoc) -> bytes:
    return ROW_LOC_DELTA.pack(*loc) if loc.base else ROW_LOC.pack(*loc[:5])


class DenseLoc(NamedTuple):
    segment: int
    offset: int
    length: int


def _dense_loc(raw: bytes) -> DenseLoc:
    return DenseLoc._make(DENSE_LOC.unpack(raw))


def _pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def _unpack(data) -> object:
    return unpack_bounded(data, what="index value")


def _key_name(db: str, raw: bytes) -> str:
    try:
        return raw.decode()
    except UnicodeDecodeError:
        raise damaged(db, raw, None, "the key", "UTF-8") from None


def _version_item(key: bytes, value: bytes) -> tuple[int, dict]:
    version = VERSION_KEY.unpack(key)[0]
    return version, check_version(version, _unpack(value))


class SharedExclusiveLock:
    """Many holders of the shared side, or one of the exclusive side; a thread waiting for the exclusive
    side keeps new shared holders out (a stream of them would starve it). Not re-entrant.

    Here: transactions (shared) and map resizes (exclusive): LMDB's set_mapsize requires that no transaction
    of this process is active. Also a serving replica's batches and updates (``cnrstore.serving``).
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

    def txn_id(self) -> int:
        """LMDB's id of this transaction: a read's is that of the commit it sees; readers that began before
        a write transaction commits have smaller ids than it."""
        return self._txn.id()

    # catalogs -------------------------------------------------------------------------------------
    def meta(self, key: str, default=None):
        raw = self._txn.get(key.encode(), db=self._dbs[b"meta"])
        return default if raw is None else check_meta(key, _unpack(raw))

    def table(self, name: str) -> TableRecord | None:
        raw = self._txn.get(name.encode(), db=self._dbs[b"tables"])
        return None if raw is None else check_table(name, _unpack(raw))

    def tables(self) -> dict[str, TableRecord]:
        with self._txn.cursor(db=self._dbs[b"tables"]) as cur:
            out, ids = {}, {}
            for k, v in cur:
                name = _key_name("tables", k)
                info = out[name] = check_table(name, _unpack(v))
                other = ids.setdefault(info.id, name)
                if other != name:
                    raise damaged("tables", name, "id", info.id, f"an id no other table has ({other!r} has it)")
            return out

    def version(self, version: int) -> dict | None:
        if not 0 <= version < 2**64:
            return None  # no such key can exist
        raw = self._txn.get(VERSION_KEY.pack(version), db=self._dbs[b"versions"])
        return None if raw is None else check_version(version, _unpack(raw))

    def versions(self) -> list[tuple[int, dict]]:
        with self._txn.cursor(db=self._dbs[b"versions"]) as cur:
            return [_version_item(k, v) for k, v in cur]

    def version_numbers(self) -> list[int]:
        """Every version number, ascending, without unpacking the records."""
        with self._txn.cursor(db=self._dbs[b"versions"]) as cur:
            return [VERSION_KEY.unpack(k)[0] for k in cur.iternext(keys=True, values=False)]

    def versions_after(self, version: int) -> list[tuple[int, dict]]:
        """The versions newer than ``version``, oldest first: one seek, then only those records."""
        with self._txn.cursor(db=self._dbs[b"versions"]) as cur:
            if not cur.set_range(VERSION_KEY.pack(version + 1)):
                return []
            return [_version_item(k, v) for k, v in cur]

    def version_count(self) -> int:
        """How many versions the index holds (LMDB keeps the count: no scan)."""
        return self._txn.stat(self._dbs[b"versions"])["entries"]

    def latest(self) -> tuple[int, dict] | None:
        with self._txn.cursor(db=self._dbs[b"versions"]) as cur:
            if not cur.last():
                return None
            return _version_item(cur.key(), cur.value())

    def segments(self) -> dict[int, int]:
        with self._txn.cursor(db=self._dbs[b"segments"]) as cur:
            out = {}
            for k, v in cur:
                segment = VERSION_KEY.unpack(k)[0]
                out[segment] = check_segment(segment, _unpack(v))
            return out

    def segment_length(self, segment: int) -> int | None:
        """The committed length of ``segment`` in the catalog, or None if the catalog does not hold it."""
        raw = self._txn.get(VERSION_KEY.pack(segment), db=self._dbs[b"segments"])
        return None if raw is None else check_segment(segment, _unpack(raw))

    def row_at(self, table_id: int, block: int, version: int) -> RowLoc | None:
        """The index entry of (table, block, version) exactly, or None."""
        raw = self._txn.get(ROW_KEY.pack(table_id, block, version), db=self._dbs[b"rows"])
        return None if raw is None else _row_loc(raw, version)

    def dense_loc(self, dense_id: int, version: int) -> DenseLoc | None:
        """The index entry of dense array ``dense_id`` at ``version`` exactly, or None."""
        raw = self._txn.get(DENSE_KEY.pack(dense_id, version), db=self._dbs[b"dense"])
        return None if raw is None else _dense_loc(raw)

    def log_loc(self, kind: int, version: int) -> DenseLoc | None:
        """The location of the log record (kind, version) the index keeps, or None."""
        db = self._dbs.get(b"log")
        raw = None if db is None else self._txn.get(LOG_KEY.pack(kind, version), db=db)
        return None if raw is None else _dense_loc(raw)

    def dense_id(self, name: str) -> int | None:
        raw = self._txn.get(name.encode(), db=self._dbs[b"dense_names"])
        return None if raw is None else _DENSE_ID.unpack(raw)[0]

    # row index ------------------------------------------------------------------------------------
    def row_chain(self, table_id: int, block: int, version: int) -> Iterator[tuple[int, RowLoc]]:
        """The block's read chain at ``version`` (engine/chain.py states the rule): (version, location) of
        the records a read walks, newest first, the baseline that ends it included. A delta whose base
        has no entry raises CorruptionError."""
        cur = self._txn.cursor(db=self._dbs[b"rows"])  # one per walk: walks may interleave
        ok = _seek_at_or_before(cur, ROW_KEY.pack(table_id, block, version))
        while ok:
            t, b, v = ROW_KEY.unpack(cur.key())
            if t != table_id or b != block:
                return
            loc = _row_loc(cur.value(), v)
            yield v, loc
            nxt = chain_rule.step(loc.flags, loc.base)
            if nxt == chain_rule.END:
                return
            if nxt == chain_rule.PREVIOUS:
                ok = cur.prev()
                continue
            ok = cur.set_key(ROW_KEY.pack(table_id, block, nxt))
            if not ok:
                raise CorruptionError(f"the index entry of table {table_id} block {block} version {v} is a "
                                      f"delta on version {nxt}, which has no entry: the index is "
                                      "damaged; run `cnrstore verify`, then `cnrstore repair`", None, None)

    def row_entries(self, table_id: int | None = None) -> Iterator[tuple[int, int, int, RowLoc]]:
        """Every (table, block, version, location) of the row index, in key order."""
        with self._txn.cursor(db=self._dbs[b"rows"]) as cur:
            ok = cur.set_range(ROW_KEY.pack(table_id, 0, 0)) if table_id is not None else cur.first()
            while ok:
                t, b, v = ROW_KEY.unpack(cur.key())
                if table_id is not None and t != table_id:
                    return
                yield t, b, v, _row_loc(cur.value(), v)
                ok = cur.next()

    def block_entries(self, table_id: int, block: int) -> list[tuple[int, RowLoc]]:
        """(version, location) of every index entry of one block, oldest first."""
        out = []
        with self._txn.cursor(db=self._dbs[b"rows"]) as cur:
            ok = cur.set_range(ROW_KEY.pack(table_id, block, 0))
            while ok:
                t, b, v = ROW_KEY.unpack(cur.key())
                if t != table_id or b != block:
                    break
                out.append((v, _row_loc(cur.value(), v)))
                ok = cur.next()
        return out

    def row_blocks(self, table_id: int, first: int = 0) -> Iterator[tuple[int, int]]:
        """(block, version of its oldest record) of every block from ``first`` on of the table with an index
        entry, in block order: one seek per such block, however many versions it holds and however many
        blocks of the table were never written."""
        with self._txn.cursor(db=self._dbs[b"rows"]) as cur:
            block = first
            while block < 2**64 and cur.set_range(ROW_KEY.pack(table_id, block, 0)):
                t, b, v = ROW_KEY.unpack(cur.key())
                if t != table_id:
                    return
                yield b, v
                block = b + 1

    def blocks_written_in(self, table_id: int, after: int, upto: int) -> Iterator[int]:
        """Every block of the table with an index entry at a version in ``(after, upto]``, in block order,
        from the keys alone (no value is read): one or two seeks per block that has any entry, whatever
        its number of entries. What ``engine/changes.py`` starts from: a block no such entry names holds
        no row whose value at ``upto`` came from a version newer than ``after``."""
        if upto <= after:
            return
        with self._txn.cursor(db=self._dbs[b"rows"]) as cur:
            block = 0
            while block < 2**64 and cur.set_range(ROW_KEY.pack(table_id, block, after + 1)):
                t, b, v = ROW_KEY.unpack(cur.key())
                if t != table_id:
                    return
                if b != block:  # the next block with entries: seek to its first entry past ``after``
                    block = b
                    continue
                if v <= upto:
                    yield b
                block = b + 1

    def dense_at(self, dense_id: int, version: int) -> tuple[int, DenseLoc] | None:
        """(version, location) of the newest record of a dense array at or before ``version``."""
        with self._txn.cursor(db=self._dbs[b"dense"]) as cur:
            ok = _seek_at_or_before(cur, DENSE_KEY.pack(dense_id, version))
            if not ok:
                return None
            d, v = DENSE_KEY.unpack(cur.key())
            if d != dense_id:
                return None
            return v, _dense_loc(cur.value())

    def dense_entries(self) -> Iterator[tuple[int, int, DenseLoc]]:
        with self._txn.cursor(db=self._dbs[b"dense"]) as cur:
            for k, val in cur:
                d, v = DENSE_KEY.unpack(k)
                yield d, v, _dense_loc(val)

    def dense_names(self) -> dict[str, int]:
        with self._txn.cursor(db=self._dbs[b"dense_names"]) as cur:
            return {_key_name("dense_names", k): _DENSE_ID.unpack(v)[0] for k, v in cur}

    def log_entries(self, kind: int | None = None) -> Iterator[tuple[int, int, DenseLoc]]:
        """Every (kind, version, location) of the COMMIT / ANCHOR records the index keeps, in key order."""
        db = self._dbs.get(b"log")
        if db is None:
            return
        with self._txn.cursor(db=db) as cur:
            ok = cur.set_range(LOG_KEY.pack(kind, 0)) if kind is not None else cur.first()
            while ok:
                k, v = LOG_KEY.unpack(cur.key())
                if kind is not None and k != kind:
                    return
                yield k, v, _dense_loc(cur.value())
                ok = cur.next()

    def stat(self) -> dict[str, dict]:
        return {name.decode(): self._txn.stat(db) for name, db in self._dbs.items() if db is not None}


def _lmdb_errno(exc: BaseException) -> int | None:
    """The errno behind an lmdb error (py-lmdb keeps LMDB's return code in ``.code``), if any."""
    code = getattr(exc, "code", None)
    if isinstance(code, int) and code > 0:
        return code
    if isinstance(exc, lmdb.DiskError):
        return errno.ENOSPC
    for candidate in (*_NO_SPACE, errno.EIO):
        if str(exc).endswith(os.strerror(candidate)):
            return candidate
    return None


def _free_bytes(path: str) -> int | None:
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


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

    def put_table(self, table: TableRecord) -> None:
        self._txn.put(table.name.encode(), _pack(table.as_dict()), db=self._dbs[b"tables"])

    def put_version(self, version: int, info: dict) -> None:
        self._txn.put(VERSION_KEY.pack(version), _pack(info), db=self._dbs[b"versions"])

    def put_segment(self, segment: int, length: int) -> None:
        self._txn.put(VERSION_KEY.pack(segment), _pack({"length": length}), db=self._dbs[b"segments"])

    def put_row(self, table_id: int, block: int, version: int, loc: RowLoc) -> None:
        self._txn.put(ROW_KEY.pack(table_id, block, version), _row_loc_bytes(loc), db=self._dbs[b"rows"])

    def put_dense_name(self, name: str, dense_id: int) -> None:
        self._txn.put(name.encode(), struct.pack(">I", dense_id), db=self._dbs[b"dense_names"])

    def put_dense(self, dense_id: int, version: int, loc: DenseLoc) -> None:
        self._txn.put(DENSE_KEY.pack(dense_id, version), DENSE_LOC.pack(*loc), db=self._dbs[b"dense"])

    def put_log(self, kind: int, version: int, loc: DenseLoc) -> None:
        self._txn.put(LOG_KEY.pack(kind, version), DENSE_LOC.pack(*loc), db=self._dbs[b"log"])

    def delete_log(self, kind: int, version: int) -> None:
        self._txn.delete(LOG_KEY.pack(kind, version), db=self._dbs[b"log"])

    def delete_row(self, table_id: int, block: int, version: int) -> None:
        self._txn.delete(ROW_KEY.pack(table_id, block, version), db=self._dbs[b"rows"])

    def delete_dense(self, dense_id: int, version: int) -> None:
        self._txn.delete(DENSE_KEY.pack(dense_id, version), db=self._dbs[b"dense"])

    def delete_version(self, version: int) -> None:
        self._txn.delete(VERSION_KEY.pack(version), db=self._dbs[b"versions"])

    def delete_segment(self, segment: int) -> None:
        self._txn.delete(VERSION_KEY.pack(segment), db=self._dbs[b"segments"])



class Index:
    """The LMDB environment of a store. Thread-safe; one write transaction at a time."""

    def __init__(self, path: str, *, readonly: bool, create: bool = False, map_bytes: int | None = None):
        """``map_bytes``: the map size to open the environment with, if no Index of this process has it
        open already (it doubles on demand); None: ``Options().index_map_bytes``."""
        self.path = path
        self.readonly = readonly
        if map_bytes is None:
            map_bytes = Options().index_map_bytes
        self._shared = _SharedEnv.acquire(path, readonly=readonly, create=create, map_bytes=map_bytes)
        self._env = self._shared.env
        self._dbs = self._shared.dbs
        self._resize = self._shared.resize  # set_mapsize needs no active txn in the whole process
        self._write_lock = self._shared.write_lock

    @contextlib.contextmanager
    def read(self) -> Iterator[IndexView]:
        """A read transaction, seeing the newest committed state as of its start.

        Safe from any number of threads: the outermost read of a thread takes one of a bounded number
        of permits shared by every Index of this environment (below LMDB's reader slots), so many
        threads queue instead of exhausting the slots; a read nested in another of the same thread
        takes none. Slots held by other processes are waited for too (``_begin``).
        """
        gate = self._shared.read_gate
        outer = not getattr(gate.nested, "depth", 0)
        if outer and not gate.slots.acquire(timeout=_READER_WAIT_S):
            raise IndexBusy(f"no index reader slot of {self.path} came free in {_READER_WAIT_S:.0f} s: "
                            f"{gate.size} reads of this process are in flight; read from fewer threads at once")
        gate.nested.depth = getattr(gate.nested, "depth", 0) + 1
        try:
            txn = self._begin(write=False)
            try:
                yield IndexView(txn, self._dbs)
            except lmdb.Error as exc:
                raise self._error(exc, "index read") from exc
            finally:
                txn.abort()
                self._resize.release_shared()
        finally:
            gate.nested.depth -= 1
            if outer:
                gate.slots.release()

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
                    break
                except lmdb.MapFullError:
                    failed, txn = txn, None
                    self._abort_alone(failed)
                    with self._resize.exclusive():
                        self._env.set_mapsize(self._env.info()["map_size"] * 2)
                except lmdb.Error as exc:
                    failed, txn = txn, None
                    self._abort_alone(failed)
                    raise self._error(exc, "index commit") from exc
                except BaseException:
                    failed, txn = txn, None
                    self._abort_alone(failed)
                    raise
                finally:
                    if txn is not None:
                        self._resize.release_shared()
            fs.pause_point("index_committed", self.path)  # durable now (the crash-state explorer snapshots it here)
            return result

    def _abort_alone(self, txn: lmdb.Transaction) -> None:
        """Abort a write transaction (releasing its shared side) while no read of this process runs.

        py-lmdb 3 makes a write abort wait until no operation of any thread is in flight on the
        environment, which a steady stream of reader threads can postpone forever.
        """
        self._resize.release_shared()
        with self._resize.exclusive():
            txn.abort()

    def _error(self, exc: lmdb.Error, what: str) -> Exception:
        """The typed error for an lmdb error: a full disk is StorageFull and an I/O error StorageIOError
        (both leave the committed state as it was: LMDB writes its meta page only after the data pages
        are written and synced); anything else is CorruptionError.

        LMDB reports a failed page write or fsync as EIO when the file system gives no better errno; an
        EIO while the file system is (nearly) full is taken for what it almost surely is, a full disk.
        """
        code = _lmdb_errno(exc)
        if code == errno.EIO:
            free = _free_bytes(self.path)
            if free is not None and free < _FULL_MARGIN_BYTES:
                code = errno.ENOSPC
        if code in _NO_SPACE:
            err = StorageFull(f"{what} failed at {self.path}: {os.strerror(code)} ({exc}); nothing was changed: "
                              "free disk space and retry")
            err.errno = code
            return err
        if code == errno.EIO:
            err = StorageIOError(f"{what} failed at {self.path}: input/output error ({exc}); nothing was changed "
                                 "and committed versions are intact: check the device (dmesg), then run "
                                 "`cnrstore verify` before writing again")
            err.errno = code
            return err
        if isinstance(exc, lmdb.PanicError):
            return CorruptionError(f"{what} failed at {self.path}: {exc}; the index environment is unusable "
                                   "after an earlier failed write: close and reopen the store", self.path, None)
        return CorruptionError(f"{what} failed at {self.path}: {exc}", self.path, None)

    def map_size(self) -> int:
        return self._env.info()["map_size"]

    def space(self) -> dict[str, int]:
        """Where the index's bytes go: ``used_bytes`` (the B-tree pages in use, every sub-database and
        the two meta pages: the index's real size), ``high_water_bytes`` (LMDB's last page used) and
        ``file_bytes`` (data.mdb, with its free pages)."""
        psize = self._env.stat()["psize"]
        pages = lambda s: s["branch_pages"] + s["leaf_pages"] + s["overflow_pages"]  # noqa: E731
        with self.read() as view:
            used = pages(self._env.stat()) + sum(pages(s) for s in view.stat().values())
        return {"used_bytes": (used + 2) * psize, "high_water_bytes": (self._env.info()["last_pgno"] + 1) * psize,
                "file_bytes": os.path.getsize(os.path.join(self.path, "data.mdb"))}

    def copy_to(self, dest_dir: str, view: IndexView) -> None:
        """Write a compact copy of the index, as ``view`` (a read of this index) sees it, to
        ``dest_dir``/data.mdb: an existing directory with no data.mdb. The copy is an index of its own
        (a remote copy point uploads it; engine/remote.py)."""
        try:
            self._env.copy(dest_dir, compact=True, txn=view._txn)
        except lmdb.Error as exc:
            raise self._error(exc, f"copying the index to {dest_dir}") from exc

    def oldest_reader_txn(self) -> int | None:
        """The smallest transaction id any active reader (of any process) sees, or None if none reads.

        A reader with id t sees the state committed by transaction t; data a later transaction made
        unreachable may still be read by it.
        """
        oldest = None
        try:
            self._env.reader_check()  # free the slots of dead processes (a reader killed mid-read)
            table = self._env.readers()
        except lmdb.Error as exc:
            raise self._error(exc, "reading the index's reader table") from exc
        for line in table.splitlines()[1:]:
            fields = line.split()
            if len(fields) >= 3 and fields[-1].isdigit():
                txn = int(fields[-1])
                oldest = txn if oldest is None else min(oldest, txn)
        return oldest

    def _begin(self, write: bool) -> lmdb.Transaction:
        """Begin a transaction holding the shared side of the resize lock (the caller releases it).

        If every reader slot is taken (readers of other processes count too), waits with a bounded
        backoff for one to come free; IndexBusy if none does within ``_READER_WAIT_S``.
        """
        delay, deadline = 0.001, None
        while True:
            self._resize.acquire_shared()
            try:
                return self._env.begin(write=write, buffers=False)
            except lmdb.MapResizedError:
                # another process grew the map: adopt its size with no transaction of ours active
                self._resize.release_shared()
                with self._resize.exclusive():
                    self._env.set_mapsize(0)
            except lmdb.ReadersFullError as exc:
                self._resize.release_shared()
                now = time.monotonic()
                deadline = now + _READER_WAIT_S if deadline is None else deadline
                if now >= deadline:
                    raise IndexBusy(f"every reader slot of the index at {self.path} stayed taken for "
                                    f"{_READER_WAIT_S:.0f} s ({exc}); read from fewer threads or processes at "
                                    "once, or close idle readonly stores") from exc
                time.sleep(delay)
                delay = min(delay * 2, 0.05)
            except lmdb.Error as exc:
                self._resize.release_shared()
                raise self._error(exc, "beginning an index transaction") from exc
            except BaseException:
                self._resize.release_shared()
                raise

    def disk_bytes(self) -> int:
        return sum(os.path.getsize(os.path.join(self.path, n)) for n in os.listdir(self.path))

    def close(self) -> None:
        shared, self._shared = self._shared, None
        if shared is not None:
            shared.release()


#: LMDB's meta page (pages 0 and 1 of data.mdb): a 16-byte page header, then MDB_meta: magic u32,
#: version u32, address u64, mapsize u64, two MDB_db of 48 bytes (the first one's leading u32 is the
#: page size), last_pgno u64, txnid u64.
LMDB_MAGIC = 0xBEEFC0DE
_META_MAGIC = struct.Struct("<I")
_META_TAIL = struct.Struct("<QQ")  # last_pgno, txnid at byte 136 of the page
_META_PSIZE_AT, _META_TAIL_AT = 40, 136


def damage_hint(index_path: str) -> str:
    root = os.path.dirname(os.path.abspath(index_path))
    if not os.path.exists(index_path) and os.path.exists(filenames.index_repair_ready(root)):
        return (f"an interrupted `cnrstore repair` left the index it built in {filenames.index_repair_tmp(root)}: "
                f"open the store for writing, or run `cnrstore repair {root}`, to install it")
    return (f"nothing was deleted: the segment log still holds the data. Run `cnrstore repair {root}` "
            "to rebuild the index from it")


def install_built_index(root: str, filesystem: fs.FileSystem) -> None:
    """Rename the index repair built (index.repair-tmp/, marked READY) into place as index/, make that
    durable, then drop the mark (a crash before that leaves index/READY behind, which nothing reads).
    The caller holds the store's lock and has moved any old index/ aside."""
    filesystem.rename(filenames.index_repair_tmp(root), filenames.index_dir(root))
    filesystem.fsync_dir(root)
    ready = os.path.join(filenames.index_dir(root), os.path.basename(filenames.index_repair_ready(root)))
    if os.path.exists(ready):
        filesystem.remove(ready)


def finish_interrupted_install(root: str, filesystem: fs.FileSystem) -> bool:
    """Finish a repair killed between moving the old index aside and renaming the new one in: it left
    no index/ but a whole, durable index.repair-tmp/ marked READY. Install that (roll forward) and
    return True; return False, touching nothing, in every other state. The caller holds the lock."""
    if os.path.exists(filenames.index_dir(root)) or not os.path.exists(filenames.index_repair_ready(root)):
        return False
    install_built_index(root, filesystem)
    return True


def check_files(path: str) -> None:
    """Raise IndexDamaged if the index directory ``path``, or its ``data.mdb`` or ``lock.mdb``, is there but
    is not what LMDB may open: a symbolic link (LMDB would follow it out of the store: a ``data.mdb`` linked
    to ``/dev/zero`` makes it read without end), a FIFO (an open that blocks for ever), a socket, a device,
    or a directory (a file, for ``path``). Missing ones pass: LMDB makes ``lock.mdb`` (and ``data.mdb`` at
    creation); a readonly open reports a missing ``data.mdb`` (``check_data_file``)."""
    hint = damage_hint(path)
    fs.check_kind(path, "the index directory", hint, directory=True, error=IndexDamaged)
    for name, what in (("data.mdb", "the index's data file"), ("lock.mdb", "the index's lock file")):
        fs.check_kind(os.path.join(path, name), what, hint, error=IndexDamaged)


def check_data_file(path: str) -> None:
    """Raise IndexDamaged unless the LMDB environment in directory ``path`` is whole enough to map.

    LMDB maps data.mdb and trusts it: a file shorter than its meta page says kills the process with
    SIGBUS on first touch. So before LMDB opens it: data.mdb exists, and its newest valid meta page (the
    larger txnid of pages 0 and 1) has ``(last_pgno + 1) * page_size <= file size``.
    """
    data = filenames.index_data_path(path)

    def damaged(why: str):
        return IndexDamaged(f"the index of the store is damaged: {why}; {damage_hint(path)}", data, None)

    check_files(path)
    if not os.path.isdir(path):
        raise damaged(f"the index directory {path} is missing")
    try:
        with open(fs.open_regular(data, "the index's data file", damage_hint(path), error=IndexDamaged), "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(65536 * 2)
    except FileNotFoundError:
        raise damaged(f"{data} is missing") from None
    except OSError as exc:
        raise damaged(f"{data} cannot be read ({exc})") from exc
    if size == 0:
        raise damaged(f"{data} is empty")
    metas = []
    psize0 = None
    if len(head) >= _META_TAIL_AT + 16 and _META_MAGIC.unpack_from(head, 16)[0] == LMDB_MAGIC:
        psize0 = _META_MAGIC.unpack_from(head, _META_PSIZE_AT)[0]
        metas.append((_META_TAIL.unpack_from(head, _META_TAIL_AT)[1], _META_TAIL.unpack_from(head, _META_TAIL_AT)[0],
                       psize0))
    for psize in ([psize0] if psize0 else [os.sysconf("SC_PAGE_SIZE"), 4096, 8192, 16384, 65536]):
        if not psize or psize & (psize - 1) or psize < 512 or psize > 65536:
            continue
        at = psize
        if len(head) >= at + _META_TAIL_AT + 16 and _META_MAGIC.unpack_from(head, at + 16)[0] == LMDB_MAGIC \
                and _META_MAGIC.unpack_from(head, at + _META_PSIZE_AT)[0] == psize:
            last, txn = _META_TAIL.unpack_from(head, at + _META_TAIL_AT)
            metas.append((txn, last, psize))
            break
    if not metas:
        raise damaged(f"{data} has no valid LMDB meta page ({size} bytes)")
    _txn, last_pgno, psize = max(metas)
    if psize & (psize - 1) or not 512 <= psize <= 65536:
        raise damaged(f"{data} records an impossible page size {psize}")
    need = (last_pgno + 1) * psize
    if size < need:
        raise damaged(f"{data} is truncated: {size} bytes, but its meta page says {need}")


class _ReadGate:
    """Permits for the read transactions of one environment in this process: fewer than LMDB's reader
    slots, leaving room for nested reads, py-lmdb's spare transaction and readers of other processes."""

    def __init__(self, max_readers: int):
        self.size = max(1, max_readers - max(2, max_readers // 8))
        self.slots = threading.BoundedSemaphore(self.size)
        self.nested = threading.local()


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
        self.resize = SharedExclusiveLock()
        self.write_lock = threading.Lock()
        self.read_gate = _ReadGate(env.max_readers())  # the lock file's slot count, whoever made it
        self.users = 0

    @classmethod
    def acquire(cls, path: str, *, readonly: bool, create: bool, map_bytes: int) -> "_SharedEnv":
        with cls._registry_lock:
            try:
                st = os.stat(path)
                key = (st.st_dev, st.st_ino)
            except OSError:
                key = None
            shared = cls._registry.get(key) if key is not None else None
            if shared is not None and not readonly and not shared.writable:
                raise _permission_error(path, readonly, None)
            if shared is not None and not readonly and any(shared.dbs[n] is None for n in _OPTIONAL_DBS):
                # a format-1 index a readonly Store of this process opened first: add what a writer needs
                try:
                    with shared.resize.exclusive(), shared.env.begin(write=True) as txn:
                        for name in _OPTIONAL_DBS:
                            if shared.dbs[name] is None:
                                shared.dbs[name] = shared.env.open_db(name, txn=txn, create=True)
                except lmdb.Error as exc:
                    raise CorruptionError(f"cannot open the index at {path}: {exc}", path, None) from exc
            if shared is None:
                if not create:
                    check_data_file(path)
                else:
                    check_files(path)
                writable = not readonly or _writable(path)
                try:
                    env = lmdb.open(
                        path,
                        subdir=True,
                        create=create,
                        readonly=not writable,
                        map_size=max(map_bytes, _MIN_MAP_BYTES),
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
                                dbs = {}
                                for name in _DBS:
                                    try:
                                        dbs[name] = env.open_db(name, txn=txn, create=not readonly)
                                    except lmdb.NotFoundError:
                                        if name not in _OPTIONAL_DBS:
                                            raise
                                        dbs[name] = None
                        else:
                            # py-lmdb: handles opened inside a read transaction die with it; without a
                            # transaction argument it opens them so that they stay valid
                            dbs = {}
                            for name in _DBS:
                                try:
                                    dbs[name] = env.open_db(name, create=False)
                                except lmdb.NotFoundError:
                                    if name not in _OPTIONAL_DBS:
                                        raise
                                    dbs[name] = None
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
