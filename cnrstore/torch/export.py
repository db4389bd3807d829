"""A version written by ``cnrstore.torch.Checkpointer`` as PyTorch objects, and the writers of the torch-based
export formats (``cnrstore/export.py`` decides what to write; this module builds and writes it: it registers
itself there as the ``"torch"`` exporter on import).

:class:`CheckpointView` reads the Checkpointer's layout back (see ``checkpointer``'s module doc): the
``"torch.state"`` blob lists the embedding tables and the dense state's dtypes; each table ``t`` is the
weight ``"<t>.weight"`` (the table name is the module path; ``"embedding"`` is a model that *is* an
embedding, key ``"weight"``, recognized from the optimizers' parameter names or given by ``model=``);
``"torch.model/<key>"`` arrays are every other state-dict entry, bfloat16 as its raw 16 bits.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import warnings

import numpy as np
import torch
from torch import nn

from ..errors import InvalidArgument
from ..export import register
from ..types import Snapshot
from . import payload as _payload
from . import sharded
from .payload import DENSE_PREFIX, ROW_MARK, STATE_BLOB

__all__ = ["CheckpointView", "load_payload", "save", "write"]


def load_payload(blob, version, *, trust_pickle: bool = False) -> dict:
    """The Checkpointer's state payload from the uint8 array ``blob`` of ``version``, read as data
    (``cnrstore.torch.payload.decode``: ``weights_only=True``; UnsafePayload for a pickle naming code unless
    ``trust_pickle``; InvalidArgument for an array that is no payload)."""
    return _payload.decode(blob, version, trust_pickle=trust_pickle)


def _tensor(arr: np.ndarray) -> torch.Tensor:
    """A tensor owning a copy of ``arr`` (store arrays may be read-only views)."""
    return torch.from_numpy(np.array(arr, copy=True, order="C"))


def embedding_tables(model: nn.Module) -> dict[str, list]:
    """The Checkpointer's tables of ``model``: {table name: [state-dict keys of its weight]}, in module
    order; a weight shared by several modules is one table (named by its first module), with every key."""
    sd = model.state_dict(keep_vars=True)
    out: dict[str, list] = {}
    seen = set()
    for path, module in model.named_modules():
        if not isinstance(module, (nn.Embedding, nn.EmbeddingBag)) or id(module.weight) in seen:
            continue
        seen.add(id(module.weight))
        out[path or "embedding"] = [k for k, v in sd.items() if v is module.weight]
    return out


class CheckpointView:
    """A version in the Checkpointer's layout, read as a model state dict, optimizer state dicts and
    the rest; see the module doc. Raises InvalidArgument if ``snapshot`` is not in that layout or does not
    match ``model`` (when given)."""

    def __init__(self, snapshot: Snapshot, *, model: nn.Module | None = None, trust_pickle: bool = False):
        blob = snapshot.dense.get(STATE_BLOB)
        if blob is None:
            raise InvalidArgument(f"version {snapshot.version} was not written by cnrstore.torch.Checkpointer "
                                  f"(no {STATE_BLOB!r} array); export it with layout 'nested'")
        self.payload = load_payload(blob, snapshot.version, trust_pickle=trust_pickle)
        if any(sharded.parse_column_name(n) for n in self.payload["tables"]):   # TorchRec column-wise shards
            snapshot = dataclasses.replace(snapshot, tables=sharded.join_column_slices(snapshot.tables))
            self.payload = {**self.payload, "tables": sorted({sharded.table_of(n) for n in self.payload["tables"]})}
        self.snapshot = snapshot
        self.model = model
        self.dense_dtypes: dict[str, str] = dict(self.payload["dense_dtypes"])
        self.tables = self._tables()  # table name -> [state-dict keys]
        self._weight_dtype: dict[str, torch.dtype] = {}
        if model is not None:
            self._check_model(model)

    # -- keys -----------------------------------------------------------------------------------------
    def _tables(self) -> dict[str, list]:
        names = {n for per_opt in self.payload.get("param_names") or [] for n in per_opt if n}
        out = {}
        for name in self.payload["tables"]:
            bare = name == "embedding" and "weight" in names and "embedding.weight" not in names
            out[name] = ["weight" if bare else f"{name}.weight"]
        return out

    def _check_model(self, model: nn.Module) -> None:
        if not isinstance(model, nn.Module):
            raise InvalidArgument(f"model must be a torch.nn.Module, got {type(model).__name__}")
        tables = embedding_tables(model)
        if set(tables) != set(self.tables):
            raise InvalidArgument(f"the model's embeddings {sorted(tables)} are not version "
                                  f"{self.snapshot.version}'s tables {sorted(self.tables)}; pass the model "
                                  "that was checkpointed")
        sd = model.state_dict()
        aliased = {k for keys in tables.values() for k in keys}
        dense = [k for k in sd if k not in aliased]
        if set(dense) != set(self.dense_dtypes):
            missing, extra = sorted(set(dense) - set(self.dense_dtypes)), sorted(set(self.dense_dtypes) - set(dense))
            raise InvalidArgument(f"version {self.snapshot.version} does not hold the model's state: missing "
                                  f"{missing[:5]}, unexpected {extra[:5]}; pass the model that was checkpointed")
        v = self.snapshot.version
        for name, keys in tables.items():
            self._weight_dtype[name] = sd[keys[0]].dtype
            arr = self.snapshot.tables.get(name)
            if arr is not None and tuple(arr.shape) != tuple(sd[keys[0]].shape):
                raise InvalidArgument(f"table {name!r} is {arr.shape[0]} x {arr.shape[1]} in version {v}, the "
                                      f"model's {tuple(sd[keys[0]].shape)}; pass the model that was checkpointed")
        for key in dense:
            arr = self.snapshot.dense.get(DENSE_PREFIX + key)
            if arr is not None and tuple(arr.shape) != tuple(sd[key].shape):
                raise InvalidArgument(f"{key!r} has shape {tuple(arr.shape)} in version {v}, the model's "
                                      f"{tuple(sd[key].shape)}; pass the model that was checkpointed")
        self.tables = tables
        self._order = list(sd)

    @property
    def merged(self) -> bool:
        """True for the merged snapshot of a multi-rank root (``cnrstore.distributed.export``): the model
        only, no optimizer state."""
        return bool(self.payload.get("merged"))

    def table_key_count(self) -> int:
        return sum(len(keys) for keys in self.tables.values())

    # -- the model ------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state dict: embedding weights from the tables (fp32, or the model's dtype when a
        model was given), every other entry exactly as saved. Tensors own their memory (none shared)."""
        out: dict[str, torch.Tensor] = {}
        v = self.snapshot.version
        for name, keys in self.tables.items():
            arr = self.snapshot.tables.get(name)
            if arr is None:
                raise InvalidArgument(f"version {v} has no rows of table {name!r}, which its state blob lists")
            t = _tensor(arr)
            if name in self._weight_dtype:
                t = t.to(self._weight_dtype[name])
            for i, key in enumerate(keys):
                out[key] = t if i == 0 else t.clone()
        for key, dtype in self.dense_dtypes.items():
            arr = self.snapshot.dense.get(DENSE_PREFIX + key)
            if arr is None:
                raise InvalidArgument(f"version {v} has no array {DENSE_PREFIX + key!r}, which its state blob lists")
            t = _tensor(arr)
            if dtype == "bfloat16":
                t = t.view(torch.bfloat16)
            out[key] = t
        if self.model is not None:
            out = {k: out[k] for k in self._order}
        return out

    def optimizer_state_dicts(self) -> list[dict]:
        """Each optimizer's ``state_dict()`` as the Checkpointer saved it, row-wise state read back from its
        tables (in the dtype and shape it had)."""
        out = []
        for sd in self.payload.get("optimizers", []):
            state = {}
            for idx, st in sd["state"].items():
                entry = {}
                for k, val in st.items():
                    if isinstance(val, dict) and ROW_MARK in val:
                        arr = self.snapshot.tables.get(val[ROW_MARK])
                        if arr is None:
                            raise InvalidArgument(f"version {self.snapshot.version} has no table "
                                                  f"{val[ROW_MARK]!r} of optimizer state")
                        val = _tensor(arr).reshape(val["shape"]).to(_payload.torch_dtype(val["dtype"], self.snapshot.version))
                    entry[k] = val
                state[idx] = entry
            out.append({"state": state, "param_groups": sd["param_groups"]})
        return out

    def checkpoint_dict(self, state_dict: dict | None = None) -> dict:
        """``{"model", "optimizers", "param_names", "embedding_tables", "extra", "version", "step", "meta"}``
        (cnrstore/export.py, layout ``"checkpoint"``): ``param_names`` is, per optimizer, the model's name of
        each parameter in ``param_groups`` order, and ``embedding_tables`` the table names -- what
        ``cnrstore import`` needs to put the optimizers' row-wise state back into its tables (absent
        ``param_names``: a version written before the Checkpointer recorded them). InvalidArgument for a
        merged multi-rank snapshot (no optimizer state to hold)."""
        if self.merged:
            raise InvalidArgument("a multi-rank root's merged export holds the model only (each rank's optimizer "
                                  "state is its own); choose layout state_dict or nested, or export one rank's "
                                  "store with layout checkpoint")
        return {"model": self.state_dict() if state_dict is None else state_dict,
                "optimizers": self.optimizer_state_dicts(), **self._names(),
                "extra": dict(self.payload.get("extra") or {}),
                "version": self.snapshot.version, "step": self.snapshot.step, "meta": self.snapshot.meta}

    def _names(self) -> dict:
        out = {"embedding_tables": list(self.tables)}
        names = self.payload.get("param_names")
        if names is not None or not self.payload.get("optimizers"):
            out["param_names"] = [list(per) for per in names or []]
        return out

    def meta_json(self) -> str:
        return json.dumps(self.snapshot.meta, default=str)

    @staticmethod
    def numpy_compatible(t: torch.Tensor) -> bool:
        try:
            torch.empty(0, dtype=t.dtype).numpy()
        except TypeError:
            return False
        return True


# -- writers ----------------------------------------------------------------------------------------------
def _tensors(obj):
    """``obj`` with every numpy array made a tensor (nested dicts)."""
    if isinstance(obj, np.ndarray):
        return _tensor(obj)
    if isinstance(obj, dict):
        return {k: _tensors(v) for k, v in obj.items()}
    return obj


def write(data, fmt: str, layout: str, path: str, metadata: dict[str, str]) -> None:
    """Write ``data`` (a state dict, a checkpoint dict or the nested dict; numpy arrays allowed) to
    ``path`` as ``fmt``: ``torch.save``; safetensors (flat tensors, ``metadata`` in its header); or a
    ``torch.distributed.checkpoint`` directory written by this process alone (no process group needed)."""
    data = _tensors(data)
    if fmt == "torch":
        torch.save(data, path)
    elif fmt == "safetensors":
        try:
            from safetensors.torch import save_file
        except ImportError as exc:
            raise InvalidArgument("export to safetensors needs the safetensors package: "
                                  "pip install 'cnrstore[export]'") from exc
        save_file(data, path, metadata=metadata)
    elif fmt == "dcp":
        import torch.distributed.checkpoint as dcp

        os.mkdir(path)
        with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
            warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
            dcp.save(data, storage_writer=dcp.FileSystemWriter(path, sync_files=True), no_dist=True)
    else:
        raise InvalidArgument(f"format {fmt!r} is not written by cnrstore.torch.export")


def save(snapshot: Snapshot, path) -> None:
    """Save every table (fp32 tensors) and dense array of ``snapshot`` to ``path`` (a path or a binary file
    object) with ``torch.save``: ``{"version", "step", "meta", "tables": {...}, "dense": {...}}`` (the
    nested layout)."""
    torch.save(
        {
            "version": snapshot.version,
            "step": snapshot.step,
            "meta": snapshot.meta,
            "tables": {name: _tensor(arr) for name, arr in snapshot.tables.items()},
            "dense": {name: _tensor(arr) for name, arr in snapshot.dense.items()},
        },
        path,
    )


register("torch", sys.modules[__name__])   # cnrstore.export's "torch" exporter (its TorchExporter)
