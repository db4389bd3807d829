"""Searched-range uniform codecs (adaptive2/3/4) and per-row codebook codecs (kmeans2/3/4): layout,
error (against the uniform codecs and FBGEMM's greedy search), determinism, row independence, input
validation. The round trip is test_codecs.py's (tests/support/codec_bounds.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings

from cnrstore import codecs
from cnrstore.codecs import adaptive, kmeans, nbit
from cnrstore.errors import InvalidArgument

from support.codec_bounds import roundtrip

BITS = {"adaptive2": 2, "adaptive3": 3, "adaptive4": 4, "kmeans2": 2, "kmeans3": 3, "kmeans4": 4}
IDS = {"adaptive2": 11, "adaptive3": 12, "adaptive4": 13, "kmeans2": 14, "kmeans3": 15, "kmeans4": 16}
ADAPTIVE = ["adaptive2", "adaptive3", "adaptive4"]
KMEANS = ["kmeans2", "kmeans3", "kmeans4"]
NAMES = ADAPTIVE + KMEANS
UNIFORM = {2: "int2", 3: "int3", 4: "int4"}
FP16_MAX = 65504.0

prop = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def row_l2(x, y):
    return np.sqrt(((y.astype(np.float64) - x.astype(np.float64)) ** 2).sum(axis=1))


def embedding_rows(n, dim, seed=0):
    """Embedding-like rows: N(0, sigma) with sigma log-uniform in [1e-3, 1]; 15% Student-t (3 dof)
    rows, 10% rows with one value 8x out."""
    rng = np.random.default_rng(seed)
    sigma = 10.0 ** rng.uniform(-3, 0, size=(n, 1))
    x = rng.standard_normal((n, dim)) * sigma
    kind = rng.random(n)
    t = kind < 0.15
    x[t] = rng.standard_t(3, size=(t.sum(), dim)) * sigma[t]
    o = (kind >= 0.15) & (kind < 0.25)
    x[o, rng.integers(0, dim, o.sum())] *= 8
    return x.astype(np.float32)


# -- strategies (tests/support/codec_strategies.py) -----------------------------------------------------------

from support.codec_strategies import raw_rows, row_batches  # noqa: E402  (shared strategies)


# -- the documented layouts, decoded independently -----------------------------------------------------

def unpack_bitstream(raw, dim, bits):
    """Levels (n, dim) from little-endian bitstreams: value j at bits [j*bits, (j+1)*bits)."""
    bitpos = np.arange(dim)[:, None] * bits + np.arange(bits)[None, :]  # (dim, bits)
    stream = np.unpackbits(raw, axis=1, bitorder="little")
    return (stream[:, bitpos] << np.arange(bits)).sum(axis=2)


def layout_decode(name, enc, dim):
    """(levels, float64 parameters) parsed from the documented layout, and the decoded values."""
    bits = BITS[name]
    raw = np.frombuffer(enc.tobytes(), np.uint8).reshape(enc.shape)
    nb = -(-dim * bits // 8)
    q = unpack_bitstream(raw[:, :nb], dim, bits)
    tail = np.frombuffer(raw[:, nb:].tobytes(), "<f2").reshape(len(raw), -1).astype(np.float64)
    if name in ADAPTIVE:
        scale, bias = tail[:, 0:1], tail[:, 1:2]
        # float32 arithmetic: scale * q is exact, the add rounds once
        values = (q * scale).astype(np.float32) + bias.astype(np.float32)
        return q, tail, values.astype(np.float64)
    return q, tail, np.take_along_axis(tail, q, axis=1)


# -- registry and layout -----------------------------------------------------------------------------------

def test_registered_with_their_on_disk_ids_and_fallbacks():
    for name in NAMES:
        c = codecs.get(name)
        assert c.codec_id == IDS[name] and codecs.by_id(IDS[name]) is c
        assert c.fallback == "int8" and not c.lossless
    assert {n: codecs.get(n).codec_id for n in NAMES} == IDS


@pytest.mark.parametrize("name", NAMES)
def test_row_bytes(name):
    c = codecs.get(name)
    bits = BITS[name]
    rng = np.random.default_rng(0)
    for dim in list(range(1, 18)) + [63, 64, 65, 1024]:
        want = -(-dim * bits // 8) + (4 if name in ADAPTIVE else 2 * (1 << bits))
        assert c.row_bytes(dim) == want
        enc = c.encode(rng.standard_normal((3, dim)))
        assert enc.dtype == np.uint8 and enc.flags.c_contiguous and enc.shape == (3, want)
    assert codecs.get("adaptive4").row_bytes(64) == codecs.get("int4").row_bytes(64) == 36
    assert codecs.get("kmeans4").row_bytes(64) == 64


@pytest.mark.parametrize("name", NAMES)
@prop
@given(x=row_batches())
def test_layout_is_as_documented(name, x):
    c = codecs.get(name)
    dim = x.shape[1]
    enc = c.encode(x)
    q, params, values = layout_decode(name, enc, dim)
    assert np.array_equal(c.decode(enc, dim).astype(np.float64), values)
    bits = BITS[name]
    nb = -(-dim * bits // 8)
    pad_bits = np.unpackbits(enc[:, :nb], axis=1, bitorder="little")[:, dim * bits :]
    assert not pad_bits.any()  # zero padding bits
    x64 = x.astype(np.float64)
    if name in ADAPTIVE:
        # the levels are FBGEMM's rule on the stored (fp16) scale and bias: the nearest grid point
        scale, bias = params[:, 0:1].astype(np.float32), params[:, 1:2].astype(np.float32)
        want = np.clip(np.rint((x - bias) * (np.float32(1) / scale)), 0, (1 << bits) - 1)
        assert np.array_equal(q, want)
    else:
        # ascending centroids; each value at its nearest one
        assert (np.diff(params, axis=1) >= 0).all()
        dist = np.abs(x64[:, :, None] - params[:, None, :])
        best = dist.min(axis=2)
        got = np.abs(x64 - values)
        assert (got <= best + 2.0**-23 * np.abs(x64)).all()


def test_hand_built_rows_decode():
    # adaptive4: levels 1, 15, 0 (odd dim, zero high nibble); scale 0.5; bias -1.0
    row = np.array([[0xF1, 0x00, *np.float16(0.5).tobytes(), *np.float16(-1.0).tobytes()]], np.uint8)
    assert codecs.get("adaptive4").decode(row, 3).tolist() == [[-0.5, 6.5, -1.0]]
    # adaptive2: levels 3, 0, 2, 1, 2 -> bits 11 00 10 01 | 10 (little-endian pairs)
    row = np.array([[0b01100011, 0b10, *np.float16(2.0).tobytes(), *np.float16(1.0).tobytes()]], np.uint8)
    assert codecs.get("adaptive2").decode(row, 5).tolist() == [[7.0, 1.0, 5.0, 3.0, 5.0]]
    # adaptive3: levels 0..7 -> 24 bits 0b111_110_101_100_011_010_001_000, little-endian
    v = sum(j << (3 * j) for j in range(8))
    row = np.array([[v & 255, (v >> 8) & 255, v >> 16, *np.float16(0.25).tobytes(), *np.float16(2.0).tobytes()]], np.uint8)
    assert codecs.get("adaptive3").decode(row, 8).tolist() == [[2.0 + 0.25 * j for j in range(8)]]
    # kmeans2: levels 2, 0, 3 (packed 0b11_00_10), centroids -1, 0.5, 3, 100
    cents = np.float16([-1.0, 0.5, 3.0, 100.0]).tobytes()
    row = np.array([[0b110010, *cents]], np.uint8)
    assert codecs.get("kmeans2").decode(row, 3).tolist() == [[3.0, -1.0, 100.0]]
    # kmeans4: two levels a byte, low nibble first
    cents = np.arange(16, dtype=np.float16) * np.float16(0.5)
    row = np.array([[0x3C, 0x0F, *cents.tobytes()]], np.uint8)
    assert codecs.get("kmeans4").decode(row, 4).tolist() == [[6.0, 1.5, 7.5, 0.0]]


@pytest.mark.parametrize("name", ["adaptive4", "adaptive2"])
def test_adaptive_rows_decode_with_fbgemm(name):
    # same layout as FBGEMM's fused n-bit rows: its unpack kernel reads them
    x = embedding_rows(200, 64, seed=3)
    enc = codecs.get(name).encode(x)
    unpack = torch.ops.quantized.embedding_bag_4bit_unpack if name == "adaptive4" else torch.ops.quantized.embedding_bag_2bit_unpack
    fb = unpack(torch.from_numpy(enc)).numpy()
    assert np.array_equal(fb, codecs.get(name).decode(enc, 64))


@pytest.mark.parametrize("name", ADAPTIVE)
def test_rows_keeping_the_full_range_are_the_uniform_codecs(name):
    # rows where the search cannot do better (int-n is exact on them) are encoded as int-n encodes them
    bits = BITS[name]
    uni = codecs.get(UNIFORM[bits])
    grid = np.arange(16, dtype=np.float32) % (1 << bits)
    x = np.stack([np.full(16, 1.25, np.float32), grid, grid * 0.5 - 3, grid[::-1] * 1024])
    assert np.array_equal(uni.decode(uni.encode(x), 16), x)
    assert np.array_equal(codecs.get(name).encode(x), uni.encode(x))


# -- helpers ---------------------------------------------------------------------------------------------

def test_round_fp16_matches_numpy():
    rng = np.random.default_rng(0)
    v = (rng.standard_normal(200_000) * 10.0 ** rng.uniform(-10, 5, 200_000)).astype(np.float32)
    edges = np.float32([0, -0.0, 65504, -65504, 65519.996, 65520, -65520, 2**-14, -(2**-14), 2**-24, 2**-25,
                        3 * 2**-26, 2**-14 - 2**-30, 1e-30, -1e-30, 1e30])
    v = np.concatenate([v, edges, np.nextafter(edges, np.float32(np.inf)), np.nextafter(edges, np.float32(-np.inf))])
    with np.errstate(over="ignore"):
        want = v.astype(np.float16).astype(np.float32)
    got = adaptive.round_fp16(v)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))  # signed zeros included


@pytest.mark.parametrize("bits", [2, 3, 4])
@prop
@given(x=row_batches(max_rows=20))
def test_uniform_qparams_match_the_uniform_codec(bits, x):
    s1, b1 = adaptive.uniform_qparams(x.min(axis=1), x.max(axis=1), bits)
    s2, b2 = nbit.qparams(x.min(axis=1), x.max(axis=1), bits)
    assert np.array_equal(s1, s2.astype(np.float32)) and np.array_equal(b1, b2.astype(np.float32))


# -- error -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ADAPTIVE)
@prop
@given(x=row_batches())
@example(x=np.float32([[1e-30, 2e-30, 1.5e-30]]))
@example(x=np.float32([[1e4, 1e4 + 1e-3, -1e4]]))
@example(x=np.float32([[5.001] * 5]))
@example(x=np.float32([[-1.0, 0.0, 1e4]]))
@example(x=np.float32([[FP16_MAX, -FP16_MAX, 0.0, 1.0]]))
def test_adaptive_row_error_at_most_the_uniform_codecs(name, x):
    # the documented bound: per row, ||x - x̂|| <= ||x - int_n(x)||; so per value too
    y = roundtrip(name, x)
    assert y.dtype == np.float32 and np.isfinite(y).all()
    e = row_l2(x, y)
    eu = row_l2(x, roundtrip(UNIFORM[BITS[name]], x))
    assert (e <= eu).all(), (e, eu)
    assert (np.abs(y.astype(np.float64) - x) <= eu[:, None]).all()


@pytest.mark.parametrize("name", ADAPTIVE)
@prop
@given(x=raw_rows())
def test_adaptive_error_arbitrary_floats(name, x):
    y = roundtrip(name, x)
    assert np.isfinite(y).all()
    assert (row_l2(x, y) <= row_l2(x, roundtrip(UNIFORM[BITS[name]], x))).all()


@pytest.mark.parametrize("name", KMEANS)
@prop
@given(x=row_batches())
@example(x=np.float32([[1e-30, 2e-30, 1.5e-30]]))
@example(x=np.float32([[1e4, 1e4 + 1e-3, -1e4]]))
@example(x=np.float32([[FP16_MAX, -FP16_MAX, 0.0, 1.0]]))
def test_kmeans_error_within_documented_bound(name, x):
    y = roundtrip(name, x)
    assert y.dtype == np.float32 and np.isfinite(y).all()
    x64 = x.astype(np.float64)
    m, M = x64.min(axis=1, keepdims=True), x64.max(axis=1, keepdims=True)
    bound = (M - m) + np.maximum(np.abs(m), np.abs(M)) * 2.0**-11 + 2.0**-25
    assert (np.abs(y - x64) <= bound).all()


@pytest.mark.parametrize("dim", [64, 128])
def test_error_on_embedding_rows_below_uniform(dim):
    x = embedding_rows(1000, dim, seed=dim)
    norm = np.linalg.norm(x.astype(np.float64), axis=1)
    rel = {n: np.mean(row_l2(x, roundtrip(n, x)) / norm) for n in NAMES + ["int2", "int3", "int4"]}
    for bits in (2, 3, 4):
        uni = rel[UNIFORM[bits]]
        assert rel[f"adaptive{bits}"] < 0.97 * uni  # at least 3% lower: in fact 8-35%
        assert rel[f"kmeans{bits}"] < 0.9 * uni  # in fact 15-35% lower
    for name in KMEANS:  # per row: lower, but for fp16 rounding of the centroids
        bits = BITS[name]
        e, eu = row_l2(x, roundtrip(name, x)), row_l2(x, roundtrip(UNIFORM[bits], x))
        assert np.mean(e <= eu) > 0.99


@pytest.mark.parametrize("dim", [64, 128])
def test_adaptive4_matches_fbgemm_greedy_search(dim):
    # The goal: mean L2 error within 1% of FBGEMM's greedy range search (optimized_qparams, 200 bins,
    # ratio 0.16), here on 2000 embedding-like rows.
    x = embedding_rows(2000, dim, seed=7 + dim)
    t = torch.from_numpy(x)
    ops = torch.ops.quantized
    greedy = ops.embedding_bag_4bit_unpack(ops.embedding_bag_4bit_prepack(t, True, 200, 0.16)).numpy()
    ours = roundtrip("adaptive4", x)
    plain = roundtrip("int4", x)
    for err in (row_l2, lambda a, b: row_l2(a, b) / np.linalg.norm(a.astype(np.float64), axis=1)):
        e_g, e_a, e_u = err(x, greedy).mean(), err(x, ours).mean(), err(x, plain).mean()
        assert e_a <= 1.01 * e_g, (e_a / e_g)
        assert e_g < e_u  # the comparison means something: the greedy search beats plain int4


def test_adaptive2_beats_fbgemm_greedy_search():
    # FBGEMM shrinks the range by at most 16%: at 2 bits the best range is much narrower
    x = embedding_rows(1000, 64, seed=11)
    t = torch.from_numpy(x)
    ops = torch.ops.quantized
    greedy = ops.embedding_bag_2bit_unpack(ops.embedding_bag_2bit_prepack(t, True, 200, 0.16)).numpy()
    assert row_l2(x, roundtrip("adaptive2", x)).mean() < 0.85 * row_l2(x, greedy).mean()


# -- determinism and row independence -------------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dim", [7, 64, 1024])
def test_row_independent_across_chunks(name, dim):
    # batches larger than one internal chunk, ending in a chunk of one row
    c = codecs.get(name)
    module = adaptive if name in ADAPTIVE else kmeans
    step = max(2, module._CHUNK_VALUES // dim)
    x = embedding_rows(step + 1, dim, seed=dim)
    enc = c.encode(x)
    for i in (0, 1, step - 1, step):
        assert np.array_equal(enc[i], c.encode(x[i : i + 1])[0])
        assert np.array_equal(enc[i], c.encode(x[i : i + 3])[0])
    assert np.array_equal(enc[step - 5 :], c.encode(x[step - 5 :]))


@pytest.mark.parametrize("name", NAMES)
def test_decode_reads_readonly_views(name):
    c = codecs.get(name)
    x = embedding_rows(5, 33, seed=2)
    enc = c.encode(x)
    ro = enc.copy()
    ro.flags.writeable = False
    out = c.decode(ro, 33)
    assert out.flags.writeable and out.flags.c_contiguous and np.array_equal(out, c.decode(enc, 33))
    with pytest.raises(InvalidArgument):
        c.decode(enc[:, :-1], 33)


# -- non-finite and unrepresentable rows ------------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_rejected_naming_the_row(name, bad):
    x = np.ones((7, 5), np.float32)
    x[3, 2] = bad
    x[6, 4] = bad
    with pytest.raises(InvalidArgument, match=r"\brow 3\b"):
        codecs.get(name).encode(x)


@pytest.mark.parametrize("name", NAMES)
def test_unrepresentable_rows_raise_and_are_flagged(name):
    c = codecs.get(name)
    x = np.zeros((5, 6), np.float32)
    x[2, 1] = -FP16_MAX * 1.5
    x[4, 0] = 70000.0
    x[3, 5] = FP16_MAX  # at the limit: fine
    x[1] = np.float32([-FP16_MAX, FP16_MAX, 0, 1, 2, 3])
    assert c.unrepresentable(x).tolist() == [False, False, True, False, True]
    assert c.unrepresentable(x, value_range=(-1.0, 1.0)).tolist() == [False] * 5
    with pytest.raises(InvalidArgument, match=r"\brow 2\b") as info:
        c.encode(x)
    assert "int8 or fp32" in str(info.value)
    ok = ~c.unrepresentable(x)
    assert np.isfinite(c.decode(c.encode(x[ok]), 6)).all()
    assert not codecs.get(c.fallback).unrepresentable(x).any()


@pytest.mark.parametrize("name", NAMES)
@prop
@given(x=raw_rows(max_abs=2e5, max_dim=12))
def test_unrepresentable_matches_definition(name, x):
    c = codecs.get(name)
    flagged = c.unrepresentable(x)
    assert flagged.tolist() == (np.abs(x.astype(np.float64)).max(axis=1) > FP16_MAX).tolist()
    if not flagged.all():
        assert np.isfinite(c.decode(c.encode(x[~flagged]), x.shape[1])).all()
