#!/usr/bin/env python3
"""Space management: bytes written, disk and read cost of a DLRM trained with incremental saves, under
three merge policies of the engine, side by side in one run.

The workload is the issue's: the reference DLRM of tools/train_dlrm.py (26 tables of the Criteo Kaggle
cardinalities capped at ``--max-rows``, dim ``--dim``, Zipf(1.05) lookups over a random ranking of each
table's rows), plain SGD, ``cnrstore.torch.Checkpointer(mode="incremental", codec="adaptive4")``: a full
save, then ``--intervals`` intervals of ``--steps`` training steps, each followed by a save of the rows
touched in it. Each policy replays the same seeds in a fresh store:

  none      compaction=None with ``knobs.READ_CHAIN_BOUND = None``: plain increments, no merges at all;
            chains grow without end
  chains-3  compaction="auto" with ``READ_CHAIN_BOUND = 3``, ``READ_AMP_BOUND = None``, ``MERGE_TRIGGER =
            None``: every save merges to hold each read chain at 3 records (the engine of issues 12-24)
  default   compaction="auto" with the package's knobs: saves write their own rows, background merges
            bound each block's read cost (docs/DESIGN.md "Read chains, merges and read amplification")

Per interval, once the background compactor is idle: all bytes appended (``stats()["bytes_written"]``),
disk (``bytes_on_disk``), live bytes, the longest read chain of any version and the largest read
amplification of any block at the newest version (``Store.read_amplification``). At the end: write
amplification (``stats()["write_amplification"]``: all bytes appended over the bytes of the trainer's
own rows; the saves' and the background merges' bytes apart), the write volume after the first save against ``--intervals`` full fp32 checkpoints (the
size of ``torch.save`` of the embedding tables), ``retain(keep_last=5); gc()`` (space amplification),
``retain(keep_last=1); gc()`` (disk against one full fp32 checkpoint, and against the codec's ceiling),
restore of the newest version against ``torch.load`` of the fp32 file, and 10,000 random point reads
of the largest table at an older version. Every policy's newest version must read bit-identically.

    python benchmarks/bench_space.py                  # full run (a few minutes on 2 cores)
    python benchmarks/bench_space.py --quick          # smoke run (< 1 minute)
    python benchmarks/bench_space.py --out FILE --plot benchmarks/space.png
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from types import SimpleNamespace

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tools"))
from common import (knob_settings, load_average, machine_description, median, save_panels,  # noqa: E402
                          three_panels)

import dlrm_model  # noqa: E402

import cnrstore  # noqa: E402
from cnrstore import knobs  # noqa: E402
from cnrstore.torch import Checkpointer  # noqa: E402

#: name: (compaction, the knobs it sets); "default" sets none (the package's knobs as they are).
POLICIES = {
    "none": (None, {"READ_CHAIN_BOUND": None}),
    "chains-3": ("auto", {"READ_CHAIN_BOUND": 3, "READ_AMP_BOUND": None, "MERGE_TRIGGER": None}),
    "default": ("auto", {}),
}
CODEC = "adaptive4"


def run_policy(name: str, args, root: str) -> dict:
    compaction, settings = POLICIES[name]
    with knob_settings(settings):  # read when the store opens ("auto") and at every write
        return _run(name, compaction, args, root)


def _run(name: str, compaction, args, root: str) -> dict:
    ns = SimpleNamespace(seed=args.seed, batch_size=args.batch_size, max_rows=args.max_rows, dim=args.dim)
    data = dlrm_model.SyntheticCriteo(ns)
    model = dlrm_model.build_model(ns, args.seed)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    path = os.path.join(root, name)
    store = cnrstore.open(path, create=True, compaction=compaction)
    ck = Checkpointer(store, model, opt, codec=CODEC, mode="incremental")
    out = {"intervals": [], "written": [], "disk": [], "live": [], "chain": [], "amp": [], "save_s": []}

    def settle():
        store.wait_for_compaction()

    t0 = time.perf_counter()
    ck.save(step=0).wait()
    out["save_s"].append(time.perf_counter() - t0)
    settle()
    first = store.stats()["bytes_written"]
    batch = 0
    for interval in range(1, args.intervals + 1):
        for _ in range(args.steps):
            dense, ids, labels = data.batch(batch)
            batch += 1
            opt.zero_grad()
            loss_fn(model(dense, ids), labels).backward()
            opt.step()
        t0 = time.perf_counter()
        ck.save(step=interval * args.steps).wait()
        out["save_s"].append(time.perf_counter() - t0)
        settle()
        st = store.stats()
        out["intervals"].append(interval)
        out["written"].append(st["bytes_written"])
        out["disk"].append(st["bytes_on_disk"])
        out["live"].append(st["live_bytes"])
        out["chain"].append(st["max_read_chain"])
        out["amp"].append(max(float(a.max()) for a in store.read_amplification().values() if a.size))
    ck.close()
    st = store.stats()
    out["first"] = first
    out["after_first"] = st["bytes_written"] - first
    out["wa"] = st["write_amplification"]
    out["save_bytes"], out["merge_bytes"] = st["save_bytes"] - first, st["merge_bytes"]
    out["max_chain"] = st["max_read_chain"]
    out["compaction_errors"] = st["compaction_errors"]
    versions = [v.version for v in store.versions()]
    names = sorted(store.tables())
    snap = store.restore()
    out["newest"] = {t: snap.tables[t].tobytes() for t in names if t.startswith("embs.")}
    # restore of the newest version (every table) against torch.load of the fp32 embedding state
    out["restore_s"] = median(_timed(store.restore) for _ in range(args.reps))
    # 10,000 random point reads of the largest table at an older version
    largest = max((t for t in names if t.startswith("embs.")), key=lambda t: store.tables()[t].num_rows)
    ids = np.random.default_rng(1).integers(0, store.tables()[largest].num_rows, 10_000)
    old = versions[len(versions) // 2]
    out["points_s"] = median(_timed(lambda: store.read_rows(largest, ids, version=old)) for _ in range(5))
    store.close()
    with cnrstore.open(path) as store:  # retention, then GC
        store.retain(keep_last=5)
        store.gc()
        st = store.stats()
        out["keep5_disk"], out["keep5_live"], out["keep5_sa"] = st["bytes_on_disk"], st["live_bytes"], \
            st["space_amplification"]
        store.retain(keep_last=1)
        store.gc()
        st = store.stats()
        out["keep1_disk"], out["keep1_live"] = st["bytes_on_disk"], st["live_bytes"]
        out["keep1_reads_same"] = all(store.read_table(t).tobytes() == b for t, b in out["newest"].items())
    shutil.rmtree(path, ignore_errors=True)
    out["model"] = model
    return out


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def fp32_reference(model, root: str) -> tuple[int, float]:
    """(bytes of torch.save of the embedding tables' fp32 state, torch.load of it: median of 7, warm),
    measured once per run so that every policy is compared with the same reference."""
    path = os.path.join(root, "fp32.pt")
    state = {k: v for k, v in model.state_dict().items() if k.startswith("embs.")}
    torch.save(state, path)
    size = os.path.getsize(path)
    torch.load(path)  # warm: the restores it is compared with read a store in the page cache
    load_s = median(_timed(lambda: torch.load(path)) for _ in range(7))
    os.remove(path)
    return size, load_s


def fmt_mb(n: float) -> str:
    return f"{n / 1e6:,.1f} MB"


def report(results: dict, args, seconds: float, start_load: str) -> str:
    lines = ["## Space management: bytes written, disk and read cost", ""]
    lines += [f"- {line}" for line in machine_description()]
    lines += [f"- workload: DLRM of tools/train_dlrm.py, 26 tables capped at {args.max_rows:,} rows, dim "
              f"{args.dim}, {CODEC}, SGD lr {args.lr}, batch {args.batch_size}; a full save, then "
              f"{args.intervals} intervals of {args.steps} steps, an incremental save after each; seed {args.seed}",
              f"- load average at start: {start_load}; at end: {load_average()}; total run {seconds:.0f} s",
              "- policies: none = plain increments, no merges (chains grow without end); chains-3 = every save "
              "merges to hold each read chain at 3 records (the engine of 2026-11 before background merges); default = the package's "
              f"knobs: saves write their own rows, background merges past read amplification {knobs.MERGE_TRIGGER}, "
              f"hard bound {knobs.READ_AMP_BOUND} (compaction='auto' for the last two)",
              "- write amplification = stats()['write_amplification']: all bytes appended / bytes the "
              "checkpoints' records would take holding only their own rows", ""]
    full = results[next(iter(results))]["full_fp32"]
    ceiling = 256 / 36  # fp32 bytes of a dim-64 row over adaptive4's bytes of it (the codec's ceiling)
    lines += [f"One full fp32 checkpoint of the embedding tables (torch.save): {fmt_mb(full)}; the codec's "
              f"ceiling is {ceiling:.1f}x below it ({args.dim}-dim rows: 4·dim fp32 bytes over adaptive4's).", ""]
    lines += ["| measurement | " + " | ".join(results) + " | goal |", "|---|" + "---|" * len(results) + "---|"]

    def row(label, fn, goal=""):
        lines.append(f"| {label} | " + " | ".join(fn(r) for r in results.values()) + f" | {goal} |")

    row("bytes appended after the first save", lambda r: fmt_mb(r["after_first"]))
    row(f"... below {args.intervals} full fp32 checkpoints", lambda r: f"{args.intervals * full / r['after_first']:.1f}x",
        ">= 30x")
    row("... by the saves", lambda r: fmt_mb(r["save_bytes"]))
    row("... by background merges", lambda r: fmt_mb(r["merge_bytes"]))
    row("write amplification (all appended / own rows)", lambda r: f"{r['wa']:.2f}", "<= 1.3")
    row("longest read chain of any version, end", lambda r: str(r["max_chain"]))
    row("largest read amplification of a block (newest version), any interval",
        lambda r: f"{max(r['amp']):.2f}", f"<= {knobs.READ_AMP_BOUND}")
    row("retain(5); gc(): disk / live (space amplification)", lambda r: f"{r['keep5_sa']:.2f}", "<= 1.5")
    row("retain(1); gc(): disk", lambda r: fmt_mb(r["keep1_disk"]))
    row("... below one full fp32 checkpoint", lambda r: f"{full / r['keep1_disk']:.2f}x", ">= 6.4x")
    row("... of the codec's ceiling", lambda r: f"{full / r['keep1_disk'] / ceiling:.2f}", ">= 0.9")
    row("restore(newest), median", lambda r: f"{r['restore_s'] * 1e3:.0f} ms")
    if "chains-3" in results:
        ref = results["chains-3"]["restore_s"]
        row("... against chains-3's restore (same run)", lambda r: f"{r['restore_s'] / ref:.2f}x",
            "default <= 1.1x")
    row(f"... against torch.load of the fp32 state ({next(iter(results.values()))['load_s'] * 1e3:.0f} ms, warm)",
        lambda r: f"{r['load_s'] / r['restore_s']:.2f}x", ">= 1.0x")
    row("10,000 random point reads, older version", lambda r: f"{r['points_s'] * 1e3:.1f} ms", "<= 10 ms")
    row("trainer save (snapshot to durable), median", lambda r: f"{median(r['save_s'][1:]) * 1e3:.0f} ms")
    row("background compaction errors", lambda r: str(r["compaction_errors"]))
    lines.append("")
    names = list(results)
    same = all(results[n]["newest"] == results[names[0]]["newest"] for n in names[1:])
    kept = all(r["keep1_reads_same"] for r in results.values())
    lines.append(f"- newest version of every policy reads bit-identically: {'yes' if same else 'NO'}; and after "
                 f"retain(1); gc(): {'yes' if kept else 'NO'}.")
    for n, r in results.items():
        lines.append(f"- {n}, per interval: written " + ", ".join(f"{w / 1e6:.1f}" for w in r["written"])
                     + " MB; disk " + ", ".join(f"{d / 1e6:.1f}" for d in r["disk"]) + " MB; max chain "
                     + ", ".join(map(str, r["chain"])) + "; max read amplification "
                     + ", ".join(f"{a:.2f}" for a in r["amp"]))
    lines.append("")
    return "\n".join(lines)


def plot(results: dict, path: str) -> str | None:
    panels = three_panels((13, 3.6))
    if panels is None:
        return "matplotlib is not installed: no plot"
    fig, axes = panels
    for name, r in results.items():
        axes[0].plot(r["intervals"], np.array(r["written"]) / 1e6, marker="o", label=name)
        axes[1].plot(r["intervals"], np.array(r["disk"]) / 1e6, marker="o", label=name)
        axes[2].plot(r["intervals"], r["amp"], marker="o", label=name)
    axes[0].set_title("bytes appended (cumulative, MB)")
    axes[1].set_title("disk (MB)")
    axes[2].set_title("largest read amplification (newest)")
    if knobs.READ_AMP_BOUND:
        axes[2].axhline(knobs.READ_AMP_BOUND, color="gray", linestyle=":", linewidth=1)
    axes[0].legend(loc="upper left", fontsize=8)
    save_panels(fig, axes, "interval", path)
    return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small smoke run (< 1 minute)")
    p.add_argument("--intervals", type=int, default=None, help="checkpoint intervals (default 10; --quick 4)")
    p.add_argument("--steps", type=int, default=None, help="training steps per interval (default 30; --quick 5)")
    p.add_argument("--batch-size", type=int, default=None, help="samples per step (default 2048; --quick 512)")
    p.add_argument("--max-rows", type=int, default=None, help="rows per table at most (default 100,000; --quick 5,000)")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reps", type=int, default=3, help="restores per measurement (median)")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--tmp", default=None, help="directory for the stores (default: system temp)")
    p.add_argument("--out", default=None, help="also write the markdown to FILE")
    p.add_argument("--plot", default=None, help="write a PNG (needs matplotlib); 'none' for no plot")
    args = p.parse_args(argv)
    args.intervals = args.intervals or (4 if args.quick else 10)
    args.steps = args.steps or (5 if args.quick else 30)
    args.batch_size = args.batch_size or (512 if args.quick else 2048)
    args.max_rows = args.max_rows or (5_000 if args.quick else 100_000)
    torch.set_num_threads(2)
    start_load = load_average()
    t0 = time.monotonic()
    results = {}
    root = tempfile.mkdtemp(prefix="cnr-space-", dir=args.tmp)
    try:
        for name in args.policies.split(","):
            print(f"policy {name} ...", flush=True)
            results[name] = run_policy(name, args, root)
        size, load_s = fp32_reference(results[name].pop("model"), root)
        for r in results.values():
            r.pop("model", None)
            r["full_fp32"], r["load_s"] = size, load_s
    finally:
        shutil.rmtree(root, ignore_errors=True)
    text = report(results, args, time.monotonic() - t0, start_load)
    if args.plot and args.plot != "none":
        note = plot(results, os.path.join(HERE, args.plot) if not os.path.isabs(args.plot) else args.plot)
        text += f"\n![bytes written, disk and read amplification per interval]({os.path.basename(args.plot)})\n" \
            if note is None else f"\n*{note}*\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
