"""One rank of a spawned gloo job for tests/test_distributed.py.

    python tests/support/dist_worker.py '<json config>'

The config names the scenario, rank, world size, the FileStore path for init_process_group, the root, an
output directory and scenario options (``device``: where the model lives, "cpu" unless tests/test_cuda.py
asks for "cuda"; ``optimizers``: "one", an Adagrad over every parameter, or "split", a list of two: Adagrad on
the embedding shards, Adam on the dense layers). A rank dumps its state (shard rows of every table, row-wise
optimizer state, dense parameters and their optimizer state) as ``<out>/<tag>-rank<r>.npz``; the test assembles the global tables
from the dumps of all ranks and compares. Exit status 0 means the rank's own checks passed.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # (its sibling modules)
from exit_now import exit_now  # noqa: E402
import gloo_join  # noqa: E402

from cnrstore.distributed import DistributedCheckpointer, ShardingPlan  # noqa: E402
from cnrstore.errors import GlobalCommitError  # noqa: E402

TABLES = {"emb.t0": (97, 8), "emb.t1": (40, 4), "emb.t2": (64, 6)}


class Loader:
    """A data-loader position (the ``extra`` state)."""

    def __init__(self):
        self.position = 0

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


def make_plan(kind: str, world: int) -> ShardingPlan:
    return ShardingPlan.row_wise(TABLES, world) if kind == "row" else ShardingPlan.table_wise(TABLES, world)


class Model(nn.Module):
    def __init__(self, plan: ShardingPlan, rank: int, seed: int):
        super().__init__()
        shards = plan.shards_of(rank)
        self.emb = nn.ModuleDict()
        for name, (num_rows, dim) in TABLES.items():
            if name not in shards:
                continue
            full = torch.randn(num_rows, dim, generator=torch.Generator().manual_seed(seed + list(TABLES).index(name)))
            s = shards[name]
            bag = nn.EmbeddingBag(s.num_rows, dim, mode="mean")
            with torch.no_grad():
                bag.weight.copy_(full[s.row_start:s.row_end])
            self.emb[name.split(".", 1)[1]] = bag
        torch.manual_seed(seed)
        self.mlp = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 1))


def make_optimizer(model: Model, kind: str):
    """One Adagrad over every parameter, or ("split") a list: Adagrad on the shards, Adam on the dense layers."""
    if kind == "split":
        return [torch.optim.Adagrad(model.emb.parameters(), lr=0.1), torch.optim.Adam(model.mlp.parameters(), lr=0.01)]
    return torch.optim.Adagrad(model.parameters(), lr=0.1)


def optimizers(opt) -> list:
    return opt if isinstance(opt, list) else [opt]


def state_of(opt, p) -> dict:
    """``p``'s state in whichever of the optimizers ``opt`` holds it."""
    return next((o.state[p] for o in optimizers(opt) if p in o.state), {})


def train(model: Model, opt, loader: Loader, steps: int, rank: int) -> None:
    device = next(model.parameters()).device  # (the inputs are drawn on the CPU, the same on every device)
    for _ in range(steps):
        k = loader.position
        g = torch.Generator().manual_seed(1000 * k + rank)
        loss = model.mlp(torch.randn(16, 5, generator=torch.Generator().manual_seed(k)).to(device)).pow(2).mean()
        for bag in model.emb.values():
            ids = torch.randint(bag.num_embeddings, (12,), generator=g).to(device)
            loss = loss + bag(ids, torch.tensor([0, 5], device=device)).pow(2).mean()
        for o in optimizers(opt):
            o.zero_grad()
        loss.backward()
        for p in model.mlp.parameters():  # DDP's job: keep the dense replicas equal
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
        for o in optimizers(opt):
            o.step()
        loader.position += 1


def dump(model: Model, opt, loader: Loader, plan: ShardingPlan, rank: int, path: str) -> None:
    out = {"position": np.array(loader.position)}
    shards = plan.shards_of(rank)
    for key, bag in model.emb.items():
        name = f"emb.{key}"
        out[f"{name}/start"] = np.array(shards[name].row_start)
        out[f"{name}/weight"] = bag.weight.detach().cpu().numpy().copy()
        state = state_of(opt, bag.weight)
        if "sum" in state:
            out[f"{name}/sum"] = state["sum"].cpu().numpy().copy()
            out[f"{name}/step"] = np.array(float(state["step"]))
    for n, p in model.mlp.named_parameters():
        out[f"mlp/{n}"] = p.detach().cpu().numpy().copy()
        state = state_of(opt, p)
        for key in ("sum", "exp_avg", "exp_avg_sq"):   # Adagrad's; Adam's ("split")
            if key in state:
                out[f"mlp/{n}/{key}"] = state[key].cpu().numpy().copy()
        if "exp_avg" in state:
            out[f"mlp/{n}/adam_step"] = np.array(float(state["step"]))
    np.savez(path, **out)


def main() -> int:
    cfg = json.loads(sys.argv[1])
    rank, world = gloo_join.join(cfg, timeout_s=cfg.get("pg_timeout", 60))
    plan = make_plan(cfg.get("plan", "row"), world)
    model = Model(plan, rank, cfg.get("seed", 0)).to(cfg.get("device", "cpu"))  # "cuda": tests/test_cuda.py
    opt = make_optimizer(model, cfg.get("optimizers", "one"))
    loader = Loader()
    kwargs = dict(plan=plan, codec=cfg.get("codec", "fp32"), mode=cfg.get("mode", "incremental"),
                  extra={"loader": loader}, timeout_s=cfg.get("timeout", 60), keep_last=cfg.get("keep_last"))
    out = lambda tag: os.path.join(cfg["out"], f"{tag}-rank{rank}.npz")  # noqa: E731
    scenario = cfg["scenario"]
    root = cfg["root"]
    if cfg.get("remote"):  # a root in a bucket: each rank's "node" has a local directory of its own
        kwargs.update(remote=cfg["remote"], remote_options=cfg["remote_options"], cache_bytes=cfg.get("cache_bytes"))
        root = os.path.join(root, f"node-{cfg.get('node', 'a')}{rank}")
    ck = DistributedCheckpointer(root, model, opt, **kwargs)
    if scenario == "save":
        for i, steps in enumerate(cfg["train"]):
            train(model, opt, loader, steps, rank)
            g = ck.save(step=loader.position, meta={"i": i}).wait()
            dump(model, opt, loader, plan, rank, out(f"g{g}"))
        ck.close()
    elif scenario == "restore":
        gv = ck.restore(cfg.get("version"))
        dump(model, opt, loader, plan, rank, out(f"restored-g{gv.version}"))
        if cfg.get("then_save"):  # the restored state must be saveable under the new plan
            train(model, opt, loader, 2, rank)
            g = ck.save(step=loader.position).wait()
            dump(model, opt, loader, plan, rank, out(f"g{g}"))
        ck.close()
    elif scenario == "crash":
        train(model, opt, loader, 3, rank)
        g1 = ck.save(step=loader.position).wait()
        dump(model, opt, loader, plan, rank, out(f"g{g1}"))
        train(model, opt, loader, 2, rank)
        if rank == cfg["crash_rank"]:
            os.environ["CNRSTORE_CRASH_AT"] = cfg["crash_at"]
        try:
            g2 = ck.save(step=loader.position).wait()
        except GlobalCommitError as exc:
            print(f"rank {rank}: commit failed as expected: {exc}", flush=True)
            return 0
        print(f"rank {rank}: committed g{g2} although rank {cfg['crash_rank']} crashed", flush=True)
        return 0 if cfg["crash_at"] == "dist_after_manifest" else 3
    elif scenario == "partial":
        return partial(cfg, ck, model, opt, loader, plan, rank, out)
    elif scenario == "sigterm":
        return sigterm(cfg, ck, model, opt, loader, rank)
    else:
        raise SystemExit(f"unknown scenario {scenario}")
    dist.destroy_process_group()
    return 0


def sigterm(cfg, ck, model, opt, loader, rank) -> int:
    """Two saves, each after step ``loader.position - 1``; at the second, SIGTERM reaches the ranks
    ``cfg["signalled"]``: right after ``save()`` returned, its global commit in flight ("after_save"), or inside
    ``save()``, once this rank's local save is queued and before its global commit starts ("inside_save"). The
    others wait for that save. Prints each save that returned; a signalled rank ends as SIGTERM ends it."""
    signalled, where = rank in cfg["signalled"], cfg["where"]
    with ck:
        train(model, opt, loader, 3, rank)
        ck.save(step=loader.position - 1).wait()
        print(f"rank {rank}: save of step {loader.position - 1} returned", flush=True)
        train(model, opt, loader, 2, rank)
        if signalled and where == "inside_save":
            local_save = ck.local.save

            def save_then_sigterm(*args, **kwargs):
                pending = local_save(*args, **kwargs)
                os.kill(os.getpid(), signal.SIGTERM)   # (handled at the next bytecode: inside the distributed save)
                return pending

            ck.local.save = save_then_sigterm
        pending = ck.save(step=loader.position - 1)
        print(f"rank {rank}: save of step {loader.position - 1} returned (committed already: {pending.done()})",
              flush=True)
        if signalled:
            os.kill(os.getpid(), signal.SIGTERM)
            raise AssertionError("SIGTERM did not end the rank")
        print(f"rank {rank}: global version {pending.wait()}", flush=True)
    return 0


def partial(cfg, ck, model, opt, loader, plan, rank, out) -> int:
    """Survivors: train, save, train; rank `fail` dies; the survivors re-form the group with a replacement
    started by the test, and recover. The replacement runs this with cfg["replacement"]."""
    fail = cfg["fail_rank"]
    if cfg.get("replacement"):
        rep = ck.recover([fail], step=None)
        assert rep.restored, rep
        dump(model, opt, loader, plan, rank, out("recovered"))
        loader.position = rep.step  # the survivors' data position: the replacement goes on from there
        train(model, opt, loader, 2, rank)
        ck.save(step=loader.position).wait()
        ck.close()
        return 0
    train(model, opt, loader, 4, rank)
    g = ck.save(step=loader.position).wait()
    dump(model, opt, loader, plan, rank, out(f"g{g}"))
    train(model, opt, loader, 3, rank)
    if rank == fail:
        os.kill(os.getpid(), 9)
    try:  # the next collective fails: the peer is gone
        dist.all_reduce(torch.ones(1))
        raise AssertionError("all_reduce succeeded with a dead peer")
    except RuntimeError as exc:
        print(f"rank {rank}: peer failure seen: {type(exc).__name__}", flush=True)
    dump(model, opt, loader, plan, rank, out("live"))
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"file://{cfg['init2']}", rank=rank, world_size=cfg["world"],
                            timeout=timedelta(seconds=60))
    rep = ck.recover([fail], step=loader.position)
    assert not rep.restored and rep.failed_ranks == (fail,) and rep.lost_steps == 3, rep
    print(f"rank {rank}: lost_update_fraction={rep.lost_update_fraction:.4f}", flush=True)
    dump(model, opt, loader, plan, rank, out("recovered"))
    train(model, opt, loader, 2, rank)  # training goes on with the replacement
    g2 = ck.save(step=loader.position).wait()
    assert g2 > g, (g, g2)
    ck.close()
    return 0


if __name__ == "__main__":
    exit_now(main())
