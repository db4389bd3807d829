"""The Store API (API.md): opening, locking, tables, checkpoints, bad input, faults, map growth, stats.

Every rejected call must raise its typed error *and* leave the store as it was; every fault (a full
disk) must leave each committed version intact and the one in flight absent.
"""

from __future__ import annotations

import errno
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
import torch
import xxhash

import cnrstore
from cnrstore import codecs, knobs
from cnrstore.engine import filenames
from cnrstore.engine.fs import FileSystem
from cnrstore.store import Store

DIM = 8
ROWS = 1000
BLOCK = 64


# helpers -------------------------------------------------------------------------------------------
def dd(codec: str, values) -> np.ndarray:
    """What ``codec`` reads back for ``values``: decode(encode(values)), row by row."""
    c = codecs.get(codec)
    v = np.ascontiguousarray(values, dtype=np.float32)
    return c.decode(c.encode(v), v.shape[1])


def rand(n, dim=DIM, seed=0, scale=1.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((n, dim)) * scale).astype(np.float32)


def assert_bits_equal(a, b):
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, a.shape, b.dtype, b.shape)
    assert a.tobytes() == b.tobytes()


def snapshot_state(store):
    """Everything observable of committed versions: infos, and every table at every version."""
    infos = store.versions()
    reads = {}
    for info in infos:
        for name in store.tables():
            try:
                reads[(info.version, name)] = store.read_table(name, version=info.version).tobytes()
            except cnrstore.MissingRows as exc:
                reads[(info.version, name)] = str(exc)
    return infos, reads


def run_python(code: str, *args, timeout=120) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop(cnrstore.engine.fs.CRASH_ENV, None)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, env=env)


def last_json(proc: subprocess.CompletedProcess):
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture
def emb(store):
    """A store with table 'emb' (fp32, 1000 x 8, block 64) fully written in version 1."""
    store.create_table("emb", ROWS, DIM, codec="fp32", block_rows=BLOCK)
    with store.checkpoint(step=1) as ck:
        ck.put_rows("emb", np.arange(ROWS), rand(ROWS, seed=1))
    return store


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
            map0 = s.engine.index.map_size()
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
            assert s.engine.index.map_size() >= 4 * map0  # the test did exercise growth
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
def test_full_disk_aborts_checkpoint_and_keeps_committed_versions(store_path, monkeypatch, where):
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
    fs.partial = where == "put_rows_partial"
    fs.fail_fsync = where == "fsync"
    if where != "fsync":
        fs.budget = fs.written + (0 if where == "new_segment" else 3000)
    if where == "new_segment":  # the active segment is full now: the next append starts a new one
        assert max(seg_before.values()) > 4096
        monkeypatch.setattr(knobs, "SEGMENT_BYTES", 4096)

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


def test_full_disk_without_with_block_then_abort(store_path):
    fs = FullDiskFS()
    s = Store(store_path, create=True, readonly=False, filesystem=fs)
    s.create_table("emb", 256, DIM, codec="fp32", block_rows=64)
    with s.checkpoint() as ck1:
        ck1.put_rows("emb", np.arange(256), rand(256))
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
    fs = FullDiskFS()
    s = Store(store_path, create=True, readonly=False, filesystem=fs)
    s.create_table("emb", 256, DIM, codec="fp32", block_rows=64)
    with s.checkpoint() as ck1:
        ck1.put_rows("emb", np.arange(256), rand(256))
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
        map0 = s.engine.index.map_size()
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
        assert s.engine.index.map_size() >= 16 * map0, "the test should grow the map several times"
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
        map0 = s.engine.index.map_size()
        for i in range(150):
            s.create_table(f"table_{i:04d}_" + "x" * 380, 10, 2)
        assert s.engine.index.map_size() > map0
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


# 9. stats -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bound", [None, 3])
def test_stats(store, monkeypatch, bound):
    """With plain increments (bound None) read chains grow by one per version; with the default bound of
    3 a checkpoint writes a cumulative delta once a block's chain would outgrow it (merge.py)."""
    monkeypatch.setattr(knobs, "READ_CHAIN_BOUND", bound)
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


# -- read_table(out=), read_tables ------------------------------------------------------------------------------

def _int4_chain(store, rng, also=lambda v, ck: None) -> None:
    """Table "w" (1000 x 6, int4, blocks of 64 rows): a baseline, then 3 increments of 150 rows, 3 rows of
    each past int4's range (written with its fallback codec); ``also(v, ck)`` writes more in checkpoint v."""
    store.create_table("w", 1000, 6, codec="int4", block_rows=64)
    for v in range(4):
        with store.checkpoint() as ck:
            rows = np.arange(1000) if v == 0 else np.sort(rng.choice(1000, 150, replace=False))
            vals = rng.standard_normal((rows.size, 6)).astype(np.float32)
            vals[:3, 0] = 1e6
            ck.put_rows("w", rows, vals)
            also(v, ck)


@pytest.mark.parametrize("threads", [1, 3])
def test_read_table_into_out_equals_read_table(tmp_path, monkeypatch, threads):
    """Several blocks, a chain of increments in two codecs (int4 with int8 fallback rows): out= gives
    read_table's bits, on one thread or several, and read_tables reads several tables at once."""
    from cnrstore import knobs

    monkeypatch.setattr(knobs, "DECODE_THREADS", threads)
    monkeypatch.setattr(knobs, "DECODE_INLINE_BYTES", 0)  # (small reads: through the pool all the same)
    rng = np.random.default_rng(5)
    with cnrstore.open(str(tmp_path / "s"), create=True) as store:
        store.create_table("f", 300, 3, codec="fp32", block_rows=128)
        _int4_chain(store, rng, lambda v, ck: v < 2 and ck.put_rows(
            "f", np.arange(300), rng.standard_normal((300, 3)).astype(np.float32)))
        for version in (1, 4):
            want = store.read_table("w", version)
            out = np.full((1000, 6), np.nan, dtype=np.float32)
            got = store.read_table("w", version, out=out)
            assert np.shares_memory(got, out) and np.array_equal(out.view(np.uint32), want.view(np.uint32))
        both = store.read_tables({"w": None, "f": np.zeros((300, 3), np.float32)})
        assert np.array_equal(both["w"], store.read_table("w")) and np.array_equal(both["f"], store.read_table("f"))
        snap = store.restore()
        assert np.array_equal(snap.tables["w"], both["w"]) and np.array_equal(snap.tables["f"], both["f"])


@pytest.mark.parametrize("threads", [1, 3])
def test_read_tables_row_ranges_equal_slices_of_read_table(tmp_path, monkeypatch, threads):
    """``(start, out)`` values read rows start .. start + len(out) - 1: ranges cut blocks at both ends, lie
    inside one block, cover whole blocks, end at the table's short last block or are empty; a chain of
    increments in two codecs (int4 and its int8 fallback). Bits equal read_table's slice."""
    from cnrstore import knobs

    monkeypatch.setattr(knobs, "DECODE_THREADS", threads)
    monkeypatch.setattr(knobs, "DECODE_INLINE_BYTES", 0)  # (small reads: through the pool all the same)
    with cnrstore.open(str(tmp_path / "s"), create=True) as store:
        _int4_chain(store, np.random.default_rng(6))
        for version in (1, 4):
            want = store.read_table("w", version)
            for start, stop in ((0, 1000), (37, 999), (64, 128), (70, 90), (500, 1000), (999, 1000), (5, 5)):
                out = np.full((stop - start, 6), np.nan, dtype=np.float32)
                got = store.read_tables({"w": (start, out)}, version)["w"]
                assert np.shares_memory(got, out) or out.size == 0
                assert np.array_equal(out.view(np.uint32), want[start:stop].view(np.uint32)), (start, stop)


def test_a_small_read_decodes_on_the_callers_thread_and_reads_the_same(tmp_path, monkeypatch):
    """Under ``knobs.DECODE_INLINE_BYTES`` of destinations no block goes to the decode pool (handing it
    over costs more than the decode); the bits are the pool's."""
    from cnrstore import knobs
    from cnrstore.engine import table_decode

    monkeypatch.setattr(knobs, "DECODE_THREADS", 3)
    with cnrstore.open(str(tmp_path / "s"), create=True) as store:
        _int4_chain(store, np.random.default_rng(7))
        monkeypatch.setattr(knobs, "DECODE_INLINE_BYTES", 0)
        pooled = store.read_table("w")
        monkeypatch.setattr(knobs, "DECODE_INLINE_BYTES", pooled.nbytes + 1)
        monkeypatch.setattr(table_decode, "_executor", lambda workers: pytest.fail("a small read used the pool"))
        assert np.array_equal(store.read_table("w").view(np.uint32), pooled.view(np.uint32))
        monkeypatch.setattr(knobs, "DECODE_INLINE_BYTES", pooled.nbytes)
        with pytest.raises(pytest.fail.Exception, match="used the pool"):
            store.read_table("w")


def test_read_tables_row_range_of_a_partly_written_table(tmp_path):
    """A range needs only its own rows written (a TorchRec shard's rows of a table stored under global ids);
    a range reaching an unwritten row raises MissingRows (exact count) and leaves every out untouched."""
    with cnrstore.open(str(tmp_path / "s"), create=True) as store:
        store.create_table("w", 1000, 4, codec="fp32", block_rows=64)
        store.create_table("f", 10, 4, codec="fp32")
        vals = np.arange(400 * 4, dtype=np.float32).reshape(400, 4)
        with store.checkpoint() as ck:
            ck.put_rows("w", np.arange(300, 700), vals)
            ck.put_rows("f", np.arange(10), np.ones((10, 4), np.float32))
        out = np.zeros((400, 4), np.float32)
        store.read_tables({"w": (300, out)})
        assert np.array_equal(out, vals)
        with pytest.raises(cnrstore.MissingRows):
            store.read_table("w")
        outs = {"f": np.full((10, 4), 7, np.float32), "w": (290, np.full((420, 4), 7, np.float32))}
        with pytest.raises(cnrstore.MissingRows, match=r"^20 row\(s\)"):
            store.read_tables(outs)
        assert (outs["f"] == 7).all() and (outs["w"][1] == 7).all()


def test_read_tables_bad_row_range_raises(tmp_path):
    with cnrstore.open(str(tmp_path / "s"), create=True) as store:
        store.create_table("w", 10, 4, codec="fp32")
        with store.checkpoint() as ck:
            ck.put_rows("w", np.arange(10), np.ones((10, 4), np.float32))
        for bad in ((8, np.zeros((3, 4), np.float32)), (-1, np.zeros((3, 4), np.float32)),
                    (1.0, np.zeros((3, 4), np.float32)), (0, np.zeros((3, 5), np.float32)),
                    (0, np.zeros(3, np.float32)), (0, np.zeros((3, 4), np.float64)), (0, 1, 2)):
            with pytest.raises(cnrstore.InvalidArgument):
                store.read_tables({"w": bad})


def test_read_table_out_of_the_wrong_shape_or_dtype_raises(tmp_path):
    with cnrstore.open(str(tmp_path / "s"), create=True) as store:
        store.create_table("w", 10, 4, codec="fp32")
        with store.checkpoint() as ck:
            ck.put_rows("w", np.arange(10), np.ones((10, 4), np.float32))
        for bad in (np.zeros((10, 5), np.float32), np.zeros((10, 4), np.float64), np.zeros((4, 10), np.float32).T,
                    [[0.0] * 4] * 10):
            with pytest.raises(cnrstore.InvalidArgument, match="out"):
                store.read_table("w", out=bad)
        with pytest.raises(cnrstore.TableNotFound):
            store.read_tables({"w": None, "nope": None})
