"""The Store API (API.md) under faults and growth: a full disk leaves each committed version intact and the
one in flight absent; LMDB map growth and segment rolling are invisible to readers and writers.
"""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest

import cnrstore
from cnrstore import knobs
from cnrstore.engine import filenames
from cnrstore.engine.fs import FileSystem
from cnrstore.store import Store

from support.store_helpers import DIM, dd, rand, assert_bits_equal, snapshot_state


# 6. full disk ---------------------------------------------------------------------------------------
class FullDiskFS(FileSystem):
    """Writes fail with ENOSPC once ``budget`` bytes have been written (optionally after writing part of
    the data, like a partial write); fsync fails with ENOSPC while ``fail_fsync`` is set."""

    def __init__(self):
        self.budget: int | None = None
        self.written = 0
        self.partial = False
        self.fail_fsync = False
        self.faults = 0
        self.failed_offsets = []

    def pwritev(self, fd, buffers, offset):
        total = sum(memoryview(b).nbytes for b in buffers)
        if self.budget is not None and self.written + total > self.budget:
            self.faults += 1
            self.failed_offsets.append(offset)
            room = max(0, self.budget - self.written)
            if self.partial and room:
                data = b"".join(bytes(memoryview(b).cast("B")) for b in buffers)[:room]
                os.pwrite(fd, data, offset)
                self.written += room
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        n = super().pwritev(fd, buffers, offset)
        self.written += n
        return n

    def fsync(self, fd):
        if self.fail_fsync:
            self.faults += 1
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        super().fsync(fd)


def _segment_bytes(path):
    d = filenames.segments_dir(path)
    return {n: os.path.getsize(os.path.join(d, n)) for n in os.listdir(d)}


@pytest.mark.parametrize("where", ["put_rows", "put_rows_partial", "put_dense", "new_segment", "fsync"])
def test_full_disk_aborts_checkpoint_and_keeps_committed_versions(store_path, where):
    fs = FullDiskFS()
    s = Store(store_path, create=True, readonly=False, filesystem=fs)
    s.create_table("emb", 512, DIM, codec="int8", block_rows=64)
    s.create_table("raw", 100, 3, codec="fp32", block_rows=64)
    with s.checkpoint(step=1) as ck:
        ck.put_rows("emb", np.arange(512), rand(512, seed=21))
        ck.put_rows("raw", np.arange(100), rand(100, 3, seed=22))
    with s.checkpoint(step=2) as ck:
        ck.put_rows("emb", np.arange(0, 512, 5), rand(103, seed=23))
        ck.put_dense("d", np.arange(10.0))
    committed = snapshot_state(s)
    dense_before = s.read_dense("d")
    seg_before = _segment_bytes(store_path)
    if where == "new_segment":  # reopened with 4 KiB segments, its active one is full: the next append starts one
        assert max(seg_before.values()) > 4096
        s.close()
        s = Store(store_path, create=False, readonly=False, filesystem=fs,
                  options=cnrstore.Options(segment_bytes=4096))
    fs.partial = where == "put_rows_partial"
    fs.fail_fsync = where == "fsync"
    if where != "fsync":
        fs.budget = fs.written + (0 if where == "new_segment" else 3000)

    with pytest.raises(cnrstore.StorageFull) as ei:
        with s.checkpoint(step=3) as ck:
            ck.put_rows("raw", [1], rand(1, 3, seed=24))  # small: fits the budget
            if where == "put_dense":
                ck.put_dense("big", np.zeros(100_000))
            else:
                ck.put_rows("emb", np.arange(512), rand(512, seed=25))
    assert fs.faults >= 1
    if where == "new_segment":
        assert fs.failed_offsets == [0]  # the new segment's header did not fit
    elif where != "fsync":
        assert fs.failed_offsets and all(off > 0 for off in fs.failed_offsets)
    err = ei.value
    assert isinstance(err, OSError) and isinstance(err, cnrstore.CnrError) and err.errno == errno.ENOSPC
    assert "free disk space" in str(err)
    # the version is absent, every committed version reads back intact, no garbage left in the log
    assert snapshot_state(s) == committed
    assert ck.version not in [v.version for v in s.versions()]
    assert_bits_equal(s.read_dense("d"), dense_before)
    assert _segment_bytes(store_path) == seg_before
    with pytest.raises(cnrstore.VersionNotFound):
        s.read_rows("raw", [1], version=ck.version)

    # lift the fault: the same Store writes and commits again
    fs.budget, fs.fail_fsync, fs.partial = None, False, False
    new = rand(512, seed=26)
    with s.checkpoint(step=4) as ck4:
        ck4.put_rows("emb", np.arange(512), new)
    assert ck4.version > ck.version
    assert s.versions()[-1].parent == committed[0][-1].version
    assert_bits_equal(s.read_table("emb"), dd("int8", new))
    assert s.verify().ok
    s.close()
    with cnrstore.open(store_path) as s2:
        infos, reads = snapshot_state(s2)
        assert infos[:2] == committed[0]
        assert {k: r for k, r in reads.items() if k[0] != ck4.version} == committed[1]
        assert_bits_equal(s2.read_table("emb"), dd("int8", new))
        assert s2.verify().ok


def _full_disk_store_of_one_version(store_path):
    """(its FullDiskFS, a writable store on it, the writer of its one version: table 'emb', 256 x DIM fp32,
    every row ``rand(256)``)."""
    fs = FullDiskFS()
    s = Store(store_path, create=True, readonly=False, filesystem=fs)
    s.create_table("emb", 256, DIM, codec="fp32", block_rows=64)
    with s.checkpoint() as ck1:
        ck1.put_rows("emb", np.arange(256), rand(256))
    return fs, s, ck1


def test_full_disk_without_with_block_then_abort(store_path):
    fs, s, ck1 = _full_disk_store_of_one_version(store_path)
    fs.budget = fs.written + 100
    ck = s.checkpoint()
    with pytest.raises(cnrstore.StorageFull):
        ck.put_rows("emb", np.arange(256), np.zeros((256, DIM)))
    with pytest.raises(cnrstore.CnrError):  # a failed writer cannot commit
        ck.commit()
    with pytest.raises(cnrstore.CnrError):
        ck.put_rows("emb", [0], np.zeros((1, DIM)))
    fs.budget = None
    # the failed writer no longer blocks the store, and aborting it later harms no newer writer
    ck2 = s.checkpoint()
    ck2.put_rows("emb", [0], np.zeros((1, DIM)))
    ck.abort()
    ck.abort()
    ck2.commit()
    assert [v.version for v in s.versions()] == [ck1.version, ck2.version]
    expect = rand(256)
    expect[0] = 0
    assert_bits_equal(s.read_table("emb"), expect)
    s.close()
    with cnrstore.open(store_path) as s2:
        assert s2.verify().ok
        assert_bits_equal(s2.read_table("emb", ck1.version), rand(256))


def test_full_disk_while_readonly_reader_is_open(store_path):
    fs, s, ck1 = _full_disk_store_of_one_version(store_path)
    with cnrstore.open(store_path, readonly=True) as ro:
        fs.budget = fs.written + 1000
        fs.partial = True
        with pytest.raises(cnrstore.StorageFull):
            with s.checkpoint() as ck:
                ck.put_rows("emb", np.arange(256), np.zeros((256, DIM)))
        assert [v.version for v in ro.versions()] == [ck1.version]
        assert_bits_equal(ro.read_table("emb"), rand(256))
        fs.budget = None
        with s.checkpoint() as ck2:
            ck2.put_rows("emb", [3], np.ones((1, DIM)))
        assert ro.read_rows("emb", [3]).tolist() == [[1.0] * DIM]
    s.close()


# 7. LMDB map growth ---------------------------------------------------------------------------------
def test_index_map_growth_is_invisible(store_path, monkeypatch):
    monkeypatch.setattr(knobs, "INDEX_MAP_BYTES", 64 << 10)
    with cnrstore.open(store_path, create=True) as s:
        map0 = s.engine._index.map_size()
        ro = cnrstore.open(store_path, readonly=True)  # opened before any growth
        expect = {}
        for i in range(24):
            name = f"t{i % 6}"
            if name not in s.tables():
                s.create_table(name, 64 * 300, 1, codec="fp32", block_rows=64)
            with s.checkpoint(step=i, meta={"pad": "x" * 200, "i": i}) as ck:
                rows = np.arange(i % 64, 64 * 300, 64)  # one row in each of 300 blocks
                ck.put_rows(name, rows, np.full((rows.size, 1), i, np.float32))
                ck.put_dense(f"d{i}", np.full(3, i))
            expect[ck.version] = (name, rows, i)
        assert s.engine._index.map_size() >= 16 * map0, "the test should grow the map several times"
        for reader in (s, ro):
            infos = reader.versions()
            assert [v.version for v in infos] == list(expect)
            assert [v.meta["i"] for v in infos] == list(range(24))
            for v, (name, rows, i) in expect.items():
                assert (reader.read_rows(name, rows, version=v) == i).all()
                assert_bits_equal(reader.read_dense(f"d{i}", version=v), np.full(3, i))
        assert ro.verify().ok and s.verify().ok
        ro.close()
    with cnrstore.open(store_path, readonly=True) as s:
        assert len(s.versions()) == 24
        name, rows, i = expect[max(expect)]
        assert (s.read_rows(name, rows) == i).all()


def test_index_map_growth_during_create_table(store_path, monkeypatch):
    monkeypatch.setattr(knobs, "INDEX_MAP_BYTES", 64 << 10)
    with cnrstore.open(store_path, create=True) as s:
        map0 = s.engine._index.map_size()
        for i in range(150):
            s.create_table(f"table_{i:04d}_" + "x" * 380, 10, 2)
        assert s.engine._index.map_size() > map0
        assert len(s.tables()) == 150
    with cnrstore.open(store_path) as s:
        assert len(s.tables()) == 150


# 8. segment rolling ---------------------------------------------------------------------------------
def test_segment_rolling(store_path, monkeypatch):
    monkeypatch.setattr(knobs, "SEGMENT_BYTES", 4096)
    expect = {}
    with cnrstore.open(store_path, create=True) as s:
        s.create_table("emb", 1024, 16, codec="int4", block_rows=64)
        state = np.zeros((1024, 16), np.float32)
        for i in range(6):
            rows = np.arange(1024) if i == 0 else np.arange(i, 1024, 7)
            vals = rand(rows.size, 16, seed=30 + i)
            with s.checkpoint() as ck:
                ck.put_rows("emb", rows, vals)
                ck.put_dense("big", np.full(3000, i, dtype=np.int32))  # 12 KB: larger than a segment
            state[rows] = dd("int4", vals)
            expect[ck.version] = state.copy()
        segs = os.listdir(filenames.segments_dir(store_path))
        assert len(segs) >= 6
        for v, e in expect.items():
            assert_bits_equal(s.read_table("emb", version=v), e)
        assert s.verify().ok
    with cnrstore.open(store_path) as s:
        assert sorted(os.listdir(filenames.segments_dir(store_path))) == sorted(segs)
        for i, (v, e) in enumerate(expect.items()):
            assert_bits_equal(s.read_table("emb", version=v), e)
            assert_bits_equal(s.read_dense("big", version=v), np.full(3000, i, dtype=np.int32))
        rep = s.verify()
        assert rep.ok and rep.records_checked > 0
