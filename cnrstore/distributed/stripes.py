"""ECRM's parity layout: which parity word protects which data word, on which rank (docs/DESIGN.md, "ECRM").

Every rank's protected state (its embedding shards and their row-wise optimizer state) is one virtual
array of 32-bit words, its *data space* (``ecrm.ProtectedState`` maps tensors onto it). The data space
of rank ``q`` is cut into *units* of ``U`` words, padded with zeros to ``m · k`` units, viewed as an
``[m, k, U]`` array: unit ``(p, i)`` (period ``p``, index ``i``) is data shard ``i`` of the stripe
``(p, c)`` with residue ``c = (q - r - i) mod W``.

The ranks of the stripes with residue ``c`` are ``c, c+1, ..., c+k+r-1`` (mod ``W``): the first ``r``
hold its parity (slot ``j`` on rank ``(c + j) mod W``), the next ``k`` its data (index ``i`` on rank
``(c + r + i) mod W``). As ``c`` runs over ``0..W-1`` every rank holds parity of ``r`` residues and data
of ``k``: rotated as in RAID-5/6, no rank is a parity hot spot and every rank's parity memory is
``m · r · U`` words, about ``r / k`` of the largest rank's data. A holder's parity is an ``[m, r, U]``
array: slot ``j`` of period ``p`` protects the stripe ``(p, (h - j) mod W)``.

Needs ``k + r <= W`` (a stripe's ranks are distinct) and ``k + r <= 256`` (GF(2^8)).
"""

from __future__ import annotations

import numpy as np

from ..errors import InvalidArgument
from . import gf256

__all__ = ["StripeLayout", "fingerprint", "fingerprint_range", "fingerprint_runs", "fingerprint_blocks"]

#: The largest unit (words): large enough that a unit's bookkeeping is nothing, small enough that the
#: data of one rank is spread over many stripes (and so over every parity holder). A layout with a
#: ``block`` rounds its default unit up to a multiple of the block.
MAX_UNIT_WORDS = 1 << 14


class StripeLayout:
    """The stripes of ``k`` data + ``r`` parity units over ``world_size`` ranks whose data spaces hold
    ``lengths[q]`` words (module doc). Pure arithmetic: the same on every rank.

    ``block``: the unit is a multiple of this many words (the default unit is rounded up to one; a given
    ``unit_words`` must be one), so that a block of ``block`` words aligned in the data space lies in one
    unit and maps to an aligned block of the parity (ECRM's steps move whole blocks)."""

    def __init__(self, world_size: int, k: int, r: int, lengths, unit_words: int | None = None, block: int = 1):
        for name, v in (("world_size", world_size), ("k", k), ("r", r)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise InvalidArgument(f"ECRM needs a positive integer {name}, got {v!r}")
        if k + r > world_size:
            raise InvalidArgument(f"ECRM with k={k} data and r={r} parity shards per stripe needs k + r <= world "
                                  f"size, and the job has {world_size} ranks; choose k + r <= {world_size}")
        if k + r > 256:
            raise InvalidArgument(f"k + r must be at most 256 (a GF(2^8) code), got {k + r}")
        self.world_size, self.k, self.r = int(world_size), int(k), int(r)
        self.lengths = tuple(int(n) for n in lengths)
        if len(self.lengths) != self.world_size or min(self.lengths) < 0:
            raise InvalidArgument(f"lengths must give every rank's data words, got {lengths!r}")
        longest = max(self.lengths)
        if isinstance(block, bool) or not isinstance(block, (int, np.integer)) or block < 1:
            raise InvalidArgument(f"block must be a positive integer, got {block!r}")
        self.block = int(block)
        if unit_words is None:
            unit_words = min(MAX_UNIT_WORDS, max(1, -(-longest // self.k)))
            unit_words = -(-unit_words // self.block) * self.block
        self.unit = int(unit_words)
        if self.unit < 1:
            raise InvalidArgument(f"unit_words must be positive, got {unit_words!r}")
        if self.unit % self.block:
            raise InvalidArgument(f"unit_words ({self.unit}) must be a multiple of the block ({self.block} words)")
        self.periods = max(1, -(-longest // (self.k * self.unit)))
        self.matrix = gf256.encode_matrix(self.k, self.r)

    # -- sizes ---------------------------------------------------------------------------------------
    @property
    def data_words(self) -> int:
        """Words of every rank's padded data space (``m · k · U``)."""
        return self.periods * self.k * self.unit

    @property
    def parity_words(self) -> int:
        """Words of parity every rank holds (``m · r · U``)."""
        return self.periods * self.r * self.unit

    # -- who is where -------------------------------------------------------------------------------
    def residue(self, rank: int, index):
        """The residue of the stripes whose data index ``index`` (int or array) is on ``rank``."""
        return (rank - self.r - index) % self.world_size

    def holder(self, residue, slot):
        """The rank holding parity ``slot`` of the stripes with ``residue`` (ints or arrays)."""
        return (residue + slot) % self.world_size

    def data_rank(self, residue: int, index: int) -> int:
        return (residue + self.r + index) % self.world_size

    def members(self, residue: int) -> list[tuple[int, str, int]]:
        """``(rank, "data" | "parity", index or slot)`` of the stripes with ``residue``: data first."""
        return ([(self.data_rank(residue, i), "data", i) for i in range(self.k)]
                + [(int(self.holder(residue, j)), "parity", j) for j in range(self.r)])

    # -- routing of updates --------------------------------------------------------------------------
    def split(self, starts: np.ndarray, lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Cut word ranges ``[start, start + len)`` at unit boundaries (vectorized): every piece lies in
        one unit. Empty ranges vanish."""
        starts = np.asarray(starts, dtype=np.int64)
        lens = np.asarray(lens, dtype=np.int64)
        keep = lens > 0
        starts, lens = starts[keep], lens[keep]
        u = self.unit
        first = starts // u
        pieces = (starts + lens - 1) // u - first + 1
        if pieces.size == 0 or pieces.max() == 1:
            return starts, lens
        owner = np.repeat(np.arange(starts.size), pieces)
        nth = np.arange(owner.size) - np.repeat(np.cumsum(pieces) - pieces, pieces)
        unit_start = (first[owner] + nth) * u
        lo = np.maximum(starts[owner], unit_start)
        hi = np.minimum(starts[owner] + lens[owner], unit_start + u)
        return lo, hi - lo

    def route(self, rank: int, starts: np.ndarray, slot: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For pieces of ``rank``'s data space starting at ``starts`` (each inside one unit): the rank
        holding parity ``slot`` of each piece's stripe, the piece's position in that rank's parity
        array, and its data index (the column of ``matrix`` giving its coefficient)."""
        unit, index = np.divmod(starts // self.unit, self.k)
        offset = starts % self.unit
        dest = self.holder(self.residue(rank, index), slot)
        return dest, (unit * self.r + slot) * self.unit + offset, index

    def check_lengths(self, lengths) -> None:
        if tuple(int(n) for n in lengths) != self.lengths:
            raise InvalidArgument(f"the ranks' protected state changed size ({self.lengths} words, now "
                                  f"{tuple(lengths)}); rebuild the parity (ECRM.rebuild())")


def _rotl(words: np.ndarray, by: np.ndarray) -> np.ndarray:
    by = (by % 32).astype(np.uint32)
    return (words << by) | (words >> ((32 - by) % 32))


def fingerprint(words: np.ndarray, positions: np.ndarray) -> int:
    """A 64-bit fingerprint of the words at ``positions`` of a data space, linear over GF(2): the
    fingerprint of ``a ^ b`` is that of ``a`` XOR that of ``b``, so a rank keeps its own up to date from
    the code deltas it sends. Two position-rotated XOR folds: any single corrupted word, and any burst
    within 31 words, changes it. Not cryptographic; it finds a stale or damaged parity."""
    words = np.ascontiguousarray(words, dtype=np.uint32).reshape(-1)
    positions = np.asarray(positions, dtype=np.int64).reshape(-1)
    lo = np.bitwise_xor.reduce(_rotl(words, positions), initial=np.uint32(0))
    hi = np.bitwise_xor.reduce(_rotl(words, positions % 31 + 1), initial=np.uint32(0))
    return (int(hi) << 32) | int(lo)


_RAMPS: dict[int, np.ndarray] = {}


def _ramp(period: int, n: int) -> np.ndarray:
    """``arange(n) % period`` as uint8 (a cached, growing array)."""
    ramp = _RAMPS.get(period)
    if ramp is None or ramp.size < n:
        ramp = (np.arange(max(n, 1 << 16) * 2, dtype=np.int64) % period).astype(np.uint8)
        _RAMPS[period] = ramp
    return ramp[:n]


def _run_phase(starts: np.ndarray, lens: np.ndarray, period: int) -> np.ndarray:
    """``(starts[n] + i) % period`` for every word ``i`` of every run, as uint32, without a division per
    word: the runs' phases are repeated and a repeating ``0 .. period-1`` ramp is added (one wrap)."""
    total = int(lens.sum())
    offs = np.cumsum(lens) - lens
    head = ((starts - offs) % period).astype(np.uint8)       # per run: its phase minus its place
    phase = np.repeat(head, lens)
    phase += _ramp(period, total)
    phase -= (phase >= period).view(np.uint8) * np.uint8(period)
    return phase.astype(np.uint32)


def _rotl32(words: np.ndarray, by: np.ndarray) -> np.ndarray:
    """``rotl(words, by)`` for uint32 ``by`` in ``0 .. 32`` (a shift by 32 gives 0 in numpy)."""
    return (words << by) | (words >> (np.uint32(32) - by))


def fingerprint_runs(words: np.ndarray, starts: np.ndarray, lens: np.ndarray) -> int:
    """``fingerprint(words, positions)`` for words at the runs ``[starts[n], starts[n] + lens[n])`` (in order),
    computed per run: no division and no 64-bit temporary per word (a step's code deltas come as runs)."""
    words = np.ascontiguousarray(words, dtype=np.uint32).reshape(-1)
    starts = np.asarray(starts, dtype=np.int64).reshape(-1)
    lens = np.asarray(lens, dtype=np.int64).reshape(-1)
    if int(lens.sum()) != words.size:
        raise InvalidArgument(f"fingerprint_runs: the runs cover {int(lens.sum())} words, the array has {words.size}")
    if words.size == 0:
        return 0
    lo = np.bitwise_xor.reduce(_rotl32(words, _run_phase(starts, lens, 32)))
    by = _run_phase(starts, lens, 31)
    by += np.uint32(1)
    hi = np.bitwise_xor.reduce(_rotl32(words, by))
    return (int(hi) << 32) | int(lo)


_BLOCK_TURNS: dict[tuple[int, int, int], np.ndarray] = {}


def _folded_blocks(words: np.ndarray, blocks: np.ndarray, period: int, shift: int) -> int:
    """``XOR rotl(words[n, j], (blocks[n] · g + j) % period + shift)`` over a ``[n, g]`` array: a word's
    rotation depends on its block only through ``blocks[n] · g % period``, so the rotations are one
    lookup of that class's row in a cached ``[period, g]`` table (no division per word)."""
    g = words.shape[1]
    turns = _BLOCK_TURNS.get((period, shift, g))
    if turns is None:
        turns = ((np.arange(period)[:, None] + np.arange(g)[None, :]) % period + shift).astype(np.uint32)
        turns = _BLOCK_TURNS.setdefault((period, shift, g), turns)
    by = turns[(blocks % period) * (g % period) % period]
    return int(np.bitwise_xor.reduce(_rotl32(words, by).reshape(-1), initial=np.uint32(0)))


def fingerprint_blocks(words: np.ndarray, blocks: np.ndarray) -> int:
    """``fingerprint`` of a ``[n, g]`` array whose row ``n`` holds the words at positions ``blocks[n] · g``
    .. ``blocks[n] · g + g - 1`` (ECRM's code deltas come as blocks): equal to ``fingerprint(words,
    positions)``, without a position array (the rotations come by block: ``_folded_blocks``)."""
    words = np.asarray(words, dtype=np.uint32)
    blocks = np.asarray(blocks, dtype=np.int64).reshape(-1)
    if words.ndim != 2 or words.shape[0] != blocks.size:
        raise InvalidArgument(f"fingerprint_blocks: {blocks.size} blocks for words of shape {words.shape}")
    if words.size == 0:
        return 0
    return (_folded_blocks(words, blocks, 31, 1) << 32) | _folded_blocks(words, blocks, 32, 0)


def _folded(words: np.ndarray, start: int, period: int, shift: int) -> int:
    """``XOR_i rotl(words[i], (start + i) % period + shift)`` in one pass: rotation distributes over XOR,
    so the words that share a rotation are XORed first (an ``[n / period, period]`` view reduced along
    its rows), and only ``period`` words are rotated."""
    head = (-start) % period                      # words before the first position that is 0 mod period
    head = min(head, words.size)
    acc = np.uint32(0)
    if head:
        pos = start + np.arange(head, dtype=np.int64)
        acc ^= np.bitwise_xor.reduce(_rotl(words[:head], pos % period + shift), initial=np.uint32(0))
    body = (words.size - head) // period * period
    if body:
        lanes = np.bitwise_xor.reduce(words[head:head + body].reshape(-1, period), axis=0)
        acc ^= np.bitwise_xor.reduce(_rotl(lanes, np.arange(period, dtype=np.int64) + shift), initial=np.uint32(0))
    tail = words[head + body:]
    if tail.size:
        pos = start + head + body + np.arange(tail.size, dtype=np.int64)
        acc ^= np.bitwise_xor.reduce(_rotl(tail, pos % period + shift), initial=np.uint32(0))
    return int(acc)


def fingerprint_range(words: np.ndarray, start: int) -> int:
    """``fingerprint(words, start + arange(len(words)))``, in one pass over the words and no temporary of
    their size: what a whole data space is fingerprinted with."""
    words = np.ascontiguousarray(words, dtype=np.uint32).reshape(-1)
    start = int(start)
    return (_folded(words, start, 31, 1) << 32) | _folded(words, start, 32, 0)
