"""What each block's read chain costs, remembered by the engine so that a save checks its hard read bounds
(merge.chain_merge) without walking every touched block's chain.

An entry is keyed by (table id, block) and valid only for the chain whose newest record is the one it
names (``Head``: version, segment, offset): records are append-only and never rewritten in place, so a
record found at the same place is the same record. A save that writes a plain increment on top of a
remembered head extends the entry by its record (``extend``); anything else that changes a block's head
— a merge, a materialized baseline, a repair — leaves the entry naming an old head, and the next look
walks the chain again. A background merge *below* the head never leaves the chain's read amplification
higher than remembered (compaction.merge_chains): the bound is then checked against a cost at most too
high (a merge a little early), never too low. A compaction or a GC copy below the head may (a chain mixing
codecs materialized as fp32; a baseline of a costlier codec rewritten with fewer rows): the engine
forgets every entry when it commits one (``VersionEdit.rewrites_chains``, ``clear``). Memory: one small
tuple per block written in this process, cleared past ``MAX_ENTRIES``.
"""

from __future__ import annotations

import threading
from typing import NamedTuple


class Head(NamedTuple):
    """Where a block's newest record at some version lies: its version and its place in the log."""

    version: int
    segment: int
    offset: int


class ChainCost(NamedTuple):
    """A block's read chain from ``head`` down: its records (baseline included), those above its baseline,
    its read cost (merge.read_cost) and one baseline's (merge.baseline_cost), in bytes."""

    head: Head
    records: int
    above: int
    cost: int
    reference: int


#: Entries kept at most (one per block written); past it the table starts afresh.
MAX_ENTRIES = 1 << 20


class ChainCosts:
    """The engine's remembered chain costs; safe to use from several threads."""

    def __init__(self):
        self._lock = threading.Lock()
        self._entries: dict[tuple[int, int], ChainCost] = {}

    def get(self, key: tuple[int, int], head: Head) -> ChainCost | None:
        """The cost remembered for block ``key`` if its chain's newest record is still ``head``."""
        with self._lock:
            found = self._entries.get(key)
        return found if found is not None and found.head == head else None

    def put(self, key: tuple[int, int], cost: ChainCost) -> None:
        """Remember ``cost`` for block ``key``."""
        with self._lock:
            if len(self._entries) >= MAX_ENTRIES and key not in self._entries:
                self._entries.clear()
            self._entries[key] = cost

    def clear(self) -> None:
        """Forget every entry (the next look at each block walks its chain)."""
        with self._lock:
            self._entries.clear()

    def extend(self, key: tuple[int, int], below: Head, head: Head, record_cost: int) -> None:
        """A plain record costing ``record_cost`` now lies at ``head`` on block ``key``'s chain, whose
        newest record was ``below``: extend the entry if it was remembered for ``below``."""
        with self._lock:
            found = self._entries.get(key)
            if found is not None and found.head == below:
                self._entries[key] = ChainCost(head, found.records + 1, found.above + 1, found.cost + record_cost,
                                               found.reference)
