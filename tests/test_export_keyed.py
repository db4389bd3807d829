"""Keyed tables through export and import (issue 50): a nested export holds keyed/<name>/keys, /values and
/columns/<column>; `import` takes safetensors, torch and dcp exports back, every column's dtype and every bit
of read_keyed equal; npz holds the same arrays; malformed keyed entries are refused naming the fix."""

from __future__ import annotations

import numpy as np
import pytest

import cnrstore
from cnrstore import nested_import
from cnrstore.errors import InvalidArgument
from cnrstore.export import export_path

pytest.importorskip("safetensors")

COLUMNS = {"flag": "bool", "i8": "int8", "u16": "uint16", "u64": ("uint64", 2), "h": "float16", "d": ("float64", 3),
           "step": "int64"}


def _columns(keys: np.ndarray, salt: int) -> dict:
    n = keys.size
    return {"flag": keys % 2 == 0, "i8": (keys % 100 - 50).astype(np.int8), "u16": (keys % 60000).astype(np.uint16),
            "u64": np.stack([keys.astype(np.uint64), np.full(n, 2**63 + salt, np.uint64)], 1),
            "h": (keys % 7).astype(np.float16) / 3, "d": np.tile(keys[:, None] / 3.0, 3) + salt,
            "step": np.full(n, salt, np.int64)}


def _save(store, puts, evicts=(), salt=0):
    keys = np.asarray(puts, np.int64)
    with store.checkpoint(step=salt, meta={"salt": salt}) as ck:
        if keys.size:
            ck.put_keys("ids", keys, np.random.default_rng(salt).standard_normal((keys.size, 5)).astype(np.float32),
                        columns=_columns(keys, salt))
        if len(evicts):
            ck.delete_keys("ids", np.asarray(evicts, np.int64))
        ck.put_rows("emb", np.arange(8), np.full((8, 2), salt, np.float32))
        if salt == 1:  # (a keyed table every key of which is evicted by version 2: exported with none)
            ck.put_keys("empty", np.arange(4), np.ones((4, 2), np.float32))
        else:
            ck.delete_keys("empty", np.arange(4))


@pytest.fixture
def keyed_store(store):
    store.create_table("ids", dim=5, keyed=True, partitions=16, columns=COLUMNS)
    store.create_table("empty", dim=2, keyed=True, partitions=4)
    store.create_table("emb", 8, 2)
    _save(store, np.r_[np.arange(-50, 200), [1 << 62, -(1 << 62)]], salt=1)
    _save(store, np.arange(300, 320), evicts=np.arange(0, 40), salt=2)
    return store


def same_keyed(a, b) -> None:
    assert np.array_equal(a.keys, b.keys) and a.keys.dtype == b.keys.dtype == np.int64
    assert a.values.dtype == b.values.dtype == np.float32
    assert np.array_equal(a.values.view(np.uint32), b.values.view(np.uint32))
    assert set(a.columns) == set(b.columns)
    for name in a.columns:
        assert a.columns[name].dtype == b.columns[name].dtype and a.columns[name].shape == b.columns[name].shape, name
        assert a.columns[name].tobytes() == b.columns[name].tobytes(), name


@pytest.mark.parametrize("fmt", ["safetensors", "torch", "dcp", "npz"])
def test_round_trip_store_export_import_bit_for_bit(keyed_store, tmp_path, fmt):
    pytest.importorskip("torch")
    from cnrstore.torch.imports import import_checkpoint

    out = tmp_path / f"out.{fmt}"
    report = export_path(keyed_store, fmt, out)
    assert report.layout == "nested"
    got = import_checkpoint(tmp_path / "back", out)
    assert got.nested and got.keyed["ids"][0] == keyed_store.keys("ids").size and got.keyed["empty"][0] == 0
    with cnrstore.open(tmp_path / "back", readonly=True) as back:
        for name in ("ids", "empty"):
            same_keyed(keyed_store.read_keyed(name), back.read_keyed(name))
        info, want = back.tables()["ids"], keyed_store.tables()["ids"]
        assert info.keyed and sorted(info.columns) == sorted(want.columns) and info.dim == 5
        assert (info.partitions, back.tables()["empty"].partitions) == (16, 4)  # (as exported: not the default)
        assert not back.read_keys("ids", np.arange(0, 40)).found.any()  # the evicted stay evicted
        assert np.array_equal(back.read_table("emb"), keyed_store.read_table("emb"))
        if fmt not in ("safetensors", "npz"):  # (these keep version and step in a header / none: not read)
            assert back.latest().step == 2 and back.latest().meta == {"salt": 2}


def test_npz_and_safetensors_hold_the_keyed_arrays(keyed_store, tmp_path):
    from safetensors.numpy import load_file

    export_path(keyed_store, "npz", tmp_path / "o.npz")
    export_path(keyed_store, "safetensors", tmp_path / "o.st")
    want = keyed_store.read_keyed("ids")
    for arrays in (dict(np.load(tmp_path / "o.npz")), load_file(str(tmp_path / "o.st"))):
        assert {k for k in arrays if k.startswith("keyed/ids/")} == {
            "keyed/ids/keys", "keyed/ids/values", "keyed/ids/partitions", *(f"keyed/ids/columns/{c}" for c in COLUMNS)}
        nested = nested_import.split(arrays, "the export")
        same_keyed(want, nested.keyed["ids"])
        assert nested.partitions == {"ids": 16, "empty": 4}
        assert arrays["keyed/empty/values"].shape == (0, 2)


def test_malformed_keyed_entries_are_refused_naming_the_fix():
    keys = np.arange(3, dtype=np.int64)
    ok = {"keyed/t/keys": keys, "keyed/t/values": np.zeros((3, 2), np.float32)}
    with pytest.raises(InvalidArgument, match="no keyed table"):
        nested_import.split({**ok, "keyed/u/values": np.zeros((3, 2), np.float32)}, "x")
    with pytest.raises(InvalidArgument, match="no keyed/t/values"):
        nested_import.split({"keyed/t/keys": keys}, "x")
    with pytest.raises(InvalidArgument, match=r"keyed/t/keys of x must be int64"):
        nested_import.split({**ok, "keyed/t/keys": keys.astype(np.int32)}, "x")
    with pytest.raises(InvalidArgument, match=r"columns/c of x must be \(3,\)"):
        nested_import.split({**ok, "keyed/t/columns/c": np.zeros(4)}, "x")
    with pytest.raises(InvalidArgument, match="more than one keyed table"):
        nested_import.split({**ok, "keyed/t/columns/x/keys": keys, "keyed/t/columns/x/values": ok["keyed/t/values"]},
                            "x")
    with pytest.raises(InvalidArgument, match=r"partitions of x must be one int in \[1, 65536\]"):
        nested_import.split({**ok, "keyed/t/partitions": np.array([0], np.int64)}, "x")
    assert nested_import.split(ok, "x").partitions == {}  # (an export before partitions were recorded)
    with pytest.raises(InvalidArgument, match="not an entry of a nested cnrstore export"):
        nested_import.split({**ok, "weight": keys}, "x")
