"""One rank of a spawned job for tests/test_torchrec_mch.py: a TorchRec MPZCH model (a
``ManagedCollisionEmbeddingCollection`` over a ``HashZchManagedCollisionModule``) sharded row-wise by
``DistributedModelParallel`` on CPU gloo ranks, checkpointed by ``cnrstore.distributed.DistributedCheckpointer``.

    python tests/support/mpzch_worker.py '<json config>'

fbgemm's CPU kernel for MPZCH's lookup is read-only (it admits nothing: "Expected readonly to be true"), so the
managed-collision modules run in eval mode (lookups of the identities they hold) while the embedding
collection trains, and each step's admissions and evictions are written into the rank's identity buffer by
hand, before the step, as the CUDA kernel would (``admit``): a few slots take new ids, one is emptied. The
saved state therefore changes at every step in the ways MPZCH's does -- identities, embedding rows, the fused
optimizer's state -- and a restore must bring all of it back bit for bit.

Scenarios as in mch_worker.py: ``save`` (train ``steps`` steps saving every other one, dump, train two more,
dump, exit without closing) and ``restore`` (a fresh model of another seed restores the newest global version,
at the config's world size, which may differ: MPZCH then reshards by buckets; dumps, trains the same two
steps, dumps, saves once more and reports its store). The config's ``zch`` and ``buckets`` size the module,
``tag`` names the dumps.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # the repository
sys.path.insert(0, HERE)

from exit_now import exit_now  # noqa: E402
import gloo_join  # noqa: E402
from mch_worker import DIM, HASH, TorchRng, state_of, train as mch_train, write_store_report  # noqa: E402

ZCH = 64


def build(rank: int, world: int, seed: int, zch_size: int = ZCH, buckets: int = 4):
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec import EmbeddingCollection, EmbeddingConfig
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.mc_embedding import ManagedCollisionEmbeddingCollectionSharder
    from torchrec.distributed.mc_modules import ManagedCollisionCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
    from torchrec.distributed.types import ShardingEnv, ShardingPlan
    from torchrec.modules.hash_mc_modules import HashZchManagedCollisionModule
    from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingCollection
    from torchrec.modules.mc_modules import ManagedCollisionCollection
    from torchrec.optim.keyed import KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            cfg = [EmbeddingConfig(name="t", embedding_dim=DIM, num_embeddings=zch_size, feature_names=["f"])]
            ec = EmbeddingCollection(tables=cfg, device=torch.device("cpu"))
            zch = HashZchManagedCollisionModule(zch_size=zch_size, device=torch.device("cpu"),
                                                total_num_buckets=buckets, input_hash_size=HASH)
            self.mc = ManagedCollisionEmbeddingCollection(
                ec, ManagedCollisionCollection({"t": zch}, embedding_configs=cfg), return_remapped_features=False)
            self.head = torch.nn.Linear(DIM, 1)

        def forward(self, kjt):
            out = self.mc(kjt)
            out = out[0] if isinstance(out, tuple) else out
            return self.head(out["f"].values()).squeeze(1)

    torch.manual_seed(seed)
    model = Model()
    fused = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05}
    sharder = ManagedCollisionEmbeddingCollectionSharder(EmbeddingCollectionSharder(fused_params=fused),
                                                         ManagedCollisionCollectionSharder())
    plan = ShardingPlan({"mc": construct_module_sharding_plan(model.mc, {"t": row_wise(compute_kernel="fused")},
                                                              world_size=world, device_type="cpu", sharder=sharder)})
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=[sharder],
                                   init_data_parallel=False, env=ShardingEnv(world, rank, dist.GroupMember.WORLD))
    with torch.no_grad():  # the same initial table whatever the seed
        for key, value in dmp.state_dict().items():
            if type(value).__name__ == "ShardedTensor" and key.endswith(".weight"):
                full = torch.randn(*value.shape, generator=torch.Generator().manual_seed(seed))
                for local in value.local_shards():
                    r0 = local.metadata.shard_offsets[0]
                    local.tensor.copy_(full[r0:r0 + local.tensor.shape[0]])
    for name, module in dmp.named_modules():  # (fbgemm's CPU lookup is read-only: module doc)
        if type(module).__name__ == "HashZchManagedCollisionModule":
            module.eval()
    dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(dmp.named_parameters())),
                                  lambda params: torch.optim.Adam(params, lr=0.01))
    return dmp, dense


def identities(dmp) -> torch.Tensor:
    (key,) = [k for k in dmp.state_dict() if k.endswith("_hash_zch_identities")]
    return dmp.state_dict()[key].local_shards()[0].tensor


def admit(dmp, step: int, rank: int) -> None:
    """This step's admissions and eviction on this rank, written as the CUDA kernel would (module doc)."""
    ident = identities(dmp)
    g = torch.Generator().manual_seed(50_000 + 100 * step + rank)
    slots = torch.randperm(ident.shape[0], generator=g)[:4]
    with torch.no_grad():
        ident[slots[:3], 0] = torch.randint(0, HASH, (3,), generator=g)
        ident[slots[3], 0] = -1


def train(dmp, dense, steps, rank: int, world: int) -> None:
    """mch_worker's training, each step's admissions written first (``admit``)."""
    mch_train(dmp, dense, steps, rank, world, {}, before_step=lambda step: admit(dmp, step, rank))


def main(cfg: dict) -> None:
    rank, world = gloo_join.join(cfg)
    out, steps = cfg["out"], cfg["steps"]
    from cnrstore.distributed import DistributedCheckpointer

    dmp, dense = build(rank, world, seed=cfg.get("seed", 0), zch_size=cfg.get("zch", ZCH),
                       buckets=cfg.get("buckets", 4))
    tag = cfg.get("tag", f"mpzch-{cfg['scenario']}")
    if cfg["scenario"] == "save":
        ckpt = DistributedCheckpointer(cfg["root"], dmp, dense, codec="fp32", mode="incremental",
                                       extra={"rng": TorchRng()})
        for step in range(steps):
            train(dmp, dense, [step], rank, world)
            if step % 2 == 1:
                ckpt.save(step + 1).wait()
        np.savez(os.path.join(out, f"{tag}-saved-rank{rank}.npz"), **state_of(dmp))
        train(dmp, dense, range(steps, steps + 2), rank, world)
        np.savez(os.path.join(out, f"{tag}-continued-rank{rank}.npz"), **state_of(dmp))
        sys.stdout.flush()
        os._exit(0)  # killed: nothing closed
    ckpt = DistributedCheckpointer(cfg["root"], dmp, dense, codec="fp32", extra={"rng": TorchRng()})
    gv = ckpt.restore()
    assert gv.step == steps, gv
    np.savez(os.path.join(out, f"{tag}-restored-rank{rank}.npz"), **state_of(dmp))
    train(dmp, dense, range(steps, steps + 2), rank, world)
    np.savez(os.path.join(out, f"{tag}-continued-rank{rank}.npz"), **state_of(dmp))
    ckpt.save(steps + 2).wait()
    ckpt.close()
    write_store_report(cfg["root"], rank, os.path.join(out, f"{tag}-stores-rank{rank}.json"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
    exit_now()
