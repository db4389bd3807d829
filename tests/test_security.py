"""A store is data, never code (issue 26, docs/DESIGN.md "Security"): a crafted store runs nothing when read.

A poisoned trainer payload (the dense array "torch.state" holding a pickle whose __reduce__ would create a
marker directory) is refused by restore, export and a distributed restore with UnsafePayload, and ignored by
verify, ls, info and repair; the opt-in (trust_pickle / --trust-pickle) and `cnrstore migrate-payload` read
and rewrite old stores' payloads. A crafted manifest of a multi-rank root is a typed error."""

from __future__ import annotations

import io
import os
import struct
import warnings

import msgpack
import numpy as np
import pytest
import torch
import xxhash
from torch import nn

import cnrstore
from cnrstore import cli
from cnrstore.errors import CorruptionError, InvalidArgument, UnsafePayload
from cnrstore.torch import Checkpointer
from cnrstore.torch import payload as payload_mod
from cnrstore.torch.checkpointer import STATE_BLOB

from support.torch_models import Position


class Boom:
    """Unpickling it would create ``path`` (a directory): the evidence that a read ran code."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return os.mkdir, (self.path,)


class Model(nn.Module):
    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(20, 4)
        self.lin = nn.Linear(4, 1)

    def forward(self, ids):
        return self.lin(self.emb(ids)).sum()


def _train(model, opt, ids=(1, 2, 3)):
    opt.zero_grad()
    model(torch.tensor(ids)).backward()
    opt.step()


def _saved_store(path):
    """A store with one version written by Checkpointer (Adam: optimizer state in the payload)."""
    model = Model()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    with cnrstore.open(path, create=True) as store:
        ck = Checkpointer(store, model, opt, codec="fp32", extra={"loader": Position(5)})
        _train(model, opt)
        ck.save(step=1).wait()
        ck.close()
    return model


def _pickle_blob(obj) -> np.ndarray:
    buf = io.BytesIO()
    torch.save(obj, buf)  # a plain pickle in torch's zip: what cnrstore wrote before payload format 2
    return np.frombuffer(buf.getvalue(), dtype=np.uint8).copy()


def _old_payload(store, version, **extra) -> dict:
    """The real payload of ``version`` (read as data) with ``extra`` entries added."""
    p = payload_mod.decode(store.read_dense(STATE_BLOB, version), version)
    p.update(extra)
    return p


def _add_version(path, blob, step=2):
    """Append a version whose only new array is the trainer payload ``blob`` (the tables and model arrays
    read through to the version before): what an attacker with write access to the directory can do."""
    with cnrstore.open(path) as store:
        with store.checkpoint(step=step) as ck:
            ck.put_dense(STATE_BLOB, blob)
        return ck.version


@pytest.fixture
def poisoned(tmp_path):
    path = str(tmp_path / "store")
    _saved_store(path)
    marker = tmp_path / "RAN"
    with cnrstore.open(path, readonly=True) as store:
        p = _old_payload(store, 1, boom=Boom(marker))
    v = _add_version(path, _pickle_blob(p))
    return path, v, marker


def test_restore_of_a_poisoned_payload_runs_nothing_and_raises_unsafe_payload(poisoned):
    path, v, marker = poisoned
    model = Model(seed=1)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    before = {k: t.clone() for k, t in model.state_dict().items()}
    with cnrstore.open(path) as store:
        ck = Checkpointer(store, model, opt, extra={"loader": Position()})
        with pytest.raises(UnsafePayload) as info:
            ck.restore(v)
        ck.close()
    assert not marker.exists()
    assert info.value.version == v and "posix.mkdir" in info.value.names
    msg = str(info.value)
    assert "migrate-payload" in msg and "trust_pickle=True" in msg
    for k, t in model.state_dict().items():  # refused before anything changed
        assert torch.equal(t, before[k])


def test_export_of_a_poisoned_payload_runs_nothing_api_and_cli(poisoned, tmp_path, capsys):
    path, v, marker = poisoned
    with pytest.raises(UnsafePayload):
        cnrstore.export.export_path(path, "torch", str(tmp_path / "out.pt"), version=v)
    for fmt in ("torch", "safetensors", "dcp", "npz"):
        assert cli.main(["export", path, "--format", fmt, str(tmp_path / f"out-{fmt}")]) == 2
        assert "UnsafePayload" in capsys.readouterr().err
    assert cli.main(["export", path, "--format", "torch", "--layout", "checkpoint", str(tmp_path / "c.pt")]) == 2
    # the nested layout reads no payload: it exports the bytes as they are, as data
    assert cli.main(["export", path, "--format", "npz", "--layout", "nested", str(tmp_path / "n.npz")]) == 0
    assert not marker.exists()
    assert not any(p.name.startswith("out") for p in tmp_path.iterdir())


def test_verify_ls_info_and_repair_of_a_poisoned_store_run_nothing(poisoned, tmp_path, capsys):
    path, v, marker = poisoned
    for argv in (["verify", path], ["ls", path], ["info", path], ["ls", path, "--json"],
                 ["migrate-payload", path]):
        assert cli.main(argv) == 0, argv
    out = capsys.readouterr().out
    assert f"version {v}: the payload's pickle names posix.mkdir" in out
    assert cnrstore.repair(path).ok
    with cnrstore.open(path, readonly=True) as store:
        assert store.verify().ok
        snap = store.restore(v)  # the store's own restore returns arrays; it never unpickles
        assert snap.dense[STATE_BLOB].dtype == np.uint8
    assert not marker.exists()


def test_trust_pickle_warns_and_reads_an_old_payload(tmp_path):
    """Stores written before payload format 2 still read, behind the explicit opt-in."""
    path = str(tmp_path / "store")
    model = _saved_store(path)
    with cnrstore.open(path, readonly=True) as store:
        old = _old_payload(store, 1, format=1, legacy=np.arange(3))  # numpy: not data for weights_only
    v = _add_version(path, _pickle_blob(old))
    fresh = Model(seed=7)
    opt = torch.optim.Adam(fresh.parameters(), lr=0.1)
    loader = Position()
    with cnrstore.open(path) as store:
        ck = Checkpointer(store, fresh, opt, extra={"loader": loader})
        with pytest.raises(UnsafePayload):
            ck.restore(v)
        with pytest.warns(UserWarning, match="trust_pickle"):
            ck.restore(v, trust_pickle=True)
        ck.close()
    assert loader.pos == 5
    for k, t in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], t)
    out = tmp_path / "o.pt"
    with pytest.warns(UserWarning):
        assert cli.main(["export", path, "--format", "torch", "--trust-pickle", str(out)]) == 0
    assert set(torch.load(out, weights_only=True)) == set(model.state_dict())


def test_migrate_payload_rewrites_old_payloads_as_data_and_keeps_every_read(tmp_path, capsys):
    from cnrstore.torch.migrate import migrate_payloads

    path = str(tmp_path / "store")
    _saved_store(path)
    with cnrstore.open(path, readonly=True) as store:
        old = _old_payload(store, 1, format=1)
    old["extra"]["loader"]["arr"] = np.arange(2)  # an old pickle's numpy array: not data
    v = _add_version(path, _pickle_blob(old))
    assert cli.main(["migrate-payload", path]) == 0  # a dry run: lists, unpickles and changes nothing
    assert f"version {v}: the payload's pickle names numpy" in capsys.readouterr().out
    # an array is not data: the rewrite refuses it, naming the object, the type and the fix
    assert cli.main(["migrate-payload", path, "--trust-pickle"]) == 2
    err = capsys.readouterr().err
    assert "extra['loader']['arr']" in err and "numpy.ndarray" in err and "add_safe_globals" in err
    # numpy scalars (np.float64 in a param group, an np.int64 position) become the numbers they hold
    old["extra"]["loader"] = {"pos": np.int64(5)}
    old["optimizers"][0]["param_groups"][0]["lr"] = np.float64(0.1)
    v2 = _add_version(path, _pickle_blob(old), step=3)
    with cnrstore.open(path) as store:
        store.retain(keep_last=1)
        before = store.restore(v2)
    with pytest.raises(UnsafePayload):
        Checkpointer(cnrstore.open(path, readonly=True), Model(), torch.optim.Adam(Model().parameters()),
                     extra={"loader": Position()}).restore(v2)
    report = migrate_payloads(path, trust_pickle=True)
    assert report.rewritten == [v2] and list(report.unsafe) == [v2]
    with cnrstore.open(path) as store:
        p = payload_mod.decode(store.read_dense(STATE_BLOB, v2), v2)  # data now: weights_only reads it
        assert p["extra"]["loader"]["pos"] == 5 and type(p["extra"]["loader"]["pos"]) is int
        after = store.restore(v2)
        assert store.verify().ok
        gc = store.gc()
        assert store.verify().ok
    assert gc is not None
    assert before.tables.keys() == after.tables.keys()
    for k in before.tables:
        assert np.array_equal(before.tables[k], after.tables[k])
    for k in before.dense:
        if k != STATE_BLOB:
            assert np.array_equal(before.dense[k], after.dense[k])
    model = Model(seed=3)
    loader = Position()
    with cnrstore.open(path) as store:
        ck = Checkpointer(store, model, torch.optim.Adam(model.parameters(), lr=0.1), extra={"loader": loader})
        ck.restore(v2)  # no opt-in needed any more
        ck.close()
    assert loader.pos == 5
    assert migrate_payloads(path, trust_pickle=True).rewritten == []  # idempotent
    assert cnrstore.repair(path).ok
    with cnrstore.open(path, readonly=True) as store:
        payload_mod.decode(store.read_dense(STATE_BLOB, v2), v2)


def test_save_refuses_extra_state_that_is_not_data_naming_the_type_and_the_fix(tmp_path):
    class NumpyLoader(Position):
        def state_dict(self):
            return {"pos": self.pos, "rng": np.random.default_rng(0).bit_generator.state, "arr": np.arange(2)}

    model = Model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with cnrstore.open(str(tmp_path / "s"), create=True) as store:
        ck = Checkpointer(store, model, opt, extra={"loader": NumpyLoader()})
        with pytest.raises(InvalidArgument) as info:
            ck.save(step=1)
        msg = str(info.value)
        assert "extra['loader']['arr']" in msg and "numpy.ndarray" in msg
        assert "add_safe_globals" in msg and "plain data" in msg
        ck.close()
        assert store.versions() == []


class Tag:
    def __init__(self, v=0):
        self.v = v


def test_add_safe_globals_is_the_escape_hatch_on_both_sides(tmp_path):
    class Holder(Position):
        def state_dict(self):
            return {"pos": self.pos, "tag": Tag(4)}

        def load_state_dict(self, sd):
            self.pos, self.tag = sd["pos"], sd["tag"]

    model = Model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    holder = Holder(2)
    with cnrstore.open(str(tmp_path / "s"), create=True) as store:
        ck = Checkpointer(store, model, opt, extra={"h": holder})
        with pytest.raises(InvalidArgument, match="Tag"):
            ck.save(step=1)
        with torch.serialization.safe_globals([Tag]):
            ck.save(step=1).wait()
            ck.restore()
        assert holder.tag.v == 4
        with pytest.raises(UnsafePayload, match="Tag"):  # a reader that did not register it
            ck.restore()
        ck.close()


def test_a_malformed_payload_of_plain_data_is_a_typed_error(tmp_path):
    path = str(tmp_path / "store")
    _saved_store(path)
    with cnrstore.open(path, readonly=True) as store:
        good = _old_payload(store, 1)
    bad_row = dict(good)
    opt0 = dict(good["optimizers"][0])
    state = {k: dict(v) for k, v in opt0["state"].items()}
    for st in state.values():
        for key, val in list(st.items()):
            if isinstance(val, dict) and "__cnrstore_row_state__" in val:
                st[key] = {**val, "dtype": "load"}  # names torch.load, not a dtype
    bad_row["optimizers"] = [{**opt0, "state": state}]
    crafted = [{"tables": "emb"}, {"tables": [], "dense_dtypes": {"x": "manual_seed"}}, bad_row,
               {"tables": [], "dense_dtypes": {}, "optimizers": [3]}, [1, 2], b"junk"]
    for i, p in enumerate(crafted):
        blob = np.frombuffer(b"not a zip at all", dtype=np.uint8) if p == b"junk" else _pickle_blob(p)
        v = _add_version(path, blob, step=10 + i)
        model = Model()
        opt = torch.optim.Adam(model.parameters(), lr=0.1)
        with cnrstore.open(path) as store:
            ck = Checkpointer(store, model, opt, extra={"loader": Position()})
            with pytest.raises(InvalidArgument):
                ck.restore(v)
            ck.close()


# -- a multi-rank root ---------------------------------------------------------------------------------
def _seal(magic: bytes, body: dict) -> bytes:
    data = magic + msgpack.packb(body, use_bin_type=True)
    return data + struct.pack("<Q", xxhash.xxh3_64_intdigest(data))


def test_a_distributed_restore_of_a_poisoned_payload_and_manifest_runs_nothing(tmp_path, group):
    from cnrstore.distributed import DistributedCheckpointer, Root, ShardingPlan

    root = tmp_path / "root"
    tables = {"emb": (20, 4)}

    def make():
        model = Model()
        opt = torch.optim.Adam(model.parameters(), lr=0.1)
        return DistributedCheckpointer(root, model, opt, plan=ShardingPlan.row_wise(tables, 1), codec="fp32"), \
            model, opt

    ck, model, opt = make()
    _train(model, opt)
    ck.save(step=1).wait()
    gv = ck.versions()[-1]
    ck.close()
    marker = tmp_path / "RAN"
    store_path = os.path.join(root, gv.stores[0])
    with cnrstore.open(store_path, readonly=True) as store:
        p = _old_payload(store, gv.local_versions[0], boom=Boom(marker))
    local = _add_version(store_path, _pickle_blob(p))
    # a forged manifest (its checksum recomputed: XXH3 is no signature) naming the poisoned local version
    body = {**gv.to_dict(), "version": 2, "local_versions": [local]}
    manifest = os.path.join(root, "global", "g-000000000002.cnrg")
    with open(manifest, "wb") as f:
        f.write(_seal(b"CNRGLOB\0", body))
    ck, model, opt = make()
    with pytest.raises(UnsafePayload):
        ck.restore(2)
    # a manifest naming a store outside the root, or not parsing into a global version, is CorruptionError
    for bad in ({**body, "stores": ["../../elsewhere"]}, {**body, "stores": ["/etc"]}, {**body, "plan": 7},
                {**body, "local_versions": "x"}, {"format": 1}, {**body, "version": 3}):
        with open(manifest, "wb") as f:
            f.write(_seal(b"CNRGLOB\0", bad))
        with pytest.raises(CorruptionError):
            Root(str(root)).read(2)
        with pytest.raises(CorruptionError):
            ck.restore(2)
    ck.close()
    assert cli.main(["verify", str(root)]) == 1
    assert cli.main(["ls", str(root)]) in (0, 2)
    assert not marker.exists()


def _set_table(store_path, name, **fields):
    """Rewrite table ``name``'s catalog entry in the index of ``store_path`` (lmdb directly)."""
    import lmdb

    env = lmdb.open(os.path.join(store_path, "index"), max_dbs=8)
    try:
        with env.begin(write=True) as txn:
            db = env.open_db(b"tables", txn=txn, create=False)
            info = msgpack.unpackb(txn.get(name.encode(), db=db), raw=False)
            txn.put(name.encode(), msgpack.packb({**info, **fields}, use_bin_type=True), db=db)
    finally:
        env.close()


@pytest.mark.parametrize("rows, dim", [(10**12, 4), (20_000_000, 4), (20, 1 << 20)])
def test_a_merged_export_checks_what_the_plan_claims_before_allocating(tmp_path, group, rows, dim):
    """A forged manifest whose plan claims a table far bigger than the rank stores hold: the merged export
    refuses it before allocating the merged table (at 10**12 rows that allocation was a MemoryError; at
    2*10**7 x 4 it was 320 MB), whether the rank store's catalog disagrees (InvalidArgument: no such shard)
    or was forged to agree (CorruptionError: its segments cannot hold those rows)."""
    import tracemalloc

    from cnrstore.distributed import DistributedCheckpointer, Root, ShardingPlan
    from cnrstore.distributed.export import merged_snapshot
    from cnrstore.export import export_path

    root = tmp_path / "root"
    model = Model()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    ck = DistributedCheckpointer(root, model, opt, plan=ShardingPlan.row_wise({"emb": (20, 4)}, 1), codec="fp32")
    _train(model, opt)
    ck.save(step=1).wait()
    gv = ck.versions()[-1]
    ck.close()
    assert merged_snapshot(root).tables["emb"].shape == (20, 4)
    plan = {"world_size": 1, "tables": {"emb": [rows, dim]}, "shards": [["emb", 0, 0, rows]]}
    with open(os.path.join(root, "global", "g-000000000002.cnrg"), "wb") as f:
        f.write(_seal(b"CNRGLOB\0", {**gv.to_dict(), "version": 2, "plan": plan}))
    assert Root(str(root)).read(2).plan.tables == {"emb": (rows, dim)}
    store_path = os.path.join(root, gv.stores[0])
    for forged, error in ((False, InvalidArgument), (True, CorruptionError)):
        if forged:  # the rank store's catalog says so too (its checksum-free index: anyone can)
            _set_table(store_path, "emb", num_rows=rows, dim=dim)
        tracemalloc.start()
        try:
            with pytest.raises(error, match="root is damaged"):
                merged_snapshot(root, 2)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 16 << 20, peak
        with pytest.raises(error):
            export_path(root, "torch", tmp_path / "m.pt", version=2)
        assert cli.main(["export", str(root), "--format", "torch", str(tmp_path / "m.pt"), "--version", "2"]) == 2
        assert not (tmp_path / "m.pt").exists()


def test_import_of_a_dcp_directory_whose_metadata_or_values_name_code_runs_nothing(tmp_path):
    """DCP's own reader unpickles .metadata with pickle.load; import reads it with an allowlist of DCP's
    metadata classes, and non-tensor values with weights_only=True."""
    import pickle

    import torch.distributed.checkpoint as dcp

    from cnrstore.torch import import_checkpoint

    src = tmp_path / "dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": {"emb.weight": torch.randn(20, 4), "lin.weight": torch.randn(1, 4)}, "step": 3},
                 checkpoint_id=str(src))
    report = import_checkpoint(str(tmp_path / "ok"), str(src))  # a DCP directory reads, its non-tensor step too
    assert "emb" in report.tables and report.step == 3
    marker = tmp_path / "RAN"
    meta = src / ".metadata"
    good = meta.read_bytes()
    with open(meta, "wb") as f:
        pickle.dump(Boom(marker), f)
    with pytest.raises(InvalidArgument, match="posix.mkdir|does not unpickle"):
        import_checkpoint(str(tmp_path / "s1"), str(src), model_only=True)
    assert not marker.exists() and not (tmp_path / "s1").exists()
    # a non-tensor value (DCP stores it as a torch.save blob) that would run code
    meta.write_bytes(good)
    src2 = tmp_path / "dcp2"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"emb.weight": torch.randn(20, 4), "boom": Boom(marker)}, checkpoint_id=str(src2))
    with pytest.raises(InvalidArgument):
        import_checkpoint(str(tmp_path / "s2"), str(src2), model_only=True)
    assert not marker.exists()


def test_import_of_a_dcp_metadata_claiming_a_huge_object_allocates_no_more_than_it_holds(tmp_path):
    """pickle's C unpickler allocates the length a BINBYTES8 opcode claims before reading it: a .metadata of
    111 bytes claiming 512 MiB allocated 512 MiB (DESIGN.md "Security": memory proportional to the bytes).
    import unpickles .metadata with the pure-Python unpickler, which reads only what the file holds."""
    import tracemalloc

    import torch.distributed.checkpoint as dcp

    from cnrstore.torch import import_checkpoint

    src = tmp_path / "dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"emb.weight": torch.randn(20, 4)}, checkpoint_id=str(src))
    (src / ".metadata").write_bytes(b"\x80\x04\x8e" + struct.pack("<Q", 512 << 20) + b"x" * 100)
    tracemalloc.start()
    try:
        with pytest.raises(InvalidArgument, match="as a dcp checkpoint"):
            import_checkpoint(str(tmp_path / "s"), str(src))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20, peak
    assert not (tmp_path / "s").exists()
