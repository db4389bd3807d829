"""Serving follows training: a ``Follower`` keeps an inference replica's tables at a store's newest version
(issue 40; docs/DESIGN.md, "Serving: following a store"; API.md, "Serving: following a store").

    from cnrstore.serving import Follower
    f = Follower("ckpt", model)          # a full sync of the newest version into the model's tensors
    f.start(interval_s=0.2)              # a thread applies each new version: only the rows that changed
    with f.serving() as v:               # a request's version pin: no update is applied while it is held
        out = model(batch)
    f.close()

An update is computed outside any lock, in one read transaction of the store (the reader pin: GC deletes
no segment that transaction may read, and the two versions it reads stay whole even if retention drops
them meanwhile), and then scattered into the target under the exclusive side of a reader/writer lock whose
shared side is ``serving()``: a batch run under ``serving()`` sees one version, never a mix of two.

The target holds the decoded float32 values (what ``Store.read_rows`` gives), whatever the table's codec.
A keyed table's serving copy is a ``KeyedReplica`` (cnrstore/keyed_replica.py): each update admits, changes
and evicts keys (``TableChanges.deleted``) in the same exclusive step, so an evicted key is never found
again once the update that evicted it is applied; a full sync replaces its keys wholesale. A target model's
``KeyedEmbedding`` follows its keyed table slot by slot (cnrstore/torch/keyed_serving.py), with the same rule.
Importing this module does not import torch; an ``nn.Module`` target does.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from typing import Any, Callable, NamedTuple

import numpy as np

from . import codecs
from .engine import arguments
from .engine import blocks as blocks_math
from .engine import changes as changes_rule
from .engine import fs
from .engine import keyed_reader
from .engine import reader
from .engine.index import SharedExclusiveLock
from .errors import CnrError, InvalidArgument, StoreClosed, VersionNotFound, VersionNotRetained
from .keyed_replica import KeyedReplica

__all__ = ["Follower", "FollowerLag", "KeyedReplica"]

log = logging.getLogger("cnrstore.serving")

#: The prefix of the dense arrays a ``cnrstore.torch.Checkpointer`` writes for a model's state-dict entries.
DENSE_PREFIX = "torch.model/"


class FollowerLag(NamedTuple):
    """How far a follower is behind its store: ``versions`` committed after the version it holds, and
    ``seconds`` since the commit of the oldest of them (0 when current)."""

    versions: int
    seconds: float


class _ServingLock:
    """``serving()``'s reader/writer lock (``SharedExclusiveLock``: a waiting update keeps new batches out,
    else a steady stream of requests would starve it), with the shared side re-entrant per thread: a thread
    already serving may nest ``serving()``."""

    def __init__(self):
        self._lock = SharedExclusiveLock()
        self._local = threading.local()
        self.exclusive = self._lock.exclusive

    def held_by_me(self) -> bool:
        return getattr(self._local, "depth", 0) > 0

    def acquire_shared(self) -> None:
        depth = getattr(self._local, "depth", 0)
        if depth == 0:
            self._lock.acquire_shared()
        self._local.depth = depth + 1

    def release_shared(self) -> None:
        self._local.depth -= 1
        if self._local.depth == 0:
            self._lock.release_shared()

    @contextlib.contextmanager
    def shared(self):
        self.acquire_shared()
        try:
            yield
        finally:
            self.release_shared()


class _Slot:
    """Where one store table or dense array lands in the target: ``scatter(rows, values)`` writes rows
    (int64, sorted) of a table; ``assign(array)`` a whole dense array. Vectorized: one call per table."""

    def __init__(self, name: str, obj, torch_mod=None, dense: bool = False):
        self.name = name
        self.obj = obj
        self.torch = torch_mod
        self.dense = dense

    def shape(self) -> tuple:
        return tuple(self.obj.shape)

    def scatter(self, rows: np.ndarray, values: np.ndarray) -> None:
        if not rows.size:
            return
        if self.torch is None:
            self.obj[rows] = values
            return
        torch = self.torch
        w = self.obj
        src = torch.from_numpy(np.ascontiguousarray(values))
        if src.dtype != w.dtype or src.device != w.device:
            src = src.to(device=w.device, dtype=w.dtype)
        idx = torch.from_numpy(rows).to(w.device)
        with torch.no_grad():
            w.index_copy_(0, idx, src)

    def assign(self, array: np.ndarray) -> None:
        if self.torch is None:
            self.obj[...] = array
            return
        torch = self.torch
        t = self.obj
        src = torch.from_numpy(np.ascontiguousarray(array))
        if t.dtype == torch.bfloat16 and src.dtype == torch.int16:  # a Checkpointer stores bfloat16 as its bits
            src = src.view(torch.bfloat16)
        with torch.no_grad():
            t.copy_(src.reshape(t.shape))


class _Update(NamedTuple):
    """An update computed outside the lock: the new version and, per slot, what to write."""

    version: int
    tables: list  # (slot, rows, values)
    dense: list  # (slot, array)
    keyed: list  # (KeyedReplica, its plan)
    rows: int
    bytes_read: int
    full: bool


def _check_on_update(hook) -> None:
    if hook is not None and not callable(hook):
        raise InvalidArgument(f"on_update must be None or a callable on_update(follower, old, new, stats), "
                              f"got {hook!r}")


class Follower:
    """Keeps ``target`` (an ``nn.Module`` or a dict of numpy arrays) at a version of the store ``source``
    and moves it forward (``poll``, or a thread: ``start``) or back (``rollback``) by reading only the
    rows that differ. See the module doc and API.md, "Serving: following a store".

    ``source``: a store path (opened readonly by the follower and closed by ``close``; with ``remote``
    (a URL, or a connected ``ObjectStore``) the bucket's copy points are followed through a read cache at
    that path, ``remote_options`` and ``cache_bytes`` as ``cnrstore.open`` takes them), or an open
    ``cnrstore.Store`` (never closed by the follower).
    ``target``: an ``nn.Module``: each ``nn.Embedding`` / ``nn.EmbeddingBag`` weight (a TorchRec
    ``EmbeddingBagCollection``'s included: its tables are such modules) is the store table
    ``cnrstore.torch.Checkpointer`` names it by (its module path; ``"embedding"`` for a model that is one),
    every other state-dict entry the dense array ``"torch.model/<key>"`` where the store has it. Or a dict
    ``{name: np.ndarray}``: each key a table (a writable ``(num_rows, dim)`` array) or a dense array name
    (an array of its shape), updated in place; an empty dict is filled with a float32 array per table.
    ``version``: where to start (default: the newest; else a version number, an int >= 1): loaded in full at
    construction (a full sync). ``tables``: restrict the tables followed to these names (one name, or an
    iterable of str). ``on_update(follower, old, new, stats)`` (a callable, or None): called after each
    update is applied (``stats``: that update's ``rows_applied``, ``bytes_read``, ``seconds``,
    ``full_sync``); an ``Exception`` it raises is logged, never propagated. An argument of another type or
    range raises InvalidArgument naming it before the target is touched (its types before the store is
    opened; a target's entries once the store says what they must be, the store closed again then).
    """

    def __init__(self, source, target, *, remote=None, remote_options: dict | None = None,
                 cache_bytes: int | None = None, version: int | None = None, tables=None,
                 on_update: Callable | None = None):
        from .store import Store

        if not isinstance(source, (Store, str, os.PathLike)):
            raise InvalidArgument(f"source must be a store path (a str or os.PathLike) or an open cnrstore.Store, "
                                  f"got {type(source).__name__}")
        version = arguments.version_arg(version, "version", least=1)
        tables = arguments.table_names(tables)
        _check_on_update(on_update)
        _check_target(target)
        self._remote = remote
        self._remote_options = remote_options
        self._cache_bytes = cache_bytes
        if isinstance(source, Store):
            if remote is not None or remote_options is not None or cache_bytes is not None:
                raise InvalidArgument("remote, remote_options and cache_bytes apply to a store path; an open "
                                      "Store given as source is read as it was opened")
            self._store = source
            self._owns_store = False
            self._path = source.path
        else:
            self._path = source
            self._store = None
            self._owns_store = True
            self._open()
        self._on_update = None  # (set once the first full sync is done: a callback never sees a half-built follower)
        self._lock = _ServingLock()
        self._update_lock = threading.RLock()  # one update (poll, rollback, re-sync) at a time
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._closed = False
        self._reopen = False
        #: the newest error a background poll raised (None if none); later successes do not clear it
        self.last_error: BaseException | None = None
        self.stats: dict[str, Any] = {"updates": 0, "rows_applied": 0, "bytes_read": 0, "last_update_seconds": 0.0,
                                      "full_syncs": 0, "errors": 0}
        try:
            self._slots, self._dense, self._keyed, filled = self._bind(target, tables)
            self._version = 0
            self._sync(version)
            for replica in self._keyed.values():  # (its lookups hold serving()'s lock from now on)
                replica.bind(self._lock)
            if filled:  # (an empty dict target: its arrays, once they hold the version)
                target.update(filled)
            self.on_update = on_update
        except BaseException:
            self._close_store()
            raise

    @property
    def on_update(self) -> Callable | None:
        """The callable given each applied update (``on_update(follower, old, new, stats)``), or None; assigning
        anything else is InvalidArgument."""
        return self._on_update

    @on_update.setter
    def on_update(self, hook: Callable | None) -> None:
        _check_on_update(hook)
        self._on_update = hook

    # -- the store -------------------------------------------------------------------------------------
    def _open(self) -> None:
        import cnrstore

        self._store = cnrstore.open(self._path, readonly=True, remote=self._remote,
                                    remote_options=self._remote_options, cache_bytes=self._cache_bytes)

    def _close_store(self) -> None:
        if self._owns_store and self._store is not None:
            with contextlib.suppress(Exception):
                self._store.close()

    def _refresh(self) -> None:
        """Make the store show the newest versions: a local store's read transactions do on their own; a
        read cache of a bucket is opened again when the bucket's pointer moved on (its next copy point) or
        after a failed update (the store the follower opened only)."""
        if not self._owns_store:
            return
        moved = self._reopen
        if not moved and self._remote is not None:
            from .engine import remote as remote_tier

            storage = self._store.engine.storage
            pointer = remote_tier.read_pointer(storage.objects)
            moved = pointer is not None and pointer.generation != getattr(storage, "generation", None)
        if moved:
            self._close_store()
            self._store = None
            self._open()
            self._reopen = False

    @property
    def store(self):
        """The store followed (the follower's own readonly one when ``source`` was a path)."""
        return self._store

    # -- the target ------------------------------------------------------------------------------------
    def _bind(self, target, tables: list[str] | None) -> tuple[dict, dict, dict, dict]:
        """({table: slot}, {dense name: slot}, {keyed table: KeyedReplica}, {table: array or replica} to add
        to an empty dict ``target`` once the first sync filled them) of ``target``, checked against the
        store; ``target`` itself is not changed."""
        infos = self._store.tables()
        dense_names = set(self._store.dense_names())
        if tables is not None:
            unknown = [t for t in tables if t not in infos]
            if unknown:
                raise InvalidArgument(f"tables={unknown[:5]} are not tables of store {self._store.path!r} "
                                      f"(tables: {sorted(infos)[:10]})")
        wanted = set(infos) if tables is None else set(tables)
        slots: dict[str, _Slot] = {}
        dense: dict[str, _Slot] = {}
        keyed: dict[str, KeyedReplica] = {}
        if isinstance(target, dict):
            filled = {} if target else {name: _new_copy(infos[name]) for name in sorted(wanted)}
            for name, arr in (target or filled).items():
                if name in infos and infos[name].keyed:
                    if name in wanted:
                        keyed[name] = _keyed_entry(name, arr)
                    continue
                if not isinstance(arr, np.ndarray) or not arr.flags.writeable:
                    raise InvalidArgument(f"target[{name!r}] must be a writable numpy array, got {type(arr).__name__}")
                if name in infos:
                    if name not in wanted:
                        continue
                    info = infos[name]
                    if arr.shape != (info.num_rows, info.dim):
                        raise InvalidArgument(f"target[{name!r}] is {arr.shape}, table {name!r} is "
                                              f"({info.num_rows}, {info.dim})")
                    slots[name] = _Slot(name, arr)
                elif name in dense_names:
                    dense[name] = _Slot(name, arr, dense=True)
                else:
                    raise InvalidArgument(f"target[{name!r}] names no table or dense array of store "
                                          f"{self._store.path!r} (tables: {sorted(infos)[:10]})")
            return slots, dense, keyed, filled
        import torch

        from .torch.export import embedding_tables

        sd = target.state_dict(keep_vars=True)
        emb = embedding_tables(target)
        aliased = {k for keys in emb.values() for k in keys}
        for name, keys in emb.items():
            if tables is not None and name not in tables:
                continue
            if name not in infos:
                raise InvalidArgument(f"the model's embedding {name!r} is no table of store {self._store.path!r} "
                                      f"(tables: {sorted(infos)[:10]}); follow the store the model was saved to, "
                                      "or pass tables=[...]")
            if infos[name].keyed:
                raise InvalidArgument(f"table {name!r} is keyed (rows by int64 key) and the model's {name!r} is a "
                                      "positional embedding; follow it into a dict target ({name: "
                                      "KeyedReplica()}), or leave it out with tables=[...]")
            w = sd[keys[0]].data
            info = infos[name]
            if tuple(w.shape) != (info.num_rows, info.dim):
                raise InvalidArgument(f"the model's {name!r} is {tuple(w.shape)}, table {name!r} is "
                                      f"({info.num_rows}, {info.dim}); pass the model that was saved")
            slots[name] = _Slot(name, w, torch)
        for key, t in sd.items():
            dname = DENSE_PREFIX + key
            if key in aliased or dname not in dense_names:
                continue
            dense[dname] = _Slot(dname, t.data if hasattr(t, "data") else t, torch, dense=True)
        from .torch.keyed_save import find_keyed
        from .torch.keyed_serving import KeyedModuleCopy

        keyed = {}
        for k in find_keyed(target):  # each KeyedEmbedding: its keyed table, slot by slot (keyed_serving.py)
            if tables is not None and k.name not in tables:
                continue
            if k.name not in infos or not infos[k.name].keyed:
                raise InvalidArgument(f"the model's KeyedEmbedding {k.name!r} is no keyed table of store "
                                      f"{self._store.path!r} (tables: {sorted(infos)[:10]}); follow the store the "
                                      "model was saved to, or pass tables=[...]")
            keyed[k.name] = KeyedModuleCopy(k.name, k.module)
        return slots, dense, keyed, {}

    # -- reading (outside the lock) --------------------------------------------------------------------
    def _compute(self, since: int, until: int | None, *, direct: bool = False) -> _Update:
        """The update from ``since`` (0: a full sync) to ``until`` (None: the newest), read in one read
        transaction: the reader pin that keeps both versions and the segments they read alive while it
        lasts. ``until < since`` (a rollback) reads the rows that differ at ``until``. ``direct``: write each
        table into the target as soon as it is read (the update returned then holds none), so that the host
        holds one table's decoded rows at a time, not every table's: only while no request can be served
        from the target (the constructor's sync, before any ``serving()``)."""
        engine = self._store.engine
        storage = engine.storage
        out_tables, out_dense, out_keyed, rows_total, nbytes = [], [], [], 0, 0
        with engine.read() as view:
            fs.pause_point("follower_reading", since, until)
            if since and view.version(since) is None:  # (the version held: dropped -> a full sync)
                raise VersionNotRetained(f"version {since} is not retained in store {self._store.path!r}", since)
            if until is None:
                latest = view.latest()
                if latest is None:
                    raise VersionNotFound(f"store {self._store.path!r} has no committed version yet")
                until = latest[0]
            elif view.version(until) is None:
                raise VersionNotFound(f"version {until} does not exist in store {self._store.path!r} (never "
                                      "committed, or dropped)")
            lo, hi = min(since, until), max(since, until)
            target = until
            for name, slot in self._slots.items():
                info = self._table(engine, view, name)
                tc = changes_rule.table_changes(view, storage, info, lo, hi, encoded=True)
                if target == hi:
                    rows, values = tc.rows, tc.decoded()
                    nbytes += tc.nbytes
                else:
                    rows, values, n = _rows_at(view, storage, info, tc.rows, lo)
                    nbytes += n
                if rows.size:
                    if direct:
                        slot.scatter(rows, values)
                    else:
                        out_tables.append((slot, rows, values))
                    rows_total += int(rows.size)
                del rows, values
            for name, replica in self._keyed.items():
                plan, n, b = _keyed_plan(view, storage, self._table(engine, view, name), replica, since, target)
                rows_total, nbytes = rows_total + n, nbytes + b
                if direct:
                    replica.commit(plan)
                else:
                    out_keyed.append((replica, plan))
            if self._dense:
                ids = view.dense_names()
                for dname in changes_rule.dense_changed(view, lo, hi, sorted(n for n in self._dense if n in ids)):
                    arr = reader.read_dense(view, storage, ids[dname], dname, target)
                    if arr is not None:
                        out_dense.append((self._dense[dname], np.array(arr, copy=True)))
                        nbytes += int(arr.nbytes)
        return _Update(target, out_tables, out_dense, out_keyed, rows_total, nbytes, since == 0)

    def _table(self, engine, view, name: str):
        info = engine.table_record(name, view)
        if info is None:
            raise VersionNotFound(f"table {name!r} is gone from store {self._store.path!r}")
        return info

    # -- applying (under the exclusive lock) -----------------------------------------------------------
    def _apply(self, up: _Update, started: float) -> int:
        old = self._version
        with self._lock.exclusive():
            for slot, rows, values in up.tables:
                slot.scatter(rows, values)
            for slot, arr in up.dense:
                slot.assign(arr)
            for replica, plan in up.keyed:
                replica.commit(plan)
            self._version = up.version
        seconds = time.perf_counter() - started
        s = self.stats
        s["updates"] += 1
        s["rows_applied"] += up.rows
        s["bytes_read"] += up.bytes_read
        s["last_update_seconds"] = seconds
        if up.full:
            s["full_syncs"] += 1
        if self.on_update is not None:
            try:
                self.on_update(self, old, up.version, {"rows_applied": up.rows, "bytes_read": up.bytes_read,
                                                       "seconds": seconds, "full_sync": up.full})
            except Exception:  # noqa: BLE001 - the application's callback never stops the follower
                log.exception("cnrstore.serving: on_update raised (the update from version %d to %d is applied)",
                              old, up.version)
        return up.version

    def _sync(self, version: int | None) -> int:
        """The constructor's full sync: every row written at ``version`` (None: the newest), each table
        written into the target as it is read (no request is served from it yet)."""
        started = time.perf_counter()
        return self._apply(self._compute(0, version, direct=True), started)

    def _move(self, until: int | None) -> int | None:
        """Go from the version held to ``until`` (None: the newest): the rows that differ, or a full sync
        when the version held is no longer retained (``VersionNotRetained``)."""
        self._check_usable()
        with self._update_lock:
            self._refresh()
            started = time.perf_counter()
            try:
                try:
                    up = self._compute(self._version, until)
                except VersionNotRetained as exc:
                    if exc.version != self._version:
                        raise
                    log.info("cnrstore.serving: version %d was dropped from %r; re-syncing in full",
                             self._version, self._store.path)
                    up = self._compute(0, until)
            except BaseException:
                self._reopen = self._owns_store
                raise
            if up.version == self._version and not up.full:
                return None
            return self._apply(up, started)

    def _check_usable(self) -> None:
        if self._closed:
            raise InvalidArgument("the follower is closed")
        if self._lock.held_by_me():
            raise InvalidArgument("an update waits for every serving() to end: poll or roll back outside "
                                  "serving(), or let the follower's thread do it")

    # -- the public surface ----------------------------------------------------------------------------
    @property
    def version(self) -> int:
        """The version the target holds."""
        return self._version

    @property
    def lag(self) -> FollowerLag:
        """``FollowerLag(versions, seconds)``: versions committed after ``version`` (as the store shows them
        now; a bucket's: as of the read cache's copy point) and seconds since the oldest of them was committed."""
        try:
            listed = self._store.versions()
        except StoreClosed:  # (the follower's thread is opening a read cache again)
            with self._update_lock:
                listed = self._store.versions()
        newer = [v for v in listed if v.version > self._version]
        if not newer:
            return FollowerLag(0, 0.0)
        return FollowerLag(len(newer), max(0.0, time.time() - min(v.created for v in newer)))

    def poll(self) -> int | None:
        """Apply every version committed since ``version`` in one step; the new version, or None if there
        is nothing new. A version held that retention dropped makes it a full sync (``stats["full_syncs"]``)."""
        return self._move(None)

    def rollback(self, version: int) -> int:
        """Go to ``version`` (any retained one, older or newer), reading only the rows that differ: those
        changed in ``(min, max]`` of the two versions, read at ``version``. Rows ``version`` never wrote keep
        the values they have. VersionNotFound if ``version`` is not retained; InvalidArgument if it is no version
        number (an int >= 1: numpy's too, never a bool)."""
        version = arguments.version_arg(version, "version", least=1, optional=False)
        got = self._move(version)
        return self._version if got is None else got

    @contextlib.contextmanager
    def serving(self):
        """A request's version pin: while held no update is applied (an update waits for every holder, and
        a new holder for an update in progress), so a batch never mixes rows of two versions. Yields the
        version being served. Nests within one thread; ``poll``/``rollback`` inside it raise."""
        self._lock.acquire_shared()
        try:
            yield self._version
        finally:
            self._lock.release_shared()

    def start(self, interval_s: float = 0.2) -> None:
        """Poll on a thread every ``interval_s`` seconds (a finite number > 0, at most
        ``threading.TIMEOUT_MAX``: int, float or numpy's, never a bool or a str; else InvalidArgument) until
        ``stop``/``close``. A poll that fails with an ``Exception`` is logged (``last_error``,
        ``stats["errors"]``) and tried again at the next interval (a store the follower opened is opened
        again first). Anything else raised in the thread (a ``BaseException`` such as ``SystemExit`` from
        ``on_update``, or a failure outside the poll) is recorded the same way and ends the thread
        (``running`` turns False); ``stop``, ``close`` and ``start`` work as before."""
        self._check_usable()
        if self.running:
            raise InvalidArgument("the follower's thread is running already; stop() it first")
        interval_s = arguments.number(interval_s, "interval_s", positive=True)
        if interval_s > threading.TIMEOUT_MAX:
            raise InvalidArgument(f"interval_s must be at most {threading.TIMEOUT_MAX:.0f} seconds (threading's "
                                  f"TIMEOUT_MAX, the longest wait), got {interval_s!r}")
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, args=(interval_s,), name="cnrstore-follower", daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        """Whether the polling thread runs: False before ``start``, after ``stop``/``close``, and after the
        thread ended on an error it does not retry (``last_error`` says which)."""
        t = self._thread
        return t is not None and t.is_alive()

    def _run(self, interval_s: float) -> None:
        """The polling thread: nothing raised in it escapes. An ``Exception`` from a poll is recorded and
        retried at the next interval; anything else is recorded and ends the thread."""
        try:
            while not self._stop.wait(interval_s):
                try:
                    self.poll()
                except Exception as exc:  # noqa: BLE001 - logged and retried at the next interval
                    self._record_error(exc, f"retried in {interval_s:.3g} s")
        except BaseException as exc:  # noqa: BLE001 - a thread's end: recorded, never raised into threading
            self._record_error(exc, "the polling thread ends; start() it again")

    def _record_error(self, exc: BaseException, then: str) -> None:
        self.last_error = exc
        self.stats["errors"] += 1
        level = logging.WARNING if isinstance(exc, (CnrError, OSError)) else logging.ERROR
        log.log(level, "cnrstore.serving: polling %r failed (%s): %s: %s", self._path, then, type(exc).__name__,
                exc, exc_info=level == logging.ERROR)

    def stop(self) -> None:
        """Stop the polling thread (waits for a poll in progress); idempotent."""
        self._stop.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join()
        self._thread = None

    def close(self) -> None:
        """Stop the thread and close the store the follower opened (a ``Store`` passed in stays open); the
        target keeps the version it holds. Idempotent."""
        if self._closed:
            return
        self.stop()
        with self._update_lock:
            self._closed = True
            self._close_store()

    def __enter__(self) -> "Follower":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Follower({self._path!r}, version={self._version}, tables={len(self._slots) + len(self._keyed)})"


def _check_target(target) -> None:
    """InvalidArgument unless ``target`` is a dict or an ``nn.Module`` (its entries are checked against the
    store later). Torch is not imported here: an ``nn.Module`` exists only once it is."""
    if isinstance(target, dict):
        return
    nn = sys.modules.get("torch.nn")
    if nn is None or not isinstance(target, nn.Module):
        raise InvalidArgument(f"target must be an nn.Module or a dict {{name: numpy array}}, got "
                              f"{type(target).__name__}")


def _rows_at(view, storage, info, rows: np.ndarray, version: int) -> tuple[np.ndarray, np.ndarray, int]:
    """(the rows of ``rows`` (sorted unique int64) written at or before ``version``, their float32 values
    there, the bytes read in their codecs): ``reader.read_rows`` without its MissingRows (a rollback keeps
    the rows the older version never wrote as they are)."""
    if not rows.size:
        return rows, np.zeros((0, info.dim), dtype=np.float32), 0
    shift = blocks_math.shift(info.block_rows)
    blocks = rows >> shift
    starts, bounds = blocks_math.runs(blocks)
    resolver = reader.BlockResolver(view, storage, info)
    got_rows, got_vals, nbytes = [], [], 0
    for i in range(starts.size):
        lo, hi = bounds[i], bounds[i + 1]
        block = int(blocks[lo])
        base = block << shift
        pieces, _absent = resolver.resolve(block, rows[lo:hi] - base, version)
        for p in pieces:
            enc = p.encoded
            nbytes += int(enc.nbytes)
            got_rows.append(p.dest + base)
            got_vals.append(codecs.by_id(p.codec_id).decode(np.ascontiguousarray(enc), info.dim))
    if not got_rows:
        return rows[:0], np.zeros((0, info.dim), dtype=np.float32), 0
    out_rows = np.concatenate(got_rows)
    order = np.argsort(out_rows, kind="stable")
    return out_rows[order], np.concatenate(got_vals)[order], nbytes


def _new_copy(info):
    """The serving copy an empty dict target gets for table ``info``: float32 zeros, or a KeyedReplica."""
    if info.keyed:
        return KeyedReplica()
    return np.zeros((info.num_rows, info.dim), dtype=np.float32)


def _keyed_entry(name: str, entry) -> KeyedReplica:
    """A dict target's entry for keyed table ``name``: a KeyedReplica (else InvalidArgument)."""
    if not isinstance(entry, KeyedReplica):
        raise InvalidArgument(f"target[{name!r}] is keyed table {name!r} (rows by int64 key): pass "
                              f"cnrstore.serving.KeyedReplica() for it, got {type(entry).__name__}")
    return entry


def _keyed_plan(view, storage, info, replica: KeyedReplica, since: int, until: int) -> tuple:
    """(the replica's plan from ``since`` (0: a full sync, replacing every key) to ``until``, keys put and
    deleted, bytes read): keyed_reader.keyed_changes, either direction (a rollback too)."""
    tc = keyed_reader.keyed_changes(view, storage, info, since, until)
    nbytes = int(tc.values.nbytes) + sum(int(c.nbytes) for c in tc.columns.values())
    if not since:
        return replica.plan_replace(tc.rows, tc.values, tc.columns, info.dim, info.columns), int(tc.rows.size), nbytes
    plan = replica.plan_update(tc.rows, tc.values, tc.columns, tc.deleted)
    return plan, int(tc.rows.size + tc.deleted.size), nbytes
