"""Seed a new store from a PyTorch checkpoint, in ``cnrstore.torch.Checkpointer``'s layout.

    report = import_checkpoint("ckpt", "model.pt", model=model, codec="fp32", codecs={"emb.0": "int4"})
    Checkpointer(cnrstore.open("ckpt"), model, optimizer).restore()    # then train, saving increments

The source is a ``torch.save`` file, a safetensors file or a ``torch.distributed.checkpoint`` (DCP)
directory holding a model's ``state_dict()`` -- or a dict ``{"model": <state dict>, ...}`` (or
``"state_dict"``), as trainers and ``cnrstore export --layout checkpoint`` write -- or a state dict in
memory. The import writes one version, a baseline, exactly as a Checkpointer's save would:

- each embedding weight becomes a table named by its module path (``"emb.0.weight"`` -> ``"emb.0"``;
  a top-level ``"weight"`` -> ``"embedding"``), every row written, as float32 values encoded with the
  table's codec: ``codecs[name]`` if given, else ``codec`` (default ``"fp32"``: an import is lossless
  unless asked; later saves use the Checkpointer's own codec);
- every other tensor becomes the dense array ``"torch.model/<key>"``, stored exactly (bfloat16 as its raw
  bits); with ``model=`` a tensor whose dtype differs from the model's is cast to it first, as
  ``load_state_dict`` would;
- the ``"torch.state"`` blob lists the tables and dtypes and holds the state of ``optimizer=`` (the
  optimizers the trainer will restore into; their row-wise state, if any, becomes ``"<table>.optim.<k>"``
  tables in ``optimizer_codec``, as the Checkpointer writes them). ``Checkpointer.restore`` requires as
  many optimizers in the store as the Checkpointer has: import without ``optimizer=`` restores into a
  Checkpointer without optimizer only.

Which tensors are embedding weights:

- with ``model=``: exactly the weights of its ``nn.Embedding`` / ``nn.EmbeddingBag`` modules (as the
  Checkpointer sees them); the source must hold exactly the model's state dict (missing or unexpected
  keys, or a shape that differs, raise InvalidArgument, as ``load_state_dict(strict=True)`` would);
- without a model, with ``tables=``: the keys matching any of the glob patterns (``fnmatch``, e.g.
  ``"emb.*.weight"``); each must be a 2-D floating tensor keyed ``"<path>.weight"`` or ``"weight"``, and
  each pattern must match something;
- otherwise (``tables=None``): every 2-D floating tensor keyed ``"<path>.weight"`` whose module path has a
  part containing ``"emb"`` (``emb_l.0``, ``embedding_bags.t_cat_0``, ``sparse.embeddings.3``), or that
  has at least ``min_rows`` rows (default ``DEFAULT_MIN_ROWS``). This guesses; an ``nn.Linear`` named like an
  embedding or a tiny embedding named otherwise is misfiled, and ``Checkpointer.restore`` then reports the
  missing state. Pass ``model=`` (exact) or ``tables=`` when that matters.

The store must hold no version yet (an import is its first version); a store the call created is removed
again if the import fails. Every failure is a typed error: InvalidArgument (a source that cannot be read or
does not fit, with what to fix), the store's own errors (StorageFull, StoreLocked, ...).
"""

from __future__ import annotations

import fnmatch
import io
import os
import shutil
import struct
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from .. import codecs as _codecs
from .. import store as _store
from ..errors import InvalidArgument
from .checkpointer import _FORMAT, _ROW_MARK, DENSE_PREFIX, STATE_BLOB, _as_list, _host_copy
from .export import embedding_tables

__all__ = ["DEFAULT_MIN_ROWS", "SOURCE_FORMATS", "ImportReport", "import_checkpoint", "parse_table_codecs",
           "read_state_dict", "select_tables"]

from ..export import DEFAULT_MIN_ROWS, SOURCE_FORMATS  # noqa: E402  (torch-free: the CLI's options read them)
#: Elements converted to float32 and written per put_rows call (bounds the import's extra memory).
_CHUNK_ELEMENTS = 1 << 24


@dataclass(frozen=True)
class ImportReport:
    """What an import wrote: ``version`` (the store's first) at ``step``; ``tables`` maps each embedding
    table to ``(source key, num_rows, dim, codec)``; ``dense`` lists the state-dict keys stored as dense
    arrays; ``optimizer_tables`` the row-wise optimizer state tables; ``source_format`` is one of
    SOURCE_FORMATS or ``"state_dict"`` (a dict in memory)."""

    version: int
    step: int | None
    source_format: str
    tables: dict[str, tuple[str, int, int, str]] = field(default_factory=dict)
    dense: tuple[str, ...] = ()
    optimizer_tables: tuple[str, ...] = ()


def parse_table_codecs(items) -> dict[str, str]:
    """``["emb.0=int8", "emb.1=fp32"]`` (the CLI's ``--table-codec NAME=CODEC``) as ``{"emb.0": "int8", ...}``;
    InvalidArgument for an item without ``=``, an empty name, a table named twice or an unknown codec."""
    out: dict[str, str] = {}
    for item in items or ():
        name, sep, codec = str(item).rpartition("=")
        if not sep or not name or not codec:
            raise InvalidArgument(f"--table-codec takes NAME=CODEC (e.g. emb.0=int8), got {item!r}")
        if name in out:
            raise InvalidArgument(f"table {name!r} is given a codec twice")
        _codecs.get(codec)
        out[name] = codec
    return out


# -- reading a source -------------------------------------------------------------------------------------
def detect_format(path: str) -> str:
    """``"dcp"`` for a directory holding DCP's ``.metadata``, ``"safetensors"`` for a file opening with a
    safetensors header, ``"torch"`` otherwise."""
    if os.path.isdir(path):
        if os.path.exists(os.path.join(path, ".metadata")):
            return "dcp"
        raise InvalidArgument(f"{path!r} is a directory but not a torch.distributed.checkpoint (no .metadata); "
                              "name a DCP directory, a torch.save file or a safetensors file")
    try:
        with open(path, "rb") as f:
            head = f.read(9)
            size = os.fstat(f.fileno()).st_size
    except FileNotFoundError:
        raise InvalidArgument(f"checkpoint to import {path!r} does not exist; check the path") from None
    except OSError as exc:
        raise InvalidArgument(f"cannot read the checkpoint to import {path!r} ({exc})") from exc
    if len(head) == 9 and head[8:9] == b"{" and 0 < struct.unpack("<Q", head[:8])[0] <= size - 8:
        return "safetensors"
    return "torch"


def _unwrap(obj, where: str) -> dict:
    """The model state dict in a loaded checkpoint: the object itself, or its ``"model"`` /
    ``"state_dict"`` entry."""
    if isinstance(obj, Mapping):
        if obj and all(isinstance(k, str) and k.startswith(("tables/", "dense/")) for k in obj):
            raise InvalidArgument(f"{where} is a nested cnrstore export (tables/ and dense/ arrays of a key-value "
                                  "store), not a model state dict; import takes what model.state_dict() returns")
        if obj and all(torch.is_tensor(v) for v in obj.values()):
            return dict(obj)
        for key in ("model", "state_dict"):
            inner = obj.get(key)
            if isinstance(inner, Mapping) and inner and all(torch.is_tensor(v) for v in inner.values()):
                return dict(inner)
        if "tables" in obj and "dense" in obj:
            raise InvalidArgument(f"{where} is a nested cnrstore export (tables/dense of a key-value store), not a "
                                  "model state dict; import takes what model.state_dict() returns")
        odd = [k for k, v in obj.items() if not torch.is_tensor(v)][:3]
        raise InvalidArgument(f"{where} is not a model state dict: entries {odd} are not tensors (and it has no "
                              "'model' or 'state_dict' entry holding one); save model.state_dict()")
    raise InvalidArgument(f"{where} holds a {type(obj).__name__}, not a model state dict; save model.state_dict()")


def read_state_dict(source, format: str | None = None) -> tuple[dict[str, torch.Tensor], str]:
    """``(state dict, format)`` of ``source``: a path (``format`` None: detected) or a state dict.

    A torch file is read with ``torch.load(weights_only=True)``: tensors and plain containers only, never
    arbitrary pickled objects."""
    if isinstance(source, Mapping):
        return _unwrap(source, "the state dict given"), "state_dict"
    try:
        path = os.fspath(source)
    except TypeError:
        raise InvalidArgument(f"source must be a path or a state dict, got {type(source).__name__}") from None
    fmt = detect_format(path) if format is None else format
    if fmt not in SOURCE_FORMATS:
        raise InvalidArgument(f"unknown source format {fmt!r}; choose one of {', '.join(SOURCE_FORMATS)}")
    try:
        if fmt == "torch":
            try:  # mapped, not read: a large checkpoint is not held twice while it is written
                obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as exc:
                if "mmap" not in str(exc):  # the legacy (non-zip) format cannot be mapped
                    raise
                obj = torch.load(path, map_location="cpu", weights_only=True)
        elif fmt == "safetensors":
            from safetensors.torch import load_file

            obj = load_file(path)
        else:
            from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
                obj = _load_state_dict_from_keys(checkpoint_id=path)
    except InvalidArgument:
        raise
    except FileNotFoundError:
        raise InvalidArgument(f"checkpoint to import {path!r} does not exist; check the path") from None
    except ImportError as exc:
        raise InvalidArgument(f"reading {fmt} needs {exc.name or 'a missing package'}: pip install it") from exc
    except Exception as exc:  # noqa: BLE001 - every reader has its own error types
        hint = (" (read with weights_only=True: re-save it as a plain state dict of tensors)"
                if fmt == "torch" else "")
        raise InvalidArgument(f"cannot read {path!r} as a {fmt} checkpoint: {type(exc).__name__}: {exc}{hint}") \
            from exc
    return _unwrap(obj, f"{path!r}"), fmt


# -- choosing tables --------------------------------------------------------------------------------------
def _table_name(key: str) -> str:
    return "embedding" if key == "weight" else key[: -len(".weight")]


def _is_weight_key(key: str) -> bool:
    return key == "weight" or key.endswith(".weight")


def _embedding_like(t: torch.Tensor) -> bool:
    return t.dim() == 2 and t.is_floating_point() and t.shape[0] > 0 and t.shape[1] > 0


def select_tables(state_dict: Mapping, *, model: nn.Module | None = None, tables=None,
                  min_rows: int = DEFAULT_MIN_ROWS) -> dict[str, list[str]]:
    """Which entries of ``state_dict`` are embedding tables (module doc): ``{table name: [keys]}``; the first
    key is the one read, the others (a weight shared by several modules, ``model=`` only) are the same
    tensor under other names. Raises InvalidArgument when the choice is impossible."""
    if model is not None:
        if not isinstance(model, nn.Module):
            raise InvalidArgument(f"model must be a torch.nn.Module, got {type(model).__name__}")
        sd = model.state_dict()
        missing = sorted(set(sd) - set(state_dict))
        unexpected = sorted(set(state_dict) - set(sd))
        out = {}
        for name, keys in embedding_tables(model).items():
            present = [k for k in keys if k in state_dict]
            if present:
                missing = [k for k in missing if k not in keys]  # one key of a shared weight suffices
                out[name] = present + [k for k in keys if k not in present]
        if missing or unexpected:
            raise InvalidArgument(f"the checkpoint does not hold the model's state: missing keys {missing[:5]}, "
                                  f"unexpected keys {unexpected[:5]}; pass the model it was saved from")
        for key, want in sd.items():
            if key in state_dict and tuple(state_dict[key].shape) != tuple(want.shape):
                raise InvalidArgument(f"{key!r} has shape {tuple(state_dict[key].shape)} in the checkpoint, "
                                      f"{tuple(want.shape)} in the model; pass the model it was saved from")
        for name, keys in out.items():
            if not state_dict[keys[0]].is_floating_point():
                raise InvalidArgument(f"embedding {name!r}: {keys[0]!r} has dtype {state_dict[keys[0]].dtype}; "
                                      "an embedding weight is floating point")
        return out
    if tables is not None:
        patterns = [tables] if isinstance(tables, str) else list(tables)
        chosen = []
        for pattern in patterns:
            hits = [k for k in state_dict if fnmatch.fnmatchcase(k, pattern)]
            if not hits:
                raise InvalidArgument(f"table pattern {pattern!r} matches no key of the checkpoint (keys: "
                                      f"{sorted(state_dict)[:8]}...)")
            chosen += [k for k in hits if k not in chosen]
        for key in chosen:
            if not _is_weight_key(key) or not _embedding_like(state_dict[key]):
                raise InvalidArgument(f"{key!r} (shape {tuple(state_dict[key].shape)}, {state_dict[key].dtype}) "
                                      "cannot be an embedding table: a table is a 2-D floating tensor keyed "
                                      "'<module path>.weight'; narrow the pattern")
    else:
        if isinstance(min_rows, bool) or not isinstance(min_rows, int) or min_rows < 1:
            raise InvalidArgument(f"min_rows must be a positive integer, got {min_rows!r}")
        chosen = [k for k, t in state_dict.items()
                  if _is_weight_key(k) and _embedding_like(t)
                  and (any("emb" in part.lower() for part in k.split(".")[:-1]) or t.shape[0] >= min_rows)]
    out = {}
    for key in chosen:
        name = _table_name(key)
        if name in out:
            raise InvalidArgument(f"keys {out[name][0]!r} and {key!r} would both be table {name!r}; pass tables= "
                                  "to choose one")
        out[name] = [key]
    return out


# -- writing ----------------------------------------------------------------------------------------------
def _numpy_dtype(dtype: torch.dtype) -> bool:
    try:
        torch.empty(0, dtype=dtype).numpy()
    except TypeError:
        return False
    return True


def _put_table(ck, name: str, t: torch.Tensor, codec: str, block_rows: int) -> None:
    """All rows of ``t`` as table ``name``, float32, in block-aligned chunks (one record per block)."""
    n, dim = t.shape
    step = max(block_rows, (_CHUNK_ELEMENTS // max(dim, 1)) // block_rows * block_rows)
    src = t.detach().reshape(n, dim)
    for start in range(0, n, step):
        part = src[start:start + step].to("cpu", torch.float32).contiguous()
        ck.put_rows(name, np.arange(start, start + part.shape[0], dtype=np.int64), part.numpy(), codec=codec)


def _optimizer_payload(optimizers, model: nn.Module, table_of: dict[int, str]):
    """(payload entries, param names, row-state tensors by table) for ``optimizers`` as the Checkpointer's
    state blob holds them (see ``Checkpointer._state_blob``)."""
    names = {id(p): n for n, p in model.named_parameters()}
    optims, row_tables = [], {}
    for opt in optimizers:
        sd = opt.state_dict()
        params = [p for g in opt.param_groups for p in g["params"]]
        state = {}
        for idx, st in sd["state"].items():
            p = params[idx] if idx < len(params) else None
            table = table_of.get(id(p)) if p is not None else None
            entry = {}
            for k, v in st.items():
                if table is not None and torch.is_tensor(v) and v.dim() >= 1 and v.shape[0] == p.shape[0]:
                    sname = f"{table}.optim.{k}"
                    row_tables[sname] = v.detach().reshape(p.shape[0], -1)
                    entry[k] = {_ROW_MARK: sname, "dtype": str(v.dtype).split(".")[-1], "shape": tuple(v.shape)}
                else:
                    entry[k] = v
            state[idx] = entry
        optims.append({"state": state, "param_groups": sd["param_groups"]})
    param_names = [[names.get(id(p)) for g in opt.param_groups for p in g["params"]] for opt in optimizers]
    return optims, param_names, row_tables


def import_checkpoint(store, source, *, model: nn.Module | None = None, optimizer=None, codec: str = "fp32",
                      codecs: Mapping[str, str] | None = None, optimizer_codec: str = "fp32", tables=None,
                      min_rows: int = DEFAULT_MIN_ROWS, format: str | None = None, step: int | None = None,
                      meta: dict | None = None) -> ImportReport:
    """Write ``source`` as the first version of ``store`` (a writable ``cnrstore.Store`` or a path, created
    if absent), in the Checkpointer's layout, so that ``Checkpointer(store, model, optimizer).restore()``
    loads it (module doc). ``codec`` is every table's codec, ``codecs`` overrides it per table name;
    ``optimizer`` (needs ``model``) is an Optimizer or a list of them over ``model``'s parameters whose
    current state is recorded; ``step`` and ``meta`` are the version's.

    Raises InvalidArgument for a source that cannot be read or does not fit (with what to fix), a store
    that holds versions already, an unknown codec or a ``codecs`` entry naming no table; the store's errors
    otherwise. On failure the store holds no new version (and a store this call created is removed)."""
    codec_of = dict(codecs or {})
    for c in [codec, optimizer_codec, *codec_of.values()]:
        _codecs.get(c)  # unknown name -> InvalidArgument
    optimizers = _as_list(optimizer)
    if optimizers and model is None:
        raise InvalidArgument("optimizer= needs model=: the optimizer's state is recorded by the model's "
                              "parameter names")
    state_dict, fmt = read_state_dict(source, format)
    chosen = select_tables(state_dict, model=model, tables=tables, min_rows=min_rows)
    unknown = sorted(set(codec_of) - set(chosen))
    if unknown:
        raise InvalidArgument(f"codecs= names {unknown}, which are not tables of this import (tables: "
                              f"{sorted(chosen)}); name tables by module path, e.g. 'emb.0'")
    consumed = {k for keys in chosen.values() for k in keys}
    target = model.state_dict() if model is not None else {}
    dense = {}
    for key, t in state_dict.items():
        if key in consumed:
            continue
        if key in target and t.dtype != target[key].dtype:
            t = t.to(target[key].dtype)
        dense[key] = t
    for key, t in dense.items():
        if t.dtype != torch.bfloat16 and not _numpy_dtype(t.dtype):
            raise InvalidArgument(f"{key!r} has dtype {t.dtype}, which a dense array cannot hold exactly; convert "
                                  "it before the import")
    weights = {name: state_dict[keys[0]] for name, keys in chosen.items()}
    if model is not None:  # a shared weight's keys hold one tensor: check the copies agree
        for name, keys in chosen.items():
            for k in keys[1:]:
                if k in state_dict and not torch.equal(state_dict[k], weights[name]):
                    raise InvalidArgument(f"{keys[0]!r} and {k!r} are one shared weight in the model but differ in "
                                          "the checkpoint")
    optims, param_names, row_tables = [], [], {}
    if optimizers:
        table_of = {}
        for path, module in model.named_modules():
            if isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
                table_of.setdefault(id(module.weight), path or "embedding")
        optims, param_names, row_tables = _optimizer_payload(optimizers, model, table_of)
    payload = {"format": _FORMAT, "mode": "imported", "tables": list(chosen),
               "dense_dtypes": {k: str(v.dtype).split(".")[-1] for k, v in dense.items()},
               "optimizers": optims, "extra": {}, "param_names": param_names,
               "imported": {"format": fmt, "source": None if isinstance(source, Mapping) else os.fspath(source)}}
    buf = io.BytesIO()
    torch.save(payload, buf)
    blob = np.frombuffer(buf.getbuffer(), dtype=np.uint8).copy()

    created = None  # a store directory this call makes, removed again if the import fails
    if isinstance(store, _store.Store):
        st = store
    else:
        try:
            path = os.fspath(store)
        except TypeError:
            raise InvalidArgument(f"store must be a cnrstore.Store or a path, got {type(store).__name__}") from None
        created = None if os.path.exists(path) else path
        st = _store.open(path, create=True)
    ok = False
    try:
        if st.versions():
            raise InvalidArgument(f"the store holds {len(st.versions())} version(s) already; an import seeds a new "
                                  "store: import into a new path")
        existing = st.tables()
        specs = {name: (w.shape[0], w.shape[1], codec_of.get(name, codec)) for name, w in weights.items()}
        specs.update({name: (v.shape[0], v.shape[1], optimizer_codec) for name, v in row_tables.items()})
        for name, (rows, dim, c) in specs.items():
            info = existing.get(name)
            if info is None:
                st.create_table(name, int(rows), int(dim), codec=c)
            elif (info.num_rows, info.dim) != (rows, dim):
                raise InvalidArgument(f"table {name!r} exists in the store with {info.num_rows} x {info.dim}, the "
                                      f"checkpoint's is {rows} x {dim}; import into a new store")
        infos = st.tables()
        with st.checkpoint(step=step, meta=meta) as ck:
            for name, w in weights.items():
                _put_table(ck, name, w, specs[name][2], infos[name].block_rows)
            for name, v in row_tables.items():
                _put_table(ck, name, v, optimizer_codec, infos[name].block_rows)
            for key, t in dense.items():
                ck.put_dense(DENSE_PREFIX + key, _host_copy(t))
            ck.put_dense(STATE_BLOB, blob)
        ok = True
        return ImportReport(version=ck.version, step=step, source_format=fmt,
                            tables={name: (chosen[name][0], *specs[name]) for name in weights},
                            dense=tuple(dense), optimizer_tables=tuple(row_tables))
    finally:
        if st is not store:
            st.close()
            if not ok and created is not None:
                shutil.rmtree(created, ignore_errors=True)
