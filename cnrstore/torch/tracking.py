"""The embedding tables of a ``cnrstore.torch.Checkpointer`` and what it keeps for each between saves.

A :class:`Table` is one embedding weight: the fingerprints of its rows, and of its row-wise optimizer state,
as of the last save (``saved``: ``fingerprint.py``; a save writes the rows whose fingerprint changed since),
the rows changed since the last baseline (``since_baseline``, one bit per row: ``rowbits.RowBits``; never
allocated in incremental mode), per-row update counts for priority saves (``counts``, ``"mfu"`` exact or
``"ssu"`` sampled, counted from the lookups: a forward pre-hook on the embedding module,
:meth:`Table.track_module`, or, for the local shards of a TorchRec-sharded table (:class:`ShardTable`), a
hook on the TBE kernel, :func:`tbe_tracker`), the saves being written from its live tensors (``streams``)
and reusable host buffers. The Checkpointer's module doc says how they become the rows of a save.
"""

from __future__ import annotations

import random

import numpy as np
import torch
from torch import nn

from .rowbits import RowBits

__all__ = ["SSU_SEED", "ShardTable", "Table", "tbe_tracker"]

#: Seed of a table's SSU sampling streams: + the table's index, so each table's stream is reproducible.
SSU_SEED = 0x5C5_0000


class Table:
    """One embedding module: its table, what the last save left (row fingerprints), tracking masks, update
    counts (priority saves) and reusable host buffers.

    ``counts`` (int32 per row, on the weight's device, or None without ``priority``) holds the lookups
    since the row was last saved, all of them (``"mfu"``) or a sample (``"ssu"``); ``count_scale`` turns
    a count into an estimate of the exact one (1, or ``1 / ssu_rate``)."""

    def __init__(self, path: str, module: nn.Module | None, priority: str | None = None, ssu_rate: float = 1.0,
                 seed: int = SSU_SEED, weight: torch.Tensor | None = None):
        self.path = path
        self.name = path or "embedding"
        self.module = module
        self.weight: torch.Tensor = module.weight if weight is None else weight
        self.num_rows, self.dim = self.weight.shape
        self.device = self.weight.device
        self.since_baseline = RowBits(self.num_rows, self.device)
        self.on_cpu = self.weight.device.type == "cpu"
        self.counts: torch.Tensor | None = None
        self.count_scale = 1.0
        self.ssu_rate: float | None = None
        if priority is not None:
            self.counts = torch.zeros(self.num_rows, dtype=torch.int32, device=self.weight.device)
            self._ones = torch.ones(0, dtype=torch.int32, device=self.weight.device)
        if priority == "ssu":
            self.ssu_rate = float(ssu_rate)
            self.count_scale = 1.0 / self.ssu_rate
            # private streams, so the training RNG is untouched: positions from a torch.Generator, the
            # sample size's rounding from a random.Random (a Python float: no tensor op in the hook)
            self.generator = torch.Generator().manual_seed(seed)
            self._rounding = random.Random(seed)
        self.buffers: dict[str, torch.Tensor] = {}  # host buffers by table name, reused across saves
        self.busy: set[str] = set()  # the names whose buffer a queued snapshot holds
        self.full_written: set[str] = set()  # row-state tables written in full in this session
        self.offset = 0                 # global id of local row 0 (a sharded table's shard: its row offset)
        self.store_rows = self.num_rows  # rows of the store table (a shard's table has the global count)
        #: the fingerprint of each row (weight and row-wise state together, ``fingerprint.py``) as of the last
        #: save's snapshot; None before the first save (a baseline)
        self.saved = None
        #: saves of this table being written from the live tensors (``streamed.StreamedTable``): until
        #: each has ended, whatever changes a row of it must preserve the row first (``guard.StepGuard``)
        self.streams: list = []
        self.in_step = 0  # optimizer steps holding this weight in progress while a save streams (guard.py)
        self.refused = False  # a streamed save of it was refused (unseen writes): it is copied at save() now
        self.hooks = []
        if module is not None and priority is not None:
            self.track_module(module)

    def track_module(self, module: nn.Module) -> None:
        """Count the lookups of ``module`` (an embedding module using this table's weight; a weight shared
        by several modules is one table counted through each of them): priority saves only."""
        if self.counts is not None:
            self.hooks.append(module.register_forward_pre_hook(self.track, with_kwargs=True))

    def remove_hooks(self) -> None:
        """Stop tracking: remove every hook this table put on a module."""
        for h in self.hooks:
            h.remove()
        self.hooks = []

    def track(self, module, args, kwargs) -> None:
        if torch.is_grad_enabled():
            self.note(args[0] if args else kwargs["input"])

    def note(self, ids: torch.Tensor) -> None:
        """Count a lookup of the local rows ``ids`` (any shape, duplicates allowed)."""
        if self.counts is not None:
            self._count(ids.reshape(-1))

    def open_streams(self) -> list:
        """The saves of this table still being written from its live tensors (those that ended are
        forgotten)."""
        if self.streams:
            self.streams = [s for s in self.streams if not s.closed]
        return self.streams

    def _count(self, ids: torch.Tensor) -> None:
        """Add one per id (duplicates too), or per id of a random sample of ``ssu_rate · len(ids)`` ids
        drawn with replacement (the sample size rounded stochastically, so the estimate stays unbiased)."""
        if self.ssu_rate is not None:
            expected = self.ssu_rate * ids.numel()
            k = int(expected)
            if self._rounding.random() < expected - k:
                k += 1
            if k == 0:
                return
            pos = torch.randint(ids.numel(), (k,), generator=self.generator)
            ids = ids.index_select(0, pos if self.on_cpu else pos.to(ids.device, non_blocking=True))
        n = ids.numel()
        if self._ones.numel() < n:
            self._ones = torch.ones(max(n, 2 * self._ones.numel()), dtype=torch.int32, device=self._ones.device)
        self.counts.index_add_(0, ids, self._ones[:n])

    def host(self, t: torch.Tensor) -> np.ndarray:
        """``t`` as numpy: a view on CPU (writes go through), a copy otherwise."""
        return t.numpy() if self.on_cpu else t.cpu().numpy()

    def top_rows(self, changed: torch.Tensor, k: int) -> torch.Tensor:
        """The rows of ``changed`` (ascending, on the weight's device) with the highest counts, at most ``k``,
        ties to the lower row id; ascending, on the weight's device."""
        rows = self.host(changed)
        if rows.size > k:
            rows = _top_rows(rows, self.host(self.counts)[rows], k)
        out = torch.from_numpy(rows)
        return out if self.on_cpu else out.to(self.weight.device)

    def settle_priority(self, rows: torch.Tensor, keep_since_baseline: bool) -> None:
        """After a priority save wrote ``rows``: clear their count; record them as changed since the
        baseline if ``keep_since_baseline`` (one-shot and intermittent modes)."""
        if self.on_cpu:  # (numpy on CPU: single-threaded, no intra-op pool to wake for microseconds of work)
            self.counts.numpy()[rows.numpy()] = 0
        else:
            self.counts[rows] = 0
        if keep_since_baseline:
            self.since_baseline.set(rows)

    @staticmethod
    def clear(counts: torch.Tensor) -> None:
        """Zero a count tensor."""
        if counts.device.type == "cpu":
            counts.numpy().fill(0)
        else:
            counts.zero_()

    def take_buffer(self, table: str, n: int, width: int, alloc=None) -> tuple[torch.Tensor, bool]:
        """A host buffer of ``n`` x ``width`` float32 for a snapshot of ``table`` (this table or one of its
        row-wise state tables), and whether it is the reusable one: that one is lent to one snapshot at a
        time (until :meth:`release_buffer`), grows only, and is kept across saves; a snapshot taken while it
        is lent gets a buffer of its own. ``alloc(shape)`` makes a buffer (default ``torch.empty``; a CUDA
        table's snapshots use page-locked ones, ``staging.Staging.host_empty``)."""
        if alloc is None:
            alloc = _host_empty
        if table in self.busy:
            return alloc((n, width)), False
        buf = self.buffers.get(table)
        if buf is None or buf.shape[0] < n or buf.shape[1] != width:
            buf = alloc((max(n, 1), width))
            self.buffers[table] = buf
        self.busy.add(table)
        return buf[:n], True

    def release_buffer(self, table: str) -> None:
        """The snapshot that took the reusable buffer of ``table`` is written: it may be lent again."""
        self.busy.discard(table)


class ShardTable(Table):
    """One local shard of a TorchRec-sharded table (``sharded.Shard``): no module of its own (its lookups
    are tracked by a hook on the TBE kernel), rows written under their global ids, its row-wise optimizer
    state the fused optimizer's."""

    def __init__(self, shard, priority: str | None, ssu_rate: float, seed: int):
        super().__init__(shard.name, None, priority, ssu_rate, seed, weight=shard.tensor)
        self.shard = shard
        self.offset = shard.row_offset
        self.store_rows = shard.global_rows
        self.states = sorted(shard.states, key=lambda kv: kv[0])


def tbe_tracker(tables: list, features: list):
    """A forward pre-hook for a TBE kernel whose ids feed ``tables`` (a ShardTable or None per config table,
    ``features[i]`` keys each): counts the ids of table i, the values of its keys, in key order (priority
    saves)."""
    bounds = np.cumsum([0] + list(features)).tolist()

    def track(module, args, kwargs) -> None:
        if not torch.is_grad_enabled():
            return
        kjt = args[0] if args else kwargs.get("features")
        if kjt is None or not hasattr(kjt, "length_per_key"):
            return
        per_key = kjt.length_per_key()
        ends = np.cumsum([0] + list(per_key)).tolist()
        values = kjt.values()
        for t, lo, hi in zip(tables, bounds[:-1], bounds[1:]):
            if t is not None and ends[hi] > ends[lo]:
                t.note(values[ends[lo]:ends[hi]].to(t.device))

    return track



def _host_empty(shape) -> torch.Tensor:
    return torch.empty(shape, dtype=torch.float32)


def _top_rows(rows: np.ndarray, counts: np.ndarray, k: int) -> np.ndarray:
    """The ``k`` entries of ``rows`` (ascending) with the highest ``counts``, ties to the lower row;
    ascending. Linear time: a partition finds the k-th highest count, the ties at it fill up in row order."""
    threshold = np.partition(counts, rows.size - k)[rows.size - k]
    above = rows[counts > threshold]
    at = rows[counts == threshold][: k - above.size]
    return np.union1d(above, at)

