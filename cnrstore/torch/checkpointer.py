"""Trainer integration: changed-row saves, decoupled asynchronous checkpoints and restore (API.md, ``cnrstore.torch``).

What goes where in the store:

- every ``nn.Embedding`` / ``nn.EmbeddingBag`` weight is a table named by its module path (``"emb.3"``;
  a model that *is* an embedding uses ``"embedding"``), in ``codec``;
- row-wise optimizer state of an embedding weight (a state tensor whose leading dimension is the
  table's ``num_rows``: Adagrad's ``sum``, Adam's ``exp_avg`` / ``exp_avg_sq``, ...) is a table named
  ``f"{table}.optim.{state_name}"`` in ``optimizer_codec``, written for the same rows as the weight;
  trailing dimensions are flattened (a 1-D state is a table of dim 1);
- every other parameter and persistent buffer is a dense array ``f"torch.model/{state_dict key}"``,
  stored exactly (bfloat16 as its raw 16-bit pattern);
- the rest (each optimizer's ``state_dict()`` without its row-wise tensors, the ``extra`` objects'
  ``state_dict()``, dtypes) is one ``torch.save`` blob, the uint8 dense array ``"torch.state"``: data only
  (payload format 2, ``cnrstore/torch/payload.py``), checked at save and read with ``weights_only=True``.

What a save writes: the rows whose value changed since the previous save, whatever changed them. At each
``save()`` every row of every table, and of its row-wise optimizer state, is fingerprinted (64 bits a row:
``fingerprint.py``; one pass over the tables, several GB/s); the rows whose fingerprint differs from the
previous save's are the increment. So an optimizer step, a gradient that no lookup of the module made (an
L2 penalty, a tied output layer, ``F.embedding`` on the weight), gradient accumulation, a closure, several
optimizers, an in-place write through ``.data`` or numpy, ``load_state_dict``, ``nn.init``: a save sees
them all, and the version is the state at ``save()``. (The fingerprints: ``tracking.py`` keeps them per
table; which rows each save writes: ``save_plan.py``; the host snapshot's write in the background:
``async_save.py``; the copy-on-write of streamed saves: ``streamed.py`` and ``guard.py``; the payload:
``payload.py``; reading a version back: ``restore.py``; this module: the ``Checkpointer`` that owns the live
objects and ties them together.)

Priority saves (``top``) write only the most updated of the changed rows; the next regular save adds what
they left.

Modes (what a save writes for the embedding tables; everything else is written in full every save):

- ``"incremental"``: the rows changed since the previous save;
- ``"one-shot"``: the rows changed since the last baseline;
- ``"intermittent"``: one-shot, plus Check-N-Run's reset rule computed over all tables together: with
  ``S_i`` the rows of the i-th differential since the baseline as a fraction of all embedding rows, when
  ``1 + S_1 + … + S_i <= (i + 1) · S_i`` the i-th save is written as a new baseline instead.

A baseline (every row) is written by the first save of a ``Checkpointer``, by the first save after a
background failure, and by the first save after ``restore`` (except in incremental mode after restoring the
newest version, where the store already holds exactly the model).

Priority saves (CPR, Maeng et al. MLSys'21): with ``priority="mfu"`` a forward pre-hook on each embedding
counts, per row, the lookups since the row was last saved (int32, duplicates within a batch counted: the exact update count of
an optimizer that updates each looked-up row once per lookup's gradient; not saturating: a row looked up
2^31 times between two saves of it would wrap); with ``priority="ssu"`` it counts only a random sample of
each batch's ids, ``ssu_rate`` of them on average (drawn with replacement from a private, deterministically
seeded ``torch.Generator`` and ``random.Random``, so the training RNG stream is not disturbed), an unbiased
estimate of ``ssu_rate`` times the exact count. ``save(top=r)`` then writes, for every table, the
changed rows with the highest counts, at most ``ceil(r · num_rows)`` of them (a fraction of *all* the
table's rows, as CPR-MFU saves the r% most frequently updated rows: the write volume of a priority save is
bounded and known in advance), ties broken toward the lower row id, with their row-wise optimizer state;
dense parameters and the state blob are written as in every save. A priority save takes the rows it writes
as saved (their fingerprints) and clears their counts, and leaves the other changed rows for the next
regular save; it marks the rows it
writes as changed since the baseline (so later differentials still hold them), is never a baseline and
does not enter the intermittent rule's ``S_i``. When the next save must be a baseline (see above), ``top``
is ignored and the save is a regular baseline (``SaveReport.priority`` is False). A regular save clears
every count.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Mapping
from types import MappingProxyType
from typing import NamedTuple

import numpy as np
import torch
from torch import nn

from .. import codecs
from .. import store as _store
from ..engine import fs, arguments
from ..policy.compaction import KeepEveryNSteps, KeepLast, Retention
from . import payload as _payload
from . import preemption, reports
from . import restore as _restore
from . import sharded
from ..errors import InvalidArgument, SaveRefused, SaveSkipped, SaveSuperseded
from ..types import VersionInfo
from .bucket_lag import DEFAULT_REMOTE_LAG_S, BucketBound
from .async_save import PendingSave, SaveQueue, SaveReport, WeakPendingWork
from .optim_state import (as_optimizer_list, create_lazy_state, holds_weight, row_state_width, table_drift,
                          with_live_state)
from .payload import DENSE_PREFIX, STATE_BLOB
from .reports import RestoreReport
from .save_plan import MODES, SavePlanner
from .staging import Stager
from .guard import StepGuard, as_rows, preserve
from . import keyed_save as keyed_state
from .keyed_save import KeyedJob, find_keyed
from .streamed import StreamedTable, block_multiple
from .tracking import SSU_SEED, ShardTable, Table, tbe_tracker

# STATE_BLOB, DENSE_PREFIX, table_drift, SaveReport, PendingSave and WeakPendingWork are importable from here as
# before (they live in payload.py, optim_state.py and async_save.py); MODES lives in save_plan.py
__all__ = ["Checkpointer", "DENSE_PREFIX", "MODES", "PendingSave", "RestoreReport", "STATE_BLOB", "SaveReport",
           "TrainerState", "WeakPendingWork", "table_drift"]

PRIORITIES = ("mfu", "ssu")
BACKPRESSURE = ("wait", "coalesce")


class TrainerState(NamedTuple):
    """What a Checkpointer saves and restores, as live objects (``Checkpointer.trainer_state()``, for sibling
    packages): ``tables`` (a ``tracking.Table`` per embedding weight or local shard, in the model's order),
    ``dense`` ({state-dict key: parameter or buffer} stored as ``DENSE_PREFIX`` arrays), ``optimizers``,
    ``extra`` ({name: object with ``state_dict()`` / ``load_state_dict()``}) and ``keyed`` (a
    ``keyed_save.KeyedTracker`` per ``KeyedEmbedding``, saved as keyed tables)."""

    tables: tuple
    dense: Mapping
    optimizers: tuple
    extra: Mapping
    keyed: tuple = ()


def _is_fraction(x) -> bool:
    """A real number in (0, 1] (not a bool)."""
    return (not isinstance(x, bool) and isinstance(x, (int, float, np.integer, np.floating))
            and 0 < float(x) <= 1)


def _retention_arg(value, name: str, what: str) -> int | None:
    """None, or a positive integer; InvalidArgument saying what to pass otherwise."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1):
        raise InvalidArgument(f"{name} must be None (keep every version) or a positive integer ({what}); "
                              f"got {value!r}")
    return None if value is None else int(value)


def _as_extra(extra) -> dict:
    if extra is None:
        return {}
    if isinstance(extra, Mapping):
        items = {str(k): v for k, v in extra.items()}
    elif isinstance(extra, (list, tuple)):
        items = {str(i): v for i, v in enumerate(extra)}
    else:
        items = {"0": extra}
    for k, v in items.items():
        if not (callable(getattr(v, "state_dict", None)) and callable(getattr(v, "load_state_dict", None))):
            raise InvalidArgument(f"extra {k!r} ({type(v).__name__}) needs state_dict() and load_state_dict()")
    return items


def _copy_in(live: torch.Tensor, src: torch.Tensor, pending: set) -> None:
    """``live[:] = src``: from a pinned host buffer into a CUDA tensor without blocking (its device is added
    to ``pending``: synchronize it before the buffer is read or freed), otherwise at once."""
    if src.is_pinned() and live.is_cuda:
        live.copy_(src, non_blocking=True)
        pending.add(live.device)
    else:
        live.copy_(src)


class Checkpointer:
    """Checkpoints ``model`` (and ``optimizer``, ``extra``) into ``store``; see API.md and the module doc.

    ``store`` is a ``cnrstore.Store`` (the caller's: ``close()`` leaves it open) or a path (``str`` or
    ``os.PathLike``): the Checkpointer then opens it, creating it if absent, owns it and closes it in
    :meth:`close` (also when the constructor fails). The arguments are checked before the store is opened:
    a bad one creates nothing.

    ``codec`` is a codec name or a ``cnrstore.policy.BitWidthPolicy`` (its ``codec()`` is asked at each
    save, and ``restore`` records a restore with it). Tables are created if missing (at construction, and
    those of row-wise optimizer state created later, e.g. Adam's, at the first save that finds it); an
    existing table of another shape raises :class:`InvalidArgument`. Not thread-safe: call it from the training thread.

    ``max_queue_bytes`` bounds the host memory held by the snapshots of saves not yet written (see
    :meth:`save`); None: the store's ``Options.save_queue_state_fraction`` of a full snapshot of the model
    (every row of every table and of its row-wise optimizer state, and the dense state); 0: one save at a time.
    ``max_lag``: the most saves that may be returned by ``save()`` and not yet committed (this one
    included: 2, the default, means ``save()`` first waits for all but the newest earlier one); None: no
    bound but the bytes. With saves every ``I`` seconds, a ``kill -9`` then loses at most the last
    ``max_lag`` saves, about ``max_lag · I`` seconds of training (:attr:`durable_step` says where it stands).

    ``stream_saves`` (default True): a save (baseline or increment) of a table whose rows change only in
    optimizer steps (CPU float32 weight without ``max_norm``, no weight decay, plain SGD / Adagrad /
    SparseAdam, held by an optimizer passed here) is written from the live tensors while training goes on,
    copying a row aside only just before something the Checkpointer sees changes it (an optimizer step, for
    the rows of its gradient; a closure's gradient; a write announced with :meth:`changing` or
    :meth:`reset_rows`): ``save()`` copies none of the table's rows, and host memory grows by the rows of the
    save changed during its write. Each row is checked against its fingerprint at ``save()`` as it is written:
    a row changed meanwhile by anything else (an unannounced in-place write) refuses the save
    (:class:`~cnrstore.errors.SaveRefused`, raised by ``wait()`` and the next ``save()``; nothing of it
    commits) and that table is copied at ``save()`` from then on. False: every save copies its rows into host
    memory inside ``save()``. Either way a committed version is the state at ``save()``.

    ``on_backpressure``: what a save does when the queue is full (``max_lag`` saves uncommitted, or the bytes
    bound): ``"wait"`` (the default) for the oldest queued save; ``"coalesce"``: supersede the queued saves
    that have not started writing (their ``wait()`` raises :class:`~cnrstore.errors.SaveSuperseded`) and write
    their rows too (``SaveReport.superseded`` names their steps), waiting only if that is not enough.

    On a store with a remote tier the local commit is the save's durability point: the Checkpointer makes the
    store's copy points run behind its commits (they coalesce; ``bucket_lag``), so ``save()`` never waits for
    an upload. ``remote_lag_s`` (600 s; ``math.inf``: none) bounds how far the bucket may trail: past it a save
    waits for the bucket (``on_remote_lag="wait"``, the default; ``SaveReport.bucket_wait_s``) or raises
    :class:`~cnrstore.errors.RemoteLagging` taking nothing (``"raise"``).

    Retention: with ``keep_last=n`` and/or ``keep_every_n_steps=k``, after each save commits the store keeps
    the newest ``n`` versions and those whose step is a multiple of ``k`` (what either rule keeps, and always
    the newest: ``cnrstore.policy.Retention``), drops the rest (versions of earlier runs included) and
    collects their space -- in the background, before that save's ``wait()`` returns. What a kept version
    reads is never changed. A retention failure does not fail the save (it is logged; the next save tries
    again). Both None (the default): every version is kept.

    ``on_report``: a callable given each save's :class:`SaveReport` once the save has committed (on the
    background writer's thread, before its ``wait()`` returns; keep it short: the next save's write waits
    for it) and each restore's :class:`RestoreReport` (on the caller's thread); None: they are logged at
    INFO on the ``cnrstore.torch`` logger. A hook's exception is logged, never raised (``reports``).

    On a GPU (a weight, its row-wise optimizer state or a dense array on a CUDA device) ``save()`` enqueues
    its copies on a side stream of the Checkpointer's own into page-locked host buffers (reused save after
    save) and returns; the trainer's later work on the current stream is ordered after the snapshot's
    reads, and the background write waits for the copies to land (``staging``: the ordering contract).
    ``stager``: None (that default), or a ``staging.Stager`` with a backend of its own (tests).
    """

    def __init__(self, store, model: nn.Module, optimizer=None, *, codec="fp32", mode: str = "incremental",
                 optimizer_codec: str = "fp32", extra=None, priority: str | None = None,
                 ssu_rate: float = 0.125, max_queue_bytes: int | None = None, keep_last: int | None = None,
                 keep_every_n_steps: int | None = None, on_report=None, stager: Stager | None = None,
                 on_sigterm: str | None = "finish", max_lag: int | None = 2, stream_saves: bool = True,
                 on_backpressure: str = "wait", remote_lag_s: float = DEFAULT_REMOTE_LAG_S,
                 on_remote_lag: str = "wait"):
        if mode not in MODES:
            raise InvalidArgument(f"mode must be one of {', '.join(MODES)}; got {mode!r}")
        if priority is not None and priority not in PRIORITIES:
            raise InvalidArgument(f"priority must be None, 'mfu' (exact update counts) or 'ssu' (sub-sampled); "
                                  f"got {priority!r}")
        if not _is_fraction(ssu_rate):
            raise InvalidArgument(f"ssu_rate must be a number in (0, 1] (the fraction of looked-up ids counted); "
                                  f"got {ssu_rate!r}")
        if not isinstance(model, nn.Module):
            raise InvalidArgument(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if max_queue_bytes is not None and (isinstance(max_queue_bytes, bool) or not isinstance(
                max_queue_bytes, (int, np.integer)) or max_queue_bytes < 0):
            raise InvalidArgument(f"max_queue_bytes must be None (the default bound) or a number of bytes >= 0; "
                                  f"got {max_queue_bytes!r}")
        if max_lag is not None and (isinstance(max_lag, bool) or not isinstance(max_lag, (int, np.integer))
                                    or max_lag < 1):
            raise InvalidArgument(f"max_lag must be None or the most saves not yet committed when save() returns "
                                  f"(an int >= 1); got {max_lag!r}")
        if not isinstance(stream_saves, bool):
            raise InvalidArgument(f"stream_saves must be True or False, got {stream_saves!r}")
        if on_backpressure not in BACKPRESSURE:
            raise InvalidArgument(f"on_backpressure must be 'wait' (save() waits for the oldest queued saves) or "
                                  f"'coalesce' (a save supersedes the queued saves that have not started "
                                  f"writing, and writes their rows too); got {on_backpressure!r}")
        self.on_backpressure = on_backpressure
        self._bucket = BucketBound(remote_lag_s, on_remote_lag)
        self.max_lag = None if max_lag is None else int(max_lag)
        self.stream_saves = stream_saves
        self.keep_last = _retention_arg(keep_last, "keep_last", "the number of newest versions to keep")
        self.keep_every_n_steps = _retention_arg(keep_every_n_steps, "keep_every_n_steps",
                                                 "keep the versions whose step is a multiple of it")
        rules = ([KeepLast(self.keep_last)] if self.keep_last else []) + (
            [KeepEveryNSteps(self.keep_every_n_steps)] if self.keep_every_n_steps else [])
        self._retention = Retention(*rules) if rules else None
        self._on_report = reports.check_hook(on_report, "Checkpointer")
        self.on_sigterm = preemption.check(on_sigterm)
        if stager is not None and not isinstance(stager, Stager):
            raise InvalidArgument(f"stager must be None or a cnrstore.torch.staging.Stager, got {type(stager).__name__}")
        #: how snapshots reach host memory (``staging``: numpy on CPU, a side stream per CUDA device)
        self.stager = Stager() if stager is None else stager
        self._policy = None if isinstance(codec, str) else codec
        if self._policy is not None and not callable(getattr(self._policy, "codec", None)):
            raise InvalidArgument(f"codec must be a codec name or a BitWidthPolicy, got {codec!r}")
        self._codec_str = codec if self._policy is None else None
        codecs.get(self._weight_codec())  # unknown name -> InvalidArgument
        codecs.get(optimizer_codec)
        self._extra = _as_extra(extra)
        self._optimizers = as_optimizer_list(optimizer)
        self._owns_store = False
        if isinstance(store, (str, os.PathLike)):
            # (every argument above checked: a bad one creates nothing); background compaction keeps saves flat
            store = _store.open(store, create=True, compaction="auto")
            self._owns_store = True
        elif not callable(getattr(store, "checkpoint", None)):
            raise InvalidArgument(f"store must be a cnrstore.Store or a path (str or os.PathLike) to open or create "
                                  f"one; got {type(store).__name__}")
        try:
            self._setup(store, model, mode, optimizer_codec, priority, ssu_rate, max_queue_bytes)
        except BaseException:
            if self._owns_store:
                store.close()
            raise

    def _setup(self, store, model, mode, optimizer_codec, priority, ssu_rate, max_queue_bytes) -> None:
        """The rest of ``__init__``, on an open ``store``."""
        self.max_queue_bytes = None if max_queue_bytes is None else int(max_queue_bytes)
        self.store = store
        self.model = model
        self.mode = mode
        self.optimizer_codec = optimizer_codec
        self.priority = priority
        self.ssu_rate = float(ssu_rate)
        self._bucket.attach(store)  # (a store in a bucket: its copy points run behind the commits from now on)
        self._tables: list[Table] = []
        self._by_weight: dict[int, Table] = {}
        existing = store.tables()
        try:
            for path, module in model.named_modules():
                if not isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
                    continue
                if id(module.weight) in self._by_weight:  # a weight shared by modules: one table
                    shared = self._by_weight[id(module.weight)]
                    shared.track_module(module)
                    continue
                t = Table(path, module, priority, self.ssu_rate, SSU_SEED + len(self._tables))
                self._tables.append(t)
                self._by_weight[id(t.weight)] = t
                self._ensure_table(existing, t.name, t.num_rows, t.dim, self._weight_codec())
            sharded_keys = self._add_shards(model, existing)
            #: each KeyedEmbedding of the model: saved as keyed tables (keyed_save.py)
            self._keyed = find_keyed(model)
            for k in self._keyed:
                k.ensure_tables(store, existing, self._weight_codec(), k.states(self._optimizers))
        except BaseException:
            self._remove_hooks()
            raise
        keyed_rows = {id(x) for k in self._keyed for x in k.row_tensors()}
        mc_local = sharded.mc_local_buffers(model)  # (a sharded managed-collision buffer: this rank's shard)
        self._dense = {k: mc_local.get(k, v) for k, v in model.state_dict(keep_vars=True).items()
                       if id(v) not in self._by_weight and k not in sharded_keys and id(v) not in keyed_rows}
        self._keyed_full = False  # the next save writes every keyed table whole (a coalesced save)
        self._plan = SavePlanner(mode, self._tables, self._optimizers)  # which rows each save writes
        self._plan.keyed = bool(self._keyed)
        try:  # row-wise state that exists already (Adagrad's) gets its tables now, not in the first save's stall
            for t in self._tables:
                for key, state in self._plan.row_states(t):
                    self._ensure_table(existing, f"{t.name}.optim.{key}", t.store_rows, row_state_width(state),
                                       self.optimizer_codec)
        except BaseException:
            self._remove_hooks()
            raise
        self._queue = SaveQueue()  # the saves whose snapshots are taken and not yet written, in order
        self._seq = 0  # saves taken so far (messages name a save by its number)
        self._blob_bytes = 0  # the last payload's size: the estimate of the next one's
        self._error: BaseException | None = None  # a background failure not yet re-raised by save()
        self._failed: PendingSave | None = None  # the save that failed with it
        self._closed = False
        self._durable: tuple[int, int | None] | None = None  # (version, step) of the newest committed save
        #: what the tables' fingerprints (``Table.saved``) describe in the store: the newest save's PendingSave,
        #: the version a whole restore loaded (int), or None (``image_rows``)
        self._image_base = None
        #: the RestoreReport of the last restore() (None before one)
        self.last_restore: RestoreReport | None = None
        self._work = WeakPendingWork(self, Checkpointer._finish_saves, Checkpointer._cancel_saves,
                                     Checkpointer._unreported_failure)
        add_work = getattr(store, "add_pending_work", None)
        if add_work is not None:  # store.close() and the interpreter's exit wait for our queued saves
            add_work(self._work)
        self._watch_sigterm()
        # every optimizer's step (passed here or not) and closure: a streamed save must see each change coming
        self._guard = StepGuard([t for t in self._tables if type(t) is Table])

    # -- SIGTERM (preemption.py) ----------------------------------------------------------------------
    def _watch_sigterm(self) -> None:
        """With ``on_sigterm``: the process's SIGTERM handler; with "save", optimizer step post-hooks that
        count training steps and save the step in progress once every optimizer has finished it."""
        self._sigterm = False  # a SIGTERM asked for a save of the step in progress
        self._last_step: int | None = None  # the step of the last save()
        self._steps_since = 0  # training steps completed since (each optimizer stepped once)
        self._stepped: set = set()
        self._step_hooks = []
        if self.on_sigterm is None:
            return
        if self.on_sigterm == "save" and self._optimizers and all(
                callable(getattr(o, "register_step_post_hook", None)) for o in self._optimizers):
            self._step_hooks = [o.register_step_post_hook(self._after_optimizer_step) for o in self._optimizers]
        preemption.watch(self)

    def can_save_on_sigterm(self) -> bool:
        """*For preemption.py*: whether a SIGTERM can be answered by a save of the step in progress."""
        return bool(self._step_hooks) and not self._closed

    def sigterm_received(self) -> None:
        """*For preemption.py*: save the step in progress once every optimizer has finished it, then exit."""
        self._sigterm = True

    def _after_optimizer_step(self, optimizer, _args, _kwargs) -> None:
        self._stepped.add(id(optimizer))
        if len(self._stepped) < len(self._optimizers):
            return
        self._stepped.clear()
        self._steps_since += 1
        if self._sigterm:
            self._sigterm = False
            # (steps counted from 0: a process that has neither saved nor restored finished step steps_since - 1)
            step = (-1 if self._last_step is None else self._last_step) + self._steps_since
            reports.LOGGER.warning("cnrstore: SIGTERM: saving step %s, then exiting with status %d", step,
                                   preemption.EXIT_STATUS)
            self.save(step, {"sigterm": True})
            raise SystemExit(preemption.EXIT_STATUS)

    def _unwatch_sigterm(self) -> None:
        for hook in self._step_hooks:
            hook.remove()
        self._step_hooks = []
        preemption.unwatch(self)

    def _add_shards(self, model: nn.Module, existing: dict) -> set:
        """The local shards of TorchRec-sharded tables become tables (``sharded``); returns the state-dict keys
        they stand for. Their lookups are tracked by hooks on the TBE kernels."""
        if not sharded.is_sharded(model):
            return set()
        shards, keys, feeds = sharded.find_shards(model)
        by_id = {}
        for shard in shards:
            if not shard.tensor.numel():
                continue
            t = ShardTable(shard, self.priority, self.ssu_rate, SSU_SEED + len(self._tables))
            self._tables.append(t)
            by_id[id(shard)] = t
            self._ensure_table(existing, t.name, t.store_rows, t.dim, self._weight_codec())
        for module, per_table, features in feeds if self.priority is not None else ():  # (update counts)
            tables = [by_id.get(id(s)) if s is not None else None for s in per_table]
            hook = module.register_forward_pre_hook(tbe_tracker(tables, features), with_kwargs=True)
            next(t for t in tables if t is not None).hooks.append(hook)
        return keys

    # -- helpers --------------------------------------------------------------------------------------
    def _weight_codec(self) -> str:
        return self._policy.codec() if self._policy is not None else self._codec_str

    def _ensure_table(self, existing: dict, name: str, num_rows: int, dim: int, codec: str) -> None:
        """Check the stored table ``name`` has this shape, or create it (a readonly store, e.g. one restored
        into a model sharded another way, gets it at the first save, which needs a writable store anyway)."""
        info = existing.get(name)
        if info is None:
            if getattr(self.store, "readonly", False):
                return
            self.store.create_table(name, num_rows, dim, codec=codec)
            existing[name] = self.store.tables()[name]
        elif (info.num_rows, info.dim) != (num_rows, dim):
            raise InvalidArgument(
                f"table {name!r} in the store has {info.num_rows} rows x {info.dim} dims but the model's has "
                f"{num_rows} x {dim}; use a new store, or a model of the stored shape")

    def _remove_hooks(self) -> None:
        for t in self._tables:
            t.remove_hooks()
        guard = getattr(self, "_guard", None)
        if guard is not None:
            guard.remove()

    def _raise_pending_error(self) -> None:
        if self._error is not None and not self.raises_own_failures:
            self._error = None  # (the owner surfaces it: its gather of every rank's outcome)
            return
        if self._error is not None:
            err, self._error = self._error, None
            if hasattr(err, "add_note"):
                err.add_note(f"(re-raised by save #{self._seq + 1} of this Checkpointer, which took no snapshot)")
            raise err

    def _reap(self) -> None:
        """Take the saves that have ended out of the queue (on the trainer's thread): their reusable buffers
        are free again and their bytes stop counting; a failure makes the next save a baseline and is kept
        for the next save() to raise (the first one; a save skipped because of it adds nothing)."""
        for pending, holds in self._queue.reap():
            for t, name in holds:
                t.release_buffer(name)
            if pending.failure() is None:
                self._durable = (pending.report.version, pending.report.step)
            err = pending.failure()
            if isinstance(err, SaveRefused):  # (unseen writes: copy that table at save() from now on)
                for t in self._tables:
                    t.refused = t.refused or err.table == t.name
            if err is not None:
                self._plan.force_full = True
                if self._error is None and not isinstance(err, SaveSkipped):
                    self._error, self._failed = err, pending

    def _finish_inflight(self) -> None:
        if self._finish_saves(None):
            self._reap()

    def _finish_saves(self, timeout: float | None) -> bool:
        """Wait for every queued save (for good, or ``timeout`` seconds); whether they have ended. SIGTERM's
        exit or a first Ctrl-C while waiting is raised once they have ended (committed); a second Ctrl-C
        cancels them (each aborts at its next step: nothing of them commits) and is raised at once; they
        stay queued until their threads have ended, so that the store is never closed under them.
        (Store.close() and the store's exit hook call this, through its ``WeakPendingWork``.)"""
        deadline = None if timeout is None else time.monotonic() + timeout

        def left() -> float | None:
            return None if deadline is None else max(0.0, deadline - time.monotonic())

        interrupt = None  # a SIGTERM's exit or a first Ctrl-C: raised once the saves that returned commit
        if len(self._queue):
            try:
                fs.pause_point("checkpointer_waits_for_save")  # (tests: where a Ctrl-C lands while close waits)
            except (KeyboardInterrupt, SystemExit) as exc:
                interrupt = self._interrupted_wait(exc)
            while True:
                try:
                    done = self._queue.wait_all(left())
                    break
                except (KeyboardInterrupt, SystemExit) as exc:
                    interrupt = self._interrupted_wait(exc, interrupt)
                except BaseException:
                    self._queue.cancel()
                    raise
            if not done:
                if interrupt is not None:
                    raise interrupt
                return False
        # every write has ended: the worker thread goes too (none may outlive a close or the interpreter)
        stopped = self._queue.stop(left())
        if interrupt is not None:
            raise interrupt
        return stopped

    def _interrupted_wait(self, exc: BaseException, first: BaseException | None = None) -> BaseException:
        """A signal reached a wait for the queued saves (``close()``, ``restore()``, the exit): a second
        Ctrl-C gives them up (each aborts at its next step) and is raised at once; SIGTERM's exit and a first
        Ctrl-C let them commit, and are raised after (``preemption``). Returns what to raise then."""
        if isinstance(exc, KeyboardInterrupt):
            if preemption.second_interrupt(exc):
                self._queue.cancel()
                raise exc
            preemption.note_interrupt()
        reports.LOGGER.warning("cnrstore: %s: committing the %d save(s) save() returned before exiting%s",
                               "Ctrl-C" if isinstance(exc, KeyboardInterrupt) else "exit",
                               len(self._queue), "; Ctrl-C again gives them up"
                               if isinstance(exc, KeyboardInterrupt) else "")
        return exc if first is None else first

    def _cancel_saves(self) -> None:
        """Tell every queued save to abort at its next step (an exit that cannot wait for them)."""
        self._queue.cancel()

    def _unreported_failure(self) -> BaseException | None:
        """A background failure nobody has been told of yet (the store's exit hook logs it)."""
        if self._error is not None:
            return self._error
        for pending in self._queue.pending():
            err = pending.failure()
            if err is not None and not pending.failure_reported and not isinstance(err, SaveSkipped):
                return err
        return None

    def queue_bound(self) -> int:
        """The bytes the snapshots of queued saves may hold (``max_queue_bytes``, or its default)."""
        if self.max_queue_bytes is not None:
            return self.max_queue_bytes
        fraction = self.store.options.save_queue_state_fraction
        return int(fraction * self._snapshot_bytes([None] * len(self._tables), stream=False))

    def queued_bytes(self) -> int:
        """Host bytes the snapshots of the saves not yet written hold now (rows a streamed save has
        preserved included)."""
        self._reap()
        return self._queue.held_bytes

    @property
    def tables(self) -> tuple:
        """The embedding tables this Checkpointer saves (tracking.Table: their rows' fingerprints as of the last
        save, update counts, saves being written), for diagnostics and benchmarks; read-only."""
        return tuple(self._tables)

    @property
    def durable_step(self) -> int | None:
        """The step of the newest save of this Checkpointer that has committed (None before one, or if it had
        no step): what a ``kill -9`` now would resume from."""
        self._reap()
        return None if self._durable is None else self._durable[1]

    @property
    def durable_version(self) -> int | None:
        """The version of the newest save of this Checkpointer that has committed (None before one)."""
        self._reap()
        return None if self._durable is None else self._durable[0]

    def _streams(self, t: Table, baseline: bool) -> bool:
        """Whether a save of ``t`` (a ``baseline`` or not) is written from the live tensors (``streamed``'s
        condition 1; an increment only once every row-wise state table of ``t`` was written in full in this
        session: before, its state is written whole while its weight is not)."""
        if not baseline and any(f"{t.name}.optim.{k}" not in t.full_written for k, _s in self._plan.row_states(t)):
            return False
        return (self.stream_saves and type(t) is Table and not t.refused and t.on_cpu
                and self.stager.backend(t.device) is None
                and t.weight.dtype == torch.float32
                and getattr(t.module, "max_norm", None) is None and holds_weight(self._optimizers, t.weight)
                and self._plan.drift(t) is None
                and all(s.device.type == "cpu" and s.dtype == torch.float32 for _k, s in self._plan.row_states(t)))

    def _snapshot_bytes(self, picks: list, stream: bool = True) -> int:
        """Host bytes a snapshot of ``picks`` (per table: rows, or None for all) takes: the rows of each table
        and of its row-wise state (in full the first time a state table is written in this session; none of a
        streamed save's, with ``stream``), the dense arrays, and a payload the size of the last one."""
        total = self._blob_bytes + sum(v.nbytes for v in self._dense.values())
        for t, rows in zip(self._tables, picks):
            if stream and self._streams(t, rows is None):
                continue
            n = t.num_rows if rows is None else int(rows.numel())
            total += 4 * n * t.dim
            for key, state in self._plan.row_states(t):
                width = row_state_width(state)
                full = f"{t.name}.optim.{key}" not in t.full_written
                total += 4 * (t.num_rows if full else n) * width
        return total

    def _must_wait(self, nbytes: int) -> bool:
        """Whether a snapshot of ``nbytes`` must wait for the oldest queued save: the queue holds one and
        either ``max_lag`` saves would be uncommitted or the bytes bound passed. A baseline queued before does
        not count against the bound for the saves behind it (its copy exists already; they add only their
        own); a snapshot alone over the bound (a baseline copied in full) is taken once the queue is empty."""
        if not len(self._queue):
            return False
        if self.max_lag is not None and len(self._queue) >= self.max_lag:
            return True
        return self._queue.held_bytes_beside_baselines + nbytes > self.queue_bound()

    def _wait_for_room(self, nbytes: int) -> None:
        """Before a snapshot of ``nbytes``: wait for the oldest queued saves while it must (:meth:`_must_wait`).
        A failure found meanwhile is raised here, with no snapshot taken."""
        self._reap()
        while self._must_wait(nbytes):
            try:
                fs.pause_point("checkpointer_waits_for_room")  # (tests: a save waiting on the bound)
                self._queue.wait_oldest()
            except KeyboardInterrupt:  # (a first Ctrl-C: the queued saves still commit, preemption.py)
                preemption.note_interrupt()
                raise
            self._reap()
        self._raise_pending_error()

    def _coalesce(self, baseline: bool, picks: list, step) -> tuple[bool, list, list]:
        """``on_backpressure="coalesce"``: if this save (``picks``) would wait for room, the queued saves that
        have not started writing are superseded by it instead -- they end with :class:`SaveSuperseded`, and
        this save writes their rows too (every row, if one was a baseline). Returns (baseline, picks, the
        steps superseded)."""
        self._reap()
        if not self._must_wait(self._snapshot_bytes(picks)):
            return baseline, picks, []
        superseded = self._queue.supersede()
        steps = []
        for pending, holds, jobs in superseded:
            for t, name in holds:
                t.release_buffer(name)
            for job in jobs:
                if isinstance(job, StreamedTable):
                    job.close()
            baseline = baseline or pending.report.baseline
            picks = [None if a is None or b is None else torch.unique(torch.cat([a, b.to(a.device)]))
                     for a, b in zip(picks, pending.picks)]
            steps.append(pending.report.step)
            pending.finish(None, SaveSuperseded(
                f"{pending.describe()} was superseded by the save of step {step} before it started writing "
                "(on_backpressure='coalesce'): that save writes its rows too; nothing of it was committed on its "
                "own", by_step=step))
        if baseline:
            picks = [None] * len(picks)
            self._plan.note_baseline()
        self._keyed_full = self._keyed_full or bool(superseded)  # (their keyed changes: written whole now)
        return baseline, picks, sorted(steps, key=lambda x: (x is None, x))

    # -- save -----------------------------------------------------------------------------------------
    def save(self, step: int | None = None, meta: dict | None = None, *, top: float | None = None) -> PendingSave:
        """Snapshot the state into host memory and write it in the background; see API.md.

        ``top`` (a fraction in (0, 1], only with ``priority``) makes it a priority save: per table, at most
        ``ceil(top · num_rows)`` of the changed rows, the most updated first (module doc).

        Saves queue: a save while earlier ones are still writing copies its rows and returns; the queued
        snapshots are written one after the other, so versions commit in save order. Only when the host
        bytes the queued snapshots hold plus this one's would pass ``queue_bound()`` does ``save`` first wait
        for the oldest ones (its ``stall_s`` includes that wait). A failure of an earlier background write
        is raised here (once, with a note naming the save that failed) instead of taking a snapshot; the
        queued saves after the failed one that are no baseline are not written (their ``wait()`` raises
        :class:`SaveSkipped`), and the next save is a baseline.

        Once ``save()`` has returned, the save commits (unless a save queued before it fails: see above) even
        if the process then ends: ``store.close()``, ``Checkpointer.close()`` and the interpreter's exit
        (Ctrl-C, an uncaught exception, ``sys.exit``) wait for every queued save; the exit waits at most ``cnrstore.store.EXIT_WAIT_S`` seconds (300, env
        ``CNRSTORE_EXIT_WAIT_S``) for all of a store's work in flight. What loses it: SIGKILL, ``os._exit``,
        a signal whose default action kills the process without Python's exit (SIGTERM: install a handler
        that raises ``SystemExit`` to finish the save), a write still running after ``EXIT_WAIT_S``, or a
        second Ctrl-C while something waits for it: the interrupted wait cancels the save (it aborts at its
        next table: nothing of it commits, ``wait()`` raises ``KeyboardInterrupt``) or, at exit, abandons
        it. In every case the store is left as ``kill -9`` would leave it: every committed version intact,
        the torn tail truncated by the next writable open.
        """
        if self._closed:
            raise InvalidArgument("this Checkpointer is closed")
        if top is not None:
            if self.priority is None:
                raise InvalidArgument("save(top=...) needs update counts: make the Checkpointer with "
                                      "priority='mfu' or priority='ssu'")
            if not _is_fraction(top):
                raise InvalidArgument(f"top must be a fraction in (0, 1] of each table's rows; got {top!r}")
        self._reap()
        self._raise_pending_error()
        arguments.check_meta(meta)  # bad arguments fail here, not in the background
        step = arguments.step_arg(step)
        for key, v in self._dense.items():  # a dense array the format cannot hold: fail now, not in the background
            if v.nbytes > arguments.max_dense_bytes():
                raise InvalidArgument(
                    f"model state {key!r} is {v.nbytes:,} bytes; the Checkpointer stores each parameter or "
                    f"buffer that is not an embedding as one dense array of at most "
                    f"{arguments.max_dense_bytes():,} bytes: make it an nn.Embedding (a table, saved by rows) "
                    "or split it into several parameters")
        try:
            pending = self._snapshot(step, meta, top)
        except BaseException:
            self._plan.force_full = True  # the masks may be half-consumed: the next save writes everything
            raise
        self._last_step, self._steps_since = step, 0
        self._image_base = pending
        return pending

    def _snapshot(self, step, meta, top=None) -> PendingSave:
        """Copy what the save writes into host memory (the trainer's stall), then queue its write."""
        start = time.perf_counter()
        bucket_lag_s, bucket_lag_versions, bucket_wait_s = self._bucket.before_save(f"the save of step {step}")
        codec = self._weight_codec()
        baseline, priority, picks = self._plan.pick(top)
        superseded = []
        if self.on_backpressure == "coalesce":
            baseline, picks, superseded = self._coalesce(baseline, picks, step)
            priority = priority and not baseline
        self._wait_for_room(self._snapshot_bytes(picks))
        report = SaveReport(step=step, baseline=baseline, priority=priority, superseded=superseded,
                            bucket_lag_s=bucket_lag_s, bucket_lag_versions=bucket_lag_versions,
                            bucket_wait_s=bucket_wait_s)
        holds = []  # (table, name) of the reusable host buffers this snapshot takes
        staging = self.stager.begin()
        try:
            row_jobs, dense, blob = self._copy(staging, picks, codec, report, holds)
            keyed_bytes = self._copy_keyed(row_jobs, baseline or self._keyed_full, codec, report)
        except BaseException:
            staging.finish().wait()  # (copies already enqueued land before their buffers are lent again)
            for t, name in holds:
                t.release_buffer(name)
            for t in self._tables:  # (a streamed save opened for this save: nothing will read it)
                for s in t.streams:
                    s.close()
            raise
        staged = staging.finish()
        self._plan.settle(picks, priority)
        for k in self._keyed:
            k.settle()
        self._keyed_full = False
        copied = [job for job in row_jobs if not isinstance(job, (StreamedTable, KeyedJob))]
        written = {name for name, _, _, _ in copied} | {
            name for job in row_jobs if isinstance(job, StreamedTable) for name, _s, _c in job.sources}
        for t in self._tables:
            t.full_written.update(n for n in written if n.startswith(f"{t.name}.optim."))
        self._blob_bytes = blob.nbytes
        report.host_bytes = sum(values.nbytes for _n, _r, values, _c in copied) + blob.nbytes + sum(
            a.nbytes for a in dense.values()) + keyed_bytes
        report.stall_s = time.perf_counter() - start
        self._seq += 1
        pending = PendingSave(report, self._seq, picks)
        self._queue.start(self.store, pending, report.host_bytes, holds, step, meta, row_jobs, dense, blob,
                          after_commit=self._after_commit, staged=staged)
        return pending

    def _after_commit(self, store, report: SaveReport) -> None:
        """On the writer's thread, once a save has committed: retention, then the report. Raises nothing
        (the version is committed; a failure here is logged)."""
        if self._retention is not None:
            try:
                report.dropped = self._apply_retention(store)
            except Exception as exc:
                reports.LOGGER.warning("retention after the save of step %s (version %s) failed; the version is "
                                       "committed, the next save retries: %s: %s", report.step, report.version,
                                       type(exc).__name__, exc)
        reports.deliver(self._on_report, report, background=True)

    def _apply_retention(self, store) -> list[int]:
        """Drop the versions ``keep_last`` / ``keep_every_n_steps`` do not keep and collect their space;
        the dropped versions, oldest first."""
        drop = self._retention.to_drop(tuple(store.versions()))
        if not drop:
            return []
        dropped = store.drop_versions(drop)
        store.gc()
        return dropped

    def _copy(self, staging, picks: list, codec: str, report: SaveReport, holds: list):
        """The snapshot's host copies, through ``staging`` (a ``staging.Staging``: on a CUDA device they are
        enqueued, and land by its handle's ``wait()``): (row jobs, dense arrays, payload blob); notes the
        rows in ``report`` and the reusable buffers taken in ``holds``."""
        row_jobs = []  # (table, rows numpy, values tensor, codec)
        existing = self.store.tables()

        def buffer(t, name, n, width):
            buf, pooled = t.take_buffer(name, n, width, lambda shape: staging.host_empty(t.device, shape))
            if pooled:
                holds.append((t, name))
            return buf

        with torch.no_grad():
            for t, rows in zip(self._tables, picks):
                if self._streams(t, rows is None):
                    row_jobs.append(self._stream(t, rows, codec, existing, report))
                    continue
                n = t.num_rows if rows is None else int(rows.numel())
                buf = buffer(t, t.name, n, t.dim)
                staging.gather(t.weight, rows, buf)
                rows_np = np.arange(t.num_rows, dtype=np.int64) if rows is None else rows.cpu().numpy()
                if t.offset:
                    rows_np = rows_np + t.offset  # a shard's rows under their global ids
                self._ensure_table(existing, t.name, t.store_rows, t.dim, codec)
                row_jobs.append((t.name, rows_np, buf, codec))
                report.rows[t.name] = n
                for key, state in self._plan.row_states(t):
                    name = f"{t.name}.optim.{key}"
                    width = row_state_width(state)
                    self._ensure_table(existing, name, t.store_rows, width, self.optimizer_codec)
                    s_rows, s_np = rows, rows_np
                    if name not in t.full_written:
                        s_rows, s_np = None, np.arange(t.offset, t.offset + t.num_rows, dtype=np.int64)
                    m = t.num_rows if s_rows is None else int(s_rows.numel())
                    sbuf = buffer(t, name, m, width)
                    staging.gather(state.reshape(t.num_rows, width), s_rows, sbuf)
                    row_jobs.append((name, s_np, sbuf, None))
                    report.rows[name] = m
            dense = {k: staging.dense(v) for k, v in self._dense.items()}
            blob = self._state_blob()
            if blob.nbytes > arguments.max_dense_bytes():  # the optimizers' dense state can outgrow a record
                raise InvalidArgument(
                    f"the optimizer state outside the embedding tables (and extra) pickles to {blob.nbytes:,} "
                    f"bytes, more than one dense array holds ({arguments.max_dense_bytes():,}); keep large "
                    "row-wise state on nn.Embedding weights (saved as tables) or split the dense layers")
        return row_jobs, dense, blob

    def _copy_keyed(self, row_jobs: list, full: bool, codec: str, report: SaveReport) -> int:
        """Each KeyedEmbedding's part of the snapshot (``keyed_save``: the ids changed since the last save, or
        every id when ``full``), copied now and appended to ``row_jobs``; the host bytes it holds."""
        if not self._keyed:
            return 0
        existing = self.store.tables()
        nbytes = 0
        for k in self._keyed:
            jobs, n = k.snapshot(self._optimizers, full, codec, self.store, existing)
            row_jobs.extend(jobs)
            report.rows[k.name] = n
            for job in jobs[1:]:
                report.rows[job.name] = int(job.keys.size)
            nbytes += sum(j.keys.nbytes + j.values.nbytes + j.deleted.nbytes
                          + sum(c.nbytes for c in (j.columns or {}).values()) for j in jobs)
        return nbytes

    def _stream(self, t: Table, rows, codec: str, existing: dict, report: SaveReport) -> StreamedTable:
        """A save of ``rows`` of ``t`` (a rows tensor, or None for all) written from the live tensors
        (``streamed``): nothing is copied now; from here on each optimizer step first preserves the rows of
        the save it will change that the writer has not read."""
        self._ensure_table(existing, t.name, t.store_rows, t.dim, codec)
        sources = [(t.name, t.weight.detach(), codec)]
        for key, state in self._plan.row_states(t):
            name = f"{t.name}.optim.{key}"
            width = row_state_width(state)
            self._ensure_table(existing, name, t.store_rows, width, self.optimizer_codec)
            sources.append((name, state.detach().reshape(t.num_rows, width), None))
        block = block_multiple([existing[name].block_rows for name, _s, _c in sources])  # (_ensure_table: in it)
        if rows is not None:
            rows = rows.cpu().numpy().astype(np.int64, copy=False)
            if rows.size > 1 and not (np.diff(rows) > 0).all():
                rows = np.unique(rows)
        stream = StreamedTable(sources, t.num_rows, block, rows, t.offset, expected=self._plan.expected(t, rows))
        t.streams.append(stream)
        for name, _src, _c in sources:
            report.rows[name] = stream.count
        report.streamed.append(t.name)
        return stream

    def _state_blob(self) -> np.ndarray:
        """This save's trainer payload, encoded (``payload.build``, then ``payload.encode``)."""
        row_tables = {w: (t.name, {k for k, _ in self._plan.row_states(t)}) for w, t in self._by_weight.items()}
        keyed_tables = {id(k.weight): (k.name, {key: k.free_value(key, s) for key, s in k.states(self._optimizers)})
                        for k in self._keyed}
        return _payload.encode(_payload.build(
            mode=self.mode, tables=[t.name for t in self._tables], dense=self._dense, optimizers=self._optimizers,
            extra=self._extra, param_names={id(p): name for name, p in self.model.named_parameters()},
            row_tables=row_tables, keyed_tables=keyed_tables))

    # -- writes of the trainer's own ------------------------------------------------------------------
    def _table_of(self, table) -> Table:
        """The tracked table named ``table`` (its module path), of the embedding module ``table``, or of the
        weight tensor ``table``; InvalidArgument otherwise."""
        for t in self._tables:
            if (table is t.weight or getattr(table, "weight", None) is t.weight
                    or (isinstance(table, str) and table in (t.name, t.path))):
                return t
        names = ", ".join(repr(t.name) for t in self._tables) or "none"
        raise InvalidArgument(f"{table!r} is not an embedding table this Checkpointer saves (tables: {names}); "
                              "pass a table's name (its module path), its module or its weight")

    def _row_ids(self, t: Table, rows) -> torch.Tensor | None:
        ids = as_rows(rows)
        if ids is not None and ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= t.num_rows):
            raise InvalidArgument(f"rows of table {t.name!r} must be in [0, {t.num_rows}); got ids from "
                                  f"{int(ids.min())} to {int(ids.max())}")
        return ids

    @contextlib.contextmanager
    def changing(self, table, rows=None):
        """Announce a write of your own code to ``rows`` (ids, or None: any row) of ``table`` (a table's name,
        embedding module or weight) and of its row-wise optimizer state, made inside the ``with`` block::

            with ckpt.changing("emb", rows):
                emb.weight.data[rows] = fresh        # any way: .data, numpy, copy_, an optimizer's state

        Saves find every changed row without it (each save compares row fingerprints); what it adds is for a
        save still being written from the live tensors (a streamed save): the rows' values as of that save
        are copied aside before the block runs, so the save stays exact instead of being refused
        (:class:`~cnrstore.errors.SaveRefused`). A write outside the announced rows still refuses it."""
        if self._closed:
            raise InvalidArgument("this Checkpointer is closed")
        t = self._table_of(table)
        preserve(t, self._row_ids(t, rows))
        yield

    def reset_rows(self, table, rows, values=0.0, *, optimizer_state=0.0) -> None:
        """Re-initialize ``rows`` of ``table`` (a table's name, embedding module or weight): set their weights
        to ``values`` (a scalar, or a tensor of ``len(rows)`` x dim) and their row-wise optimizer state to
        ``optimizer_state`` (None: left as it is) -- what a zero-collision hash table does to the slot of an
        evicted id. Announced (:meth:`changing`): a save being written keeps the rows' values as of its
        ``save()``, and the next save writes the new ones."""
        t = self._table_of(table)
        ids = self._row_ids(t, rows)
        if ids is None:
            raise InvalidArgument("reset_rows needs the rows to reset (ids); to re-initialize a whole table, "
                                  "write it inside `with ckpt.changing(table):`")
        with self.changing(t.weight, ids), torch.no_grad():
            w = t.weight
            w[ids.to(w.device)] = values.to(w.device, w.dtype) if torch.is_tensor(values) else values
            if optimizer_state is not None:
                for _key, state in self._plan.row_states(t):
                    state[ids.to(state.device)] = optimizer_state

    # -- what the store holds ---------------------------------------------------------------------------
    def versions(self) -> list[VersionInfo]:
        """The store's versions, oldest first (``Store.versions``)."""
        return self.store.versions()

    def latest(self) -> VersionInfo | None:
        """The newest version (None before the first save commits)."""
        return self.store.latest()

    def steps(self) -> list[int | None]:
        """The training step of each version, oldest first (what ``save(step)`` recorded)."""
        return [v.step for v in self.store.versions()]

    # -- restore --------------------------------------------------------------------------------------
    def restore(self, version: int | None = None, *, only=None, strict: bool = True,
                trust_pickle: bool = False) -> VersionInfo | None:
        """Load ``version`` (default newest) into the model, optimizers and ``extra`` in place; returns its
        ``VersionInfo``, or None when the store holds no version yet (a fresh start:
        ``info = ckpt.restore(); start = info.step + 1 if info else 0``).

        All or nothing: what the version holds is checked against the live objects before any of them
        changes (restore_check.py): every table, dense array, optimizer and ``extra`` object must get its
        state, and the version must hold nothing beyond them, the optimizers of the same kind with the same
        parameter groups; else :class:`InvalidArgument` names the difference and nothing is changed. A
        damaged record (:class:`CorruptionError`) and a refused payload (:class:`UnsafePayload`: a pickle
        naming code, unless ``trust_pickle=True``, a warning, then a full unpickle: only for a store you
        wrote) change nothing either. An ``extra`` object whose ``load_state_dict`` raises is put back as it
        was (InvalidArgument).

        ``only`` loads part of it: ``"model"`` (every table and dense array), ``"optimizers"``,
        ``"extra"``, or names of tables, dense arrays (state-dict keys) and ``extra`` objects, in any
        combination (a list); the rest is left as it is. ``strict=False`` loads what matches a changed model
        (DCP's ``allow_partial_load``): live state the version lacks is left as it is, stored state nothing
        takes is not loaded, and optimizer state follows the parameters by name; the ``RestoreReport`` (the
        ``on_report`` hook, and ``last_restore``) lists both (``missing``, ``unexpected``).

        Waits for every queued save first (a failure among them is still raised by the next ``save``). A
        version holding no optimizer state (``cnrstore import`` of model weights only) leaves the
        optimizers as they are.
        """
        if self._closed:
            raise InvalidArgument("this Checkpointer is closed")
        start = time.perf_counter()
        self._finish_inflight()
        before: dict = {}  # extra objects' state as it was, put back if a later step fails

        def load_extra(states: dict) -> None:
            for name, state in states.items():
                obj = self._extra[name]
                before[name] = obj.state_dict()
                try:
                    obj.load_state_dict(state)
                except Exception as exc:
                    raise InvalidArgument(f"extra {name!r}: its load_state_dict failed ({type(exc).__name__}: "
                                          f"{exc}); nothing was changed") from exc

        try:
            # the KeyedEmbeddings' rows are read (and checked) first: before anything live changes
            keyed = self._read_keyed(version, only, strict, trust_pickle) if self._keyed else None
            got = _restore.read_version(self.store, self._tables, self._dense, self._optimizers, self._extra,
                                        version, trust_pickle=trust_pickle, only=only, strict=strict,
                                        param_names={id(p): n for n, p in self.model.named_parameters()},
                                        before_decode=load_extra, keyed_names=[k.name for k in self._keyed])
        except BaseException:
            for name, state in before.items():
                try:
                    self._extra[name].load_state_dict(state)
                except Exception:  # noqa: BLE001 - the first failure is the one to raise
                    reports.LOGGER.exception("cnrstore: putting extra %r back after a failed restore failed", name)
            raise
        if got is None:
            return None
        info, stored, outcome = got
        if keyed is not None:  # (the keyed embeddings' optimizer state, from the rows read above)
            reads, load, missing, unexpected = keyed
            stored = stored._replace(optimizer_states=[
                None if sd is None else keyed_state.with_keyed_state(sd, reads) for sd in stored.optimizer_states])
        # everything read and checked (the fp32 host weights and row-wise optimizer state already decoded
        # into place, after every record was verified): now change the rest of the live objects
        self.load_state(*stored)
        if keyed is not None:
            for k in self._keyed:
                if k.name in load:
                    k.load(reads[k.name])
            outcome.restored = sorted(outcome.restored + sorted(load))
            outcome.missing += missing
            outcome.unexpected += unexpected
        if info.step is not None:  # (on_sigterm="save" counts the steps after it)
            self._last_step, self._steps_since = info.step, 0
        latest = self.store.latest()
        whole = only is None and not outcome.missing and not outcome.unexpected
        self.note_restore(matches_newest=whole and latest is not None and latest.version == info.version)
        if whole and not self._keyed:
            self._image_base = info.version
        self.last_restore = RestoreReport(info.version, info.step, time.perf_counter() - start, outcome.restored,
                                          outcome.missing, outcome.unexpected)
        reports.deliver(self._on_report, self.last_restore)
        return info

    def _read_keyed(self, version, only, strict: bool, trust_pickle: bool):
        """For ``restore``, before anything live changes: the KeyedEmbeddings' rows at ``version`` (read and
        checked: ``keyed_save.KeyedTracker.read``) -> ({table: rows read}, the tables to load into the modules,
        missing, unexpected), or None for an empty store. Reads a module's tables when it is restored (``only``:
        None, "model" or its name) or when the optimizer state restored holds its ``KEYED_MARK`` markers."""
        info = _restore.version_info(self.store, version)
        if info is None:
            return None
        v = info.version
        payload = _payload.decode(self.store.read_dense(STATE_BLOB, v), v, trust_pickle=trust_pickle)
        asked = None if only is None else ({only} if isinstance(only, str) else set(only))
        live = {k.name for k in self._keyed}
        want = live if asked is None or "model" in asked else live & asked
        stored = set(payload.get("keyed", []))
        whole = asked is None or "model" in asked
        missing, unexpected = sorted(want - stored), sorted(stored - live) if whole else []
        if strict and (missing or unexpected):
            raise InvalidArgument(
                f"version {v} does not match: " + "; ".join(
                    ([f"it holds no keyed table {missing[:5]} of the live KeyedEmbeddings"] if missing else [])
                    + ([f"it holds keyed tables {unexpected[:5]} that nothing live takes"] if unexpected else []))
                + ". Nothing was changed; restore with strict=False to load what matches, or only=[...]")
        load = want & stored
        marks = keyed_state.marked_tables(payload) if asked is None or "optimizers" in asked else set()
        catalog = self.store.tables()
        reads = {k.name: k.read(self.store, v, catalog) for k in self._keyed
                 if k.name in load or any(m.startswith(f"{k.name}.optim.") for m in marks)}
        for m in marks:  # (a marker naming a table nothing read: refused now, before anything changed)
            if not any(m.startswith(f"{n}.optim.") and m[len(n) + 1:] in r for n, r in reads.items()):
                if strict:
                    raise InvalidArgument(f"version {v}: optimizer state {m!r} of a keyed embedding the model does "
                                          "not have (or its table is missing). Nothing was changed")
        return reads, load, missing, unexpected

    # -- for sibling packages (cnrstore.distributed; docs/ARCHITECTURE.md, "Seams between packages") -----
    def trainer_state(self) -> "TrainerState":
        """*For sibling packages* (``cnrstore.distributed``), not part of the trainer API: the live objects
        this Checkpointer saves and restores (:class:`TrainerState`). The tensors, optimizers and ``extra``
        objects are the model's own; the containers are read-only views."""
        return TrainerState(tuple(self._tables), MappingProxyType(self._dense), tuple(self._optimizers),
                            MappingProxyType(self._extra), tuple(self._keyed))

    def load_state(self, weights, shard_states, dense, optimizer_states, extra) -> None:
        """*For sibling packages* (``cnrstore.distributed``'s resharding restore) and ``restore``: put state
        read from a stored version, all of it read and checked already, into the live objects, in place.

        ``weights``: a tensor per table (``trainer_state().tables`` order; the table's own weight tensor
        when it already holds the state, a pinned host tensor is copied without blocking);
        ``shard_states``: (row-wise state tensor of a ``ShardTable``, its stored values, or the state tensor
        itself when it holds them already); ``dense``: {state-dict key: tensor} (bfloat16 viewed as such);
        ``optimizer_states``: a state dict per optimizer with its row-wise state filled in (an empty list
        leaves the optimizers as they are); ``extra``: {name: state dict}, loaded in that order.
        Call :meth:`note_restore` after it."""
        create_lazy_state(self._optimizers, [sd if sd is not None else {"state": {}} for sd in optimizer_states])
        pending = set()  # the CUDA devices with host-to-device copies in flight
        with torch.no_grad():
            for t, w in zip(self._tables, weights):
                if w is not None and w is not t.weight:  # (None: not loaded; the weight itself: decoded into)
                    _copy_in(t.weight, w, pending)
            for state, w in shard_states:
                if w is not state:  # (the state itself: restore decoded its rows into it)
                    _copy_in(state, w.reshape(state.shape), pending)
            for key, src in dense.items():
                self._dense[key].copy_(src)
            for device in pending:  # the pinned buffers' copies have landed before anyone reads (or frees) them
                torch.cuda.synchronize(device)
        for opt, sd in zip(self._optimizers, optimizer_states):
            if sd is not None:  # (None: this one is not loaded)
                opt.load_state_dict(with_live_state(sd, opt))
        for k, state in extra.items():
            self._extra[k].load_state_dict(state)

    def note_restore(self, *, matches_newest: bool = False) -> None:
        """*For sibling packages* (``cnrstore.distributed``) and ``restore``: the live state was just loaded
        from a stored version. Takes the restored rows' fingerprints as the last save's, clears the rows
        since the baseline and the update counts, makes the next save a baseline (unless
        ``matches_newest``, the state is the store's newest version, and the mode is incremental: the next
        increment then follows it) and records the restore with a ``BitWidthPolicy``."""
        self._plan.note_restore(matches_newest=matches_newest)
        self._image_base = None  # (restore() names the version it loaded whole)
        for k in self._keyed:
            k.note_restore(self._optimizers)
        if self._policy is not None and callable(getattr(self._policy, "record_restore", None)):
            self._policy.record_restore()

    def image_rows(self, changed: bool = True):
        """*For sibling packages* (``cnrstore.distributed.torchft_transport``): how the live tables differ
        from a stored version, so that a peer can rebuild them from the store -> ``(base, tables, exact)``.

        ``base``: the newest ``save()``'s PendingSave (its version is the base once it commits; a failed one
        is no base), the version a whole ``restore()`` loaded, or None (no save or restore yet: no base).
        ``tables``: per table, ``(table, sources, rows)``: ``sources`` lists ``(store table name, live tensor
        viewed as rows, the live tensor)`` for its weight and each row-wise optimizer state, and ``rows`` the
        local rows (an int64 CPU tensor, ascending) whose weight or row-wise state differ from the base's
        (their fingerprints, as a save finds them). ``exact``: whether base + those rows is the live state
        bit for bit (the codecs are fp32 and every source is float32); when False, use whole tables.
        ``changed=False`` skips the fingerprints (``rows`` None). Reads the live tensors: call it when no
        optimizer step runs."""
        exact = (self._policy is None and self._codec_str == "fp32" and self.optimizer_codec == "fp32")
        out = []
        for t in self._tables:
            sources = []
            states = {f"{t.name}.optim.{k}": s for k, s in self._plan.row_states(t)}
            for name, rows_view in self._plan.sources(t):
                live = states.get(name, t.weight)
                sources.append((name, rows_view, live))
                exact = exact and rows_view.dtype == torch.float32
            out.append((t, sources, self._plan.changed_rows(t) if changed else None))
        return self._image_base, out, exact

    #: *For sibling packages* (``cnrstore.distributed``): False makes ``save()`` raise no failure of an earlier
    #: background write (each save's own ``wait()`` still does; the next save is still a baseline), because
    #: the owner surfaces it on every rank at the same call
    raises_own_failures = True

    def forget_failure(self) -> None:
        """*For sibling packages* (``cnrstore.distributed``): drop the failure of a background write that the
        next ``save()`` would raise, because the caller has surfaced it itself (the next save is still a
        baseline)."""
        self._reap()
        self._error = None

    # -- lifecycle ------------------------------------------------------------------------------------
    def close(self) -> None:
        """Wait for every queued save, remove the tracking hooks and, when the Checkpointer opened the store
        (a path), close it. Idempotent. A background failure that neither ``wait()`` nor ``save()`` has
        raised yet is raised here (after closing)."""
        if self._closed:
            return
        self._finish_inflight()
        self._remove_hooks()
        self._unwatch_sigterm()
        self._closed = True
        if self._owns_store:
            self.store.close()
        if self._error is not None and self._failed is not None and not self._failed.failure_reported:
            err, self._error = self._error, None
            raise err

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
