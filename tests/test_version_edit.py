"""VersionEdit (cnrstore/engine/version_edit.py): one object per change, one encode() to the log and one apply() to
the index; the log records decode back into the edits that wrote them, byte for byte."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from cnrstore.engine import record, version_edit
from cnrstore.errors import CnrError, InvalidArgument
from cnrstore.engine.index import DenseLoc
from cnrstore.engine.version_edit import Move, VersionEdit


def _log_records(store, kind):
    """(version or seq, body bytes, decoded body) of every live log record of ``kind``."""
    out = []
    with store.engine.read() as view:
        for _k, key, loc in view.log_entries(kind):
            rec = record.parse(store.engine.storage.read(loc.segment, loc.offset, loc.length), "seg", loc.offset)
            out.append((key, rec, record.log_body(rec)))
    return out


@pytest.fixture
def written(store):
    store.create_table("t", 300, 4, codec="int8", block_rows=64)
    store.create_table("u", 40, 2, codec="fp32", block_rows=16)
    for v in range(1, 5):
        with store.checkpoint(step=v, meta={"v": v}) as ck:
            ck.put_rows("t", np.arange(v, 300, 7), np.full((len(range(v, 300, 7)), 4), v, np.float32))
            ck.put_rows("t", [299 - v], np.ones((1, 4), np.float32) * -v)  # a merge within the version
            if v % 2:
                ck.put_rows("u", [0, 39], np.zeros((2, 2), np.float32))
            ck.put_dense(f"d{v % 2}", np.arange(v))
    return store


def test_a_commit_record_decodes_into_the_edit_whose_entries_the_index_holds(written):
    """What the COMMIT says (rows with count and flags, version entry, dense names) is what the commit put
    in the index, and encoding the decoded edit gives the record's body back byte for byte."""
    with written.engine.read() as view:
        entries = {(t, b, v): loc for t, b, v, loc in view.row_entries()}
        versions = dict(view.versions())
        names = view.dense_names()
    for v, rec, body in _log_records(written, record.KIND_COMMIT):
        edit = version_edit.decode(record.KIND_COMMIT, v, body)
        assert edit.info == versions[v]
        assert edit.rows and all(loc.segment == version_edit.UNPLACED for *_k, loc in edit.rows)
        assert {(t, b): (loc.count, loc.flags) for t, b, _v, loc in edit.rows} == \
            {(t, b): (loc.count, loc.flags) for (t, b, u), loc in entries.items() if u == v}
        assert all(names[name] == did for name, did in edit.dense_names.items())
        (again,) = edit.encode()
        assert (again.kind, again.version, again.key) == (record.KIND_COMMIT, v, v)
        assert msgpack.packb(again.body, use_bin_type=True) == rec.body.tobytes()


def test_anchor_and_drop_records_round_trip(written):
    written.compact(2)
    assert written.retain(keep_last=2) == [1, 2]
    anchors = _log_records(written, record.KIND_ANCHOR)
    (drop,) = _log_records(written, record.KIND_DROP)
    assert anchors
    for v, rec, body in anchors:
        edit = version_edit.decode(record.KIND_ANCHOR, v, body)
        assert edit.anchor.version == v and edit.version is None and not edit.rows
        (again,) = edit.encode()
        assert msgpack.packb(again.body, use_bin_type=True) == rec.body.tobytes()
    seq, rec, body = drop
    edit = version_edit.decode(record.KIND_DROP, rec.version, body)
    assert (edit.drop.seq, edit.drop.latest, edit.drop.kept) == (seq, 4, [3, 4])
    assert edit.drop.dropped(1) and not edit.drop.dropped(3) and not edit.drop.dropped(5)
    (again,) = edit.encode()
    assert (again.key, again.version) == (seq, 4)
    assert msgpack.packb(again.body, use_bin_type=True) == rec.body.tobytes()


def test_a_move_applies_only_while_its_entry_still_names_the_copied_record(written):
    with written.engine.read() as view:
        did = view.dense_id("d1")
        loc = view.dense_loc(did, 3)
    elsewhere = DenseLoc(loc.segment, loc.offset + 1, loc.length)
    stale = VersionEdit(moves=[Move("dense", (did, 3), elsewhere, DenseLoc(77, 0, loc.length))])
    written.engine._index.write(stale.apply)  # planned on an entry that moved since: skipped
    with written.engine.read() as view:
        assert view.dense_loc(did, 3) == loc
    strict = VersionEdit(moves=[Move("dense", (did, 3), elsewhere, DenseLoc(77, 0, loc.length), "it changed")])
    with pytest.raises(InvalidArgument, match="it changed"):
        written.engine._index.write(strict.apply)
    with written.engine.read() as view:
        assert view.dense_loc(did, 3) == loc


def test_a_segment_is_freed_only_at_the_length_it_was_judged_at(written):
    with written.engine.read() as view:
        (seg, length), = view.segments().items()
    grown = VersionEdit(free_segments={seg: length - 1})
    written.engine._index.write(grown.apply)
    assert grown.freed == []
    with written.engine.read() as view:
        assert view.segment_length(seg) == length


def test_the_newest_version_is_dropped_only_when_allowed(written):
    with pytest.raises(CnrError, match="newest version cannot be dropped"):
        written.engine._index.write(VersionEdit(drop_versions=frozenset({4})).apply)
    assert [v.version for v in written.versions()] == [1, 2, 3, 4]
    edit = VersionEdit(drop_versions=frozenset({3, 4, 9}), allow_newest=True)
    written.engine._index.write(edit.apply)
    assert edit.dropped == [3, 4]
    assert [v.version for v in written.versions()] == [1, 2]
    assert np.array_equal(written.read_dense("d0", 2), np.arange(2))
