"""``KeyedEmbedding`` s restored at another world size by ``DistributedCheckpointer`` (issue 50).

The contract a multi-rank job keeps (docs/API.md, "Keyed embeddings in a multi-rank job"): every rank builds its
``KeyedEmbedding`` at the same module path with the same ``partitions``, and holds the ids
``KeyedEmbedding.owner(ids, world_size)`` gives its rank (``keyed_reshard.owner_of_keys``: contiguous ranges of
hash partitions). Restoring at M ranks a version written at N, rank r of M then reads, from each of the N rank
stores, only the partitions it owns at M (``keyed_reshard.read_owned``, from the index: no rank reads what it
will not hold), checking that each writer held only the ids it owned at N (else the job routed ids some other way
and the restore is refused).

What rank r's module gets (``read_module``), all read before anything live changes:

- every id it owns, with its weight row, ``last_step``, ``count`` and the row of each row-wise optimizer state
  (``<path>.optim.<state>`` tables), exactly as stored;
- new slots: the ids in ascending order take slots ``0 .. n-1`` (the slot an id had on its old rank means
  nothing here); the free slots are zero, and their optimizer state the value the version recorded for free
  slots;
- if r owns more ids than the module's ``capacity``, the ones its eviction policy would keep (``"lru"``: the
  largest ``last_step``; ``"lfu"``: the largest ``count``, then ``last_step``; ties: the smaller id), with a
  ``RuntimeWarning`` saying how many were dropped;
- ``step``: rank 0's (the dense state, as for any replicated buffer); ``seed``: the module's own (each rank's as
  built: a new rank has no old one).
"""

from __future__ import annotations

import warnings

import numpy as np

from .. import keyed_reshard
from ..errors import InvalidArgument
from ..torch import keyed_save
from ..torch.payload import KEYED_MARK

__all__ = ["KeyedReshard", "keep_by_policy"]


def keep_by_policy(keys: np.ndarray, last_step: np.ndarray, count: np.ndarray, capacity: int,
                   eviction: str) -> np.ndarray:
    """Positions (ascending) of the at most ``capacity`` of ``keys`` a module with ``eviction`` keeps: all of them
    when they fit, else those with the largest ``last_step`` ("lru") or ``count`` then ``last_step`` ("lfu"),
    ties to the smaller key."""
    n = keys.size
    if n <= capacity:
        return np.arange(n)
    # np.lexsort sorts by the last key first; negate to keep the largest, keys ascending break ties
    order = (np.lexsort((keys, -last_step)) if eviction == "lru"
             else np.lexsort((keys, -last_step, -count)))
    return np.sort(order[:capacity])


class KeyedReshard:
    """Rank ``rank`` of ``world_size``'s KeyedEmbeddings from a global version's rank stores (module doc).

    ``sources``: (store, local version) per writer rank, in rank order; ``trackers``: the local Checkpointer's
    ``KeyedTracker`` s. :meth:`read` reads and checks everything; :meth:`optimizer_value` turns a payload's
    ``KEYED_MARK`` marker into this rank's tensor; :meth:`load` puts the rows into the live modules."""

    def __init__(self, trackers, sources: list, rank: int, world_size: int, version: int):
        self.trackers = list(trackers)
        self.sources = sources
        self.rank, self.world_size, self.version = rank, world_size, version
        self.reads: dict[str, dict] = {}
        #: ids dropped per module (more owned than its capacity)
        self.dropped: dict[str, int] = {}

    def read(self) -> None:
        for k in self.trackers:
            self.reads[k.name] = self._read_module(k)

    def _catalogs(self) -> list[dict]:
        return [store.tables() for store, _v in self.sources]

    def _read_module(self, k) -> dict:
        m = k.module
        catalogs = self._catalogs()
        infos = [c.get(k.name) for c in catalogs]
        if not any(i is not None for i in infos):
            raise InvalidArgument(f"global version {self.version} holds no keyed table {k.name!r} for the model's "
                                  "KeyedEmbedding on any rank")
        for writer, info in enumerate(infos):
            if info is None:
                continue
            if not getattr(info, "keyed", False) or info.dim != m.dim:
                raise InvalidArgument(f"table {k.name!r} of rank {writer}'s store is not a keyed table of dim {m.dim} "
                                      "(the model's KeyedEmbedding); restore into a model of the stored shape")
            if info.partitions != m.partitions:
                raise InvalidArgument(
                    f"keyed table {k.name!r} has {info.partitions} partitions, the model's KeyedEmbedding "
                    f"{m.partitions}: ids are owned by partition, so build it with partitions={info.partitions} "
                    "(the same on every rank and at every world size)")
        rows, _report = keyed_reshard.read_owned(self.sources, k.name, self.rank, self.world_size,
                                                 writers_owned=True)
        keep = keep_by_policy(rows.keys, rows.columns["last_step"], rows.columns["count"], m.capacity, m.eviction)
        if keep.size < rows.keys.size:
            self.dropped[k.name] = int(rows.keys.size - keep.size)
            warnings.warn(f"KeyedEmbedding {k.name!r}: rank {self.rank} of {self.world_size} owns {rows.keys.size} "
                          f"ids of global version {self.version}, more than its capacity {m.capacity}; it keeps the "
                          f"{m.capacity} its eviction policy ({m.eviction!r}) keeps and drops {self.dropped[k.name]}",
                          RuntimeWarning, stacklevel=3)
        slots = np.arange(keep.size)  # (the kept ids, ascending, take slots 0 .. n-1)
        out = keyed_save.slot_tensors(m.capacity, m.dim, slots, rows.keys[keep], rows.values[keep],
                                      rows.columns["last_step"][keep], rows.columns["count"][keep])
        prefix = f"{k.name}.optim."
        names = sorted({n_ for c in catalogs for n_, ti in c.items()
                        if n_.startswith(prefix) and getattr(ti, "keyed", False)})
        for name in names:
            srows, _r = keyed_reshard.read_owned(self.sources, name, self.rank, self.world_size, writers_owned=True)
            if not np.array_equal(srows.keys, rows.keys):
                raise InvalidArgument(f"global version {self.version}: keyed table {name!r} does not hold the ids "
                                      f"{k.name!r} holds on the ranks this rank reads")
            width = srows.values.shape[1] if srows.values.ndim == 2 else 1
            out[name[len(k.name) + 1:]] = keyed_save.state_rows(m.capacity, width, slots, srows.values[keep])
        return out

    def optimizer_value(self, marker: dict):
        """The tensor a payload's ``KEYED_MARK`` marker stands for on this rank: the rows read for its table at
        their new slots, the free slots holding the marker's value, shaped for this rank's module."""
        value = keyed_save.marker_tensor(marker, self.reads)
        if value is None:
            raise InvalidArgument(f"global version {self.version}: optimizer state {marker[KEYED_MARK]!r} of a keyed "
                                  "embedding the model does not have, or whose table is missing")
        return value

    def load(self) -> None:
        """Put the rows read into the live modules (in place) and rebuild their id maps."""
        for k in self.trackers:
            k.load(self.reads[k.name])
