"""Reading a stored version back for ``Checkpointer.restore``: every table, dense array, optimizer state and
``extra`` state the live objects will take, read from the store and checked against them *before* any of
them changes (``Checkpointer.load_state`` then puts it in place).

A TorchRec shard (``tracking.ShardTable``) is assembled from whichever column slices the saving plan
stored (:func:`read_shard`); row-wise optimizer state comes back from the tables its payload's
``ROW_MARK`` markers name (:func:`optimizer_state`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import NamedTuple

import numpy as np
import torch

from . import payload as _payload
from . import sharded
from ..errors import InvalidArgument, MissingRows, VersionNotFound
from ..types import VersionInfo
from .optim_state import row_state_width
from .payload import DENSE_PREFIX, ROW_MARK, STATE_BLOB
from .tracking import ShardTable

__all__ = ["StoredState", "optimizer_state", "read_shard", "read_version", "version_info"]


class StoredState(NamedTuple):
    """A version's state, read and checked, in ``Checkpointer.load_state``'s argument order: a weight
    tensor per table, (row-wise state tensor of a shard, its stored values), {state-dict key: dense tensor},
    a state dict per stored optimizer (row-wise state filled in), {name: ``extra`` state dict}."""

    weights: list
    shard_states: list
    dense: dict
    optimizer_states: list
    extra: dict


def version_info(store, version: int | None) -> VersionInfo:
    """The ``VersionInfo`` of ``version`` (default newest); VersionNotFound, or InvalidArgument for an
    empty store."""
    if version is None:
        info = store.latest()
        if info is None:
            raise InvalidArgument("the store holds no version to restore; save() one first")
        return info
    for vi in store.versions():
        if vi.version == version:
            return vi
    raise VersionNotFound(f"version {version} is not in the store (see store.versions())")


def read_version(store, tables: list, dense: Mapping, optimizers: int, extra: Mapping, version: int | None, *,
                 trust_pickle: bool = False) -> tuple[VersionInfo, StoredState]:
    """Version ``version`` (default newest) of ``store`` for a Checkpointer whose live objects are
    ``tables`` (``tracking.Table``s), ``dense`` ({state-dict key: tensor}), ``optimizers`` (how many) and
    ``extra`` ({name: object}); ``Checkpointer.restore`` gives the contract. Raises InvalidArgument when the
    version does not fit them (a table's or a dense tensor's shape, a table or state it lacks, another
    number of optimizers unless it holds none, ``extra`` state this Checkpointer lacks), UnsafePayload
    for a pickled payload without ``trust_pickle``; changes nothing."""
    info = version_info(store, version)
    v = info.version
    catalog = store.tables()
    for t in tables:
        if isinstance(t, ShardTable):
            continue  # read by rows and column slices, checked there (read_shard)
        ti = catalog.get(t.name)
        if ti is None:
            raise InvalidArgument(f"version {v} has no table {t.name!r} for the model's embedding")
        if (ti.num_rows, ti.dim) != (t.num_rows, t.dim):
            raise InvalidArgument(
                f"table {t.name!r}: the store has {ti.num_rows} rows x {ti.dim} dims, the model "
                f"{t.num_rows} x {t.dim}; restore into a model of the stored shape")
    payload = _payload.decode(store.read_dense(STATE_BLOB, v), v, trust_pickle=trust_pickle)
    stored_dense = {key: _dense(store, key, target, v) for key, target in dense.items()}
    if payload["optimizers"] and len(payload["optimizers"]) != optimizers:
        raise InvalidArgument(f"version {v} holds {len(payload['optimizers'])} optimizer(s), this "
                              f"Checkpointer has {optimizers}")
    missing = [k for k in payload["extra"] if k not in extra]
    if missing:
        raise InvalidArgument(f"version {v} holds extra state {missing}, which this Checkpointer lacks")
    weights = [torch.from_numpy(read_shard(store, catalog, t, "", t.dim, v)) if isinstance(t, ShardTable)
               else torch.from_numpy(store.read_table(t.name, v)) for t in tables]
    shard_states = [(state, torch.from_numpy(read_shard(store, catalog, t, f".optim.{key}", row_state_width(state), v)))
                    for t in tables if isinstance(t, ShardTable) for key, state in t.states]
    # a version without optimizer state (an import of model weights) leaves the optimizers as they are
    optim_sds = [optimizer_state(store, sd, v) for sd in payload["optimizers"]]
    return info, StoredState(weights, shard_states, stored_dense, optim_sds, payload["extra"])


def _dense(store, key: str, target: torch.Tensor, v: int) -> torch.Tensor:
    """The stored ``DENSE_PREFIX`` array of ``key`` as a tensor for ``target`` (bfloat16 viewed as such)."""
    try:
        arr = store.read_dense(DENSE_PREFIX + key, v)
    except MissingRows as exc:
        raise InvalidArgument(f"version {v} has no state {key!r} of the model") from exc
    if tuple(arr.shape) != tuple(target.shape):
        raise InvalidArgument(f"state {key!r}: version {v} has shape {tuple(arr.shape)}, the model "
                              f"{tuple(target.shape)}; restore into a model of the stored shape")
    src = torch.from_numpy(arr.copy())
    return src.view(torch.bfloat16) if target.dtype == torch.bfloat16 else src


def read_shard(store, catalog: dict, t: ShardTable, suffix: str, width: int, v: int) -> np.ndarray:
    """The stored rows of shard ``t`` (its global row range, its columns) of the table ``<fqn><suffix>``
    (suffix "" for the weights, ``".optim.<state>"`` for row-wise state of ``width`` columns) at version
    ``v``, assembled from whichever column slices the saving plan stored (any sharding plan at save);
    ``catalog`` is ``store.tables()``."""
    shard = t.shard
    c0, c1 = shard.col_offset, shard.col_offset + t.dim
    per_column = width == t.dim
    if not per_column:  # row-wise state of a column slice: only the same slice holds it
        c0, c1 = 0, width
    pieces = []
    for name, info in catalog.items():
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
            vals = store.read_table(name, v)
        else:
            vals = store.read_rows(name, rows, version=v)
        out[:, lo - c0:hi - c0] = vals[:, lo - a:hi - a]
        covered[lo - c0:hi - c0] = True
    if not covered.all():
        what = f"columns {c0}:{c1} of {shard.fqn + suffix!r}" if per_column else f"{t.name + suffix!r}"
        raise InvalidArgument(f"version {v} holds no table with {what} for the model's shard (rows "
                              f"{t.offset}..{t.offset + t.num_rows - 1}); restore into a model of the stored "
                              "tables" + ("" if per_column else ", sharded with the same column slices "
                                          "(row-wise optimizer state of a column slice cannot be re-sliced)"))
    return out


def optimizer_state(store, sd: dict, v: int) -> dict:
    """The stored optimizer state dict ``sd`` of version ``v`` with each ``ROW_MARK`` marker replaced by the
    row-wise tensor read from the table it names (its shape and dtype as the marker says)."""
    state = {}
    for idx, st in sd["state"].items():
        out = {}
        for k, val in st.items():
            if isinstance(val, dict) and ROW_MARK in val:
                arr = torch.from_numpy(store.read_table(val[ROW_MARK], v))
                if math.prod(val["shape"]) != arr.numel():
                    raise InvalidArgument(f"version {v}: optimizer state {val[ROW_MARK]!r} has {arr.numel()} "
                                          f"values, its payload names shape {tuple(val['shape'])}")
                val = arr.reshape(val["shape"]).to(_payload.torch_dtype(val["dtype"], v))
            out[k] = val
        state[idx] = out
    return {**sd, "state": state}
