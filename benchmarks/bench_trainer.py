"""A user's own trainer, checkpointing as it trains: stalls, peak host memory and how far the store trails.

The shape of issue 48's trainer: one ``nn.EmbeddingBag`` of 1.6M rows x 64 fp32 (410 MB, sparse gradients)
under Adagrad (another 410 MB of state) and a small MLP under Adam; a save every ``--every`` steps (25: about
a fifth of the rows touched per save). Each method runs in a process of its own, so that its peak RSS (``ru_maxrss`` of that
process, from ``wait4``) is its own:

- ``no checkpoints``: the same training, nothing saved (the reference for memory and step time);
- ``cnrstore``: ``Checkpointer(path, model, opt)`` at its defaults (fp32, incremental, streamed saves,
  ``max_lag=2``);
- ``cnrstore, saves copied``: the same with ``stream_saves=False`` (what streaming changes);
- ``DCP async_save``: ``torch.distributed.checkpoint.async_save`` of the model's and optimizer's state dicts
  into a new directory per save, waiting for the previous save's future first (as DCP's docs do).

Per method: the stall of each save (the call's time, plus, for cnrstore, what the step pre-hooks of the step
after it copied aside; the first save is a baseline), peak RSS against the
no-checkpoint run's, the lag p100 (cnrstore: ``SaveReport.lag_s``; DCP: the future's completion, polled)
in save intervals, and the cost per step of cnrstore's step pre-hooks (time inside
``guard.StepGuard.before_step`` over the training time). In the cnrstore run, the physical reference for the
snapshot of touched rows: ``np.take`` of one save's rows of the table into a buffer, GB/s, beside the
increments' snapshot rate (``host_bytes / stall_s``); and the background write rate (a version's
``bytes_written / write_s``) against the disk's sequential write rate, measured first in the same run (a file
of ``--disk-mib`` MiB written in 8 MiB pieces, then fsynced, in the benchmark's directory).

``--optimizer adam``: one Adam over everything (the table's gradient dense): Adam moves every row at each
step, so each save copies its rows at ``save()``.

    .venv/bin/python benchmarks/bench_trainer.py [--quick] [--optimizer adam] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

METHODS = ("no checkpoints", "cnrstore", "cnrstore, saves copied", "DCP async_save")
OPTIMIZER_STATE = {"adagrad": "sparse gradients, Adagrad state of the same size",
                   "adam": "dense gradients, Adam state of twice the size"}


def child(method: str, rows: int, dim: int, steps: int, every: int, batch: int, path: str,
          optimizer: str = "adagrad") -> dict:
    """One method's training run (in its own process): what it measured."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    sparse = optimizer == "adagrad"
    model = nn.ModuleDict({"emb": nn.EmbeddingBag(rows, dim, mode="sum", sparse=sparse),
                           "mlp": nn.Sequential(nn.Linear(dim, 64), nn.ReLU(), nn.Linear(64, 1))})
    if sparse:  # sparse Adagrad on the table, Adam on the dense layers
        opts = [torch.optim.Adagrad(model["emb"].parameters(), lr=0.05),
                torch.optim.Adam(model["mlp"].parameters(), lr=0.001)]
    else:
        opts = [torch.optim.Adam(model.parameters(), lr=0.001)]
    opt = opts[0]
    rng = np.random.default_rng(0)

    def batch_ids():  # uniform: 25 steps of 2048 x 8 ids touch about a fifth of the rows, as in the issue
        return torch.from_numpy(rng.integers(0, rows, batch * 8)).view(batch, 8)

    def train_step():
        ids = batch_ids()
        for o in opts:
            o.zero_grad()
        out = model["mlp"](model["emb"](ids)).squeeze(1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(out, torch.ones_like(out))
        loss.backward()
        for o in opts:
            o.step()

    hook_s = [0.0]
    ck = None
    lags, reports = [], []
    if method.startswith("cnrstore"):
        from cnrstore.torch import Checkpointer, guard
        real = guard.StepGuard.before_step

        def timed(self, optimizer):
            t0 = time.perf_counter()
            real(self, optimizer)
            hook_s[0] += time.perf_counter() - t0

        guard.StepGuard.before_step = timed
        ck = Checkpointer(path, model, opts, stream_saves=(method == "cnrstore"),
                          on_report=lambda r: reports.append(r) if hasattr(r, "lag_s") else None)
    elif method == "DCP async_save":
        import torch.distributed.checkpoint as dcp
    stalls, step_s, save_at = [], [], []
    future, future_at, dcp_lags = None, 0.0, []
    t_start = time.perf_counter()
    for i in range(1, steps + 1):
        t0, hooks_before = time.perf_counter(), hook_s[0]
        train_step()
        step_s.append(time.perf_counter() - t0)
        if ck is not None and stalls and i == save_at_step + 1:
            # the first step after a save: what its pre-hooks copied aside (all a whole streamed save had not
            # copied yet: Adam) is part of that save's stall
            stalls[-1] += hook_s[0] - hooks_before
        if future is not None and future.done():
            dcp_lags.append(time.perf_counter() - future_at)
            future = None
        if i % every:
            continue
        t0 = time.perf_counter()
        if ck is not None:
            ck.save(i)
        elif method == "DCP async_save":
            if future is not None:
                future.result()
                dcp_lags.append(time.perf_counter() - future_at)
            future = dcp.async_save({"model": model.state_dict(), "optim": [o.state_dict() for o in opts]},
                                    checkpoint_id=os.path.join(path, f"step_{i:05d}"))
            future_at = time.perf_counter()
        if method != "no checkpoints":
            stalls.append(time.perf_counter() - t0)
            save_at.append(time.perf_counter())
            save_at_step = i
    train_s = time.perf_counter() - t_start
    if ck is not None:
        ck.close()
        lags = [r.lag_s for r in reports]
    elif future is not None:
        future.result()
        dcp_lags.append(time.perf_counter() - future_at)
        lags = dcp_lags
    out = {"stalls": stalls, "step_s": step_s, "lags": lags, "train_s": train_s,
           "interval_s": float(np.median(np.diff(save_at))) if len(save_at) > 1 else None,
           "hook_share": hook_s[0] / train_s}
    if reports:
        inc = [r for r in reports if not r.baseline]
        copied = [r for r in inc if not r.streamed]  # (a snapshot inside save(): its rate is the copy's)
        out["increment_rate"] = float(np.median([r.host_bytes / r.stall_s for r in copied])) if copied else None
        out["increment_bytes"] = float(np.median([r.host_bytes for r in inc])) if inc else None
        out["preserved"] = max(r.preserved_bytes for r in reports)
        written = [r.bytes_written / r.write_s for r in reports if r.bytes_written and r.write_s > 0]
        out["write_rate"] = float(np.median(written)) if written else None
        out["streamed"] = sum(bool(r.streamed) for r in reports)
        # the physical reference: a gather of one increment's share of the rows, same process, same table
        share = int(np.median([r.rows.get("emb", 0) for r in inc])) if inc else rows // 5
        out["touched"] = share / rows
        src = model["emb"].weight.detach().numpy()
        idx = np.sort(rng.choice(rows, share, replace=False))
        state = next(v for v in opt.state[model["emb"].weight].values() if v.shape == (rows, dim)).numpy()
        buf, sbuf = np.empty((share, dim), np.float32), np.empty((share, dim), np.float32)
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            np.take(src, idx, axis=0, out=buf, mode="clip")  # (numpy's fastest gather into a buffer)
            np.take(state, idx, axis=0, out=sbuf, mode="clip")
            times.append(time.perf_counter() - t0)
        out["gather_rate"] = 2 * buf.nbytes / min(times)
    return out


def disk_write_rate(root: str, mib: int) -> float:
    """The disk's sequential write rate here, bytes/s: ``mib`` MiB written in 8 MiB pieces, then fsynced."""
    piece = np.random.default_rng(0).integers(0, 255, 8 << 20, dtype=np.uint8).tobytes()
    path = os.path.join(root, "disk-rate")
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(max(1, mib // 8)):
            f.write(piece)
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - t0
    os.unlink(path)
    return max(1, mib // 8) * len(piece) / seconds


def run_method(method: str, args, root: str) -> dict:
    path = os.path.join(root, method.replace(" ", "_").replace(",", ""))
    os.makedirs(path, exist_ok=True)
    from common import child_with_peak_rss
    result = child_with_peak_rss(__file__, "--child", [method, args.rows, args.dim, args.steps, args.every,
                                                        args.batch, path, args.optimizer], method)
    result["peak_rss"] = result.pop("maxrss")
    shutil.rmtree(path, ignore_errors=True)
    return result


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def report(results: dict, args, seconds: float) -> str:
    from common import load_average, machine_description
    base = results["no checkpoints"]
    lines = [f"## {args.title}", "",
             "A user's own trainer (issue 48's shape) checkpointing as it trains, each method in a process of its "
             "own; peak RSS is that process's.", "",
             f"Reproduce: `.venv/bin/python benchmarks/bench_trainer.py{' --quick' if args.quick else ''}"
             f"{' --optimizer adam' if args.optimizer == 'adam' else ''}` "
             f"({seconds:.0f} s here).", ""]
    lines += [f"- {m}" for m in machine_description()]
    lines += [f"- load average at end: {load_average()}",
              f"- model: EmbeddingBag {args.rows:,} x {args.dim} fp32 ({gib(args.rows * args.dim * 4)}) + "
              f"{OPTIMIZER_STATE[args.optimizer]} + a 2-layer MLP{' under Adam' if args.optimizer == 'adagrad' else ''}; batch "
              f"{args.batch} x 8 ids, uniform; "
              f"{args.steps} steps, a save every {args.every} (rows touched per increment: median "
              f"{results['cnrstore'].get('touched', 0):.1%})",
              f"- training without checkpoints: {np.median(base['step_s']) * 1e3:.1f} ms per step (median), "
              f"peak RSS {gib(base['peak_rss'])}", ""]
    lines += ["| method | stall median | stall max (p100) | max / median | peak RSS | RSS vs no checkpoints "
              "| lag p100 (save intervals) | step median |",
              "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for m in METHODS:
        r = results[m]
        if m == "no checkpoints":
            lines.append(f"| {m} | - | - | - | {gib(r['peak_rss'])} | 1.00x | - | "
                         f"{np.median(r['step_s']) * 1e3:.1f} ms |")
            continue
        st = r["stalls"]
        lag = max(r["lags"]) / r["interval_s"] if r["lags"] and r["interval_s"] else float("nan")
        lines.append(f"| {m} | {np.median(st) * 1e3:.0f} ms | {max(st) * 1e3:.0f} ms | "
                     f"{max(st) / np.median(st):.1f}x | {gib(r['peak_rss'])} | "
                     f"{r['peak_rss'] / base['peak_rss']:.2f}x | {lag:.2f} | {np.median(r['step_s']) * 1e3:.1f} ms |")
    c, d = results["cnrstore"], results["DCP async_save"]
    lines += ["", "Targets, ratios from this run:"]

    def goal(text, ok):
        lines.append(f"- {text}: **{'met' if ok else 'not met'}**")

    goal(f"cnrstore's worst stall / its median: {max(c['stalls']) / np.median(c['stalls']):.2f}x (goal <= 2x)",
         max(c["stalls"]) <= 2 * np.median(c["stalls"]))
    goal(f"cnrstore's worst stall / DCP async_save's median: {max(c['stalls']) / np.median(d['stalls']):.2f}x "
         "(goal < 1x)", max(c["stalls"]) < np.median(d["stalls"]))
    goal(f"peak RSS, cnrstore / no checkpoints: {c['peak_rss'] / base['peak_rss']:.2f}x (goal <= 1.25x; "
         f"DCP async_save {d['peak_rss'] / base['peak_rss']:.2f}x)", c["peak_rss"] <= 1.25 * base["peak_rss"])
    goal(f"peak RSS, cnrstore / DCP async_save: {c['peak_rss'] / d['peak_rss']:.2f}x (goal < 1x)",
         c["peak_rss"] < d["peak_rss"])
    lag = max(c["lags"]) / c["interval_s"]
    goal(f"lag between save() and its commit, p100: {lag:.2f} save intervals (goal <= 2)", lag <= 2)
    k = results["cnrstore, saves copied"]
    if k.get("increment_rate"):
        goal(f"snapshot of touched rows where a save copies them (stream_saves=False; at the defaults this "
             f"trainer's saves copy nothing): {k['increment_rate'] / 1e9:.2f} GB/s against a plain gather of as "
             f"many rows (np.take, weights + one state tensor) at {k['gather_rate'] / 1e9:.2f} GB/s, same process: "
             f"{k['increment_rate'] / k['gather_rate']:.1%} (goal >= 70%)",
             k["increment_rate"] >= 0.7 * k["gather_rate"])
    goal(f"median stall, cnrstore / DCP async_save: {np.median(c['stalls']) / np.median(d['stalls']):.2f}x "
         "(goal < 0.2x)", np.median(c["stalls"]) < 0.2 * np.median(d["stalls"]))
    if c.get("write_rate"):
        lines.append(f"- background write rate (a version's bytes / its write time, median): "
                     f"{c['write_rate'] / 1e6:.0f} MB/s, against the disk's sequential write rate measured in this "
                     f"run, {results['disk'] / 1e6:.0f} MB/s: {c['write_rate'] / results['disk']:.0%}")
    goal(f"step pre-hooks' cost: {c['hook_share']:.3%} of training time (goal <= 1%)", c["hook_share"] <= 0.01)
    lines.append(f"- cnrstore: {c['streamed']} of {len(c['stalls'])} saves streamed; rows copied aside by a "
                 f"streamed save, at most {gib(c['preserved'])}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--child")
    p.add_argument("--quick", action="store_true", help="a small smoke run (< 60 s)")
    p.add_argument("--rows", type=int, default=1_600_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--steps", type=int, default=250)
    p.add_argument("--every", type=int, default=25)
    p.add_argument("--batch", type=int, default=2048)
    p.add_argument("--optimizer", choices=["adagrad", "adam"], default="adagrad",
                   help="adam: every row of the table and its state moves at each step (a whole streamed save)")
    p.add_argument("--disk-mib", type=int, default=1024, help="MiB written to measure the disk's write rate")
    p.add_argument("--tmp", default=None)
    p.add_argument("--out", default=None)
    p.add_argument("--title", default="A user's trainer: stalls, peak memory and lag")
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(*json.loads(args.child))))
        return 0
    if args.quick:
        args.rows, args.steps, args.every, args.batch, args.disk_mib = 100_000, 40, 10, 512, 128
    t0 = time.perf_counter()
    root = tempfile.mkdtemp(dir=args.tmp, prefix="bench_trainer-")
    try:
        disk = disk_write_rate(root, args.disk_mib)
        results = {m: run_method(m, args, root) for m in METHODS}
        results["disk"] = (disk + disk_write_rate(root, args.disk_mib)) / 2  # (before and after the methods)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    from common import publish
    publish(report(results, args, time.perf_counter() - t0), args.out, None, None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
