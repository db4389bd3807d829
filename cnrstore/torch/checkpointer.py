"""Trainer integration: row tracking, decoupled asynchronous checkpoints and restore (API.md, ``cnrstore.torch``).

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

Row tracking: a forward pre-hook on each embedding sets a bool mask (on the weight's device) at every
looked-up index, while autograd is enabled (lookups under ``torch.no_grad()``, e.g. evaluation, are not
tracked: they cannot change the weights). Weights changed outside a forward pass and an optimizer step
are not tracked. (The masks and counts: ``tracking.py``; drift, non-zero rows and restored optimizer state:
``optim_state.py``; this module: what a save writes, the background write, restore.)

Every mode is exact with every optimizer: a regular save adds to the looked-up rows those the optimizer
may have changed without a lookup, judged per table from the optimizers holding its weight, with the
hyper-parameters of the weight's param group at save time (``optim_state.table_drift``):

- none: plain SGD (no momentum), Adagrad and ``SparseAdam``, all without weight decay, leave a row with a
  zero gradient untouched: the looked-up rows are all that changed;
- ``"state"``: SGD with momentum, Adam, AdamW (weight_decay=0), NAdam, RAdam, Adamax, RMSprop, Adadelta,
  Rprop move a row, and change its row-wise state, exactly while that state is non-zero (a zero state
  and a zero gradient give a zero update; Adamax's zero infinity norm becomes ``eps`` at once). A save
  adds the rows whose row-wise state is non-zero now or was at the previous regular save (a state that
  decayed to zero in between) -- a vectorized scan of the state, chunked to bound memory;
- ``"all"``: any non-zero ``weight_decay`` (it shrinks every row), and any optimizer class cnrstore does
  not know (it may change any row): every row is written, as in a baseline.

Priority saves (``top``) write only the top looked-up rows; the next regular save adds what they left.

Modes (what a save writes for the embedding tables; everything else is written in full every save):

- ``"incremental"``: the rows looked up since the previous save;
- ``"one-shot"``: the rows looked up since the last baseline;
- ``"intermittent"``: one-shot, plus Check-N-Run's reset rule computed over all tables together: with
  ``S_i`` the rows of the i-th differential since the baseline as a fraction of all embedding rows, when
  ``1 + S_1 + … + S_i <= (i + 1) · S_i`` the i-th save is written as a new baseline instead.

A baseline (every row) is written by the first save of a ``Checkpointer``, by the first save after a
background failure, and by the first save after ``restore`` (except in incremental mode after restoring the
newest version, where the store already holds exactly the model).

Priority saves (CPR, Maeng et al. MLSys'21): with ``priority="mfu"`` the pre-hook also counts, per row, the
lookups since the row was last saved (int32, duplicates within a batch counted: the exact update count of
an optimizer that updates each looked-up row once per lookup's gradient; not saturating: a row looked up
2^31 times between two saves of it would wrap); with ``priority="ssu"`` it counts only a random sample of
each batch's ids, ``ssu_rate`` of them on average (drawn with replacement from a private, deterministically
seeded ``torch.Generator`` and ``random.Random``, so the training RNG stream is not disturbed), an unbiased
estimate of ``ssu_rate`` times the exact count. ``save(top=r)`` then writes, for every table, the
touched rows with the highest counts, at most ``ceil(r · num_rows)`` of them (a fraction of *all* the
table's rows, as CPR-MFU saves the r% most frequently updated rows: the write volume of a priority save is
bounded and known in advance), ties broken toward the lower row id, with their row-wise optimizer state;
dense parameters and the state blob are written as in every save. A priority save clears the touched bit
and count of the rows it writes and leaves the others' for the next regular save; it marks the rows it
writes as changed since the baseline (so later differentials still hold them), is never a baseline and
does not enter the intermittent rule's ``S_i``. When the next save must be a baseline (see above), ``top``
is ignored and the save is a regular baseline (``SaveReport.priority`` is False). A regular save clears
every count.
"""

from __future__ import annotations

import math
import threading
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import NamedTuple

import numpy as np
import torch
from torch import nn

from .. import codecs, fs, validate
from . import payload as _payload
from . import sharded
from ..errors import InvalidArgument, MissingRows, VersionNotFound
from ..types import VersionInfo
from ..writer import pack_meta
from .optim_state import (as_optimizer_list, create_lazy_state, is_sharded_value, nonzero_rows, row_state_width,
                          row_states, table_drift, with_live_state)
from .payload import DENSE_PREFIX, LIVE_MARK, PAYLOAD_FORMAT, ROW_MARK, STATE_BLOB, dense_copy
from .tracking import SSU_SEED, ShardTable, Table, tbe_tracker

# STATE_BLOB, DENSE_PREFIX and table_drift are importable from here as before (they live in payload.py and
# optim_state.py)
__all__ = ["Checkpointer", "DENSE_PREFIX", "PendingSave", "STATE_BLOB", "SaveReport", "TrainerState", "table_drift"]

MODES = ("incremental", "one-shot", "intermittent")
PRIORITIES = ("mfu", "ssu")


@dataclass
class SaveReport:
    """What one save wrote: rows per table (weights and row-wise optimizer state), whether it was a
    baseline or a priority save (``save(top=...)``), and how long ``save()`` held the trainer
    (``stall_s``)."""

    step: int | None
    baseline: bool
    rows: dict[str, int] = field(default_factory=dict)
    stall_s: float = 0.0
    version: int | None = None
    priority: bool = False


class PendingSave:
    """A save whose snapshot is taken and whose write runs in the background."""

    def __init__(self, report: SaveReport):
        self.report = report
        self._done = threading.Event()
        self._version: int | None = None
        self._error: BaseException | None = None
        self._reported = False
        self._thread: threading.Thread | None = None
        self._cancelled = False  # an interrupt while waiting for it: abort at the next step, commit nothing

    def done(self) -> bool:
        """True once the background write has committed or failed."""
        return self._done.is_set()

    def wait(self) -> int:
        """Block until the write ends; return the committed version, or re-raise its failure (the
        exception the store raised)."""
        self._done.wait()
        if self._error is not None:
            self._reported = True
            raise self._error
        assert self._version is not None
        return self._version


class TrainerState(NamedTuple):
    """What a Checkpointer saves and restores, as live objects (``Checkpointer.trainer_state()``, for sibling
    packages): ``tables`` (a ``tracking.Table`` per embedding weight or local shard, in the model's order),
    ``dense`` ({state-dict key: parameter or buffer} stored as ``DENSE_PREFIX`` arrays), ``optimizers``
    and ``extra`` ({name: object with ``state_dict()`` / ``load_state_dict()``})."""

    tables: tuple
    dense: Mapping
    optimizers: tuple
    extra: Mapping


class WeakPendingWork:
    """Background work of ``owner`` as a store's ``PendingWork`` (``Store.add_pending_work``): what
    ``store.close()`` and the interpreter's exit wait for, cancel or report. It refers to its owner weakly,
    as the store refers to it: an owner that is gone has no work in flight (the work's thread holds it).
    ``finish(owner, timeout)``, ``cancel(owner)`` and ``failure(owner)`` do the work's part for a live owner.
    *For sibling packages*: the Checkpointer's saves and the DistributedCheckpointer's global commits."""

    def __init__(self, owner, finish, cancel=None, failure=None):
        self._owner = weakref.ref(owner)
        self._finish, self._cancel, self._failure = finish, cancel, failure

    def finish(self, timeout: float | None) -> bool:
        owner = self._owner()
        return True if owner is None else self._finish(owner, timeout)

    def cancel(self) -> None:
        owner = self._owner()
        if owner is not None and self._cancel is not None:
            self._cancel(owner)

    def failure(self) -> BaseException | None:
        owner = self._owner()
        return None if owner is None or self._failure is None else self._failure(owner)


def _is_fraction(x) -> bool:
    """A real number in (0, 1] (not a bool)."""
    return (not isinstance(x, bool) and isinstance(x, (int, float, np.integer, np.floating))
            and 0 < float(x) <= 1)


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


class Checkpointer:
    """Checkpoints ``model`` (and ``optimizer``, ``extra``) into ``store``; see API.md and the module doc.

    ``codec`` is a codec name or a ``cnrstore.policy.BitWidthPolicy`` (its ``codec()`` is asked at each
    save, and ``restore`` records a restore with it). Tables are created if missing; an existing table of
    another shape raises :class:`InvalidArgument`. Not thread-safe: call it from the training thread.
    """

    def __init__(self, store, model: nn.Module, optimizer=None, *, codec="int4", mode: str = "intermittent",
                 optimizer_codec: str = "fp32", extra=None, priority: str | None = None,
                 ssu_rate: float = 0.125):
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
        self._policy = None if isinstance(codec, str) else codec
        if self._policy is not None and not callable(getattr(self._policy, "codec", None)):
            raise InvalidArgument(f"codec must be a codec name or a BitWidthPolicy, got {codec!r}")
        self._codec_str = codec if self._policy is None else None
        codecs.get(self._weight_codec())  # unknown name -> InvalidArgument
        codecs.get(optimizer_codec)
        self.store = store
        self.model = model
        self.mode = mode
        self.optimizer_codec = optimizer_codec
        self.priority = priority
        self.ssu_rate = float(ssu_rate)
        self._optimizers = as_optimizer_list(optimizer)
        self._extra = _as_extra(extra)
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
        except BaseException:
            self._remove_hooks()
            raise
        self._dense = {k: v for k, v in model.state_dict(keep_vars=True).items()
                       if id(v) not in self._by_weight and k not in sharded_keys}
        self._total_rows = sum(t.num_rows for t in self._tables)
        self._force_full = True
        self._diffs: list[float] = []  # S_1..S_i since the last baseline (intermittent)
        self._pending: PendingSave | None = None
        self._error: BaseException | None = None  # a background failure not yet re-raised by save()
        self._failed: PendingSave | None = None  # the save that failed with it
        self._closed = False
        self._work = WeakPendingWork(self, Checkpointer._finish_saves, Checkpointer._cancel_saves,
                                     lambda owner: owner._error)
        add_work = getattr(store, "add_pending_work", None)
        if add_work is not None:  # store.close() and the interpreter's exit wait for our save in flight
            add_work(self._work)

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
        for module, per_table, features in feeds:
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

    def _row_states(self, t: Table):
        """(state name, tensor) of the row-wise optimizer state of ``t``'s weight, in a stable order."""
        if isinstance(t, ShardTable):
            yield from t.states
            return
        yield from row_states(self._optimizers, t.weight, t.num_rows)

    def _table_drift(self, t: Table) -> str | None:
        if isinstance(t, ShardTable):
            return None  # fused TBE optimizers update the rows of the batch only (sharded.py)
        return table_drift(self._optimizers, t.weight)

    def _add_drifted_rows(self) -> None:
        """Before a regular save: mark as touched the rows the optimizers may have changed without a lookup
        since the previous regular save, so that every mode writes them (module doc)."""
        for t in self._tables:
            drift = self._table_drift(t)
            if drift == "all":
                if t.on_cpu:
                    t.touched.numpy().fill(True)
                else:
                    t.touched.fill_(True)
                t.nonzero_saved = None
            elif drift == "state":
                nz = nonzero_rows([v for _k, v in self._row_states(t)], t.num_rows, t.touched.device)
                changed = nz if t.nonzero_saved is None else nz | t.nonzero_saved
                t.touched |= changed
                t.nonzero_saved = nz
            else:
                t.nonzero_saved = None

    def _note_restored_state(self) -> None:
        """After a restore: the optimizer state now equals the stored one; remember where it is non-zero."""
        for t in self._tables:
            t.nonzero_saved = None
            if self._table_drift(t) == "state":
                t.nonzero_saved = nonzero_rows([v for _k, v in self._row_states(t)], t.num_rows,
                                                t.touched.device)

    def _remove_hooks(self) -> None:
        for t in self._tables:
            t.remove_hooks()

    def _raise_pending_error(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def _finish_inflight(self) -> None:
        if not self._finish_saves(None):
            return
        self._pending = None

    def _finish_saves(self, timeout: float | None) -> bool:
        """Wait for the save in flight (for good, or ``timeout`` seconds); whether it has ended. An
        interrupt while waiting cancels it (it aborts at its next step: nothing of it commits) and is
        re-raised; the save stays pending until its thread has ended, so that the store is never closed
        under it. (Store.close() and the store's exit hook call this, through its ``WeakPendingWork``.)"""
        p = self._pending
        if p is None:
            return True
        try:
            fs.pause_point("checkpointer_waits_for_save")  # (tests: where a Ctrl-C lands while close waits)
            return p._done.wait(timeout)
        except BaseException:
            p._cancelled = True
            raise

    def _cancel_saves(self) -> None:
        """Tell the save in flight to abort at its next step (an exit that cannot wait for it)."""
        if self._pending is not None:
            self._pending._cancelled = True

    # -- save -----------------------------------------------------------------------------------------
    def save(self, step: int | None = None, meta: dict | None = None, *, top: float | None = None) -> PendingSave:
        """Snapshot the state into host memory and write it in the background; see API.md.

        ``top`` (a fraction in (0, 1], only with ``priority``) makes it a priority save: per table, at most
        ``ceil(top · num_rows)`` of the touched rows, the most updated first (module doc). Waits for the
        save in flight first. A failure of an earlier background write is raised here (once) instead of
        taking a snapshot.

        Once ``save()`` has returned, the save commits even if the process then ends: ``store.close()``,
        ``Checkpointer.close()`` and the interpreter's exit (Ctrl-C, an uncaught exception, ``sys.exit``)
        wait for it; the exit waits at most ``cnrstore.store.EXIT_WAIT_S`` seconds (300, env
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
        self._finish_inflight()
        self._raise_pending_error()
        pack_meta(meta)  # bad arguments fail here, not in the background
        step = validate.step_arg(step)
        for key, v in self._dense.items():  # a dense array the format cannot hold: fail now, not in the background
            if v.nbytes > validate.max_dense_bytes():
                raise InvalidArgument(
                    f"model state {key!r} is {v.nbytes:,} bytes; the Checkpointer stores each parameter or "
                    f"buffer that is not an embedding as one dense array of at most "
                    f"{validate.max_dense_bytes():,} bytes: make it an nn.Embedding (a table, saved by rows) "
                    "or split it into several parameters")
        try:
            return self._snapshot(step, meta, top)
        except BaseException:
            self._force_full = True  # the masks may be half-consumed: the next save writes everything
            raise

    def _snapshot(self, step, meta, top=None) -> PendingSave:
        start = time.perf_counter()
        codec = self._weight_codec()
        priority = top is not None and not self._force_full and bool(self._tables)
        if priority:
            baseline, picks = False, self._pick_priority(top)
        else:
            baseline, picks = self._pick_rows()
        report = SaveReport(step=step, baseline=baseline, priority=priority)
        row_jobs = []  # (table, rows numpy, values tensor, codec)
        existing = self.store.tables()
        with torch.no_grad():
            for t, rows in zip(self._tables, picks):
                n = t.num_rows if rows is None else int(rows.numel())
                buf = t.host_buffer(t.name, n, t.dim)
                self._gather(t.weight, rows, buf)
                rows_np = np.arange(t.num_rows, dtype=np.int64) if rows is None else rows.cpu().numpy()
                if t.offset:
                    rows_np = rows_np + t.offset  # a shard's rows under their global ids
                self._ensure_table(existing, t.name, t.store_rows, t.dim, codec)
                row_jobs.append((t.name, rows_np, buf, codec))
                report.rows[t.name] = n
                for key, state in self._row_states(t):
                    name = f"{t.name}.optim.{key}"
                    width = int(np.prod(state.shape[1:], dtype=np.int64)) if state.dim() > 1 else 1
                    self._ensure_table(existing, name, t.store_rows, width, self.optimizer_codec)
                    s_rows, s_np = rows, rows_np
                    if name not in t.full_written:
                        s_rows, s_np = None, np.arange(t.offset, t.offset + t.num_rows, dtype=np.int64)
                    m = t.num_rows if s_rows is None else int(s_rows.numel())
                    sbuf = t.host_buffer(name, m, width)
                    self._gather(state.reshape(t.num_rows, width), s_rows, sbuf)
                    row_jobs.append((name, s_np, sbuf, None))
                    report.rows[name] = m
            dense = {k: dense_copy(v) for k, v in self._dense.items()}
            blob = self._state_blob()
            if blob.nbytes > validate.max_dense_bytes():  # the optimizers' dense state can outgrow a record
                raise InvalidArgument(
                    f"the optimizer state outside the embedding tables (and extra) pickles to {blob.nbytes:,} "
                    f"bytes, more than one dense array holds ({validate.max_dense_bytes():,}); keep large "
                    "row-wise state on nn.Embedding weights (saved as tables) or split the dense layers")
        for t, rows in zip(self._tables, picks):
            if priority:
                t.settle_priority(rows, keep_since_baseline=self.mode != "incremental")
            else:
                t.clear(t.touched)
                if t.counts is not None:
                    t.clear(t.counts)
            for name, _, _, _ in row_jobs:
                if name.startswith(f"{t.name}.optim."):
                    t.full_written.add(name)
        report.stall_s = time.perf_counter() - start
        pending = PendingSave(report)
        thread = threading.Thread(target=self._write, args=(pending, step, meta, row_jobs, dense, blob),
                                  name=f"cnrstore-save-{step}", daemon=True)
        pending._thread = thread
        self._pending = pending
        thread.start()
        return pending

    def _pick_rows(self):
        """(baseline?, per table: rows tensor to write, or None for all rows). Updates the masks."""
        self._add_drifted_rows()
        if self._force_full or not self._tables:
            baseline = True
        elif self.mode == "incremental":
            return False, [t.rows(t.touched) for t in self._tables]
        else:
            for t in self._tables:
                t.merge_touched()
            count = sum(t.count(t.since_baseline) for t in self._tables)
            baseline = False
            if self.mode == "intermittent":
                s = self._diffs + [count / self._total_rows]
                i = len(s)
                baseline = 1 + sum(s) <= (i + 1) * s[-1]
                if not baseline:
                    self._diffs = s
            if not baseline:
                return False, [t.rows(t.since_baseline) for t in self._tables]
        self._force_full = False
        self._diffs = []
        for t in self._tables:
            t.clear(t.since_baseline)
        return True, [None] * len(self._tables)

    def _pick_priority(self, top: float):
        """Per table, the rows a priority save writes (``Table.top_rows``); changes no mask."""
        picks = []
        for t in self._tables:
            # the epsilon keeps 0.07 * 100 (= 7.000000000000001) at 7 rows
            k = min(t.num_rows, max(1, math.ceil(top * t.num_rows - 1e-6)))
            picks.append(t.top_rows(k))
        return picks

    @staticmethod
    def _gather(src: torch.Tensor, rows, out: torch.Tensor) -> None:
        src = src.detach()
        if src.device.type == "cpu" and src.dtype == torch.float32:
            # numpy: single-threaded copies (see Table.rows); out is a reused host buffer
            if rows is None:
                np.copyto(out.numpy(), src.numpy())
            else:
                np.take(src.numpy(), rows.numpy(), axis=0, out=out.numpy())
        elif rows is None:
            out.copy_(src)
        else:
            out.copy_(src.index_select(0, rows))

    def _state_blob(self) -> np.ndarray:
        """The ``torch.save`` payload: format, mode, tables, dense dtypes, each optimizer's state without its
        row-wise tensors (markers naming their tables instead), ``extra``, and ``param_names``: per
        optimizer, the model's name of each parameter in ``param_groups`` order (None for a parameter
        that is not the model's). Readers must accept payloads without ``param_names`` (older versions)."""
        names = {id(p): name for name, p in self.model.named_parameters()}
        optims = []
        for opt in self._optimizers:
            sd = opt.state_dict()
            params = [p for g in opt.param_groups for p in g["params"]]
            state = {}
            named = getattr(opt, "params", None)  # torchrec's KeyedOptimizer: state keyed by parameter name
            for idx, st in sd["state"].items():
                if isinstance(idx, int):
                    param = params[idx] if 0 <= idx < len(params) else None
                else:
                    param = named.get(idx) if isinstance(named, Mapping) else None
                t = self._by_weight.get(id(param)) if param is not None else None
                row_keys = {k for k, _ in self._row_states(t)} if t is not None else set()
                state[idx] = {k: ({ROW_MARK: f"{t.name}.optim.{k}", "dtype": str(v.dtype).split(".")[-1],
                                   "shape": tuple(v.shape)} if str(k) in row_keys
                                  else {LIVE_MARK: True} if is_sharded_value(v) else v)
                              for k, v in st.items()}
            optims.append({**{k: v for k, v in sd.items() if k != "state"}, "state": state})
        payload = {
            "format": PAYLOAD_FORMAT,
            "mode": self.mode,
            "tables": [t.name for t in self._tables],
            "dense_dtypes": {k: str(v.dtype).split(".")[-1] for k, v in self._dense.items()},
            "optimizers": optims,
            "extra": {k: obj.state_dict() for k, obj in self._extra.items()},
            "param_names": [[names.get(id(p)) for g in opt.param_groups for p in g["params"]]
                            for opt in self._optimizers],
        }
        return _payload.encode(payload)

    def _write(self, pending: PendingSave, step, meta, row_jobs, dense, blob) -> None:
        def check():  # an interrupt cancelled this save while the trainer waited for it: abort, commit nothing
            if pending._cancelled:
                raise KeyboardInterrupt(f"the save of step {step} was cancelled by an interrupt while waiting "
                                        "for it; nothing of it was committed")

        try:
            with self.store.checkpoint(step, meta) as ck:
                for name, rows, values, codec in row_jobs:
                    check()
                    if rows.size:
                        ck.put_rows(name, rows, values.numpy(), codec=codec)
                for key, arr in dense.items():
                    check()
                    ck.put_dense(DENSE_PREFIX + key, arr)
                ck.put_dense(STATE_BLOB, blob)
                check()
            pending._version = ck.version
            pending.report.version = ck.version
        except BaseException as exc:  # re-raised by wait() and the next save()
            if hasattr(exc, "add_note"):
                exc.add_note(f"(cnrstore.torch: the background write of the checkpoint of step {step} failed; "
                             "the next save() re-raises this once, without taking a snapshot, and the one "
                             "after writes a full baseline)")
            pending._error = exc
            self._error, self._failed = exc, pending
            self._force_full = True
        finally:
            pending._done.set()

    # -- restore --------------------------------------------------------------------------------------
    def restore(self, version: int | None = None, *, trust_pickle: bool = False) -> VersionInfo:
        """Load ``version`` (default newest) into the model, optimizers and ``extra`` in place.

        The trainer payload is read as data (``torch.load(weights_only=True)``); a payload whose pickle names
        code (written before payload format 2, or crafted) raises :class:`UnsafePayload` before anything is
        changed, unless ``trust_pickle=True`` (a warning, then a full unpickle: only for a store you wrote).

        Waits for an in-flight save (its failure, if any, is still raised by the next ``save``). A model
        whose shapes differ from the stored ones raises :class:`InvalidArgument`, and so does a version
        holding another number of optimizers than this Checkpointer has -- except a version holding none
        (``cnrstore import`` of model weights only), which leaves the optimizers as they are.
        """
        if self._closed:
            raise InvalidArgument("this Checkpointer is closed")
        self._finish_inflight()
        info = self.store.latest() if version is None else self._version_info(version)
        if info is None:
            raise InvalidArgument("the store holds no version to restore; save() one first")
        v = info.version
        tables = self.store.tables()
        for t in self._tables:
            if isinstance(t, ShardTable):
                continue  # read by rows and column slices, checked there (_read_shard)
            ti = tables.get(t.name)
            if ti is None:
                raise InvalidArgument(f"version {v} has no table {t.name!r} for the model's embedding")
            if (ti.num_rows, ti.dim) != (t.num_rows, t.dim):
                raise InvalidArgument(
                    f"table {t.name!r}: the store has {ti.num_rows} rows x {ti.dim} dims, the model "
                    f"{t.num_rows} x {t.dim}; restore into a model of the stored shape")
        payload = _payload.decode(self.store.read_dense(STATE_BLOB, v), v, trust_pickle=trust_pickle)
        dense = {}
        for key, target in self._dense.items():
            try:
                arr = self.store.read_dense(DENSE_PREFIX + key, v)
            except MissingRows as exc:
                raise InvalidArgument(f"version {v} has no state {key!r} of the model") from exc
            if tuple(arr.shape) != tuple(target.shape):
                raise InvalidArgument(f"state {key!r}: version {v} has shape {tuple(arr.shape)}, the model "
                                      f"{tuple(target.shape)}; restore into a model of the stored shape")
            src = torch.from_numpy(arr.copy())
            if target.dtype == torch.bfloat16:
                src = src.view(torch.bfloat16)
            dense[key] = src
        if payload["optimizers"] and len(payload["optimizers"]) != len(self._optimizers):
            raise InvalidArgument(f"version {v} holds {len(payload['optimizers'])} optimizer(s), this "
                                  f"Checkpointer has {len(self._optimizers)}")
        missing = [k for k in payload["extra"] if k not in self._extra]
        if missing:
            raise InvalidArgument(f"version {v} holds extra state {missing}, which this Checkpointer lacks")
        weights = [torch.from_numpy(self._read_shard(tables, t, "", t.dim, v)) if isinstance(t, ShardTable)
                   else torch.from_numpy(self.store.read_table(t.name, v)) for t in self._tables]
        shard_states = [(state, self._read_shard(tables, t, f".optim.{key}", row_state_width(state), v))
                        for t in self._tables if isinstance(t, ShardTable) for key, state in t.states]
        shard_states = [(state, torch.from_numpy(vals)) for state, vals in shard_states]
        # a version without optimizer state (an import of model weights) leaves the optimizers as they are
        optim_sds = [self._optimizer_state(sd, v) for sd in payload["optimizers"]]
        # everything read and checked: now change the live objects
        self.load_state(weights, shard_states, dense, optim_sds, payload["extra"])
        latest = self.store.latest()
        self.note_restore(matches_newest=latest is not None and latest.version == v)
        return info

    # -- for sibling packages (cnrstore.distributed; docs/ARCHITECTURE.md, "Seams between packages") -----
    def trainer_state(self) -> "TrainerState":
        """*For sibling packages* (``cnrstore.distributed``), not part of the trainer API: the live objects
        this Checkpointer saves and restores (:class:`TrainerState`). The tensors, optimizers and ``extra``
        objects are the model's own; the containers are read-only views."""
        return TrainerState(tuple(self._tables), MappingProxyType(self._dense), tuple(self._optimizers),
                            MappingProxyType(self._extra))

    def load_state(self, weights, shard_states, dense, optimizer_states, extra) -> None:
        """*For sibling packages* (``cnrstore.distributed``'s resharding restore) and ``restore``: put state
        read from a stored version, all of it read and checked already, into the live objects, in place.

        ``weights``: a tensor per table (``trainer_state().tables`` order); ``shard_states``: (row-wise state
        tensor of a ``ShardTable``, its stored values); ``dense``: {state-dict key: tensor} (bfloat16 viewed
        as such); ``optimizer_states``: a state dict per optimizer with its row-wise state filled in (an
        empty list leaves the optimizers as they are); ``extra``: {name: state dict}, loaded in that order.
        Call :meth:`note_restore` after it."""
        create_lazy_state(self._optimizers, optimizer_states)
        with torch.no_grad():
            for t, w in zip(self._tables, weights):
                t.weight.copy_(w)
            for state, w in shard_states:
                state.copy_(w.reshape(state.shape))
            for key, src in dense.items():
                self._dense[key].copy_(src)
        for opt, sd in zip(self._optimizers, optimizer_states):
            opt.load_state_dict(with_live_state(sd, opt))
        for k, state in extra.items():
            self._extra[k].load_state_dict(state)

    def note_restore(self, *, matches_newest: bool = False) -> None:
        """*For sibling packages* (``cnrstore.distributed``) and ``restore``: the live state was just loaded
        from a stored version. Clears the row tracking (touched rows, rows since the baseline, update
        counts), remembers where the optimizer state is non-zero, makes the next save a baseline (unless
        ``matches_newest``, the state is the store's newest version, and the mode is incremental: the next
        increment then follows it) and records the restore with a ``BitWidthPolicy``."""
        for t in self._tables:
            t.touched.zero_()
            t.since_baseline.zero_()
            if t.counts is not None:
                t.counts.zero_()
        self._note_restored_state()
        self._force_full = not (self.mode == "incremental" and matches_newest)
        self._diffs = []
        if self._policy is not None and callable(getattr(self._policy, "record_restore", None)):
            self._policy.record_restore()

    def forget_failure(self) -> None:
        """*For sibling packages* (``cnrstore.distributed``): drop the failure of a background write that the
        next ``save()`` would raise, because the caller has surfaced it itself (the next save is still a
        baseline)."""
        self._error = None

    def _read_shard(self, tables: dict, t: "ShardTable", suffix: str, width: int, v: int) -> np.ndarray:
        """The stored rows of shard ``t`` (its global row range, its columns) of the table ``<fqn><suffix>``
        (suffix "" for the weights, ``".optim.<state>"`` for row-wise state of ``width`` columns) at version
        ``v``, assembled from whichever column slices the saving plan stored (any sharding plan at save)."""
        shard = t.shard
        c0, c1 = shard.col_offset, shard.col_offset + t.dim
        per_column = width == t.dim
        if not per_column:  # row-wise state of a column slice: only the same slice holds it
            c0, c1 = 0, width
        pieces = []
        for name, info in tables.items():
            if suffix and not name.endswith(suffix):
                continue
            base = name[: len(name) - len(suffix)] if suffix else name
            if base == shard.fqn and per_column:
                pieces.append((0, info.dim, name, info))
            elif base == t.name and not per_column:
                pieces.append((0, info.dim, name, info))
            elif per_column:
                parsed = sharded.parse_column_name(base)
                if parsed is not None and parsed[0] == shard.fqn:
                    pieces.append((parsed[1], parsed[2], name, info))
        rows = np.arange(t.offset, t.offset + t.num_rows, dtype=np.int64)
        out = np.empty((t.num_rows, c1 - c0), dtype=np.float32)
        covered = np.zeros(c1 - c0, dtype=bool)
        for a, b, name, info in sorted(pieces):
            lo, hi = max(a, c0), min(b, c1)
            if lo >= hi or covered[lo - c0:hi - c0].all():
                continue
            if info.num_rows != t.store_rows or info.dim != b - a:
                raise InvalidArgument(
                    f"table {name!r}: the store has {info.num_rows} rows x {info.dim} dims, the model's shard of "
                    f"{shard.fqn!r} belongs to a table of {t.store_rows} rows; restore into a model of the stored shape")
            if a == 0 and info.num_rows == t.num_rows and t.offset == 0:
                vals = self.store.read_table(name, v)
            else:
                vals = self.store.read_rows(name, rows, version=v)
            out[:, lo - c0:hi - c0] = vals[:, lo - a:hi - a]
            covered[lo - c0:hi - c0] = True
        if not covered.all():
            what = f"columns {c0}:{c1} of {shard.fqn + suffix!r}" if per_column else f"{t.name + suffix!r}"
            raise InvalidArgument(f"version {v} holds no table with {what} for the model's shard (rows "
                                  f"{t.offset}..{t.offset + t.num_rows - 1}); restore into a model of the stored "
                                  "tables" + ("" if per_column else ", sharded with the same column slices "
                                              "(row-wise optimizer state of a column slice cannot be re-sliced)"))
        return out

    def _version_info(self, version: int) -> VersionInfo:
        for vi in self.store.versions():
            if vi.version == version:
                return vi
        raise VersionNotFound(f"version {version} is not in the store (see store.versions())")

    def _optimizer_state(self, sd: dict, v: int) -> dict:
        state = {}
        for idx, st in sd["state"].items():
            out = {}
            for k, val in st.items():
                if isinstance(val, dict) and ROW_MARK in val:
                    arr = torch.from_numpy(self.store.read_table(val[ROW_MARK], v))
                    if math.prod(val["shape"]) != arr.numel():
                        raise InvalidArgument(f"version {v}: optimizer state {val[ROW_MARK]!r} has {arr.numel()} "
                                              f"values, its payload names shape {tuple(val['shape'])}")
                    val = arr.reshape(val["shape"]).to(_payload.torch_dtype(val["dtype"], v))
                out[k] = val
            state[idx] = out
        return {**sd, "state": state}

    # -- lifecycle ------------------------------------------------------------------------------------
    def close(self) -> None:
        """Wait for the save in flight and remove the tracking hooks. Idempotent. A background failure
        that neither ``wait()`` nor ``save()`` has raised yet is raised here (after closing)."""
        if self._closed:
            return
        self._finish_inflight()
        self._remove_hooks()
        self._closed = True
        if self._error is not None and self._failed is not None and not self._failed._reported:
            err, self._error = self._error, None
            raise err

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
