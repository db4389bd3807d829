"""Merge-on-write: the cumulative delta records that keep every block's read chain short (format 3).

A checkpoint's increment of block b normally adds one record to b's read chain. When the chain at the
parent version already holds ``knobs.READ_CHAIN_BOUND`` records, the checkpoint instead writes one
*cumulative delta*: its own rows plus every row of the chain's non-baseline records it does not put
(newest value of each), flagged ``record.FLAG_DELTA`` with the version of the chain's baseline. A read
of the new version visits that record and the baseline: two records. When the union reaches
``knobs.DELTA_RESET_FRACTION`` of the block, the record takes the baseline's remaining rows too and is
a new baseline of the block (Check-N-Run's reset rule applied per block to the real union of changed
rows). Stored bytes are copied, never re-quantized; a chain mixing codecs is merged as fp32 of each
row's decoded value, which decodes bit-identically.

The write cost follows the rows that changed: a delta is written at most every other touch of a block
(the bound leaves room for one plain increment on top of a delta), and it carries only the rows the
block changed since its baseline.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import codecs, knobs, record
from .index import IndexView, RowLoc
from .reader import BlockResolver


@dataclass
class ChainMerge:
    """What a checkpoint merges into its record of one block: the chain at the parent version."""

    records: list  # (version, RowLoc) of the chain's non-baseline records, newest first
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
    chain ``merge`` describes. Every record read is checksum-verified; bytes are copied."""
    parts = [(codec.codec_id, offsets, encoded)]  # newest first: the first occurrence of a row wins
    copied_before = 0
    for v, loc in merge.records:
        rec, rows = resolver._load_rows(loc, block, v)
        parts.append((rec.codec_id, rec.offsets(), rows))
        copied_before = max(copied_before, rec.copied())
    union = np.unique(np.concatenate([p[1] for p in parts]))
    copied = copied_before + union.size - offsets.size
    base = merge.baseline[0] if merge.baseline is not None else 0
    if merge.baseline is not None and (copied >= knobs.DELTA_RESET_FRACTION * block_len or union.size == block_len):
        v, loc = merge.baseline
        rec, rows = resolver._load_rows(loc, block, v)
        parts.append((rec.codec_id, rec.offsets(), rows))
        base = copied = 0  # the record is a new baseline: every row the block has
    all_offsets = np.concatenate([p[1] for p in parts])
    merged_offsets, first = np.unique(all_offsets, return_index=True)
    ids = {p[0] for p in parts}
    if len(ids) == 1:
        merged_codec = codec
        merged = np.concatenate([p[2] for p in parts])[first]
    else:  # several codecs: fp32 of each row's decoded value reads back bit-identically
        merged_codec = codecs.get("fp32")
        dim = resolver.dim
        decoded = np.concatenate([codecs.by_id(cid).decode(rows, dim) for cid, _o, rows in parts])[first]
        merged = merged_codec.encode(decoded, check=False)
    carried = np.setdiff1d(merged_offsets, offsets, assume_unique=True)
    return Merged(merged_codec, merged_offsets, np.ascontiguousarray(merged), base, carried, copied if base else 0)
