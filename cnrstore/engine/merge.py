"""Merge-on-write: the deltas that keep every block's read chain short (format 3).

A checkpoint's increment of block b normally adds one record to b's read chain. When the chain at the
parent version already holds ``knobs.READ_CHAIN_BOUND`` records, the checkpoint instead writes one merged
record, flagged ``record.FLAG_DELTA`` with a *base* version that a read jumps to:

- a **delta on the chain's cumulative delta D** (two levels, size-tiered): its own rows plus the rows of
  the records above D, while those are fewer than ``knobs.DELTA_TIER_RATIO`` times D's rows; read as it,
  D and the baseline (three records), and D's rows are not copied again;
- else a **cumulative delta on the baseline**: its own rows plus every row changed since the baseline
  (newest value of each); read as it and the baseline;
- or a **new baseline** of the block, once the block's merges have copied ``knobs.DELTA_RESET_FRACTION``
  of the block since its baseline (a ski-rental rule: copies never cost more than twice the best choice
  in hindsight), or the merge would hold ``knobs.DELTA_FULL_FRACTION`` of the block anyway: every row,
  the untouched ones copied from the old baseline. This is Check-N-Run's reset rule applied per block to
  the real union of changed rows.

Stored bytes are copied, never re-quantized; a merge mixing codecs is stored as fp32 of each row's
decoded value, which decodes bit-identically. Each delta records the rows its block's merges copied
since the baseline (``record.Record.copied``), which the reset rule weighs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import codecs, knobs
from . import record
from .index import IndexView, RowLoc
from .reader import BlockResolver


@dataclass
class ChainMerge:
    """What a checkpoint merges into its record of one block: the chain at the parent version."""

    records: list  # (version, RowLoc) of the chain's non-baseline records, newest first (up to 2 deltas)
    baseline: tuple | None  # (version, RowLoc) of the chain's baseline, None if the chain has none


def chain_merge(view: IndexView, table_id: int, block: int, parent: int | None) -> ChainMerge | None:
    """The merge a new version's record of ``block`` needs (None: a plain increment keeps the chain within
    ``knobs.READ_CHAIN_BOUND``, at least 2). Reads the block's read chain at ``parent`` (index entries only)."""
    bound = knobs.READ_CHAIN_BOUND
    if bound is None or parent is None:
        return None
    chain: list[tuple[int, RowLoc]] = []
    baseline = None
    for v, loc in view.row_chain(table_id, block, parent):
        if loc.flags & record.FLAG_BASELINE:
            baseline = (v, loc)
            break
        chain.append((v, loc))
    if len(chain) + (baseline is not None) + 1 <= max(2, bound):
        return None
    return ChainMerge(chain, baseline)


@dataclass
class Merged:
    """A block's record after merging: codec, sorted block offsets, aligned encoded rows, its delta base
    (0 when it is a baseline) and how many of its rows were carried from older records."""

    codec: object
    offsets: np.ndarray
    encoded: np.ndarray
    base: int
    carried: np.ndarray  # offsets of the rows carried from older records (sorted)
    copied: int = 0  # of a delta: rows the block's deltas copied since its base, this one's included


def merge_block(resolver: BlockResolver, block: int, block_len: int, merge: ChainMerge, codec, offsets: np.ndarray,
                encoded: np.ndarray) -> Merged:
    """Merge a version's rows of ``block`` (``offsets`` sorted unique, ``encoded`` by ``codec``) with the
    chain ``merge`` describes. Every record read is checksum-verified; bytes are copied.

    Two levels, size-tiered: if the chain holds a cumulative delta D (on the baseline) and the records
    above it hold, with this version's rows, fewer rows than ``knobs.DELTA_TIER_RATIO`` times D, they are
    merged into a delta *on D* (read: it, D, the baseline), copying only the rows above D. Otherwise
    everything since the baseline is merged into a new cumulative delta on the baseline (or, once the
    block's merges have copied ``knobs.DELTA_RESET_FRACTION`` of the block since it, a new baseline).
    """
    records = list(merge.records)
    loaded = [(v, loc) + resolver.load_rows(loc, block, v) for v, loc in records]
    copied_before = max((rec.copied() for _v, _loc, rec, _rows in loaded), default=0)
    base_version = merge.baseline[0] if merge.baseline is not None else 0
    # the level-2 record: the oldest of the chain, if it is a cumulative delta on the baseline
    level2 = len(loaded) - 1 if loaded and base_version and loaded[-1][1].base == base_version else None
    own = [(codec.codec_id, offsets, encoded)]  # newest first: the first occurrence of a row wins
    if level2 is not None and level2 > 0 and knobs.READ_CHAIN_BOUND >= 3:
        upper = own + [(rec.codec_id, rec.offsets(), rows) for _v, _loc, rec, rows in loaded[:level2]]
        upper_rows = np.unique(np.concatenate([p[1] for p in upper]))
        if upper_rows.size < knobs.DELTA_TIER_RATIO * loaded[level2][2].count:
            copied = copied_before + upper_rows.size - offsets.size
            return _merged(upper, codec, resolver.dim, offsets, loaded[level2][0], copied)
    parts = own + [(rec.codec_id, rec.offsets(), rows) for _v, _loc, rec, rows in loaded]
    union = np.unique(np.concatenate([p[1] for p in parts]))
    copied = copied_before + union.size - offsets.size
    if merge.baseline is not None and (copied >= knobs.DELTA_RESET_FRACTION * block_len
                                       or union.size >= knobs.DELTA_FULL_FRACTION * block_len):
        v, loc = merge.baseline
        rec, rows = resolver.load_rows(loc, block, v)
        parts.append((rec.codec_id, rec.offsets(), rows))
        return _merged(parts, codec, resolver.dim, offsets, 0, 0)  # a new baseline: every row the block has
    return _merged(parts, codec, resolver.dim, offsets, base_version, copied)


def _merged(parts: list, codec, dim: int, offsets: np.ndarray, base: int, copied: int) -> Merged:
    """The record holding each row of ``parts`` (newest first) once, as its first part has it."""
    all_offsets = np.concatenate([p[1] for p in parts])
    merged_offsets, first = np.unique(all_offsets, return_index=True)
    if len({p[0] for p in parts}) == 1:
        merged_codec = codec if parts[0][0] == codec.codec_id else codecs.by_id(parts[0][0])
        merged = np.concatenate([p[2] for p in parts])[first]
    else:  # several codecs: fp32 of each row's decoded value reads back bit-identically
        merged_codec = codecs.get("fp32")
        decoded = np.concatenate([codecs.by_id(cid).decode(rows, dim) for cid, _o, rows in parts])[first]
        merged = merged_codec.encode(decoded, check=False)
    carried = np.setdiff1d(merged_offsets, offsets, assume_unique=True)
    return Merged(merged_codec, merged_offsets, np.ascontiguousarray(merged), base, carried, copied if base else 0)
