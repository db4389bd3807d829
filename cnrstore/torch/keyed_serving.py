"""A serving model's ``KeyedEmbedding`` as a ``Follower`` target (cnrstore.serving; issue 50).

A model given to ``Follower`` whose ``KeyedEmbedding`` at module path ``p`` was saved by a ``Checkpointer`` (the
keyed table ``p``: key the id, value its row, columns ``slot``, ``last_step``, ``count``) is followed through
``KeyedModuleCopy``: each update puts every id it reports in the slot the training module held it in (the
stored ``slot`` column), with its row and metadata, and frees the slot of every evicted id (id -1, zero row and
metadata), so the serving module's ``lookup`` never finds an evicted id and no evicted vector stays in a slot
that ``forward`` reads. A full sync replaces everything. The module's ``step`` and ``seed`` are followed as dense
arrays, like any buffer; its optimizer tables (``p.optim.*``) are not served.

Planning (outside the serving lock) checks that the stored slots fit the module (``capacity``, ``dim``);
``commit`` (under the exclusive side of the lock, or before anything is served) writes in place and rebuilds the
module's id map. Vectorized: one ``lookup`` of the ids touched, scatters, one sort of the live ids.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from ..errors import InvalidArgument
from .keyed_embedding import KeyedEmbedding

__all__ = ["KeyedModuleCopy"]


class _Plan(NamedTuple):
    full: bool              # a full sync: free every slot first
    put: torch.Tensor       # ids put (int64)
    slots: torch.Tensor     # their slots
    values: torch.Tensor    # their rows
    last_step: torch.Tensor
    count: torch.Tensor
    deleted: torch.Tensor   # ids evicted


class KeyedModuleCopy:
    """The ``Follower``'s copy of keyed table ``name`` in a serving model's ``KeyedEmbedding`` ``module``
    (module doc)."""

    def __init__(self, name: str, module: KeyedEmbedding):
        self.name, self.module = name, module

    def bind(self, lock) -> None:
        """(A model is served under ``Follower.serving()`` by its caller: nothing to bind.)"""

    def _plan(self, full: bool, keys, values, columns, deleted) -> _Plan:
        m = self.module
        missing = [c for c in ("slot", "last_step", "count") if c not in columns]
        if missing:
            raise InvalidArgument(f"keyed table {self.name!r} has no column {missing[0]!r}: it was not saved from a "
                                  "KeyedEmbedding, so the model's cannot follow it")
        values = np.asarray(values, np.float32).reshape(keys.size, -1) if keys.size else np.zeros((0, m.dim),
                                                                                                     np.float32)
        if values.shape[1] != m.dim:
            raise InvalidArgument(f"keyed table {self.name!r} has rows of {values.shape[1]} values, the model's "
                                  f"KeyedEmbedding {m.dim}: follow with the model that was saved")
        slots = np.asarray(columns["slot"], np.int64).reshape(-1)
        if slots.size and (slots.min() < 0 or slots.max() >= m.capacity):
            raise InvalidArgument(f"keyed table {self.name!r} holds slots up to {int(slots.max())}, the model's "
                                  f"KeyedEmbedding has capacity {m.capacity}: follow with the model that was saved")
        dev = m.weight.device

        def t(a, dtype=torch.int64):
            return torch.from_numpy(np.ascontiguousarray(a)).to(dev, dtype)

        return _Plan(full, t(keys), t(slots), t(values, m.weight.dtype), t(np.asarray(columns["last_step"]).reshape(-1)),
                     t(np.asarray(columns["count"]).reshape(-1)), t(deleted))

    def plan_replace(self, keys: np.ndarray, values: np.ndarray, columns: dict, dim: int, spec) -> _Plan:
        """A full sync: exactly ``keys`` (their rows and columns), every other slot free."""
        return self._plan(True, keys, values, columns, np.zeros(0, np.int64))

    def plan_update(self, put: np.ndarray, values: np.ndarray, columns: dict, deleted: np.ndarray) -> _Plan:
        """``put`` ids into their slots, ``deleted`` ids out of theirs."""
        return self._plan(False, put, values, columns, deleted)

    @torch.no_grad()
    def commit(self, plan: _Plan) -> None:
        m = self.module
        if plan.full:
            freed = torch.arange(m.capacity, device=m.weight.device)
        else:  # the slots the evicted ids, and the ids put (which may have moved), hold now
            held = m.lookup(torch.cat([plan.deleted, plan.put]))
            freed = held[held >= 0]
        for buf in (m.weight, m.last_step, m.count):
            buf[freed] = 0
        m.slot_ids[freed] = -1
        m.weight[plan.slots] = plan.values
        m.slot_ids[plan.slots] = plan.put
        m.last_step[plan.slots] = plan.last_step
        m.count[plan.slots] = plan.count
        m.rebuild_index()
