#!/usr/bin/env python3
"""Write cost over a long run (issue 25): bytes and time per save, background merges and read
amplification, under the engine's old and new policies, side by side in one run.

The workload is the issue's peer workload (IncrCP_paper's Check-N-Run baseline): ``--tables`` tables of
``--rows`` rows x ``--dim`` (8 x 524,288 x 64 fp32: 1 GiB), a baseline (every row), then ``--versions``
increments, each touching a fraction of every table's rows drawn uniformly from [2%, 5%] per increment,
the rows drawn with Zipf(1.05) popularity over a fixed random ranking of each table's rows (duplicates
removed), written with new random values. Plain store API: ``create_table(..., codec=...)``,
``store.checkpoint(step=...)``, ``put_rows``. Every (codec, policy) replays the same seeds in a fresh store:

  old  ``knobs.READ_CHAIN_BOUND = 3``, ``READ_AMP_BOUND = None``, ``MERGE_TRIGGER = None``,
       compaction="auto": the save path writes merged deltas to hold every read chain at 3 records
  new  the package's knobs as they are when this script starts, compaction="auto"

Per increment, once the background compactor is idle: the raw delta (the bytes the save's records take
holding only its own rows: rows x the codec's row bytes, plus record header, checksum and row offsets,
computed here; beside it the store's own count, ``stats()["increment_bytes"]``), the bytes the save
appended (``stats()["save_bytes"]``), the bytes background merges appended (``stats()["merge_bytes"]``),
the save's wall time (the ``with store.checkpoint(...)`` block), disk, and the read
amplification of every block at the newest version (``Store.read_amplification``: the block's read cost
over its baseline's; max and mean). At the end: restore of the newest version (``read_tables`` of every
table, best of ``--restores``, page cache warm) with its peak extra memory (``RssAnon`` high-water, as
bench_restore measures it) over the output bytes, against ``torch.load`` of an fp32 file of the same
tables measured in the same run; the newest version must read bit for bit as the model held in memory.

    python benchmarks/bench_writecost.py                  # full run (1 GiB fp32 and int4, 2 policies)
    python benchmarks/bench_writecost.py --quick          # smoke run (< 1 minute)
    python benchmarks/bench_writecost.py --out FILE --plot benchmarks/writecost.png
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import tempfile
import time

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import cnrstore  # noqa: E402
from common import (T975, Z975, fmt_bytes, knob_settings, load_average, machine_description, publish,  # noqa: E402
                          save_panels, t_quantile, three_panels, zipf_rows)
from bench_restore import PeakSampler  # noqa: E402
from cnrstore import codecs, knobs  # noqa: E402
from cnrstore.engine import record  # noqa: E402

#: The knobs a policy sets. The old policy's are fixed (the engine of 2026-11 before background merges: the save path merges
#: to hold every chain at 3 records); the new one is the package's defaults, read once here, before
#: anything changes them.
POLICY_KNOBS = ("READ_CHAIN_BOUND", "READ_AMP_BOUND", "MERGE_TRIGGER")
POLICIES = {
    "old": {"READ_CHAIN_BOUND": 3, "READ_AMP_BOUND": None, "MERGE_TRIGGER": None},
    "new": {k: getattr(knobs, k) for k in POLICY_KNOBS},
}
ZIPF_A = 1.05
#: Verdict thresholds (stated in the report): a line is flat when the 95% interval of its fitted change
#: over the run lies within this fraction of its mean (either way).
FLAT_BYTES, FLAT_TIME = 0.10, 0.25
#: "No slower": the new policy's best restore within this factor of the old one's (timing noise on a
#: shared machine).
RESTORE_MARGIN = 1.10


# workload --------------------------------------------------------------------------------------------
def rankings(args) -> list[np.ndarray]:
    """Each table's fixed random ranking of its rows (rank k -> row perm[k - 1])."""
    return [np.random.default_rng([args.seed, t]).permutation(args.rows) for t in range(args.tables)]


def baseline_values(args, t: int) -> np.ndarray:
    return np.random.default_rng([args.seed, t, 0]).standard_normal((args.rows, args.dim), dtype=np.float32)


def increment(args, perms: list[np.ndarray], version: int, t: int) -> tuple[np.ndarray, np.ndarray]:
    """(sorted unique rows, new float32 values) that increment ``version`` (1..) puts into table ``t``: the
    same for every policy and codec of a run."""
    rng = np.random.default_rng([args.seed, t, version])
    fraction = np.random.default_rng([args.seed, version]).uniform(0.02, 0.05)  # one draw per increment
    rows = zipf_rows(rng, perms[t], max(1, round(fraction * args.rows)), a=ZIPF_A)
    return rows, rng.standard_normal((rows.size, args.dim), dtype=np.float32)


def raw_delta_bytes(rows: np.ndarray, num_rows: int, block_rows: int, row_bytes: int) -> int:
    """Bytes of the ROWS records holding exactly ``rows`` (sorted, unique) of a table: one record per
    touched block (header, checksum, the rows' encodings, a u16 offset per row unless the record holds
    rows 0..count-1 of its block), as docs/FORMAT.md lays them out."""
    blocks = rows // block_rows
    starts = np.flatnonzero(np.r_[True, blocks[1:] != blocks[:-1]])
    counts = np.diff(np.r_[starts, rows.size])
    last = rows[np.r_[starts[1:], rows.size] - 1] - blocks[starts] * block_rows
    full = last == counts - 1
    return int(starts.size * (record.HEADER_BYTES + record.TRAILER_BYTES) + counts.sum() * row_bytes
               + (2 * counts[~full]).sum())


def expected(codec, values: np.ndarray, dim: int) -> np.ndarray:
    """What the store reads back for ``values`` put with ``codec`` (a row's encoding does not depend on the
    other rows: API.md)."""
    return values if codec.lossless else codec.decode(codec.encode(values), dim)


# one policy ------------------------------------------------------------------------------------------
def settle(store) -> None:
    store.wait_for_compaction()


def run_policy(name: str, codec_name: str, args, root: str, base: list[np.ndarray], model: list[np.ndarray],
               perms) -> dict:
    """One fresh store under policy ``name``: ``base`` (the baseline's values) then the increments;
    ``model`` (what the baseline reads back) is updated in place to what the newest version reads."""
    with knob_settings(POLICIES[name]):
        return _run(name, codec_name, args, root, base, model, perms)


def _run(name: str, codec_name: str, args, root: str, base: list[np.ndarray], model: list[np.ndarray],
         perms) -> dict:
    codec = codecs.get(codec_name)
    row_bytes = codec.row_bytes(args.dim)
    path = os.path.join(root, f"{name}-{codec_name}")
    store = cnrstore.open(path, create=True, compaction="auto")
    names = [f"t{t}" for t in range(args.tables)]
    for n in names:
        store.create_table(n, args.rows, args.dim, codec=codec_name)
    block_rows = store.tables()[names[0]].block_rows
    all_rows = np.arange(args.rows, dtype=np.int64)
    out = {k: [] for k in ("raw", "store_raw", "save", "merge", "save_s", "disk", "amp_max", "amp_mean", "touched")}
    t0 = time.perf_counter()
    with store.checkpoint(step=0) as ck:
        for n, values in zip(names, base):
            ck.put_rows(n, all_rows, values)
    out["baseline_s"] = time.perf_counter() - t0
    baseline = ck.version
    settle(store)
    first = counters(store)
    out["baseline_bytes"], out["block_rows"], out["row_bytes"] = first["bytes_written"], block_rows, row_bytes
    prev = first
    for v in range(1, args.versions + 1):
        puts = [increment(args, perms, v, t) for t in range(args.tables)]
        t0 = time.perf_counter()
        with store.checkpoint(step=v) as ck:
            for n, (rows, values) in zip(names, puts):
                ck.put_rows(n, rows, values)
        out["save_s"].append(time.perf_counter() - t0)
        version = ck.version
        settle(store)
        now = counters(store)
        for t, (rows, values) in enumerate(puts):
            model[t][rows] = expected(codec, values, args.dim)
        out["raw"].append(sum(raw_delta_bytes(rows, args.rows, block_rows, row_bytes) for rows, _ in puts))
        out["touched"].append(sum(rows.size for rows, _ in puts))
        out["store_raw"].append(now["increment_bytes"] - prev["increment_bytes"])
        out["save"].append(now["save_bytes"] - prev["save_bytes"])
        out["merge"].append(now["merge_bytes"] - prev["merge_bytes"])
        out["disk"].append(now["bytes_on_disk"])
        amp = np.concatenate(list(store.read_amplification(version).values()))
        out["amp_max"].append(float(amp.max()))
        out["amp_mean"].append(float(amp.mean()))
        prev = now
    out["after_baseline"] = prev["bytes_written"] - first["bytes_written"]
    out["compaction_errors"] = store.stats()["compaction_errors"]
    out.update(restore(store, names, model, args, baseline))
    store.close()
    shutil.rmtree(path, ignore_errors=True)
    return out


def counters(store) -> dict:
    """The store's byte counters now (read after the background compactor went idle)."""
    st = store.stats()
    return {k: st[k] for k in ("bytes_written", "bytes_on_disk", "increment_bytes", "save_bytes", "merge_bytes")}


def restore(store, names: list[str], model: list[np.ndarray], args, baseline: int) -> dict:
    """Best of ``args.restores`` reads of every table of the newest version (a first, untimed read warms the
    page cache and checks the bits), with the peak extra memory of each; and the same of the ``baseline``
    version (each block a lone baseline record: what the chains above it cost is the difference)."""
    got = store.read_tables({n: None for n in names})
    for t, n in enumerate(names):
        if not np.array_equal(got[n].view(np.uint32), model[t].view(np.uint32)):
            bad = int(np.flatnonzero((got[n].view(np.uint32) != model[t].view(np.uint32)).any(axis=1))[0])
            raise AssertionError(f"table {n}: the newest version differs from the model held in memory "
                                 f"(first row {bad})")
    output = sum(a.nbytes for a in got.values())
    del got
    best, extra = best_read(lambda: store.read_tables({n: None for n in names}), args.restores)
    store.read_tables({n: None for n in names}, version=baseline)  # warm
    base_s, _ = best_read(lambda: store.read_tables({n: None for n in names}, version=baseline), args.restores)
    return {"restore_s": best, "restore_extra": extra, "output_bytes": output, "baseline_restore_s": base_s}


def best_read(read, repeats: int) -> tuple[float, int]:
    """(best time of ``repeats`` calls of ``read``, the highest peak extra memory of any); what a call
    returns is dropped before the next."""
    best, extra = float("inf"), 0
    for _ in range(repeats):
        with PeakSampler() as peak:
            t0 = time.perf_counter()
            got = read()
            best = min(best, time.perf_counter() - t0)
        extra = max(extra, peak.extra)
        del got
    return best, extra


def torch_reference(model: list[np.ndarray], root: str, restores: int) -> dict:
    """torch.save of the same tables (fp32) and the best of ``restores`` torch.load of it, warm."""
    path = os.path.join(root, "fp32.pt")
    torch.save({f"t{t}": torch.from_numpy(a) for t, a in enumerate(model)}, path)
    size = os.path.getsize(path)
    torch.load(path)
    best, extra = best_read(lambda: torch.load(path), restores)
    os.remove(path)
    return {"load_s": best, "load_extra": extra, "fp32_bytes": size}


# statistics and report -------------------------------------------------------------------------------
def slope(ys: list[float]) -> tuple[float, float, float]:
    """(least-squares slope of ``ys`` against 1..n, half-width of its 95% interval, fitted change over the
    run as a fraction of the mean)."""
    y = np.asarray(ys, dtype=np.float64)
    n = y.size
    if n < 3:
        return float("nan"), float("nan"), float("nan")
    x = np.arange(1, n + 1, dtype=np.float64)
    sxx = ((x - x.mean()) ** 2).sum()
    b = float(((x - x.mean()) * (y - y.mean())).sum() / sxx)
    resid = y - (y.mean() + b * (x - x.mean()))
    se = math.sqrt(float((resid ** 2).sum()) / (n - 2) / sxx)
    return b, t_quantile(T975, Z975, n - 2) * se, b * (n - 1) / y.mean() if y.mean() else float("nan")


def flat(ys: list[float], tolerance: float) -> tuple[bool, str]:
    """Whether ``ys`` is shown flat over the run: the 95% interval of its fitted change over the run (slope x
    (n - 1), as a fraction of the mean) lies within +-``tolerance``; and the figures that say so."""
    b, half, change = slope(ys)
    if math.isnan(b):
        return False, "too few increments to fit"
    y_mean = float(np.mean(ys))
    lo, hi = ((b - half) * (len(ys) - 1) / y_mean, (b + half) * (len(ys) - 1) / y_mean)
    ok = -tolerance <= lo and hi <= tolerance
    why = "" if ok else ("; grows (the CI excludes 0)" if lo > 0 else "; shrinks (the CI excludes 0)" if hi < 0
                         else "; too noisy to show it within the tolerance")
    return ok, f"fitted change over the run {change:+.1%} of the mean (95% CI {lo:+.1%} to {hi:+.1%}){why}"


def mb(n: float) -> str:
    return f"{n / 1e6:,.1f} MB"


def verdict(ok: bool) -> str:
    return "**reached**" if ok else "**missed**"


def report(results: dict, refs: dict, args, seconds: float, start_load: str) -> str:
    lines = ["## Write cost over a long run: saves, merges and read amplification", ""]
    lines += [f"- {line}" for line in machine_description()]
    total = args.tables * args.rows * args.dim * 4
    lines += [
        f"- workload: {args.tables} tables of {args.rows:,} rows x {args.dim} ({fmt_bytes(total)} of fp32), a baseline "
        f"(every row) then {args.versions} increments; each touches a fraction of every table's rows drawn uniformly "
        f"from [2%, 5%] per increment, rows drawn by Zipf({ZIPF_A}) popularity over a fixed random ranking "
        f"(duplicates removed), new random values; plain store API (put_rows), seed {args.seed}",
        f"- load average at start: {start_load}; at end: {load_average()}; total run {seconds:.0f} s",
        "- policies (knobs set before each fresh store opens, compaction='auto' for both): "
        + "; ".join(f"{p} = " + ", ".join(f"{k} {v!r}" for k, v in POLICIES[p].items()) for p in args.policies),
        "- raw delta: the bytes an increment's records take holding only its own rows (rows x codec row bytes + "
        "per-record header, checksum and u16 row offsets), computed by this script; save bytes: what the save "
        "appended; merge bytes: what background merges appended after it (the background compactor is let go "
        "idle after every save, before the next one and before any figure is read)",
        "- increments are numbered 1..N after the baseline (store versions 2..N+1)", "",
    ]
    cols = [(p, c) for c in args.codecs for p in args.policies]
    lines += ["| measurement | " + " | ".join(f"{p} {c}" for p, c in cols) + " |", "|---|" + "---|" * len(cols)]

    def row(label, fn):
        lines.append(f"| {label} | " + " | ".join(fn(results[c][p], refs[c]) for p, c in cols) + " |")

    def amp_list(r):
        return [s / raw for s, raw in zip(r["save"], r["raw"])]

    row("baseline: bytes, save time", lambda r, ref: f"{mb(r['baseline_bytes'])}, {r['baseline_s']:.2f} s")
    row("raw delta per increment: first / last / mean", lambda r, ref: f"{mb(r['raw'][0])} / {mb(r['raw'][-1])} / "
        f"{mb(np.mean(r['raw']))}")
    row("bytes per save: first / last / mean", lambda r, ref: f"{mb(r['save'][0])} / {mb(r['save'][-1])} / "
        f"{mb(np.mean(r['save']))}")
    row("... slope per increment (95% CI)", lambda r, ref: "{:+.2f} ± {:.2f} MB".format(*(x / 1e6 for x in slope(r["save"])[:2])))
    row("save amplification (save / raw delta): first / last / max",
        lambda r, ref: f"{amp_list(r)[0]:.2f} / {amp_list(r)[-1]:.2f} / {max(amp_list(r)):.2f}")
    row("bytes per touched row, mean", lambda r, ref: f"{np.sum(r['save']) / np.sum(r['touched']):.0f} B "
        f"(codec row {r['row_bytes']} B)")
    row("background merge bytes, all increments", lambda r, ref: mb(np.sum(r["merge"])))
    row("total amplification (all bytes after the baseline / raw deltas)",
        lambda r, ref: f"{r['after_baseline'] / np.sum(r['raw']):.2f}")
    row("store's own increment count / raw delta", lambda r, ref: f"{np.sum(r['store_raw']) / np.sum(r['raw']):.4f}")
    row("save time: first / last / mean", lambda r, ref: f"{r['save_s'][0] * 1e3:.0f} / {r['save_s'][-1] * 1e3:.0f} / "
        f"{np.mean(r['save_s']) * 1e3:.0f} ms")
    row(f"disk after {args.versions} increments (x one fp32 copy)",
        lambda r, ref: f"{mb(r['disk'][-1])} ({r['disk'][-1] / ref['fp32_bytes']:.2f}x)")
    row("read amplification per block at the newest: max / mean",
        lambda r, ref: f"{r['amp_max'][-1]:.2f} / {r['amp_mean'][-1]:.2f}")
    row("... max over the run", lambda r, ref: f"{max(r['amp_max']):.2f}")
    row(f"restore newest (read_tables, best of {args.restores})", lambda r, ref: f"{r['restore_s'] * 1e3:.0f} ms")
    row("... over a restore of the baseline version, same store", lambda r, ref: f"{r['restore_s'] / r['baseline_restore_s']:.2f}x "
        f"({r['baseline_restore_s'] * 1e3:.0f} ms)")
    row("... torch.load of the fp32 file / restore (above 1: faster)",
        lambda r, ref: f"{ref['load_s'] / r['restore_s']:.2f}x")
    row("restore peak extra memory / output", lambda r, ref: f"{r['restore_extra'] / r['output_bytes']:.2f}")
    row("background compaction errors", lambda r, ref: str(r["compaction_errors"]))
    lines.append("")
    lines.append("- peak extra memory: the process's RssAnon high-water (1 ms sampling) above its level before the "
                 "read, over the bytes returned; arrays under glibc's mmap threshold (32 MiB) may reuse freed heap "
                 "and read low (--quick sizes)")
    for c in args.codecs:
        ref = refs[c]
        lines.append(f"- {c}: torch.save of the same tables {mb(ref['fp32_bytes'])}; torch.load best of "
                     f"{args.restores} {ref['load_s'] * 1e3:.0f} ms, peak extra memory / output "
                     f"{ref['load_extra'] / ref['fp32_bytes']:.2f}. The newest version of every policy read bit "
                     "for bit as the model held in memory (checked; a mismatch fails the run).")
    lines.append("")
    lines += goals(results, args)
    lines.append("")
    for c in args.codecs:
        for p in args.policies:
            r = results[c][p]
            lines.append(f"- {p} {c}, per increment: save " + ", ".join(f"{x / 1e6:.1f}" for x in r["save"])
                         + " MB; merges " + ", ".join(f"{x / 1e6:.1f}" for x in r["merge"]) + " MB; save time "
                         + ", ".join(f"{x * 1e3:.0f}" for x in r["save_s"]) + " ms"
                         + "; read amplification max " + ", ".join(f"{x:.2f}" for x in r["amp_max"]))
    lines += ["", f"Reproduce: `python benchmarks/bench_writecost.py{' --quick' if args.quick else ''}`", ""]
    return "\n".join(lines)


def goals(results: dict, args) -> list[str]:
    """The issue's goals on the fp32 line of the new policy, each reached or missed from the figures above."""
    if "fp32" not in args.codecs or "new" not in args.policies:
        return ["- goals: judged on new fp32; not run"]
    r = results["fp32"]["new"]
    amps = [s / raw for s, raw in zip(r["save"], r["raw"])]
    flat_bytes, why_bytes = flat(amps, FLAT_BYTES)
    per_mb = [s / raw * 1e6 for s, raw in zip(r["save_s"], r["raw"])]
    flat_time, why_time = flat(per_mb, FLAT_TIME)
    total = r["after_baseline"] / np.sum(r["raw"])
    mem = r["restore_extra"] / r["output_bytes"]
    lines = ["Targets (new policy, fp32):", "",
             f"- bytes per save at most 1.1x the raw delta: max {max(amps):.2f}x, mean {np.mean(amps):.2f}x: "
             f"{verdict(max(amps) <= 1.1)}",
             f"- ... and flat (save bytes / raw delta, which takes out the workload's own 2-5% draw; flat when the "
             f"95% CI of the fitted change over the run is within ±{FLAT_BYTES:.0%} of the mean): {why_bytes}: "
             f"{verdict(flat_bytes)}",
             f"- all bytes written after the baseline, merges included, at most 1.5x the raw deltas: {total:.2f}x: "
             f"{verdict(total <= 1.5)}",
             f"- save time flat (seconds per raw-delta MB; the 95% CI of the change within ±{FLAT_TIME:.0%}): {why_time}: "
             f"{verdict(flat_time)}"]
    if "old" in args.policies:
        ratio = r["restore_s"] / results["fp32"]["old"]["restore_s"]
        lines.append(f"- restore of the newest no slower than the old policy's in this run (within "
                     f"{RESTORE_MARGIN - 1:.0%} for timing noise): new / old {ratio:.2f}: {verdict(ratio <= RESTORE_MARGIN)}")
    lines.append(f"- restore peak extra memory at most 1.1x the output: {mem:.2f}x: {verdict(mem <= 1.1)}")
    return lines


def plot(results: dict, args, path: str) -> str | None:
    panels = three_panels((14, 3.8))
    if panels is None:
        return "matplotlib is not installed: no plot"
    fig, axes = panels
    colors = {"old": "tab:red", "new": "tab:blue"}
    styles = {"fp32": "-", "int4": "--"}
    x = np.arange(1, args.versions + 1)
    for c in args.codecs:
        for p in args.policies:
            r = results[c][p]
            kw = dict(color=colors.get(p), linestyle=styles.get(c, ":"), marker="o", markersize=3, label=f"{p} {c}")
            axes[0].plot(x, np.array(r["save"]) / 1e6, **kw)
            axes[1].plot(x, np.array(r["save_s"]) * 1e3, **kw)
            axes[2].plot(x, r["amp_max"], **kw)
            axes[2].plot(x, r["amp_mean"], **{**kw, "marker": "x", "alpha": 0.5, "label": f"{p} {c} (mean)"})
        raw = results[c][args.policies[0]]["raw"]
        axes[0].plot(x, np.array(raw) / 1e6, color="gray", linestyle=styles.get(c, ":"), linewidth=1,
                     label=f"raw delta {c}")
    for knob, style in (("READ_AMP_BOUND", ":"), ("MERGE_TRIGGER", "-.")):
        if "new" in args.policies and POLICIES["new"][knob] is not None:
            axes[2].axhline(POLICIES["new"][knob], color="gray", linestyle=style, linewidth=1,
                            label=f"new {knob} {POLICIES['new'][knob]:g}")
    axes[0].set_yscale("log")
    axes[1].set_yscale("log")
    axes[0].set_title("bytes per save (MB, log)")
    axes[1].set_title("save time (ms, log)")
    axes[2].set_title("read amplification per block, newest (max; x: mean)")
    axes[0].legend(fontsize=7)
    axes[2].legend(fontsize=7)
    save_panels(fig, axes, "increment", path)
    return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small smoke run (< 1 minute)")
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--rows", type=int, default=None, help="rows per table (default 524,288: 1 GiB; --quick 16,384)")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--versions", type=int, default=None, help="increments after the baseline (default 20; --quick 6)")
    p.add_argument("--codecs", default="fp32,int4", help="comma separated; fp32 is the headline figure")
    p.add_argument("--policies", default="old,new")
    p.add_argument("--restores", type=int, default=3, help="timed restores (best of)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tmp", default=None, help="directory for the stores (default: system temp)")
    p.add_argument("--out", default=None, help="also write the markdown to FILE")
    p.add_argument("--plot", default=None, help="write a PNG (needs matplotlib); 'none' for no plot")
    args = p.parse_args(argv)
    args.rows = args.rows or (16_384 if args.quick else 524_288)
    args.versions = args.versions or (6 if args.quick else 20)
    args.codecs = args.codecs.split(",")
    args.policies = args.policies.split(",")
    for name in args.policies:
        if name not in POLICIES:
            p.error(f"unknown policy {name!r} (old, new)")
    start_load = load_average()
    t0 = time.monotonic()
    perms = rankings(args)
    results, refs = {}, {}
    root = tempfile.mkdtemp(prefix="cnr-writecost-", dir=args.tmp)
    try:
        for c in args.codecs:
            codec = codecs.get(c)
            base = [baseline_values(args, t) for t in range(args.tables)]
            results[c] = {}
            for name in args.policies:
                print(f"{c} {name} ...", flush=True)
                model = [expected(codec, a, args.dim).copy() for a in base]
                results[c][name] = run_policy(name, c, args, root, base, model, perms)
            del base
            refs[c] = torch_reference(model, root, args.restores)
            del model
    finally:
        shutil.rmtree(root, ignore_errors=True)
    text = report(results, refs, args, time.monotonic() - t0, start_load)
    if args.plot and args.plot != "none":
        png = args.plot if os.path.isabs(args.plot) else os.path.join(HERE, os.path.basename(args.plot))
        why = plot(results, args, png)
        text += (f"\n![bytes and time per save, read amplification per block]({os.path.basename(png)})\n"
                 if why is None else f"\n*{why}*\n")
    publish(text, args.out, None, None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
