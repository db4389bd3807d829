"""cnrstore/distributed/stripes.py: ECRM's parity layout and fingerprints, every rank's data space
simulated in one process (the erasure code itself: test_ecrm.py's field and matrix tests)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from cnrstore.distributed import gf256
from cnrstore.distributed.stripes import (MAX_UNIT_WORDS, StripeLayout, fingerprint, fingerprint_blocks,
                                          fingerprint_range, fingerprint_runs)
from cnrstore.errors import InvalidArgument


def test_bad_layouts_are_refused():
    with pytest.raises(InvalidArgument, match="k \\+ r <= world"):
        StripeLayout(3, 2, 2, [10, 10, 10])
    with pytest.raises(InvalidArgument, match="positive integer k"):
        StripeLayout(3, 0, 1, [10, 10, 10])
    with pytest.raises(InvalidArgument, match="positive integer r"):
        StripeLayout(3, 2, True, [10, 10, 10])
    with pytest.raises(InvalidArgument, match="every rank's data words"):
        StripeLayout(3, 2, 1, [10, 10])
    with pytest.raises(InvalidArgument, match="every rank's data words"):
        StripeLayout(3, 2, 1, [10, -1, 10])


def test_the_default_unit_spreads_the_longest_data_space_over_k_units_up_to_a_cap():
    lay = StripeLayout(3, 2, 1, [10, 0, 7])
    assert (lay.unit, lay.periods, lay.data_words, lay.parity_words) == (5, 1, 10, 5)
    big = StripeLayout(3, 2, 1, [3 * MAX_UNIT_WORDS, 0, 0])
    assert big.unit == MAX_UNIT_WORDS and big.periods == 2 and big.data_words >= 3 * MAX_UNIT_WORDS
    empty = StripeLayout(2, 1, 1, [0, 0])
    assert empty.unit == 1 and empty.periods == 1


def test_split_cuts_ranges_at_unit_boundaries_and_drops_empty_ones():
    lay = StripeLayout(3, 2, 1, [100, 100, 100], unit_words=4)
    starts, lens = lay.split(np.array([0, 3, 9, 20]), np.array([4, 6, 0, 1]))
    assert list(zip(starts.tolist(), lens.tolist())) == [(0, 4), (3, 1), (4, 4), (8, 1), (20, 1)]
    same = lay.split(np.array([1, 8]), np.array([2, 4]))     # already inside one unit each: unchanged
    assert [a.tolist() for a in same] == [[1, 8], [2, 4]]


def test_a_changed_data_space_asks_for_a_rebuild():
    lay = StripeLayout(3, 2, 1, [10, 11, 12])
    lay.check_lengths([10, 11, 12])
    with pytest.raises(InvalidArgument, match="rebuild"):
        lay.check_lengths([10, 11, 13])


def encode_all(lay: StripeLayout, data: list[np.ndarray]) -> list[np.ndarray]:
    """Every rank's parity, straight from the definition (module doc of stripes)."""
    w = lay.world_size
    parity = [np.zeros((lay.periods, lay.r, lay.unit), dtype=np.uint32) for _ in range(w)]
    for q in range(w):
        view = padded(lay, data[q])
        for i in range(lay.k):
            c = lay.residue(q, i)
            for j in range(lay.r):
                h = int(lay.holder(c, j))
                parity[h][:, j, :] ^= gf256.mul(lay.matrix[j, i], view[:, i, :].copy().view(np.uint8)).view(np.uint32)
    return parity


def padded(lay: StripeLayout, words: np.ndarray) -> np.ndarray:
    out = np.zeros(lay.data_words, dtype=np.uint32)
    out[:words.size] = words
    return out.reshape(lay.periods, lay.k, lay.unit)


@pytest.mark.parametrize("world,k,r,unit", [(3, 2, 1, None), (4, 2, 2, 7), (5, 3, 2, 5), (6, 2, 1, 3), (2, 1, 1, None)])
def test_layout_rotates_parity_and_recovers_any_r_failures(world, k, r, unit):
    rng = np.random.default_rng(world * 10 + k)
    lengths = [int(n) for n in rng.integers(30, 90, world)]   # ranges below must not overlap
    lay = StripeLayout(world, k, r, lengths, unit_words=unit)
    assert lay.parity_words == lay.periods * r * lay.unit
    assert lay.data_words >= max(lengths) and lay.data_words - max(lengths) < k * lay.unit
    for c in range(world):                              # a stripe's ranks are distinct
        ranks = [m[0] for m in lay.members(c)]
        assert len(set(ranks)) == k + r
    # every rank holds parity of r residues and data of k: rotated, no hot spot
    held = [sum(1 for c in range(world) for j in range(r) if lay.holder(c, j) == q) for q in range(world)]
    assert held == [r] * world
    data = [rng.integers(0, 2**32, n, dtype=np.uint32) for n in lengths]
    parity = encode_all(lay, data)
    # an update routed piece by piece lands where the definition puts it
    q = 1 % world
    starts = np.array([0, 5, lengths[q] - 9], dtype=np.int64)
    lens = np.array([3, 11, 9], dtype=np.int64)
    delta = rng.integers(0, 2**32, int(lens.sum()), dtype=np.uint32)
    ps, pl = lay.split(starts, lens)
    assert pl.sum() == lens.sum() and ((ps % lay.unit) + pl <= lay.unit).all()
    offsets = np.cumsum(pl) - pl
    for j in range(r):
        dest, ppos, index = lay.route(q, ps, j)
        for s0, n, o, d, pp, i in zip(ps, pl, offsets, dest, ppos, index):
            parity[d].reshape(-1)[pp:pp + n] ^= gf256.mul(lay.matrix[j, i], delta[o:o + n].copy().view(np.uint8)).view(np.uint32)
    flat = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, lens)])
    data[q][flat] ^= delta
    expect = encode_all(lay, data)
    for h in range(world):
        assert np.array_equal(parity[h], expect[h])
    # any r failed ranks: decode their data from k survivors of each stripe
    for failed in itertools.combinations(range(world), r):
        for f in failed:
            got = np.zeros((lay.periods, k, lay.unit), dtype=np.uint32)
            for i in range(k):
                members = lay.members(lay.residue(f, i))
                avail = [m for m in members if m[0] not in failed][:k]
                shard = [m[2] if m[1] == "data" else k + m[2] for m in avail]
                dm = gf256.decode_matrix(k, r, shard)
                for col, (rank, kind, idx) in enumerate(avail):
                    block = padded(lay, data[rank])[:, idx, :] if kind == "data" else parity[rank][:, idx, :]
                    got[:, i, :] ^= gf256.mul(dm[i, col], block.copy().view(np.uint8)).view(np.uint32)
            assert np.array_equal(got.reshape(-1)[:lengths[f]], data[f]), (failed, f)


def test_fingerprint_is_linear_and_sees_one_flipped_bit():
    rng = np.random.default_rng(3)
    a = rng.integers(0, 2**32, 1000, dtype=np.uint32)
    b = rng.integers(0, 2**32, 1000, dtype=np.uint32)
    pos = np.arange(1000)
    assert fingerprint(a ^ b, pos) == fingerprint(a, pos) ^ fingerprint(b, pos)
    for i in (0, 31, 32, 999):
        c = a.copy()
        c[i] ^= 1 << (i % 32)
        assert fingerprint(c, pos) != fingerprint(a, pos)
    assert fingerprint(a[10:20], pos[10:20]) ^ fingerprint(a[:10], pos[:10]) == fingerprint(a[:20], pos[:20])


@pytest.mark.parametrize("start", [0, 1, 30, 31, 32, 33, 961, 12345])
@pytest.mark.parametrize("n", [0, 1, 30, 31, 32, 63, 993, 4097])
def test_fingerprint_of_a_range_equals_the_general_one(start, n):
    words = np.random.default_rng(n + start).integers(0, 2**32, n, dtype=np.uint32)
    assert fingerprint_range(words, start) == fingerprint(words, start + np.arange(n))


@pytest.mark.parametrize("seed", range(4))
def test_fingerprint_of_runs_equals_the_general_one(seed):
    rng = np.random.default_rng(seed)
    lens = rng.integers(0, 70, 50)
    starts = np.cumsum(lens + rng.integers(0, 40, 50)) + int(rng.integers(0, 10**9))
    words = rng.integers(0, 2**32, int(lens.sum()), dtype=np.uint32)
    pos = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, lens)])
    assert fingerprint_runs(words, starts, lens) == fingerprint(words, pos)
    assert fingerprint_runs(words[:0], starts[:0], lens[:0]) == 0


@pytest.mark.parametrize("g", [1, 2, 3, 16, 31, 32, 33, 64])
def test_fingerprint_of_blocks_equals_the_general_one(g):
    rng = np.random.default_rng(g)
    blocks = rng.choice(10**7, 200, replace=False)            # any order, as a step's blocks come
    words = rng.integers(0, 2**32, (200, g), dtype=np.uint64).astype(np.uint32)
    pos = (blocks[:, None] * g + np.arange(g)).reshape(-1)
    assert fingerprint_blocks(words, blocks) == fingerprint(words.reshape(-1), pos)
    assert fingerprint_blocks(words[:0], blocks[:0]) == 0
    flipped = words.copy()
    flipped[7, g - 1] ^= np.uint32(1 << 5)
    assert fingerprint_blocks(flipped, blocks) != fingerprint_blocks(words, blocks)
    with pytest.raises(InvalidArgument, match="blocks for words"):
        fingerprint_blocks(words, blocks[:-1])


def test_a_block_rounds_the_default_unit_up_and_must_divide_a_given_one():
    lay = StripeLayout(3, 2, 1, [100, 90, 7], block=16)
    assert lay.block == 16 and lay.unit == 64 and lay.data_words % 16 == 0 and lay.parity_words % 16 == 0
    assert StripeLayout(3, 2, 1, [100, 90, 7]).unit == 50          # no block: as before
    assert StripeLayout(2, 1, 1, [3 * MAX_UNIT_WORDS, 0], block=12).unit % 12 == 0
    assert StripeLayout(3, 2, 1, [100, 90, 7], unit_words=48, block=16).unit == 48
    with pytest.raises(InvalidArgument, match="multiple of the block"):
        StripeLayout(3, 2, 1, [100, 90, 7], unit_words=40, block=16)
    with pytest.raises(InvalidArgument, match="block must be a positive integer"):
        StripeLayout(3, 2, 1, [100, 90, 7], block=0)

