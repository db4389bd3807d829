"""TorchRec's sharded embeddings (``DistributedModelParallel``) as cnrstore tables (docs/DESIGN.md, "TorchRec").

A DMP-sharded ``EmbeddingBagCollection`` / ``EmbeddingCollection`` keeps its tables inside FBGEMM's
table-batched embedding (TBE) kernels; the model's ``state_dict()`` names each table by its
fully-qualified name (``"ebc.embedding_bags.t0.weight"``) as a ``ShardedTensor`` whose local shards are
views of the kernel's weights, each with its global row and column offsets. :func:`find_shards` turns every
local shard into a :class:`Shard`:

- its store table is named by the table's FQN without ``.weight`` (``"ebc.embedding_bags.t0"``), with the
  table's *global* row count: a shard writes its rows under their global ids, so the row-wise shards of one
  table in one store make up the whole table, and a shard of another plan reads its rows back by id;
- a column-wise shard (a slice ``[c0, c1)`` of the columns) is a table of its own, named
  ``"<fqn>[c0:c1]"``, of width ``c1 - c0`` (row-wise codecs quantize each stored row, so a column slice is
  quantized on its own);
- its row-wise optimizer state is the fused optimizer's state of that shard (row-wise Adagrad's
  ``momentum1``, Adam's moments, ...), matched to the weight shard by order and row count.

Row tracking: a forward pre-hook on every TBE module (``BaseBatchedEmbedding``/``...Bag``) of the sharded
lookups reads the ids it is given, after the input distribution: they are already local to the shard
(row-wise shards get their rows minus the shard's offset), laid out as the concatenation of each table's
features in the module's config order. Fused TBE optimizers update only the rows of a batch (the backward
kernels visit the batch's unique ids), weight decay included, so the looked-up rows are exactly the rows
that change.

Managed collisions (``ShardedManagedCollisionEmbeddingBagCollection`` / ``...EmbeddingCollection``): the
embedding collection inside is sharded as above; the managed-collision modules' slot buffers (MCH's
``_mch_sorted_raw_ids``, ``_mch_remapped_ids_mapping``, ``_mch_<metadata>``; MPZCH's ``_hash_zch_*``) are
``ShardedTensor`` s of one row per slot (1-D; MPZCH's identities ``(slots, 1)``), one local shard per rank: the
module that rank runs on its own range of slots
(:func:`mc_local_buffers`). They are the rank's state, saved and restored as that rank's own (its store's
managed-collision groups, ``mc_saves``), not rows of a table.

Anything else is refused with :class:`InvalidArgument` saying why: ``DTensor`` state dicts, sharded modules
other than these collections (quantized inference, key-value/SSD kernels), a shard
whose kernel could not be found (its lookups could not be tracked). This module imports torchrec only when
the process already has (a model built from torchrec means it is imported).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from ..errors import InvalidArgument

__all__ = ["Shard", "find_shards", "is_sharded", "is_rank_local", "mc_local_buffers", "column_name", "parse_column_name", "table_of", "join_column_slices"]

#: Sharded modules whose tables this module knows how to find and track (torchrec class names).
_SUPPORTED = ("ShardedEmbeddingBagCollection", "ShardedEmbeddingCollection")
#: Sharded managed-collision modules: their embedding collection is one of the above, their managed-collision
#: buffers are per-rank state (module doc)
_MANAGED = ("ShardedManagedCollisionEmbeddingBagCollection", "ShardedManagedCollisionEmbeddingCollection",
            "ShardedManagedCollisionCollection")
#: The state-dict path of a managed-collision module's buffers
MC_MARK = "._managed_collision_modules."
#: TBE compute kernels whose weights live in memory as one tensor per table and whose optimizer is fused
#: (updates the batch's rows only). The "dense" kernel leaves the update to a regular optimizer, which may
#: move every row (Adam's moments, weight decay): refused rather than saved inexactly.
_KERNELS = ("fused", "fused_uvm", "fused_uvm_caching")


@dataclass
class Shard:
    """One local shard of a sharded table (module doc). ``tensor`` is a ``[rows, cols]`` view of the
    kernel's weights: writes go to the model. ``states`` are its fused optimizer's row-wise state tensors
    (views too), by state name."""

    fqn: str
    tensor: torch.Tensor
    row_offset: int
    col_offset: int
    global_rows: int
    global_cols: int
    states: list = field(default_factory=list)   # [(name, tensor with shape[0] == rows)]

    @property
    def name(self) -> str:
        """The store table: the FQN, or the FQN with the column slice for a column-wise shard."""
        cols = self.tensor.shape[1]
        if self.col_offset == 0 and cols == self.global_cols:
            return self.fqn
        return column_name(self.fqn, self.col_offset, self.col_offset + cols)


def column_name(fqn: str, c0: int, c1: int) -> str:
    return f"{fqn}[{c0}:{c1}]"


def parse_column_name(name: str) -> tuple[str, int, int] | None:
    """``(fqn, c0, c1)`` of a column-slice table name, or None for another name."""
    if not name.endswith("]") or "[" not in name:
        return None
    fqn, _, cols = name[:-1].rpartition("[")
    lo, sep, hi = cols.partition(":")
    if not sep or not lo.isdigit() or not hi.isdigit():
        return None
    return fqn, int(lo), int(hi)


def table_of(name: str) -> str:
    """The table a stored table belongs to: the FQN of a column slice ``<fqn>[c0:c1]``, else ``name``."""
    parsed = parse_column_name(name)
    return name if parsed is None else parsed[0]


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` holds any torchrec sharded module (without importing torchrec)."""
    if "torchrec" not in sys.modules:
        return False
    from torchrec.distributed.types import ShardedModule  # noqa: PLC0415

    return any(isinstance(m, ShardedModule) for m in model.modules())


def _sharded_tensor_type():
    from torch.distributed._shard.sharded_tensor import ShardedTensor  # noqa: PLC0415

    return ShardedTensor


def find_shards(model: nn.Module) -> tuple[list[Shard], set[str], list]:
    """(every local shard of the model's sharded tables, the ``state_dict`` keys they stand for, the TBE
    modules with, for each, the shards its ids feed in key order). Raises InvalidArgument for a model
    cnrstore cannot checkpoint (module doc)."""
    from torchrec.distributed.types import ShardedModule  # noqa: PLC0415

    sharded_tensor = _sharded_tensor_type()
    for path, mod in model.named_modules():
        if isinstance(mod, ShardedModule) and type(mod).__name__ not in _SUPPORTED + _MANAGED:
            raise InvalidArgument(
                f"module {path!r} is a {type(mod).__name__}; cnrstore.torch checkpoints the sharded tables of "
                f"{' and '.join(_SUPPORTED)} only. Checkpoint this model with torch.distributed.checkpoint, "
                "or shard that module as a plain EmbeddingBagCollection / EmbeddingCollection")
    shards: list[Shard] = []
    keys: set[str] = set()
    for key, value in model.state_dict(keep_vars=True).items():
        if type(value).__name__ == "DTensor":
            raise InvalidArgument(
                f"state {key!r} is a DTensor; cnrstore.torch reads sharded tables from torchrec's ShardedTensor "
                "state dicts (its default): unset the option that makes torchrec return DTensors")
        if not isinstance(value, sharded_tensor) or _is_mc_buffer(key, value):
            continue
        if value.dim() != 2 or not key.endswith(".weight"):
            raise InvalidArgument(f"state {key!r} is a ShardedTensor of shape {tuple(value.shape)} that is not an "
                                  "embedding table's weight; cnrstore.torch cannot checkpoint it")
        keys.add(key)
        rows, cols = (int(n) for n in value.shape)
        for local in value.local_shards():
            r0, c0 = (int(n) for n in local.metadata.shard_offsets)
            shards.append(Shard(key[: -len(".weight")], local.tensor, r0, c0, rows, cols))
    if not shards:
        return [], keys, []
    _attach_optimizer_state(model, shards)
    return shards, keys, _tbe_feeds(model, shards)


def _is_mc_buffer(key: str, value) -> bool:
    """Whether state ``key`` (a ShardedTensor) is a sharded managed-collision module's buffer: 1-D (MCH's),
    or an MPZCH buffer of one row per slot (``_hash_zch_identities`` is ``(slots, 1)``)."""
    return MC_MARK in "." + key and (value.dim() == 1 or (value.dim() == 2 and "._hash_zch_" in "." + key))


def is_rank_local(key: str) -> bool:
    """Whether state-dict ``key`` belongs to a managed-collision module: under TorchRec sharding each rank's
    is its own (the ids routed to it, its range of slots), neither replicated nor a table's rows."""
    return MC_MARK in "." + key


def mc_local_buffers(model: nn.Module) -> dict:
    """{state-dict key: this rank's local tensor (the live buffer)} of every managed-collision buffer the
    sharded model's ``state_dict`` holds as a ShardedTensor (module doc); {} for a model without one.
    InvalidArgument for a buffer with other than one local shard."""
    if not is_sharded(model):
        return {}
    sharded_tensor = _sharded_tensor_type()
    out = {}
    for key, value in model.state_dict(keep_vars=True).items():
        if not isinstance(value, sharded_tensor) or not _is_mc_buffer(key, value):
            continue
        locals_ = value.local_shards()
        if len(locals_) != 1:
            raise InvalidArgument(f"managed-collision buffer {key!r} has {len(locals_)} local shards on this rank; "
                                  "cnrstore.torch saves one (torchrec's row-wise managed-collision sharding)")
        out[key] = locals_[0].tensor
    return out


def _tbe_feeds(model: nn.Module, shards: list[Shard]) -> list:
    """[(TBE module, [shard or None per table in its config order], [features per table])]: the modules
    whose forward pre-hook tracks the shards' lookups. Every shard must be fed by exactly one module."""
    by_ptr = {(s.tensor.data_ptr(), tuple(s.tensor.shape)): s for s in shards}
    feeds, fed = [], set()
    for mod in _kernel_modules(model):
        config = getattr(mod, "config", None)
        tables = getattr(config, "embedding_tables", None)
        split = getattr(mod, "split_embedding_weights", None)
        if tables is None or not callable(split) or not hasattr(config, "feature_names"):
            continue
        weights = split()
        if len(weights) != len(tables):
            continue
        per_table = []
        for table, w in zip(tables, weights):
            s = by_ptr.get((w.data_ptr(), tuple(w.shape))) if torch.is_tensor(w) and w.numel() else None
            kernel = getattr(getattr(table, "compute_kernel", None), "value", None)
            if s is not None and kernel is not None and kernel not in _KERNELS:
                raise InvalidArgument(
                    f"table {table.name!r} uses the {kernel!r} compute kernel; cnrstore.torch checkpoints sharded "
                    f"tables with the kernels {', '.join(_KERNELS)} (the planner's default on CPU and GPU), whose "
                    "rows live in one in-memory tensor and whose fused optimizer changes only the rows a batch "
                    "looks up: constrain the planner to them (ParameterConstraints(compute_kernels=['fused']))")
            if s is not None:
                fed.add(id(s))
            per_table.append(s)
        if any(s is not None for s in per_table):
            feeds.append((mod, per_table, [len(t.feature_names) for t in tables]))
    lost = [s for s in shards if id(s) not in fed and s.tensor.numel()]
    if lost:
        raise InvalidArgument(
            f"cnrstore.torch found no TBE kernel holding the shard of {lost[0].fqn!r} (rows {lost[0].row_offset}+, "
            f"columns {lost[0].col_offset}+), so it cannot track which rows training changes; this torchrec "
            "version or kernel is not supported")
    return feeds


def _kernel_modules(model: nn.Module):
    """The modules under the sharded collections' lookups (a sharded module keeps its lookups in a plain
    list, so ``named_modules`` does not reach them), each once."""
    from torchrec.distributed.types import ShardedModule  # noqa: PLC0415

    seen = set()
    for mod in model.modules():
        if not isinstance(mod, ShardedModule):
            continue
        for lookup in getattr(mod, "_lookups", []) or []:
            if not isinstance(lookup, nn.Module):
                continue
            for sub in lookup.modules():
                if id(sub) not in seen:
                    seen.add(id(sub))
                    yield sub


def _attach_optimizer_state(model: nn.Module, shards: list[Shard]) -> None:
    """Give each shard its fused optimizer's row-wise state: DMP's ``fused_optimizer`` (or the sharded
    modules' own), state keyed ``"<fqn>.weight"`` -> ``{"<table>.<state>": ShardedTensor}``."""
    opt = getattr(model, "fused_optimizer", None)
    if opt is None:
        return
    sharded_tensor = _sharded_tensor_type()
    state = opt.state_dict().get("state", {})
    by_fqn: dict[str, list[Shard]] = {}
    for s in shards:
        by_fqn.setdefault(s.fqn, []).append(s)
    for fqn, mine in by_fqn.items():
        entries = state.get(f"{fqn}.weight", {})
        for key, value in sorted(entries.items()):
            if not isinstance(value, sharded_tensor):
                continue
            locals_ = value.local_shards()
            if len(locals_) != len(mine):
                raise InvalidArgument(f"the fused optimizer's state {key!r} of {fqn!r} has {len(locals_)} local "
                                      f"shard(s), the table {len(mine)}; cnrstore.torch cannot pair them")
            name = key.rsplit(".", 1)[-1]
            for s, local in zip(mine, locals_):
                t = local.tensor
                if t.dim() == 0 or t.shape[0] != s.tensor.shape[0]:
                    raise InvalidArgument(
                        f"the fused optimizer's state {key!r} of {fqn!r} has a local shard of shape "
                        f"{tuple(t.shape)} for a weight shard of {tuple(s.tensor.shape)}: not row-wise state "
                        "cnrstore.torch can save by rows")
                s.states.append((name, t))


def join_column_slices(tables: dict) -> dict:
    """``{table name: array}`` with column slices joined: TorchRec's column-wise shards are stored as
    ``<fqn>[c0:c1]`` tables; the unsharded model has one ``<fqn>`` table, the slices side by side (only when
    they cover its columns from 0 without a gap), and likewise their element-wise optimizer state
    (``<fqn>[c0:c1].optim.<k>`` of the slice's width). Row-wise state of a slice (one value per row of each
    slice) has no joined form and is left out."""
    out, slices = {}, {}
    for name, arr in tables.items():
        base, sep, state = name.partition(".optim.")
        parsed = parse_column_name(base)
        if parsed is None:
            out[name] = arr
            continue
        fqn, c0, c1 = parsed
        slices.setdefault(fqn + (sep + state if sep else ""), []).append((c0, c1, arr))
    for name, parts in slices.items():
        parts.sort(key=lambda p: p[0])
        widths_match = all(a.shape[1] == c1 - c0 for c0, c1, a in parts)
        contiguous = parts[0][0] == 0 and all(p[1] == q[0] for p, q in zip(parts, parts[1:]))
        if widths_match and contiguous:
            out[name] = np.concatenate([a for _c0, _c1, a in parts], axis=1)
    return out
