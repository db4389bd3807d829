"""One rank of a spawned gloo job for tests/test_distributed_keyed.py: a plain-PyTorch model whose
``KeyedEmbedding`` holds the ids its rank owns (``KeyedEmbedding.owner``), checkpointed by
``cnrstore.distributed.DistributedCheckpointer``.

    python tests/support/keyed_dist_worker.py '<json config>'

Scenarios: ``save`` trains ``steps`` steps, saving after every other one, dumps its state at the last save
(``saved-rank<r>.npz``), trains two more steps, dumps again (``continued-saved``) and exits without closing
anything (a kill); ``restore`` builds a fresh model (another seed, the config's ``capacity``) at the config's
world size, restores the newest global version, dumps (``restored-w<world>-rank<r>.npz``), trains the same two
steps, dumps (``continued-w<world>``) and saves once more.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # (its sibling modules)
from exit_now import exit_now  # noqa: E402
import gloo_join  # noqa: E402

from cnrstore.distributed import DistributedCheckpointer, ShardingPlan  # noqa: E402
from cnrstore.errors import InvalidArgument  # noqa: E402
from cnrstore.torch import KeyedEmbedding  # noqa: E402

P = 16      # the keyed table's partitions: the same on every rank and world size
DIM = 4
BATCH = 48  # global ids per step


class Model(nn.Module):
    def __init__(self, capacity: int, seed: int):
        super().__init__()
        self.emb = KeyedEmbedding(capacity, DIM, eviction="lru", partitions=P, seed=seed, init_std=0.1)
        torch.manual_seed(seed)
        self.head = nn.Linear(DIM, 1)


def batch(step: int):
    """The global batch of ``step``: ids among 60 + 12 * step distinct ones (admissions, then evictions)."""
    g = torch.Generator().manual_seed(100 + step)
    ids = (torch.randint(0, 60 + 12 * step, (BATCH,), generator=g) * 2654435761) % (1 << 40)
    return ids, torch.rand(BATCH, generator=g)


def train(model: Model, opt, steps, rank: int, world: int) -> None:
    for step in steps:
        ids, labels = batch(step)
        mine = model.emb.owner(ids, world) == rank
        out = model.head(model.emb(ids[mine])).squeeze(1)
        loss = nn.functional.binary_cross_entropy_with_logits(out, labels[mine], reduction="sum") / BATCH
        opt.zero_grad()
        loss.backward()
        for p in model.head.parameters():  # the replicated dense layer: gradients summed over ranks
            dist.all_reduce(p.grad)
        opt.step()


def dump(model: Model, opt, path: str) -> None:
    m = model.emb
    state = opt.state[m.weight]
    np.savez(path, weight=m.weight.detach().numpy(), slot_ids=m.slot_ids.numpy(), last_step=m.last_step.numpy(),
             count=m.count.numpy(), step=m.step.numpy(), seed=m.seed.numpy(), sum=state["sum"].numpy(),
             adagrad_step=np.asarray(float(state["step"])), head_w=model.head.weight.detach().numpy(),
             head_b=model.head.bias.detach().numpy(), head_sum=opt.state[model.head.weight]["sum"].numpy())


def main(cfg: dict) -> None:
    rank, world = gloo_join.join(cfg)
    out, steps = cfg["out"], cfg["steps"]
    seed = cfg["seed"] + rank
    model = Model(cfg["capacity"], seed)
    opt = torch.optim.Adagrad(model.parameters(), lr=0.1)
    model.emb.bind_optimizer(opt)
    plan = ShardingPlan.row_wise({}, world)  # (no positional table: the keyed embedding is each rank's own)
    if cfg["scenario"] == "save":
        ckpt = DistributedCheckpointer(cfg["root"], model, opt, plan=plan, timeout_s=60)
        cand = torch.arange(10_000, dtype=torch.int64)  # ids rank 0 owns (at 2 ranks, and at 3)
        bad = cand[(model.emb.owner(cand, 2) == 0) & (model.emb.owner(cand, 3) == 0)][:3]
        for step in range(steps):
            train(model, opt, [step], rank, world)
            if cfg.get("misroute") and rank == 1:  # rank 1 holds them too (looked up last: never evicted)
                with torch.no_grad():
                    model.emb(bad)
            if step % 2 == 1:
                ckpt.save(step + 1).wait()
        dump(model, opt, os.path.join(out, f"saved-rank{rank}.npz"))
        train(model, opt, range(steps, steps + 2), rank, world)
        dump(model, opt, os.path.join(out, f"continued-saved-rank{rank}.npz"))
        sys.stdout.flush()
        os._exit(0)  # killed: nothing closed
    ckpt = DistributedCheckpointer(cfg["root"], model, opt, plan=plan, timeout_s=60)
    (at,) = [g.version for g in ckpt.versions() if g.step == steps]  # (another test's job may have saved since)
    if cfg.get("expect_refusal"):
        before = model.emb.slot_ids.clone()
        try:
            ckpt.restore(at)
        except InvalidArgument as exc:
            assert torch.equal(model.emb.slot_ids, before)  # (nothing loaded)
            with open(os.path.join(out, f"refused-w{world}-rank{rank}.txt"), "w") as f:
                f.write(str(exc))
        ckpt.close()
        dist.destroy_process_group()
        return
    gv = ckpt.restore(at)
    dump(model, opt, os.path.join(out, f"restored-w{world}-rank{rank}.npz"))
    train(model, opt, range(steps, steps + 2), rank, world)
    dump(model, opt, os.path.join(out, f"continued-w{world}-rank{rank}.npz"))
    ckpt.save(steps + 2).wait()
    ckpt.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
    exit_now()
