"""Store.changes / dense_changes / `cnrstore diff` (engine/changes.py): against an in-memory model of every
version over random histories (saves, merges on the save path and in the background, compact at any version,
retention, drops of middle versions, gc), quantized codecs and their fallbacks (encoded rows decode to the
same bits), dense arrays, a readonly store, a remote tier, the typed errors and the cost (blocks no version in
(since, until] wrote are never read)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import cnrstore
from cnrstore import codecs
from cnrstore.engine import reader
from cnrstore.errors import InvalidArgument, MissingRows, TableNotFound, VersionNotFound, VersionNotRetained
from cnrstore.maintenance.compaction import merge_chains

ROWS, DIM, BLOCK = 300, 4, 32
ENV = dict(os.environ, OMP_NUM_THREADS="1")


class Model:
    """Per retained version: each table's float32 rows and which were ever written; and the rows each
    version put (what the changes may hold at most)."""

    def __init__(self):
        self.values: dict[int, np.ndarray] = {}
        self.written: dict[int, np.ndarray] = {}
        self.put: dict[int, np.ndarray] = {}  # version -> bool (ROWS,): rows it put
        self.state = np.zeros((ROWS, DIM), dtype=np.float32)
        self.ever = np.zeros(ROWS, dtype=bool)

    def save(self, store, rows, values):
        with store.checkpoint() as ck:
            ck.put_rows("t", rows, values)
        self.state[rows] = values
        self.ever[rows] = True
        put = np.zeros(ROWS, dtype=bool)
        put[rows] = True
        self.values[ck.version], self.written[ck.version], self.put[ck.version] = \
            self.state.copy(), self.ever.copy(), put
        return ck.version

    def drop(self, versions):
        for v in versions:
            del self.values[v], self.written[v]


def check(store, model: Model, since, until) -> None:
    """changes(since, until) against the model: every reported row read at until bit for bit, a superset of
    the rows whose value (or being written) differs between since and until, a subset of the rows some
    version in (since, until] put; applied over since it gives until; encoded rows decode to the values."""
    u = until if until is not None else max(model.values)
    (tc,) = list(store.changes(since, until))
    (enc,) = list(store.changes(since, until, ["t"], encoded=True))
    assert (tc.table, tc.until, tc.since, tc.dim, tc.encoded, enc.encoded) == ("t", u, since or 0, DIM, False, True)
    rows = tc.rows
    assert rows.dtype == np.int64 and np.all(np.diff(rows) > 0)
    assert np.array_equal(enc.rows, rows)
    assert model.written[u][rows].all()
    assert np.array_equal(tc.values.view(np.uint32), model.values[u][rows].view(np.uint32))
    assert np.array_equal(enc.decoded().view(np.uint32), tc.values.view(np.uint32))
    for part in enc.parts:
        assert part.data.shape == (part.rows.size, codecs.get(part.codec).row_bytes(DIM))
    reported = np.zeros(ROWS, dtype=bool)
    reported[rows] = True
    if not since:
        assert np.array_equal(reported, model.written[u])
        return
    differs = model.written[u] & (~model.written[since] | (
        model.values[u].view(np.uint32) != model.values[since].view(np.uint32)).any(axis=1))
    missed = np.flatnonzero(differs & ~reported)
    assert not missed.size, f"changes({since}, {u}) misses rows {missed[:8]}"
    put_between = np.zeros(ROWS, dtype=bool)
    for v, put in model.put.items():
        if since < v <= u:
            put_between |= put
    extra = np.flatnonzero(reported & ~put_between)
    assert not extra.size, f"changes({since}, {u}) reports rows no version in between put: {extra[:8]}"
    replica = model.values[since].copy()
    replica[rows] = tc.values
    assert np.array_equal(replica[model.written[u]], model.values[u][model.written[u]])


def check_all_pairs(store, model: Model, rng, pairs: int = 6) -> None:
    versions = sorted(model.values)
    check(store, model, None, None)
    for _ in range(pairs):
        a, b = sorted(rng.choice(versions, 2))
        check(store, model, int(a), int(b))
    check(store, model, versions[0], None)


def _random_rows(rng):
    kind = rng.integers(4)
    if kind == 0:  # a whole block: a baseline put by a save
        b = int(rng.integers(ROWS // BLOCK))
        return np.arange(b * BLOCK, min(ROWS, (b + 1) * BLOCK))
    if kind == 1:  # a few rows of one block
        b = int(rng.integers(ROWS // BLOCK))
        return np.unique(rng.integers(b * BLOCK, (b + 1) * BLOCK, 5))
    return np.unique(rng.integers(0, ROWS, int(rng.integers(1, 40))))


@pytest.mark.parametrize("seed,merging", [(1, "save"), (2, "background"), (3, "save"), (4, "background")])
def test_random_histories_match_the_model(tmp_path, seed, merging):
    """Saves, then at random: a background merge at the newest version, compact at a random retained version,
    a drop of a middle version, retention, gc; changes between random retained versions after each."""
    rng = np.random.default_rng(seed)
    # save: merges on the save path past a low bound; background: merges only when asked (merge_chains)
    options = (cnrstore.Options(read_record_cost_s=0, read_amp_bound=1.6, merge_trigger=None) if merging == "save"
               else cnrstore.Options(read_record_cost_s=0, merge_trigger=1.2, read_amp_bound=None))
    model = Model()
    with cnrstore.open(tmp_path / "s", create=True, options=options) as store:
        store.create_table("t", ROWS, DIM, block_rows=BLOCK)
        for step in range(22):
            rows = _random_rows(rng)
            values = rng.standard_normal((rows.size, DIM)).astype(np.float32)
            if rng.random() < 0.3:  # some puts write rows with the value they had: over-reported at most
                values[: rows.size // 2] = model.state[rows[: rows.size // 2]]
            model.save(store, rows, values)
            op = rng.integers(8)
            if merging == "background" and op in (0, 5, 6):
                with store.engine.maintenance() as m:
                    merge_chains(m, store.latest().version)
            elif op == 1:
                store.compact(int(rng.choice(sorted(model.values))))
            elif op == 2 and len(model.values) > 2:
                middle = int(rng.choice(sorted(model.values)[:-1]))
                model.drop(store.retain(drop=[middle]))
            elif op == 3 and len(model.values) > 4:
                model.drop(store.retain(keep_last=4))
            elif op == 4:
                store.gc()
            if step % 3 == 2:
                check_all_pairs(store, model, rng)
        check_all_pairs(store, model, rng, pairs=10)
        stats = store.stats()
        if merging == "background":
            assert stats["merge_bytes"] > 0, "the history has background merges"
        else:
            assert stats["save_bytes"] > stats["increment_bytes"], "the history has saves that merged"


def test_merges_and_compaction_are_not_reported_as_changes(tmp_path):
    """A background merge (a cumulative delta on an old baseline) and a compaction re-write rows under newer
    versions; rows whose value at since is the same are left out: a replica syncing each version gets exactly
    that version's rows."""
    options = cnrstore.Options(read_record_cost_s=0, merge_trigger=1.05, read_amp_bound=None)
    rng = np.random.default_rng(5)
    model = Model()
    with cnrstore.open(tmp_path / "s", create=True, options=options) as store:
        store.create_table("t", ROWS, DIM, block_rows=BLOCK)
        model.save(store, np.arange(ROWS), rng.standard_normal((ROWS, DIM)).astype(np.float32))
        for _ in range(6):
            rows = np.unique(rng.integers(0, ROWS, 20))
            v = model.save(store, rows, rng.standard_normal((rows.size, DIM)).astype(np.float32))
            with store.engine.maintenance() as m:
                merged = merge_chains(m, v).blocks_merged
            (tc,) = store.changes(v - 1, v)
            assert np.array_equal(tc.rows, np.flatnonzero(model.put[v])), f"merged {merged} blocks"
        assert store.stats()["merge_bytes"] > 0
        store.compact()
        newest = store.latest().version
        (tc,) = store.changes(newest - 1)
        assert np.array_equal(tc.rows, np.flatnonzero(model.put[newest]))
        check_all_pairs(store, model, rng)


def test_quantized_codecs_encoded_rows_decode_to_the_values(tmp_path):
    """int4, int8 and fp16 tables, with rows past fp16's range (their blocks fall back to int8 / fp32) and a
    put with another codec: encoded parts hold each row in the codec it is stored in and decode to exactly the
    values read_rows gives."""
    rng = np.random.default_rng(3)
    with cnrstore.open(tmp_path / "s", create=True) as store:
        for name in ("int4", "int8", "fp16"):
            store.create_table(name, ROWS, DIM, codec=name, block_rows=BLOCK)
        with store.checkpoint() as ck:
            for name in ("int4", "int8", "fp16"):
                ck.put_rows(name, np.arange(ROWS), rng.standard_normal((ROWS, DIM)))
        first = ck.version
        with store.checkpoint() as ck:
            for name in ("int4", "int8", "fp16"):
                rows = np.arange(3, ROWS, 7)
                values = rng.standard_normal((rows.size, DIM))
                values[:5, 0] = 1e38 if name == "int8" else 7e4  # block 0 falls back (-> fp32, -> int8)
                ck.put_rows(name, rows, values)
            ck.put_rows("int4", np.arange(40, 44), rng.standard_normal((4, DIM)), codec="fp32")
        for tc, enc in zip(store.changes(first), store.changes(first, encoded=True)):
            assert tc.table == enc.table and tc.codec == tc.table
            assert np.array_equal(tc.rows, np.union1d(np.arange(3, ROWS, 7), np.arange(40, 44) if tc.table == "int4"
                                                      else []))
            assert np.array_equal(tc.values, store.read_rows(tc.table, tc.rows))
            assert np.array_equal(enc.decoded().view(np.uint32), tc.values.view(np.uint32))
            assert len({p.codec for p in enc.parts}) >= 2, [p.codec for p in enc.parts]
            assert sum(p.rows.size for p in enc.parts) == tc.rows.size
            assert enc.nbytes == sum(p.data.nbytes for p in enc.parts) < tc.nbytes or tc.table == "fp16"
            for p in enc.parts:
                assert np.array_equal(p.decode(DIM), store.read_rows(tc.table, p.rows))
        full = {tc.table: tc for tc in store.changes(None, encoded=True)}
        for name, tc in full.items():
            assert np.array_equal(tc.rows, np.arange(ROWS))
            assert np.array_equal(tc.decoded(), store.read_table(name))


def test_dense_changes(tmp_path):
    with cnrstore.open(tmp_path / "s", create=True) as store:
        with store.checkpoint() as ck:
            ck.put_dense("a", np.arange(4))
            ck.put_dense("b", np.ones(2, dtype=np.float16))
        v1 = ck.version
        with store.checkpoint() as ck:
            ck.put_dense("b", np.zeros(2, dtype=np.float16))
        v2 = ck.version
        with store.checkpoint() as ck:
            ck.put_dense("c", np.eye(2))
        v3 = ck.version
        assert set(store.dense_changes(None)) == {"a", "b", "c"}
        assert set(store.dense_changes(v1, v2)) == {"b"}
        assert set(store.dense_changes(v1)) == {"b", "c"}
        assert np.array_equal(store.dense_changes(v1)["b"], np.zeros(2, dtype=np.float16))
        assert store.dense_changes(v2, v3, names=["a", "b"]) == {}
        assert store.dense_changes(v3) == {}
        with pytest.raises(MissingRows):
            store.dense_changes(v1, names=["nope"])


def test_errors(tmp_path):
    rng = np.random.default_rng(0)
    with cnrstore.open(tmp_path / "s", create=True) as store:
        with pytest.raises(VersionNotFound):
            store.changes(None)  # no version yet
        store.create_table("t", ROWS, DIM, block_rows=BLOCK)
        versions = []
        for _ in range(4):
            with store.checkpoint() as ck:
                ck.put_rows("t", np.arange(10), rng.standard_normal((10, DIM)))
            versions.append(ck.version)
        ck = store.checkpoint()
        aborted = ck.version
        ck.abort()
        with store.checkpoint() as ck:
            ck.put_rows("t", np.arange(10), rng.standard_normal((10, DIM)))
        versions.append(ck.version)
        store.retain(keep_last=2)
        for since in (versions[0], aborted):
            with pytest.raises(VersionNotRetained, match=r"since=None") as err:
                store.changes(since)
            assert isinstance(err.value, VersionNotFound) and err.value.version == since
        with pytest.raises(VersionNotRetained):
            store.dense_changes(versions[1])
        with pytest.raises(InvalidArgument, match="since must not be after until"):
            store.changes(versions[4], versions[3])
        with pytest.raises(VersionNotFound):
            store.changes(None, versions[0])
        with pytest.raises(InvalidArgument):
            store.changes(-1)
        with pytest.raises(TableNotFound):
            store.changes(None, tables=["t", "nope"])
        assert [tc.rows.size for tc in store.changes(versions[4])] == [0]
        assert [tc.rows.size for tc in store.changes(versions[3])] == [10]
        assert [tc.table for tc in store.changes(0, tables="t")] == ["t"]
        # a version dropped while the iterator is consumed: the next table raises
        store.create_table("u", ROWS, DIM, block_rows=BLOCK)
        with store.checkpoint() as ck:
            ck.put_rows("u", np.arange(5), rng.standard_normal((5, DIM)))
        it = store.changes(versions[3])
        assert next(it).table == "t"
        store.retain(keep_last=1)
        with pytest.raises(VersionNotRetained):
            next(it)


@pytest.mark.parametrize("call,kwargs,named", [
    ("changes", {"since": True}, "since"),  # bools are not versions
    ("changes", {"since": "1"}, "since"),
    ("changes", {"since": 1.5}, "since"),
    ("changes", {"since": -1}, "since"),
    ("changes", {"since": 0, "until": False}, "until"),
    ("changes", {"since": 0, "until": "2"}, "until"),
    ("changes", {"since": 0, "until": 2.0}, "until"),
    ("changes", {"since": 0, "until": -2}, "until"),
    ("changes", {"since": 0, "tables": 5}, "tables"),
    ("changes", {"since": 0, "tables": [5]}, "tables"),
    ("changes", {"since": 0, "tables": ["t", None]}, "tables"),
    ("changes", {"since": 0, "tables": b"t"}, "tables"),
    ("changes", {"since": 0, "encoded": "no"}, "encoded"),  # (a truthy "no" read as True)
    ("changes", {"since": 0, "encoded": None}, "encoded"),
    ("changes", {"since": 0, "encoded": 1}, "encoded"),
    ("dense_changes", {"since": True}, "since"),
    ("dense_changes", {"since": 0, "until": 1.0}, "until"),
    ("dense_changes", {"since": 0, "names": 5}, "names"),
    ("dense_changes", {"since": 0, "names": [5]}, "names"),
    ("dense_changes", {"since": 0, "names": b"w"}, "names"),
])
def test_bad_arguments_are_invalid_argument_naming_them(tmp_path, call, kwargs, named):
    """Each argument of changes / dense_changes of the wrong type or range: InvalidArgument whose message
    starts with the argument's name and says what to pass, raised by the call itself (before the iterator)."""
    with cnrstore.open(tmp_path / "s", create=True) as store:
        store.create_table("t", ROWS, DIM, block_rows=BLOCK)
        with store.checkpoint() as ck:
            ck.put_rows("t", np.arange(10), np.ones((10, DIM), np.float32))
            ck.put_dense("w", np.arange(3.0))
        with pytest.raises(InvalidArgument, match=rf"^{named} must be (a version number|None, a name|True or False)"):
            getattr(store, call)(**kwargs)
        assert [v.version for v in store.versions()] == [ck.version]
        # what is accepted: numpy ints and bools, any iterable of names
        v = np.int64(ck.version)
        for tables in (("t",), {"t"}, {"t": 1}, (n for n in ["t"]), np.array(["t"])):
            (tc,) = store.changes(np.uint64(0), v, tables, encoded=np.bool_(True))
            assert tc.encoded and tc.rows.size == 10
        assert list(store.dense_changes(np.int32(0), v, names=("w",))) == ["w"]


def test_only_blocks_written_after_since_are_read(tmp_path, monkeypatch):
    """The cost: the records changes() loads are those of blocks with an entry in (since, until], and in
    them only the records newer than since (plus a read at since of a merge's suspect rows: none here)."""
    rng = np.random.default_rng(1)
    with cnrstore.open(tmp_path / "s", create=True, options=cnrstore.Options(read_chain_bound=None)) as store:
        store.create_table("t", ROWS, DIM, block_rows=BLOCK)
        with store.checkpoint() as ck:
            ck.put_rows("t", np.arange(ROWS), rng.standard_normal((ROWS, DIM)))
        for block in (1, 4, 4, 7):
            with store.checkpoint() as ck:
                ck.put_rows("t", np.arange(block * BLOCK, block * BLOCK + 3), rng.standard_normal((3, DIM)))
        newest = ck.version
        loads = []
        real = reader.BlockResolver.load_rows

        def counting(self, loc, block, version):
            loads.append((block, version))
            return real(self, loc, block, version)

        monkeypatch.setattr(reader.BlockResolver, "load_rows", counting)
        (tc,) = store.changes(newest - 2)
        assert sorted(loads) == [(4, newest - 1), (7, newest)]
        assert np.array_equal(tc.rows, np.r_[np.arange(4 * BLOCK, 4 * BLOCK + 3), np.arange(7 * BLOCK, 7 * BLOCK + 3)])


def test_readonly_store_and_remote_tier(tmp_path):
    rng = np.random.default_rng(2)
    path, remote = tmp_path / "s", f"file://{tmp_path / 'bucket'}"
    (tmp_path / "bucket").mkdir()
    opts = {"auto_mkdir": True}  # (fsspec's local file system as the object store)
    with cnrstore.open(path, create=True, remote=remote, remote_options=opts, cache_bytes=0) as store:
        store.create_table("t", ROWS, DIM, codec="int8", block_rows=BLOCK)
        with store.checkpoint() as ck:
            ck.put_rows("t", np.arange(ROWS), rng.standard_normal((ROWS, DIM)))
        first = ck.version
        with store.checkpoint() as ck:
            ck.put_rows("t", np.arange(50, 60), rng.standard_normal((10, DIM)))
        expected = store.read_table("t")
    for kwargs in ({"readonly": True, "remote": remote, "remote_options": opts},
                   {"readonly": True, "remote": remote, "remote_options": opts, "cache_bytes": 0}):
        target = path if "cache_bytes" not in kwargs else tmp_path / "fresh"
        with cnrstore.open(target, **kwargs) as ro:
            (tc,) = ro.changes(first, encoded=True)
            assert np.array_equal(tc.rows, np.arange(50, 60))
            assert np.array_equal(tc.decoded(), expected[50:60])
            (full,) = ro.changes(None)
            assert np.array_equal(full.values, expected)
            if target != path:  # a fresh read cache holds no segment: the records were fetched ahead
                assert ro.stats()["remote"]["planned_reads"] >= 2


def test_cli_diff(tmp_path):
    rng = np.random.default_rng(4)
    path = tmp_path / "s"
    with cnrstore.open(path, create=True) as store:
        store.create_table("a", ROWS, DIM, codec="int4", block_rows=BLOCK)
        store.create_table("b", ROWS, DIM, block_rows=BLOCK)
        with store.checkpoint() as ck:
            ck.put_rows("a", np.arange(ROWS), rng.standard_normal((ROWS, DIM)))
            ck.put_rows("b", np.arange(ROWS), rng.standard_normal((ROWS, DIM)))
            ck.put_dense("w", np.arange(3.0))
        v1 = ck.version
        with store.checkpoint() as ck:
            ck.put_rows("a", np.array([5, 6, 200]), rng.standard_normal((3, DIM)))
        v2 = ck.version

    def run(*args, rc=0):
        proc = subprocess.run([sys.executable, "-m", "cnrstore.cli", *map(str, args)], capture_output=True,
                              text=True, env=ENV, timeout=120)
        assert proc.returncode == rc, (proc.stdout, proc.stderr)
        return proc

    out = json.loads(run("diff", path, v1, v2, "--json", "--rows").stdout)
    assert (out["since"], out["until"]) == (v1, v2)
    a = out["tables"]["a"]
    assert a["rows_changed"] == 3 and a["rows"] == [5, 6, 200] and a["codec"] == "int4"
    assert a["bytes"] == 3 * codecs.get("int4").row_bytes(DIM)
    assert out["tables"]["b"]["rows_changed"] == 0 and out["dense"] == []
    assert json.loads(run("diff", path, 0, v2, "--json").stdout)["dense"] == ["w"]
    text = run("diff", path, v1, v2).stdout
    assert "a" in text and "3 rows" in text
    err = run("diff", path, v2, v1, rc=2).stderr
    assert "InvalidArgument" in err and err.count("\n") == 1
    assert "VersionNotFound" in run("diff", path, 99, 100, rc=2).stderr
    for args, named in (((-1,), "V1"), ((v1, -2), "V2")):
        err = run("diff", path, *args, rc=2).stderr
        assert "InvalidArgument: " + named + " must be a version number (an integer >= 0), got -" in err, err


def test_blocks_written_in_reads_the_keys_only(tmp_path):
    """IndexView.blocks_written_in: the blocks with an entry in (after, upto], whatever entries they have
    before or after, and none of another table."""
    rng = np.random.default_rng(6)
    with cnrstore.open(tmp_path / "s", create=True, options=cnrstore.Options(read_chain_bound=None)) as store:
        for name in ("a", "b"):
            store.create_table(name, ROWS, DIM, block_rows=BLOCK)
        puts = [{"a": [0, 3], "b": [1]}, {"a": [3, 5]}, {"b": [2, 9]}, {"a": [0, 9]}]
        for put in puts:
            with store.checkpoint() as ck:
                for name, blocks in put.items():
                    rows = np.concatenate([np.arange(b * BLOCK, b * BLOCK + 2) for b in blocks])
                    ck.put_rows(name, rows, rng.standard_normal((rows.size, DIM)))
        with store.engine.read() as view:
            a, b = view.table("a").id, view.table("b").id
            assert list(view.blocks_written_in(a, 0, 4)) == [0, 3, 5, 9]
            assert list(view.blocks_written_in(a, 1, 3)) == [3, 5]
            assert list(view.blocks_written_in(a, 2, 3)) == []
            assert list(view.blocks_written_in(a, 3, 4)) == [0, 9]
            assert list(view.blocks_written_in(b, 1, 4)) == [2, 9]
            assert list(view.blocks_written_in(b, 4, 4)) == []
