"""Merges: the deltas that keep every block's reads bounded by what they cost (format 3).

A checkpoint writes a plain increment of each block it touches: one more record on the block's read
chain. A block's *read amplification* at a version is what reading its chain there costs over what one
baseline of the block costs, a record costing its bytes plus a fixed cost (``record_fixed_cost``: what the
table's codec decodes in ``Options.read_record_cost_s``), so that it tracks a read's time (``read_cost``).
Every record counts at its own bytes, whatever codec it was written in (a ``codec=`` override, a
fallback, a merge mixing codecs and so stored as fp32). One baseline costs every row in the table's codec,
or the chain's bottom record (its baseline, or its oldest record if it has none) if that is larger: a
block whose baseline is in a costlier codec reads at that cost however it is merged (``baseline_cost``).
Once it passes ``Options.merge_trigger`` at the newest version, background compaction merges the block
(maintenance/compaction.py ``merge_chains``); a save merges it itself whenever its record would pass the
hard bounds (``Options.read_amp_bound``, and ``Options.read_chain_bound`` records: ``chain_merge``), even a
record on a lone baseline. A merge writes one record, flagged ``record.FLAG_DELTA`` with a *base* version
that a read jumps to:

- a **delta on the chain's cumulative delta D** (two levels, size-tiered): the rows of the records above
  D, while those are fewer than ``Options.delta_tier_ratio`` times D's rows; read as it, D and the baseline
  (three records), and D's rows are not copied again;
- else a **cumulative delta on the baseline**: every row changed since the baseline (newest value of
  each); read as it and the baseline;
- or a **new baseline** of the block, once the block's merges have copied ``Options.delta_reset_fraction``
  of the block since its baseline (a ski-rental rule: copies never cost more than twice the best choice
  in hindsight), or the merge would hold ``Options.delta_full_fraction`` of the block anyway: every row,
  the untouched ones copied from the old baseline. This is Check-N-Run's reset rule applied per block to
  the real union of changed rows.

Stored bytes are copied, never re-quantized; a merge mixing codecs is stored as fp32 of each row's
decoded value, which decodes bit-identically. Each delta records the rows its block's merges copied
since the baseline (``record.Record.copied``), which the reset rule weighs.

Every tunable comes from the store's ``options`` (a ``cnrstore.Options``, ``Engine.options``), passed to
each function that weighs one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import codecs
from . import blocks as blocks_math
from . import record
from .chain_costs import ChainCost, ChainCosts, Head
from .index import IndexView, RowLoc
from ..options import Options
from .reader import BlockResolver


@dataclass
class ChainMerge:
    """What a merge of one block reads: its read chain at a version."""

    records: list  # (version, RowLoc) of the chain's non-baseline records, newest first
    baseline: tuple | None  # (version, RowLoc) of the chain's baseline, None if the chain has none


def record_fixed_cost(info, options: Options) -> int:
    """What reading one record of table ``info`` costs beyond its bytes, in bytes: those the table's codec
    decodes in ``options.read_record_cost_s`` (``Codec.decode_bytes_per_s``), the time a record's seek,
    verification, gather and decode call take whatever its size."""
    return round(options.read_record_cost_s * codecs.get(info.codec).decode_bytes_per_s)


def baseline_cost(info, block_len: int, options: Options, bottom=None) -> int:
    """What reading one baseline of a block of ``block_len`` rows of table ``info`` costs, in bytes: every
    row in the table's codec, or the chain's bottom record ``bottom`` (a RowLoc: its baseline, or its oldest
    record if it has none) if that is larger, plus a record's fixed cost.

    Why the bottom and not the costliest codec present: a baseline written in a costlier codec (a whole
    block put with ``codec="fp32"``, an fp16 block fallen back to fp32, a merge mixing codecs) is what the
    block costs to read at best until a save rewrites it, so the records above it are weighed against it;
    a record in a costlier codec *above* the baseline is what a merge can take away, so it counts in full
    and never loosens the bound (one fp32 row on an int4 baseline would otherwise allow a chain 6x its
    size at dim 64)."""
    full = record.HEADER_BYTES + record.TRAILER_BYTES + block_len * codecs.get(info.codec).row_bytes(info.dim)
    if bottom is not None:
        full = max(full, bottom.length)
    return full + record_fixed_cost(info, options)


def outweighs_baseline(info, block: int, loc) -> bool:
    """Whether the record at ``loc`` (a RowLoc of ``block``) is larger than a baseline of every row of its
    block in the table's codec (one of a costlier codec holding most of the block). As a chain's bottom
    it is what the block's read amplification is weighed against (``baseline_cost``), so GC keeps its rows
    whole: a copy holding fewer would raise the amplification of the records above it."""
    block_len = blocks_math.length(block, info.block_rows, info.num_rows)
    return loc.length > record.HEADER_BYTES + record.TRAILER_BYTES + block_len * codecs.get(info.codec).row_bytes(info.dim)


def read_cost(locs, fixed: int) -> int:
    """What reading the records ``locs`` (RowLocs) costs, in bytes: theirs plus ``fixed``
    (``record_fixed_cost``) for each."""
    return sum(loc.length for loc in locs) + len(locs) * fixed


def walk_chain(view: IndexView, table_id: int, block: int, version: int) -> ChainMerge:
    """The block's read chain at ``version`` (index entries only), split into its records above the
    baseline and the baseline."""
    chain: list[tuple[int, RowLoc]] = []
    for v, loc in view.row_chain(table_id, block, version):
        if loc.flags & record.FLAG_BASELINE:
            return ChainMerge(chain, (v, loc))
        chain.append((v, loc))
    return ChainMerge(chain, None)


def chain_cost(info, block: int, chain: ChainMerge, options: Options) -> tuple[int, int]:
    """(what reading ``chain`` costs, what reading one baseline of the block costs), in bytes."""
    locs = [loc for _v, loc in chain.records] + ([chain.baseline[1]] if chain.baseline is not None else [])
    block_len = blocks_math.length(block, info.block_rows, info.num_rows)
    return (read_cost(locs, record_fixed_cost(info, options)),
            baseline_cost(info, block_len, options, locs[-1] if locs else None))


def read_amplification(info, block: int, chain: ChainMerge, options: Options) -> float:
    """The block's read amplification over ``chain``: its read cost over one baseline's."""
    cost, reference = chain_cost(info, block, chain, options)
    return cost / reference


def merge_due(info, block: int, chain: ChainMerge, trigger: float, options: Options) -> bool:
    """Whether background compaction merges a block whose read chain is ``chain``: its read amplification
    passes ``trigger``, or its records pass the same fraction (``trigger / options.read_amp_bound``) of
    ``options.read_chain_bound``, or two more records like its newest would pass ``options.read_amp_bound``
    (a block whose records each cost much of a baseline: the next save's record may be larger than the
    newest), so that the save path seldom has to merge."""
    count = len(chain.records) + (chain.baseline is not None)
    amp_bound = options.read_amp_bound or trigger
    if options.read_chain_bound is not None and count > options.read_chain_bound * min(1.0, trigger / amp_bound):
        return True
    cost, reference = chain_cost(info, block, chain, options)
    newest = read_cost([chain.records[0][1]], record_fixed_cost(info, options)) if chain.records else 0
    return cost > trigger * reference or cost + 2 * newest > amp_bound * reference


def chain_head(view: IndexView, table_id: int, block: int, version: int) -> Head | None:
    """Where the block's newest record at ``version`` lies (one index seek); None if it has none."""
    for v, loc in view.row_chain(table_id, block, version):
        return Head(v, loc.segment, loc.offset)
    return None


def chain_merge(view: IndexView, info, block: int, parent: int | None, own_bytes: int, options: Options,
                costs: ChainCosts | None = None, head: Head | None = None) -> ChainMerge | None:
    """The merge a new version's record of ``block`` (``own_bytes``: as it will be written, in the codec it
    will be written in) needs on the save path: None unless the record on top of the chain at ``parent``
    would pass ``options.read_chain_bound`` records or a read amplification of ``options.read_amp_bound``
    (background merges normally keep chains well below both), the latter even on a lone baseline.
    With ``options.read_chain_bound`` None, never. The chain's cost comes from ``costs`` where it remembers
    the chain whose newest record is ``head`` (``chain_head`` at ``parent``), else from walking the chain
    (index entries only), which ``costs`` then remembers; the chain is walked to be returned."""
    bound = options.read_chain_bound
    if bound is None or parent is None:
        return None
    key = (info.id, block)
    known = costs.get(key, head) if costs is not None and head is not None else None
    chain = None
    if known is None:
        chain = walk_chain(view, info.id, block, parent)
        cost, reference = chain_cost(info, block, chain, options)
        known = ChainCost(head, len(chain.records) + (chain.baseline is not None), len(chain.records), cost, reference)
        if costs is not None and head is not None:
            costs.put(key, known)
    if not known.records:
        return None  # the block's first record
    amp_bound = options.read_amp_bound
    fixed = record_fixed_cost(info, options)
    # (on a lone baseline the count bound never asks for a merge; the cost bound does, for a record that
    # alone would pass it: the merge then writes a new baseline)
    if (known.above and known.records + 1 > max(2, bound)) or (
            amp_bound is not None and known.cost + own_bytes + fixed > amp_bound * known.reference):
        return chain if chain is not None else walk_chain(view, info.id, block, parent)
    return None


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
                encoded: np.ndarray, options: Options, budget: float | None = None) -> Merged:
    """Merge a version's rows of ``block`` (``offsets`` sorted unique, ``encoded`` by ``codec``; none for a
    background merge of the chain at a version) with the chain ``merge`` describes. Every record read is
    checksum-verified; bytes are copied.

    Two levels, size-tiered: if the chain holds a cumulative delta D (on the baseline) and the records
    above it hold, with this version's rows, fewer rows than ``options.delta_tier_ratio`` times D, they are
    merged into a delta *on D* (read: it, D, the baseline), copying only the rows above D. Otherwise
    everything since the baseline is merged into a new cumulative delta on the baseline (or, once the
    block's merges have copied ``options.delta_reset_fraction`` of the block since it, a new baseline).

    With a ``budget`` (bytes: what reading the block's chain may cost after the merge, ``read_cost``), the
    cheapest of the three to write whose chain stays within it is taken instead of the tier ratio, so
    that every merge leaves room for many records before the next (``merge_budget``).
    """
    records = list(merge.records)
    fixed = record_fixed_cost(resolver.table, options)
    loaded = [(v, loc) + resolver.load_rows(loc, block, v) for v, loc in records]
    copied_before = max((rec.copied() for _v, _loc, rec, _rows in loaded), default=0)
    base_version = merge.baseline[0] if merge.baseline is not None else 0
    # the level-2 record: the oldest of the chain, if it is a cumulative delta on the baseline
    level2 = len(loaded) - 1 if loaded and base_version and loaded[-1][1].base == base_version else None
    # newest first: the first occurrence of a row wins (a background merge has no rows of its own)
    own = [(codec.codec_id, offsets, encoded)] if offsets.size else []
    # (two or more records become one: a merge always shortens the chain)
    if level2 is not None and len(own) + level2 >= 2 and (options.read_chain_bound or 3) >= 3:
        upper = own + [(rec.codec_id, rec.offsets(), rows) for _v, _loc, rec, rows in loaded[:level2]]
        upper_rows = np.unique(np.concatenate([p[1] for p in upper]))
        if (upper_rows.size < options.delta_tier_ratio * loaded[level2][2].count if budget is None else
                _base_cost(merge, fixed) + read_cost([loaded[level2][1]], fixed)
                + _record_cost(upper, upper_rows.size, resolver.dim, fixed) <= budget):
            copied = copied_before + upper_rows.size - offsets.size
            return _merged(upper, resolver.dim, offsets, loaded[level2][0], copied)
    parts = own + [(rec.codec_id, rec.offsets(), rows) for _v, _loc, rec, rows in loaded]
    union = np.unique(np.concatenate([p[1] for p in parts]))
    copied = copied_before + union.size - offsets.size
    over_budget = (budget is not None
                   and _base_cost(merge, fixed) + _record_cost(parts, union.size, resolver.dim, fixed) > budget)
    if merge.baseline is not None and (copied >= options.delta_reset_fraction * block_len
                                       or union.size >= options.delta_full_fraction * block_len or over_budget):
        v, loc = merge.baseline
        rec, rows = resolver.load_rows(loc, block, v)
        parts.append((rec.codec_id, rec.offsets(), rows))
        return _merged(parts, resolver.dim, offsets, 0, 0)  # a new baseline: every row the block has
    return _merged(parts, resolver.dim, offsets, base_version, copied)


def merged_chain(chain: ChainMerge, version: int, loc: RowLoc) -> ChainMerge:
    """The block's read chain once ``loc``, a merge of ``chain`` (``merge_block``), is its record at
    ``version``: a new baseline alone, or the delta over what it is based on (the chain's cumulative delta
    D and its baseline, or the baseline)."""
    if loc.flags & record.FLAG_BASELINE:
        return ChainMerge([], (version, loc))
    return ChainMerge([(version, loc)] + [(v, d) for v, d in chain.records if loc.base and v == loc.base],
                      chain.baseline)


def merge_budget(bound: float, info, block: int, chain: ChainMerge, options: Options) -> float:
    """The read cost (bytes) a merge triggered at read amplification ``bound`` may leave the block's chain
    at: halfway from one baseline to ``bound``, so that the records until the next merge add at least half
    the room a baseline would leave (a merge never leaves the chain just under its trigger, to be merged
    again a few versions later)."""
    return chain_cost(info, block, chain, options)[1] * (1 + (bound - 1) / 2)


def _base_cost(chain: ChainMerge, fixed: int) -> int:
    return read_cost([chain.baseline[1]], fixed) if chain.baseline is not None else 0


def _record_cost(parts: list, rows: int, dim: int, fixed: int) -> int:
    """What reading a merged delta of ``rows`` rows of ``parts`` costs at most: in the codec ``_merged``
    stores it in (theirs if they share one, else fp32), with its offsets and its base."""
    row_bytes = _merged_codec(parts).row_bytes(dim) + 2  # (+ its u16 offset)
    return record.HEADER_BYTES + record.BASE.size + record.TRAILER_BYTES + rows * row_bytes + fixed


def _merged_codec(parts: list):
    """The codec a record merging ``parts`` is stored in: theirs if they share one, else fp32 (of each
    row's decoded value, which reads back bit-identically)."""
    ids = {p[0] for p in parts}
    return codecs.by_id(ids.pop()) if len(ids) == 1 else codecs.get("fp32")


def _merged(parts: list, dim: int, offsets: np.ndarray, base: int, copied: int) -> Merged:
    """The record holding each row of ``parts`` (newest first) once, as its first part has it."""
    all_offsets = np.concatenate([p[1] for p in parts])
    merged_offsets, first = np.unique(all_offsets, return_index=True)
    merged_codec = _merged_codec(parts)
    if len({p[0] for p in parts}) == 1:
        merged = np.concatenate([p[2] for p in parts])[first]
    else:  # several codecs: fp32 of each row's decoded value reads back bit-identically
        decoded = np.concatenate([codecs.by_id(cid).decode(rows, dim) for cid, _o, rows in parts])[first]
        merged = merged_codec.encode(decoded, check=False)
    carried = np.setdiff1d(merged_offsets, offsets, assume_unique=True)
    return Merged(merged_codec, merged_offsets, np.ascontiguousarray(merged), base, carried, copied if base else 0)
