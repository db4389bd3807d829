#!/usr/bin/env python3
"""Full against partial recovery (CPR: plain, MFU, SSU) under a simulated failure schedule, on the reference
DLRM sharded over ``--world-size`` gloo processes (tools/dlrm_dist.py's model and training step).

One job of ``--world-size`` processes runs everything, in this order:

1. the reference: ``--steps`` steps without checkpoints or failures (its held-out logloss/AUC is the
   quality reference, its wall time the training time every overhead is a fraction of);
2. calibration: the trainer's stall per regular save (``DistributedCheckpointer.save`` returning; each
   save waited for before the next), the full restore (every rank ``restore()``s the newest global
   version) and the partial recovery (``recover([r])``: rank r restores its shards), medians of
   ``--calib`` each, the slowest rank's time;
3. the checkpoint interval of each mode from ``cnrstore.policy.CheckpointInterval`` fed those costs and the
   MTBF (``--mtbf-steps`` times the reference's median step time): Young/Daly (Daly's rule) for full
   recovery, CPR's rule ``τ = 2 · PLS · MTBF · N`` (``--pls-target``, N = world size) for partial;
4. the same training under one failure schedule for every mode: ``steps / --mtbf-steps`` failures at
   uniformly drawn steps (a Poisson process given its count; seeded), after that step's update and
   before its checkpoint, victims round-robin.
   Failures are *soft*: no process dies. Full recovery: every rank restores the newest global version and
   the steps since are re-computed. Partial recovery: every rank calls ``recover([victim])``; the victim
   restores its shards, the others keep their state and training goes on. MFU / SSU add priority saves
   (``save(top=--priority-top)``, ``--priority-splits`` - 1 of them evenly between two regular saves).
   Every mode starts with a checkpoint at step 0.

Per mode: the time lost to checkpoints (the slowest rank's summed stall), to recoveries and to re-computed
steps, each as a fraction of the reference's training time, and the measured wall-clock overhead
(``wall / reference wall - 1``; it also holds what the fractions miss, such as background writes
competing with training for the cores), all medians over ``--repeats``; the overhead CheckpointInterval's
first-order model expects at the interval used; the lost-update estimate; held-out logloss/AUC.
Soft failures leave out what a real failure also costs (a process start-up and a rendezvous:
``tools/train_dlrm.py --world-size 2`` measures those with real SIGKILLs).

    python benchmarks/bench_cpr.py --quick                  # < 40 s
    python benchmarks/bench_cpr.py --out FILE --plot benchmarks/cpr.png
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
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tools"))
from common import load_average, machine_description, median, publish  # noqa: E402
import dlrm_dist  # noqa: E402
import dlrm_model  # noqa: E402

from cnrstore.distributed import DistributedCheckpointer  # noqa: E402
from cnrstore.policy.interval import CheckpointInterval  # noqa: E402

MODES = ("full", "partial", "partial+MFU", "partial+SSU")
#: The parts the wall overhead is split into (fractions of the reference's training time); "other" is the
#: measured wall overhead minus the others.
PARTS = ("stall", "recovery", "replay", "slower", "final_wait", "other")
PART_LABELS = {"stall": "checkpoint stall", "recovery": "recovery", "replay": "re-computed steps",
               "slower": "slower training steps", "final_wait": "wait for the last save", "other": "other / unaccounted"}
PRIORITY = {"partial+MFU": "mfu", "partial+SSU": "ssu"}
#: CPR (Maeng et al., MLSys 2021), abstract: checkpoint-related overhead on Criteo, full -> partial recovery.
CPR_FULL, CPR_PARTIAL = "8.2-8.5%", "0.53-0.68%"


# --------------------------------------------------------------------------------------------- worker


def failure_schedule(steps: int, mtbf_steps: float, world: int, seed: int) -> list[tuple[int, int]]:
    """(step, victim rank) of each failure, victims round-robin from rank 1: a Poisson process of mean
    interval ``mtbf_steps`` conditioned on its expected count ``round(steps / mtbf_steps)`` (at least 1),
    i.e. that many distinct steps drawn uniformly from [1, steps) (seeded). Conditioning keeps a short run
    from drawing far more or fewer failures than the MTBF says; the random positions keep failures from
    lining up with the checkpoint interval."""
    count = min(steps - 1, max(1, round(steps / mtbf_steps)))
    picks = np.random.default_rng([seed, 31]).choice(np.arange(1, steps), size=count, replace=False)
    return [(int(s), (i + 1) % world) for i, s in enumerate(sorted(picks))]


class BenchWorker:
    def __init__(self, cfg: dict):
        self.cfg = cfg
        self.args = argparse.Namespace(**cfg["args"])
        self.rank = cfg["rank"]
        self.world = self.args.world_size
        self.tmp = cfg["tmp"]
        self.plan = dlrm_dist.make_plan(self.args, self.world)
        self.loss_fn = nn.BCEWithLogitsLoss()

    def fresh(self):
        model = dlrm_dist.ShardedDLRM(self.args, self.plan, self.rank, self.args.seed)
        return model, dlrm_model.build_optimizer(model, self.args.lr), dlrm_model.SyntheticCriteo(self.args)

    def slowest(self, *values: float) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()

    def checkpointer(self, root, model, opt, loader, priority=None) -> DistributedCheckpointer:
        a = self.args
        kwargs = {} if priority != "ssu" else {"ssu_rate": a.ssu_rate}
        return DistributedCheckpointer(os.path.join(self.tmp, root), model, opt, plan=self.plan, codec=a.codec,
                                       mode=a.mode, extra={"loader": loader}, priority=priority,
                                       timeout_s=dlrm_dist.PG_TIMEOUT_S, **kwargs)

    def log(self, text: str) -> None:
        if self.rank == 0 and not self.args.quiet:
            print(text, file=sys.stderr, flush=True)

    # -- one training run -----------------------------------------------------------------------------
    def run(self, mode: str, tag: str, interval: int = 0, schedule=(), priority_every: int = 0) -> dict:
        a = self.args
        model, opt, loader = self.fresh()
        priority = PRIORITY.get(mode)
        ck = None if mode == "reference" else self.checkpointer(f"root-{tag}", model, opt, loader, priority)
        share = {r: self.plan.rows_of(r) / self.plan.total_rows() for r in range(self.world)}
        stall = recovery = replay = 0.0
        saves = priority_saves = 0
        step_times: list[float] = []
        recoveries: list[dict] = []
        lost_est = lost_bound = 0.0
        last_regular = 0
        pending = None
        failures = list(schedule)

        def save(step, top=None):
            nonlocal stall, pending
            t0 = time.perf_counter()
            pending = ck.save(step, meta={"priority": top is not None}, top=top)
            stall += time.perf_counter() - t0

        dist.barrier()
        t_start = time.perf_counter()
        if ck is not None:
            save(0)
            saves += 1
        step = high = 0
        while step < a.steps:
            t0 = time.perf_counter()
            dlrm_dist.train_step(model, opt, self.loss_fn, loader.next())
            step += 1
            dt = time.perf_counter() - t0
            if step <= high:
                replay += dt
            else:
                step_times.append(dt)
            high = max(high, step)
            if failures and failures[0][0] == step:
                _s, victim = failures.pop(0)
                t0 = time.perf_counter()
                if mode == "full":
                    gv = ck.restore()
                    rec = {"step": step, "victim": victim, "checkpoint_step": gv.step, "lost_steps": step - gv.step}
                    step = int(gv.step)
                    assert loader.position == step, (loader.position, step)
                else:
                    rep = ck.recover([victim], step=step)
                    rec = {"step": step, "victim": victim, "checkpoint_step": rep.checkpoint_step,
                           "lost_steps": rep.lost_steps}
                    lost_est += share[victim] * rep.lost_steps
                    lost_bound += share[victim] * (step - last_regular)
                recovery += time.perf_counter() - t0
                recoveries.append(rec)
                continue
            if ck is None:
                continue
            if step % interval == 0:
                save(step)
                saves += 1
                last_regular = step
            elif priority and step % priority_every == 0:
                save(step, top=a.priority_top)
                priority_saves += 1
        t_wait = time.perf_counter()
        if pending is not None:
            pending.wait()
        final_wait = time.perf_counter() - t_wait
        dist.barrier()
        wall = time.perf_counter() - t_start
        if ck is not None:
            ck.close()
        ll, auc = dlrm_dist.evaluate(model, self.holdout)
        train = float(np.sum(step_times))  # first-time steps only (re-computed ones are in replay)
        wall, stall, recovery, replay, train, final_wait = self.slowest(wall, stall, recovery, replay, train,
                                                                        final_wait)
        shutil.rmtree(os.path.join(self.tmp, f"root-{tag}"), ignore_errors=True) if self.rank == 0 else None
        return {"mode": mode, "wall": wall, "stall": stall, "recovery": recovery, "replay": replay,
                "train": train, "final_wait": final_wait,
                "saves": saves, "priority_saves": priority_saves, "recoveries": recoveries,
                "step_s": float(np.median(step_times)), "logloss": ll, "auc": auc,
                "lost_est": lost_est / a.steps, "lost_bound": lost_bound / a.steps}

    # -- calibration ----------------------------------------------------------------------------------
    def calibrate(self) -> dict:
        a = self.args
        model, opt, loader = self.fresh()
        ck = self.checkpointer("root-calib", model, opt, loader)
        step = 0
        stalls, durable, full, partial = [], [], [], []
        for i in range(a.calib + 1):
            for _ in range(max(1, a.mtbf_steps // 10)):
                dlrm_dist.train_step(model, opt, self.loss_fn, loader.next())
                step += 1
            dist.barrier()
            t0 = time.perf_counter()
            pending = ck.save(step)
            t1 = time.perf_counter()
            pending.wait()
            t2 = time.perf_counter()
            s, d = self.slowest(t1 - t0, t2 - t0)
            if i > 0:             # the first save is the baseline: later ones are what a run repeats
                stalls.append(s)
                durable.append(d)
        for i in range(a.calib):
            dist.barrier()
            t0 = time.perf_counter()
            ck.restore()
            full.append(self.slowest(time.perf_counter() - t0)[0])
            dist.barrier()
            t0 = time.perf_counter()
            ck.recover([i % self.world], step=step)
            partial.append(self.slowest(time.perf_counter() - t0)[0])
        ck.close()
        if self.rank == 0:
            shutil.rmtree(os.path.join(self.tmp, "root-calib"), ignore_errors=True)
        return {"stall": stalls, "durable": durable, "restore_full": full, "recover_partial": partial}

    # -- everything -----------------------------------------------------------------------------------
    def main(self) -> int:
        a = self.args
        torch.set_num_threads(max(a.threads, 1))
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(self.tmp, 'rdzv')}", rank=self.rank,
                                world_size=self.world, timeout=timedelta(seconds=dlrm_dist.PG_TIMEOUT_S))
        t0 = time.perf_counter()
        self.holdout = dlrm_model.Holdout(a, a.holdout_batches)
        setup_s = time.perf_counter() - t0
        runs: list[dict] = []
        self.log("  reference run (no checkpoints, no failures) ...")
        runs.append(self.run("reference", "ref0"))
        step_s = runs[0]["step_s"]
        self.log("  calibrating save and restore costs ...")
        cal = self.calibrate()
        mtbf_s = a.mtbf_steps * step_s
        delta, r_full, r_part = median(cal["stall"]), median(cal["restore_full"]), median(cal["recover_partial"])
        policies = {
            "full": CheckpointInterval(mtbf_s, delta, r_full, recovery="full"),
            "partial": CheckpointInterval(mtbf_s, delta, r_part, recovery="partial", shards=self.world,
                                          max_lost_fraction=a.pls_target),
        }
        intervals = {m: min(a.steps, policies[m].interval_steps(step_s)) for m in policies}
        prio_every = max(1, intervals["partial"] // a.priority_splits)
        schedule = failure_schedule(a.steps, a.mtbf_steps, self.world, a.seed)
        self.log(f"  intervals: full {intervals['full']} steps, partial {intervals['partial']} steps; failures at "
                 f"{[s for s, _ in schedule]}")
        for rep in range(a.repeats):
            if rep:
                runs.append(self.run("reference", f"ref{rep}"))
            for mode in MODES:
                self.log(f"  repeat {rep + 1}/{a.repeats}: {mode} ...")
                iv = intervals["full" if mode == "full" else "partial"]
                runs.append(self.run(mode, f"{mode}{rep}".replace("+", "_"), iv, schedule, prio_every))
        if self.rank == 0:
            expected = {m: policies["full" if m == "full" else "partial"].expected_overhead(
                intervals["full" if m == "full" else "partial"] * step_s).as_dict() for m in MODES}
            out = {"runs": runs, "calibration": cal, "mtbf_s": mtbf_s, "step_s": step_s, "intervals": intervals,
                   "interval_s": {m: p.interval_s() for m, p in policies.items()}, "priority_every": prio_every,
                   "schedule": schedule, "expected": expected, "setup_s": setup_s,
                   "rows_per_rank": [self.plan.rows_of(r) for r in range(self.world)],
                   "total_rows": self.plan.total_rows(), "threads": torch.get_num_threads()}
            with open(self.cfg["result"], "w") as f:
                json.dump(out, f)
        dist.barrier()
        dist.destroy_process_group()
        return 0


# ------------------------------------------------------------------------------------------- launcher


def run_job(args) -> dict:
    """Spawn the ranks, wait, return rank 0's results."""
    tmp = tempfile.mkdtemp(prefix="bench_cpr-", dir=args.tmp)
    try:
        result = os.path.join(tmp, "result.json")
        env = dict(os.environ, OMP_NUM_THREADS=str(max(args.threads, 1)))
        procs = []
        for r in range(args.world_size):
            cfg = {"args": vars(args), "rank": r, "tmp": tmp, "result": result}
            procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", json.dumps(cfg)],
                                          env=env))
        deadline = time.monotonic() + args.job_timeout
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                        p.wait()
                raise SystemExit(f"bench_cpr: a rank failed or the job exceeded {args.job_timeout:.0f} s "
                                 f"(exit statuses {[p.poll() for p in procs]})")
            time.sleep(0.05)
        with open(result) as f:
            return json.load(f)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def pct(x: float) -> str:
    return f"{100 * x:.2f}%" if x == x else "n/a"


def report(args, res: dict, load_start: str) -> tuple[str, dict]:
    runs = res["runs"]
    ref_runs = [r for r in runs if r["mode"] == "reference"]
    ref_wall = median([r["wall"] for r in ref_runs])
    ref = ref_runs[0]
    ref_train = median([r["train"] for r in ref_runs])
    table = {}
    for m in MODES:
        rs = [r for r in runs if r["mode"] == m]
        per = {
            "stall": [r["stall"] / ref_wall for r in rs],
            "recovery": [r["recovery"] / ref_wall for r in rs],
            "replay": [r["replay"] / ref_wall for r in rs],
            # the same steps, trained beside the checkpointer (tracking hooks, background writes competing
            # for the cores) against the reference's steps
            "slower": [(r["train"] - ref_train) / ref_wall for r in rs],
            "final_wait": [r["final_wait"] / ref_wall for r in rs],
            "wall": [r["wall"] / ref_wall - 1 for r in rs],
        }
        per["sum"] = [a + b + c for a, b, c in zip(per["stall"], per["recovery"], per["replay"])]
        per["other"] = [w - sum(per[k][i] for k in PARTS[:-1]) for i, w in enumerate(per["wall"])]
        table[m] = {k: median(v) for k, v in per.items()}
        table[m]["spread"] = {k: (min(v), max(v)) for k, v in per.items()}
        # the stacked parts add up to the median wall overhead: 'other' is what the measured parts miss
        table[m]["other"] = table[m]["wall"] - sum(table[m][k] for k in PARTS[:-1])
        table[m]["run"] = rs[0]
        table[m]["logloss"] = [r["logloss"] for r in rs]
        table[m]["auc"] = [r["auc"] for r in rs]
    ref_ll = [r["logloss"] for r in ref_runs]
    cal = res["calibration"]
    iv = res["intervals"]
    card = dlrm_model.cardinalities(args)
    lines = ["## CPR: full against partial recovery (plain, MFU, SSU)", ""]
    lines += [f"- {h}" for h in machine_description()]
    lines += [
        f"- load average (1/5/15 min) at start: {load_start}; at end: {load_average()}",
        f"- job: {args.world_size} gloo processes on this machine, {args.sharding}-wise sharding "
        f"({', '.join(f'{n:,}' for n in res['rows_per_rank'])} rows per rank), the reference DLRM of "
        f"tools/train_dlrm.py ({sum(card):,} rows x dim {args.dim}, --max-rows {args.max_rows:,}), "
        f"{args.steps} steps x batch {args.batch_size}, Adagrad; checkpoints in {args.codec}, mode {args.mode}; "
        f"{res['threads']} torch thread(s) per rank",
        f"- reference run: {ref_wall:.2f} s of training (median of {len(ref_runs)}), median step "
        f"{1e3 * res['step_s']:.1f} ms; held-out logloss {ref['logloss']:.5f}, AUC {ref['auc']:.5f}",
        f"- failure schedule: MTBF {args.mtbf_steps} steps (= {res['mtbf_s']:.2f} s at the median step), "
        f"Poisson arrivals conditioned on their expected count (seed {args.seed}): {len(res['schedule'])} "
        f"failure(s), at steps "
        f"{', '.join(f'{s} (rank {v})' for s, v in res['schedule']) or 'none'}; soft failures (no process killed)",
        f"- measured costs (slowest rank, medians of {args.calib}): save stall {1e3 * median(cal['stall']):.1f} ms "
        f"(until durable {1e3 * median(cal['durable']):.0f} ms), full restore "
        f"{1e3 * median(cal['restore_full']):.0f} ms, "
        f"partial recover() {1e3 * median(cal['recover_partial']):.0f} ms",
        f"- intervals from CheckpointInterval: full recovery (Daly) {res['interval_s']['full']:.3f} s = "
        f"{iv['full']} steps; partial recovery (CPR's rule, PLS target {args.pls_target:g}, {args.world_size} shards) "
        f"{res['interval_s']['partial']:.3f} s = {iv['partial']} steps; MFU/SSU: a priority save of the top "
        f"{args.priority_top:g} of each table's rows every {res['priority_every']} steps between regular saves"
        + (f" (SSU rate {args.ssu_rate:g})" if args.ssu_rate else ""),
        f"- fractions are of the reference's training time; each cell: median of {args.repeats} repeat(s) "
        "([min, max] over the repeats in brackets); every repeat runs its own reference and every mode on the "
        "same failure schedule", "",
        "| mode | interval (steps) | saves (priority) | ckpt stall | recovery | re-computed | sum of the three "
        "| slower training steps | wait for the last save | other / unaccounted | wall overhead, measured "
        "| expected (model) | lost updates, est. (bound) | logloss (Δ vs no failures) | AUC |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def cell(t, k):
        lo, hi = t["spread"][k]
        return f"{pct(t[k])} [{pct(lo)}, {pct(hi)}]" if len(t["logloss"]) > 1 else pct(t[k])

    def span(vals, ref_vals=None, fmt="{:.5f}"):
        med = median(vals)
        txt = fmt.format(med)
        if ref_vals is not None:
            txt += f" ({median(vals) - median(ref_vals):+.5f})"
        if len(vals) > 1 and max(vals) != min(vals):
            txt += f" [{fmt.format(min(vals))}, {fmt.format(max(vals))}]"
        return txt

    for m in MODES:
        t, r, e = table[m], table[m]["run"], res["expected"][m]
        lost = "0 (re-computed)" if m == "full" else f"{pct(r['lost_est'])} ({pct(r['lost_bound'])})"
        lines.append(
            f"| {m} | {iv['full' if m == 'full' else 'partial']} | {r['saves']} ({r['priority_saves']}) | "
            + " | ".join(cell(t, k) for k in ("stall", "recovery", "replay", "sum", "slower", "final_wait")) + " | "
            f"{pct(t['other'])} [{pct(t['spread']['other'][0])}, {pct(t['spread']['other'][1])}] | {cell(t, 'wall')} | "
            f"{pct(e['total'])} | {lost} | {span(t['logloss'], ref_ll)} | {span(t['auc'])} |")
    full, part = table["full"], table["partial"]
    best = min(MODES[1:], key=lambda m: table[m]["sum"])
    lines += [
        "",
        "- columns: ckpt stall = the slowest rank's summed `save()` time; recovery = `restore()` (full) or "
        "`recover()` (partial) of every failure; re-computed = steps trained again after a full restore; sum = "
        "the three; slower training steps = the run's first-time steps' summed time minus the reference's (the "
        "same steps, trained beside the checkpointer: its tracking hooks and its background writes competing "
        "with the 2 ranks for the cores); wait for the last save = `pending.wait()` after the last step; "
        "wall overhead = run wall / reference wall - 1; other / unaccounted = the median wall overhead minus the "
        "medians of the five parts (the bracket: the same residual per repeat): time between the timed calls "
        "(the loop's bookkeeping, priority-save checks, barriers) and the error of taking each part at its "
        "slowest rank; negative where the parts, each taken at its slowest rank, overlap; expected = CheckpointInterval.expected_overhead at the interval used; lost updates = the "
        "failed shard's row share x steps since the checkpoint it restored, / steps (bound: since the last "
        "regular save, which is what a row no priority save wrote lost)",
        f"- CPR reports {CPR_FULL} -> {CPR_PARTIAL} checkpoint-related overhead (Criteo, MTBF of hours, "
        f"production-size tables). Here: full {pct(full['sum'])} -> partial {pct(part['sum'])} "
        f"(wall: {pct(full['wall'])} -> {pct(part['wall'])}); best partial variant {best} "
        f"{pct(table[best]['sum'])}; full / partial = "
        + (f"{full['sum'] / part['sum']:.1f}x" if part["sum"] > 0 else "n/a")
        + f"; Δ logloss vs no failures: full {median(full['logloss']) - median(ref_ll):+.5f}, partial "
        f"{median(part['logloss']) - median(ref_ll):+.5f}. Logloss and AUC are medians over the repeats "
        "(brackets where they differ; the training is seeded, so repeats usually agree): every restore of "
        f"{args.codec} rows moves the trajectory, so compare Δs against the full-recovery row, which loses no "
        "update yet differs from the no-failure run too.",
        "- at this scale a failure arrives every few seconds and a restore costs a sizeable part of an MTBF, so "
        "absolute overheads are far above CPR's; the comparison between modes on the same schedule is the point. "
        "Soft failures leave out process start-up and re-forming the group (a few seconds with real SIGKILLs: "
        "`tools/train_dlrm.py --world-size 2`).",
    ]
    return "\n".join(lines) + "\n", table


def plot(table: dict, res: dict, path: str) -> str | None:
    try:
        import matplotlib  # noqa: PLC0415
    except ImportError:
        return "plot skipped: matplotlib is not installed"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    colors = {"stall": "tab:blue", "recovery": "tab:orange", "replay": "tab:green", "slower": "tab:red",
              "final_wait": "tab:purple", "other": "0.75"}
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.2), gridspec_kw=dict(width_ratios=[1.5, 1]))
    xs = np.arange(len(MODES))
    width = 0.6
    ax = axes[0]
    pos = np.zeros(len(MODES))
    neg = np.zeros(len(MODES))
    n_rep = len(table[MODES[0]]["logloss"])
    for j, key in enumerate(PARTS):
        vals = np.array([100 * table[m][key] for m in MODES])
        base = np.where(vals >= 0, pos, neg)
        ax.bar(xs, vals, width, bottom=base, color=colors[key], label=PART_LABELS[key],
               hatch="//" if key == "other" else None, edgecolor="white" if key != "other" else "0.4", lw=0.5)
        if n_rep > 1 and key != "other":  # the part's min-max over the repeats, at its place in the stack
            lo = np.array([100 * table[m]["spread"][key][0] for m in MODES])
            hi = np.array([100 * table[m]["spread"][key][1] for m in MODES])
            xj = xs - width / 2 + width * (j + 0.5) / len(PARTS)
            ax.errorbar(xj, base + vals, yerr=[vals - lo, hi - vals], fmt="none", ecolor="black", capsize=2, lw=0.8)
        pos = np.where(vals >= 0, pos + vals, pos)
        neg = np.where(vals < 0, neg + vals, neg)
    wall = np.array([100 * table[m]["wall"] for m in MODES])
    lo = np.array([100 * table[m]["spread"]["wall"][0] for m in MODES])
    hi = np.array([100 * table[m]["spread"]["wall"][1] for m in MODES])
    ax.errorbar(xs + width / 2 + 0.08, wall, yerr=[wall - lo, hi - wall], fmt="D", color="black", ms=5,
                capsize=4, label="wall overhead, measured\n(median, min-max)")
    ax.axhline(0, color="k", lw=0.8)
    ax.set_xticks(xs, MODES)
    ax.set_xlim(-0.6, len(MODES) - 0.3)
    ax.set_ylabel("% of the reference's training time")
    ax.set_title(f"wall overhead and its parts (median of {n_rep} repeats;\nwhiskers: min-max over repeats)")
    ax.set_ylim(min(0, float(neg.min()) * 1.2), max(float(hi.max()), float(pos.max())) * 1.08)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)

    ax = axes[1]
    ref_ll = median([r["logloss"] for r in res["runs"] if r["mode"] == "reference"])
    d = np.array([median(table[m]["logloss"]) - ref_ll for m in MODES])
    dlo = np.array([min(table[m]["logloss"]) - ref_ll for m in MODES])
    dhi = np.array([max(table[m]["logloss"]) - ref_ll for m in MODES])
    ax.bar(xs, d, 0.6, color="tab:purple", yerr=[d - dlo, dhi - d], capsize=4)
    ax.axhline(0, color="k", lw=0.8)
    ax.set_xticks(xs, MODES)
    ax.set_ylabel("held-out logloss - no-failure run")
    ax.set_title(f"model quality (median of {n_rep}, min-max)")
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout(w_pad=2.0)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a small smoke run (< 40 s)")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--sharding", choices=("row", "table"), default="row")
    p.add_argument("--steps", type=int, default=None, help="training steps per run (default 250; --quick 150)")
    p.add_argument("--mtbf-steps", type=int, default=None, help="mean steps between failures (default 60; --quick 50)")
    p.add_argument("--max-rows", type=int, default=None, help="table size cap (default 20000; --quick 2000)")
    p.add_argument("--batch-size", type=int, default=None, help="samples per step (default 256; --quick 128)")
    p.add_argument("--repeats", type=int, default=None, help="repeats of every run (default 3; --quick 1)")
    p.add_argument("--calib", type=int, default=3, help="calibration saves and restores (medians)")
    p.add_argument("--pls-target", type=float, default=0.05,
                   help="partial recovery's target portion of lost samples (CPR's rule)")
    p.add_argument("--priority-top", type=float, default=0.05, help="fraction of rows a priority save writes")
    p.add_argument("--priority-splits", type=int, default=4, help="priority saves split a regular interval in N")
    p.add_argument("--ssu-rate", type=float, default=0.125, help="SSU's sampling rate")
    p.add_argument("--codec", default="int4")
    p.add_argument("--mode", default="intermittent")
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--holdout-batches", type=int, default=None, help="held-out batches of 4096 (default 4; --quick 2)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--tmp", default=None)
    p.add_argument("--job-timeout", type=float, default=900.0)
    p.add_argument("--out", default=None, help="also write the markdown to FILE")
    p.add_argument("--plot", default=None, help="write a PNG (e.g. benchmarks/cpr.png; 'none': no plot)")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return BenchWorker(json.loads(args.worker)).main()
    defaults = dict(steps=(150, 250), mtbf_steps=(50, 60), max_rows=(2_000, 20_000), batch_size=(128, 256),
                    repeats=(1, 3), holdout_batches=(2, 4))
    for k, (quick, full) in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, quick if args.quick else full)
    if args.world_size < 2:
        p.error("--world-size must be >= 2 (partial recovery needs a survivor)")
    if min(args.steps, args.mtbf_steps, args.repeats, args.calib, args.priority_splits) < 1:
        p.error("--steps, --mtbf-steps, --repeats, --calib and --priority-splits must be positive")
    if not 0 < args.pls_target < 1 or not 0 < args.priority_top <= 1:
        p.error("--pls-target must be in (0, 1) and --priority-top in (0, 1]")
    load_start = load_average()
    t0 = time.perf_counter()
    res = run_job(args)
    md, table = report(args, res, load_start)
    md += f"- whole benchmark: {time.perf_counter() - t0:.0f} s\n"
    publish(md, args.out, args.plot, lambda path: plot(table, res, path))
    return 0


if __name__ == "__main__":
    rc = main()
    if "--worker" in sys.argv:
        dlrm_dist.exit_now(rc)
    sys.exit(rc)
