"""n-bit uniform codecs (int1, int3, int5, int6, int7): layout, FBGEMM equivalence, error bounds,
determinism, row independence, input validation. The error bound and the round trip are test_codecs.py's
(tests/support/codec_bounds.py)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from cnrstore import codecs
from cnrstore.codecs import nbit
from cnrstore.errors import InvalidArgument

from support.codec_bounds import roundtrip, uniform_error_bound

BITS = {"int1": 1, "int3": 3, "int5": 5, "int6": 6, "int7": 7}
NAMES = list(BITS)
IDS = {"int1": 6, "int3": 7, "int5": 8, "int6": 9, "int7": 10}
FP16_MAX = 65504.0

prop = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# -- the documented error bound and representable range, transcribed from the docstrings ---------------

def flagged_by_definition(bits: int, x: np.ndarray) -> np.ndarray:
    """Rows past fp16's range, or whose fp16 scale would overflow (reachable at 1 bit only)."""
    x = x.astype(np.float64)
    m, M = x.min(axis=1), x.max(axis=1)
    out = np.abs(x).max(axis=1) > FP16_MAX
    with np.errstate(over="ignore", invalid="ignore"):
        bias = m.astype(np.float16).astype(np.float64)
        span = (M.astype(np.float32) - bias.astype(np.float32)) / np.float32((1 << bits) - 1)
        # fp16 rounds to inf from 65520 up (the midpoint between 65504 and the next power of two)
        return out | ~np.isfinite(bias) | (np.abs(span.astype(np.float64)) >= 65520.0)


def assert_within_bound(name, x):
    y = roundtrip(name, x)
    assert y.dtype == np.float32 and y.shape == x.shape
    assert np.isfinite(y).all()
    err = np.abs(y.astype(np.float64) - x.astype(np.float64))
    bound = uniform_error_bound(BITS[name], x)
    over = err > bound
    assert not over.any(), (
        f"{name}: error {err[over][:3]} over bound {np.broadcast_to(bound, x.shape)[over][:3]} "
        f"for values {x[over][:3]} in row {np.nonzero(over)[0][0]}"
    )


# -- strategies (tests/support/codec_strategies.py) -----------------------------------------------------------

from support.codec_strategies import dims, raw_rows, row_batches  # noqa: E402  (shared strategies)


def test_registered_with_their_on_disk_ids():
    for name in NAMES:
        c = codecs.get(name)
        assert c.name == name and c.codec_id == IDS[name] and codecs.by_id(IDS[name]) is c
        assert not c.lossless and c.fallback == "int8"
        assert c.bits == BITS[name]
    assert set(NAMES) <= set(codecs.names())


# -- layout --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_row_bytes_matches_layout_and_encode(name):
    c = codecs.get(name)
    b = BITS[name]
    rng = np.random.default_rng(0)
    for dim in list(range(1, 18)) + [63, 64, 65, 128, 1024]:
        assert c.row_bytes(dim) == -(-dim * b // 8) + 4
        enc = c.encode(rng.standard_normal((3, dim)))
        assert enc.dtype == np.uint8 and enc.flags.c_contiguous and enc.shape == (3, c.row_bytes(dim))
    assert [codecs.get(n).row_bytes(64) for n in NAMES] == [12, 28, 44, 52, 60]


def layout_decode(bits: int, enc: np.ndarray, dim: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(values, tolerance, padding bits) straight from the documented layout, with numpy's bit unpacking."""
    raw = np.frombuffer(enc.tobytes(), np.uint8).reshape(enc.shape)
    nb = -(-dim * bits // 8)
    stream = np.unpackbits(raw[:, :nb], axis=1, bitorder="little")  # bit i of the row's stream
    fields = stream[:, : dim * bits].reshape(len(raw), dim, bits).astype(np.int64)
    q = (fields << np.arange(bits)).sum(axis=2).astype(np.float64)
    scale = np.frombuffer(raw[:, nb : nb + 2].tobytes(), "<f2").astype(np.float64)[:, None]
    bias = np.frombuffer(raw[:, nb + 2 :].tobytes(), "<f2").astype(np.float64)[:, None]
    sq = q * scale
    return sq + bias, 2.0**-24 * np.abs(sq + bias), stream[:, dim * bits :]


@pytest.mark.parametrize("name", NAMES)
@prop
@given(x=row_batches())
def test_layout_is_as_documented(name, x):
    c = codecs.get(name)
    dim = x.shape[1]
    enc = c.encode(x)
    ref, tol, padding = layout_decode(BITS[name], enc, dim)
    got = c.decode(enc, dim).astype(np.float64)
    assert (np.abs(got - ref) <= tol).all()
    assert not padding.any()


def f16(v: float) -> list[int]:
    return list(np.float16(v).astype("<f2").tobytes())


def test_byte_examples():
    # levels 0..7 at 3 bits: sum(j << 3j) = 0xFAC688, little-endian; scale fp16(7/7) = 1.0, bias 0.
    assert codecs.get("int3").encode([list(range(8))]).tolist() == [[0x88, 0xC6, 0xFA, 0x00, 0x3C, 0x00, 0x00]]
    # 1 bit: level j at bit j % 8 of byte j // 8; a 9th value starts byte 1
    e = codecs.get("int1").encode([[0, 1, 1, 0, 1, 0, 0, 0, 1]])
    assert e.tolist() == [[0b00010110, 0x01, 0x00, 0x3C, 0x00, 0x00]]
    e = codecs.get("int5").encode([[0.0, 31.0, 1.0]])  # 0 | 31 << 5 | 1 << 10 = 0x07E0
    assert e.tolist() == [[0xE0, 0x07, 0x00, 0x3C, 0x00, 0x00]]
    e = codecs.get("int6").encode([[63.0, 0.0, 63.0, 0.0]])  # 63 | 63 << 12 = 0x03F03F
    assert e.tolist() == [[0x3F, 0xF0, 0x03, 0x00, 0x3C, 0x00, 0x00]]
    e = codecs.get("int7").encode([[-2.0, 125.0]])  # bias -2, scale fp16(127/127) = 1: levels 0, 127
    assert e.tolist() == [[0x80, 0x3F, *f16(1.0), *f16(-2.0)]]  # 127 << 7 = 0x3F80
    e = codecs.get("int3").encode([[0.5, 0.5, 0.5]])  # constant: range 0, so scale 1.0 and levels 0
    assert e.tolist() == [[0x00, 0x00, *f16(1.0), *f16(0.5)]]


# -- the generic code at 4 and 2 bits is FBGEMM's --------------------------------------------------------------

def _fbgemm_levels(name: str, enc: np.ndarray, dim: int) -> np.ndarray:
    bits = 4 if name == "int4" else 2
    per = 8 // bits
    j = np.arange(dim)
    return (enc[:, j // per] >> (bits * (j % per))) & ((1 << bits) - 1)


@pytest.mark.parametrize("name,bits", [("int4", 4), ("int2", 2)])
@prop
@given(x=st.one_of(row_batches(max_abs=FP16_MAX), row_batches(max_abs=1.0, min_exp=-38.0), raw_rows()))
@example(x=np.float32([[1e-30, 2e-30, 1.5e-30, 1e-30]]))
@example(x=np.float32([[0.1, 0.1, 0.1, 0.1], [-0.0, 0.0, -0.0, 0.0], [65504, -65504, 0, 1]]))
def test_generic_equals_fbgemm(name, bits, x):
    fb = codecs.get(name)
    dim = x.shape[1]
    ref = fb.encode(x)
    mine = nbit.encode_uniform(x, bits)
    q, scale, bias = nbit.quantize(x, bits)
    assert np.array_equal(q, _fbgemm_levels(name, ref, dim))
    assert np.array_equal(mine[:, -4:-2], ref[:, -4:-2])  # scale bytes
    assert np.array_equal(mine[:, -4:-2].copy().view("<f2")[:, 0], scale)
    assert np.array_equal(mine[:, -2:].copy().view("<f2")[:, 0], bias)
    # bias: the same fp16, except that ours is +0.0 where FBGEMM's reduction may have found -0.0
    ref_bias = ref[:, -2:].copy().view("<f2")[:, 0]
    assert np.array_equal(bias, ref_bias)  # as numbers: -0.0 == +0.0
    zero_min = x.min(axis=1) == 0  # +-0.0: our bias is +0.0
    assert not np.signbit(bias[zero_min]).any()
    same = ~zero_min | ~np.signbit(ref_bias)
    assert np.array_equal(mine[same, -2:], ref[same, -2:])
    if dim % (8 // bits) == 0:  # no padding: the very same bytes
        assert np.array_equal(mine[same], ref[same])
    assert np.array_equal(nbit.decode_uniform(mine, dim, bits), fb.decode(ref, dim))


# -- bit packing -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bits", range(1, 9))
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_pack_levels_is_the_little_endian_bitstream(bits, data):
    n = data.draw(st.integers(0, 5))
    dim = data.draw(dims)
    seed = data.draw(st.integers(0, 2**32 - 1))
    q = np.random.default_rng(seed).integers(0, 1 << bits, (n, dim), dtype=np.uint8)
    packed = nbit.pack_levels(q, bits)
    stream = np.unpackbits(q[..., None], axis=-1, bitorder="little")[..., :bits].reshape(n, dim * bits)
    assert packed.shape == (n, -(-dim * bits // 8))
    assert np.array_equal(packed, np.packbits(stream, axis=-1, bitorder="little").reshape(packed.shape))
    assert np.array_equal(nbit.unpack_levels(packed, dim, bits), q)


# -- error bounds --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
@prop
@given(x=row_batches())
@example(x=np.float32([[1e-30, 2e-30, 1.5e-30]]))
@example(x=np.float32([[1e4, 1e4 + 1e-3, -1e4]]))
@example(x=np.float32([[5.001] * 5]))
@example(x=np.float32([[-1.0, 0.0, 1e4]]))
@example(x=np.float32([[1e30 * 0]]))
def test_error_within_documented_bound(name, x):
    assert_within_bound(name, x)


@pytest.mark.parametrize("name", NAMES)
@prop
@given(x=raw_rows(max_abs=FP16_MAX / 2))
def test_error_within_bound_arbitrary_floats(name, x):
    assert_within_bound(name, x)


@pytest.mark.parametrize("name", NAMES)
@prop
@given(x=row_batches(max_abs=1.0, min_exp=-38.0))
@example(x=np.float32([[1e-38, 1.1e-38, 1e-45]]))
def test_error_within_bound_tiny_ranges(name, x):
    assert_within_bound(name, x)


@pytest.mark.parametrize("name", NAMES)
@prop
@given(data=st.data())
def test_huge_but_representable_rows(name, data):
    x = data.draw(raw_rows(max_abs=FP16_MAX, max_dim=17))
    sign = data.draw(st.sampled_from([1.0, -1.0]))
    if name == "int1":  # one sign keeps max - min within the 1-bit scale's fp16 range
        x = np.abs(x) * np.float32(sign)
    x[:, 0] = sign * FP16_MAX
    assert not codecs.get(name).unrepresentable(x).any()
    assert_within_bound(name, x)


def test_more_bits_less_error_on_embedding_rows():
    x = np.random.default_rng(5).standard_normal((2000, 64)).astype(np.float32) * np.float32(0.1)
    names = ["int1", "int2", "int3", "int4", "int5", "int6", "int7", "int8"]
    err = [np.linalg.norm(roundtrip(n, x) - x) / np.linalg.norm(x) for n in names]
    assert all(a > b for a, b in zip(err, err[1:])), dict(zip(names, err))
    # each extra bit about halves the error (a level is half as wide); int1 is min/max only
    assert all(1.6 < a / b < 2.6 for a, b in zip(err[2:], err[3:])), dict(zip(names, err))


# -- determinism and row independence -------------------------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_rows_across_inner_chunks_are_independent(name, monkeypatch):
    c = codecs.get(name)
    x = np.random.default_rng(4).standard_normal((1000, 37)).astype(np.float32)
    x[::7] *= 1e3
    ref = np.concatenate([c.encode(x[i : i + 1]) for i in range(len(x))])
    assert np.array_equal(c.encode(x), ref)
    dec = c.decode(ref, 37)
    monkeypatch.setattr(nbit, "_CHUNK_VALUES", 100)  # a few rows per inner step, and a ragged last one
    assert np.array_equal(c.encode(x), ref)
    assert np.array_equal(c.decode(ref, 37), dec)


# -- non-finite and unrepresentable rows ------------------------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("row", [0, 2])
def test_unrepresentable_rows_raise_and_are_flagged(name, row):
    c = codecs.get(name)
    x = np.zeros((5, 6), np.float32)
    x[row, 1] = -FP16_MAX * 1.5
    x[4, 0] = FP16_MAX * 2
    x[3, 5] = FP16_MAX  # at the limit: fine
    assert c.unrepresentable(x).tolist() == [i in (row, 4) for i in range(5)]
    with pytest.raises(InvalidArgument, match=rf"\brow {row}\b") as info:
        c.encode(x)
    assert "use the int8 or fp32 codec" in str(info.value)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        c.encode(x, check=False)  # the caller promised; no check, no error, no warning
    ok = ~c.unrepresentable(x)
    assert np.isfinite(c.decode(c.encode(x[ok]), 6)).all()
    assert not codecs.get(c.fallback).unrepresentable(x).any()  # the fallback takes the rows


def test_int1_refuses_rows_whose_scale_overflows_fp16():
    c = codecs.get("int1")
    # -31000 rounds to the bias -31008 (fp16 spacing 16 there): scale fp16(66008) = inf
    x = np.float32([[-31000.0, 35000.0], [-32768.0, 32752.0], [-32768.0, 32751.0], [0.0, 65504.0]])
    assert c.unrepresentable(x).tolist() == [True, True, False, False]
    with pytest.raises(InvalidArgument, match=r"\brow 0\b.*max - min < 65520"):
        c.encode(x)
    assert not codecs.get("int3").unrepresentable(x).any()
    assert_within_bound("int1", x[2:])


@pytest.mark.parametrize("name", NAMES)
@prop
@given(data=st.data())
def test_unrepresentable_matches_definition(name, data):
    c = codecs.get(name)
    x = data.draw(raw_rows(max_abs=float(np.finfo(np.float32).max) / 2, max_dim=12))
    scale = np.float32(data.draw(st.sampled_from([0.5, 0.99999, 1.0, 1.00001, 2.0])) * FP16_MAX)
    x = np.clip(x, -1, 1) * scale
    flagged = c.unrepresentable(x)
    assert flagged.dtype == bool and flagged.shape == (len(x),)
    assert flagged.tolist() == flagged_by_definition(BITS[name], x).tolist()
    # encode's one global min/max test agrees with the per-row flags (the range test is monotone)
    if flagged.any():
        with pytest.raises(InvalidArgument):
            c.encode(x)
    else:
        assert np.isfinite(c.decode(c.encode(x), x.shape[1])).all()


def test_unrepresentable_empty():
    for name in NAMES:
        assert codecs.get(name).unrepresentable(np.zeros((0, 3))).shape == (0,)


# -- shapes, empty input, decode inputs ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("values", [np.zeros(4), np.zeros((2, 3, 4)), np.zeros((3, 0)), 1.5, "abc"])
def test_encode_rejects_bad_shapes_and_types(name, values):
    with pytest.raises(InvalidArgument):
        codecs.get(name).encode(values)


def test_bits_out_of_range_rejected():
    for bits in (0, 9, 2.5):
        with pytest.raises(ValueError):
            nbit.uniform_row_bytes(8, bits)


# -- through the store ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["int1", "int3", "int7"])
def test_store_reads_back_decode_of_encode_and_falls_back_per_block(store, name):
    c = codecs.get(name)
    rng = np.random.default_rng(6)
    x = (rng.standard_normal((300, 13)) * 0.1).astype(np.float32)
    x[250, 3] = 1e5  # past fp16's range: that row's block goes to int8
    store.create_table("emb", num_rows=300, dim=13, codec=name, block_rows=64)
    with store.checkpoint() as ck:
        ck.put_rows("emb", np.arange(300), x)
    got = store.read_table("emb")
    assert np.array_equal(got[:192], c.decode(c.encode(x[:192]), 13))  # blocks 0-2: this codec, exactly
    fb = codecs.get("int8")
    assert np.array_equal(got[192:256], fb.decode(fb.encode(x[192:256]), 13))  # the block with the outlier
    assert np.array_equal(got[256:], c.decode(c.encode(x[256:]), 13))
