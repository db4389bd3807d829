"""The Store API (API.md): stats() and the edge cases of tables, dense arrays and opening.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

import cnrstore
from cnrstore import knobs

from support.store_helpers import rand


# 9. stats -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bound", [None, 3])
def test_stats(store_path, bound):
    """With plain increments (bound None) read chains grow by one per version; with a bound of 3 a
    checkpoint writes a cumulative delta once a block's chain would outgrow it (merge.py)."""
    store = cnrstore.open(store_path, create=True, options=cnrstore.Options(read_chain_bound=bound))
    st = store.stats()
    for key in ("bytes_written", "bytes_on_disk", "live_bytes", "versions", "max_read_chain"):
        assert key in st
    assert st["bytes_written"] == 0 and st["versions"] == 0 and st["max_read_chain"] == 0
    store.create_table("emb", 256, 8, codec="fp32", block_rows=64)
    with store.checkpoint() as ck:
        ck.put_rows("emb", np.arange(256), rand(256))  # baseline of every block
    assert store.stats()["max_read_chain"] == 1
    with store.checkpoint() as ck:
        ck.abort()  # an aborted version adds nothing
    chains = []
    for i in range(4):
        with store.checkpoint() as ck:
            ck.put_rows("emb", [3 + i, 70], rand(2, seed=i))
            if i == 1:
                ck.put_dense("d", np.zeros(100))
        chains.append(store.stats()["max_read_chain"])
    assert chains == ([2, 3, 4, 5] if bound is None else [2, 3, 3, 3])
    st = store.stats()
    infos = store.versions()
    assert st["versions"] == len(infos) == 5
    assert st["bytes_written"] == sum(v.bytes for v in infos) > 256 * 8 * 4
    assert 0 < st["live_bytes"] <= st["bytes_written"]
    assert st["bytes_on_disk"] >= st["live_bytes"]
    # a full rewrite of the block on top resets the chain of block 0 but not of block 1
    with store.checkpoint() as ck:
        ck.put_rows("emb", np.arange(64), rand(64, seed=9))
    assert store.stats()["max_read_chain"] == (5 if bound is None else 3)
    assert store.stats()["bytes_written"] == sum(v.bytes for v in store.versions())
    store.close()
    with cnrstore.open(store.path, readonly=True) as ro:
        assert ro.stats()["bytes_written"] == sum(v.bytes for v in ro.versions())


def test_unknown_table_is_named_before_a_missing_version(store):
    # API.md: any call naming an unknown table raises TableNotFound, even before any version exists
    with pytest.raises(cnrstore.TableNotFound):
        store.read_rows("nope", [0])
    with pytest.raises(cnrstore.TableNotFound):
        store.read_table("nope", version=12345)


def test_empty_put_does_not_list_the_table(store):
    store.create_table("t", 10, 4, codec="fp32")
    with store.checkpoint() as ck:
        ck.put_rows("t", np.zeros(0, dtype=np.int64), np.zeros((0, 4), np.float32))
    assert store.latest().tables == ()


def test_integer_and_bool_values_are_refused_as_the_contract_says(store):
    # API.md: values are a float array-like; anything else raises InvalidArgument
    store.create_table("t", 10, 4, codec="fp32")
    with store.checkpoint() as ck:
        for bad in ([[1, 2, 3, 4]], np.ones((1, 4), dtype=bool)):
            with pytest.raises(cnrstore.InvalidArgument, match="floating point"):
                ck.put_rows("t", [1], bad)
        ck.put_rows("t", [1], [[1.0, 2.0, 3.0, 4.0]])
    assert store.read_rows("t", [1]).tolist() == [[1.0, 2.0, 3.0, 4.0]]


def test_tiny_initial_index_map_still_creates_a_store(store_path, monkeypatch):
    monkeypatch.setattr(cnrstore.knobs, "INDEX_MAP_BYTES", 4096)
    with cnrstore.open(store_path, create=True) as s:
        s.create_table("t", 10, 4, codec="fp32")
        with s.checkpoint() as ck:
            ck.put_rows("t", [1], np.ones((1, 4), np.float32))
        assert s.read_rows("t", [1]).sum() == 4.0


def test_rejected_oversized_block_leaves_no_trace_of_the_table(store, monkeypatch):
    # an InvalidArgument raised while records are being laid out (after validation) must not list the
    # table in the version, nor leave rows of the failed call behind
    store.create_table("t", 64, 4, codec="fp32", block_rows=64)
    store.create_table("u", 8, 4, codec="fp32")
    monkeypatch.setattr(cnrstore.knobs, "MAX_RECORD_BYTES", 100)
    with store.checkpoint() as ck:
        with pytest.raises(cnrstore.InvalidArgument, match="smaller block_rows"):
            ck.put_rows("t", np.arange(64), np.ones((64, 4), np.float32))
        monkeypatch.setattr(cnrstore.knobs, "MAX_RECORD_BYTES", (1 << 32) - 1)
        ck.put_rows("u", [0], np.ones((1, 4), np.float32))
    assert store.latest().tables == ("u",)
    with pytest.raises(cnrstore.MissingRows):
        store.read_rows("t", [0])


def test_a_failed_open_releases_the_lock_and_the_index(store_path, monkeypatch):
    cnrstore.open(store_path, create=True).close()

    def broken_recover(*args, **kwargs):
        raise OSError("injected failure during recovery")

    monkeypatch.setattr(cnrstore.engine.storage.LocalSegmentStorage, "recover", broken_recover)
    with pytest.raises(OSError, match="injected"):
        cnrstore.open(store_path)
    assert not cnrstore.engine.index._SharedEnv._registry, "the failed open left its LMDB environment open"
    monkeypatch.undo()
    with cnrstore.open(store_path) as store:  # neither the lock nor the LMDB environment leaked
        store.create_table("t", 4, 2, codec="fp32")


def test_missing_segments_directory_is_corruption_not_a_raw_or_permission_error(store_path):
    """segments/ deleted by hand: a writable open says the data is gone (CorruptionError naming the
    directory), not FileNotFoundError or PermissionDenied; a readonly open's reads report it too."""
    import shutil

    with cnrstore.open(store_path, create=True) as s:
        s.create_table("t", 16, 4, codec="fp32")
        with s.checkpoint() as ck:
            ck.put_rows("t", np.arange(16), np.ones((16, 4)))
    seg_dir = os.path.join(store_path, "segments")
    shutil.rmtree(seg_dir)
    with pytest.raises(cnrstore.CorruptionError, match="segments directory .* is missing") as ei:
        cnrstore.open(store_path)
    assert not isinstance(ei.value, PermissionError) and ei.value.path == seg_dir
    assert not os.path.exists(seg_dir)  # the open created nothing in its place
    with cnrstore.open(store_path, readonly=True) as r:
        with pytest.raises(cnrstore.CorruptionError, match="missing"):
            r.read_table("t")
        assert not r.verify().ok


def test_dense_names_lists_every_dense_array_a_version_holds(tmp_path):
    """``dense_names`` lists the dense arrays by name (sorted), whichever version put them; ``read_dense``
    then says which version holds which."""
    with cnrstore.open(tmp_path / "s", create=True) as store:
        assert store.dense_names() == []
        with store.checkpoint(step=1) as ck:
            ck.put_dense("zeta", np.arange(3, dtype=np.int64))
        with store.checkpoint(step=2) as ck:
            ck.put_dense("alpha", np.ones(2, dtype=np.float32))
        assert store.dense_names() == ["alpha", "zeta"]
        with pytest.raises(cnrstore.MissingRows):
            store.read_dense("alpha", ck.version - 1)
    closed = cnrstore.open(tmp_path / "s")
    closed.close()
    with pytest.raises(cnrstore.StoreClosed):
        closed.dense_names()
