"""Managed-collision state as keyed rows: TorchRec MCH and MPZCH modules' per-slot buffers, saved as the ids
admitted, evicted or changed since the last save (issue 50).

A managed-collision module keeps one int buffer entry per slot:

- **MCH** (``MCHManagedCollisionModule``): ``_mch_sorted_raw_ids`` (the raw ids, ascending, then the empty
  value int64 max), with ``_mch_remapped_ids_mapping`` (each id's slot) and the eviction metadata
  ``_mch_<name>`` (counts, last access) aligned with it. An admission shifts every position after it, so the
  rows are keyed by *raw id*: the key is the id, the columns its mapping and metadata. The positions past the
  last id (the *tail*: the free slots in the order the module will hand them out, and their metadata) are
  kept as small dense arrays: exact, and empty once the table is full.
- **MPZCH** (``HashZchManagedCollisionModule``): ``_hash_zch_identities`` (one id per slot, -1 when empty),
  ``_hash_zch_metadata`` and, if present, ``_hash_zch_runtime_meta``, indexed by slot. Its rows are keyed by
  *slot*: the columns are the slot's identity and metadata, so a save writes the slots whose id or metadata
  changed (an admission, an eviction, a touch).

``group_rows`` turns a module's buffers into (keys, columns, tail); ``delta`` compares two such states
(vectorized: one sorted merge, no loop over ids); ``rebuild`` turns keyed rows and a tail back into the
buffers, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..errors import CorruptionError

#: MCH's empty value in ``_mch_sorted_raw_ids``
MCH_EMPTY = np.iinfo(np.int64).max
MCH_IDS = "_mch_sorted_raw_ids"
MCH_MAPPING = "_mch_remapped_ids_mapping"
ZCH_IDENTITIES = "_hash_zch_identities"
ZCH_COLUMNS = ("_hash_zch_identities", "_hash_zch_metadata", "_hash_zch_runtime_meta")


@dataclass
class BufferGroup:
    """One managed-collision module's slot buffers: ``kind`` "mch" (keyed by raw id) or "zch" (keyed by slot);
    ``prefix`` the module's state-dict prefix; ``columns`` (buffer name, dtype string, width) of the keyed
    table; ``size`` the slots."""

    kind: str
    prefix: str
    columns: list[tuple[str, str, int]]
    size: int
    #: the module's buffer names this group stores (the rest of its state goes the dense way)
    names: list[str] = field(default_factory=list)

    def table(self) -> str:
        """The keyed table holding the group: ``<module path>.keyed``."""
        return f"{self.prefix.rstrip('.')}.keyed"

    def keys_of(self, state: dict) -> list[str]:
        """The state-dict keys this group stores."""
        return [self.prefix + n for n in self.names]


def find_groups(state: dict) -> list[BufferGroup]:
    """The managed-collision groups of a state dict ({key: numpy array}), found by their buffer names: an MCH
    module's ``<prefix>_mch_sorted_raw_ids`` with the ``_mch_*`` buffers of its length, an MPZCH module's
    ``<prefix>_hash_zch_identities`` with its metadata."""
    groups = []
    for key, arr in state.items():
        if key.endswith(MCH_IDS) and arr.ndim == 1 and arr.dtype == np.int64:
            prefix = key[: -len(MCH_IDS)]
            names = sorted(k[len(prefix):] for k, a in state.items() if k.startswith(prefix + "_mch_")
                           and k != key and "." not in k[len(prefix):] and a.shape == arr.shape
                           and a.dtype.kind in "iu")
            if MCH_MAPPING not in names:
                continue
            cols = [(n, state[prefix + n].dtype.str, 1) for n in names]
            groups.append(BufferGroup("mch", prefix, cols, arr.shape[0], [MCH_IDS] + names))
        elif key.endswith(ZCH_IDENTITIES) and arr.dtype.kind == "i":
            prefix = key[: -len(ZCH_IDENTITIES)]
            size = arr.shape[0]
            names = [n for n in ZCH_COLUMNS if prefix + n in state and state[prefix + n].shape[0] == size
                     and state[prefix + n].dtype.kind in "iu"]
            cols = [(n, state[prefix + n].dtype.str, int(np.prod(state[prefix + n].shape[1:], dtype=np.int64)))
                    for n in names]
            groups.append(BufferGroup("zch", prefix, cols, size, names))
    return groups


def group_rows(group: BufferGroup, state: dict) -> tuple[np.ndarray, dict, dict]:
    """(keys ascending, {column: (n, width) array}, tail {name: array}) of the group in ``state``."""
    p = group.prefix
    if group.kind == "zch":
        keys = np.arange(group.size, dtype=np.int64)
        cols = {n: state[p + n].reshape(group.size, -1) for n, _d, _w in group.columns}
        return keys, cols, {}
    ids = state[p + MCH_IDS]
    n = int(np.searchsorted(ids, MCH_EMPTY))  # the ids, then the empty value
    keys = ids[:n]
    if n > 1 and not (keys[1:] > keys[:-1]).all():
        raise CorruptionError(f"{p}{MCH_IDS} is not strictly increasing: not an MCH state this cnrstore can key "
                              "by id", None, None)
    cols = {c: state[p + c][:n].reshape(n, 1) for c, _d, _w in group.columns}
    tail = {name: state[p + name][n:].copy() for name in group.names}
    return keys, cols, tail


def delta(before: tuple | None, keys: np.ndarray, cols: dict) -> tuple[np.ndarray, np.ndarray]:
    """(positions of ``keys`` whose row is new or differs from ``before``, keys of ``before`` that are gone):
    ``before`` is the (keys, cols) of the last save, or None (every key is new)."""
    if before is None:
        return np.arange(keys.size), np.zeros(0, np.int64)
    old_keys, old_cols = before
    at = np.searchsorted(old_keys, keys)
    inside = at < old_keys.size
    found = np.zeros(keys.size, bool)
    found[inside] = old_keys[at[inside]] == keys[inside]
    same = found.copy()
    for name, now in cols.items():
        old = old_cols[name]
        same[found] &= (old[at[found]] == now[found]).all(axis=1)
    alive = np.zeros(old_keys.size, bool)
    alive[at[found]] = True
    return np.flatnonzero(~same), old_keys[~alive]


def rebuild(group: BufferGroup, keys: np.ndarray, cols: dict, tail: dict, like: dict) -> dict:
    """{state-dict key: numpy array} of the group's buffers from its keyed rows and tail; ``like`` gives each
    buffer's shape and dtype (the live module's). CorruptionError if they do not fill the buffers exactly."""
    p, size = group.prefix, group.size
    out = {}
    if group.kind == "zch":
        if keys.size != size or (keys != np.arange(size)).any():
            raise CorruptionError(f"{group.table()}: {keys.size} slots stored for {size}", None, None)
        for name, _d, _w in group.columns:
            out[p + name] = cols[name].reshape(like[p + name].shape).astype(like[p + name].dtype, copy=False)
        return out
    n = keys.size
    if n + tail[MCH_IDS].size != size:
        raise CorruptionError(f"{group.table()}: {n} ids and a tail of {tail[MCH_IDS].size} for {size} slots",
                              None, None)
    out[p + MCH_IDS] = np.concatenate([keys, tail[MCH_IDS]])
    for name, _d, _w in group.columns:
        out[p + name] = np.concatenate([cols[name].reshape(n), tail[name]]).astype(like[p + name].dtype,
                                                                                   copy=False)
    return out
