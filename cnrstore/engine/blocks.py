"""Block math: which block a row lies in, where a block starts, how long it is, and runs of rows by block.

A table's rows are split into blocks of ``block_rows`` rows (a power of two, docs/FORMAT.md): row ``r``
lies in block ``r >> shift`` at offset ``r - (block << shift)``, where ``shift = log2(block_rows)``; the
last block may be shorter. Every module that maps rows to blocks uses these functions. Pure numpy and
integer arithmetic (no I/O, nothing from cnrstore but ``knobs``); the array functions are vectorized.
"""

from __future__ import annotations

import numpy as np

from .. import knobs


def floor_pow2(n: int) -> int:
    """The largest power of two at most ``n`` (1 for ``n`` < 2)."""
    return 1 << (max(1, n).bit_length() - 1)


def shift(block_rows: int) -> int:
    """log2 of ``block_rows`` (a power of two): ``row >> shift(block_rows)`` is the row's block."""
    return block_rows.bit_length() - 1


def of_rows(rows: np.ndarray, block_rows: int) -> np.ndarray:
    """The block of each row id in ``rows`` (int64 array, same shape)."""
    return rows >> shift(block_rows)


def base(block: int, block_rows: int) -> int:
    """The row id of the block's first row."""
    return block << shift(block_rows)


def count(num_rows: int, block_rows: int) -> int:
    """How many blocks a table of ``num_rows`` rows has (the last may be partial)."""
    return -(-num_rows // block_rows)


def length(block: int, block_rows: int, num_rows: int) -> int:
    """How many rows block ``block`` of a table of ``num_rows`` rows has (``block_rows``, or fewer for
    the last block)."""
    return min(block_rows, num_rows - block * block_rows)


def lengths(bases: np.ndarray, block_rows: int, num_rows: int) -> np.ndarray:
    """``length`` of each block, given the blocks' base rows (vectorized)."""
    return np.minimum(block_rows, num_rows - bases)


def run_starts(blocks: np.ndarray) -> np.ndarray:
    """Indices where a new block begins in ``blocks`` (the blocks of sorted rows, so equal blocks are
    adjacent): one start per distinct block, in order; empty for an empty array."""
    if not blocks.size:
        return np.zeros(0, dtype=np.int64)
    return np.flatnonzero(np.r_[True, blocks[1:] != blocks[:-1]])


def runs(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(starts, bounds) of the runs of equal blocks in ``blocks`` (sorted): run ``i`` is
    ``blocks[bounds[i]:bounds[i + 1]]`` and ``starts == bounds[:-1]``; ``bounds`` ends with ``blocks.size``."""
    starts = run_starts(blocks)
    return starts, np.r_[starts, blocks.size]


def default_block_rows(row_bytes: int, most: int, target_bytes: int, min_rows: int) -> int:
    """The block_rows a table gets when its creator names none: the largest power of two of rows whose
    block of ``row_bytes``-byte encoded rows stays within ``target_bytes`` (the store's
    ``Options.block_target_bytes``), clamped to [``min_rows`` (``Options.min_block_rows``),
    ``knobs.MAX_BLOCK_ROWS``] and to ``most`` (the most rows a record holds)."""
    fit = floor_pow2(target_bytes // row_bytes)
    return min(most, max(min_rows, min(knobs.MAX_BLOCK_ROWS, fit)))
