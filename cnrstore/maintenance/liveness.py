"""Row-level liveness: which rows of each row record some retained version still reads.

A retained version k reads, for each block, the records of its read chain (from the newest entry at or
before k back to a baseline, jumping from a cumulative delta to its base), and from each record only the
rows no record before it in the chain holds. A record's *live rows* are the union of those over every
retained version whose chain visits it. A record whose live rows are fewer than its rows holds dead
bytes: GC rewrites it with its live rows only (an LSM merge, bytes copied), under the same index key.
A record a chain walks through but takes no row from (newer records of the chain hold all its rows) is
rewritten with no rows, never freed with its segment: the chain still visits its index entry. A record
larger than a baseline of its block in the table's codec (a costlier codec's, ``merge.outweighs_baseline``)
is wholly live while any row of it is: as a chain's bottom it is what the block's read amplification is
weighed against, and a smaller copy would raise the amplification of the records above it.

What a version reads is unchanged by that rewrite: each retained reader takes from the record exactly
the rows that are kept, and finds the others in the same records as before.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable

import numpy as np

from ..engine import blocks as blocks_math
from ..engine import chain as chain_rule
from ..engine import merge, record
from ..engine.index import IndexView, RowLoc
from ..engine.reader import check_offsets
from ..engine.schema import TableRecord


@dataclass
class Liveness:
    """``partial``: (table id, block, version) -> sorted block offsets of the live rows of a row record
    that holds dead rows too (records not listed are wholly live or not read at all); ``live_bytes``:
    segment -> bytes of live data in it, a partial record counted for its live rows only (and never as
    less than a record header)."""

    partial: dict[tuple[int, int, int], np.ndarray] = field(default_factory=dict)
    live_bytes: dict[int, int] = field(default_factory=dict)


def row_liveness(view: IndexView, load: Callable[[RowLoc], record.Record], kept: Iterable[int],
                 pinned: set = frozenset()) -> Liveness:
    """Liveness of every row record the index names, for the retained versions ``kept``.

    ``load(loc)`` returns the checksum-verified record at ``loc`` (only records that some chain visits
    past its head are loaded: their rows are needed to know what they shadow). Entries in ``pinned``
    (bases an open checkpoint's deltas will read) count as wholly live. One pass over the row index;
    each record is visited once per distinct chain through it (at most the read-chain bound).
    """
    kept_arr = np.asarray(sorted(kept), dtype=np.int64)
    tables = {info.id: info for info in view.tables().values()}
    result = Liveness()
    block_key = None
    entries: list[tuple[int, RowLoc]] = []

    def flush():
        if block_key is not None:
            _block(result, tables[block_key[0]], block_key, entries, kept_arr, load, pinned)

    for tid, block, version, loc in view.row_entries():
        if (tid, block) != block_key:
            flush()
            block_key, entries = (tid, block), []
        entries.append((version, loc))
    flush()
    return result


def _block(result: Liveness, info: TableRecord | None, key: tuple[int, int], entries: list, kept: np.ndarray,
           load, pinned) -> None:
    tid, block = key
    versions = np.fromiter((v for v, _loc in entries), dtype=np.int64, count=len(entries))
    starts = np.unique(np.searchsorted(versions, kept, side="right") - 1)
    starts = starts[starts >= 0].tolist()
    position = {v: i for i, v in enumerate(versions.tolist())}
    flags = [loc.flags for _v, loc in entries]
    bases = [loc.base for _v, loc in entries]
    # each distinct read chain of a kept version, newest record first
    chains = [list(chain_rule.walk(flags, bases, position, i)) for i in starts]
    read = {i for walked in chains for i in walked}
    live: dict[int, np.ndarray | None] = {}  # entry -> live offsets, None = wholly live
    heads = {walked[0] for walked in chains}
    for i, (v, _loc) in enumerate(entries):
        if (tid, block, v) in pinned:
            read.add(i)
    for i in range(len(entries)):
        if i not in read:
            live[i] = None  # no kept version reads it (drop_versions deletes such entries): never freed here
    for i in read:
        if i in heads or (tid, block, entries[i][0]) in pinned or info is None or info.keyed:
            # (a key run is wholly live while any chain reads it: which of its keys newer runs shadow is not
            # worth a rewrite; compaction's baselines and the saves' merged ones leave the old runs unread)
            live[i] = None  # a chain's head: every row of it is read
        elif merge.outweighs_baseline(info, block, entries[i][1]):
            live[i] = None  # kept whole: what the read amplification above it is weighed against
    if any(i not in live for i in read):
        block_len = blocks_math.length(block, info.block_rows, info.num_rows)
        offsets: dict[int, np.ndarray] = {}

        def rows_of(i):
            if i not in offsets:
                loc = entries[i][1]
                rec = load(loc)
                check_offsets(rec, block_len, f"segment {loc.segment}", loc.offset)  # a crafted catalog
                offsets[i] = rec.offsets()
            return offsets[i]

        for walked in chains:
            if all(live.get(i, 0) is None for i in walked):
                continue
            covered = np.zeros(block_len, dtype=bool)
            for i in walked:
                rows = rows_of(i)
                if live.get(i, 0) is not None:
                    fresh = rows[~covered[rows]]
                    live[i] = fresh if i not in live else np.union1d(live[i], fresh)
                covered[rows] = True
        for i, rows in list(live.items()):
            if rows is not None and rows.size == entries[i][1].count:
                live[i] = None
    for i, rows in live.items():
        v, loc = entries[i]
        if rows is None:
            result.live_bytes[loc.segment] = result.live_bytes.get(loc.segment, 0) + loc.length
        else:
            result.partial[(tid, block, v)] = rows
            # never 0: a chain still walks through a record none of whose rows it reads, so its segment
            # must not be freed under it; cleaning rewrites it with no rows (a header and a checksum)
            share = max(loc.length * rows.size // max(1, loc.count), record.HEADER_BYTES + record.TRAILER_BYTES)
            result.live_bytes[loc.segment] = result.live_bytes.get(loc.segment, 0) + share
