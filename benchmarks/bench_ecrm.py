#!/usr/bin/env python3
"""Full recovery against CPR partial recovery against ECRM, with real failures, side by side in one run.

Three jobs of ``tools/train_dlrm.py --world-size N`` (the reference DLRM sharded over N gloo processes,
tools/dlrm_dist.py) train the same steps on the same data from the same init, under the same failure
schedule: a rank killed with SIGKILL every ``--mtbf-steps`` steps (bench_cpr.py's MTBF, as a fixed
period), round-robin from rank 1, after that step's update; the launcher spawns a replacement process. The
modes differ only in how the job recovers:

- ``full``: every rank restores the newest global version and the steps since are re-computed;
- ``partial`` (CPR): the replacement restores its shards from the newest global version; survivors keep
  their state; the failed shard's updates since the checkpoint are lost;
- ``ecrm``: the replacement decodes its shards and optimizer state from the parity the others hold
  (``--parity K,R``); nothing is lost, no checkpoint is read. It also checkpoints (the fallback).

Every job checkpoints every ``--ckpt-every`` steps. The ECRM job also trains the same run without failures
or checkpoints (``--compare``): its wall time is the training time every overhead is a fraction of, its
held-out logloss/AUC the quality reference, and its weights are compared bit for bit.

Reported per mode: normal-operation overhead (checkpoint stall; ECRM adds the parity update of every
step), recovery overhead (from the kill to every rank training again, plus re-computed steps), the
replaced rank's own recovery call (its shard restore or decode, after its process start-up), the rest of
a recovery (detection, process start-up, rendezvous), lost updates, final logloss/AUC, extra memory.

    python benchmarks/bench_ecrm.py --quick                 # about a minute
    python benchmarks/bench_ecrm.py --out FILE --plot benchmarks/ecrm.png
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tools"))
from common import load_average, machine_description, publish  # noqa: E402
import dlrm_dist  # noqa: E402
import train_dlrm  # noqa: E402

MODES = ("full", "partial", "ecrm")
#: ECRM.stats' parts of a step's parity update (seconds_<part>).
PARTS = ("capture", "encode", "exchange", "apply")
#: ECRM (Kosaian et al.), abstract: up to 88% less training-time overhead than checkpointing, up to 10.3x
#: faster recovery.
PAPER = "up to 88% lower overhead, up to 10.3x faster recovery"


def job(args, mode: str) -> dict:
    """Run one training job; returns its summary (dlrm_dist.summarize) plus per-role recovery times."""
    argv = ["--world-size", str(args.world_size), "--steps", str(args.steps), "--max-rows", str(args.max_rows),
            "--batch-size", str(args.batch_size), "--ckpt-every", str(args.ckpt_every), "--fail-every",
            str(args.mtbf_steps), "--recovery", mode, "--holdout-batches", str(args.holdout_batches),
            "--no-progress", "--dim", str(args.dim), "--seed", str(args.seed), "--job-timeout", str(args.job_timeout),
            "--pg-timeout", str(args.pg_timeout), "--codec", args.codec, "--mode", args.mode]
    if mode == "ecrm":
        argv += ["--parity", args.parity, "--compare"]
    else:
        argv += ["--no-compare"]
    targs = train_dlrm.parse_args(argv)
    problem = dlrm_dist.check_args(targs)
    if problem:
        raise SystemExit(f"bench_ecrm: {problem}")
    tmp = tempfile.mkdtemp(prefix=f"bench_ecrm-{mode}-", dir=args.tmp)
    try:
        targs.store_root = os.path.join(tmp, "root")
        t0 = time.perf_counter()
        rc, problems = dlrm_dist.supervise(targs, tmp)
        wall = time.perf_counter() - t0
        if rc:
            raise SystemExit(f"bench_ecrm: the {mode} job failed: {problems}")
        events = dlrm_dist.read_events(tmp, args.world_size)
        plan = dlrm_dist.make_plan(targs, args.world_size)
        s = dlrm_dist.summarize(targs, events, plan)
        recs = [e for evs in events.values() for e in evs if e["kind"] == "recovered"]
        s["replacement_call_s"] = [e["recover_s"] for e in recs if e["role"] == "replacement"]
        s["replacement_phases"] = [e["phases"] for e in recs if e["role"] == "replacement" and e.get("phases")]
        s["job_wall"] = wall
        return s
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def row_of(args, mode: str, s: dict, base_wall: float) -> dict:
    stall = max(s["stall_per_rank"]) if s["stall_per_rank"] else 0.0
    parity = 0.0
    mem = 0.0
    cost = {}
    if s["ecrm"]:
        # per step, on the rank with the most parity work per step (a replacement counts from its start)
        e0 = max(s["ecrm"], key=lambda e: (e["stats"]["seconds"] + e["stats"]["seconds_capture"])
                 / max(e["stats"]["steps"], 1))
        steps = max(e0["stats"]["steps"], 1)
        parity = (e0["stats"]["seconds"] + e0["stats"]["seconds_capture"]) / steps * args.steps
        cost = {k: e0["stats"][f"seconds_{k}"] / steps for k in PARTS}
        cost["bytes"] = e0["stats"]["bytes_sent"] / steps
        mem = max(e["parity_bytes"] / max(e["data_bytes"], 1) for e in s["ecrm"])
    rec = sum(f["recovery_s"] for f in s["failures"])
    redo = sum(f["replayed_s"] for f in s["failures"])
    if mode == "partial":
        lost = sum(f["row_share"] * (f["lost_steps"] or 0) for f in s["failures"]) / args.steps
    else:
        lost = 0.0
    return {"mode": mode, "stall": stall, "parity": parity, "normal": (stall + parity) / base_wall,
            "recovery": rec, "redo": redo, "recovery_frac": (rec + redo) / base_wall,
            "total": (stall + parity + rec + redo) / base_wall, "per_failure": rec / max(len(s["failures"]), 1),
            "call": float(np.median(s["replacement_call_s"])) if s["replacement_call_s"] else float("nan"),
            "other": (rec - sum(s["replacement_call_s"])) / max(len(s["failures"]), 1),
            "failures": len(s["failures"]), "lost": lost, "final": s["final"]["result"] if s["final"] else None,
            "mem": mem, "cost": cost, "redo_steps": sum(f["replayed_steps"] for f in s["failures"]),
            "phases": {k: float(np.median([p[k] for p in s.get("replacement_phases", []) if k in p]))
                       for k in (s.get("replacement_phases") or [{}])[0]},
            "recovery_phases": {k: [f[k] for f in s["failures"]] for k in PHASES},
            "how": sorted({h for f in s["failures"] for h in f["how"]})}


#: A recovery's phases (tools/dlrm_dist.recovery_phases), reported with their spread over the failures.
PHASES = {"kill_to_training_s": "kill to training", "detect_s": "detect", "startup_s": "replacement start-up",
          "imports_s": "of which imports", "rendezvous_s": "rendezvous", "restore_s": "restore / decode",
          "resume_s": "first step"}


def spread(values) -> str:
    """min / median / max of ``values`` in seconds."""
    v = [x for x in values if x == x]
    if not v:
        return "n/a"
    return f"{min(v):.2f} / {float(np.median(v)):.2f} / {max(v):.2f}"


def report(args, rows: dict, base: dict, load_start: str, elapsed: float) -> str:
    ms = lambda x: f"{x * 1e3:.1f} ms"  # noqa: E731
    pct = lambda x: f"{x:.1%}"  # noqa: E731
    e, f = rows["ecrm"], rows["full"]
    step_s = base["wall_s"] / args.steps
    per_step = e["parity"] / args.steps
    lines = [
        f"- machine: {machine_description()}; load average at start {load_start}",
        f"- model: tools/train_dlrm.py's DLRM on {args.world_size} gloo ranks, row-wise shards, --max-rows "
        f"{args.max_rows:,}, dim {args.dim}, batch {args.batch_size}, {args.steps} steps; checkpoint every "
        f"{args.ckpt_every} steps ({args.codec}, {args.mode}); a rank SIGKILLed every {args.mtbf_steps} steps "
        f"({f['failures']} failures); ECRM parity {args.parity} (k,r)",
        f"- the run without failures or checkpoints: {base['wall_s']:.1f} s ({ms(step_s)} per step); held-out "
        f"logloss {base['result'][0]:.5f}, AUC {base['result'][1]:.5f}",
        "",
        "| mode | normal-op overhead | recovery overhead | total | per failure: kill to training | "
        "replaced rank's call | rest (detect, start-up, rendezvous) | redone steps | lost updates | "
        "final logloss / AUC | extra memory |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m in MODES:
        r = rows[m]
        ll = f"{r['final'][0]:.5f} / {r['final'][1]:.5f}" if r["final"] else "n/a"
        lost = "0 (decoded)" if m == "ecrm" else ("0 (re-computed)" if m == "full" else pct(r["lost"]))
        mem = f"parity {r['mem']:.0%} of a shard + undo log" if m == "ecrm" else "-"
        lines.append(f"| {m} | {pct(r['normal'])} | {pct(r['recovery_frac'])} | {pct(r['total'])} | "
                     f"{r['per_failure']:.2f} s | {ms(r['call'])} | {r['other']:.2f} s | {r['redo_steps']} | "
                     f"{lost} | {ll} | {mem} |")
    lines += ["", f"Recovery by phase, seconds, min / median / max over each mode's {f['failures']} failures (the PG "
              f"timeout is {args.pg_timeout:g} s: a recovery that waited on it would show):", "",
              "| mode | " + " | ".join(PHASES.values()) + " | kill to training less start-up | survivors learned by |",
              "|---|" + "---|" * (len(PHASES) + 2)]
    for m in MODES:
        ph = rows[m]["recovery_phases"]
        less = [k - u for k, u in zip(ph["kill_to_training_s"], ph["startup_s"])]
        lines.append(f"| {m} | " + " | ".join(spread(ph[k]) for k in PHASES) + f" | {spread(less)} | "
                     f"{', '.join(rows[m]['how'])} |")
    c = e["cost"]
    dominant = max(PARTS, key=lambda k: c.get(k, 0))
    speed = f["call"] / e["call"] if e["call"] > 0 else float("nan")
    lines += [
        "",
        f"- ECRM recovery call of the replaced rank vs the full-recovery restore of the same rank: "
        f"{ms(e['call'])} vs {ms(f['call'])}: **{speed:.1f}x** faster (goal >= 5x: {'met' if speed >= 5 else 'MISSED'}); "
        "the ECRM call by phase (median over failures): "
        + ", ".join(f"{k} {ms(v)}" for k, v in e["phases"].items()),
        f"- total overhead: ECRM {pct(e['total'])}, partial {pct(rows['partial']['total'])}, full {pct(f['total'])} "
        f"(goal: ECRM below both: {'met' if e['total'] < min(f['total'], rows['partial']['total']) else 'MISSED'})",
        f"- parity update per step: {ms(per_step)} = **{per_step / step_s:.0%}** of a no-failure step "
        f"(goal < 10%: {'met' if per_step / step_s < 0.1 else 'MISSED'}); the slowest rank per step: capture "
        f"{ms(c.get('capture', 0))}, encode {ms(c.get('encode', 0))}, message round {ms(c.get('exchange', 0))}, "
        f"apply {ms(c.get('apply', 0))}; dominated by {dominant}; "
        f"{c.get('bytes', 0) / 1e3:.0f} KB sent per step",
        f"- ECRM's final weights vs the run without failures: max |diff| = {base['max_weight_diff']:g} "
        "(bit-exact recovery: 0)",
        f"- paper (ECRM abstract): {PAPER}",
        f"- whole benchmark: {elapsed:.0f} s",
    ]
    return "\n".join(lines) + "\n"


def plot(rows: dict, path: str) -> str | None:
    try:
        import matplotlib  # noqa: PLC0415
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        return "plot skipped: matplotlib is not installed"
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    x = np.arange(len(MODES))
    normal = [rows[m]["normal"] * 100 for m in MODES]
    rec = [rows[m]["recovery_frac"] * 100 for m in MODES]
    ax.bar(x, normal, label="normal operation (stall, parity)")
    ax.bar(x, rec, bottom=normal, label="recovery (+ re-computed steps)")
    ax.set_xticks(x, MODES)
    ax.set_ylabel("% of training time")
    ax.set_title("Overhead by recovery mode (same failures)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a small smoke run (about a minute)")
    p.add_argument("--world-size", type=int, default=3)
    p.add_argument("--parity", default="2,1", help="ECRM's K,R")
    p.add_argument("--steps", type=int, default=None, help="training steps (default 240; --quick 120)")
    p.add_argument("--mtbf-steps", type=int, default=None, help="steps between failures (default 60; --quick 50)")
    p.add_argument("--ckpt-every", type=int, default=20)
    p.add_argument("--max-rows", type=int, default=None, help="table size cap (default 20000; --quick 5000)")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--codec", default="fp32",
                   help="the checkpoints' embedding codec (one: a multi-rank job takes one; default lossless fp32)")
    p.add_argument("--mode", default="incremental", help="the checkpoints' mode")
    p.add_argument("--holdout-batches", type=int, default=2)
    p.add_argument("--tmp", default=None)
    p.add_argument("--job-timeout", type=float, default=900.0)
    p.add_argument("--pg-timeout", type=float, default=3600.0,
                   help="the process groups' timeout; far beyond a recovery, so that waiting on it would show")
    p.add_argument("--out", default=None, help="also write the markdown to FILE")
    p.add_argument("--plot", default=None, help="write a PNG (e.g. benchmarks/ecrm.png; 'none': no plot)")
    args = p.parse_args(argv)
    for k, (quick, full) in dict(steps=(120, 240), mtbf_steps=(50, 60), max_rows=(5_000, 20_000)).items():
        if getattr(args, k) is None:
            setattr(args, k, quick if args.quick else full)
    load_start = load_average()
    t0 = time.perf_counter()
    summaries = {}
    for mode in MODES:
        print(f"  {mode} ...", file=sys.stderr, flush=True)
        summaries[mode] = job(args, mode)
    base = summaries["ecrm"]["compare"]
    rows = {m: row_of(args, m, summaries[m], base["wall_s"]) for m in MODES}
    md = report(args, rows, base, load_start, time.perf_counter() - t0)
    publish(md, args.out, args.plot, lambda path: plot(rows, path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
