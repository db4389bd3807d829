"""One rank of a spawned job for tests/test_torchrec_mch.py: a TorchRec managed-collision model (an MCH
``ManagedCollisionEmbeddingBagCollection``, DistanceLFU eviction) sharded row-wise by
``DistributedModelParallel`` on CPU gloo ranks, checkpointed by ``cnrstore.distributed.DistributedCheckpointer``.

    python tests/support/mch_worker.py '<json config>'

Scenarios: ``save`` trains ``steps`` steps saving every other one, dumps its state (``saved-rank<r>.npz``),
trains two more steps and dumps again (``continued-saved``), then exits without closing anything (a kill:
the job's last global version is what a restart finds); ``restore`` builds a fresh model (another seed),
restores the newest global version, dumps (``restored``), trains the same two steps and dumps
(``continued-restored``), and writes what each rank's store holds (``stores-rank<r>.json``); ``reshard``
restores a version saved at another world size (``<tag>-restored``, with the RuntimeWarnings of the restore in
``<tag>-warnings-rank<r>.json``), trains two more steps (``<tag>-trained``) and saves; ``recover``: partial
recovery of rank 1.
"""

from __future__ import annotations

import glob
import json
import os
import sys
import warnings
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # (its sibling modules)
from exit_now import exit_now  # noqa: E402
import gloo_join  # noqa: E402

import cnrstore  # noqa: E402

ZCH = 64          # slots of table t (row-wise: ZCH / world per rank); the config's "zch" sets another
HASH = 2 ** 20    # raw ids in [0, HASH): torchrec routes id to rank id // ceil(HASH / world)
DIM = 8
BATCH = 16        # ids per rank and step (the config's "batch")
VOCAB = (40, 8)   # step s draws ids among VOCAB[0] + VOCAB[1] * s distinct ones (the config's "vocab")


def cpu_reset_weight_momentum() -> None:
    """fbgemm 1.8 has no CPU kernel for ``fbgemm::reset_weight_momentum``, which a sharded MCH collection calls
    at each eviction (slots handed to new ids get their row and row-wise Adagrad momentum reset): the same
    in Python, on the TBE's per-table views, so the sharded model trains on CPU at all. Test scaffolding
    only; cnrstore does not depend on it (its saves find changed rows by fingerprints, whoever wrote them)."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen

    def reset(self, pruned_indices, pruned_indices_offsets, logical_table_ids, buffer_ids):
        weights = self.split_embedding_weights()
        states = self.split_optimizer_states()
        offs = pruned_indices_offsets.tolist()
        with torch.no_grad():
            for i, t in enumerate(logical_table_ids.tolist()):
                rows = pruned_indices[offs[i]:offs[i + 1]].long()
                weights[t][rows] = 0
                states[t][0][rows] = 0

    SplitTableBatchedEmbeddingBagsCodegen.reset_embedding_weight_momentum = reset


def build(rank: int, world: int, seed: int, zch: int = ZCH):
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.mc_embeddingbag import ManagedCollisionEmbeddingBagCollectionSharder
    from torchrec.distributed.mc_modules import ManagedCollisionCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
    from torchrec.distributed.types import ShardingEnv, ShardingPlan, ShardingType
    from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection
    from torchrec.modules.mc_modules import (DistanceLFU_EvictionPolicy, ManagedCollisionCollection,
                                             MCHManagedCollisionModule)
    from torchrec.optim.keyed import KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    class RwSharder(EmbeddingBagCollectionSharder):
        def sharding_types(self, compute_device_type):
            return [ShardingType.ROW_WISE.value]

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            cfg = [EmbeddingBagConfig(name="t", embedding_dim=DIM, num_embeddings=zch, feature_names=["f"])]
            ebc = EmbeddingBagCollection(tables=cfg, device=torch.device("cpu"))
            mch = MCHManagedCollisionModule(zch_size=zch, device=torch.device("cpu"), eviction_interval=2,
                                            input_hash_size=HASH, eviction_policy=DistanceLFU_EvictionPolicy())
            self.mc = ManagedCollisionEmbeddingBagCollection(
                ebc, ManagedCollisionCollection({"t": mch}, embedding_configs=cfg), return_remapped_features=False)
            self.head = torch.nn.Linear(DIM, 1)

        def forward(self, kjt):
            out = self.mc(kjt)
            out = out[0] if isinstance(out, tuple) else out
            return self.head(out["f"]).squeeze(1)

    torch.manual_seed(seed)
    model = Model()
    fused = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05}
    sharder = ManagedCollisionEmbeddingBagCollectionSharder(ebc_sharder=RwSharder(fused_params=fused),
                                                           mc_sharder=ManagedCollisionCollectionSharder())
    plan = ShardingPlan({"mc": construct_module_sharding_plan(model.mc, {"t": row_wise(compute_kernel="fused")}, world_size=world,
                                                              device_type="cpu", sharder=sharder)})
    env = ShardingEnv(world, rank, dist.GroupMember.WORLD)
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=[sharder],
                                   init_data_parallel=False, env=env)
    with torch.no_grad():  # the same initial table whatever the seed's draws in the sharded init
        for key, value in dmp.state_dict().items():
            if type(value).__name__ == "ShardedTensor" and value.dim() == 2:
                full = torch.randn(*value.shape, generator=torch.Generator().manual_seed(seed))
                for local in value.local_shards():
                    r0, c0 = local.metadata.shard_offsets
                    local.tensor.copy_(full[r0:r0 + local.tensor.shape[0], c0:c0 + local.tensor.shape[1]])
    dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(dmp.named_parameters())),
                                  lambda params: torch.optim.Adam(params, lr=0.01))
    return dmp, dense


def batch(step: int, rank: int, world: int, size: int = BATCH, vocab=VOCAB):
    """This rank's slice of the global batch of ``step``: new ids every step (admissions, then evictions)."""
    from torchrec import KeyedJaggedTensor

    g = torch.Generator().manual_seed(1000 + step)
    ids = (torch.randint(0, vocab[0] + vocab[1] * step, (size * world,), generator=g) * 2654435761) % HASH
    labels = torch.rand(size * world, generator=g)
    mine = slice(rank * size, (rank + 1) * size)
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=["f"], values=ids[mine].contiguous(),
                                              lengths=torch.ones(size, dtype=torch.int64))
    return kjt, labels[mine]


def train(dmp, dense, steps, rank, world, cfg, before_step=None) -> None:
    """Train ``steps`` (the dense layers' gradients averaged over ranks); ``before_step(step)`` runs first at each."""
    for step in steps:
        if before_step is not None:
            before_step(step)
        kjt, labels = batch(step, rank, world, cfg.get("batch", BATCH), cfg.get("vocab", VOCAB))
        loss = torch.nn.functional.binary_cross_entropy_with_logits(dmp(kjt), labels)
        dense.zero_grad()
        loss.backward()
        for p in dense.params.values():
            if p.grad is not None and world > 1:
                dist.all_reduce(p.grad)
                p.grad /= world
        dense.step()


def state_of(dmp) -> dict[str, np.ndarray]:
    """Every local shard (tables, managed-collision buffers), the fused optimizer's state, dense state."""
    out = {}
    for key, value in dmp.state_dict().items():
        if type(value).__name__ == "ShardedTensor":
            for local in value.local_shards():
                out[f"{key}@{local.metadata.shard_offsets[0]}"] = local.tensor.detach().clone().numpy()
        else:
            out[f"dense/{key}"] = value.detach().clone().numpy()
    for key, entries in dmp.fused_optimizer.state_dict()["state"].items():
        for name, value in entries.items():
            for local in value.local_shards():
                out[f"optim/{name}@{local.metadata.shard_offsets[0]}"] = local.tensor.detach().clone().numpy()
    return out


def write_store_report(root: str, rank: int, path: str) -> None:
    """What this rank's store (of the newest generation) holds, as JSON at ``path``: per keyed table its live
    keys and the keys each version changed, the dense array names, and whether it verifies."""
    report = {}
    store_dir = sorted(glob.glob(os.path.join(root, "gen-*", f"rank-{rank:05d}")))[-1]
    with cnrstore.open(store_dir, readonly=True) as s:
        vs = [v.version for v in s.versions()]
        for name, t in s.tables().items():
            if t.keyed:
                report[name] = {"live": int(s.keys(name).size),
                                "changed": [int(c.rows.size) for a, b in zip(vs, vs[1:]) for c in s.changes(a, b, [name])]}
        report["dense"] = sorted(s.dense_names())
        report["ok"] = bool(s.verify().ok)
    with open(path, "w") as f:
        json.dump(report, f)


class TorchRng:
    """The process's torch RNG as checkpointed state: MCH re-initializes the rows of the slots it hands to new
    ids with the table's init_fn, drawn from torch's global generator, so an exact continuation needs it."""

    def state_dict(self):
        return {"state": torch.get_rng_state()}

    def load_state_dict(self, sd):
        torch.set_rng_state(sd["state"])


def main(cfg: dict) -> None:
    rank, world = gloo_join.join(cfg)
    out, scenario, steps = cfg["out"], cfg["scenario"], cfg["steps"]
    from cnrstore.distributed import DistributedCheckpointer

    cpu_reset_weight_momentum()
    dmp, dense = build(rank, world, seed=cfg.get("seed", 0), zch=cfg.get("zch", ZCH))
    if scenario == "save":
        ckpt = DistributedCheckpointer(cfg["root"], dmp, dense, codec="fp32", mode="incremental",
                                       extra={"rng": TorchRng()})
        for step in range(steps):
            train(dmp, dense, range(step, step + 1), rank, world, cfg)
            if step % 2 == 1:
                ckpt.save(step + 1).wait()
        np.savez(os.path.join(out, f"saved-rank{rank}.npz"), **state_of(dmp))
        train(dmp, dense, range(steps, steps + 2), rank, world, cfg)
        np.savez(os.path.join(out, f"continued-saved-rank{rank}.npz"), **state_of(dmp))
        # killed: nothing closed, no destroy_process_group
        sys.stdout.flush()
        os._exit(0)
    elif scenario == "restore":
        ckpt = DistributedCheckpointer(cfg["root"], dmp, dense, codec="fp32", extra={"rng": TorchRng()})
        try:
            gv = ckpt.restore()
        except cnrstore.errors.InvalidArgument as exc:
            with open(os.path.join(out, f"error-rank{rank}.txt"), "w") as f:
                f.write(str(exc))
            ckpt.close()
            dist.destroy_process_group()
            return
        assert gv.step == steps, gv
        np.savez(os.path.join(out, f"restored-rank{rank}.npz"), **state_of(dmp))
        train(dmp, dense, range(steps, steps + 2), rank, world, cfg)
        np.savez(os.path.join(out, f"continued-restored-rank{rank}.npz"), **state_of(dmp))
        ckpt.save(steps + 2).wait()   # a save after the restore: its delta is against the restored version
        ckpt.close()
        write_store_report(cfg["root"], rank, os.path.join(out, f"stores-rank{rank}.json"))
    elif scenario == "reshard":
        # a job at another world size than the save's: restore (MCH state remapped, cnrstore's RuntimeWarnings
        # recorded), dump, train two more steps, dump, save
        tag = cfg["tag"]
        ckpt = DistributedCheckpointer(cfg["root"], dmp, dense, codec="fp32", extra={"rng": TorchRng()})
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            gv = ckpt.restore()
        assert gv.step == steps and gv.plan.world_size != world, gv
        with open(os.path.join(out, f"{tag}-warnings-rank{rank}.json"), "w") as f:
            json.dump([str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)], f)
        np.savez(os.path.join(out, f"{tag}-restored-rank{rank}.npz"), **state_of(dmp))
        train(dmp, dense, range(steps, steps + 2), rank, world, cfg)
        np.savez(os.path.join(out, f"{tag}-trained-rank{rank}.npz"), **state_of(dmp))
        ckpt.save(steps + 2).wait()
        ckpt.close()
    elif scenario == "recover":
        # partial recovery: both ranks save at step 2 and train on; rank 1 is then "replaced" (recovers its
        # saved state), rank 0 keeps its live one. Managed-collision state is each rank's own: rank 1 must get
        # its saved buffers back, not rank 0's (replicated dense state is copied from the survivor)
        ckpt = DistributedCheckpointer(cfg["root"], dmp, dense, codec="fp32", mode="incremental", timeout_s=60,
                                       extra={"rng": TorchRng()})
        train(dmp, dense, range(2), rank, world, cfg)
        ckpt.save(2).wait()
        np.savez(os.path.join(out, f"at-save-rank{rank}.npz"), **state_of(dmp))
        train(dmp, dense, range(2, 4), rank, world, cfg)
        np.savez(os.path.join(out, f"live-rank{rank}.npz"), **state_of(dmp))
        dist.destroy_process_group()
        dist.init_process_group("gloo", init_method=f"file://{cfg['init']}-again", rank=rank, world_size=world,
                                timeout=timedelta(seconds=60))
        if rank == 0:
            ckpt.recover([1], step=4)
        else:
            ckpt.close()
            ckpt = DistributedCheckpointer(cfg["root"], dmp, dense, codec="fp32", timeout_s=60,
                                           extra={"rng": TorchRng()})
            ckpt.recover([1])
        ckpt.close()
        np.savez(os.path.join(out, f"recovered-rank{rank}.npz"), **state_of(dmp))
    else:
        raise ValueError(f"unknown scenario {scenario!r}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
    exit_now()
