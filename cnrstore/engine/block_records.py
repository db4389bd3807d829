"""ROWS records of rows grouped by block: what a checkpoint, a merge and a compaction append.

Beneath writer.py and compaction.py (both build records with it); block math itself is in blocks.py.
"""

from __future__ import annotations

import numpy as np

from . import blocks as blocks_math
from .. import knobs
from . import record
from ..errors import InvalidArgument
from .schema import TableRecord


def block_records(info: TableRecord, codec, rows: np.ndarray, encoded: np.ndarray, version: int, *,
                  compacted: bool = False, base: int = 0, copied: int = 0, baseline: bool = False,
                  merged: bool = False) -> list:
    """One ROWS record per block of ``rows`` (sorted, unique; ``encoded`` aligned with them).

    Returns ((block, count, flags), buffers, length) per record; the buffers are views, not copies. A
    record holding every row of its block is a baseline. With ``compacted``, every record is a
    (compacted) baseline: it holds every row written to its block at or before ``version``. With
    ``base`` (rows of one block, merge.py), a record that is not a baseline is a cumulative delta on the
    baseline at version ``base`` (record.FLAG_DELTA). With ``merged`` (a background merge, merge.py), every
    record is flagged COMPACTED (the block's record at ``version``, rewritten) without being made a baseline.
    """
    block_rows, num_rows = info.block_rows, info.num_rows
    shift = blocks_math.shift(block_rows)
    blocks = rows >> shift
    starts, bounds = blocks_math.runs(blocks)
    stops = bounds[1:]
    counts = stops - starts
    bases = blocks[starts] << shift
    complete = baseline
    baseline = counts == blocks_math.lengths(bases, block_rows, num_rows)
    full = baseline | (rows[stops - 1] - bases == counts - 1)  # rows 0..count-1: no offsets needed
    sizes = record.HEADER_BYTES + record.TRAILER_BYTES + np.where(full, 0, 2 * counts) + counts * encoded.shape[1]
    if sizes.max() > knobs.MAX_RECORD_BYTES:
        raise InvalidArgument(f"a block of table {info.name!r} encodes to {int(sizes.max())} bytes, more "
                              "than a record holds; create the table with a smaller block_rows")
    if compacted or complete:
        baseline = np.ones_like(baseline)
    flags = (np.where(full, record.FLAG_FULL, 0) | np.where(baseline, record.FLAG_BASELINE, 0)
             | (record.FLAG_COMPACTED if compacted or merged else 0) | np.where(~baseline & bool(base), record.FLAG_DELTA, 0))
    records = []
    for start, stop, first, flag, is_full in zip(starts.tolist(), stops.tolist(), bases.tolist(),
                                                 flags.tolist(), full.tolist()):
        offsets = None if is_full else rows[start:stop] - first
        buffers, length = record.rows_record(codec.codec_id, flag, info.id, first >> shift, version,
                                             offsets, encoded[start:stop], base if flag & record.FLAG_DELTA else 0,
                                             copied)
        records.append(((first >> shift, stop - start, flag), buffers, length))
    return records
