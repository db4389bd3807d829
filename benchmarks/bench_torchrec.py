#!/usr/bin/env python3
"""Save stall and bytes per save of a TorchRec DMP-sharded DLRM: cnrstore against DCP async_save (issue 14).

A DLRM (``torchrec.models.dlrm.DLRM``) whose ``EmbeddingBagCollection`` is sharded by
``DistributedModelParallel`` over ``--world-size`` gloo processes on this machine (CPU: the large tables
row-wise, the small ones table-wise; fused row-wise Adagrad in the TBE kernels, Adagrad on the dense part
through ``KeyedOptimizerWrapper``) trains on synthetic Criteo-shaped batches whose ids are Zipf-distributed
(``--zipf``; hot rows scattered over the table by a fixed permutation, as hashed ids are). Every
``--steps-per-save`` steps the trainer checkpoints. The same training run (same init, same batches, checked:
every step's loss must be equal) is repeated once per method, each in a pass of its own:

  - cnrstore, int4: ``DistributedCheckpointer(root, dmp, dense_opt, codec="int4", mode="incremental",
    optimizer_codec="fp32")`` (``cnrstore.torch.Checkpointer`` on a single store for one rank): a save
    writes the rows looked up since the previous save, weights in int4, the fused optimizer's row-wise
    state in fp32; the trainer stalls for the host snapshot of those rows, the write (and, for several
    ranks, the global commit) runs in a background thread;
  - cnrstore, fp32: the same with ``codec="fp32"`` (lossless weights);
  - DCP async_save: ``torch.distributed.checkpoint.async_save({"model": dmp.state_dict(), "optim":
    CombinedOptimizer([fused, dense]).state_dict()}, storage_writer=FileSystemWriter(new dir),
    process_group=<a gloo group of its own>)``, as TorchRec's examples checkpoint a DMP model.

Per save: the trainer stall (the time the save call blocks the training loop: cnrstore's ``save()``; DCP's
``state_dict()`` calls plus ``async_save`` until it returns its future), measured separately the wait for
the previous save (both block there: cnrstore's ``save()`` waits for the write in flight, and DCP's
documented pattern waits on the previous future before the next ``async_save``), the bytes the save put on
disk (the growth of the files under the method's directory, measured once the save is durable), and the
time until durable (cnrstore: until ``pending.wait()`` returns, the global manifest written; DCP: until its
future completes; both fsync their files). With several ranks a save's stall is the slowest rank's (the
next collective waits for it). After the last save, each method restores its newest version into the
same model whose tables, optimizer state and dense layers were zeroed first (cnrstore ``restore()``;
DCP ``dcp.load`` + ``load_state_dict``), timed, and compared with the trained state.

    python benchmarks/bench_torchrec.py --quick          # smoke run (under a minute)
    python benchmarks/bench_torchrec.py --out FILE --plot benchmarks/torchrec.png
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from common import fmt_bytes, publish  # noqa: E402  (the shared report helpers)

METHODS = ("cnrstore, int4", "cnrstore, fp32", "DCP async_save")
NONE = "no checkpoints"  # a pass of the same training without saves: the reference for the training wall
CODEC = {"cnrstore, int4": "int4", "cnrstore, fp32": "fp32"}
#: table sizes of the full run (rows); --quick takes 1/50 of each (--scale). Criteo-like: a few large tables,
#: a tail of small ones. At dim 64: 1,211,000 rows = 310 MB of fp32 weights.
TABLE_ROWS = (400_000, 300_000, 200_000, 150_000, 100_000, 50_000, 10_000, 1_000)
#: ids per sample of each table (pooling factors)
POOLING = (2, 1, 3, 1, 2, 1, 1, 1)
DENSE_IN = 13
ROW_WISE_MIN = 100_000  # tables at least this large (full run) are sharded row-wise, the others table-wise
GOALS = {"stall": 10.0, "bytes": 20.0}  # DCP / cnrstore, medians (issue 14)


# ---------------------------------------------------------------------------------------------------------
# one rank (a process of its own: python bench_torchrec.py --worker JSON)
# ---------------------------------------------------------------------------------------------------------

class Data:
    """Synthetic Criteo-shaped batches: dense features ~ N(0, 1), per table ``pooling`` Zipf(``s``) ids per
    sample, scattered by a fixed permutation; labels from a fixed random linear rule on the dense part.
    Each rank draws its own local batch of each step from a generator seeded by (seed, step, rank)."""

    def __init__(self, cfg: dict, rank: int):
        import torch

        self.cfg, self.rank = cfg, rank
        self.rows = cfg["rows"]
        self.cdfs, self.perms = [], []
        for i, n in enumerate(self.rows):
            p = 1.0 / np.arange(1, n + 1, dtype=np.float64) ** cfg["zipf"]
            cdf = np.cumsum(p)
            self.cdfs.append(torch.from_numpy(cdf / cdf[-1]))
            self.perms.append(torch.randperm(n, generator=torch.Generator().manual_seed(cfg["seed"] * 100 + i)))
        self.w = torch.randn(DENSE_IN, generator=torch.Generator().manual_seed(cfg["seed"] + 7))

    def batch(self, step: int):
        import torch
        from torchrec import KeyedJaggedTensor

        b = self.cfg["batch_size"] // self.cfg["world"]
        g = torch.Generator().manual_seed((self.cfg["seed"] * 1_000_003 + step) * 64 + self.rank)
        dense = torch.randn(b, DENSE_IN, generator=g)
        values, lengths = [], []
        for cdf, perm, pool in zip(self.cdfs, self.perms, POOLING):
            u = torch.rand(b * pool, generator=g, dtype=torch.float64)
            ranks = torch.searchsorted(cdf, u).clamp_(max=len(perm) - 1)
            values.append(perm[ranks])
            lengths.append(torch.full((b,), pool, dtype=torch.int64))
        labels = (dense @ self.w + torch.randn(b, generator=g) > 0.5).float()
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=[f"f{i}" for i in range(len(self.rows))],
                                                  values=torch.cat(values), lengths=torch.cat(lengths))
        return dense, kjt, labels


def build(cfg: dict, rank: int, world: int):
    """(DMP model, dense optimizer (KeyedOptimizerWrapper), CombinedOptimizer over fused + dense), with the
    same initial state in every pass: tables from generators seeded per shard, dense layers from the seed."""
    import torch
    import torch.distributed as dist
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.distributed.types import ShardingEnv, ShardingType
    from torchrec.models.dlrm import DLRM
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    class Sharder(EmbeddingBagCollectionSharder):
        """TorchRec's planner offers row-wise shards on GPUs only; allow them on CPU."""

        def sharding_types(self, compute_device_type):
            return [ShardingType.ROW_WISE.value, ShardingType.TABLE_WISE.value]

    torch.manual_seed(cfg["seed"])
    dim = cfg["dim"]
    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=dim, num_embeddings=n, feature_names=[f"f{i}"])
              for i, n in enumerate(cfg["rows"])]
    model = DLRM(EmbeddingBagCollection(tables=tables, device=torch.device("meta")), dense_in_features=DENSE_IN,
                 dense_arch_layer_sizes=[64, dim], over_arch_layer_sizes=[64, 32, 1],
                 dense_device=torch.device("cpu"))
    sharder = Sharder(fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05})
    kinds = {t.name: (ShardingType.ROW_WISE.value if world > 1 and t.num_embeddings >= cfg["row_wise_min"]
                      else ShardingType.TABLE_WISE.value) for t in tables}
    constraints = {name: ParameterConstraints(sharding_types=[kind], compute_kernels=["fused"])
                   for name, kind in kinds.items()}
    planner = EmbeddingShardingPlanner(topology=Topology(world_size=world, compute_device="cpu"),
                                       constraints=constraints)
    plan = planner.collective_plan(model, [sharder], dist.GroupMember.WORLD)
    env = ShardingEnv(world, rank, dist.GroupMember.WORLD)
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=[sharder],
                                   init_data_parallel=False, env=env)
    with torch.no_grad():
        for key, value in dmp.state_dict().items():
            if type(value).__name__ == "ShardedTensor":
                bound = value.shape[0] ** -0.5
                for local in value.local_shards():
                    r0, c0 = local.metadata.shard_offsets
                    g = torch.Generator().manual_seed(cfg["seed"] * 7919 + sum(map(ord, key)) * 131 + r0 + c0)
                    local.tensor.uniform_(-bound, bound, generator=g)
    dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(dmp.named_parameters())),
                                  lambda params: torch.optim.Adagrad(params, lr=0.05))
    combined = CombinedOptimizer([("fused", dmp.fused_optimizer), ("dense", dense)])
    return dmp, dense, combined, kinds


def train_step(dmp, dense_opt, data: Data, step: int, world: int) -> float:
    import torch
    import torch.distributed as dist
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    x, kjt, labels = data.batch(step)
    loss = torch.nn.functional.binary_cross_entropy_with_logits(dmp(x, kjt).squeeze(-1), labels)
    dense_opt.zero_grad()
    loss.backward()  # the fused optimizer updates the looked-up rows here
    if world > 1:  # the dense replicas stay equal: average their gradients in one all-reduce
        grads = [p.grad for p in dense_opt.params.values() if p.grad is not None]
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat)
        flat /= world
        for g, f in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.copy_(f)
    dense_opt.step()
    return float(loss.detach())


def tree_bytes(path: str) -> int:
    """Apparent size of every file under ``path`` (the bytes the files hold)."""
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(root, f))
            except FileNotFoundError:
                pass
    return total


def local_state(dmp, combined) -> dict:
    """Views of this rank's trained state: table shards, the fused optimizer's shards, dense parameters."""
    out = {}
    for key, value in dmp.state_dict(keep_vars=True).items():
        if type(value).__name__ == "ShardedTensor":
            for i, local in enumerate(value.local_shards()):
                out[f"{key}#{i}"] = local.tensor
        else:
            out[key] = value
    for key, entries in dmp.fused_optimizer.state_dict()["state"].items():
        for name, value in entries.items():
            if type(value).__name__ == "ShardedTensor":
                for i, local in enumerate(value.local_shards()):
                    out[f"optim/{key}/{name}#{i}"] = local.tensor
    return out


def pass_dir(workdir: str, method: str) -> str:
    return os.path.join(workdir, "".join(ch if ch.isalnum() else "_" for ch in method))


def run_pass(method: str, cfg: dict, rank: int, world: int, workdir: str) -> dict:
    import torch
    import torch.distributed as dist

    dmp, dense_opt, combined, kinds = build(cfg, rank, world)
    data = Data(cfg, rank)
    root = pass_dir(workdir, method)
    if rank == 0:
        os.makedirs(root, exist_ok=True)
    dist.barrier()
    saves: list[dict] = []
    losses: list[float] = []
    step_s: list[float] = []
    ckpt = None
    dcp_group = None
    if method == NONE:
        pass
    elif method in CODEC:
        def open_ckpt(readonly: bool = False):
            """(checkpointer, its store or None): the distributed one on 2+ ranks, else a Checkpointer."""
            if world > 1:
                from cnrstore.distributed import DistributedCheckpointer
                return DistributedCheckpointer(root, dmp, dense_opt, codec=CODEC[method], mode="incremental",
                                               optimizer_codec="fp32"), None
            import cnrstore
            from cnrstore.torch import Checkpointer
            st_ = cnrstore.open(root, create=not readonly, readonly=readonly)
            return Checkpointer(st_, dmp, dense_opt, codec=CODEC[method], mode="incremental",
                                optimizer_codec="fp32"), st_

        ckpt, store = open_ckpt()
    else:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemWriter
        dcp_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=600))
    pending = None  # the previous save: a cnrstore PendingSave or DCP's future
    dist.barrier()
    written_before = tree_bytes(root) if rank == 0 else 0  # what creating the store wrote is no save's

    def settle(prev: dict | None) -> float:
        """Wait for the save in flight (timed: the next save would wait as long), then measure its bytes."""
        nonlocal written_before
        t0 = time.perf_counter()
        if pending is not None:
            pending.wait() if method in CODEC else pending.result()
        waited = time.perf_counter() - t0
        if prev is not None:
            if not prev.get("durable_s"):  # the watcher may be a moment behind the future
                prev["durable_s"] = time.perf_counter() - prev["t_call"]
            if rank == 0:
                now = tree_bytes(root)
                prev["bytes"] = now - written_before
                written_before = now
        return waited

    t_train = time.perf_counter()
    for step in range(cfg["steps"]):
        t0 = time.perf_counter()
        losses.append(train_step(dmp, dense_opt, data, step, world))
        step_s.append(time.perf_counter() - t0)
        if (step + 1) % cfg["steps_per_save"] or method == NONE:
            continue
        rec: dict = {"step": step + 1}
        rec["wait_prev_s"] = settle(saves[-1] if saves else None)
        t0 = time.perf_counter()
        rec["t_call"] = t0
        if ckpt is not None:
            pending = ckpt.save(step + 1)
            rec["stall_s"] = time.perf_counter() - t0
            rec["snapshot_s"] = pending.report.stall_s
            rec["rows"] = {k: int(v) for k, v in pending.report.rows.items()}
            rec["baseline"] = bool(pending.report.baseline)

            def watch(p=pending, r=rec):
                try:
                    p.wait()
                finally:
                    r["durable_s"] = time.perf_counter() - r["t_call"]
            threading.Thread(target=watch, daemon=True).start()
        else:
            d = os.path.join(root, f"step_{step + 1:05d}")
            state = {"model": dmp.state_dict(), "optim": combined.state_dict()}
            rec["state_dict_s"] = time.perf_counter() - t0
            pending = dcp.async_save(state, storage_writer=FileSystemWriter(d), process_group=dcp_group)
            rec["stall_s"] = time.perf_counter() - t0
            pending.add_done_callback(lambda _f, r=rec: r.__setitem__("durable_s", time.perf_counter() - r["t_call"]))
            del state
        saves.append(rec)
    settle(saves[-1] if saves else None)
    train_wall = time.perf_counter() - t_train
    dist.barrier()
    if method == NONE:
        return {"losses": losses, "step_s": step_s, "train_wall_s": train_wall}

    # restore the newest version into the same model, zeroed first; compare with the trained state
    trained = {k: v.detach().clone() for k, v in local_state(dmp, combined).items()}
    with torch.no_grad():
        for v in local_state(dmp, combined).values():
            v.zero_()
    restore: dict = {}
    stats = {}
    if ckpt is not None:
        st = (ckpt.store if world > 1 else store).stats()
        stats = {k: st[k] for k in ("bytes_written", "write_amplification", "max_read_chain", "versions")}
        ckpt.close()
        if world == 1:
            store.close()
        dist.barrier()
        t0 = time.perf_counter()
        ckpt, store = open_ckpt(readonly=True)
        restore["open_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        ckpt.restore()
        restore["restore_s"] = time.perf_counter() - t0
        ckpt.close()
        if world == 1:
            store.close()
    else:
        newest = os.path.join(root, f"step_{saves[-1]['step']:05d}")
        dist.barrier()
        t0 = time.perf_counter()
        state = {"model": dmp.state_dict(), "optim": combined.state_dict()}
        dcp.load(state, checkpoint_id=newest, process_group=dcp_group)
        dmp.load_state_dict(state["model"])
        combined.load_state_dict(state["optim"])
        restore["restore_s"] = time.perf_counter() - t0
        restore["open_s"] = 0.0
    now = local_state(dmp, combined)
    err = {"weights": 0.0, "optim": 0.0, "dense": 0.0}
    for k, v in trained.items():
        kind = "optim" if k.startswith("optim/") else ("weights" if "#" in k else "dense")
        d = float((now[k].detach() - v).abs().max()) if v.numel() else 0.0
        if kind == "optim":
            d /= max(float(v.abs().max()), 1e-30)
        err[kind] = max(err[kind], d)
    restore["error"] = err
    dist.barrier()
    if dcp_group is not None:
        dist.destroy_process_group(dcp_group)
    for r in saves:
        r.pop("t_call", None)
    return {"saves": saves, "stats": stats, "losses": losses, "step_s": step_s, "train_wall_s": train_wall,
            "restore": restore, "kinds": kinds}


def worker(cfg: dict) -> None:
    import torch
    import torch.distributed as dist
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)  # torchrec's planner and torch.fx warn at every model built
    rank, world = cfg["rank"], cfg["world"]
    torch.set_num_threads(cfg["threads"])
    dist.init_process_group("gloo", init_method=f"file://{cfg['init']}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=600))
    out = {}
    # a short pass first, discarded: the process's first steps pay one-time costs (allocations, lazy
    # initialisation) that would otherwise fall on whichever pass came first
    run_pass(NONE, {**cfg, "steps": cfg["steps_per_save"]}, rank, world, cfg["workdir"])
    for method in cfg["methods"]:
        t0 = time.perf_counter()
        out[method] = run_pass(method, cfg, rank, world, cfg["workdir"])
        out[method]["pass_s"] = time.perf_counter() - t0
        if rank == 0:
            print(f"  {method}: pass {out[method]['pass_s']:.1f} s", file=sys.stderr, flush=True)
            shutil.rmtree(pass_dir(cfg["workdir"], method), ignore_errors=True)
        dist.barrier()
    with open(os.path.join(cfg["out"], f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------------
# the launcher: spawn the ranks, assemble their records, report
# ---------------------------------------------------------------------------------------------------------

def launch(args, workdir: str) -> list[dict]:
    out = os.path.join(workdir, "out")
    os.makedirs(out)
    procs = []
    for rank in range(args.world_size):
        cfg = {"rank": rank, "world": args.world_size, "init": os.path.join(workdir, "init"), "out": out,
               "workdir": workdir, "methods": [NONE, *METHODS], "rows": args.rows, "dim": args.dim,
               "zipf": args.zipf, "seed": args.seed, "batch_size": args.batch_size, "steps": args.steps,
               "steps_per_save": args.steps_per_save, "threads": args.threads,
               "row_wise_min": args.row_wise_min}
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", json.dumps(cfg)],
                                      stdout=subprocess.PIPE if rank else None, stderr=subprocess.STDOUT if rank
                                      else None, text=True))
    failed = []
    for rank, p in enumerate(procs):
        try:
            text, _ = p.communicate(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise SystemExit(f"bench_torchrec: rank {rank} ran past {args.timeout:.0f} s")
        if p.returncode:
            failed.append(f"rank {rank} exited with {p.returncode}" + (f":\n{text[-3000:]}" if text else ""))
    if failed:
        raise SystemExit("bench_torchrec: " + "\n".join(failed))
    results = []
    for rank in range(args.world_size):
        with open(os.path.join(out, f"rank{rank}.json")) as f:
            results.append(json.load(f))
    return results


def median(xs) -> float:
    xs = [x for x in xs if x == x]
    return statistics.median(xs) if xs else float("nan")


def fmt_s(s: float) -> str:
    if s != s:
        return "n/a"
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


def summarize(args, results: list[dict]) -> dict:
    """Per method: per-save records (stall, wait, durable: the slowest rank's; bytes: rank 0 measured the
    whole directory), restore, store statistics summed over ranks, training times."""
    s = {}
    for m in (NONE, *METHODS):
        per_rank = [r[m] for r in results]
        s[m] = {
            "train_wall": max(pr["train_wall_s"] for pr in per_rank),
            "pass": max(pr["pass_s"] for pr in per_rank),
            "step_med": median([max(t) for t in zip(*(pr["step_s"] for pr in per_rank))]),
            "losses": per_rank[0]["losses"],
        }
        if m == NONE:
            continue
        saves = []
        for i in range(len(per_rank[0]["saves"])):
            recs = [pr["saves"][i] for pr in per_rank]
            saves.append({
                "step": recs[0]["step"],
                "stall": max(r["stall_s"] for r in recs),
                "wait": max(r["wait_prev_s"] for r in recs),
                "snapshot": max(r.get("snapshot_s", float("nan")) for r in recs),
                "state_dict": max(r.get("state_dict_s", float("nan")) for r in recs),
                "durable": max(r.get("durable_s", float("nan")) for r in recs),
                "bytes": recs[0]["bytes"],
                "baseline": recs[0].get("baseline", False),
                "rows": sum(v for r in recs for k, v in r.get("rows", {}).items() if ".optim." not in k),
            })
        stats = [pr["stats"] for pr in per_rank if pr["stats"]]
        s[m].update({
            "saves": saves,
            "restore": max(pr["restore"]["restore_s"] for pr in per_rank),
            "open": max(pr["restore"]["open_s"] for pr in per_rank),
            "error": {k: max(pr["restore"]["error"][k] for pr in per_rank) for k in ("weights", "optim", "dense")},
            "kinds": per_rank[0]["kinds"],
            "store_written": sum(st["bytes_written"] for st in stats),
            "write_amp": max((st["write_amplification"] or 0.0 for st in stats), default=float("nan")),
            "chain": max((st["max_read_chain"] for st in stats), default=0),
        })
    return s


def report(args, s: dict, load_start: str, elapsed: float) -> tuple[str, dict]:
    from common import load_average, machine_description

    total_rows = sum(args.rows)
    state_bytes = total_rows * (args.dim * 4 + 4)  # fp32 weights + row-wise Adagrad's one fp32 per row
    c4, c32, ref = s["cnrstore, int4"], s["cnrstore, fp32"], s["DCP async_save"]
    touched = [x["rows"] / total_rows for x in c4["saves"] if not x["baseline"]]
    losses_equal = all(s[m]["losses"] == s[NONE]["losses"] for m in METHODS)
    max_loss_diff = max(abs(a - b) for m in METHODS for a, b in zip(s[m]["losses"], s[NONE]["losses"]))
    kinds = c4["kinds"]
    rw = [k for k, v in kinds.items() if v == "row_wise"]
    tw = [k for k, v in kinds.items() if v != "row_wise"]
    row = {}
    for m in METHODS:
        saves = s[m]["saves"]
        row[m] = {"stall": median([x["stall"] for x in saves]), "stall_max": max(x["stall"] for x in saves),
                  "wait": median([x["wait"] for x in saves]), "wait_max": max(x["wait"] for x in saves),
                  "blocked": median([x["stall"] + x["wait"] for x in saves]),
                  "bytes": median([x["bytes"] for x in saves]), "bytes_total": sum(x["bytes"] for x in saves),
                  "durable": median([x["durable"] for x in saves]), "restore": s[m]["restore"]}
    base_wall = s[NONE]["train_wall"]
    lines = [f"- {h}" for h in machine_description()]
    lines += [
        f"- load average (1/5/15 min) at start: {load_start}; at end: {load_average()} (a shared machine: other "
        "processes compete for the 2 cores)",
        f"- model: torchrec DLRM, {len(args.rows)} tables ({', '.join(f'{n:,}' for n in args.rows)} rows = "
        f"{total_rows:,} rows x dim {args.dim}; ids per sample {', '.join(map(str, POOLING))}), dense arch "
        f"{DENSE_IN}-64-{args.dim}, over arch 64-32-1; DistributedModelParallel over **{args.world_size} gloo "
        f"process(es)** on this machine, {args.threads} torch thread(s) each; row-wise: {', '.join(rw) or '-'}; "
        f"table-wise: {', '.join(tw) or '-'}; fused EXACT_ROWWISE_ADAGRAD (TBE), dense Adagrad; full state "
        f"{fmt_bytes(state_bytes)} (fp32 weights + row-wise optimizer state)",
        f"- {args.steps} steps x global batch {args.batch_size}, a save every {args.steps_per_save} steps "
        f"({len(c4['saves'])} saves per method); ids Zipf(s={args.zipf}), scattered over each table; rows "
        f"looked up per save interval (what an incremental save writes): median **{median(touched):.1%}** of all "
        f"rows (min {min(touched, default=float('nan')):.1%}, max {max(touched, default=float('nan')):.1%})",
        f"- cnrstore: {'DistributedCheckpointer' if args.world_size > 1 else 'Checkpointer'}(codec, "
        "mode=\"incremental\", optimizer_codec=\"fp32\"), no compaction; the first save of a pass is a full "
        f"baseline (int4: {fmt_bytes(c4['saves'][0]['bytes'])}, fp32: {fmt_bytes(c32['saves'][0]['bytes'])}); "
        "DCP: async_save of {model: dmp.state_dict(), optim: CombinedOptimizer(fused, dense).state_dict()} "
        "through a new FileSystemWriter per save (defaults: sync_files=True, it fsyncs; staging into new "
        "buffers, as cache_staged_state_dict=True pins memory, which needs an accelerator) on a gloo group of "
        "its own, a new directory per save, every one kept",
        f"- the {len(METHODS) + 1} passes train identically: "
        f"{'every step loss equal' if losses_equal else '**losses DIFFER**'} (max |diff| {max_loss_diff:.3g} over "
        f"{len(s[NONE]['losses'])} steps); training wall of the pass, saves included (median step, slowest "
        "rank, save calls excluded): "
        + "; ".join(f"{m} {s[m]['train_wall']:.1f} s ({fmt_s(s[m]['step_med'])})" for m in (NONE, *METHODS)),
        "",
        "| method | trainer stall / save (median) | stall (max) | wait for the previous save (median; max) | "
        "bytes on disk / save (median) | bytes, all saves | until durable (median) | restore newest | "
        "training wall vs no checkpoints |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for m in METHODS:
        r = row[m]
        lines.append(f"| {m} | {fmt_s(r['stall'])} | {fmt_s(r['stall_max'])} | {fmt_s(r['wait'])}; "
                     f"{fmt_s(r['wait_max'])} | {fmt_bytes(r['bytes'])} | {fmt_bytes(r['bytes_total'])} | "
                     f"{fmt_s(r['durable'])} | {fmt_s(r['restore'])} | "
                     f"{s[m]['train_wall'] / base_wall - 1:+.0%} |")
    lines += ["", "Targets, DCP async_save / cnrstore, medians from this run"
              + (" (--quick: a smoke run at 1/50 of the tables, where fixed per-save costs dominate and an "
                 "interval touches far more of the rows; the full run's verdicts are the ones that count):"
                 if args.quick else ":")]
    for m in CODEC:
        r = row[m]
        st = ref_ratio(row["DCP async_save"]["stall"], r["stall"])
        by = ref_ratio(row["DCP async_save"]["bytes"], r["bytes"])
        bl = ref_ratio(row["DCP async_save"]["blocked"], r["blocked"])
        rs = ref_ratio(row["DCP async_save"]["restore"], r["restore"])
        lines += [
            f"- {m}:",
            f"  - trainer stall per save: **{st:.1f}x** (goal >= {GOALS['stall']:g}x): "
            f"**{'met' if st >= GOALS['stall'] else 'MISSED'}**; counting the wait for the previous save too: "
            f"{bl:.1f}x",
            f"  - bytes on disk per save: **{by:.1f}x** (goal >= {GOALS['bytes']:g}x): "
            f"**{'met' if by >= GOALS['bytes'] else 'MISSED'}**",
            f"  - restore of the newest version: DCP {fmt_s(row['DCP async_save']['restore'])}, this "
            f"{fmt_s(r['restore'])} ({rs:.2f}x; no goal)",
        ]
    mib = lambda xs: ", ".join(f"{x['bytes'] / 2**20:.1f}" for x in xs)  # noqa: E731
    lines += [
        "",
        "- stall: the save call as the training loop sees it, on the slowest rank. cnrstore's own snapshot "
        "(SaveReport.stall_s), median: " + ", ".join(f"{m} {fmt_s(median([x['snapshot'] for x in s[m]['saves']]))}"
                                                    for m in CODEC)
        + f"; the largest stall is the first save's (a baseline: every row). DCP's: dmp.state_dict() + the "
        f"optimizers' state_dict() (median {fmt_s(median([x['state_dict'] for x in ref['saves']]))}), then "
        "async_save until it returns (staging: a copy of the whole state)",
        "- wait: before each save the loop waits for the previous one, timed apart from the stall (0 when it was "
        "durable by then)",
        "- bytes: growth of the files under the method's directory (apparent size: log segments, index and "
        "manifests; DCP: the step directory), measured once the save was durable. Per save, MiB: "
        + "; ".join(f"{m} {mib(s[m]['saves'])}" for m in METHODS),
        "- cnrstore's writer bounds read chains with cumulative deltas (docs/DESIGN.md): "
        + "; ".join(f"{m}: write amplification {s[m]['write_amp']:.2f} (bytes written / the saves' own rows), "
                    f"longest read chain {s[m]['chain']}" for m in CODEC),
        "- restore: the newest version into the same model after zeroing its tables, fused optimizer state and "
        "dense layers (slowest rank; cnrstore's excludes opening the store and building the checkpointer: "
        + ", ".join(f"{m} {fmt_s(s[m]['open'])}" for m in CODEC) + "); max error against the trained state "
        "(weights |diff| / optimizer state, relative / dense |diff|): "
        + "; ".join(f"{m} {s[m]['error']['weights']:.3g} / {s[m]['error']['optim']:.3g} / "
                    f"{s[m]['error']['dense']:.3g}" for m in METHODS),
        f"- whole benchmark {elapsed:.0f} s (passes: "
        + ", ".join(f"{m} {s[m]['pass']:.0f} s" for m in (NONE, *METHODS))
        + f"); reproduce: `.venv/bin/python benchmarks/bench_torchrec.py{' --quick' if args.quick else ''}`",
    ]
    return "\n".join(lines) + "\n", row


def ref_ratio(ref: float, x: float) -> float:
    return ref / x if x > 0 else float("inf")


def plot(s: dict, row: dict, path: str) -> str | None:
    try:
        import matplotlib
    except ImportError:
        return "plot skipped: matplotlib is not installed"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), constrained_layout=True)
    x = np.arange(len(METHODS))
    colors = ["tab:blue", "tab:cyan", "tab:orange"]
    for ax, key, scale, unit, title in ((axes[0], "stall", 1e3, "ms", "trainer stall per save"),
                                        (axes[1], "bytes", 2.0**-20, "MiB", "bytes on disk per save")):
        vals = [row[m][key] * scale for m in METHODS]
        lo = [min(x_[key] for x_ in s[m]["saves"]) * scale for m in METHODS]
        hi = [max(x_[key] for x_ in s[m]["saves"]) * scale for m in METHODS]
        ax.bar(x, vals, color=colors, yerr=[np.subtract(vals, lo), np.subtract(hi, vals)], capsize=4)
        for xi, v in zip(x, vals):
            ax.annotate(f"{v:,.0f}" if v >= 100 else f"{v:.3g}", (xi, v), textcoords="offset points",
                        xytext=(8, 2), fontsize=8)
        ax.set_xticks(x, METHODS)
        ax.set(yscale="log", ylabel=f"{unit} (median; whiskers: min-max over saves)", title=title)
        ax.grid(True, axis="y", which="both", alpha=0.3)
    fig.suptitle("TorchRec DMP model: cnrstore against DCP async_save (same run)")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def main(argv=None) -> int:
    if argv is None and len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker(json.loads(sys.argv[2]))
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke run (under a minute): tables 50x smaller")
    p.add_argument("--world-size", type=int, default=2, help="gloo processes (default 2)")
    p.add_argument("--scale", type=float, default=None,
                   help="table rows = the full run's x this (default 1; --quick 0.02)")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--zipf", type=float, default=1.05, help="Zipf exponent of the ids")
    p.add_argument("--batch-size", type=int, default=None, help="global batch (default 2048; --quick 256)")
    p.add_argument("--steps", type=int, default=None, help="training steps per pass (default 100; --quick 20)")
    p.add_argument("--steps-per-save", type=int, default=None, help="steps between saves (default 10; --quick 4)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tmp", default=None, help="directory for the checkpoints (default: system temp)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds before the ranks are killed")
    p.add_argument("--out", default=None, help="also write the markdown to FILE")
    p.add_argument("--plot", default=None, help="write a PNG (e.g. benchmarks/torchrec.png; 'none': no plot)")
    args = p.parse_args(argv)
    defaults = dict(scale=(0.02, 1.0), batch_size=(256, 2048), steps=(20, 100), steps_per_save=(4, 10))
    for k, (quick, full) in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, quick if args.quick else full)
    if args.world_size < 1 or args.steps < args.steps_per_save or args.steps_per_save < 1:
        p.error("--world-size and --steps-per-save must be positive, --steps at least --steps-per-save")
    args.rows = [max(16, int(n * args.scale)) for n in TABLE_ROWS]
    args.row_wise_min = max(16, int(ROW_WISE_MIN * args.scale))
    import torch
    from common import load_average

    torch.set_num_threads(args.threads)  # so that the header's "torch threads" is the ranks' own setting
    load_start = load_average()
    t0 = time.perf_counter()
    workdir = tempfile.mkdtemp(prefix="bench_torchrec-", dir=args.tmp)
    try:
        results = launch(args, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    s = summarize(args, results)
    md, row = report(args, s, load_start, time.perf_counter() - t0)
    md = "## cnrstore against DCP async_save on a TorchRec DMP model\n\n" + md
    publish(md, args.out, args.plot, lambda path: plot(s, row, path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
