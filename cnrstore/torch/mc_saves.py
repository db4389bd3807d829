"""Managed-collision buffers saved as keyed tables by the torch ``Checkpointer`` (issue 50).

A model's TorchRec MCH and MPZCH modules (found by their buffers: mc_buffers.find_groups) are not written
as whole dense arrays at every save. Each module's slot buffers go to a keyed table of dim 0
(``<module path>.keyed``), and a save writes only the ids admitted, evicted or changed since the version it
goes on top of (``put_groups``); an MCH module's free-slot tail is a small dense array
(``"torch.keyed-tail/<state-dict key>"``). The buffers are the host copies the save took at ``save()``, so a
version holds the state at save() exactly; ``restore_groups`` rebuilds them bit for bit.

The last written state of each table is kept per store (weakly) with its version: a save whose parent is
another version (a restore, another process, a failed save) reads the table at its parent instead.
"""

from __future__ import annotations

import threading
import weakref

import numpy as np
import torch

from . import mc_buffers as kb
from ..errors import InvalidArgument

#: Prefix of the dense arrays holding an MCH module's free-slot tail: TAIL_PREFIX + state-dict key
TAIL_PREFIX = "torch.keyed-tail/"

_LAST: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # store -> {table: (version, keys, cols)}
_LOCK = threading.Lock()


def _partitions(size: int) -> int:
    return max(1, min(4096, size >> 15))  # about 2**15 slots per partition


def put_groups(ck, store, dense: dict) -> tuple[dict, list]:
    """Write the managed-collision groups of ``dense`` (state-dict key -> host array) into checkpoint ``ck`` of
    ``store``: the keyed rows changed since ``ck``'s parent and the tails. Returns (the dense arrays left to
    put as usual, what ``written`` records once ``ck`` has committed)."""
    arrays = {k: a for k, a in dense.items() if isinstance(a, np.ndarray)}
    groups = kb.find_groups(arrays)
    if not groups:
        return dense, []
    left = dict(dense)
    done = []
    for g in groups:
        keys, cols, tail = kb.group_rows(g, arrays)
        table = g.table()
        store.create_table(table, dim=0, keyed=True, partitions=_partitions(g.size), exist_ok=True,
                           columns={name: (dt, w) for name, dt, w in g.columns})
        before = _before(store, table, ck.parent)
        changed, deleted = kb.delta(before, keys, cols)
        if deleted.size:  # (evictions first: keyed_save.write_job says why)
            ck.delete_keys(table, deleted)
        if changed.size:
            ck.put_keys(table, keys[changed], None, columns={n: c[changed] for n, c in cols.items()})
        for name, arr in tail.items():
            ck.put_dense(TAIL_PREFIX + g.prefix + name, arr)
        for key in g.keys_of(arrays):
            left.pop(key, None)
        done.append((table, keys, cols))
    return left, done


def written(store, version: int, done: list) -> None:
    """Note the state ``put_groups`` wrote, once its version committed: the next save's delta starts there."""
    with _LOCK:
        last = _LAST.setdefault(store, {})
        for table, keys, cols in done:
            last[table] = (version, keys, cols)


def _before(store, table: str, parent: int | None):
    """(keys, cols) of ``table`` at ``parent``: the one noted if it is that version's, else read from the store."""
    if parent is None:
        return None
    with _LOCK:
        noted = _LAST.get(store, {}).get(table)
    if noted is not None and noted[0] == parent:
        return noted[1], noted[2]
    got = store.read_keyed(table, parent)  # (empty if no version up to the parent wrote it)
    return got.keys, {n: _rows(c) for n, c in got.columns.items()}


def _rows(c: np.ndarray) -> np.ndarray:
    """A keyed column read back as (rows, width) (a table with no key left reads as 0 rows)."""
    return c.reshape(c.shape[0], int(np.prod(c.shape[1:], dtype=np.int64)))


def restore_groups(store, targets: dict, version: int) -> dict:
    """{state-dict key: tensor} of the managed-collision buffers among ``targets`` (state-dict key -> the live
    tensor) that ``version`` holds as keyed tables; keys whose group the version does not hold keyed are left
    out (read the dense way)."""
    arrays = {k: t.detach().cpu().numpy() for k, t in targets.items()
              if isinstance(t, torch.Tensor) and t.dtype in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8)}
    out = {}
    tables = store.tables()
    for g in kb.find_groups(arrays):
        table = g.table()
        if table not in tables:
            continue
        got = store.read_keyed(table, version)
        tail = {}
        if g.kind == "mch":
            for name in g.names:
                tail[name] = store.read_dense(TAIL_PREFIX + g.prefix + name, version)
        cols = {n: _rows(c) for n, c in got.columns.items()}
        missing = [n for n, _d, _w in g.columns if n not in cols]
        if missing:
            raise InvalidArgument(f"{table}: version {version} holds no column {missing[0]!r} of the model's "
                                  "module; restore into a model of the stored kind")
        for key, arr in kb.rebuild(g, got.keys, cols, tail, arrays).items():
            out[key] = torch.from_numpy(np.ascontiguousarray(arr))
        with _LOCK:
            _LAST.setdefault(store, {})[table] = (version, got.keys, cols)
    return out
