"""``KeyedEmbedding``: an embedding addressed by raw int64 ids (a dynamic embedding for plain PyTorch), over a
fixed pool of ``capacity`` slots, admitting unseen ids and evicting old ones; saved by a ``Checkpointer`` into a
keyed table, incrementally and exactly (``keyed_save.py``; API.md, "Keyed embeddings").

State (all of it in ``state_dict()``):

- ``weight`` (Parameter, ``capacity x dim``): the row of the id held by each slot;
- ``slot_ids`` (int64, ``capacity``): the id held by each slot, -1 for a free slot (ids are any int64 >= 0);
- ``last_step`` (int64, ``capacity``): the value of ``step`` at the slot's last lookup (its admission counts);
- ``count`` (int64, ``capacity``): lookups of the slot's id since its admission (duplicates in a batch count);
- ``step`` (int64 scalar): training-mode forward calls so far; ``seed`` (int64 scalar): the init seed.

The id -> slot map is derived from ``slot_ids`` (a sorted id tensor and the slot of each, searched with
``torch.searchsorted``; rebuilt after admissions and on ``load_state_dict``), so it is never state of its own.

**Admission and eviction** (training mode; ``forward`` in eval mode admits nothing and changes nothing: an
unknown id reads as zeros). Each call increments ``step``, then takes the batch's distinct ids that hold no
slot, in ascending id order, and gives them slots: free slots first (lowest slot first), then the slots with
the lowest eviction score among those whose id is not in this batch -- ``"lru"``: the smallest ``last_step``;
``"lfu"``: the smallest ``count``, then the smallest ``last_step``; ties go to the lowest slot. A batch with
more distinct new ids than there are slots not looked up by it raises ``InvalidArgument``. An admitted slot's
row is re-initialized to ``init_std * N(0, 1)`` drawn from a generator seeded by ``(seed, step)`` -- so the
draws depend on the module's state alone and a restored module draws exactly what the original would --, its
``count`` reset to 0, and the row-wise state of each optimizer given to :meth:`bind_optimizer` reset (0;
Adagrad's ``sum`` to its ``initial_accumulator_value``). Then every looked-up slot gets ``last_step = step``
and ``count += `` its lookups in the batch. Everything is vectorized over the batch (``torch.unique``,
``searchsorted``); an admitting batch also sorts the ``capacity`` eviction scores and the live ids once.

The embeddings are ``F.embedding(slots, weight, sparse=sparse)``: any optimizer on ``weight`` works (SGD,
Adagrad, Adam; ``SparseAdam`` with ``sparse=True``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import InvalidArgument
from ..keyed_reshard import owner_of_keys

__all__ = ["EVICTIONS", "KeyedEmbedding"]

EVICTIONS = ("lru", "lfu")
_MIX = 0x9E3779B97F4A7C15 & ((1 << 63) - 1)


class KeyedEmbedding(nn.Module):
    """An embedding over int64 ids with ``capacity`` slots of ``dim`` values (module doc: admission,
    eviction, state). ``partitions``: the keyed table's partitions when a ``Checkpointer`` saves it (None:
    about one per 8,192 slots, at most 1,024)."""

    def __init__(self, capacity: int, dim: int, *, eviction: str = "lru", init_std: float = 0.01, seed: int = 0,
                 sparse: bool = False, partitions: int | None = None, device=None, dtype=torch.float32):
        super().__init__()
        for name, v in (("capacity", capacity), ("dim", dim)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InvalidArgument(f"KeyedEmbedding: {name} must be a positive int, got {v!r}")
        if eviction not in EVICTIONS:
            raise InvalidArgument(f"KeyedEmbedding: eviction must be one of {EVICTIONS}, got {eviction!r}")
        if partitions is not None and (isinstance(partitions, bool) or not isinstance(partitions, int)
                                       or not 1 <= partitions <= 1 << 16):
            raise InvalidArgument(f"KeyedEmbedding: partitions must be None or an int in [1, 65536], got {partitions!r}")
        self.capacity, self.dim, self.eviction = capacity, dim, eviction
        self.init_std, self.sparse = float(init_std), bool(sparse)
        self.partitions = partitions if partitions is not None else min(1024, max(1, -(-capacity // 8192)))
        self.weight = nn.Parameter(torch.zeros(capacity, dim, device=device, dtype=dtype))
        self.register_buffer("slot_ids", torch.full((capacity,), -1, dtype=torch.int64, device=device))
        self.register_buffer("last_step", torch.zeros(capacity, dtype=torch.int64, device=device))
        self.register_buffer("count", torch.zeros(capacity, dtype=torch.int64, device=device))
        self.register_buffer("step", torch.zeros((), dtype=torch.int64, device=device))
        self.register_buffer("seed", torch.tensor(int(seed), dtype=torch.int64, device=device))
        self._bound: list = []  # optimizers whose row-wise state of ``weight`` an admission resets
        self._index = None  # (sorted ids, their slots): derived from slot_ids
        self.register_load_state_dict_post_hook(lambda module, _keys: module.rebuild_index())

    # -- the id -> slot map -------------------------------------------------------------------------
    def rebuild_index(self) -> None:
        """Derive the id -> slot map from ``slot_ids`` (after an admission, a load or an edit of your own)."""
        occupied = (self.slot_ids >= 0).nonzero().squeeze(1)
        ids, order = torch.sort(self.slot_ids[occupied])
        self._index = (ids, occupied[order])

    def lookup(self, ids) -> torch.Tensor:
        """The slot of each id (any shape), -1 where the id holds none; changes nothing."""
        ids = torch.as_tensor(ids, dtype=torch.int64, device=self.slot_ids.device)
        if self._index is None:
            self.rebuild_index()
        sorted_ids, slots = self._index
        flat = ids.reshape(-1)
        if not sorted_ids.numel():
            return torch.full_like(ids, -1)
        pos = torch.searchsorted(sorted_ids, flat).clamp_(max=sorted_ids.numel() - 1)
        hit = sorted_ids[pos] == flat
        return torch.where(hit, slots[pos], torch.full_like(flat, -1)).reshape(ids.shape)

    def ids(self) -> torch.Tensor:
        """The ids that hold a slot, ascending."""
        if self._index is None:
            self.rebuild_index()
        return self._index[0].clone()

    def owner(self, ids, world_size: int) -> torch.Tensor:
        """The rank of ``world_size`` that holds each of ``ids`` (any shape; int64 ranks on ``ids``' device) in a
        multi-rank job: ``cnrstore.keyed_reshard.owner_of_keys`` over this module's ``partitions``. A job whose
        ranks each look up only the ids this gives them can be restored by ``DistributedCheckpointer`` at any
        other world size (docs/API.md, "Keyed embeddings in a multi-rank job")."""
        ids = torch.as_tensor(ids)
        ranks = owner_of_keys(ids.detach().reshape(-1).cpu().to(torch.int64).numpy(), self.partitions, world_size)
        return torch.from_numpy(ranks).reshape(ids.shape).to(ids.device)

    def bind_optimizer(self, optimizer) -> "KeyedEmbedding":
        """Make each admission reset the row-wise state ``optimizer`` keeps for ``weight`` (module doc)."""
        self._bound.append(optimizer)
        return self

    # -- admission ------------------------------------------------------------------------------------
    def _victims(self, k: int, protected: torch.Tensor) -> torch.Tensor:
        """The ``k`` occupied slots not in ``protected`` (bool per slot) with the lowest eviction score."""
        order = torch.argsort(self.last_step, stable=True)  # ties: the lower slot first
        if self.eviction == "lfu":
            order = order[torch.argsort(self.count[order], stable=True)]
        order = order[~protected[order]]
        if order.numel() < k:
            raise InvalidArgument(f"KeyedEmbedding: a batch of {k} new ids more than the {order.numel()} slots it "
                                  f"does not look up (capacity {self.capacity}); raise the capacity")
        return order[:k]

    def _init_rows(self, n: int) -> torch.Tensor:
        g = torch.Generator(device="cpu")
        g.manual_seed((int(self.seed) * _MIX + int(self.step)) & ((1 << 63) - 1))
        rows = torch.randn(n, self.dim, generator=g, dtype=torch.float32) * self.init_std
        return rows.to(self.weight.device, self.weight.dtype)

    def _reset_optimizer_rows(self, slots: torch.Tensor) -> None:
        for opt in self._bound:
            state = opt.state.get(self.weight)
            if not state:
                continue
            fill = 0.0
            if isinstance(opt, torch.optim.Adagrad):
                group = next(g for g in opt.param_groups if any(p is self.weight for p in g["params"]))
                fill = group.get("initial_accumulator_value", 0.0)
            for key, v in state.items():
                if torch.is_tensor(v) and v.dim() >= 1 and v.shape[0] == self.capacity:
                    v[slots.to(v.device)] = fill if key == "sum" else 0.0

    @torch.no_grad()
    def _admit(self, flat: torch.Tensor) -> torch.Tensor:
        """Admit ``flat``'s new ids and update the metadata; the slot of each of ``flat``'s ids."""
        self.step += 1
        uniq, inverse, counts = torch.unique(flat, return_inverse=True, return_counts=True)
        slots = self.lookup(uniq)
        missing = slots < 0
        n_new = int(missing.sum())
        if n_new:
            new_ids = uniq[missing]
            free = (self.slot_ids < 0).nonzero().squeeze(1)[:n_new]
            chosen = free
            if free.numel() < n_new:
                protected = torch.zeros(self.capacity, dtype=torch.bool, device=flat.device)
                protected[slots[~missing]] = True
                protected[free] = True
                chosen = torch.cat([free, self._victims(n_new - free.numel(), protected)])
            self.slot_ids[chosen] = new_ids
            self.weight[chosen] = self._init_rows(n_new)
            self.count[chosen] = 0
            self._reset_optimizer_rows(chosen)
            slots = slots.clone()
            slots[missing] = chosen
            self.rebuild_index()
        self.last_step[slots] = self.step
        self.count[slots] += counts
        return slots[inverse]

    def forward(self, ids) -> torch.Tensor:
        """The embeddings of ``ids`` (int64, any shape): ``ids.shape + (dim,)``. In training mode, admits the new
        ids and updates the metadata first (module doc); in eval mode an unknown id reads as zeros."""
        ids = torch.as_tensor(ids, device=self.slot_ids.device)
        if ids.dtype not in (torch.int64, torch.int32):
            raise InvalidArgument(f"KeyedEmbedding: ids must be int64 (or int32), got {ids.dtype}")
        flat = ids.reshape(-1).to(torch.int64)
        if flat.numel() and int(flat.min()) < 0:
            raise InvalidArgument(f"KeyedEmbedding: ids must be >= 0 (-1 marks a free slot); got {int(flat.min())}")
        if self.training:
            slots = self._admit(flat)
            return F.embedding(slots.reshape(ids.shape), self.weight, sparse=self.sparse)
        slots = self.lookup(flat)
        out = F.embedding(slots.clamp(min=0), self.weight, sparse=self.sparse)
        return (out * (slots >= 0).unsqueeze(1).to(out.dtype)).reshape(*ids.shape, self.dim)

    def extra_repr(self) -> str:
        return f"capacity={self.capacity}, dim={self.dim}, eviction={self.eviction!r}, init_std={self.init_std}"
