"""The numpy decode of FBGEMM's row-wise formats (int8, int4, int2) gives FBGEMM's kernel's float32 bits.

Reads decode with numpy unless torch is already loaded (cnrstore/codecs/rowwise.py), so that the CLI
never imports torch; that is only sound if both give the same bits for every encoding, which these
tests check on this machine: encodings FBGEMM made from random and edge-value rows of every width at
many dims, and arbitrary encodings (any levels, any finite scale and bias).
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from cnrstore import codecs
from cnrstore.codecs import rowwise
from cnrstore.codecs.nbit import unpack_levels

NAMES = ["int8", "int4", "int2"]
#: Largest magnitude each codec represents (their docstrings).
LIMIT = {"int8": 2.0**126, "int4": 65504.0, "int2": 65504.0}
DIMS = list(range(1, 41)) + [63, 64, 65, 127, 128, 129, 257]


def both(name: str, enc: np.ndarray, dim: int) -> tuple[np.ndarray, np.ndarray]:
    codec = codecs.get(name)
    return codec._decode_kernel(torch, enc, dim), codec._decode_numpy(enc, dim)


def assert_same_bits(kernel: np.ndarray, numpy_: np.ndarray) -> None:
    assert kernel.dtype == numpy_.dtype == np.float32 and kernel.shape == numpy_.shape
    diff = kernel.view(np.uint32) != numpy_.view(np.uint32)
    if diff.any():
        i = tuple(np.argwhere(diff)[0])
        raise AssertionError(f"{int(diff.sum())} of {diff.size} values differ; first at {i}: kernel "
                             f"{kernel[i]!r} numpy {numpy_[i]!r}")


def edge_rows(name: str, dim: int, rng: np.random.Generator) -> np.ndarray:
    """Rows of many shapes and scales, and the edge values of ``name``'s range."""
    lim = np.float32(LIMIT[name])
    n = 64
    scale = np.float32(10.0) ** rng.uniform(-30 if name == "int8" else -7, 30 if name == "int8" else 4, (n, 1))
    x = (rng.standard_normal((n, dim)) * scale).astype(np.float32)
    x[0] = 0.0
    x[1] = -0.0
    x[2, ::2] = -0.0  # both zeros in one row
    x[3] = np.float32(0.1)  # a constant that is no fp16 value
    x[4] = np.float32(0.5)  # one that is
    x[5] = lim
    x[6] = -lim
    x[7] = np.linspace(-lim, lim, dim, dtype=np.float32)
    x[8] = np.float32(1e-40)  # subnormal
    x[9] = rng.uniform(1000.0, 1000.001, dim).astype(np.float32)  # tiny range far from zero
    x[10] = rng.uniform(-1e-9, 1e-9, dim).astype(np.float32)  # within int8's 1e-8 range guard
    x[11, :] = 1.0
    x[11, -1] = 1e4  # one outlier
    x[12] = rng.uniform(-lim, lim, dim).astype(np.float32)
    x[13] = np.float32(-65504.0 if name != "int8" else -3.4e37)
    return x


@pytest.mark.parametrize("name", NAMES)
def test_fbgemm_encodings_decode_to_the_kernels_bits(name):
    """Every dim (odd ones pad the last byte), random rows of many magnitudes and the range's edges."""
    rng = np.random.default_rng(14)
    codec = codecs.get(name)
    total = 0
    for dim in DIMS:
        rows = np.concatenate([edge_rows(name, dim, rng),
                               rng.standard_normal((200, dim)).astype(np.float32)])
        enc = codec.encode(rows)
        assert_same_bits(*both(name, enc, dim))
        total += rows.shape[0]
    assert total > 10_000


def random_meta(name: str, n: int, rng: np.random.Generator) -> np.ndarray:
    """Up to ``n`` rows of finite (scale, bias) as the codec stores them: half any finite bit pattern,
    half with the bias from a dozen binades above to forty below ``scale * 255`` (where the sum rounds,
    and where rounding the product first would change it)."""
    ftype, itype = (np.float32, np.uint32) if name == "int8" else (np.float16, np.uint16)
    bits = rng.integers(0, np.iinfo(itype).max, (n, 2), dtype=np.uint64, endpoint=True).astype(itype)
    meta = bits.view(ftype).copy()
    half = n // 2
    fin = np.finfo(ftype)
    exp = rng.integers(fin.minexp, fin.maxexp - 9, half)
    meta[half:, 0] = np.ldexp(rng.uniform(1, 2, half), exp).astype(ftype)
    bias_exp = np.clip(exp + 8 - rng.integers(-12, 40, half), fin.minexp - 10, fin.maxexp - 1)
    with np.errstate(over="ignore", under="ignore"):
        meta[half:, 1] = (rng.choice([-1.0, 1.0], half) * np.ldexp(rng.uniform(1, 2, half), bias_exp)).astype(ftype)
    return meta[np.isfinite(meta).all(axis=1)]


def random_encodings(name: str, dim: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(encoded rows with random levels and :func:`random_meta`, their (scale, bias))."""
    codec = codecs.get(name)
    meta = random_meta(name, 4000, rng)
    n, width = len(meta), codec.row_bytes(dim)
    assert n > 1000
    enc = rng.integers(0, 256, (n, width), dtype=np.uint8)
    enc[:, width - codec.meta_bytes:] = meta.view(np.uint8).reshape(n, codec.meta_bytes)
    return enc, meta


@pytest.mark.parametrize("name", NAMES)
def test_arbitrary_encodings_decode_to_the_kernels_bits(name):
    """Any levels with any finite scale and bias (fp32 for int8, fp16 for int4/int2): exponents far
    apart, near overflow (where a value reaches inf), subnormals, negative scales."""
    rng = np.random.default_rng(1414)
    for dim in (1, 7, 8, 64, 129):
        enc, _ = random_encodings(name, dim, rng)
        assert_same_bits(*both(name, enc, dim))


@pytest.mark.parametrize("name", NAMES)
def test_the_arbitrary_encodings_include_sums_that_two_roundings_get_wrong(name):
    """For int8, rounding ``scale * q`` to float32 before the add changes some of the values above, so
    that test would catch a numpy decode that rounds twice; for int4/int2 the product is exact."""
    rng = np.random.default_rng(1414)
    dim, bits = 64, {"int8": 8, "int4": 4, "int2": 2}[name]
    enc, meta = random_encodings(name, dim, rng)
    kernel, _ = both(name, enc, dim)
    levels = unpack_levels(enc[:, :-codecs.get(name).meta_bytes], dim, bits).astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        twice = levels * meta[:, 0:1].astype(np.float32) + meta[:, 1:2].astype(np.float32)  # two roundings
    differs = int((twice.view(np.uint32) != kernel.view(np.uint32)).sum())
    if name == "int8":
        assert differs > 100, "FBGEMM's int8 kernel fuses the multiply-add (AVX2); see rowwise.py"
    else:
        assert differs == 0


rows_strategy = st.integers(1, 40).flatmap(lambda dim: hnp.arrays(
    np.float32, st.tuples(st.integers(1, 12), st.just(dim)),
    elements=st.floats(-65504, 65504, width=32, allow_nan=False, allow_infinity=False)))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(x=rows_strategy, name=st.sampled_from(NAMES))
def test_property_decodes_agree(x, name):
    enc = codecs.get(name).encode(x)
    assert_same_bits(*both(name, enc, x.shape[1]))


def test_decode_chooses_numpy_without_torch_and_the_kernel_with_it(monkeypatch):
    """With torch loaded the kernel decodes; with it absent from sys.modules the numpy path does."""
    calls = []
    codec = codecs.get("int4")
    enc = codec.encode(np.ones((3, 8), dtype=np.float32))
    monkeypatch.setattr(type(codec), "_decode_numpy", lambda self, e, d: calls.append("numpy") or
                        rowwise.decode_uniform(e, d, 4))
    codec.decode(enc, 8)
    assert calls == []
    monkeypatch.delitem(sys.modules, "torch")
    assert np.array_equal(codec.decode(enc, 8), np.ones((3, 8), dtype=np.float32))
    assert calls == ["numpy"]
