"""The Store API (API.md), opening and locking: a missing, empty or foreign path, the format marker,
close and use after close, a second writer in this or another process, readonly readers seeing later
versions (tables, checkpoints and bad input: test_store_checkpoints.py; faults: test_store_faults.py;
stats and edge cases: test_store_stats.py; whole-table reads: test_store_reads.py).

Every rejected call must raise its typed error *and* leave the store as it was.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import textwrap
import time

import msgpack
import numpy as np
import pytest
import xxhash

import cnrstore
from cnrstore import knobs
from cnrstore.engine import filenames

from support.store_helpers import rand, assert_bits_equal, run_python, last_json


# 1. opening -----------------------------------------------------------------------------------------
def test_open_missing_path_without_create_raises_store_not_found(store_path):
    with pytest.raises(cnrstore.StoreNotFound) as ei:
        cnrstore.open(store_path)
    assert "create=True" in str(ei.value)
    assert not os.path.exists(store_path)
    with pytest.raises(cnrstore.StoreNotFound):
        cnrstore.open(store_path, readonly=True)
    assert not os.path.exists(store_path)


def test_empty_directory_is_not_a_store(tmp_path):
    with pytest.raises(cnrstore.StoreNotFound):
        cnrstore.open(tmp_path)
    with cnrstore.open(tmp_path, create=True) as s:  # but an empty directory may become one
        assert s.versions() == [] and s.latest() is None


def test_create_then_reopen_sees_data(store_path):
    with cnrstore.open(store_path, create=True) as s:
        s.create_table("emb", 100, 4, codec="fp32", block_rows=64)
        with s.checkpoint(step=7, meta={"epoch": 2}) as ck:
            ck.put_rows("emb", np.arange(100), rand(100, 4))
            ck.put_dense("w", np.arange(6, dtype=np.int16).reshape(2, 3))
        before = s.versions()
    for create in (False, True):  # create=True on an existing store just opens it
        with cnrstore.open(store_path, create=create) as s:
            assert s.versions() == before
            assert s.tables()["emb"] == cnrstore.TableInfo("emb", 100, 4, "fp32", 64)
            assert_bits_equal(s.read_table("emb"), rand(100, 4))
            assert_bits_equal(s.read_dense("w"), np.arange(6, dtype=np.int16).reshape(2, 3))
    with cnrstore.open(store_path, readonly=True) as s:
        assert s.versions() == before


def test_create_in_non_empty_non_store_directory_raises_invalid_argument(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(cnrstore.InvalidArgument) as ei:
        cnrstore.open(tmp_path, create=True)
    assert "notes.txt" in str(ei.value)
    assert sorted(os.listdir(tmp_path)) == ["notes.txt"]  # left as it was
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_file_path_is_rejected(tmp_path):
    f = tmp_path / "afile"
    f.write_bytes(b"data")
    with pytest.raises(cnrstore.InvalidArgument):
        cnrstore.open(f, create=True)
    with pytest.raises(cnrstore.StoreNotFound):
        cnrstore.open(f)
    with pytest.raises(cnrstore.StoreNotFound):
        cnrstore.open(f, readonly=True)
    assert f.read_bytes() == b"data"


def _marker(fmt: int) -> bytes:
    payload = msgpack.packb({"format_version": fmt, "created": time.time()})
    head = struct.pack("<8sII", b"CNRSTORE", fmt, len(payload)) + payload
    return head + struct.pack("<Q", xxhash.xxh3_64_intdigest(head))


def test_marker_builder_matches_the_store_format(store_path):
    """Guard for the tests below: our hand-built marker is one the store accepts."""
    cnrstore.open(store_path, create=True).close()
    with open(filenames.marker_path(store_path), "wb") as f:
        f.write(_marker(cnrstore.FORMAT_VERSION))
    cnrstore.open(store_path).close()


@pytest.mark.parametrize("readonly", [False, True])
def test_newer_format_version_raises_format_version_error(store_path, readonly):
    cnrstore.open(store_path, create=True).close()
    with open(filenames.marker_path(store_path), "wb") as f:
        f.write(_marker(cnrstore.FORMAT_VERSION + 1))
    with pytest.raises(cnrstore.FormatVersionError) as ei:
        cnrstore.open(store_path, readonly=readonly)
    assert str(cnrstore.FORMAT_VERSION + 1) in str(ei.value) and "upgrade" in str(ei.value)


@pytest.mark.parametrize("damage", ["flip_payload", "flip_checksum", "truncate", "empty", "bad_magic"])
def test_corrupt_marker_raises_corruption_error(store_path, damage):
    cnrstore.open(store_path, create=True).close()
    path = filenames.marker_path(store_path)
    data = bytearray(open(path, "rb").read())
    if damage == "flip_payload":
        data[20] ^= 0x01
    elif damage == "flip_checksum":
        data[-1] ^= 0x80
    elif damage == "truncate":
        data = data[:-3]
    elif damage == "empty":
        data = bytearray()
    elif damage == "bad_magic":
        data[0:8] = b"NOTSTORE"
        body = bytes(data[:-8])
        data[-8:] = struct.pack("<Q", xxhash.xxh3_64_intdigest(body))
    open(path, "wb").write(bytes(data))
    for readonly in (False, True):
        with pytest.raises(cnrstore.CorruptionError) as ei:
            cnrstore.open(store_path, readonly=readonly)
        assert ei.value.path == path


def test_context_manager_close_idempotent_and_use_after_close(emb):
    s = emb
    with s as same:
        assert same is s
    s.close()
    s.close()
    for call in (lambda: s.versions(), lambda: s.latest(), lambda: s.tables(),
                 lambda: s.read_rows("emb", [0]), lambda: s.read_table("emb"), lambda: s.read_dense("x"),
                 lambda: s.restore(), lambda: s.checkpoint(), lambda: s.stats(), lambda: s.verify(),
                 lambda: s.create_table("other", 10, 2)):
        with pytest.raises(cnrstore.StoreClosed):
            call()


def test_close_with_open_writer_aborts_it(store_path):
    s = cnrstore.open(store_path, create=True)
    s.create_table("emb", 100, 4, block_rows=64)
    ck = s.checkpoint()
    ck.put_rows("emb", [1, 2], rand(2, 4))
    s.close()
    with pytest.raises(cnrstore.StoreClosed):
        ck.put_rows("emb", [3], rand(1, 4))
    with cnrstore.open(store_path) as s:
        assert s.versions() == []
        assert s.verify().ok
        # the aborted number is never handed out again
        with s.checkpoint() as ck2:
            ck2.put_rows("emb", [1], rand(1, 4))
        assert ck2.version > ck.version


# 2. locking -----------------------------------------------------------------------------------------
_TRY_OPEN = """
    import json, sys, cnrstore
    path, mode = sys.argv[1], sys.argv[2]
    out = {}
    try:  # a writable open
        s = cnrstore.open(path)
    except cnrstore.StoreLocked as e:
        out["writable"] = {"outcome": "locked", "pid": e.pid, "message": str(e)}
    else:
        with s.checkpoint(step=99) as ck:
            ck.put_rows("emb", [0], [[42.0] * 4])
        out["writable"] = {"outcome": "opened", "committed": ck.version}
        s.close()
    if mode == "both":  # and a readonly open
        with cnrstore.open(path, readonly=True) as s:
            out["readonly"] = {"versions": [v.version for v in s.versions()], "row0": s.read_rows("emb", [0]).tolist()}
    print(json.dumps(out))
"""


def test_second_writer_in_another_process_is_locked_out(store_path):
    with cnrstore.open(store_path, create=True) as s:
        s.create_table("emb", 10, 4, codec="fp32", block_rows=64)
        with s.checkpoint() as ck:
            ck.put_rows("emb", np.arange(10), np.ones((10, 4)))
        out = last_json(run_python(_TRY_OPEN, store_path, "both"))
        assert out["writable"]["outcome"] == "locked"
        assert out["writable"]["pid"] == os.getpid()
        assert str(os.getpid()) in out["writable"]["message"]
        # readonly opens never conflict with the writer
        assert out["readonly"] == {"versions": [ck.version], "row0": [[1.0] * 4]}
        assert [v.version for v in s.versions()] == [ck.version]  # the writer is unaffected
    # once the writer has closed, another process may write
    out = last_json(run_python(_TRY_OPEN, store_path, "write"))
    assert out["writable"]["outcome"] == "opened" and out["writable"]["committed"] > ck.version
    with cnrstore.open(store_path) as s:
        assert [v.version for v in s.versions()] == [ck.version, out["writable"]["committed"]]
        assert s.latest().step == 99
        assert s.read_rows("emb", [0, 1]).tolist() == [[42.0] * 4, [1.0] * 4]


def test_second_writer_in_same_process_is_locked_out(store):
    with pytest.raises(cnrstore.StoreLocked) as ei:
        cnrstore.open(store.path)
    assert ei.value.pid == os.getpid()


def test_readonly_in_same_process_sees_later_versions(store):
    store.create_table("emb", 200, 4, codec="fp32", block_rows=64)
    with cnrstore.open(store.path, readonly=True) as ro:
        assert ro.versions() == [] and ro.latest() is None
        with pytest.raises(cnrstore.VersionNotFound):
            ro.read_rows("emb", [0])
        expect = {}
        for i in range(3):
            with store.checkpoint(step=i) as ck:
                ck.put_rows("emb", np.arange(200), np.full((200, 4), i, np.float32))
            expect[ck.version] = i
            assert [v.version for v in ro.versions()] == list(expect)
            assert ro.latest().version == ck.version
            for v, val in expect.items():
                assert (ro.read_table("emb", version=v) == val).all()
        # a table created after the reader opened
        store.create_table("late", 10, 2, codec="fp32", block_rows=64)
        with store.checkpoint() as ck:
            ck.put_rows("late", [3], [[1.5, 2.5]])
        assert "late" in ro.tables()
        assert ro.read_rows("late", [3]).tolist() == [[1.5, 2.5]]
        # writes through the readonly handle are refused
        with pytest.raises(cnrstore.ReadOnlyError):
            ro.checkpoint()
        with pytest.raises(cnrstore.ReadOnlyError):
            ro.create_table("x", 10, 2)
        assert ro.verify().ok
    # closing the reader leaves the writer working
    with store.checkpoint() as ck:
        ck.put_rows("emb", [0], np.zeros((1, 4)))
    assert store.read_rows("emb", [0, 1]).tolist() == [[0.0] * 4, [2.0] * 4]


_READER = """
    import json, sys, cnrstore
    cnrstore.knobs.INDEX_MAP_BYTES = 64 << 10   # a small map, so the writer's growth must be adopted
    s = cnrstore.open(sys.argv[1], readonly=True)
    print(json.dumps({"versions": [v.version for v in s.versions()]}), flush=True)
    for line in sys.stdin:
        v = int(line)
        t = s.read_table("emb", version=v)
        print(json.dumps({"versions": [x.version for x in s.versions()], "sum": float(t.sum(dtype="f8")),
                          "row": t[5].tolist(), "ok": s.verify().ok}), flush=True)
    s.close()
"""


def _reply(proc):
    line = proc.stdout.readline()
    if not line:
        proc.wait(timeout=30)
        raise AssertionError(f"reader process died: {proc.stderr.read()}")
    return json.loads(line)


def test_readonly_in_other_process_sees_later_versions_across_map_growth(store_path, monkeypatch):
    N = 64 * 512
    monkeypatch.setattr(knobs, "INDEX_MAP_BYTES", 64 << 10)
    monkeypatch.setattr(knobs, "SEGMENT_BYTES", 64 << 10)
    with cnrstore.open(store_path, create=True) as s:
        s.create_table("emb", N, 1, codec="fp32", block_rows=64)
        with s.checkpoint() as ck:
            ck.put_rows("emb", np.arange(N), np.zeros((N, 1)))
        env = dict(os.environ)
        env.pop(cnrstore.engine.fs.CRASH_ENV, None)
        proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(_READER), store_path], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        try:
            first = _reply(proc)
            assert first["versions"] == [ck.version]
            map0 = s.engine._index.map_size()
            versions = [ck.version]
            for i in range(1, 13):  # every block every time: many index entries, several map doublings
                with s.checkpoint() as ck:
                    ck.put_rows("emb", np.arange(N), np.full((N, 1), i, np.float32))
                versions.append(ck.version)
                if i % 4 == 0:
                    proc.stdin.write(f"{ck.version}\n")
                    proc.stdin.flush()
                    got = _reply(proc)
                    assert got["versions"] == versions
                    assert got["sum"] == i * N and got["row"] == [float(i)] and got["ok"]
            assert s.engine._index.map_size() >= 4 * map0  # the test did exercise growth
            proc.stdin.write(f"{versions[3]}\n")
            proc.stdin.flush()
            got = _reply(proc)
            assert got["sum"] == 3 * N
            proc.stdin.close()
            assert proc.wait(timeout=60) == 0, proc.stderr.read()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_writes_on_readonly_store_raise_read_only_error(emb):
    with cnrstore.open(emb.path, readonly=True) as ro:
        with pytest.raises(cnrstore.ReadOnlyError):
            ro.create_table("t", 10, 2)
        with pytest.raises(cnrstore.ReadOnlyError):
            ro.checkpoint(step=1)
        assert ro.versions() == emb.versions()
        assert "t" not in ro.tables()
