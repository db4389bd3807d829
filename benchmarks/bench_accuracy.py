#!/usr/bin/env python3
"""Accuracy of quantized checkpoints against the paper's bit-width table (Check-N-Run, quantization).

Trains the reference DLRM of ``tools/train_dlrm.py`` (its model, synthetic Criteo-shaped data, held-out
set and training loop, imported) once without failures, then once per (codec, restore count) with
failures injected so that exactly that many restores happen over the run. Each restore loads the newest
checkpoint, whose embedding rows went through the codec (uniform ``int2/3/4/8`` or ``adaptive2/3/4``);
the optimizer state and the dense layers are lossless. Quantization error therefore enters the model only
through restores, and compounds with each one (a restored model trains on from quantized rows, and the
first save after a restore writes a new, again quantized, baseline).

Reports the final held-out logloss / AUC of every run against the run without failures (same seed) as a
relative logloss degradation in % ((with - without) / without * 100) and an AUC delta, a markdown table,
the verdict on the paper's table (1 restore -> 2-bit, <= 3 -> 3-bit, <= 20 -> 4-bit, for < 0.01% logloss
degradation), and a plot of degradation against restores per bit width (uniform solid, adaptive dashed).

Noise: every run is deterministic given the seed (batch k is a pure function of (seed, k), failures replay
the lost steps on the same batches, and an ``fp32`` control run with the most restores is included: it must
match the no-failure run exactly). So there is no run-to-run training noise; the differences are caused
by the quantized restores alone. But one seed gives *one* sample of how a perturbation of the embeddings
propagates through the rest of training: a small perturbation can land on either side of the baseline, so
single cells near 0.01% are not a statistically robust ranking of codecs. An ``fp16`` control (a ~1e-3
relative perturbation per restore) measures that sensitivity floor of the run.

    python benchmarks/bench_accuracy.py            # full: 7 codecs x {1, 3, 10, 20} restores (+ baseline)
    python benchmarks/bench_accuracy.py --quick    # 2 codecs x {1, 3} restores, fewer steps
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tools"))

import torch  # noqa: E402

import train_dlrm as td  # noqa: E402
from bench_engine import load_average, machine_description  # noqa: E402

import cnrstore  # noqa: E402

UNIFORM = ("int2", "int3", "int4", "int8")
ADAPTIVE = ("adaptive2", "adaptive3", "adaptive4")
RESTORES = (1, 3, 10, 20)
#: The paper's table: (most restores, bits) and the degradation it promises to stay under.
PAPER_TABLE = ((1, 2), (3, 3), (20, 4))
THRESHOLD_PCT = 0.01


def bits_of(codec: str) -> int:
    return int(codec.lstrip("intadaptivefp"))


def paper_bits(restores: int) -> int:
    for most, bits in PAPER_TABLE:
        if restores <= most:
            return bits
    return 8


def fail_every_for(steps: int, restores: int, ckpt_every: int) -> int:
    """A failure period K > ckpt_every giving exactly ``restores`` failures in ``steps`` steps.

    The trainer fails after step s when s % K == 0 and s < steps: (steps - 1) // K failures. The largest K
    with that count spreads the restores evenly over the run.
    """
    k = (steps - 1) // restores
    if k <= ckpt_every or (steps - 1) // k != restores:
        raise ValueError(f"{steps} steps cannot hold {restores} restores with checkpoints every {ckpt_every}")
    return k


def make_args(ns, codec: str, fail_every: int, tmp: str) -> argparse.Namespace:
    args = td.parse_args(["--steps", str(ns.steps), "--max-rows", str(ns.max_rows), "--ckpt-every",
                          str(ns.ckpt_every), "--fail-every", str(fail_every), "--codec", codec,
                          "--mode", ns.mode, "--seed", str(ns.seed), "--batch-size", str(ns.batch_size),
                          "--holdout-batches", str(ns.holdout_batches), "--no-progress"])
    args.probe_dir = tmp
    return args


def run_one(ns, holdout, codec: str | None, restores: int, tmp: str, Checkpointer):
    """(final logloss, AUC, failures, wall seconds, model) of one run; codec None is the baseline."""
    if codec is None:
        args = make_args(ns, "fp32", 0, tmp)
        res = td.train(args, holdout, label="no failures", checkpoint=False, fail_every=0,
                       backend_name="cnrstore", Checkpointer=None, store_root=None)
    else:
        k = fail_every_for(ns.steps, restores, ns.ckpt_every)
        args = make_args(ns, codec, k, tmp)
        root = os.path.join(tmp, f"store-{codec}-{restores}")
        res = td.train(args, holdout, label=f"{codec} x{restores}", checkpoint=True, fail_every=k,
                       backend_name="cnrstore", Checkpointer=Checkpointer, store_root=root)
        shutil.rmtree(root, ignore_errors=True)
        if res.failures != restores:
            raise RuntimeError(f"{codec}: expected {restores} restores, the run had {res.failures}")
    return res.final[0], res.final[1], res.failures, res.wall_s, res.model


def degradation(ll: float, base_ll: float) -> float:
    return (ll - base_ll) / base_ll * 100.0


def render(ns, codecs, restores, results, base, control, floor, header, elapsed) -> str:
    base_ll, base_auc = base
    lines = ["# Quantized checkpoints vs. the paper's bit-width table", ""]
    lines += [f"- {h}" for h in header]
    lines.append(f"- load average at start: {ns.load_start}; at end: {load_average()}")
    card = td.cardinalities(ns)
    lines.append(f"- DLRM: 26 EmbeddingBags, {sum(card):,} rows x dim 16; {ns.steps} steps x batch "
                 f"{ns.batch_size}; checkpoint every {ns.ckpt_every} steps; mode {ns.mode}; seed {ns.seed}; "
                 f"held-out {ns.holdout_batches * 4096} samples; optimizer (Adagrad) state lossless")
    lines.append("- failure period per restore count: " + ", ".join(
        f"{r} -> every {fail_every_for(ns.steps, r, ns.ckpt_every)} steps" for r in restores))
    lines.append(f"- baseline (no failures): logloss {base_ll:.6f}, AUC {base_auc:.6f}")
    if control is not None:
        c_ll, c_auc, c_r, c_diff = control
        lines.append(f"- lossless control (fp32, {c_r} restores): logloss {c_ll:.6f}, AUC {c_auc:.6f}, "
                     f"max |weight diff| vs baseline {c_diff:.3g} (determinism check: must be 0)")
    if floor is not None:
        f_ll, f_auc, f_r, f_diff = floor
        lines.append(f"- near-lossless control (fp16, {f_r} restores): logloss {f_ll:.6f} "
                     f"({degradation(f_ll, base_ll):+.4f}%), AUC delta {f_auc - base_auc:+.5f}, max |weight diff| "
                     f"vs baseline {f_diff:.3g}: how far a tiny (~1e-3 relative) perturbation at each restore "
                     f"moves this short run; degradations near it are the training's sensitivity, not the codec's")
    lines.append(f"- total time {elapsed:.0f} s")
    lines += ["", "Cells: logloss degradation % ((with - without) / without * 100) / AUC delta (with - without). "
              "**Bold**: the paper's pick for that many restores (uniform and adaptive).", ""]
    lines.append("| codec | " + " | ".join(f"{r} restore{'s' if r > 1 else ''}" for r in restores) + " |")
    lines.append("|---|" + "---|" * len(restores))
    for c in codecs:
        cells = []
        for r in restores:
            ll, a = results[(c, r)][:2]
            cell = f"{degradation(ll, base_ll):+.4f}% / {a - base_auc:+.5f}"
            if bits_of(c) == paper_bits(r):
                cell = f"**{cell}**"
            cells.append(cell)
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    lines += ["", "## Verdict on the paper's table (logloss degradation < 0.01%)", ""]
    ok_all = True
    checked = 0
    floor_pct = degradation(floor[0], base_ll) if floor is not None else float("nan")
    for r in restores:
        b = paper_bits(r)
        for c in codecs:
            if bits_of(c) != b or b == 8:
                continue
            checked += 1
            d = degradation(results[(c, r)][0], base_ll)
            ok = d < THRESHOLD_PCT
            ok_all &= ok
            note = ""
            if not ok and floor is not None and r == floor[2] and d <= abs(floor_pct):
                note = f" (but within the fp16 control's {floor_pct:+.4f}% at {r} restores)"
            lines.append(f"- {r} restore(s) -> {b}-bit: {c} {d:+.4f}% -> {'holds' if ok else 'FAILS'}{note}")
    if checked:
        lines.append("")
        lines.append(("The paper's table **holds** on this workload: every pick stays under 0.01% logloss "
                      "degradation." if ok_all else
                      "The paper's table **does not hold** on this workload: at least one pick exceeds 0.01% "
                      "logloss degradation (numbers above)."))
    lines += ["", "What drives the differences: every run is deterministic given the seed (same batches, "
              "lost steps replayed on the same data; the fp32 control with restores reproduces the "
              "no-failure weights), so there is no run-to-run training noise here; all differences come "
              "from the quantized embedding rows the restores load. But training amplifies any perturbation "
              "(the fp16 control above shows how much a tiny one moves the final logloss), and one seed gives "
              "one sample of how it propagates: signs and sizes of cells near 0.01% (and of the high-bit "
              "codecs) are not a robust ranking of nearby codecs; the low-bit cells, far above the floor, "
              "are the codec's effect. The workload is also short and small (a few hundred steps, "
              "synthetic Criteo-shaped data), far from the paper's production-scale runs, where each row "
              "keeps training for much longer after a restore."]
    return "\n".join(lines) + "\n"


def plot(path: str, codecs, restores, results, base_ll: float, floor=None) -> str | None:
    try:
        import matplotlib  # noqa: PLC0415
        matplotlib.use("Agg")
        import matplotlib.ticker  # noqa: PLC0415
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib); no plot written"
    colors = {2: "tab:red", 3: "tab:orange", 4: "tab:green", 8: "tab:blue"}
    fig, ax = plt.subplots(figsize=(9.5, 5), dpi=120)
    for c in codecs:
        ys = [degradation(results[(c, r)][0], base_ll) for r in restores]
        ax.plot(restores, ys, marker="o", color=colors.get(bits_of(c), "black"),
                linestyle="--" if c.startswith("adaptive") else "-", label=c)
    if floor is not None:
        ax.plot([floor[2]], [degradation(floor[0], base_ll)], marker="x", color="gray", linestyle="none",
                markersize=9, label=f"fp16 control ({floor[2]} restores)")
    ax.axhline(THRESHOLD_PCT, color="gray", linestyle=":", linewidth=1, label="0.01% (paper's bound)")
    ax.axhline(0.0, color="black", linewidth=0.5)
    ax.set_xscale("log")
    ax.set_xticks(list(restores))
    ax.set_xticklabels([str(r) for r in restores])
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.set_yscale("symlog", linthresh=THRESHOLD_PCT)
    ax.set_xlabel("restores over the run")
    ax.set_ylabel("held-out logloss degradation vs. no failures (%)")
    ax.set_title("DLRM logloss degradation by restores and bit width\n(uniform solid, adaptive dashed)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # outside: no point hidden
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return None


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="2 codecs x {1, 3} restores, fewer steps (< ~90 s)")
    p.add_argument("--steps", type=int, default=None, help="training steps per run (default 601; --quick 121)")
    p.add_argument("--max-rows", type=int, default=None, help="table row cap (default 10000; --quick 5000)")
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--ckpt-every", type=int, default=None, help="checkpoint period (default 10; --quick 10)")
    p.add_argument("--holdout-batches", type=int, default=None, help="held-out batches of 4096 (default 4; quick 2)")
    p.add_argument("--mode", default="intermittent", choices=("incremental", "intermittent"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--codecs", default=None, help="comma-separated codecs (default all 7; --quick int2,adaptive2)")
    p.add_argument("--restores", default=None, help="comma-separated restore counts (default 1,3,10,20; quick 1,3)")
    p.add_argument("--no-control", action="store_true",
                   help="skip the fp32 (determinism) and fp16 (perturbation floor) control runs")
    p.add_argument("--out", default=None, help="also write the markdown report to this file")
    p.add_argument("--png", default=os.path.join(HERE, "accuracy.png"), help="plot path ('' for none)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ns = p.parse_args(argv)
    full = dict(steps=601, max_rows=10_000, ckpt_every=10, holdout_batches=4,
                codecs=",".join(UNIFORM + ADAPTIVE), restores="1,3,10,20")
    quick = dict(steps=121, max_rows=5_000, ckpt_every=10, holdout_batches=2,
                 codecs="int2,adaptive2", restores="1,3")
    for k, v in (quick if ns.quick else full).items():
        if getattr(ns, k) is None:
            setattr(ns, k, v)
    ns.codecs = [c.strip() for c in ns.codecs.split(",") if c.strip()]
    ns.restores = sorted({int(r) for r in ns.restores.split(",")})
    for c in ns.codecs:
        if c not in cnrstore.codecs.names():
            p.error(f"unknown codec {c!r}")
    for r in ns.restores:
        try:
            fail_every_for(ns.steps, r, ns.ckpt_every)
        except ValueError as e:
            p.error(str(e))
    ns.dim = 16
    return ns


def main(argv=None) -> int:
    ns = parse_args(argv)
    if ns.threads:
        torch.set_num_threads(ns.threads)
    ns.load_start = load_average()
    Checkpointer, why = td.load_checkpointer()
    if Checkpointer is None:
        print(f"error: cnrstore.torch.Checkpointer is not available ({why})", file=sys.stderr)
        return 2
    header = machine_description()
    tmp = tempfile.mkdtemp(prefix="bench_accuracy-")
    t0 = time.perf_counter()
    try:
        holdout = td.Holdout(make_args(ns, "fp32", 0, tmp), ns.holdout_batches)
        b_ll, b_auc, _, b_wall, b_model = run_one(ns, holdout, None, 0, tmp, Checkpointer)
        print(f"baseline (no failures): logloss {b_ll:.6f} AUC {b_auc:.6f} ({b_wall:.1f} s)", file=sys.stderr)
        control = floor = None
        if not ns.no_control:
            r = max(ns.restores)
            for codec in ("fp32", "fp16"):
                ll, a, n, wall, model = run_one(ns, holdout, codec, r, tmp, Checkpointer)
                diff = max(float((p - q).abs().max()) for p, q in
                           zip(model.state_dict().values(), b_model.state_dict().values()))
                if codec == "fp32":
                    control = (ll, a, n, diff)
                else:
                    floor = (ll, a, n, diff)
                print(f"{codec} x{r}: logloss {ll:.6f} ({degradation(ll, b_ll):+.4f}%) AUC {a:.6f} "
                      f"max|dw| {diff:.3g} ({wall:.1f} s)", file=sys.stderr)
        results = {}
        for c in ns.codecs:
            for r in ns.restores:
                ll, a, n, wall, _ = run_one(ns, holdout, c, r, tmp, Checkpointer)
                results[(c, r)] = (ll, a)
                print(f"{c} x{r}: logloss {ll:.6f} ({degradation(ll, b_ll):+.4f}%) AUC {a:.6f} "
                      f"({wall:.1f} s, {time.perf_counter() - t0:.0f} s total)", file=sys.stderr)
        report = render(ns, ns.codecs, ns.restores, results, (b_ll, b_auc), control, floor, header,
                        time.perf_counter() - t0)
        print(report)
        if ns.out:
            with open(ns.out, "w") as f:
                f.write(report)
        if ns.png:
            err = plot(ns.png, ns.codecs, ns.restores, results, b_ll, floor)
            print(err if err else f"plot: {ns.png}")
        if control is not None and control[3] != 0.0:
            print("warning: the lossless control differs from the baseline: runs are not deterministic",
                  file=sys.stderr)
        return 0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
