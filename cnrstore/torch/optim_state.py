"""Optimizer state as ``cnrstore.torch`` sees it: which rows an optimizer changes without a lookup (drift),
where its row-wise state is non-zero, and the state a restore must create or keep live.

Drift: a regular save adds to the looked-up rows those the optimizers may have changed without a lookup,
judged per table from the optimizers holding its weight, with the hyper-parameters of the weight's param
group at save time (:func:`table_drift`; the Checkpointer's module doc lists which optimizer does what):
None (only looked-up rows change), ``"state"`` (rows whose row-wise state is non-zero change:
:func:`nonzero_rows` finds them) or ``"all"``. ``cnrstore.distributed.ecrm`` judges its parity updates the
same way.

Restore: :func:`create_lazy_state` makes the state torchrec's keyed optimizers create lazily, and
:func:`with_live_state` keeps a fused optimizer's sharded state (restored through the shard tables, in
place) when a payload's optimizer state is loaded.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from ..errors import InvalidArgument
from .payload import LIVE_MARK, is_sharded_value  # (is_sharded_value: importable from here too)

__all__ = ["as_optimizer_list", "create_lazy_state", "holds_weight", "is_keyed", "is_sharded_value", "nonzero_rows",
           "row_state_width", "row_states", "table_drift", "with_live_state"]


def row_state_width(state: torch.Tensor) -> int:
    """Columns of the table holding row-wise ``state`` (trailing dimensions flattened, at least 1)."""
    return int(np.prod(state.shape[1:], dtype=np.int64)) if state.dim() > 1 else 1


def with_live_state(sd: dict, opt) -> dict:
    """``sd`` with each ``LIVE_MARK`` replaced by the optimizer's own current value: sharded state (a fused
    optimizer's ``ShardedTensor``) is restored through the shard tables, in place, before this is loaded."""
    marked = any(isinstance(v, dict) and LIVE_MARK in v for st in sd["state"].values() for v in st.values())
    live = {idx: {k: v for k, v in st.items() if is_sharded_value(v)}
            for idx, st in opt.state_dict()["state"].items()} if marked or is_keyed(opt) else {}
    if not marked and not any(live.values()):
        return sd
    state = {idx: {k: v for k, v in st.items() if not (isinstance(v, dict) and LIVE_MARK in v)}
             for idx, st in sd["state"].items()}
    for idx, st in live.items():     # this rank's sharded state, whichever rank's payload the rest came from
        if st:
            state.setdefault(idx, {}).update(st)
    return {**sd, "state": state}


def create_lazy_state(optimizers, state_dicts) -> None:
    """torchrec's KeyedOptimizer loads into existing state only: create the state an optimizer makes lazily
    (Adam's) by its own zero-gradient ``init_state()`` step -- before a restore puts the weights back."""
    for opt, sd in zip(optimizers, state_dicts):
        if callable(getattr(opt, "init_state", None)) and len(opt.state_dict()["state"]) < len(sd["state"]):
            opt.init_state()


def is_keyed(opt) -> bool:
    """Whether ``opt`` keys its state by parameter name (torchrec's ``KeyedOptimizer``)."""
    return isinstance(getattr(opt, "params", None), Mapping)


#: Optimizers that change a row without a lookup exactly while its row-wise state is non-zero.
_STATE_DRIFT = tuple(getattr(torch.optim, n) for n in (
    "Adam", "AdamW", "NAdam", "RAdam", "Adamax", "RMSprop", "Adadelta", "Rprop") if hasattr(torch.optim, n))
_DRIFT_ORDER = {None: 0, "state": 1, "all": 2}
#: Elements scanned per chunk when looking for non-zero optimizer state (bounds the temporary memory).
_SCAN_ELEMENTS = 1 << 24


def _drift(opt: torch.optim.Optimizer, group: dict) -> str | None:
    """Which rows ``opt`` may change without a lookup, for a weight in param group ``group``: None (none),
    "state" (those with non-zero row-wise state) or "all" (this module's doc)."""
    if group.get("weight_decay"):
        return "all"
    if isinstance(opt, torch.optim.SGD):
        return "state" if group.get("momentum") else None
    if isinstance(opt, (torch.optim.Adagrad, torch.optim.SparseAdam)):
        return None
    if isinstance(opt, _STATE_DRIFT):
        return "state"
    return "all"


def _leaf_optimizers(opt):
    """The torch optimizers doing the work inside torchrec's wrappers (``KeyedOptimizerWrapper`` holds one
    as ``_optimizer``, ``CombinedOptimizer`` lists ``(key, optimizer)`` pairs as ``optimizers``), else ``opt``."""
    inner = getattr(opt, "_optimizer", None)
    if isinstance(inner, torch.optim.Optimizer) and inner is not opt:
        yield from _leaf_optimizers(inner)
        return
    subs = getattr(opt, "optimizers", None)
    if isinstance(subs, list) and subs and all(isinstance(x, tuple) and len(x) == 2 for x in subs):
        for _key, sub in subs:
            yield from _leaf_optimizers(sub)
        return
    yield opt


def table_drift(optimizers, weight) -> str | None:
    """The widest drift (None, ``"state"`` or ``"all"``: see ``_drift``) of the ``optimizers`` holding
    ``weight``, judged with the hyper-parameters of its param group now (also used by
    ``cnrstore.distributed.ecrm``). Optimizers wrapped by torchrec (``KeyedOptimizerWrapper``,
    ``CombinedOptimizer``) are judged by what they wrap."""
    worst = None
    for opt in (leaf for o in optimizers for leaf in _leaf_optimizers(o)):
        for group in opt.param_groups:
            if any(p is weight for p in group["params"]):
                d = _drift(opt, group)
                if _DRIFT_ORDER[d] > _DRIFT_ORDER[worst]:
                    worst = d
    return worst


def holds_weight(optimizers, weight) -> bool:
    """Whether a ``torch.optim.Optimizer`` among ``optimizers`` (torchrec's wrappers looked through) holds
    ``weight`` in one of its param groups."""
    return any(isinstance(opt, torch.optim.Optimizer) and any(p is weight for g in opt.param_groups for p in g["params"])
               for o in optimizers for opt in _leaf_optimizers(o))


def nonzero_rows(states: list, num_rows: int, device) -> torch.Tensor:
    """Bool per row: any element of any of ``states`` (each ``(num_rows, ...)``) has non-zero bits (so -0.0
    and NaN count as non-zero). Vectorized, in chunks of about ``_SCAN_ELEMENTS`` elements."""
    nz = torch.zeros(num_rows, dtype=torch.bool, device=device)
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    for state in states:
        flat = state.detach().reshape(num_rows, -1)
        if flat.is_floating_point() and flat.element_size() in ints:
            flat = flat.view(ints[flat.element_size()])
        chunk = max(1, _SCAN_ELEMENTS // max(1, flat.shape[1]))
        for start in range(0, num_rows, chunk):
            part = flat[start:start + chunk]
            nz[start:start + chunk] |= (part != 0).any(dim=1).to(nz.device)
    return nz



def as_optimizer_list(optimizer) -> list:
    if optimizer is None:
        return []
    if isinstance(optimizer, torch.optim.Optimizer):
        return [optimizer]
    opts = list(optimizer)
    for o in opts:
        if not isinstance(o, torch.optim.Optimizer):
            raise InvalidArgument(f"optimizer must be an Optimizer, a list of them or None; got {type(o).__name__}")
    return opts



def row_states(optimizers, weight: torch.Tensor, num_rows: int):
    """(state name, tensor) of the row-wise optimizer state of ``weight`` (a state tensor of the
    ``optimizers`` whose leading dimension is ``num_rows``), in a stable order."""
    for opt in optimizers:
        state = opt.state.get(weight)
        if not state:
            continue
        for key in sorted(state, key=str):
            v = state[key]
            if torch.is_tensor(v) and v.dim() >= 1 and v.shape[0] == num_rows:
                yield str(key), v
