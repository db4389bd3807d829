"""Codecs: registry, byte layouts, error bounds, determinism, row independence, input validation."""

from __future__ import annotations

import mmap
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from cnrstore import codecs
from cnrstore.errors import InvalidArgument

from support.codec_bounds import roundtrip, u16, uniform_error_bound

ALL = ["fp32", "fp16", "int8", "int4", "int2"]
LOSSY = ["fp16", "int8", "int4", "int2"]
NBIT = {"int4": 4, "int2": 2}
FP16_MAX = 65504.0
INT8_MAX_ABS = 2.0**126
#: Largest magnitude each codec represents (the documented representable range).
LIMIT = {"fp32": float(np.finfo(np.float32).max), "fp16": FP16_MAX, "int8": INT8_MAX_ABS,
         "int4": FP16_MAX, "int2": FP16_MAX}

prop = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# -- the documented error bounds, transcribed from the codecs' docstrings ----------------------------

def error_bound(name: str, x: np.ndarray) -> np.ndarray:
    """Per-value bound on |x - decode(encode(x))|, broadcastable to x's shape (float64)."""
    if name == "fp32":
        return np.zeros_like(x, dtype=np.float64)
    if name == "fp16":
        return u16(x.astype(np.float64))
    if name == "int8":
        x = x.astype(np.float64)
        m, M = x.min(axis=1, keepdims=True), x.max(axis=1, keepdims=True)
        d = M - m
        return d / 510 + np.minimum(d, 1e-8) + 2.0**-20 * (np.abs(m) + np.abs(M))
    return uniform_error_bound(NBIT[name], x)


def assert_within_bound(name, x):
    y = roundtrip(name, x)
    assert y.dtype == np.float32 and y.shape == x.shape
    assert np.isfinite(y).all()
    err = np.abs(y.astype(np.float64) - x.astype(np.float64))
    bound = error_bound(name, x)
    over = err > bound
    assert not over.any(), (
        f"{name}: error {err[over][:3]} over bound {np.broadcast_to(bound, x.shape)[over][:3]} "
        f"for values {x[over][:3]} in row {np.nonzero(over)[0][0]}"
    )


# -- strategies (tests/support/codec_strategies.py) -----------------------------------------------------------

from support.codec_strategies import dims, raw_rows, row_batches  # noqa: E402  (shared strategies)


# -- registry --------------------------------------------------------------------------------------

def test_names_and_get():
    assert set(ALL) <= set(codecs.names())
    for name in codecs.names():
        c = codecs.get(name)
        assert isinstance(c, codecs.Codec) and c.name == name
        assert codecs.by_id(c.codec_id) is c
        assert codecs.by_id(np.uint8(c.codec_id)) is c  # ids come off disk as numpy ints


def test_unknown_name_lists_known():
    with pytest.raises(InvalidArgument) as info:
        codecs.get("nope")
    assert "nope" in str(info.value) and all(n in str(info.value) for n in ALL)
    with pytest.raises(InvalidArgument):
        codecs.get(None)


@pytest.mark.parametrize("bad", [0, 254, 255, 999, -1, "int4", None, 4.0])
def test_unknown_id(bad):
    with pytest.raises(InvalidArgument):
        codecs.by_id(bad)


def test_ids_are_the_on_disk_ones_and_unique():
    ids = {n: codecs.get(n).codec_id for n in codecs.names()}
    assert {n: ids[n] for n in ALL} == {"fp32": 1, "fp16": 2, "int8": 3, "int4": 4, "int2": 5}
    assert len(set(ids.values())) == len(ids)
    assert all(0 < i < 256 for i in ids.values())


def test_fallbacks_and_lossless():
    fallback = {n: codecs.get(n).fallback for n in ALL}
    assert fallback == {"fp32": None, "fp16": "fp32", "int8": "fp32", "int4": "int8", "int2": "int8"}
    assert [n for n in ALL if codecs.get(n).lossless] == ["fp32"]
    for name in codecs.names():  # every chain ends at a codec that takes every finite row
        c = codecs.get(name)
        while c.fallback is not None:
            c = codecs.get(c.fallback)
        assert c.lossless


# -- layout ------------------------------------------------------------------------------------------

ROW_BYTES = {
    "fp32": lambda d: 4 * d,
    "fp16": lambda d: 2 * d,
    "int8": lambda d: d + 8,
    "int4": lambda d: -(-d // 2) + 4,
    "int2": lambda d: -(-d // 4) + 4,
}


@pytest.mark.parametrize("name", ALL)
def test_row_bytes_matches_layout_and_encode(name):
    c = codecs.get(name)
    rng = np.random.default_rng(0)
    for dim in list(range(1, 18)) + [63, 64, 65, 1024]:
        assert c.row_bytes(dim) == ROW_BYTES[name](dim)
        enc = c.encode(rng.standard_normal((3, dim)))
        assert enc.dtype == np.uint8 and enc.flags.c_contiguous and enc.shape == (3, c.row_bytes(dim))


def layout_decode(name: str, enc: np.ndarray, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """Decode straight from the documented byte layout: (values, tolerance), float64.

    The tolerance covers the float32 arithmetic of ``scale * q + bias`` (FBGEMM may fuse it)."""
    raw = np.frombuffer(enc.tobytes(), np.uint8).reshape(enc.shape)
    if name in ("fp32", "fp16"):
        dt = "<f4" if name == "fp32" else "<f2"
        values = np.frombuffer(raw.tobytes(), dt).reshape(len(raw), dim).astype(np.float64)
        return values, np.zeros_like(values)
    if name == "int8":
        q = raw[:, :dim].astype(np.float64)
        scale = np.frombuffer(raw[:, dim : dim + 4].tobytes(), "<f4")
        bias = np.frombuffer(raw[:, dim + 4 :].tobytes(), "<f4")
    else:
        bits = NBIT[name]
        per = 8 // bits
        nb = -(-dim // per)
        j = np.arange(dim)
        q = ((raw[:, j // per] >> (bits * (j % per))) & ((1 << bits) - 1)).astype(np.float64)
        scale = np.frombuffer(raw[:, nb : nb + 2].tobytes(), "<f2")
        bias = np.frombuffer(raw[:, nb + 2 :].tobytes(), "<f2")
    sq = q * scale.astype(np.float64)[:, None]
    b = bias.astype(np.float64)[:, None]
    return sq + b, 2.0**-23 * (np.abs(sq) + np.abs(b)) + 1e-45


@pytest.mark.parametrize("name", ALL)
@prop
@given(x=row_batches())
def test_layout_is_as_documented(name, x):
    c = codecs.get(name)
    dim = x.shape[1]
    enc = c.encode(x)
    ref, tol = layout_decode(name, enc, dim)
    got = c.decode(enc, dim).astype(np.float64)
    assert (np.abs(got - ref) <= tol).all()


def test_int4_int2_byte_examples():
    # value j at nibble/pair j%per of byte j//per, least significant first; fp16 scale then bias.
    e = codecs.get("int4").encode([[0.0, 15.0, 0.0]])  # odd dim: last value repeated as padding
    assert e.tolist() == [[0xF0, 0x00, 0x00, 0x3C, 0x00, 0x00]]  # levels 0,15,0,(0); scale 1.0; bias 0
    e = codecs.get("int2").encode([[0.0, 1.0, 2.0, 3.0, 3.0]])
    assert e.tolist() == [[0b11100100, 0xFF, 0x00, 0x3C, 0x00, 0x00]]
    e = codecs.get("int8").encode([[1.0, 256.0]])
    assert e[0, :2].tolist() == [0, 255]
    assert e[0, 2:].tobytes() == np.array([1.0, 1.0], "<f4").tobytes()


@pytest.mark.parametrize("name", ["int4", "int2"])
@prop
@given(x=row_batches())
def test_odd_dims_encode_as_rows_padded_with_last_value(name, x):
    c = codecs.get(name)
    per = 8 // NBIT[name]
    dim = x.shape[1]
    padded = np.concatenate([x, np.repeat(x[:, -1:], -dim % per, axis=1)], axis=1)
    assert np.array_equal(c.encode(x), c.encode(padded))


# -- error bounds ------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ALL)
@prop
@given(x=row_batches())
@example(x=np.float32([[1e-30, 2e-30, 1.5e-30]]))
@example(x=np.float32([[1e4, 1e4 + 1e-3, -1e4]]))
@example(x=np.float32([[5.001] * 5]))
@example(x=np.float32([[-1.0, 0.0, 1e4]]))
def test_error_within_documented_bound(name, x):
    assert_within_bound(name, x)


@pytest.mark.parametrize("name", LOSSY)
@prop
@given(x=raw_rows())
def test_error_within_bound_arbitrary_floats(name, x):
    assert_within_bound(name, x)


@pytest.mark.parametrize("name", ["int8", "int4", "int2"])
@prop
@given(x=row_batches(max_abs=1.0, min_exp=-38.0))
def test_error_within_bound_tiny_ranges(name, x):
    assert_within_bound(name, x)


@pytest.mark.parametrize("name", LOSSY)
@prop
@given(data=st.data())
def test_huge_but_representable_rows(name, data):
    limit = LIMIT[name]
    x = data.draw(raw_rows(max_abs=limit, max_dim=17))
    x[:, 0] = data.draw(st.sampled_from([limit, -limit]))
    assert_within_bound(name, x)


@pytest.mark.parametrize("name", codecs.names())  # the contract of every registered codec
@prop
@given(v=st.floats(-FP16_MAX, FP16_MAX, width=16), dim=dims)
def test_constant_fp16_rows_exact(name, v, dim):
    x = np.full((2, dim), v, np.float32)
    assert np.array_equal(roundtrip(name, x), x)


@pytest.mark.parametrize("name", ["fp32", "int8"])
@prop
@given(v=st.floats(-INT8_MAX_ABS, INT8_MAX_ABS, width=32), dim=dims)
def test_constant_rows_exact_with_fp32_bias(name, v, dim):
    x = np.full((2, dim), v, np.float32)
    assert np.array_equal(roundtrip(name, x), x)


@prop
@given(x=hnp.arrays(np.float32, st.tuples(st.integers(0, 5), st.integers(1, 33)),
                    elements=st.floats(width=32, allow_nan=False, allow_infinity=False)))
@example(x=np.float32([[-0.0, 0.0, 1e-45, -1e-45, 1.17e-38, 3.4028235e38]]))
def test_fp32_bit_exact(x):
    y = roundtrip("fp32", x)
    assert np.array_equal(y.view(np.uint32), x.view(np.uint32))


def test_fp32_keeps_nan_payloads_without_check():
    x = np.array([[0x7FC00001, 0xFFA00000, 0x00000001, 0x80000000]], np.uint32).view(np.float32)
    c = codecs.get("fp32")
    assert np.array_equal(c.decode(c.encode(x, check=False), 4).view(np.uint32), x.view(np.uint32))


def test_fp16_rounds_to_nearest_even():
    c = codecs.get("fp16")
    x = np.float32([[1 + 2.0**-11, 1 + 3 * 2.0**-11, 2.0**-25, 3 * 2.0**-26, -0.0, FP16_MAX]])
    y = c.decode(c.encode(x), x.shape[1])
    assert y.tolist() == [[1.0, 1 + 2.0**-9, 0.0, 2.0**-24, 0.0, FP16_MAX]]
    assert np.signbit(y[0, 4])
    # past the range, unchecked: rounds to the largest finite fp16 below 65520, to inf from there
    y = c.decode(c.encode(np.float32([[65519.0, 65520.0]]), check=False), 2)
    assert y.tolist() == [[FP16_MAX, np.inf]]


# -- determinism and row independence ------------------------------------------------------------------

@pytest.mark.parametrize("name", codecs.names())  # the contract of every registered codec
@prop
@given(x=row_batches(), other=row_batches(), seed=st.integers(0, 2**16))
def test_deterministic_and_row_independent(name, x, other, seed):
    c = codecs.get(name)
    enc = c.encode(x)
    assert np.array_equal(enc, c.encode(x.copy()))
    for i in range(len(x)):
        assert np.array_equal(enc[i], c.encode(x[i : i + 1])[0])
    perm = np.random.default_rng(seed).permutation(len(x))
    assert np.array_equal(c.encode(x[perm]), enc[perm])
    if other.shape[1] == x.shape[1]:
        mixed = c.encode(np.concatenate([other, x, other]))
        assert np.array_equal(mixed[len(other) : len(other) + len(x)], enc)


@pytest.mark.parametrize("name", codecs.names())  # the contract of every registered codec
def test_input_layouts_and_dtypes_give_same_bytes(name):
    c = codecs.get(name)
    x = np.random.default_rng(1).standard_normal((9, 12)).astype(np.float32)
    ref = c.encode(x)
    assert np.array_equal(c.encode(np.asfortranarray(x)), ref)
    assert np.array_equal(c.encode(np.repeat(x, 2, axis=1)[:, ::2]), ref)
    assert np.array_equal(c.encode(x.astype(np.float64)), ref)
    assert np.array_equal(c.encode(x.tolist()), ref)
    ro = x.copy()
    ro.flags.writeable = False
    assert np.array_equal(c.encode(ro), ref)
    torch = pytest.importorskip("torch")
    assert np.array_equal(c.encode(torch.from_numpy(x)), ref)
    assert np.array_equal(c.encode(torch.from_numpy(x).requires_grad_()), ref)
    assert np.array_equal(c.encode(torch.from_numpy(x).to(torch.float64)), ref)
    assert c.encode(torch.from_numpy(x).to(torch.bfloat16)).shape == ref.shape


# -- non-finite and unrepresentable rows -----------------------------------------------------------------

@pytest.mark.parametrize("name", codecs.names())  # the contract of every registered codec
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("row", [0, 3, 6])
def test_non_finite_rejected_naming_the_row(name, bad, row):
    x = np.ones((7, 5), np.float32)
    x[row, 2] = bad
    x[6, 4] = bad  # a later offender: the message names the first
    with pytest.raises(InvalidArgument, match=rf"\brow {row}\b"):
        codecs.get(name).encode(x)


@pytest.mark.parametrize("name", LOSSY)
@pytest.mark.parametrize("row", [0, 2])
def test_unrepresentable_rows_raise_and_are_flagged(name, row):
    c = codecs.get(name)
    x = np.zeros((5, 6), np.float32)
    x[row, 1] = -LIMIT[name] * 1.5
    x[4, 0] = LIMIT[name] * 2
    x[3, 5] = LIMIT[name]  # at the limit: fine
    assert c.unrepresentable(x).tolist() == [i in (row, 4) for i in range(5)]
    with pytest.raises(InvalidArgument, match=rf"\brow {row}\b") as info:
        c.encode(x)
    hint = "use the int8 or fp32 codec" if c.fallback == "int8" else "use the fp32 codec"
    assert hint in str(info.value)
    c.encode(x, check=False)  # the caller promised; no check, no error
    ok = ~c.unrepresentable(x)
    assert np.isfinite(c.decode(c.encode(x[ok]), 6)).all()
    fb = codecs.get(c.fallback)  # the fallback takes the rows
    assert not fb.unrepresentable(x).any()
    assert_within_bound(fb.name, x)


@pytest.mark.parametrize("name", ALL)
@prop
@given(data=st.data())
def test_unrepresentable_matches_definition(name, data):
    c = codecs.get(name)
    limit = LIMIT[name]
    x = data.draw(raw_rows(max_abs=float(np.finfo(np.float32).max) / 2, max_dim=12))
    scale = np.float32(data.draw(st.sampled_from([0.5, 0.99999, 1.0, 1.00001, 2.0])) * min(limit, 1e38))
    x = np.clip(x, -1, 1) * scale
    flagged = c.unrepresentable(x)
    assert flagged.dtype == bool and flagged.shape == (len(x),)
    assert flagged.tolist() == (np.abs(x.astype(np.float64)).max(axis=1) > limit).tolist()
    if not flagged.all():
        assert np.isfinite(c.decode(c.encode(x[~flagged]), x.shape[1])).all()


def test_int8_rejects_rows_that_would_decode_to_inf():
    # found empirically: (M - m) is finite, yet FBGEMM decodes M to inf.
    x = np.float32([[1.4267238e38, 2.7754981e38, 3.4028235e38]])
    c = codecs.get("int8")
    assert c.unrepresentable(x).tolist() == [True]
    assert codecs.get("fp32").decode(codecs.get("fp32").encode(x), 3).tolist() == x.tolist()


def test_unrepresentable_empty_and_fp32_never():
    for name in ALL:
        assert codecs.get(name).unrepresentable(np.zeros((0, 3))).shape == (0,)
    big = np.float32([[3.4e38, -3.4e38]])
    assert codecs.get("fp32").unrepresentable(big).tolist() == [False]


# -- shapes, empty input, decode inputs ------------------------------------------------------------------

@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("values", [
    np.zeros(4), np.zeros((2, 3, 4)), np.zeros((3, 0)), np.zeros((0, 0)), 1.5, "abc",
    np.array([["a", "b"]]), np.zeros((2, 2), complex), [[1, 2], [3]],
])
def test_encode_rejects_bad_shapes_and_types(name, values):
    with pytest.raises(InvalidArgument):
        codecs.get(name).encode(values)
    with pytest.raises(InvalidArgument):
        codecs.get(name).encode(values, check=False)


@pytest.mark.parametrize("name", codecs.names())  # the contract of every registered codec
def test_decode_rejects_bad_input(name):
    c = codecs.get(name)
    w = c.row_bytes(5)
    for enc, dim in [
        (np.zeros((2, w + 1), np.uint8), 5),
        (np.zeros((2, w - 1), np.uint8), 5),
        (np.zeros(w, np.uint8), 5),
        (np.zeros((1, 2, w), np.uint8), 5),
        (np.zeros((2, w), np.int8), 5),
        (np.zeros((2, w), np.float32), 5),
        (np.zeros((2, w), np.uint8), 0),
        (np.zeros((2, w), np.uint8), -5),
        (np.zeros((2, w), np.uint8), "5"),
        (np.zeros((2, w), np.uint8), 5.0),
    ]:
        with pytest.raises(InvalidArgument):
            c.decode(enc, dim)


@pytest.mark.parametrize("name", codecs.names())  # the contract of every registered codec
@pytest.mark.parametrize("dim", [1, 3, 12, 64])
def test_empty_batches(name, dim):
    c = codecs.get(name)
    enc = c.encode(np.zeros((0, dim), np.float32))
    assert enc.shape == (0, c.row_bytes(dim)) and enc.dtype == np.uint8
    out = c.decode(enc, dim)
    assert out.shape == (0, dim) and out.dtype == np.float32


@pytest.mark.parametrize("name", codecs.names())  # the contract of every registered codec
def test_decode_read_only_unaligned_mmap_without_warnings(name, tmp_path):
    c = codecs.get(name)
    x = np.random.default_rng(2).standard_normal((33, 7)).astype(np.float32)
    enc = c.encode(x)
    path = tmp_path / "rows"
    path.write_bytes(b"\x00" + enc.tobytes())
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        view = np.frombuffer(mm, np.uint8, count=enc.size, offset=1).reshape(enc.shape)
        assert not view.flags.writeable
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            out = c.decode(view, 7)
        del view
        assert np.array_equal(out, c.decode(enc, 7))
        assert out.flags.writeable and out.flags.c_contiguous and out.dtype == np.float32
        out[:] = 0  # new memory, not the mapping


@pytest.mark.parametrize("name", codecs.names())  # the contract of every registered codec
def test_results_are_fresh_memory(name):
    c = codecs.get(name)
    x = np.random.default_rng(3).standard_normal((4, 8)).astype(np.float32)
    enc = c.encode(x)
    assert not np.shares_memory(enc, x)
    x[:] = 7.0
    assert np.array_equal(enc, c.encode(np.random.default_rng(3).standard_normal((4, 8)).astype(np.float32)))
    out = c.decode(enc, 8)
    assert not np.shares_memory(out, enc)
    strided = np.repeat(enc, 2, axis=0)[::2]  # non-contiguous input decodes the same
    assert np.array_equal(c.decode(strided, 8), out)


# -- decode_into: the same bits in the caller's array ------------------------------------------------------

def _encodable(codec, x: np.ndarray) -> np.ndarray:
    """``x`` with the rows ``codec`` cannot represent replaced by zeros (decode_into is about decoding)."""
    bad = codec.unrepresentable(x)
    return np.where(bad[:, None], np.float32(0), x).astype(np.float32)


@pytest.mark.parametrize("name", codecs.names())
@prop
@given(x=row_batches(max_rows=40), chunk=st.sampled_from([None, 1, 7]))
def test_decode_into_gives_decode_bits(name, x, chunk):
    """Every codec, with and without torch's kernels, in one chunk or many: decode_into's ``out`` holds
    decode's float32 bits, and only ``out`` is written."""
    from cnrstore.codecs import base

    codec = codecs.get(name)
    enc = codec.encode(_encodable(codec, x))
    with pytest.MonkeyPatch.context() as mp:
        if chunk is not None:
            mp.setattr(base, "DECODE_CHUNK_VALUES", chunk * x.shape[1])
            mp.setattr(codecs.rowwise, "DECODE_CHUNK_VALUES", chunk * x.shape[1])
        want = codec.decode(enc, x.shape[1])
        table = np.full((x.shape[0] + 2, x.shape[1]), np.float32(7.5))
        got = codec.decode_into(enc, x.shape[1], table[1:-1])
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
        assert np.shares_memory(got, table)
        assert (table[[0, -1]] == np.float32(7.5)).all()  # neighbours untouched
        mp.setattr(codecs.rowwise, "_loaded_torch", lambda: None)  # the numpy decode of int8/4/2
        again = np.zeros_like(want)
        codec.decode_into(enc, x.shape[1], again)
        assert np.array_equal(again.view(np.uint32), want.view(np.uint32))


def test_decode_into_writes_a_torch_tensor_in_place():
    torch = pytest.importorskip("torch")
    x = np.random.default_rng(0).standard_normal((9, 6)).astype(np.float32)
    codec = codecs.get("int4")
    w = torch.zeros(9, 6, requires_grad=True)
    codec.decode_into(codec.encode(x), 6, w)
    assert np.array_equal(w.detach().numpy(), codec.decode(codec.encode(x), 6))


@pytest.mark.parametrize("out", [np.zeros((3, 4), np.float64), np.zeros((4, 4), np.float32),
                                 np.zeros((3, 8), np.float32)[:, ::2], "not an array"])
def test_decode_into_rejects_a_bad_out_and_writes_nothing(out):
    codec = codecs.get("fp32")
    enc = codec.encode(np.ones((3, 4), np.float32))
    with pytest.raises(InvalidArgument, match="out must"):
        codec.decode_into(enc, 4, out)
    if isinstance(out, np.ndarray):
        assert not out.any()
    ro = np.zeros((3, 4), np.float32)
    ro.flags.writeable = False
    with pytest.raises(InvalidArgument, match="writable"):
        codec.decode_into(enc, 4, ro)
