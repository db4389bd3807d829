"""Read a nested cnrstore export back into a store (``cnrstore import`` of what ``cnrstore export --layout
nested`` wrote; cnrstore/export.py's module doc names the entries).

A nested export holds ``tables/<name>`` (fp32 ``(num_rows, dim)``), ``dense/<name>`` (as stored) and, per
keyed table, ``keyed/<name>/keys`` (int64), ``keyed/<name>/values`` (float32 ``(n, dim)``) and
``keyed/<name>/columns/<column>`` (``(n,)`` or ``(n, width)`` of the column's dtype), and
``keyed/<name>/partitions`` (int64 ``(1,)``; an export before it has none). ``split`` checks and groups those
(numpy arrays; the torch-based readers convert tensors first); ``write`` writes them as one version of a
store: each table with ``codec`` (default fp32: lossless), each keyed table with its columns' dtypes and
widths and its exported partition count (the default where the export has none), so that ``read_keyed`` of
the import equals the exported version's bit for bit and a job whose ranks own ids by partition reads the
import as it read the original. Torch-free.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from .errors import InvalidArgument
from .export import KEYED_PREFIX
from .types import KeyedRows

__all__ = ["Nested", "is_nested", "split", "write"]

_PREFIXES = ("tables/", "dense/", KEYED_PREFIX)
_SCALARS = ("version", "step", "meta")


@dataclass
class Nested:
    """A nested export's contents: ``tables`` {name: fp32 array}, ``dense`` {name: array}, ``keyed`` {name:
    KeyedRows}, and the exported version's ``step`` and ``meta`` (None where the format keeps none)."""

    tables: dict = field(default_factory=dict)
    dense: dict = field(default_factory=dict)
    keyed: dict = field(default_factory=dict)
    #: {keyed table: its partition count} where the export recorded it
    partitions: dict = field(default_factory=dict)
    step: int | None = None
    meta: dict | None = None
    version: int | None = None


def is_nested(obj) -> bool:
    """Whether ``obj`` (a loaded source) is a nested export: flat ``tables/`` / ``dense/`` / ``keyed/`` entries
    (npz, safetensors), or torch / dcp's ``{"tables": {...}, "dense": {...}, ...}``."""
    if not isinstance(obj, Mapping) or not obj:
        return False
    if all(isinstance(k, str) and k.startswith(_PREFIXES) for k in obj):
        return True
    if isinstance(obj.get("tables"), Mapping) and isinstance(obj.get("dense"), Mapping):
        return True
    # (dcp keeps no empty dict: a nested export without dense arrays or tables lacks that entry)
    parts = [k for k in obj if k not in _SCALARS]
    return bool(parts) and all(isinstance(k, str) and (k.startswith(KEYED_PREFIX) or (
        k in ("tables", "dense") and isinstance(obj[k], Mapping))) for k in parts)


def flatten(obj: Mapping) -> tuple[dict, dict]:
    """(flat entries, scalars) of a nested export: torch / dcp's ``tables`` and ``dense`` dicts spread into
    ``tables/<name>`` and ``dense/<name>``, ``version`` / ``step`` / ``meta`` apart."""
    flat, scalars = {}, {}
    for key, value in obj.items():
        if key in ("tables", "dense") and isinstance(value, Mapping):
            flat.update({f"{key}/{name}": arr for name, arr in value.items()})
        elif key in _SCALARS:
            scalars[key] = value
        else:
            flat[key] = value
    return flat, scalars


def split(entries: Mapping[str, np.ndarray], where: str, scalars: Mapping | None = None) -> Nested:
    """The tables, dense arrays and keyed tables of a nested export's flat ``entries`` (numpy arrays);
    InvalidArgument naming the entry and the fix for one that belongs to none or does not fit."""
    scalars = dict(scalars or {})
    out = Nested(step=scalars.get("step"), meta=scalars.get("meta"), version=scalars.get("version"))
    keyed = {}
    for key, arr in entries.items():
        if not isinstance(key, str) or not key.startswith(_PREFIXES):
            raise InvalidArgument(f"{where} holds {key!r}, which is not an entry of a nested cnrstore export "
                                  "(tables/, dense/, keyed/); export the store again with --layout nested")
        if not isinstance(arr, np.ndarray):
            raise InvalidArgument(f"entry {key!r} of {where} is a {type(arr).__name__}, not an array")
        if key.startswith("tables/"):
            out.tables[key[len("tables/"):]] = arr
        elif key.startswith("dense/"):
            out.dense[key[len("dense/"):]] = arr
        else:
            keyed[key] = arr
    out.keyed, out.partitions = _keyed_tables(keyed, where)
    return out


def _keyed_tables(entries: dict, where: str) -> tuple[dict[str, KeyedRows], dict[str, int]]:
    """({name: KeyedRows}, {name: partitions}) of the ``keyed/`` entries: a table per ``keyed/<name>/keys``,
    each other entry its ``/values``, ``/partitions`` or one of its ``/columns/<c>`` (an entry that could belong
    to two tables is refused)."""
    names = [k[len(KEYED_PREFIX):-len("/keys")] for k in entries if k.endswith("/keys")]
    parts: dict[str, dict] = {n: {"keys": entries[f"{KEYED_PREFIX}{n}/keys"], "columns": {}} for n in names}
    for key, arr in entries.items():
        owners = [(n, key[len(f"{KEYED_PREFIX}{n}/"):]) for n in names if key.startswith(f"{KEYED_PREFIX}{n}/")
                  and key != f"{KEYED_PREFIX}{n}/keys"]
        owners = [(n, rest) for n, rest in owners if rest in ("values", "partitions") or rest.startswith("columns/")]
        if key.endswith("/keys") and key[len(KEYED_PREFIX):-len("/keys")] in parts and not owners:
            continue
        if len(owners) != 1:
            why = "no keyed table (no keyed/<name>/keys beside it)" if not owners else \
                f"more than one keyed table ({', '.join(n for n, _ in owners)})"
            raise InvalidArgument(f"entry {key!r} of {where} belongs to {why}; a keyed table is keyed/<name>/keys, "
                                  "keyed/<name>/values and keyed/<name>/columns/<column>: export it again")
        name, rest = owners[0]
        if rest in ("values", "partitions"):
            parts[name][rest] = arr
        else:
            parts[name]["columns"][rest[len("columns/"):]] = arr
    out = {name: _keyed_rows(name, p, where) for name, p in parts.items()}
    return out, {name: _partitions(name, p["partitions"], where) for name, p in parts.items() if "partitions" in p}


def _partitions(name: str, arr: np.ndarray, where: str) -> int:
    if arr.shape != (1,) or arr.dtype.kind not in "iu" or not 1 <= int(arr[0]) <= 1 << 16:
        raise InvalidArgument(f"{KEYED_PREFIX}{name}/partitions of {where} must be one int in [1, 65536], got "
                              f"{arr.dtype} {arr.shape}")
    return int(arr[0])


def _keyed_rows(name: str, p: dict, where: str) -> KeyedRows:
    keys, values = p["keys"], p.get("values")
    if values is None:
        raise InvalidArgument(f"keyed table {name!r} of {where} has keys but no {KEYED_PREFIX}{name}/values; "
                              "export it again")
    if keys.ndim != 1 or keys.dtype != np.int64:
        raise InvalidArgument(f"{KEYED_PREFIX}{name}/keys of {where} must be int64 (n,), got {keys.dtype} {keys.shape}")
    if values.ndim != 2 or values.shape[0] != keys.size or values.dtype != np.float32:
        raise InvalidArgument(f"{KEYED_PREFIX}{name}/values of {where} must be float32 ({keys.size}, dim), got "
                              f"{values.dtype} {values.shape}")
    for col, arr in p["columns"].items():
        if arr.ndim not in (1, 2) or arr.shape[0] != keys.size:
            raise InvalidArgument(f"{KEYED_PREFIX}{name}/columns/{col} of {where} must be ({keys.size},) or "
                                  f"({keys.size}, width), got {arr.shape}")
    return KeyedRows(keys, values, dict(p["columns"]))


def _column_spec(columns: dict) -> dict:
    """``create_table(columns=)`` of a keyed table's exported columns: dtype and width from each array."""
    return {c: (a.dtype.str, 1 if a.ndim == 1 else int(a.shape[1])) for c, a in columns.items()}


def write(store, nested: Nested, *, codec: str = "fp32", codecs: Mapping | None = None, step: int | None = None,
          meta: dict | None = None) -> int:
    """Write ``nested`` as one version of ``store`` (its tables created here: none of these names may exist
    with another shape), each table (keyed too) in ``codecs[name]`` or ``codec``; the version."""
    codec_of = dict(codecs or {})
    unknown = sorted(set(codec_of) - set(nested.tables) - set(nested.keyed))
    if unknown:
        raise InvalidArgument(f"codecs (--table-codec) names {unknown}, which are not tables of this import "
                              f"(tables: {sorted([*nested.tables, *nested.keyed])[:10]})")
    for name, arr in nested.tables.items():
        if arr.ndim != 2:
            raise InvalidArgument(f"tables/{name} must be 2-D (num_rows, dim), got {arr.shape}")
        store.create_table(name, int(arr.shape[0]), int(arr.shape[1]), codec=codec_of.get(name, codec), exist_ok=True)
    for name, rows in nested.keyed.items():
        store.create_table(name, dim=int(rows.values.shape[1]), keyed=True, codec=codec_of.get(name, codec),
                           columns=_column_spec(rows.columns) or None, partitions=nested.partitions.get(name),
                           exist_ok=True)
    with store.checkpoint(step=nested.step if step is None else step,
                          meta=nested.meta if meta is None else meta) as ck:
        for name, arr in nested.tables.items():
            ck.put_rows(name, np.arange(arr.shape[0]), np.asarray(arr, np.float32))
        for name, arr in nested.dense.items():
            ck.put_dense(name, np.ascontiguousarray(arr))
        for name, rows in nested.keyed.items():
            if rows.keys.size:
                ck.put_keys(name, rows.keys, rows.values, columns=rows.columns)
    return ck.version
