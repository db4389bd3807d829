"""The serving copy of a keyed table: ``KeyedReplica`` (API.md, "Serving: following a store").

A ``cnrstore.serving.Follower`` keeps one per keyed table it follows (a dict target's entry). It holds the
keys live at the follower's version and each key's float32 value and columns, host-side numpy arrays:

- ``keys``: int64, ascending, unique; ``slots``: where each key's row lies in ``values`` / the columns;
- ``values``: float32 ``(capacity, dim)``, ``columns`` {name: (capacity,) or (capacity, width)}; the slots
  no key holds are zero and listed in ``free``.

An update is planned outside the serving lock (``plan_update`` / ``plan_replace``: which slots take which
rows, the new key index; nothing the replica serves is changed) and committed under its exclusive side
(``commit``: the rows written into their slots, the freed slots zeroed, the new index swapped in). A lookup
holds the shared side (the follower's ``serving()`` lock, re-entrant), so a lookup sees one version; an
evicted key is not found from the commit of the update that evicted it on, and its slot is zeroed then.

Everything is vectorized: searchsorted over the keys, fancy indexing into the slots; no loop over keys.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import numpy as np

from .engine.keyed_records import new_columns
from .engine.keyed_runs import as_keys
from .errors import InvalidArgument
from .types import KeyedRows, KeyLookup

__all__ = ["KeyedReplica"]

#: The smallest capacity a replica's row arrays grow to (then doubling).
MIN_CAPACITY = 16


class _State(NamedTuple):
    keys: np.ndarray  # int64 ascending
    slots: np.ndarray  # int64, the row of each key
    values: np.ndarray  # float32 (capacity, dim)
    columns: dict  # {name: (capacity,) or (capacity, width)}
    free: np.ndarray  # int64: slots no key holds (zeroed)


class _Plan(NamedTuple):
    """What ``commit`` does: zero ``cleared`` slots, write ``rows`` at ``slots``, then serve ``state``."""

    state: _State
    cleared: np.ndarray
    slots: np.ndarray
    values: np.ndarray
    columns: dict


def _empty_state(dim: int, columns: tuple) -> _State:
    cols = new_columns(columns, 0)
    return _State(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros((0, dim), np.float32), cols,
                  np.zeros(0, np.int64))


def _find(keys: np.ndarray, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(found, index into ``keys`` (valid where found)) of each of ``q`` in sorted ``keys``."""
    at = np.searchsorted(keys, q)
    at[at >= keys.size] = 0
    found = keys[at] == q if keys.size else np.zeros(q.size, bool)
    return found, at


def _grown(state: _State, needed: int) -> _State:
    """``state`` with room for ``needed`` more keys in ``free``: new, larger row arrays (the old ones copied;
    the old state is not changed, so readers of it are undisturbed)."""
    if needed <= state.free.size:
        return state
    cap = state.values.shape[0]
    new_cap = max(cap * 2, cap + needed - state.free.size, MIN_CAPACITY)

    def grow(a: np.ndarray) -> np.ndarray:
        out = np.zeros((new_cap, *a.shape[1:]), a.dtype)
        out[:cap] = a
        return out

    return _State(state.keys, state.slots, grow(state.values), {n: grow(a) for n, a in state.columns.items()},
                  np.concatenate([state.free, np.arange(cap, new_cap, dtype=np.int64)]))


class KeyedReplica:
    """A keyed table's serving copy (module doc): ``lookup(keys) -> (found, values)``, ``read(keys) ->
    KeyLookup``, ``keys()``, ``rows() -> KeyedRows``, ``len()``, ``dim``, ``column_names``. Pass an empty
    one as a dict target's entry for a keyed table (or let the follower fill an empty dict); the follower's
    full sync sets its shape and keys."""

    def __init__(self):
        self._state = _empty_state(0, ())
        self._lock = None  # the follower's serving lock, once bound

    # -- reading ------------------------------------------------------------------------------------
    def _shared(self):
        lock = self._lock
        return contextlib.nullcontext() if lock is None else lock.shared()

    def lookup(self, keys) -> tuple[np.ndarray, np.ndarray]:
        """(found: bool per key, float32 ``(len(keys), dim)`` values, zeros where not found) at the version
        the follower holds; ``keys`` any int64 array (any order, repeats allowed)."""
        q = as_keys(keys, "keys")
        with self._shared():
            st = self._state
            found, at = _find(st.keys, q)
            values = np.zeros((q.size, st.values.shape[1]), np.float32)
            values[found] = st.values[st.slots[at[found]]]
        return found, values

    def read(self, keys) -> KeyLookup:
        """KeyLookup(found, values, columns) of ``keys``, as ``Store.read_keys`` gives them."""
        q = as_keys(keys, "keys")
        with self._shared():
            st = self._state
            found, at = _find(st.keys, q)
            slots = st.slots[at[found]]
            values = np.zeros((q.size, st.values.shape[1]), np.float32)
            values[found] = st.values[slots]
            columns = {}
            for name, col in st.columns.items():
                columns[name] = np.zeros((q.size, *col.shape[1:]), col.dtype)
                columns[name][found] = col[slots]
        return KeyLookup(found, values, columns)

    def keys(self) -> np.ndarray:
        """int64, ascending: every key held (a copy)."""
        return self._state.keys.copy()

    def rows(self) -> KeyedRows:
        """KeyedRows(keys, values, columns): everything held, keys ascending, as ``Store.read_keyed`` gives it."""
        with self._shared():
            st = self._state
            return KeyedRows(st.keys.copy(), st.values[st.slots], {n: c[st.slots] for n, c in st.columns.items()})

    def __len__(self) -> int:
        return int(self._state.keys.size)

    @property
    def dim(self) -> int:
        return int(self._state.values.shape[1])

    @property
    def column_names(self) -> tuple:
        return tuple(self._state.columns)

    def __repr__(self) -> str:
        return f"KeyedReplica(keys={len(self)}, dim={self.dim}, columns={list(self.column_names)})"

    # -- updating (the follower's) ------------------------------------------------------------------
    def bind(self, lock) -> None:
        """Make lookups hold ``lock``'s shared side (the follower's serving lock)."""
        self._lock = lock

    def plan_replace(self, keys: np.ndarray, values: np.ndarray, columns: dict, dim: int, spec: tuple) -> _Plan:
        """A plan serving exactly ``keys`` (sorted unique) with their rows: a full sync."""
        st = _empty_state(dim, spec)._replace(keys=keys, slots=np.arange(keys.size, dtype=np.int64),
                                              values=np.ascontiguousarray(values, np.float32),
                                              columns={n: np.array(columns[n]) for n, _d, _w in spec})
        none = np.zeros(0, np.int64)
        return _Plan(st, none, none, st.values[:0], {n: c[:0] for n, c in st.columns.items()})

    def plan_update(self, put: np.ndarray, values: np.ndarray, columns: dict, deleted: np.ndarray) -> _Plan:
        """A plan applying ``put`` keys (sorted unique; rows ``values`` / ``columns``) and removing
        ``deleted`` (keys not in ``put``) over what is held. The held state is not changed."""
        st = self._state
        hit, at = _find(st.keys, deleted)
        gone = at[hit]
        keep = np.ones(st.keys.size, bool)
        keep[gone] = False
        freed = st.slots[gone]
        st = st._replace(keys=st.keys[keep], slots=st.slots[keep], free=np.concatenate([st.free, freed]))
        exists, at = _find(st.keys, put)
        fresh = ~exists
        st = _grown(st, int(fresh.sum()))
        slots = np.empty(put.size, np.int64)
        slots[exists] = st.slots[at[exists]]
        n_new = int(fresh.sum())
        slots[fresh] = st.free[:n_new]
        merged = np.concatenate([st.keys, put[fresh]])
        order = np.argsort(merged, kind="stable")
        st = st._replace(keys=merged[order], slots=np.concatenate([st.slots, slots[fresh]])[order],
                         free=st.free[n_new:])
        return _Plan(st, freed, slots, values, columns)

    def commit(self, plan: _Plan) -> None:
        """Apply ``plan`` (the caller holds the serving lock's exclusive side, or nothing is served yet)."""
        st = plan.state
        st.values[plan.cleared] = 0
        st.values[plan.slots] = plan.values
        for name, col in st.columns.items():
            col[plan.cleared] = 0
            col[plan.slots] = plan.columns[name]
        self._state = st
