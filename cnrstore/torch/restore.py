"""Reading a stored version back for ``Checkpointer.restore``: every table, dense array, optimizer state and
``extra`` state the live objects will take, read from the store and checked against them *before* any of
them changes. The one step that writes live objects comes last, after every record it reads is verified:
the whole tables are decoded in parallel straight into the fp32 host weights and the optimizers' existing
row-wise state tensors (``Store.read_tables``); ``Checkpointer.load_state`` then puts the rest in place.

A TorchRec shard (``tracking.ShardTable``) whose columns one stored table holds exactly (restored into the
plan it was saved with) is read in the same ``read_tables`` call, as a row range of that table, straight
into its view of the TBE's weights, and its fused row-wise state into the TBE's state tensors; a shard of
another plan is assembled from whichever column slices the saving plan stored (:func:`read_shard`).
Row-wise optimizer state comes back from the tables its payload's ``ROW_MARK`` markers name.
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
from .optim_state import is_keyed, row_state_width
from . import mc_saves
from .payload import DENSE_PREFIX, ROW_MARK, STATE_BLOB
from .restore_check import Outcome, check_names, check_optimizers, select
from .tracking import ShardTable

__all__ = ["StoredState", "read_shard", "read_version", "version_info"]


class StoredState(NamedTuple):
    """A version's state, read and checked, in ``Checkpointer.load_state``'s argument order: a weight
    tensor per table, (row-wise state tensor of a shard, its stored values), {state-dict key: dense tensor},
    a state dict per stored optimizer (row-wise state filled in), {name: ``extra`` state dict}."""

    weights: list
    shard_states: list
    dense: dict
    optimizer_states: list
    extra: dict


def version_info(store, version: int | None) -> VersionInfo | None:
    """The ``VersionInfo`` of ``version`` (default newest: None for an empty store); VersionNotFound."""
    if version is None:
        return store.latest()
    for vi in store.versions():
        if vi.version == version:
            return vi
    raise VersionNotFound(f"version {version} is not in the store (see store.versions())")


def read_version(store, tables: list, dense: Mapping, optimizers, extra: Mapping, version: int | None, *,
                 trust_pickle: bool = False, only=None, strict: bool = True, param_names: Mapping | None = None,
                 before_decode=None, keyed_names=()) -> tuple[VersionInfo, StoredState, Outcome] | None:
    """Version ``version`` (default newest; None if the store holds none) of ``store`` for a Checkpointer
    whose live objects are ``tables`` (``tracking.Table``s), ``dense`` ({state-dict key: tensor}),
    ``optimizers`` (the optimizers, or how many) and ``extra`` ({name: object}); ``Checkpointer.restore``
    gives the contract, ``only`` and ``strict`` what is loaded (restore_check.py), ``param_names``
    ({id(parameter): its model name}) how optimizer state follows parameters by name with ``strict=False``.
    Raises InvalidArgument when the version does not fit them (a table's or a dense tensor's shape, a table,
    array, optimizer or ``extra`` state it lacks or holds beyond them, another kind of optimizer, other
    parameter groups), UnsafePayload for a pickled payload without ``trust_pickle``, CorruptionError for a
    damaged record: each of them before any live object changes.

    Only its last step changes live objects: ``before_decode()`` (if given) is called once everything is
    checked, then, once every record of every table it reads has been verified (``Store.read_tables``), the
    tables are decoded, in parallel, straight into the live fp32 CPU weights and into the optimizers'
    existing row-wise state tensors of the stored shape and dtype (on a CUDA device: into pinned buffers
    copied into them without blocking, then synchronized; these come back in the ``StoredState`` as the live
    tensors themselves, which ``Checkpointer.load_state`` then leaves as they are); other tables are decoded
    into new tensors (pinned host memory for a CUDA weight) for ``load_state`` to copy. A table not loaded
    comes back as None in ``weights``; an optimizer not loaded as None in ``optimizer_states`` (an empty list:
    none is). ``keyed_names``: the keyed tables of the model's KeyedEmbeddings, which ``only`` may name (the
    caller reads them: ``keyed_save``); their optimizer state comes back as its ``KEYED_MARK`` markers."""
    info = version_info(store, version)
    if info is None:
        return None
    v = info.version
    catalog = store.tables()
    live_opts = optimizers if not isinstance(optimizers, int) else None
    n_opts = optimizers if live_opts is None else len(live_opts)
    payload = _payload.decode(store.read_dense(STATE_BLOB, v), v, trust_pickle=trust_pickle)
    outcome = Outcome()
    if only is not None and not isinstance(only, str):
        try:
            only = list(only)  # (read twice below: a generator once)
        except TypeError:
            pass  # (select() says what to pass)
    sel = select(only, [t.name for t in tables] + list(keyed_names), list(dense), list(extra), bool(n_opts))
    hint = "The model, optimizers or extra objects differ from the ones that saved it. "
    plain = [t for t in tables if not isinstance(t, ShardTable)]
    asked = None if only is None else ({only} if isinstance(only, str) else set(only))  # (select() checked it)
    whole = asked is None or "model" in asked
    if plain and len(plain) == len(tables):  # (a TorchRec plan's shards are named by the plan that saved them)
        stored = set(payload["tables"])
        keep = check_names("table(s)", {t.name for t in plain} & sel.tables, stored if whole else stored & sel.tables,
                           v, strict, outcome, hint)
    else:
        keep = {t.name for t in plain} & sel.tables
    stored_dense = set(payload["dense_dtypes"])
    keep_dense = check_names("dense array(s)", set(dense) & sel.dense, stored_dense if whole else stored_dense & sel.dense,
                             v, strict, outcome, hint)
    whole_extra = asked is None or "extra" in asked
    stored_extra = set(payload["extra"])
    keep_extra = check_names("extra state", set(extra) & sel.extra, stored_extra if whole_extra else stored_extra & sel.extra,
                             v, strict, outcome, hint)
    all_tables = tables
    tables = [t for t in tables if t.name in keep or (isinstance(t, ShardTable) and t.name in sel.tables)]
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
    keyed = mc_saves.restore_groups(store, {k: t for k, t in dense.items() if k in keep_dense}, v)
    read_dense = {key: keyed[key] if key in keyed else _dense(store, key, target, v)
                  for key, target in dense.items() if key in keep_dense}
    stored_opts = payload["optimizers"] or []
    whole_opts = asked is None or "optimizers" in asked
    if sel.optimizers and live_opts is not None:
        optim_sds = check_optimizers(payload, live_opts, param_names or {}, v, strict, outcome)
    else:
        optim_sds = None
        if stored_opts and (whole_opts or sel.optimizers) and len(stored_opts) != n_opts:
            if strict:  # (optimizer state the version holds, and nothing live to take it)
                raise InvalidArgument(f"version {v} holds {len(stored_opts)} optimizer(s), this Checkpointer has "
                                      f"{n_opts}. Nothing was changed; restore with only='model' to load the model "
                                      "alone, or strict=False to leave the optimizer state out")
            outcome.unexpected += [f"optimizer {i}" for i in range(len(stored_opts))]
    # every table read whole, in one read_tables call: {name: live tensor or a new host tensor}
    targets = {t.name: _weight_target(t.weight) for t in tables if not isinstance(t, ShardTable)}
    to_device: list = []  # (live CUDA state tensor, the pinned buffer its table is decoded into)
    row_marks = [None if sd is None else _row_marks(store, catalog, sd, None if live_opts is None else live_opts[i],
                                                    v, targets, to_device)
                 for i, sd in enumerate(optim_sds or [])]
    # a shard (and its row-wise state) that one stored table holds, columns for columns, is read in the same
    # call, as a row range, into its live tensor in the TBE (or a pinned buffer); the others are assembled
    # from column slices now (new arrays, copied in by load_state)
    ranges: dict[str, tuple[int, torch.Tensor]] = {}
    shards = {id(t): _shard_read(store, catalog, t, "", t.dim, t.weight, v, targets, ranges)
              for t in tables if isinstance(t, ShardTable)}
    shard_states = [(state, _shard_read(store, catalog, t, f".optim.{key}", row_state_width(state), state, v, targets,
                                        ranges))
                    for t in tables if isinstance(t, ShardTable) and optim_sds for key, state in t.states]
    if before_decode is not None:
        before_decode({k: payload["extra"][k] for k in keep_extra})
    outs = {name: None if target is None else target.numpy() for name, target in targets.items()}
    outs.update((name, (start, target.numpy())) for name, (start, target) in ranges.items())
    arrays = store.read_tables(outs, v)  # verifies every record, then decodes (in parallel) into the targets
    _copy_to_devices(to_device)
    read = {name: torch.from_numpy(arrays[name]) if target is None else target for name, target in targets.items()}
    loaded = {id(t) for t in tables}
    weights = [None if id(t) not in loaded else
               _live_or(shards[id(t)], t.weight) if isinstance(t, ShardTable) else _live_or(read[t.name], t.weight)
               for t in all_tables]
    shard_states = [(state, _live_or(w, state)) for state, w in shard_states]
    optim_states = [] if optim_sds is None else [None if sd is None else _with_row_state(sd, marks, read, v)
                                                 for sd, marks in zip(optim_sds, row_marks)]
    outcome.restored = sorted({t.name for t in tables}) + sorted(read_dense) + sorted(keep_extra) + [
        f"optimizer {i}" for i, sd in enumerate(optim_states) if sd is not None]
    return info, StoredState(weights, shard_states, read_dense, optim_states, {}), outcome


def _weight_target(weight: torch.Tensor) -> torch.Tensor | None:
    """Where a table read for ``weight`` is decoded: the weight itself (fp32, contiguous, in host memory),
    a pinned host buffer for a CUDA weight (``load_state`` copies it without blocking), else None (a new
    array, copied and cast by ``load_state``)."""
    if weight.dtype != torch.float32 or not weight.is_contiguous():
        return None
    if weight.device.type == "cpu":
        return weight.detach()
    if weight.device.type == "cuda":
        return torch.empty(weight.shape, dtype=torch.float32, pin_memory=True)
    return None


def _live_or(read: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """``live`` when ``read`` is its own memory (decoded in place), else ``read``."""
    return live if read.data_ptr() == live.data_ptr() and read.numel() == live.numel() and read.device == live.device \
        else read


def _shard_read(store, catalog: dict, t: ShardTable, suffix: str, width: int, live: torch.Tensor, v: int,
                targets: dict, ranges: dict) -> torch.Tensor:
    """Where the rows of shard ``t`` of ``<fqn><suffix>`` (``read_shard``'s arguments) for the live tensor
    ``live`` will be: when one stored table holds exactly the shard's columns (of ``width``), a tensor of
    ``live``'s memory (fp32, contiguous, host) or a pinned host buffer (a CUDA ``live``), registered in
    ``ranges`` ({table: (first row, tensor)}) for the caller's ``read_tables`` call to decode into; else
    the rows read now (``read_shard``: column slices assembled into a new array)."""
    name = _stored_range(catalog, t, suffix, width)
    target = None if name is None or name in targets or name in ranges else _weight_target(live)
    if target is None:
        return torch.from_numpy(read_shard(store, catalog, t, suffix, width, v))
    target = target.view(t.num_rows, width)
    ranges[name] = (t.offset, target)
    return target


def _stored_range(catalog: dict, t: ShardTable, suffix: str, width: int) -> str | None:
    """The stored table of ``<fqn><suffix>`` whose columns are exactly shard ``t``'s (``width`` of them) and
    whose rows are the whole table's, or None (``read_shard`` assembles the shard, or says what is amiss)."""
    name = t.name + suffix  # (a column-wise shard's own slice, ``<fqn>[c0:c1]``, or the whole-width table)
    info = catalog.get(name)
    if info is None or info.dim != width or info.num_rows != t.store_rows:
        return None
    return name


def _row_marks(store, catalog: dict, sd: dict, opt, v: int, targets: dict, to_device: list) -> dict:
    """{(state index, key): (table name, live state tensor or None)} for each ``ROW_MARK`` of the stored
    optimizer state dict ``sd``, checked against the stored table; adds each table to ``targets`` (the
    live tensor when ``opt`` holds one of the marker's shape and dtype, fp32, contiguous, for the same
    parameter as the stored state: decoded into in place when it is in host memory; on a CUDA device,
    decoded into a pinned buffer noted in ``to_device`` with the live tensor, for :func:`_copy_to_devices`)."""
    live = _live_states(sd, opt)
    marks = {}
    for idx, st in sd["state"].items():
        for k, val in st.items():
            if not (isinstance(val, dict) and ROW_MARK in val):
                continue
            name = val[ROW_MARK]
            ti = catalog.get(name)
            if ti is not None and math.prod(val["shape"]) != ti.num_rows * ti.dim:
                raise InvalidArgument(f"version {v}: optimizer state {name!r} has {ti.num_rows * ti.dim} "
                                      f"values, its payload names shape {tuple(val['shape'])}")
            target = live.get((idx, k))
            ok = (ti is not None and torch.is_tensor(target) and target.device.type in ("cpu", "cuda")
                  and target.is_contiguous() and target.dtype == torch.float32 == _payload.torch_dtype(val["dtype"], v)
                  and tuple(target.shape) == tuple(val["shape"]) and name not in targets)
            if ok and target.device.type == "cuda":
                pinned = torch.empty((ti.num_rows, ti.dim), dtype=torch.float32, pin_memory=True)
                to_device.append((target.detach().view(ti.num_rows, ti.dim), pinned))
                targets[name] = pinned
            targets.setdefault(name, target.detach().view(ti.num_rows, ti.dim) if ok else None)
            marks[(idx, k)] = (name, target if ok else None)
    return marks


def _copy_to_devices(to_device: list) -> None:
    """Each (live CUDA tensor, pinned host buffer) pair: the buffer copied in without blocking, then one
    synchronization per device, so the live tensors hold their rows when this returns."""
    devices = set()
    with torch.no_grad():
        for live, pinned in to_device:
            live.copy_(pinned, non_blocking=True)
            devices.add(live.device)
    for device in devices:
        torch.cuda.synchronize(device)


def _live_states(sd: dict, opt) -> dict:
    """{(stored state index, key): the live optimizer's state value} for a plain torch optimizer whose
    param groups match ``sd``'s in size (how ``Optimizer.load_state_dict`` pairs them); {} otherwise
    (torchrec's keyed optimizers, no live optimizer, another layout)."""
    if not isinstance(opt, torch.optim.Optimizer) or is_keyed(opt):
        return {}
    saved = [g.get("params", ()) for g in sd.get("param_groups", ())]
    groups = [g["params"] for g in opt.param_groups]
    if len(saved) != len(groups) or any(len(a) != len(b) for a, b in zip(saved, groups)):
        return {}
    live = {}
    for ids, params in zip(saved, groups):
        for idx, p in zip(ids, params):
            for k, value in opt.state.get(p, {}).items():
                live[(idx, k)] = value
    return live


def _with_row_state(sd: dict, marks: dict, read: dict, v: int) -> dict:
    """The stored optimizer state dict ``sd`` with each ``ROW_MARK`` marker replaced by its row-wise
    tensor: the live one it was decoded into, else the table read, reshaped and cast as the marker says."""
    state = {}
    for idx, st in sd["state"].items():
        out = {}
        for k, val in st.items():
            if (idx, k) in marks:
                name, live = marks[(idx, k)]
                if live is not None:
                    val = live  # the optimizer's own tensor, decoded into: load_state_dict keeps it
                else:  # (its size was checked against the stored table by _row_marks, before any read)
                    val = read[name].reshape(val["shape"]).to(_payload.torch_dtype(val["dtype"], v))
            out[k] = val
        state[idx] = out
    return {**sd, "state": state}


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
