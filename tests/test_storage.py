"""The segment storage seam (cnrstore/engine/storage.py): the ABC and its capability flags, the local storage,
and ``fetch``, the one place a record is read and checked against the index entry that names it."""

from __future__ import annotations

import numpy as np
import pytest

import cnrstore
from cnrstore.engine import fs, record, storage
from cnrstore.errors import CorruptionError, ReadOnlyError
from cnrstore.store import Store


@pytest.fixture
def two_versions(tmp_path):
    path = str(tmp_path / "s")
    with cnrstore.open(path, create=True) as s:
        s.create_table("t", 128, 4, codec="fp32", block_rows=64)
        for v in (1, 2):
            with s.checkpoint() as ck:
                ck.put_rows("t", np.arange(128), np.full((128, 4), v, np.float32))
                ck.put_dense("d", np.arange(5) + v)
        with s.engine.read() as view:
            rows = {(t, b, v): loc for t, b, v, loc in view.row_entries()}
            dense = {(d, v): loc for d, v, loc in view.dense_entries()}
    return path, rows, dense


def test_fetch_returns_the_record_its_entry_names_and_refuses_any_other(two_versions):
    path, rows, dense = two_versions
    local = storage.LocalSegmentStorage(path)
    try:
        (tid, block, v), loc = next(iter(rows.items()))
        rec = storage.fetch(local, loc, storage.Expect(record.KIND_ROWS, tid, v, block))
        assert (rec.kind, rec.object_id, rec.block, rec.version, rec.count) == (record.KIND_ROWS, tid, block, v, loc.count)
        wrong = [storage.Expect(record.KIND_DENSE, tid, v, block), storage.Expect(record.KIND_ROWS, tid + 1, v, block),
                 storage.Expect(record.KIND_ROWS, tid, v + 7, block), storage.Expect(record.KIND_ROWS, tid, v, block + 1)]
        for expect in wrong:
            with pytest.raises(CorruptionError, match="not the one the index names"):
                storage.fetch(local, loc, expect)
        for bad_loc in (loc._replace(count=loc.count - 1), loc._replace(flags=loc.flags ^ record.FLAG_BASELINE),
                        loc._replace(base=loc.base + 1)):
            with pytest.raises(CorruptionError, match="not the one the index names"):
                storage.fetch(local, bad_loc, storage.Expect(record.KIND_ROWS, tid, v, block))
        (did, dv), dloc = next(iter(dense.items()))
        assert storage.fetch(local, dloc, storage.Expect(record.KIND_DENSE, did, dv)).version == dv
        with pytest.raises(CorruptionError):  # a location that cuts a record: its checksum fails
            storage.fetch(local, dloc._replace(offset=dloc.offset + 1))
    finally:
        local.close()


def test_gc_never_copies_a_record_other_than_the_one_its_entry_names(two_versions):
    """An index entry pointing at a whole, valid record of another version (a damaged index): GC's copy
    refuses it (CorruptionError) instead of moving the wrong rows under the entry's key."""
    path = two_versions[0]
    with cnrstore.open(path) as s:
        s.retain(keep_last=2)
        with s.engine.read() as view:
            entries = sorted(view.row_entries())
        (t1, b1, v1), (t2, b2, v2, loc2) = entries[0][:3], entries[-1]
        assert (t1, b1) != (t2, b2) or v1 != v2

        def swap(w):
            w.put_row(t1, b1, v1, loc2)  # block b1 of v1 now names the record of (b2, v2)
        s.engine._index.write(swap)
        with pytest.raises(CorruptionError, match="not the one the index names"):
            s.read_table("t", version=v1)
        from cnrstore.maintenance import compaction
        with pytest.raises(CorruptionError, match="not the one the index names"), s.engine.maintenance() as m:
            compaction._verified_bytes(m, loc2, storage.Expect(record.KIND_ROWS, t1, v1, b1))


def test_the_seam_is_an_abc_and_a_storage_without_appends_serves_readonly_stores_only(two_versions):
    path = two_versions[0]
    with pytest.raises(TypeError):
        storage.SegmentStorage()  # abstract: read, path, size, list, remove

    class ReadOnlyStorage(storage.SegmentStorage):
        def __init__(self, root):
            self.local = storage.LocalSegmentStorage(root)

        def read(self, seg, offset, length):
            return self.local.read(seg, offset, length)

        def path(self, seg):
            return self.local.path(seg)

        def size(self, seg):
            return self.local.size(seg)

        def list(self):
            return self.local.list()

        def remove(self, seg):
            raise AssertionError("a readonly store removes nothing")

    assert not ReadOnlyStorage.supports_appends and storage.LocalSegmentStorage.supports_appends
    with Store(path, create=False, readonly=True, filesystem=fs.DEFAULT, storage=ReadOnlyStorage(path)) as s:
        assert s.read_table("t", version=2)[0, 0] == 2.0
    with pytest.raises(ReadOnlyError, match="readonly=True"):
        Store(path, create=False, readonly=False, filesystem=fs.DEFAULT, storage=ReadOnlyStorage(path))
    with cnrstore.open(path) as s:  # the failed writable open released the lock
        assert s.latest().version == 2
