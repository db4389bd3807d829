#!/usr/bin/env python3
"""ECRM's parity update as a share of a training step: an A/B on the same ranks, in the same run.

Every rank of a gloo job (``--world-size`` processes on this machine) builds bench_ecrm's DLRM shard
(tools/dlrm_dist.py: 26 row-wise sharded ``EmbeddingBag`` tables, replicated MLPs, Adagrad) twice, from
the same init: model A trains without ECRM, model B with ``ECRM(k, r)`` around its optimizer step. The
two train alternately, ``--block`` steps at a time (A, B, A, B, ...), so that a change of the machine's
load hits both; a barrier starts every block. Reported per world size:

- the step time of A and of B (median over blocks of the block's mean step), and their difference as a
  share of A's step: what ECRM costs the trainer, waits included;
- ECRM's own accounting (``ECRM.stats``, per step, on the rank that spent most): capture (the undo log),
  encode (the code deltas and messages), exchange (the one round that carries them, with the
  fingerprints; "of which waiting": blocked on its messages), apply (the received deltas XORed into
  the parity), and what of the exchange was left to overlap with the next step's forward;
- whether A and B still hold the same weights (the parity update must not change training).

    python benchmarks/bench_ecrm_step.py --quick          # 2 and 4 ranks, a few seconds each
    python benchmarks/bench_ecrm_step.py --world-size 3 --blocks 8 --block 20
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import timedelta

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tools"))
from common import load_average, machine_description, publish  # noqa: E402

PHASES = ("capture", "encode", "exchange", "apply")


def worker(cfg: dict) -> int:
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415
    import dlrm_dist  # noqa: PLC0415
    import dlrm_model  # noqa: PLC0415
    import train_dlrm  # noqa: PLC0415
    from cnrstore.distributed import ECRM  # noqa: PLC0415

    torch.set_num_threads(1)
    rank, world = cfg["rank"], cfg["world"]
    dist.init_process_group("gloo", init_method=f"file://{cfg['rdzv']}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    args = train_dlrm.parse_args(["--world-size", str(world), "--max-rows", str(cfg["max_rows"]), "--dim",
                                  str(cfg["dim"]), "--batch-size", str(cfg["batch"]), "--no-progress"])
    args.sparse_grads = cfg["sparse_grads"]
    plan = dlrm_dist.make_plan(args, world)
    models = [dlrm_dist.build_sharded(args, plan, rank, 0) for _ in range(2)]
    loaders = [dlrm_model.SyntheticCriteo(args) for _ in range(2)]
    loss_fn = torch.nn.BCEWithLogitsLoss()
    ecrm = ECRM(models[1][0], models[1][1], k=cfg["k"], r=cfg["r"], timeout_s=120)
    times = {0: [], 1: []}
    steps = {0: 0, 1: 0}
    for b in range(2 * (cfg["blocks"] + 1)):
        which = b % 2
        model, opt = models[which]
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(cfg["block"]):
            steps[which] += 1
            dlrm_dist.train_step(model, opt, loss_fn, loaders[which].next(), ecrm if which else None, steps[which])
        if which:
            ecrm.flush()
        dist.barrier()
        if b >= 2:                                   # the first pair warms up
            times[which].append((time.perf_counter() - t0) / cfg["block"])
    same = all(torch.equal(p, q) for p, q in zip(models[0][0].parameters(), models[1][0].parameters()))
    out = {"rank": rank, "a": times[0], "b": times[1], "stats": dict(ecrm.stats), "same": same,
           "parity_bytes": int(ecrm.parity.nbytes), "data_bytes": ecrm.data_words * 4}
    with open(os.path.join(cfg["out"], f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    ecrm.close()
    dist.destroy_process_group()
    return 0


def run(args, world: int, k: int, r: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench_ecrm_step-") as tmp:
        procs = []
        for rank in range(world):
            cfg = {"rank": rank, "world": world, "k": k, "r": r, "rdzv": os.path.join(tmp, "rdzv"), "out": tmp,
                   "blocks": args.blocks, "block": args.block, "max_rows": args.max_rows, "dim": args.dim,
                   "batch": args.batch_size, "sparse_grads": args.sparse_grads}
            env = dict(os.environ, OMP_NUM_THREADS="1")
            procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "worker", json.dumps(cfg)],
                                          env=env))
        for p in procs:
            if p.wait(timeout=args.timeout):
                raise SystemExit(f"bench_ecrm_step: a rank exited with status {p.returncode}")
        ranks = [json.load(open(os.path.join(tmp, f"rank{q}.json"))) for q in range(world)]
    # the block times are the same on every rank (a barrier ends each block): take rank 0's
    a = float(np.median(ranks[0]["a"]))
    b = float(np.median(ranks[0]["b"]))
    worst = max(ranks, key=lambda x: x["stats"]["seconds"] + x["stats"]["seconds_capture"])
    st = worst["stats"]
    n = max(st["steps"], 1)
    cost = {p: st[f"seconds_{p}"] / n for p in PHASES}
    cost["overlapped"] = st["seconds_overlapped"] / n
    cost["wait"] = st.get("seconds_wait", 0.0) / n
    return {"world": world, "k": k, "r": r, "a": a, "b": b, "cost": cost, "same": all(x["same"] for x in ranks),
            "own": sum(cost[p] for p in PHASES), "bytes": st["bytes_sent"] / n,
            "parity_share": max(x["parity_bytes"] / max(x["data_bytes"], 1) for x in ranks)}


def report(args, rows: list[dict], load_start: str, elapsed: float, load_end: str = "unknown") -> str:
    ms = lambda x: f"{x * 1e3:.2f} ms"  # noqa: E731
    lines = [
        f"- machine: {machine_description()}; load average at start {load_start}, at the end {load_end}",
        f"- model: bench_ecrm's DLRM shard (26 tables, --max-rows {args.max_rows:,}, dim {args.dim}, batch "
        f"{args.batch_size}, Adagrad, {'sparse' if args.sparse_grads else 'dense'} embedding gradients), gloo; "
        f"{args.blocks} blocks of {args.block} steps per arm, A and B alternating",
        "",
        "| ranks | k,r | step without ECRM (A) | step with ECRM (B) | B - A, share of A | ECRM's own time | "
        + " | ".join(PHASES) + " | of which waiting | left to overlap | sent per step | A == B bit for bit |",
        "|---|---|---|---|---|---|" + "---|" * len(PHASES) + "---|---|---|---|",
    ]
    for x in rows:
        c = x["cost"]
        lines.append(f"| {x['world']} | {x['k']},{x['r']} | {ms(x['a'])} | {ms(x['b'])} | "
                     f"{ms(x['b'] - x['a'])}, **{(x['b'] - x['a']) / x['a']:.1%}** | {ms(x['own'])} "
                     f"({x['own'] / x['a']:.1%}) | " + " | ".join(ms(c[p]) for p in PHASES)
                     + f" | {ms(c['wait'])} | {ms(c['overlapped'])} | {x['bytes'] / 1e3:.1f} KB | {x['same']} |")
    lines += [""]
    for x in rows:
        c = x["cost"]
        top = max(PHASES, key=lambda p: c[p])
        lines.append(f"- {x['world']} ranks: ECRM's own time is dominated by {top} ({ms(c[top])} of {ms(x['own'])})")
    lines.append(f"- whole benchmark: {elapsed:.0f} s")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "worker":
        return worker(json.loads(argv[1]))
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer, shorter blocks")
    p.add_argument("--world-size", type=int, nargs="+", default=None,
                   help="the world sizes to run, k = world - 1 and r = 1 each (default: 2 and 4)")
    p.add_argument("--blocks", type=int, default=None, help="blocks per arm (default 8; --quick 4)")
    p.add_argument("--block", type=int, default=None, help="steps per block (default 20; --quick 10)")
    p.add_argument("--max-rows", type=int, default=5_000, help="table size cap (bench_ecrm --quick's)")
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--sparse-grads", action="store_true",
                   help="EmbeddingBag(sparse=True): the tables' gradients name their rows (the reference DLRM's "
                        "are dense, read whole by ECRM's gradient scan)")
    p.add_argument("--out", default=None, help="also write the markdown to FILE")
    args = p.parse_args(argv)
    if args.blocks is None:
        args.blocks = 4 if args.quick else 8
    if args.block is None:
        args.block = 10 if args.quick else 20
    load_start = load_average()
    t0 = time.perf_counter()
    worlds = args.world_size or [2, 4]
    rows = [run(args, w, w - 1, 1) for w in worlds]
    publish(report(args, rows, load_start, time.perf_counter() - t0, load_average()), args.out, None, None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
