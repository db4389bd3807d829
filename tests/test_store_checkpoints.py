"""The Store API (API.md): tables, the checkpoint writer and bad input.

Every rejected call must raise its typed error *and* leave the store as it was.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

import cnrstore
from cnrstore import codecs, knobs

from support.store_helpers import DIM, ROWS, dd, rand, assert_bits_equal, snapshot_state


# 3. tables ------------------------------------------------------------------------------------------
def test_create_table_and_tables(store):
    info = store.create_table("a", 1000, 16, codec="int8", block_rows=128)
    assert info == cnrstore.TableInfo("a", 1000, 16, "int8", 128)
    b = store.create_table("b", 5, 3)  # defaults: lossless
    assert b.codec == "fp32" and b.num_rows == 5 and b.dim == 3
    assert store.tables() == {"a": info, "b": b}
    assert store.create_table("b", 5, 3, exist_ok=True) == b  # the same table: returned as it is
    with pytest.raises(cnrstore.InvalidArgument, match="already exists"):
        store.create_table("b", 5, 3)
    with pytest.raises(cnrstore.InvalidArgument, match="exists with 5 rows x 3 dims in fp32, not 5 x 3 in int8"):
        store.create_table("b", 5, 3, codec="int8", exist_ok=True)
    assert all(isinstance(t, cnrstore.TableInfo) for t in store.tables().values())


@pytest.mark.parametrize("codec", ["fp32", "fp16", "int8", "int4", "int2"])
@pytest.mark.parametrize("num_rows,dim", [(1, 1), (10, 7), (1 << 20, 64), (1 << 24, 512)])
def test_default_block_rows_is_a_power_of_two(store, codec, num_rows, dim):
    br = store.create_table(f"t_{num_rows}_{dim}", num_rows, dim, codec=codec).block_rows
    assert br >= 1 and br & (br - 1) == 0
    assert br <= knobs.MAX_BLOCK_ROWS


@pytest.mark.parametrize("kwargs", [
    dict(num_rows=0, dim=4), dict(num_rows=-1, dim=4), dict(num_rows=10, dim=0), dict(num_rows=10, dim=-2),
    dict(num_rows=10.0, dim=4), dict(num_rows=10, dim=4.0), dict(num_rows="10", dim=4), dict(num_rows=True, dim=4),
    dict(num_rows=None, dim=4), dict(num_rows=10, dim=4, codec="nope"), dict(num_rows=10, dim=4, codec=None),
    dict(num_rows=10, dim=4, block_rows=3), dict(num_rows=10, dim=4, block_rows=0),
    dict(num_rows=10, dim=4, block_rows=-64), dict(num_rows=10, dim=4, block_rows=96),
    dict(num_rows=10, dim=4, block_rows=64.0), dict(num_rows=10, dim=4, block_rows=1 << 17),
])
def test_create_table_bad_arguments_raise_invalid_argument(store, kwargs):
    with pytest.raises(cnrstore.InvalidArgument):
        store.create_table("t", **kwargs)
    assert store.tables() == {}


@pytest.mark.parametrize("name", ["", None, 5, "a\x00b", "x" * 401])
def test_create_table_bad_name(store, name):
    with pytest.raises(cnrstore.InvalidArgument):
        store.create_table(name, 10, 2)
    assert store.tables() == {}


def test_duplicate_table_name_raises_and_keeps_original(store):
    first = store.create_table("t", 10, 2, codec="fp32", block_rows=64)
    with pytest.raises(cnrstore.InvalidArgument) as ei:
        store.create_table("t", 20, 4, codec="int8")
    assert "'t'" in str(ei.value)
    assert store.tables() == {"t": first}
    store.close()
    with cnrstore.open(store.path) as s:
        assert s.tables() == {"t": first}


# 4. checkpoint writer -------------------------------------------------------------------------------
def test_versions_known_at_open_strictly_increasing_and_never_reused(store_path):
    seen = []
    with cnrstore.open(store_path, create=True) as s:
        s.create_table("emb", 10, 2, codec="fp32", block_rows=64)
        for i in range(6):
            ck = s.checkpoint(step=i)
            assert isinstance(ck.version, int)
            assert not seen or ck.version > max(seen)
            seen.append(ck.version)
            ck.put_rows("emb", [i], [[float(i), 0.0]])
            if i % 2:
                ck.abort()
            else:
                assert ck.commit() == ck.version
        assert [v.version for v in s.versions()] == seen[0::2]
    with cnrstore.open(store_path) as s:  # not reused after a reopen either
        with s.checkpoint() as ck:
            pass
        assert ck.version > max(seen)
        assert [v.version for v in s.versions()] == seen[0::2] + [ck.version]


def test_exception_inside_with_aborts_and_propagates(emb):
    before = snapshot_state(emb)

    class Boom(Exception):
        pass

    err = Boom("trainer crashed")
    with pytest.raises(Boom) as ei:
        with emb.checkpoint(step=2, meta={"x": 1}) as ck:
            ck.put_rows("emb", np.arange(10), np.zeros((10, DIM)))
            ck.put_dense("d", np.ones(3))
            raise err
    assert ei.value is err
    assert snapshot_state(emb) == before
    with pytest.raises(cnrstore.VersionNotFound):
        emb.read_rows("emb", [0], version=ck.version)
    with pytest.raises(cnrstore.MissingRows):
        emb.read_dense("d")
    assert "d" not in emb.restore().dense
    with pytest.raises(cnrstore.StoreClosed):
        ck.put_rows("emb", [0], np.zeros((1, DIM)))
    # the store takes a new checkpoint at once
    with emb.checkpoint() as ck2:
        ck2.put_rows("emb", [0], np.zeros((1, DIM)))
    assert ck2.version > ck.version and emb.latest().parent == before[0][-1].version
    assert emb.verify().ok


def test_abort_discards_and_is_idempotent(emb):
    before = snapshot_state(emb)
    ck = emb.checkpoint()
    ck.put_rows("emb", np.arange(50), np.zeros((50, DIM)))
    ck.abort()
    ck.abort()
    with ck:  # leaving a with-block of an aborted writer commits nothing
        pass
    assert snapshot_state(emb) == before
    with pytest.raises(cnrstore.StoreClosed):
        ck.commit()
    with emb.checkpoint() as ck2:
        pass
    assert emb.latest().version == ck2.version


def test_explicit_commit_inside_with(emb):
    with emb.checkpoint(step=5) as ck:
        ck.put_rows("emb", [3], np.full((1, DIM), 9.0))
        v = ck.commit()
        assert v == ck.version
        assert emb.latest().version == v  # visible before the with-block ends
        assert ck.commit() == v  # idempotent
        with pytest.raises(cnrstore.StoreClosed):
            ck.put_rows("emb", [4], np.ones((1, DIM)))
    assert [x.version for x in emb.versions()][-1] == v
    assert (emb.read_rows("emb", [3]) == 9.0).all()


def test_version_info_fields(store):
    store.create_table("a", 100, 4, codec="fp32", block_rows=64)
    store.create_table("b", 100, 4, codec="int4", block_rows=64)
    t0 = time.time()
    with store.checkpoint(step=10, meta={"loader": {"pos": 123}, "lr": [0.1, 0.01], "tag": "x"}) as ck1:
        ck1.put_rows("b", np.arange(100), rand(100, 4))
        ck1.put_rows("a", np.arange(100), rand(100, 4))
    with store.checkpoint() as aborted:
        aborted.put_rows("a", [5], rand(1, 4))
        aborted.abort()
    with store.checkpoint(step=np.int64(20)) as ck3:
        ck3.put_dense("d", np.zeros(2))
    v1, v3 = store.versions()
    assert v1.version == ck1.version and v1.step == 10 and v1.parent is None
    assert v1.meta == {"loader": {"pos": 123}, "lr": [0.1, 0.01], "tag": "x"}
    assert v1.tables == ("a", "b") and v1.bytes > 0
    assert t0 - 1 <= v1.created <= time.time() + 1
    assert v3.version == ck3.version and v3.step == 20 and v3.meta is None
    assert v3.parent == v1.version  # the aborted version is no one's parent
    assert v3.tables == () and v3.bytes > 0
    assert store.latest() == v3
    snap = store.restore(v1.version)
    assert snap.version == v1.version and snap.step == 10 and snap.meta == v1.meta
    assert set(snap.tables) == {"a", "b"} and snap.dense == {}
    assert_bits_equal(snap.tables["a"], rand(100, 4))
    assert_bits_equal(snap.tables["b"], dd("int4", rand(100, 4)))


def test_incremental_semantics(store):
    store.create_table("a", 300, 4, codec="fp32", block_rows=64)
    store.create_table("b", 50, 4, codec="fp32", block_rows=64)
    base = rand(300, 4, seed=1)
    with store.checkpoint() as ck1:
        ck1.put_rows("a", np.arange(300), base)
        ck1.put_dense("d", np.arange(3.0))
    upd = rand(10, 4, seed=2)
    with store.checkpoint() as ck2:
        ck2.put_rows("a", np.arange(60, 70), upd)  # straddles blocks 0 and 1
    with store.checkpoint() as ck3:
        ck3.put_rows("b", np.arange(50), rand(50, 4, seed=3))
        ck3.put_dense("d", np.arange(4.0))
    with store.checkpoint() as ck4:
        ck4.put_rows("a", [299, 0], rand(2, 4, seed=4))
    expect = {ck1.version: base.copy()}
    e2 = base.copy()
    e2[60:70] = upd
    expect[ck2.version] = e2
    expect[ck3.version] = e2
    e4 = e2.copy()
    e4[[299, 0]] = rand(2, 4, seed=4)
    expect[ck4.version] = e4
    for v, e in expect.items():
        assert_bits_equal(store.read_table("a", version=v), e)
        rows = np.array([0, 65, 65, 299, 59, 70, 0])
        assert_bits_equal(store.read_rows("a", rows, version=v), e[rows])
        assert_bits_equal(store.read_rows("a", [], version=v), np.zeros((0, 4), np.float32))
    assert_bits_equal(store.read_table("a"), e4)
    with pytest.raises(cnrstore.MissingRows):
        store.read_rows("b", [0], version=ck2.version)
    assert_bits_equal(store.read_dense("d", ck2.version), np.arange(3.0))
    assert_bits_equal(store.read_dense("d", ck4.version), np.arange(4.0))
    snap = store.restore(ck2.version)
    assert set(snap.tables) == {"a"} and snap.dense.keys() == {"d"}
    assert_bits_equal(snap.tables["a"], e2)
    snap = store.restore()
    assert set(snap.tables) == {"a", "b"}
    assert_bits_equal(snap.tables["a"], e4)


@pytest.mark.parametrize("codec", ["fp32", "fp16", "int8", "int4", "int2"])
def test_multiple_puts_same_blocks_same_codec(store, codec):
    store.create_table("t", 256, 6, codec=codec, block_rows=64)
    vals = rand(256, 6, seed=5, scale=3.0)
    even, odd = np.arange(0, 256, 2), np.arange(1, 256, 2)
    with store.checkpoint() as ck:
        ck.put_rows("t", even[:40], vals[even[:40]])   # blocks 0 and 1
        ck.put_rows("t", odd[::-1], vals[odd[::-1]])   # every block, unsorted, merges into 0 and 1
        ck.put_rows("t", even[40:], vals[even[40:]])   # merges into blocks 1, 2, 3
    expect = dd(codec, vals)
    assert_bits_equal(store.read_table("t"), expect)
    assert_bits_equal(store.read_rows("t", [255, 0, 1, 77]), expect[[255, 0, 1, 77]])
    assert store.versions()[-1].tables == ("t",)
    assert store.verify().ok
    store.close()
    with cnrstore.open(store.path, readonly=True) as ro:
        assert_bits_equal(ro.read_table("t"), expect)


@pytest.mark.parametrize("first,second", [("int4", "fp32"), ("fp32", "int4"), ("int4", "int8"),
                                          ("int2", "fp16"), ("int8", "int2")])
def test_multiple_puts_same_blocks_different_codecs(store, first, second):
    store.create_table("t", 200, 5, codec="int4", block_rows=64)
    vals = rand(200, 5, seed=6, scale=2.0)
    a = np.arange(0, 200, 3)
    b = np.setdiff1d(np.arange(200), a)
    with store.checkpoint() as ck:
        ck.put_rows("t", a, vals[a], codec=first)
        ck.put_rows("t", b, vals[b], codec=second)
    expect = np.empty_like(vals)
    expect[a] = dd(first, vals[a])
    expect[b] = dd(second, vals[b])
    got = store.read_table("t")
    assert_bits_equal(got, expect)
    if first != second:  # the test is meaningful: the codecs really decode differently
        assert not np.array_equal(dd(first, vals[b]), dd(second, vals[b]))
    # a later version of the same rows in the table's codec shadows the merged record
    with store.checkpoint() as ck2:
        ck2.put_rows("t", a[:5], vals[a[:5]] * 2)
    assert_bits_equal(store.read_rows("t", a[:5]), dd("int4", vals[a[:5]] * 2))
    assert_bits_equal(store.read_table("t", version=ck.version), expect)
    assert store.verify().ok


def test_unrepresentable_rows_fall_back_per_block(store):
    store.create_table("t", 256, 4, codec="int4", block_rows=64)
    vals = rand(256, 4, seed=7)
    vals[70] = [1e5, -2.0, 3.0, 0.5]          # beyond fp16: block 1 -> int8
    vals[200] = [1e38, 1.0, -1e38, 0.0]        # beyond int8's 2**126: block 3 -> fp32
    with store.checkpoint() as ck:
        ck.put_rows("t", np.arange(256), vals)
    expect = np.empty_like(vals)
    expect[0:64] = dd("int4", vals[0:64])
    expect[128:192] = dd("int4", vals[128:192])
    expect[64:128] = dd("int8", vals[64:128])     # the whole block of row 70
    expect[192:256] = vals[192:256]                # the whole block of row 200, exact
    assert codecs.get("int4").unrepresentable(vals[[70]]).all()
    assert codecs.get("int8").unrepresentable(vals[[200]]).all()
    got = store.read_table("t")
    assert_bits_equal(got, expect)
    others = [r for r in range(64, 128) if r != 70]
    assert not np.array_equal(got[others], dd("int4", vals[others]))  # block 1 really is int8, not int4
    # the same through a merge: a second put into blocks the version already wrote
    vals2 = rand(256, 4, seed=8)
    with store.checkpoint() as ck2:
        ck2.put_rows("t", np.arange(0, 256, 2), vals2[0::2])
        odd = np.arange(1, 256, 2)
        big = vals2[odd].copy()
        big[0] = [7e4, 1.0, 1.0, 1.0]  # row 1, merging into block 0
        ck2.put_rows("t", odd, big)
    exp2 = np.empty_like(vals2)
    exp2[0::2] = dd("int4", vals2[0::2])
    exp2[odd[32:]] = dd("int4", big[32:])
    exp2[odd[:32]] = dd("int8", big[:32])  # block 0's odd rows fall back together
    assert_bits_equal(store.read_table("t", version=ck2.version), exp2)
    assert_bits_equal(store.read_table("t", version=ck.version), expect)
    assert store.verify().ok


def test_values_as_tensors_and_other_float_dtypes(store):
    store.create_table("t", 64, 4, codec="fp32", block_rows=64)
    v64 = rand(4, 4, seed=9).astype(np.float64)
    with store.checkpoint() as ck:
        ck.put_rows("t", torch.tensor([0, 1]), torch.from_numpy(v64[:2].astype(np.float32)))
        ck.put_rows("t", [2], torch.tensor(v64[2:3]).to(torch.bfloat16))
        ck.put_rows("t", np.array([3], dtype=np.uint16), v64[3:4])
    got = store.read_rows("t", [0, 1, 2, 3])
    assert_bits_equal(got[:2], v64[:2].astype(np.float32))
    assert_bits_equal(got[2:3], torch.tensor(v64[2:3]).to(torch.bfloat16).float().numpy())
    assert_bits_equal(got[3:4], v64[3:4].astype(np.float32))


_DENSE = {
    "scalar_f64": np.array(3.25),
    "scalar_i8": np.array(-7, dtype=np.int8),
    "empty": np.zeros((0, 3), dtype=np.float32),
    "empty_1d": np.array([], dtype=np.int64),
    "bool": np.array([[True, False, True]]),
    "int8": np.arange(-5, 5, dtype=np.int8).reshape(2, 5),
    "uint64": np.array([0, 2**64 - 1], dtype=np.uint64),
    "float64": np.array([np.pi, -0.0, np.inf, -np.inf, 5e-324]),
    "float64_nan": np.array([np.nan, 1.0]),
    "float16": np.arange(12, dtype=np.float16).reshape(3, 2, 2),
    "complex64": np.array([1 + 2j, -3.5j], dtype=np.complex64),
    "big_endian": np.arange(5, dtype=">i4"),
    "fortran": np.asfortranarray(np.arange(12.0).reshape(3, 4)),
    "strided": np.arange(20, dtype=np.int32)[::3],
    "high_dim": np.arange(2 * 1 * 3 * 1 * 2, dtype=np.int16).reshape(2, 1, 3, 1, 2),
}


def test_put_dense_numpy_round_trip(store):
    with store.checkpoint() as ck:
        for name, arr in _DENSE.items():
            ck.put_dense(name, arr)
    assert store.latest().dense == tuple(sorted(_DENSE))
    for name, arr in _DENSE.items():
        got = store.read_dense(name)
        assert got.dtype == arr.dtype and got.shape == arr.shape, name
        assert got.tobytes() == np.ascontiguousarray(arr).tobytes(), name
    snap = store.restore()
    assert set(snap.dense) == set(_DENSE)
    assert_bits_equal(snap.dense["complex64"], _DENSE["complex64"])


def test_put_dense_torch_round_trip(store):
    tensors = {
        "f32": torch.randn(3, 4),
        "i64": torch.arange(10),
        "f16": torch.randn(5).half(),
        "bool": torch.tensor([True, False]),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "noncontig": torch.arange(12.0).reshape(3, 4).t(),
        "grad": torch.ones(2, 2, requires_grad=True),
        "u8": torch.arange(7, dtype=torch.uint8),
    }
    with store.checkpoint() as ck:
        for name, t in tensors.items():
            ck.put_dense(name, t)
    for name, t in tensors.items():
        want = t.detach().contiguous().numpy()
        got = store.read_dense(name)
        assert isinstance(got, np.ndarray)
        assert got.dtype == want.dtype and got.shape == want.shape and got.tobytes() == want.tobytes(), name


@pytest.mark.parametrize("bad", [np.array([object(), 1], dtype=object), np.array(["a", "b"]),
                                 np.array([b"x"]), np.zeros(2, dtype=[("a", "i4"), ("b", "f4")]),
                                 np.array(["2024-01-01"], dtype="datetime64[D]")])
def test_put_dense_unsupported_dtype_raises_and_writer_stays_usable(emb, bad):
    before = snapshot_state(emb)
    with emb.checkpoint() as ck:
        ck.put_dense("ok", np.arange(3))
        with pytest.raises(cnrstore.InvalidArgument):
            ck.put_dense("bad", bad)
        assert snapshot_state(emb) == before
        ck.put_dense("ok2", np.arange(4))
    assert emb.latest().dense == ("ok", "ok2")
    with pytest.raises(cnrstore.MissingRows):
        emb.read_dense("bad")
    assert_bits_equal(emb.read_dense("ok2"), np.arange(4))


def test_put_dense_same_name_twice_in_one_version(emb):
    before = snapshot_state(emb)
    with emb.checkpoint() as ck:
        ck.put_dense("w", np.arange(3))
        with pytest.raises(cnrstore.InvalidArgument) as ei:
            ck.put_dense("w", np.arange(5))
        assert "'w'" in str(ei.value)
        assert snapshot_state(emb) == before
    assert_bits_equal(emb.read_dense("w"), np.arange(3))  # the first put stands
    with emb.checkpoint() as ck2:  # the name may be put again in a later version
        ck2.put_dense("w", np.arange(5))
    assert_bits_equal(emb.read_dense("w"), np.arange(5))
    assert_bits_equal(emb.read_dense("w", ck.version), np.arange(3))


# 5. bad input ---------------------------------------------------------------------------------------
def _dup_across_calls(ck):
    ck.put_rows("emb", [70, 5], np.zeros((2, DIM)))  # row 5 was put by the good first call


BAD_PUTS = {
    "nan": (lambda ck: ck.put_rows("emb", [70, 71, 72], np.array([[0.0] * DIM, [np.nan] * DIM, [0.0] * DIM])),
            cnrstore.InvalidArgument, ["'emb'", "71"]),
    "inf": (lambda ck: ck.put_rows("emb", [72, 70, 71], np.r_[np.zeros((2, DIM)), [[1.0] * (DIM - 1) + [-np.inf]]]),
            cnrstore.InvalidArgument, ["'emb'", "71"]),
    "float64_overflow": (lambda ck: ck.put_rows("emb", [70, 71], np.array([[0.0] * DIM, [1e39] + [0.0] * (DIM - 1)])),
                         cnrstore.InvalidArgument, ["'emb'", "71"]),
    "out_of_range": (lambda ck: ck.put_rows("emb", [70, ROWS, 71], np.zeros((3, DIM))),
                     cnrstore.InvalidArgument, ["'emb'", str(ROWS)]),
    "negative": (lambda ck: ck.put_rows("emb", [70, -3], np.zeros((2, DIM))),
                 cnrstore.InvalidArgument, ["'emb'", "-3"]),
    "float_rows": (lambda ck: ck.put_rows("emb", [70.0, 71.0], np.zeros((2, DIM))), cnrstore.InvalidArgument, ["'emb'"]),
    "fractional_rows": (lambda ck: ck.put_rows("emb", np.array([70, 71.5]), np.zeros((2, DIM))),
                        cnrstore.InvalidArgument, ["'emb'"]),
    "bool_rows": (lambda ck: ck.put_rows("emb", np.array([True, False]), np.zeros((2, DIM))),
                  cnrstore.InvalidArgument, ["'emb'"]),
    "dup_in_call": (lambda ck: ck.put_rows("emb", [70, 71, 70], np.zeros((3, DIM))), cnrstore.InvalidArgument,
                    ["'emb'", "70"]),
    "dup_across_calls": (_dup_across_calls, cnrstore.InvalidArgument, ["'emb'", "5"]),
    "wrong_dim": (lambda ck: ck.put_rows("emb", [70, 71], np.zeros((2, DIM + 1))), cnrstore.InvalidArgument,
                  ["'emb'", str(DIM)]),
    "wrong_count": (lambda ck: ck.put_rows("emb", [70, 71], np.zeros((3, DIM))), cnrstore.InvalidArgument, ["'emb'"]),
    "values_1d": (lambda ck: ck.put_rows("emb", [70], np.zeros(DIM)), cnrstore.InvalidArgument, ["'emb'"]),
    "rows_2d": (lambda ck: ck.put_rows("emb", [[70, 71]], np.zeros((2, DIM))), cnrstore.InvalidArgument, ["'emb'"]),
    "int_values": (lambda ck: ck.put_rows("emb", [70], np.zeros((1, DIM), dtype=np.int32)),
                   cnrstore.InvalidArgument, ["'emb'"]),
    "unknown_codec": (lambda ck: ck.put_rows("emb", [70], np.zeros((1, DIM)), codec="int9"),
                      cnrstore.InvalidArgument, ["int9"]),
    "unknown_table": (lambda ck: ck.put_rows("nope", [70], np.zeros((1, DIM))), cnrstore.TableNotFound, ["'nope'"]),
    "dense_object": (lambda ck: ck.put_dense("obj", np.array([object()])), cnrstore.InvalidArgument, ["'obj'"]),
    "dense_bad_name": (lambda ck: ck.put_dense("", np.zeros(2)), cnrstore.InvalidArgument, []),
}


@pytest.mark.parametrize("case", list(BAD_PUTS))
def test_bad_put_raises_leaves_store_unchanged_and_writer_usable(emb, case):
    put, exc_type, fragments = BAD_PUTS[case]
    v1 = emb.latest().version
    base = emb.read_table("emb")
    before = snapshot_state(emb)
    good_a = rand(2, seed=11)
    good_b = rand(2, seed=12)
    with emb.checkpoint(step=2) as ck:
        ck.put_rows("emb", [5, 130], good_a)          # blocks 0 and 2
        with pytest.raises(exc_type) as ei:
            put(ck)
        for frag in fragments:
            assert frag in str(ei.value), (frag, str(ei.value))
        assert snapshot_state(emb) == before  # nothing of the version is visible, nothing changed
        ck.put_rows("emb", [6, 71], good_b)           # the same writer still takes good data (block 0 merges)
    assert ck.version > v1
    assert emb.latest().version == ck.version and emb.latest().tables == ("emb",)
    expect = base.copy()
    expect[[5, 130]] = good_a
    expect[[6, 71]] = good_b
    assert_bits_equal(emb.read_table("emb"), expect)  # in particular rows 70, 72 kept their old values
    assert_bits_equal(emb.read_table("emb", version=v1), base)
    assert emb.latest().dense == ()
    assert emb.verify().ok


def test_unknown_table_and_version_in_reads(emb):
    with pytest.raises(cnrstore.TableNotFound) as ei:
        emb.read_rows("nope", [0])
    assert "'nope'" in str(ei.value)
    with pytest.raises(cnrstore.TableNotFound):
        emb.read_table("nope")
    with pytest.raises(LookupError):  # TableNotFound is a LookupError
        emb.read_table("nope", version=emb.latest().version)
    for bad_version in (0, 2, 10**6, 2**64 - 1, 2**64, 2**70):
        with pytest.raises(cnrstore.VersionNotFound):
            emb.read_rows("emb", [0], version=bad_version)
        with pytest.raises(cnrstore.VersionNotFound):
            emb.read_table("emb", version=bad_version)
        with pytest.raises(cnrstore.VersionNotFound):
            emb.read_dense("x", version=bad_version)
        with pytest.raises(cnrstore.VersionNotFound):
            emb.restore(bad_version)
    for bad_version in (-1, 1.0, "1", True):
        with pytest.raises(cnrstore.InvalidArgument):
            emb.read_rows("emb", [0], version=bad_version)


def test_reads_on_empty_store(store):
    store.create_table("t", 10, 2)
    assert store.versions() == [] and store.latest() is None
    with pytest.raises(cnrstore.VersionNotFound):
        store.read_rows("t", [0])
    with pytest.raises(cnrstore.VersionNotFound):
        store.restore()


def test_missing_rows(store):
    store.create_table("t", 500, 2, codec="fp32", block_rows=64)
    with store.checkpoint() as ck:
        ck.put_rows("t", [0, 1, 200], np.ones((3, 2)))
    with pytest.raises(cnrstore.MissingRows) as ei:
        store.read_rows("t", [0, 3, 1, 499, 300, 3])
    msg = str(ei.value)
    assert "3 row" in msg and "'t'" in msg and "3" in msg and "300" in msg and "499" in msg
    assert isinstance(ei.value, LookupError)
    with pytest.raises(cnrstore.MissingRows) as ei:
        store.read_table("t")
    assert "497 row" in str(ei.value)
    with pytest.raises(cnrstore.MissingRows):
        store.restore()  # a partly written table cannot be restored whole
    with pytest.raises(cnrstore.MissingRows) as ei:
        store.read_dense("never")
    assert "'never'" in str(ei.value)
    assert store.read_rows("t", [200, 0, 200]).tolist() == [[1.0, 1.0]] * 3


@pytest.mark.parametrize("rows", [[500], [-1], [0, 500], [1.0], np.array([0.5]), [True], [[0]],
                                  np.array([2**64 - 1], dtype=np.uint64)])
def test_read_rows_bad_rows(store, rows):
    store.create_table("t", 500, 2, codec="fp32", block_rows=64)
    with store.checkpoint() as ck:
        ck.put_rows("t", np.arange(500), np.ones((500, 2)))
    with pytest.raises(cnrstore.InvalidArgument) as ei:
        store.read_rows("t", rows)
    assert "'t'" in str(ei.value)


@pytest.mark.parametrize("meta", [{"f": object()}, {"a": np.float32(1.0)}, [1, 2], "meta", {"s": {1, 2}}])
def test_meta_not_msgpackable(emb, meta):
    before = snapshot_state(emb)
    with pytest.raises(cnrstore.InvalidArgument):
        emb.checkpoint(meta=meta)
    assert snapshot_state(emb) == before
    with emb.checkpoint(meta={"ok": True}) as ck:  # no writer was left open
        pass
    assert emb.latest().meta == {"ok": True}


@pytest.mark.parametrize("step", [1.5, "3", True])
def test_bad_step(emb, step):
    with pytest.raises(cnrstore.InvalidArgument):
        emb.checkpoint(step=step)
    with emb.checkpoint(step=4):
        pass


def test_second_concurrent_checkpoint_raises(emb):
    ck = emb.checkpoint(step=2)
    ck.put_rows("emb", [0], np.zeros((1, DIM)))
    with pytest.raises(cnrstore.CheckpointInProgress) as ei:
        emb.checkpoint(step=3)
    assert str(ck.version) in str(ei.value)
    ck.put_rows("emb", [1], np.zeros((1, DIM)))  # the first writer is unaffected
    ck.commit()
    assert emb.latest().version == ck.version and emb.latest().step == 2
    assert (emb.read_rows("emb", [0, 1]) == 0).all()
    with emb.checkpoint(step=3) as ck3:  # and once it is done, the next one may start
        pass
    assert ck3.version > ck.version
