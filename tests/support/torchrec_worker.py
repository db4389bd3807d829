"""One rank of a spawned TorchRec job for tests/test_torchrec.py (CPU, gloo).

    python tests/support/torchrec_worker.py '<json config>'

Builds a small model of an ``EmbeddingBagCollection`` (tables t0, t1, t2, dims 8) and a linear head,
sharded by ``DistributedModelParallel`` with the plan the config gives (``{"t0": "row_wise", ...}``; a
sharder that also allows row-wise shards on CPU, which TorchRec's planner offers on GPUs only), a fused
TBE optimizer (``fused``: an ``EmbOptimType`` name) and an Adam dense optimizer (``KeyedOptimizerWrapper``,
name-keyed), then runs the config's ``scenario`` and writes ``<out>/<tag>-rank<r>.npz``: the assembled
state of every table shard it holds (keyed ``<table>/<kind>/<row_offset>/<col_offset>``) and the dense
parameters. Exit status 0: the rank's own checks passed.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # (its sibling modules)
from exit_now import exit_now  # noqa: E402
import gloo_join  # noqa: E402

import cnrstore  # noqa: E402
from cnrstore.torch import Checkpointer  # noqa: E402

ROWS = {"t0": 96, "t1": 40, "t2": 64}
DIM = 8


def build(cfg: dict, rank: int, world: int, seed: int):
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.distributed.types import ShardingEnv, ShardingType
    from torchrec.optim.keyed import KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    pooled = cfg.get("collection", "ebc") == "ebc"
    base = EmbeddingBagCollectionSharder if pooled else EmbeddingCollectionSharder

    class Sharder(base):
        def sharding_types(self, compute_device_type):
            return [ShardingType.ROW_WISE.value, ShardingType.TABLE_WISE.value, ShardingType.COLUMN_WISE.value]

    class Model(torch.nn.Module):
        """The tables as a pooled EmbeddingBagCollection (``ebc``) or a sequence EmbeddingCollection (``ec``:
        one id per sample and feature here, so its rows are the samples' embeddings)."""

        def __init__(self):
            super().__init__()
            if pooled:
                self.ebc = EmbeddingBagCollection(
                    tables=[EmbeddingBagConfig(name=t, embedding_dim=DIM, num_embeddings=n, feature_names=[f"f{t}"])
                            for t, n in ROWS.items()], device=torch.device("meta"))
            else:
                self.ec = EmbeddingCollection(
                    tables=[EmbeddingConfig(name=t, embedding_dim=DIM, num_embeddings=n, feature_names=[f"f{t}"])
                            for t, n in ROWS.items()], device=torch.device("meta"))
            self.head = torch.nn.Linear(DIM * len(ROWS), 1)

        def forward(self, kjt):
            if pooled:
                return self.head(self.ebc(kjt).values()).squeeze(1)
            out = self.ec(kjt)
            return self.head(torch.cat([out[f"f{t}"].values() for t in ROWS], dim=1)).squeeze(1)

    torch.manual_seed(seed)
    model = Model()
    sharder = Sharder(fused_params={"optimizer": getattr(EmbOptimType, cfg.get("fused", "EXACT_ROWWISE_ADAGRAD")),
                                    "learning_rate": 0.05})
    constraints = {t: ParameterConstraints(sharding_types=[kind], min_partition=4) for t, kind in cfg["plan"].items()}
    planner = EmbeddingShardingPlanner(topology=Topology(world_size=world, compute_device="cpu"),
                                       constraints=constraints)
    plan = planner.collective_plan(model, [sharder], dist.GroupMember.WORLD)
    env = ShardingEnv(world, rank, dist.GroupMember.WORLD, output_dtensor=bool(cfg.get("dtensor")))
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=[sharder],
                                   init_data_parallel=False, env=env)
    with torch.no_grad():  # the same initial tables whatever the plan: every row from a seeded generator
        for key, value in dmp.state_dict().items():
            if type(value).__name__ == "ShardedTensor":
                full = torch.randn(*value.shape, generator=torch.Generator().manual_seed(seed + len(key)))
                for local in value.local_shards():
                    r0, c0 = local.metadata.shard_offsets
                    r1, c1 = r0 + local.tensor.shape[0], c0 + local.tensor.shape[1]
                    local.tensor.copy_(full[r0:r1, c0:c1])
    dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(dmp.named_parameters())),
                                  lambda params: torch.optim.Adam(params, lr=0.01))
    return dmp, dense


def batch(step: int, batch_size: int = 16):
    """The global batch of ``step`` (every rank draws the same, then takes its slice)."""
    from torchrec import KeyedJaggedTensor

    g = torch.Generator().manual_seed(1000 + step)
    values, lengths = [], []
    for n in ROWS.values():
        ids = torch.randint(0, n, (batch_size,), generator=g) ** 2 % n  # skewed: some rows often, some never
        values.append(ids)
        lengths.append(torch.ones(batch_size, dtype=torch.int64))
    labels = torch.rand(batch_size, generator=g)
    return KeyedJaggedTensor.from_lengths_sync(keys=[f"f{t}" for t in ROWS], values=torch.cat(values),
                                               lengths=torch.cat(lengths)), labels


def train(dmp, dense, steps: range) -> None:
    for step in steps:
        kjt, labels = batch(step)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(dmp(kjt), labels)
        dense.zero_grad()
        loss.backward()
        for p in dense.params.values():   # the dense replicas stay equal: average their gradients
            if p.grad is not None and dist.get_world_size() > 1:
                dist.all_reduce(p.grad)
                p.grad /= dist.get_world_size()
        dense.step()


def state_of(dmp) -> dict[str, np.ndarray]:
    """Every local shard of every table and its fused optimizer state, and the dense parameters."""
    out, offsets = {}, {}
    for key, value in dmp.state_dict().items():
        if type(value).__name__ == "ShardedTensor":
            offsets[key] = [tuple(local.metadata.shard_offsets) for local in value.local_shards()]
            for local in value.local_shards():
                r0, c0 = local.metadata.shard_offsets
                out[f"{key}/weight/{r0}/{c0}"] = local.tensor.detach().clone().numpy()
        else:
            out[f"dense/{key}"] = value.detach().clone().numpy()
    for key, entries in dmp.fused_optimizer.state_dict()["state"].items():
        for name, value in entries.items():
            for (r0, c0), local in zip(offsets[key], value.local_shards()):   # paired with the weight shards
                out[f"{key}/{name.rsplit('.', 1)[-1]}/{r0}/{c0}"] = local.tensor.detach().clone().numpy()
    return out


def main(cfg: dict) -> None:
    rank, world = gloo_join.join(cfg, timeout_s=120)
    out = cfg["out"]
    scenario = cfg["scenario"]
    store_path = os.path.join(cfg["root"], f"rank-{rank}")
    dmp, dense = build(cfg, rank, world, seed=cfg.get("seed", 0))
    if scenario == "refused":  # a model cnrstore cannot checkpoint: the constructor says why
        with cnrstore.open(store_path, create=True) as store:
            try:
                Checkpointer(store, dmp, dense)
            except cnrstore.errors.InvalidArgument as exc:
                with open(os.path.join(out, f"error-rank{rank}.txt"), "w") as f:
                    f.write(str(exc))
    elif scenario == "dsave":   # through cnrstore.distributed: one store per rank, global versions
        from cnrstore.distributed import DistributedCheckpointer
        ckpt = DistributedCheckpointer(cfg["root"], dmp, dense, codec=cfg.get("codec", "fp32"),
                                       mode=cfg.get("mode", "incremental"))
        for step in range(cfg["steps"]):
            train(dmp, dense, range(step, step + 1))
            if step % 2 == 1 or step == cfg["steps"] - 1:
                ckpt.save(step + 1).wait()
        ckpt.close()
        np.savez(os.path.join(out, f"saved-rank{rank}.npz"), **state_of(dmp))
    elif scenario == "drestore":   # maybe another world size and plan: resharded from the ranks' stores
        from cnrstore.distributed import DistributedCheckpointer
        ckpt = DistributedCheckpointer(cfg["root"], dmp, dense, codec=cfg.get("codec", "fp32"))
        try:
            gv = ckpt.restore()
        except cnrstore.errors.InvalidArgument as exc:
            with open(os.path.join(out, f"error-rank{rank}.txt"), "w") as f:
                f.write(str(exc))
            ckpt.close()
            return
        ckpt.close()
        assert gv.step == cfg["steps"], gv
        np.savez(os.path.join(out, f"restored-rank{rank}.npz"), **state_of(dmp))
    elif scenario == "regroup":
        # partial recovery where the survivor keeps its checkpointer across the re-created default group and
        # the "replaced" rank opens a new one (plan=None): the same collectives on both sides
        from cnrstore.distributed import DistributedCheckpointer
        ckpt = DistributedCheckpointer(cfg["root"], dmp, dense, codec="fp32", mode="incremental", timeout_s=60)
        train(dmp, dense, range(2))
        ckpt.save(2).wait()
        dist.destroy_process_group()
        dist.init_process_group("gloo", init_method=f"file://{cfg['init']}-again", rank=rank, world_size=world,
                                timeout=timedelta(seconds=60))
        if rank == 0:
            rep = ckpt.recover([1], step=2)
        else:
            ckpt.close()
            ckpt = DistributedCheckpointer(cfg["root"], dmp, dense, codec="fp32", timeout_s=60)
            rep = ckpt.recover([1])
        ckpt.close()
        with open(os.path.join(out, f"recovered-rank{rank}.json"), "w") as f:
            json.dump({"global_version": rep.global_version, "restored": rep.restored}, f)
    elif scenario == "save":
        # train, saving every other step in the given mode; the state after the last save is the truth
        with cnrstore.open(store_path, create=True) as store:
            ckpt = Checkpointer(store, dmp, dense, codec=cfg.get("codec", "fp32"), mode=cfg.get("mode", "incremental"))
            saves = []
            for step in range(cfg["steps"]):
                train(dmp, dense, range(step, step + 1))
                if step % 2 == 1 or step == cfg["steps"] - 1:
                    pending = ckpt.save(step + 1)
                    pending.wait()
                    saves.append({"rows": pending.report.rows, "baseline": pending.report.baseline})
            ckpt.close()
            np.savez(os.path.join(out, f"saved-rank{rank}.npz"), **state_of(dmp))
            with open(os.path.join(out, f"saves-rank{rank}.json"), "w") as f:
                json.dump({"saves": saves, "tables": {n: [i.num_rows, i.dim, i.codec] for n, i in store.tables().items()}},
                          f)
        train(dmp, dense, range(cfg["steps"], cfg["steps"] + 2))   # what a restore must continue exactly
        np.savez(os.path.join(out, f"continued-saved-rank{rank}.npz"), **state_of(dmp))
    elif scenario == "restore":
        # a fresh model (another seed), maybe another plan: restore the newest version
        src = os.path.join(cfg["root"], f"rank-{cfg.get('source_rank', rank)}")
        # count the shards assembled from column slices (the others are decoded straight into the TBE)
        from cnrstore.torch import restore as restore_module
        assembled = []
        read_shard = restore_module.read_shard
        restore_module.read_shard = lambda store, catalog, t, suffix, *a: (assembled.append(t.name + suffix),
                                                                             read_shard(store, catalog, t, suffix, *a))[1]
        with cnrstore.open(src, readonly=True) as store:
            ckpt = Checkpointer(store, dmp, dense, codec=cfg.get("codec", "fp32"), mode=cfg.get("mode", "incremental"))
            try:
                ckpt.restore()
            except cnrstore.errors.InvalidArgument as exc:
                with open(os.path.join(out, f"error-rank{rank}.txt"), "w") as f:
                    f.write(str(exc))
                return
            ckpt.close()
        with open(os.path.join(out, f"assembled-rank{rank}.json"), "w") as f:
            json.dump(assembled, f)
        np.savez(os.path.join(out, f"restored-rank{rank}.npz"), **state_of(dmp))
        train(dmp, dense, range(cfg["steps"], cfg["steps"] + 2))
        np.savez(os.path.join(out, f"continued-restored-rank{rank}.npz"), **state_of(dmp))
    else:
        raise ValueError(f"unknown scenario {scenario!r}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
    exit_now()
