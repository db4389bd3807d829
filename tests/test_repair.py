"""Index loss and damage: an open never destroys data it cannot account for, damage to the index is a
typed error naming ``cnrstore repair``, and repair rebuilds the index from the segment log."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import cnrstore
from cnrstore.engine import filenames, record  # noqa: F401
from cnrstore.errors import CorruptionError, IndexDamaged

PY = sys.executable


def _make_store(path, versions: int = 4) -> None:
    rng = np.random.default_rng(0)
    with cnrstore.open(path, create=True) as s:
        s.create_table("emb", num_rows=300, dim=8, codec="int8", block_rows=64)
        s.create_table("f", num_rows=100, dim=4, codec="fp32", block_rows=32)
        for v in range(versions):
            with s.checkpoint(step=v, meta={"i": v}) as ck:
                rows = rng.choice(300, size=40, replace=False)
                ck.put_rows("emb", rows, rng.standard_normal((40, 8)).astype(np.float32))
                ck.put_rows("f", np.arange(v, 100, 3), rng.standard_normal((len(range(v, 100, 3)), 4)))
                ck.put_dense("dense", np.full(3, v, dtype=np.int64))


def _segment_digests(path) -> dict[str, str]:
    seg_dir = filenames.segments_dir(str(path))
    return {n: hashlib.sha256(open(os.path.join(seg_dir, n), "rb").read()).hexdigest()
            for n in sorted(os.listdir(seg_dir))}


def _data_mdb(path) -> str:
    return os.path.join(filenames.index_dir(str(path)), "data.mdb")


def _lose_deleted(path):
    os.remove(_data_mdb(path))


def _lose_truncated(path):
    os.truncate(_data_mdb(path), 0)


def _lose_dir(path):
    shutil.rmtree(filenames.index_dir(str(path)))


@pytest.mark.parametrize("damage", [_lose_deleted, _lose_truncated, _lose_dir], ids=["deleted", "empty", "no-dir"])
@pytest.mark.parametrize("readonly", [False, True], ids=["writable", "readonly"])
def test_open_with_deleted_index_raises_corruption_and_keeps_segments(tmp_path, damage, readonly):
    path = tmp_path / "s"
    _make_store(path)
    before = _segment_digests(path)
    assert before
    damage(path)
    with pytest.raises(IndexDamaged, match="cnrstore repair") as info:
        cnrstore.open(path, readonly=readonly)
    assert isinstance(info.value, CorruptionError)
    assert _segment_digests(path) == before  # nothing deleted, nothing truncated


def test_unknown_segment_that_is_not_a_leftover_refuses_open_and_deletes_nothing(tmp_path):
    path = tmp_path / "s"
    _make_store(path, versions=2)
    seg_dir = filenames.segments_dir(str(path))
    # a committed segment the index no longer lists (e.g. an index restored from an older copy)
    with cnrstore.open(path) as s:
        with s.engine.read() as view:
            committed = view.segments()
        first = min(committed)

        def forget(w):
            w.delete_segment(first)
        s.engine._index.write(forget)
    before = _segment_digests(path)
    with pytest.raises(IndexDamaged, match="cnrstore repair"):
        cnrstore.open(path)
    assert _segment_digests(path) == before
    assert os.path.exists(os.path.join(seg_dir, f"{first:016x}.seg"))


def test_leftover_segment_of_an_uncommitted_checkpoint_is_still_removed(tmp_path):
    path = tmp_path / "s"
    _make_store(path, versions=1)
    with cnrstore.open(path) as s:
        with s.engine.read() as view:
            high = max(view.segments())
    leftover = filenames.segment_path(str(path), high + 5)
    with open(leftover, "wb") as f:
        f.write(b"x" * 10)
    with cnrstore.open(path) as s:
        assert any("removed uncommitted segment" in n for n in s.recovery_notes)
    assert not os.path.exists(leftover)


_TRUNCATE = r"""
import os, sys
import cnrstore
path, what = sys.argv[1], sys.argv[2]
try:
    if what == "open":
        s = cnrstore.open(path, readonly=True)
        s.versions(); s.read_table("emb")
    else:
        s = cnrstore.open(path)
        s.versions()
except cnrstore.CorruptionError as exc:
    print("CORRUPTION", exc)
    sys.exit(3)
sys.exit(0)
"""


@pytest.mark.parametrize("what", ["open", "open-writable"])
def test_truncated_data_mdb_is_corruption_not_sigbus(tmp_path, what):
    path = tmp_path / "s"
    _make_store(path)
    data = _data_mdb(path)
    size = os.path.getsize(data)
    os.truncate(data, size - 8192)
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    res = subprocess.run([PY, "-c", _TRUNCATE, str(path), what], capture_output=True, text=True, env=env,
                         timeout=120)
    assert res.returncode == 3, (res.returncode, res.stdout, res.stderr)  # a signal gives a negative code
    assert "truncated" in res.stdout and "cnrstore repair" in res.stdout


def test_truncated_data_mdb_cli_verify_exits_1_with_message(tmp_path):
    """Damage that keeps the store from opening is damage: verify exits 1 (issue 11 item 12) and names
    the repair, with no SIGBUS."""
    path = tmp_path / "s"
    _make_store(path)
    data = _data_mdb(path)
    os.truncate(data, os.path.getsize(data) - 4096)
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    res = subprocess.run([PY, "-m", "cnrstore.cli", "verify", str(path)], capture_output=True, text=True,
                         env=env, timeout=120)
    assert res.returncode == 1, (res.returncode, res.stdout, res.stderr)
    assert "cnrstore repair" in res.stdout


# repair -------------------------------------------------------------------------------------------------
def _read_all(s, v: int, tables, dense_names, *, damage: bool) -> dict:
    """Every byte version ``v`` reads: None where rows are missing, and with ``damage`` the string
    "CorruptionError" where a read raises it (else it propagates)."""
    caught = (cnrstore.MissingRows, CorruptionError) if damage else cnrstore.MissingRows
    reads = {}
    for key, read in [*((name, lambda n=name: s.read_table(n, v).tobytes()) for name in tables),
                      *(("dense:" + name, lambda n=name: _dense_bytes(s.read_dense(n, v))) for name in dense_names)]:
        try:
            reads[key] = read()
        except caught as exc:
            reads[key] = "CorruptionError" if isinstance(exc, CorruptionError) else None
    return reads


def _dense_bytes(arr) -> tuple:
    return arr.dtype.str, arr.shape, arr.tobytes()


def _everything(path) -> dict:
    """Every version's info and every byte it reads (tables and dense arrays)."""
    out = {}
    with cnrstore.open(path, readonly=True) as s:
        tables = s.tables()
        with s.engine.read() as view:
            dense_names = sorted(view.dense_names())
        for info in s.versions():
            out[info.version] = (info, _read_all(s, info.version, tables, dense_names, damage=False))
        out["tables"] = tables
    return out


def _everything_or_damage(path) -> dict:
    """Per version: every table's bytes, "CorruptionError" where the read raises it, dense arrays."""
    with cnrstore.open(path, readonly=True) as s:
        tables = s.tables()
        with s.engine.read() as view:
            dense_names = sorted(view.dense_names())
        return {info.version: _read_all(s, info.version, tables, dense_names, damage=True) for info in s.versions()}


def _rich_store(path) -> None:
    """Increments, merges within a version, several codecs (and a codec fallback), dense arrays, meta."""
    rng = np.random.default_rng(1)
    with cnrstore.open(path, create=True) as s:
        s.create_table("i4", num_rows=200, dim=8, codec="int4", block_rows=32)
        s.create_table("f16", num_rows=70, dim=3, codec="fp16", block_rows=16)
        s.create_table("f32", num_rows=50, dim=2, codec="fp32", block_rows=8)
        with s.checkpoint(step=0, meta={"lr": 0.1}) as ck:
            ck.put_rows("i4", np.arange(200), rng.standard_normal((200, 8)))
            ck.put_rows("f16", np.arange(70), rng.standard_normal((70, 3)))
            ck.put_dense("opt", np.arange(6, dtype=np.float64).reshape(2, 3))
        for step in range(1, 6):
            with s.checkpoint(step=step, meta={"step": step, "tag": f"s{step}"}) as ck:
                rows = np.sort(rng.choice(200, size=30, replace=False))
                ck.put_rows("i4", rows[:15], rng.standard_normal((15, 8)))
                ck.put_rows("i4", rows[15:], rng.standard_normal((15, 8)))  # merges into blocks already written
                ck.put_rows("f16", [step, 40 + step], rng.standard_normal((2, 3)))
                if step % 2:
                    ck.put_rows("f32", np.arange(step, 50, 7), rng.standard_normal((len(range(step, 50, 7)), 2)))
                    ck.put_dense("opt", np.full((2, 3), step, dtype=np.float64))
                ck.put_dense(f"rng{step % 2}", np.array([step], dtype=np.uint32))
        with s.checkpoint(step=99) as ck:  # aborted: its number is never reused
            ck.put_rows("f32", [1], np.ones((1, 2)))
            ck.abort()


def _repair_and_compare(path, before) -> cnrstore.RepairReport:
    _lose_deleted(path)
    report = cnrstore.repair(path)
    assert report.ok, report.versions_lost
    after = _everything(path)
    assert after.keys() == before.keys()
    assert after["tables"] == before["tables"]
    for v in before:
        if v == "tables":
            continue
        assert after[v][0] == before[v][0], v  # step, meta, created, parent, tables, dense, bytes
        assert after[v][1] == before[v][1], v  # bit-identical reads
    with cnrstore.open(path) as s:
        assert s.verify().ok, s.verify().problems
    return report


def test_repair_after_index_loss_recovers_every_version_bit_exactly(tmp_path):
    path = tmp_path / "s"
    _rich_store(path)
    before = _everything(path)
    segs = _segment_digests(path)
    report = _repair_and_compare(path, before)
    assert report.versions_recovered == sorted(v for v in before if v != "tables")
    assert sorted(report.tables_recovered) == ["f16", "f32", "i4"]
    assert report.old_index is not None and os.path.isdir(report.old_index)  # kept as evidence
    assert _segment_digests(path) == segs  # repair changed no segment
    with cnrstore.open(path) as s:
        newest = s.latest().version
        with s.checkpoint(step=100) as ck:
            ck.put_rows("f32", [0], np.ones((1, 2)))
        # past every version any record names (an aborted checkpoint that left no record leaves no trace)
        assert ck.version > newest
        assert s.read_rows("f32", [0])[0].tolist() == [1.0, 1.0]


def test_repair_after_compact_retain_gc_recovers_every_version(tmp_path):
    path = tmp_path / "s"
    _rich_store(path)
    with cnrstore.open(path) as s:
        s.compact(3)
        s.retain(keep_last=4)
        s.gc()
        with s.checkpoint(step=7) as ck:
            ck.put_rows("i4", [3], np.ones((1, 8)))
        s.compact()
        s.gc()
    before = _everything(path)
    report = _repair_and_compare(path, before)
    assert report.versions_dropped == [] or min(report.versions_dropped) < min(report.versions_recovered)
    # the versions retain dropped stay dropped
    with cnrstore.open(path, readonly=True) as s:
        assert [v.version for v in s.versions()] == sorted(v for v in before if v != "tables")


def test_repair_after_background_compaction_and_retention_recovers_every_kept_version(tmp_path, monkeypatch):
    from cnrstore.policy.compaction import CompactionPolicy, KeepEveryNSteps, KeepLast, MaxChain, Retention

    monkeypatch.setattr(cnrstore.knobs, "SEGMENT_BYTES", 4 << 10)  # several segments for GC to free
    path = tmp_path / "s"
    rng = np.random.default_rng(2)
    policy = CompactionPolicy(materialize=MaxChain(2), retention=Retention(KeepLast(2), KeepEveryNSteps(3)))
    with cnrstore.open(path, create=True, compaction=policy) as s:
        s.create_table("t", num_rows=128, dim=4, codec="int8", block_rows=16)
        for step in range(10):
            with s.checkpoint(step=step) as ck:
                rows = np.arange(128) if step == 0 else rng.choice(128, size=20, replace=False)
                ck.put_rows("t", rows, rng.standard_normal((rows.size, 4)))
                ck.put_dense("d", np.array([step]))
        s._compactor.close()
        assert s._compactor.errors == [] and s._compactor.steps > 0
        kept = [v.version for v in s.versions()]
    assert len(kept) < 10  # the policy dropped versions in the middle
    before = _everything(path)
    report = _repair_and_compare(path, before)
    assert report.versions_recovered == kept
    assert set(report.versions_dropped) <= set(range(1, 11)) - set(kept)


def test_repair_of_a_healthy_store_changes_nothing_and_leaves_nothing_behind(tmp_path):
    path = tmp_path / "s"
    _make_store(path)
    before = _everything(path)
    listing = sorted(os.listdir(path))
    report = cnrstore.repair(path)
    assert report.ok and report.old_index is None and "healthy" in " ".join(report.notes)
    assert report.versions_recovered == sorted(v for v in before if v != "tables")
    assert sorted(os.listdir(path)) == listing  # no index.damaged-* left behind
    _lose_deleted(path)
    report = cnrstore.repair(path)  # a damaged one is rebuilt, and its old index kept as evidence
    assert report.ok and report.old_index is not None
    report = cnrstore.repair(path)  # then healthy again: nothing to do
    assert report.ok and report.old_index is None
    after = _everything(path)
    assert {v: x[1] for v, x in after.items() if v != "tables"} == \
        {v: x[1] for v, x in before.items() if v != "tables"}


def _linear_store(path, monkeypatch) -> None:
    """v1 a full baseline of table t, then v2..v5 each an increment of block 0 only, in small segments
    (one version per segment); dense array 'd' at every version."""
    monkeypatch.setattr(cnrstore.knobs, "SEGMENT_BYTES", 64)  # every append after the first starts a segment
    monkeypatch.setattr(cnrstore.knobs, "READ_CHAIN_BOUND", None)  # plain increments: a linear chain
    with cnrstore.open(path, create=True) as s:
        s.create_table("t", num_rows=64, dim=4, codec="fp32", block_rows=16)
        for v in range(1, 6):
            with s.checkpoint(step=v) as ck:
                rows = np.arange(64) if v == 1 else np.array([v])
                ck.put_rows("t", rows, np.full((rows.size, 4), float(v)))
                ck.put_dense("d", np.array([v]))


def _record_location(path, kind, version, block=0):
    with cnrstore.open(path, readonly=True) as s:
        with s.engine.read() as view:
            if kind == "rows":
                return next(loc for t, b, v, loc in view.row_entries() if b == block and v == version)
            return next(loc for k, v, loc in view.log_entries() if k == cnrstore.engine.record.KIND_COMMIT and v == version)


def test_repair_with_a_corrupted_record_keeps_the_versions_and_names_the_damaged_block(tmp_path, monkeypatch):
    """A damaged record costs only the (version, block) pairs that need it (R2): versions 3-5 stay listed,
    block 0 of each is recorded damaged and reads of it raise CorruptionError (never older data, R1)."""
    path = tmp_path / "s"
    _linear_store(path, monkeypatch)
    before = _everything(path)
    loc = _record_location(path, "rows", 3)  # block 0's increment at version 3: read by versions 3, 4, 5
    seg_path = filenames.segment_path(str(path), loc.segment)
    with open(seg_path, "r+b") as f:
        f.seek(loc.offset + loc.length - 12)
        byte = f.read(1)
        f.seek(loc.offset + loc.length - 12)
        f.write(bytes([byte[0] ^ 0xFF]))
    _lose_deleted(path)
    report = cnrstore.repair(path)
    assert not report.ok
    assert report.versions_recovered == [1, 2, 3, 4, 5] and report.versions_lost == {}
    assert sorted(report.damaged) == [3, 4, 5]
    assert "table 't' block 0" in report.damaged[4][0] and "version 3 is damaged" in report.damaged[4][0]
    assert report.bad_records and seg_path in report.bad_records[0]
    after = _everything_or_damage(path)
    for v in (1, 2):
        assert after[v] == before[v][1]
    for v in (3, 4, 5):
        assert after[v]["t"] == "CorruptionError"
        assert after[v]["dense:d"] == before[v][1]["dense:d"]
        with cnrstore.open(path, readonly=True) as s:
            assert s.read_rows("t", [20, 63], v).tolist() == [[1.0] * 4, [1.0] * 4]  # blocks 1-3 are whole
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    res = subprocess.run([PY, "-m", "cnrstore.cli", "repair", str(path)], capture_output=True, text=True,
                         env=env, timeout=120)
    assert res.returncode == 1, res.stderr
    assert "DAMAGED BLOCK: version 3" in res.stdout and "DAMAGED" in res.stdout


def test_repair_with_a_segment_deleted_recovers_the_versions_that_do_not_need_it(tmp_path, monkeypatch):
    path = tmp_path / "s"
    _linear_store(path, monkeypatch)
    # then a new baseline of block 0 at version 6: versions 6 and 7 no longer need version 3's record
    with cnrstore.open(path) as s:
        with s.checkpoint(step=6) as ck:
            ck.put_rows("t", np.arange(16), np.full((16, 4), 6.0))
            ck.put_dense("d", np.array([6]))
        with s.checkpoint(step=7) as ck:
            ck.put_rows("t", [20], np.full((1, 4), 7.0))
            ck.put_dense("d", np.array([7]))
    before = _everything(path)
    loc = _record_location(path, "rows", 3)
    os.remove(filenames.segment_path(str(path), loc.segment))
    _lose_deleted(path)
    report = cnrstore.repair(path)
    assert report.versions_recovered == [1, 2, 3, 4, 5, 6, 7] and report.versions_lost == {}
    assert sorted(report.damaged) == [3, 4, 5]
    assert "missing" in report.damaged[3][0]
    after = _everything_or_damage(path)
    for v in (1, 2, 6, 7):
        assert after[v] == before[v][1]
    for v in (3, 4, 5):
        assert after[v]["t"] == "CorruptionError"
    with cnrstore.open(path) as s:  # the repaired store is writable; verify names what is damaged
        problems = s.verify().problems
        assert problems and all("version 3" in p or "version 4" in p or "version 5" in p for p in problems), problems
        with s.checkpoint(step=8) as ck:
            ck.put_rows("t", [1], np.zeros((1, 4)))
        assert ck.version == 8


def test_repair_with_a_commit_record_damaged_rebuilds_it_from_its_records(tmp_path, monkeypatch):
    path = tmp_path / "s"
    _linear_store(path, monkeypatch)
    before = _everything(path)
    loc = _record_location(path, "commit", 2)
    with open(filenames.segment_path(str(path), loc.segment), "r+b") as f:
        f.seek(loc.offset + 50)
        f.write(b"\x00\x01\x02")
    _lose_deleted(path)
    report = cnrstore.repair(path)
    assert report.versions_recovered == [1, 2, 3, 4, 5] and report.versions_lost == {}
    assert any("version 2: its commit record is damaged" in n for n in report.notes)
    after = _everything(path)
    for v in (1, 2, 3, 4, 5):
        assert after[v][1] == before[v][1], v


def test_cli_repair_json_on_a_healthy_store(tmp_path):
    path = tmp_path / "s"
    _make_store(path)
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    res = subprocess.run([PY, "-m", "cnrstore.cli", "repair", str(path), "--json"], capture_output=True,
                         text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    import json
    out = json.loads(res.stdout)
    assert out["ok"] and out["versions_recovered"] == [1, 2, 3, 4] and out["versions_lost"] == {}
    res = subprocess.run([PY, "-m", "cnrstore.cli", "repair", str(tmp_path / "nope")], capture_output=True,
                         text=True, env=env, timeout=120)
    assert res.returncode == 2 and "StoreNotFound" in res.stderr


def test_repair_refuses_while_a_writer_holds_the_store(tmp_path):
    path = tmp_path / "s"
    _make_store(path, versions=1)
    with cnrstore.open(path):
        with pytest.raises(cnrstore.StoreLocked):
            cnrstore.repair(path)


GOLDEN1 = os.path.join(os.path.dirname(__file__), "data", "format1", "store")


def test_format1_store_reads_and_a_writable_open_upgrades_its_marker(tmp_path):
    from cnrstore.engine.marker import read_marker as _read_marker

    path = tmp_path / "s"
    shutil.copytree(GOLDEN1, path)
    assert _read_marker(str(path)) == 1
    with cnrstore.open(path, readonly=True) as s:
        assert [v.version for v in s.versions()] == [1, 2]
    assert _read_marker(str(path)) == 1  # a readonly open changes nothing
    with cnrstore.open(path) as s:
        assert any("upgraded" in n for n in s.recovery_notes)
        with s.checkpoint(step=3) as ck:
            ck.put_rows("t_int4", [1], np.ones((1, 7), np.float32))
    assert _read_marker(str(path)) == cnrstore.FORMAT_VERSION == 4
    with cnrstore.open(path) as s:
        assert s.verify().ok


def test_repair_of_format1_versions_says_they_cannot_be_proven(tmp_path):
    path = tmp_path / "s"
    shutil.copytree(GOLDEN1, path)
    segs = _segment_digests(path)
    before = _everything(path)
    report = cnrstore.repair(path)  # the intact index proves both versions: repair keeps them (R2)
    assert report.ok and report.used_index and report.versions_recovered == [1, 2]
    assert {v: x[1] for v, x in _everything(path).items() if v != "tables"} == \
        {v: x[1] for v, x in before.items() if v != "tables"}
    _lose_deleted(path)
    report = cnrstore.repair(path)  # the log alone cannot prove a version without a COMMIT record
    assert not report.ok and report.versions_recovered == []
    assert sorted(report.versions_lost) == [1, 2]
    assert "before format 2" in report.versions_lost[1]
    assert _segment_digests(path) == segs


def test_format1_store_opened_readonly_then_writable_in_one_process(tmp_path):
    path = tmp_path / "s"
    shutil.copytree(GOLDEN1, path)
    open(os.path.join(filenames.index_dir(str(path)), "lock.mdb"), "wb").close()  # so LMDB opens it writable
    with cnrstore.open(path, readonly=True) as ro:
        with cnrstore.open(path) as s:
            with s.checkpoint(step=3) as ck:
                ck.put_rows("t_int4", [1], np.ones((1, 7), np.float32))
        assert [v.version for v in ro.versions()] == [1, 2, 3]


def test_create_fsyncs_the_index_directory_before_writing_the_marker(tmp_path, monkeypatch):
    from cnrstore.engine import fs

    calls = []
    fsync_dir, write_atomic = fs.FileSystem.fsync_dir, fs.FileSystem.write_file_atomic

    def record_dir(self, p):
        calls.append(("dir", os.path.abspath(p)))
        fsync_dir(self, p)

    def record_atomic(self, p, tmp, data):
        calls.append(("marker", os.path.abspath(p)))
        write_atomic(self, p, tmp, data)

    monkeypatch.setattr(fs.FileSystem, "fsync_dir", record_dir)
    monkeypatch.setattr(fs.FileSystem, "write_file_atomic", record_atomic)
    path = str(tmp_path / "s")
    cnrstore.open(path, create=True).close()
    marker = calls.index(("marker", filenames.marker_path(path)))
    assert ("dir", filenames.index_dir(path)) in calls[:marker]
    assert ("dir", path) in calls[:marker]


def test_verify_checks_commit_records(tmp_path, monkeypatch):
    path = tmp_path / "s"
    _linear_store(path, monkeypatch)
    loc = _record_location(path, "commit", 2)
    with open(filenames.segment_path(str(path), loc.segment), "r+b") as f:
        f.seek(loc.offset + 45)
        f.write(b"\xff\xfe")
    with cnrstore.open(path, readonly=True) as s:
        report = s.verify()
        assert not report.ok
        assert any("commit record of version 2" in p for p in report.problems)
        assert s.read_table("t", 2)[2, 0] == 2.0  # reads do not need the commit record


def test_repair_reports_progress(tmp_path):
    path = tmp_path / "s"
    _make_store(path, versions=2)
    calls = []
    cnrstore.repair(path, progress=lambda done, total: calls.append((done, total)))
    assert calls and calls[-1][0] == calls[-1][1] > 0
    assert all(d <= t for d, t in calls)


def test_drops_after_a_repair_stay_dropped_through_the_next_repair(tmp_path):
    """Repair restores meta drop_seq, so a later drop's DROP record is the newest one, and a second repair
    leaves every version dropped since dropped (retain writes no ANCHOR any more to mask it)."""
    path = tmp_path / "s"
    with cnrstore.open(path, create=True) as s:
        s.create_table("t", num_rows=16, dim=2, codec="fp32", block_rows=16)
        for v in range(1, 3):
            with s.checkpoint(step=v) as ck:
                ck.put_rows("t", np.arange(16), np.full((16, 2), v, np.float32))
        assert s.retain(keep_last=1) == [1]
        s.gc()
    assert cnrstore.repair(path).ok
    with cnrstore.open(path) as s:
        for v in range(3, 5):
            with s.checkpoint(step=v) as ck:
                ck.put_rows("t", np.arange(16) if v == 3 else [0], np.full((16 if v == 3 else 1, 2), v, np.float32))
        assert s.retain(keep_last=1) == [2, 3]
        s.gc()
    report = cnrstore.repair(path)
    assert report.ok, report.versions_lost
    assert report.versions_recovered == [4]
    with cnrstore.open(path, readonly=True) as s:
        assert [v.version for v in s.versions()] == [4]
        assert s.read_rows("t", [0, 1]).tolist() == [[4.0, 4.0], [3.0, 3.0]]


def test_repair_then_gc_then_repair_after_retain_and_compact_at_one_version(tmp_path):
    """retain writes an ANCHOR at the oldest kept version and compact another there: repair must take the
    newer one's chains (the one it indexes), or GC frees the compacted baseline that ANCHOR names and the next
    repair loses the version. (Found by tests/test_keyed_tables.py's state machine.)"""
    path = str(tmp_path / "s")
    with cnrstore.open(path, create=True) as s:
        s.create_table("t", 8, 3, block_rows=8)
        for row in (1, 2):
            with s.checkpoint() as ck:
                ck.put_rows("t", [row], np.full((1, 3), row, np.float32))
        s.retain(keep_last=1)
        s.compact(2)
        want = s.read_rows("t", [1, 2])
    for _ in range(2):
        shutil.rmtree(os.path.join(path, "index"))
        cnrstore.repair(path)
        with cnrstore.open(path) as s:
            assert [v.version for v in s.versions()] == [2]
            assert np.array_equal(s.read_rows("t", [1, 2]), want)
            s.gc()
            assert s.verify().ok
