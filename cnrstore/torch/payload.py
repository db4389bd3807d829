"""The trainer payload: the dense array ``"torch.state"`` a ``Checkpointer`` writes beside the tables (the
optimizers' state outside the tables, the ``extra`` objects' state, the table list, dense dtypes).

A store is data, never code (docs/DESIGN.md "Security"). The payload is a ``torch.save`` file whose
pickle holds *data only*: what ``torch.load(weights_only=True)`` rebuilds (tensors, ``torch.dtype`` /
``Size`` / ``device``, ``dict`` / ``OrderedDict`` / ``list`` / ``tuple`` / ``set``, ``str``, ``bytes``,
numbers, ``bool``, ``None``), plus the classes the *reading* process has registered with
``torch.serialization.add_safe_globals``. Format 2 (docs/FORMAT.md "Trainer payload") is checked when it
is written (:func:`encode` refuses anything else, naming the object and the fix) and read with
``weights_only=True`` only (:func:`decode`). A payload whose pickle needs anything else (one written by
cnrstore before format 2 holding such objects, or a crafted one) is refused with :class:`UnsafePayload`
unless the caller passes ``trust_pickle=True`` (it then warns and unpickles it: that runs whatever code the
pickle names); ``cnrstore migrate-payload`` rewrites such payloads as data once.
"""

from __future__ import annotations

import io
import pickle
import warnings
from collections import OrderedDict
from collections.abc import Mapping

import numpy as np
import torch

from ..errors import InvalidArgument, UnsafePayload

__all__ = ["DENSE_PREFIX", "KEYED_MARK", "LIVE_MARK", "PAYLOAD_FORMAT", "ROW_MARK", "STATE_BLOB", "build", "check_structure",
           "decode", "dense_copy", "dense_view", "encode", "is_sharded_value", "torch_dtype", "unsafe_globals"]

#: Format of the payload (docs/FORMAT.md): 1 = any pickle (older stores), 2 = data only (weights_only).
PAYLOAD_FORMAT = 2
#: The dense array holding the payload.
STATE_BLOB = "torch.state"
#: Prefix of the dense arrays holding the model's parameters and buffers that are not tables:
#: ``DENSE_PREFIX + state-dict key``.
DENSE_PREFIX = "torch.model/"
#: Key of the marker standing for a row-wise optimizer state tensor in ``optimizers``: ``{ROW_MARK: table
#: name, "dtype": torch dtype name, "shape": [int, ...]}`` (the tensor is read back from that table).
ROW_MARK = "__cnrstore_row_state__"
#: Key of the marker standing for the row-wise optimizer state of a ``KeyedEmbedding``'s weight: ``{KEYED_MARK:
#: keyed table name, "dtype", "shape", "free": the value of every free slot's state}`` (the rows of the live ids
#: are read back from that keyed table, by their ``slot`` column: ``keyed_save.py``).
KEYED_MARK = "__cnrstore_keyed_state__"
#: Key of the marker standing for a fused optimizer's sharded state (``{LIVE_MARK: True}``): restored through
#: the shard tables, in place.
LIVE_MARK = "__cnrstore_sharded_state__"

_PLAIN = (type(None), bool, int, float, complex, str, bytes, bytearray, torch.dtype, torch.Size, torch.device)


def is_sharded_value(v) -> bool:
    """Whether the optimizer state value ``v`` is sharded (a fused optimizer's ``ShardedTensor``, or a
    ``DTensor``): its rows are this rank's shard tables', not a payload's (``LIVE_MARK`` stands for it)."""
    return type(v).__name__ in ("ShardedTensor", "DTensor")


def build(*, mode: str, tables: list[str], dense: Mapping, optimizers: list, extra: Mapping,
          param_names: Mapping[int, str], row_tables: Mapping[int, tuple[str, set]],
          keyed_tables: Mapping | None = None) -> dict:
    """The payload a save writes (docs/FORMAT.md, "Trainer payload"), before :func:`encode`: ``mode``, the
    names of the embedding ``tables``, the dtype of each ``dense`` tensor (by state-dict key), each optimizer's
    ``state_dict()`` with every row-wise tensor replaced by a ``ROW_MARK`` marker naming its table and each
    sharded value by a ``LIVE_MARK`` marker, the ``extra`` objects' ``state_dict()``, and ``param_names``:
    per optimizer, the model's name of each parameter in ``param_groups`` order (None for one that is not
    the model's). ``param_names`` maps ``id(parameter)`` to its name; ``row_tables`` maps ``id(weight)`` of
    an embedding weight to (its table, the names of its row-wise optimizer state); ``keyed_tables`` maps
    ``id(weight)`` of a ``KeyedEmbedding`` to (its keyed table, {state name: the free slots' value}), whose
    row-wise state becomes ``KEYED_MARK`` markers."""
    keyed_tables = keyed_tables or {}
    optims = []
    for opt in optimizers:
        sd = opt.state_dict()
        params = [p for g in opt.param_groups for p in g["params"]]
        state = {}
        named = getattr(opt, "params", None)  # torchrec's KeyedOptimizer: state keyed by parameter name
        for idx, st in sd["state"].items():
            if isinstance(idx, int):
                param = params[idx] if 0 <= idx < len(params) else None
            else:
                param = named.get(idx) if isinstance(named, Mapping) else None
            table, row_keys = row_tables.get(id(param), (None, set())) if param is not None else (None, set())
            ktable, kstates = keyed_tables.get(id(param), (None, {})) if param is not None else (None, {})
            state[idx] = {k: ({KEYED_MARK: f"{ktable}.optim.{k}", "dtype": str(v.dtype).split(".")[-1],
                               "shape": tuple(v.shape), "free": kstates[str(k)]} if str(k) in kstates
                              else {ROW_MARK: f"{table}.optim.{k}", "dtype": str(v.dtype).split(".")[-1],
                               "shape": tuple(v.shape)} if str(k) in row_keys
                              else {LIVE_MARK: True} if is_sharded_value(v) else v)
                          for k, v in st.items()}
        optims.append({**{k: v for k, v in sd.items() if k != "state"}, "state": state})
    out = {
        "format": PAYLOAD_FORMAT,
        "mode": mode,
        "tables": list(tables),
        "dense_dtypes": {k: str(v.dtype).split(".")[-1] for k, v in dense.items()},
        "optimizers": optims,
        "extra": {k: obj.state_dict() for k, obj in extra.items()},
        "param_names": [[param_names.get(id(p)) for g in opt.param_groups for p in g["params"]]
                        for opt in optimizers],
        # the optimizers' classes: a restore into another kind is refused (restore_check.py); absent in
        # payloads of earlier cnrstore, whose kinds are then not checked
        "optimizer_types": [f"{type(opt).__module__}.{type(opt).__qualname__}" for opt in optimizers],
    }
    if keyed_tables:  # (the keyed tables of KeyedEmbeddings; absent otherwise, and in earlier payloads)
        out["keyed"] = sorted(t for t, _s in keyed_tables.values())
    return out


def unsafe_globals(blob) -> list[str]:
    """The classes and functions the pickle of the ``torch.save`` bytes ``blob`` names that
    ``weights_only=True`` would not rebuild here (a static scan of the pickle opcodes: nothing is
    unpickled). Raises whatever torch raises for bytes that are no ``torch.save`` zip."""
    return list(torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(_as_bytes(blob))))


def _as_bytes(blob) -> bytes:
    if isinstance(blob, (bytes, bytearray, memoryview)):
        return bytes(blob)
    return np.ascontiguousarray(blob).tobytes()


def _first_unsafe(obj, path: str, safe: set, seen: set):
    """(path, type name) of the first object under ``obj`` that is not data, or None."""
    if id(obj) in seen:
        return None
    t = type(obj)
    if t in _PLAIN:
        return None
    if isinstance(obj, torch.Tensor) and t in (torch.Tensor, torch.nn.Parameter):
        return None
    name = f"{t.__module__}.{t.__qualname__}"
    if t in (dict, OrderedDict):
        seen.add(id(obj))
        for k, v in obj.items():
            found = _first_unsafe(k, f"{path} (a key)", safe, seen) or _first_unsafe(v, f"{path}[{k!r}]", safe, seen)
            if found:
                return found
        return None
    if t in (list, tuple, set):
        seen.add(id(obj))
        for i, v in enumerate(obj):
            found = _first_unsafe(v, f"{path}[{i}]", safe, seen)
            if found:
                return found
        return None
    if t in safe or name in safe:
        return None
    return path, name


def encode(payload: dict, *, what: str = "the Checkpointer's state") -> np.ndarray:
    """``payload`` as a format-2 payload (uint8 array). InvalidArgument, naming the object, its type and the
    fix, when it holds anything ``torch.load(weights_only=True)`` would not rebuild: found at save, never at
    restore."""
    safe = set()
    for g in torch.serialization.get_safe_globals():
        safe.add(g[0] if isinstance(g, tuple) else g)
    found = _first_unsafe(payload, "payload", safe, set())
    out = io.BytesIO()
    if found is None:
        try:
            torch.save(payload, out)
        except (pickle.PicklingError, AttributeError, TypeError) as exc:  # e.g. a registered but local class
            raise InvalidArgument(f"{what} cannot be saved: {_one_line(exc)}; make the state plain data") from exc
        bad = torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(out.getvalue()))
        if bad:
            found = ("payload", ", ".join(bad))
    if found is not None:
        where, name = found
        where = where.replace("payload['extra']", "extra").replace("payload['optimizers']", "optimizers")
        raise InvalidArgument(
            f"{what} holds {where} of type {name}, which a checkpoint does not store: a store is data, never "
            "code, and restore reads it with torch.load(weights_only=True). Make that state_dict() return plain "
            "data (tensors, numbers, strings, lists, tuples, dicts), or, if the type is safe to rebuild, "
            f"register it with torch.serialization.add_safe_globals([{name.rsplit('.', 1)[-1]}]) in the saving "
            "and in every restoring process")
    return np.frombuffer(out.getbuffer(), dtype=np.uint8).copy()


def decode(blob, version, *, trust_pickle: bool = False, store: str | None = None) -> dict:
    """The payload stored as ``blob`` (the ``"torch.state"`` array of ``version``), read as data.

    - UnsafePayload when its pickle names anything ``weights_only`` does not rebuild (unless
      ``trust_pickle``: then a warning and a full unpickle, which runs the code the pickle names);
    - InvalidArgument when the bytes are no ``torch.save`` file or not a Checkpointer payload.
    Nothing in the blob is executed unless ``trust_pickle``."""
    data = _as_bytes(blob)
    try:
        bad = unsafe_globals(data)
    except Exception as exc:  # noqa: BLE001 - torch's zip reader raises its own types (RuntimeError)
        raise _not_payload(version, exc) from exc
    where = f"store {store!r}, " if store else ""
    refused = None
    if bad:
        refused = f"is a pickle naming {', '.join(bad[:5])}{' ...' if len(bad) > 5 else ''}"
    else:
        try:
            payload = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
        except pickle.UnpicklingError as exc:
            refused = f"is a pickle that torch.load(weights_only=True) refuses ({_one_line(exc)})"
        except Exception as exc:  # noqa: BLE001 - torch raises its own types for a damaged zip or pickle
            raise _not_payload(version, exc) from exc
    if refused is not None:
        if not trust_pickle:
            raise UnsafePayload(
                f"{where}version {version}: the trainer payload ({STATE_BLOB!r}) {refused}, which cnrstore does "
                "not unpickle (unpickling runs code the pickle names). It was written by cnrstore before payload "
                "format 2 (or crafted). If you wrote this store and trust every byte of it: rewrite it as data "
                "once with `cnrstore migrate-payload STORE --trust-pickle`, or pass trust_pickle=True "
                "(`--trust-pickle` on the CLI) for this read; if a class named is safe to rebuild, "
                "torch.serialization.add_safe_globals([...]) it instead", version=version, names=bad)
        warnings.warn(f"{where}version {version}: the trainer payload {refused}; unpickling it because "
                      "trust_pickle=True: this runs code the pickle names, do it only for a store you wrote",
                      UserWarning, stacklevel=3)
        try:
            payload = torch.load(io.BytesIO(data), weights_only=False, map_location="cpu")
        except Exception as exc:  # noqa: BLE001
            raise _not_payload(version, exc) from exc
    check_structure(payload, version)
    return payload


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def _not_payload(version, exc: BaseException) -> InvalidArgument:
    return InvalidArgument(f"version {version}'s {STATE_BLOB!r} array is not a cnrstore.torch state blob "
                           f"({_one_line(exc)}); export it with layout 'nested'")


def dense_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` detached, as a ``DENSE_PREFIX`` array stores it: bfloat16 (which numpy lacks) as its raw int16
    pattern, every other dtype as it is (a view: nothing copied)."""
    t = t.detach()
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def dense_copy(t: torch.Tensor) -> np.ndarray:
    """An exact host copy of the tensor ``t`` as numpy, as a ``DENSE_PREFIX`` array stores it (``dense_view``)."""
    return dense_view(t).to("cpu", copy=True).numpy()


def torch_dtype(name, version=None) -> torch.dtype:
    """The torch dtype a payload names (``"float32"``); InvalidArgument for anything else (a payload is
    data: a name is never resolved to another attribute of torch)."""
    dt = getattr(torch, name, None) if isinstance(name, str) and name.isidentifier() else None
    if not isinstance(dt, torch.dtype):
        raise InvalidArgument(f"version {version}'s {STATE_BLOB!r} names dtype {name!r}, which is no torch dtype")
    return dt


def _bad(version, what: str) -> InvalidArgument:
    return InvalidArgument(f"version {version}'s {STATE_BLOB!r} array is not a cnrstore.torch state blob ({what}); "
                           "export it with layout 'nested'")


def check_structure(payload, version) -> None:
    """The shape of a payload the readers rely on: InvalidArgument for anything else (so that a crafted
    payload fails with a typed error, not a KeyError deep in restore)."""
    if not isinstance(payload, dict) or "tables" not in payload or "dense_dtypes" not in payload:
        raise _bad(version, "no table list")
    if not isinstance(payload["tables"], (list, tuple)) or not all(isinstance(t, str) for t in payload["tables"]):
        raise _bad(version, "the table list is not a list of names")
    dd = payload["dense_dtypes"]
    if not isinstance(dd, dict) or not all(isinstance(k, str) for k in dd):
        raise _bad(version, "dense_dtypes is not a map of names")
    for v in dd.values():
        torch_dtype(v, version)
    optims = payload.get("optimizers", [])
    if not isinstance(optims, (list, tuple)):
        raise _bad(version, "optimizers is not a list")
    for sd in optims:
        if not isinstance(sd, dict) or not isinstance(sd.get("state", {}), dict) \
                or not isinstance(sd.get("param_groups", []), (list, tuple)):
            raise _bad(version, "an optimizer state is not a map with 'state' and 'param_groups'")
        for st in sd.get("state", {}).values():
            if not isinstance(st, dict):
                raise _bad(version, "an optimizer's per-parameter state is not a map")
            for val in st.values():
                if isinstance(val, dict) and ROW_MARK in val:
                    shape = val.get("shape")
                    if not isinstance(val[ROW_MARK], str) or not isinstance(shape, (list, tuple)) \
                            or not all(isinstance(n, int) and not isinstance(n, bool) and 0 <= n < 2 ** 63
                                       for n in shape):
                        raise _bad(version, "a row-wise state marker is malformed")
                    torch_dtype(val.get("dtype"), version)
                if isinstance(val, dict) and KEYED_MARK in val:
                    shape = val.get("shape")
                    if not isinstance(val[KEYED_MARK], str) or not isinstance(shape, (list, tuple)) \
                            or not all(isinstance(n, int) and not isinstance(n, bool) and 0 <= n < 2 ** 63
                                       for n in shape) or not isinstance(val.get("free"), (int, float)):
                        raise _bad(version, "a keyed state marker is malformed")
                    torch_dtype(val.get("dtype"), version)
    keyed = payload.get("keyed", [])
    if not isinstance(keyed, (list, tuple)) or not all(isinstance(t, str) for t in keyed):
        raise _bad(version, "the keyed table list is not a list of names")
    if not isinstance(payload.get("extra", {}), dict):
        raise _bad(version, "extra is not a map")
    kinds = payload.get("optimizer_types")
    if kinds is not None and (not isinstance(kinds, (list, tuple)) or not all(isinstance(k, str) for k in kinds)):
        raise _bad(version, "optimizer_types is not a list of class names")
    names = payload.get("param_names")
    if names is not None and (not isinstance(names, (list, tuple)) or not all(
            isinstance(n, (list, tuple)) and all(x is None or isinstance(x, str) for x in n) for n in names)):
        raise _bad(version, "param_names is not a list of name lists")
