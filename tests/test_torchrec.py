"""TorchRec models through cnrstore.torch.Checkpointer (cnrstore/torch/sharded.py).

Sharded models run in spawned gloo processes (tests/support/torchrec_worker.py, CPU): a DMP-sharded
EmbeddingBagCollection with a fused row-wise Adagrad (or Adagrad) TBE optimizer and a name-keyed Adam
(``KeyedOptimizerWrapper``) for the dense head. A job trains, saving every other step, and dumps its state;
a fresh process (another init) restores the newest version, maybe into another sharding plan, and dumps
its state; then both train two more steps and dump again. Unsharded torchrec modules run in this process.

TorchRec is an optional dependency (``pip install 'cnrstore[torchrec-cpu]'``, see README); ``make test``
installs it and sets CNRSTORE_REQUIRE_TORCHREC=1, which turns a missing torchrec into a failure here.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import cnrstore
from cnrstore import codecs

if os.environ.get("CNRSTORE_REQUIRE_TORCHREC") == "1":
    import torchrec  # noqa: F401  (make test installs it: a missing one is a set-up bug, not a skip)
else:
    pytest.importorskip("torchrec")

import torch  # noqa: E402
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor  # noqa: E402
from torchrec.optim.keyed import KeyedOptimizerWrapper  # noqa: E402

from cnrstore.torch import Checkpointer  # noqa: E402
from support.dist_jobs import finish  # noqa: E402  (waits for spawned ranks, killing one that hangs)
from support import prespawn  # noqa: E402  (workers forked from a preloaded server)

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "support", "torchrec_worker.py")
ALL_TW = {"t0": "table_wise", "t1": "table_wise", "t2": "table_wise"}
MIXED = {"t0": "row_wise", "t1": "column_wise", "t2": "table_wise"}


def _run(tmp_path, scenario: str, world: int, plan: dict, seed: int, **cfg) -> None:
    out = tmp_path
    procs = []
    for rank in range(world):
        c = {"scenario": scenario, "rank": rank, "world": world, "init": str(out / f"init-{scenario}"),
             "out": str(out), "root": str(out / "root"), "plan": plan, "steps": 5, "seed": seed, **cfg}
        procs.append(prespawn.spawn(WORKER, json.dumps(c), env=dict(os.environ, OMP_NUM_THREADS="1")))
    bad = [(rc, text[-3000:]) for rc, text in finish(procs) if rc != 0]
    assert not bad, bad


def _load(tmp_path, kind: str, world: int) -> dict[str, np.ndarray]:
    """Every rank's dump of ``kind`` (saved, restored, continued-saved, continued-restored) merged: table
    entries are assembled into whole tables (``<fqn>/<state>`` -> array), dense ones taken from rank 0."""
    pieces: dict[str, list] = {}
    out: dict[str, np.ndarray] = {}
    for rank in range(world):
        with np.load(tmp_path / f"{kind}-rank{rank}.npz") as z:
            for key in z.files:
                if key.startswith("dense/"):
                    out.setdefault(key, z[key])
                    continue
                fqn, state, r0, c0 = key.rsplit("/", 3)
                pieces.setdefault(f"{fqn}/{state}", []).append((int(r0), int(c0), z[key]))
    for name, parts in pieces.items():
        rows = max(r0 + a.shape[0] for r0, _c0, a in parts)
        row_wise_state = all(a.ndim == 1 for _r, _c, a in parts)
        if row_wise_state:  # one value per row of each column slice: keep the slices apart
            for r0, c0, a in parts:
                full = out.setdefault(f"{name}@{c0}", np.full(rows, np.nan, np.float32))
                full[r0:r0 + a.shape[0]] = a
            continue
        cols = max(c0 + a.shape[1] for _r0, c0, a in parts)
        full = np.full((rows, cols), np.nan, np.float32)
        for r0, c0, a in parts:
            full[r0:r0 + a.shape[0], c0:c0 + a.shape[1]] = a
        out[name] = full
    return out


def _assembled(tmp_path, world: int) -> list[str]:
    """The shards (and states) a restore assembled from column slices rather than decoding into the TBE."""
    names = []
    for rank in range(world):
        with open(tmp_path / f"assembled-rank{rank}.json") as f:
            names += json.load(f)
    return names


def _assert_equal(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for key in a:
        assert not np.isnan(a[key]).any(), f"{key}: not every row or column came back"
        assert a[key].tobytes() == b[key].tobytes(), key


@pytest.mark.parametrize("world,plan", [(1, {"t0": "table_wise", "t1": "column_wise", "t2": "table_wise"}),
                                        (2, MIXED)])
def test_sharded_model_round_trip_is_bit_exact(tmp_path, world, plan):
    """Row-, column- and table-wise shards with fused row-wise Adagrad and a name-keyed Adam: the restored
    weights, fused optimizer state and dense parameters equal the saved ones bit for bit, and two more
    training steps from each give bit-equal states (so the dense optimizer's state came back too)."""
    _run(tmp_path, "save", world, plan, seed=0)
    _run(tmp_path, "restore", world, plan, seed=7)
    _assert_equal(_load(tmp_path, "restored", world), _load(tmp_path, "saved", world))
    _assert_equal(_load(tmp_path, "continued-restored", world), _load(tmp_path, "continued-saved", world))
    # the same plan: every shard and its fused state decoded straight into the TBE, none assembled
    assert _assembled(tmp_path, world) == []
    with open(tmp_path / "saves-rank0.json") as f:
        saves = json.load(f)
    tables = saves["tables"]
    # tables named by the fully-qualified name, with the global row count; a column slice names its columns
    assert tables["ebc.embedding_bags.t0"][:2] == [96, 8]
    assert ("ebc.embedding_bags.t1[0:4]" in tables) == (plan["t1"] == "column_wise")
    assert any(name.endswith(".optim.momentum1") for name in tables)
    # incremental saves write the looked-up rows only, after the baseline
    first, later = saves["saves"][0], saves["saves"][1:]
    assert first["baseline"] and not any(s["baseline"] for s in later)
    for s in later:
        assert 0 < s["rows"]["ebc.embedding_bags.t0"] < first["rows"]["ebc.embedding_bags.t0"]


def test_sharded_embedding_collection_round_trip_is_bit_exact(tmp_path):
    """The same with a sequence EmbeddingCollection (``ec.embeddings.<table>``) on 2 ranks."""
    _run(tmp_path, "save", 2, MIXED, seed=0, collection="ec")
    _run(tmp_path, "restore", 2, MIXED, seed=7, collection="ec")
    _assert_equal(_load(tmp_path, "restored", 2), _load(tmp_path, "saved", 2))
    _assert_equal(_load(tmp_path, "continued-restored", 2), _load(tmp_path, "continued-saved", 2))
    with open(tmp_path / "saves-rank0.json") as f:
        assert "ec.embeddings.t0" in json.load(f)["tables"]


def test_restore_into_another_sharding_plan(tmp_path):
    """Saved table-wise, restored with t1 cut into column slices (element-wise Adagrad state, which can be
    sliced like the weights): every table and state equal, assembled."""
    _run(tmp_path, "save", 1, ALL_TW, seed=0, fused="EXACT_ADAGRAD")
    _run(tmp_path, "restore", 1, {**ALL_TW, "t1": "column_wise"}, seed=7, fused="EXACT_ADAGRAD")
    _assert_equal(_load(tmp_path, "restored", 1), _load(tmp_path, "saved", 1))
    # only t1's slices (weights and state) are cut from the stored table: the other tables go straight in
    assert _assembled(tmp_path, 1) and all(".t1[" in name for name in _assembled(tmp_path, 1))


@pytest.mark.parametrize("src,dst", [((2, MIXED), (1, {**MIXED, "t0": "table_wise"})),
                                     ((1, {**MIXED, "t0": "table_wise"}), (2, {**MIXED, "t2": "row_wise"}))])
def test_distributed_checkpointer_reshards_torchrec_models(tmp_path, src, dst):
    """DistributedCheckpointer(plan=None) reads the plan off the DMP model; a global version written on one
    world size and plan is restored on another: every table and fused optimizer state equal, assembled."""
    (w0, p0), (w1, p1) = src, dst
    _run(tmp_path, "dsave", w0, p0, seed=0)
    saved = _load(tmp_path, "saved", w0)
    _run(tmp_path, "drestore", w1, p1, seed=7)
    restored = _load(tmp_path, "restored", w1)
    if "@" in "".join(saved):   # row-wise state of column slices keeps its slices: same slicing both sides
        assert sorted(k for k in saved if "@" in k) == sorted(k for k in restored if "@" in k)
    _assert_equal(restored, saved)


def test_a_survivor_keeps_its_checkpointer_across_a_regrouped_job(tmp_path):
    """After the default group is re-created, a survivor's recover() runs the collectives a replacement's
    new DistributedCheckpointer(plan=None) runs (the plan read off the model, then its own group): before,
    the two sides waited on different collectives until the timeout."""
    _run(tmp_path, "regroup", 2, MIXED, seed=0)
    reports = [json.loads((tmp_path / f"recovered-rank{r}.json").read_text()) for r in range(2)]
    assert reports == [{"global_version": 1, "restored": False}, {"global_version": 1, "restored": True}]


def test_row_wise_state_of_other_column_slices_is_refused(tmp_path):
    _run(tmp_path, "save", 1, ALL_TW, seed=0)
    _run(tmp_path, "restore", 1, {**ALL_TW, "t1": "column_wise"}, seed=7)
    message = (tmp_path / "error-rank0.txt").read_text()
    assert "ebc.embedding_bags.t1[0:4].optim.momentum1" in message and "cannot be re-sliced" in message
    assert not (tmp_path / "restored-rank0.npz").exists()


def test_a_model_it_cannot_checkpoint_is_refused_at_construction(tmp_path):
    """A DMP whose state dict holds DTensors (``ShardingEnv(output_dtensor=True)``, as 2-D parallelism uses):
    refused when the Checkpointer is made, saying why and what to do, not at the first save."""
    _run(tmp_path, "refused", 1, ALL_TW, seed=0, dtensor=True)
    message = (tmp_path / "error-rank0.txt").read_text()
    assert "is a DTensor" in message and "ShardedTensor" in message


def test_int4_shards_restore_as_the_codec_decodes_them(tmp_path):
    _run(tmp_path, "save", 2, MIXED, seed=0, codec="int4")
    _run(tmp_path, "restore", 2, MIXED, seed=7, codec="int4")
    saved, restored = _load(tmp_path, "saved", 2), _load(tmp_path, "restored", 2)
    int4 = codecs.get("int4")
    for name, weights in saved.items():
        if not name.endswith("/weight"):
            assert restored[name].tobytes() == weights.tobytes(), name   # optimizer state: fp32
            continue
        col_slices = [(0, 4), (4, 8)] if "t1" in name else [(0, 8)]   # each stored slice quantized alone
        for c0, c1 in col_slices:
            part = np.ascontiguousarray(weights[:, c0:c1])
            expect = int4.decode(int4.encode(part), c1 - c0)
            assert restored[name][:, c0:c1].tobytes() == expect.tobytes(), (name, c0)


class _UnshardedModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=50,
                                                                     feature_names=[f"f{i}"]) for i in range(2)])
        self.head = torch.nn.Linear(16, 1)

    def forward(self, kjt):
        return self.head(self.ebc(kjt).values()).squeeze(1)


def _kjt(step: int) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(step)
    return KeyedJaggedTensor.from_lengths_sync(keys=["f0", "f1"], values=torch.randint(0, 50, (16,), generator=g),
                                               lengths=torch.ones(16, dtype=torch.int64))


def _step(model, opt, step: int) -> None:
    opt.zero_grad()
    model(_kjt(step)).sum().backward()
    opt.step()


def test_unsharded_collection_with_a_keyed_optimizer(tmp_path):
    """An unsharded EmbeddingBagCollection and torchrec's name-keyed KeyedOptimizerWrapper (whose state dict
    is keyed by parameter names, which broke save()): tables by module path, Adagrad's row-wise state saved
    with them, and a restore into a fresh model continues bit-exactly."""
    torch.manual_seed(0)
    a = _UnshardedModel()
    opt_a = KeyedOptimizerWrapper(dict(a.named_parameters()), lambda p: torch.optim.Adagrad(p, lr=0.1))
    with cnrstore.open(tmp_path / "s", create=True) as store:
        ckpt = Checkpointer(store, a, opt_a, codec="fp32", mode="incremental")
        for step in range(4):
            _step(a, opt_a, step)
            ckpt.save(step).wait()
        ckpt.close()
        assert {"ebc.embedding_bags.t0", "ebc.embedding_bags.t0.optim.sum"} <= set(store.tables())
    torch.manual_seed(1)
    b = _UnshardedModel()
    opt_b = KeyedOptimizerWrapper(dict(b.named_parameters()), lambda p: torch.optim.Adagrad(p, lr=0.1))
    with cnrstore.open(tmp_path / "s", readonly=True) as store:
        Checkpointer(store, b, opt_b, codec="fp32").restore()
    for step in range(4, 6):
        _step(a, opt_a, step)
        _step(b, opt_b, step)
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values()):
        assert pa.numpy().tobytes() == pb.numpy().tobytes(), name


def _unsharded_model():
    """The workers' model unsharded (tests/support/torchrec_worker.py: tables t0..t2 of dim 8, a linear head)."""
    from support.torchrec_worker import DIM, ROWS

    return torch.nn.ModuleDict({
        "ebc": EmbeddingBagCollection(tables=[EmbeddingBagConfig(name=t, embedding_dim=DIM, num_embeddings=n,
                                                                 feature_names=[f"f{t}"]) for t, n in ROWS.items()]),
        "head": torch.nn.Linear(DIM * len(ROWS), 1)})


@pytest.mark.parametrize("world", [1, 2])
def test_export_of_a_sharded_model_loads_into_the_unsharded_one(tmp_path, world):
    """A DMP model's checkpoint (one store for 1 rank, a multi-rank root for 2) exports as the unsharded
    model's state dict: row-wise shards assembled by global row id, column slices joined, fused state left
    out; strict load_state_dict takes it and every table equals the saved one bit for bit (fp32)."""
    from cnrstore.export import export_path

    if world == 1:
        _run(tmp_path, "save", 1, MIXED, seed=0)
        source = tmp_path / "root" / "rank-0"
    else:
        _run(tmp_path, "dsave", 2, MIXED, seed=0)
        source = tmp_path / "root"
    report = export_path(source, "torch", tmp_path / "model.pt")
    assert report.layout == "state_dict" and report.merged == (world == 2)
    model = _unsharded_model()
    model.load_state_dict(torch.load(tmp_path / "model.pt"))   # strict: exactly the unsharded keys
    saved = _load(tmp_path, "saved", world)
    for t in ("t0", "t1", "t2"):
        key = f"ebc.embedding_bags.{t}.weight"
        assert model.state_dict()[key].numpy().tobytes() == saved[f"{key}/weight"].tobytes(), key
    assert model.state_dict()["head.weight"].numpy().tobytes() == saved["dense/head.weight"].tobytes()


def test_a_follower_keeps_an_unsharded_embedding_bag_collection_current(tmp_path):
    """cnrstore.serving.Follower with a TorchRec EmbeddingBagCollection as its target: a full sync, then an
    update of only the rows a step changed, bit for bit."""
    from cnrstore.serving import Follower

    def make():
        return EmbeddingBagCollection(tables=[
            EmbeddingBagConfig(name="t0", embedding_dim=8, num_embeddings=100, feature_names=["f0"]),
            EmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=50, feature_names=["f1"])])

    torch.manual_seed(0)
    model = make()
    opt = torch.optim.Adagrad(model.parameters(), lr=0.1)
    with Checkpointer(str(tmp_path / "ckpt"), model, opt) as ck:
        ck.save(step=0).wait()
        replica = make()
        with Follower(str(tmp_path / "ckpt"), replica) as follower:
            kjt = KeyedJaggedTensor.from_lengths_sync(keys=["f0", "f1"], values=torch.tensor([1, 5, 7, 3]),
                                                      lengths=torch.tensor([2, 1, 1, 0]))
            model(kjt).values().sum().backward()
            opt.step()
            version = ck.save(step=1).wait()
            assert follower.poll() == version
            assert follower.stats["rows_applied"] == 150 + 4  # (the full sync, then the 4 rows the step changed)
            for (k, a), (_, b) in zip(model.state_dict().items(), replica.state_dict().items()):
                assert torch.equal(a, b), k
