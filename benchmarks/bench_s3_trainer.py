#!/usr/bin/env python3
"""Does a save wait for the bucket? Issue 49's trainer: stalls of a trainer checkpointing to S3, against the
same trainer checkpointing to a local store, in the same run.

The endpoint is moto's S3 server **in a process of its own** (as a real endpoint is; on localhost). The model
is one ``nn.EmbeddingBag`` of ``--rows`` x ``--dim`` fp32 (sparse gradients, Adagrad: its row-wise ``sum``
state is saved too) and a small MLP under Adam; each step looks up ``--batch`` x 8 uniform ids; a save every
``--every`` steps. Each configuration runs in a process of its own:

- ``local``: ``Checkpointer(cnrstore.open(dir), model, opts)`` (the reference);
- ``s3``: README's "Checkpoints on S3" pattern: ``cnrstore.open(dir, remote="s3://bench/...")`` then the same
  ``Checkpointer``; the uploads run behind the saves (``remote_lag_s``, docs/API.md).
- ``2 ranks, local`` / ``2 ranks, s3``: two processes joined by gloo, each with its row-wise half of the table,
  ``DistributedCheckpointer(node_dir, ...)`` on a root on this machine's disk or in the bucket.

Per configuration: each save's stall (the time ``save()`` takes; the first save is a baseline, whose rows are
streamed), the median and worst, worst / median, and the worst against the local run's worst; the bucket's lag
(``Store.stats()["remote"]["lag_s"]`` sampled after each save; the newest committed version's age when
the bucket lacks it) and the seconds ``close()`` took to make the bucket current.

    .venv/bin/python benchmarks/bench_s3_trainer.py            # 1M x 64, a save every 20 steps, 12 saves
    .venv/bin/python benchmarks/bench_s3_trainer.py --quick    # 128K x 32, 6 saves
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

CONFIGS = ("local", "s3", "2 ranks local", "2 ranks s3")


def _model(rows: int, dim: int):
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.ModuleDict({"emb": nn.EmbeddingBag(rows, dim, mode="sum", sparse=True),
                           "mlp": nn.Sequential(nn.Linear(dim, 64), nn.ReLU(), nn.Linear(64, 1))})
    opts = [torch.optim.Adagrad(model["emb"].parameters(), lr=0.05),
            torch.optim.Adam(model["mlp"].parameters(), lr=0.001)]
    return model, opts


def _train(model, opts, ids):
    import torch

    for o in opts:
        o.zero_grad()
    out = model["mlp"](model["emb"](ids)).squeeze(1)
    loss = torch.nn.functional.binary_cross_entropy_with_logits(out, torch.ones_like(out))
    loss.backward()
    for o in opts:
        o.step()


def child(spec: dict) -> dict:
    """One single-process configuration's run: what it measured."""
    import torch

    import cnrstore
    from cnrstore.torch import Checkpointer

    torch.set_num_threads(1)
    model, opts = _model(spec["rows"], spec["dim"])
    kwargs = {}
    if spec.get("url"):
        kwargs = {"remote": spec["url"], "remote_options": spec["options"]}
    store = cnrstore.open(spec["path"], create=True, **kwargs)
    reports = []
    ck = Checkpointer(store, model, opts, on_report=reports.append)
    rng = np.random.default_rng(0)
    stalls, steps_s = [], []
    for i in range(1, spec["steps"] + 1):
        ids = torch.from_numpy(rng.integers(0, spec["rows"], spec["batch"] * 8)).view(spec["batch"], 8)
        t0 = time.perf_counter()
        _train(model, opts, ids)
        steps_s.append(time.perf_counter() - t0)
        if i % spec["every"] == 0:
            t0 = time.perf_counter()
            ck.save(i)
            stalls.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    ck.close()
    close_s = time.perf_counter() - t0
    written = store.stats()["bytes_written"]
    t0 = time.perf_counter()
    store.close()  # (a store in a bucket: the last copy point)
    close_s += time.perf_counter() - t0
    status = store.engine.replication_status() or {}
    return {"stalls": stalls, "lags": [r.bucket_lag_s for r in reports], "close_s": close_s,
            "step_s": float(np.median(steps_s)), "written": written, "uploaded": status.get("bytes_uploaded"),
            "local_stalls": [r.stall_s for r in reports]}


def rank_child(spec: dict) -> dict:
    """One rank of a 2-rank configuration (spawned with RANK/WORLD_SIZE/MASTER_* set): what it measured."""
    import torch
    import torch.distributed as dist

    from cnrstore.distributed import DistributedCheckpointer, ShardingPlan

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    rows, dim = spec["rows"], spec["dim"]
    plan = ShardingPlan.row_wise({"emb": (rows, dim)}, world)
    shard = plan.shards_of(rank)["emb"]
    lo, hi = shard.row_start, shard.row_end
    model, opts = _model(hi - lo, dim)
    kwargs = {}
    if spec.get("url"):
        kwargs = {"remote": spec["url"], "remote_options": spec["options"]}
    # (a local root is one directory the ranks share; a bucket root's ranks each have a node directory)
    where = os.path.join(spec["path"], f"node-{rank}" if kwargs else "root")
    reports = []
    ck = DistributedCheckpointer(where, model, opts, plan=plan, on_report=reports.append, **kwargs)
    settled = []  # the part of each stall spent on the saves before it (their commits; a bucket past its bound)
    for name in ("_settle", "_settle_behind"):
        real = getattr(ck, name)

        def timed(*a, _real=real, **k):
            t = time.perf_counter()
            try:
                return _real(*a, **k)
            finally:
                settled.append(time.perf_counter() - t)

        setattr(ck, name, timed)
    rng = np.random.default_rng(rank)
    stalls, waits = [], []
    for i in range(1, spec["steps"] + 1):
        ids = torch.from_numpy(rng.integers(0, hi - lo, spec["batch"] * 8)).view(spec["batch"], 8)
        _train(model, opts, ids)
        if i % spec["every"] == 0:
            t0 = time.perf_counter()
            settled.clear()
            ck.save(i)
            stalls.append(time.perf_counter() - t0)
            waits.append(sum(settled))
    t0 = time.perf_counter()
    ck.close()
    close_s = time.perf_counter() - t0
    dist.destroy_process_group()
    status = ck.store.engine.replication_status() or {}
    return {"stalls": stalls, "lags": [r.bucket_lag_s for r in reports], "close_s": close_s, "waits": waits,
            "uploaded": status.get("bytes_uploaded")}


def run_config(config: str, args, root: str, endpoint) -> dict:
    from common import free_port

    path = os.path.join(root, config.replace(" ", "_").replace(",", ""))
    os.makedirs(path, exist_ok=True)
    spec = {"rows": args.rows, "dim": args.dim, "batch": args.batch, "every": args.every,
            "steps": args.every * args.saves, "path": path}
    if config.endswith("s3"):
        spec["url"] = f"s3://bench/{config.replace(' ', '_').replace(',', '')}-{int(time.time() * 1e3)}"
        spec["options"] = endpoint.options
    if not config.startswith("2 ranks"):
        out = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True)
        if out.returncode:
            raise RuntimeError(f"{config}: {out.stderr[-3000:]}")
        result = json.loads(out.stdout.strip().splitlines()[-1])
    else:
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2")
        procs = [subprocess.Popen([sys.executable, __file__, "--rank-child", json.dumps(spec)],
                                  env=dict(env, RANK=str(r)), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True) for r in range(2)]
        outs = [p.communicate() for p in procs]
        failed = [f"rank {r}: {err[-2000:]}" for r, (p, (_o, err)) in enumerate(zip(procs, outs)) if p.returncode]
        if failed:
            raise RuntimeError(f"{config}: " + "\n".join(failed))
        ranks = [json.loads(o.strip().splitlines()[-1]) for o, _e in outs]
        result = {"stalls": [max(s) for s in zip(*(r["stalls"] for r in ranks))],
                  "lags": [max((x for x in lag if x is not None), default=None) for lag in zip(*(r["lags"] for r in ranks))],
                  "close_s": max(r["close_s"] for r in ranks),
                  "waits": [max(w) for w in zip(*(r["waits"] for r in ranks))],
                  "uploaded": sum(r["uploaded"] or 0 for r in ranks)}
    shutil.rmtree(path, ignore_errors=True)
    return result


def report(rounds: list[dict], args) -> str:
    """``rounds``: one {configuration: result} per round (the configurations interleaved within a round)."""
    from common import load_average, machine_description

    lines = [f"## {args.title}", "",
             f"One `nn.EmbeddingBag` of {args.rows:,} x {args.dim} fp32 (sparse, Adagrad) and a small MLP (Adam); "
             f"{args.batch} x 8 uniform ids a step, a save every {args.every} steps, {args.saves} saves (the first "
             "a baseline), each configuration in a process of its own (2 ranks: two, joined by gloo); "
             f"{len(rounds)} round(s), the configurations interleaved in each. S3 is moto's server in a process of "
             "its own on localhost. Stall: the time `save()` takes (2 ranks: the slower rank's, per save); "
             "worst / local's worst pairs each run with the local run of its round. Bucket lag: "
             "`SaveReport.bucket_lag_s` at each save (2 ranks: the larger of the two). Close: until the bucket holds the last "
             "save.", ""]
    lines += machine_description() + [f"- load average at the end: {load_average()}", ""]
    lines += ["| configuration | round | stalls (ms) | median | worst | worst / median | worst / local's worst | "
              "bucket lag p100 (s) | uploaded / written | close (s) |", "|---|---|---|---|---|---|---|---|---|---|"]
    summary = {}
    for i, results in enumerate(rounds, 1):
        for config, r in results.items():
            s = np.array(r["stalls"]) * 1e3
            local = results.get("2 ranks local" if config.startswith("2 ranks") else "local")
            ref = max(local["stalls"]) * 1e3 if local else float("nan")
            lags = [x for x in r["lags"] if x is not None]
            amp = f"{r['uploaded'] / r['written']:.2f}x" if r.get("uploaded") and r.get("written") else "-"
            lines.append(f"| {config} | {i} | {', '.join(f'{x:.0f}' for x in s)} | {np.median(s):.1f} | "
                         f"{s.max():.1f} | {s.max() / np.median(s):.2f}x | {s.max() / ref:.2f}x | "
                         f"{f'{max(lags):.2f}' if lags else '-'} | {amp} | {r['close_s']:.2f} |")
            summary.setdefault(config, []).append((s.max() / np.median(s), s.max() / ref))
    lines += ["", "| configuration | worst / median, median of rounds (goal <= 2x) | worst / local's worst, median "
              "of rounds (goal <= 1.5x) |", "|---|---|---|"]
    for config, ratios in summary.items():
        lines.append(f"| {config} | {np.median([a for a, _ in ratios]):.2f}x ({', '.join(f'{a:.2f}' for a, _ in ratios)}) "
                     f"| {np.median([b for _, b in ratios]):.2f}x ({', '.join(f'{b:.2f}' for _, b in ratios)}) |")
    lines.append("")
    for config in (c for c in summary if c.endswith("s3")):
        tail = np.median([a for a, _ in summary[config]])
        vs_local = np.median([b for _, b in summary[config]])
        lines.append(f"- {config}: worst stall {tail:.2f}x its median (goal <= 2x): "
                     f"**{'met' if tail <= 2 else 'missed'}**; {vs_local:.2f}x the local run's worst (goal <= 1.5x): "
                     f"**{'met' if vs_local <= 1.5 else 'missed'}**")
    for config in (c for c in summary if c.endswith("s3")):
        lags = [max(x for x in r["lags"] if x is not None) for results in rounds for c, r in results.items()
                if c == config and any(x is not None for x in r["lags"])]
        if lags:
            lines.append(f"- {config}: the bucket's lag at a save, at most {max(lags):.1f} s (bound: remote_lag_s=600 s):"
                         f" **{'met' if max(lags) <= 600 else 'missed'}**")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=1 << 20)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--every", type=int, default=20)
    ap.add_argument("--saves", type=int, default=12)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--server-nice", type=int, default=0, help="moto's niceness (0: as the trainer)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--title", default="A trainer checkpointing to S3 (issue 49)")
    ap.add_argument("--out")
    ap.add_argument("--child")
    ap.add_argument("--rank-child")
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return 0
    if args.rank_child:
        print(json.dumps(rank_child(json.loads(args.rank_child))))
        return 0
    if args.quick:
        args.rows, args.dim, args.saves = 1 << 17, 32, 6
    from common import MotoEndpoint

    endpoint = MotoEndpoint(nice=args.server_nice)
    root = tempfile.mkdtemp(prefix="bench-s3-trainer-")
    rounds = []
    try:
        for _ in range(args.rounds):
            results: dict = {}
            rounds.append(results)
            for config in args.configs.split(","):
                t0 = time.perf_counter()
                r = results[config] = run_config(config, args, root, endpoint)
                print(f"{config}: stalls {[round(x * 1e3) for x in r['stalls']]} ms (of which waiting for earlier "
                      f"saves {[round(x * 1e3) for x in r.get('waits', [])]}), written {r.get('written')}, "
                      f"uploaded {r.get('uploaded')}, close {r['close_s']:.2f} s ({time.perf_counter() - t0:.0f} s)",
                      file=sys.stderr)
    finally:
        endpoint.stop()
        shutil.rmtree(root, ignore_errors=True)
    md = report(rounds, args)
    print(md)
    if args.out:
        with open(args.out, "w") as f:
            f.write(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
