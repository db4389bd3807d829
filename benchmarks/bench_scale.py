#!/usr/bin/env python3
"""Scale curves (issue 15): how cnrstore's costs grow with the work, and where they grow faster than it.

Three sweeps, each in fresh stores opened with the store's defaults (``cnrstore.open(path, create=True)``:
``compaction=None``; the writer bounds read chains itself with cumulative deltas at
``knobs.READ_CHAIN_BOUND``), one int4 table of dim 16 fp32 rows (random values):

  1. table size: 1M, 2M, 4M, 8M, 16M rows (16M x 16 fp32 = 1 GiB). Full write (put_rows + commit, fsync
     included), bytes per save, an incremental save of 1% of the rows, restore of the whole table
     (read_table) at the baseline and at the newest version (chain of 2) against torch.load of the same
     fp32 tensor saved with torch.save (same run, page cache warm), 10,000 random point reads, a readonly
     open + close, ``cnrstore ls`` (its listing function) and stats(), index bytes, and the peak memory of a
     restore against the bytes it returns (peak RSS growth in a fresh process: the read path decodes with
     FBGEMM's kernel into torch-allocated memory, which tracemalloc cannot see).
  2. versions: a 200k-row table, a baseline then incremental saves of 1% random rows up to 1,000 versions;
     at 10, 30, 100, 300 and 1,000 versions: open + close, ls, stats(), restore of the newest, 10,000
     point reads at the newest and at the first increment, index bytes, bytes on disk, read chains, and
     the time and bytes of the saves made since the previous mark.
  3. touched fraction: a 2M-row table, a baseline, then one incremental save of 0.1% .. 50% of the rows
     (uniform random): bytes per save, bytes per touched row, save time and throughput, restore of the newest.

Every curve gets a growth exponent: the slope of a least-squares line through log(cost) against
log(work). The report flags a metric that grows faster than the work (exponent > 1.1) and one that
should not grow at all but does (exponent > 0.3 where O(1) is expected).

    python benchmarks/bench_scale.py                       # full run (about 3 minutes on 2 cores)
    python benchmarks/bench_scale.py --quick --plot none   # smoke run (< 25 s)
    python benchmarks/bench_scale.py --out FILE --plot benchmarks/scale.png
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
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import fmt_bytes, load_average, machine_description, median, publish  # noqa: E402

import cnrstore  # noqa: E402
from cnrstore import cli, knobs  # noqa: E402

TABLE = "emb"
DIM = 16
CODEC = "int4"
POINT_ROWS = 10_000
INC_FRACTION = 0.01
FAST = 1.1  # exponent above which a cost grows faster than the work
FLAT = 0.3  # exponent above which a cost expected O(1) is reported as growing

SIZES_FULL = [1 << 20, 2 << 20, 4 << 20, 8 << 20, 16 << 20]
SIZES_QUICK = [125_000, 250_000, 500_000]
MARKS_FULL = [10, 30, 100, 300, 1000]
MARKS_QUICK = [10, 30, 100]
FRACTIONS = [0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 0.5]


# -- helpers --------------------------------------------------------------------------------------

def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def med_time(fn, reps: int) -> float:
    return median(timed(fn) for _ in range(reps))


def best_time(fn, reps: int) -> float:
    """Fastest of ``reps`` calls: for the short operations (open, ls, stats, point reads), whose median on a
    shared, loaded machine grows with their length only because a longer call is more likely to lose its
    core to another process for a time slice (timeit's convention)."""
    return min(timed(fn) for _ in range(reps))


def fmt_s(seconds: float) -> str:
    if seconds < 0.01:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e3:.0f} ms" if seconds < 10 else f"{seconds:.1f} s"


def fmt_rows(n: float) -> str:
    """1M, 2M, 125k, 0.5M ... (binary millions for the powers of two of the size sweep)."""
    if n >= 1 << 20 and n % (1 << 20) == 0:
        return f"{n // (1 << 20)}M"
    if n >= 1_000_000:
        return f"{n / 1e6:g}M"
    if n >= 1000:
        return f"{n / 1e3:g}k"
    return f"{n:g}"


def fmt_pct(f: float) -> str:
    return f"{f * 100:g}%"


def exponent(xs, ys) -> float | None:
    """Slope of the least-squares line through (log x, log y); None if a y is not positive."""
    xs, ys = np.asarray(xs, dtype=float), np.asarray(ys, dtype=float)
    if len(xs) < 2 or not np.all(ys > 0):
        return None
    return float(np.polyfit(np.log(xs), np.log(ys), 1)[0])


def exponent_se(xs, ys) -> float | None:
    """Standard error of :func:`exponent` (from the fit's residuals; None below 3 points)."""
    xs, ys = np.log(np.asarray(xs, dtype=float)), np.asarray(ys, dtype=float)
    if len(xs) < 3 or not np.all(ys > 0):
        return None
    ys = np.log(ys)
    slope, icpt = np.polyfit(xs, ys, 1)
    resid = ys - (slope * xs + icpt)
    return float(np.sqrt(resid @ resid / (len(xs) - 2) / ((xs - xs.mean()) @ (xs - xs.mean()))))


def expected_blocks(n: int, block_rows: int, k: int) -> float:
    """Expected number of distinct blocks that ``k`` uniformly random rows of ``n`` fall in."""
    blocks = -(-n // block_rows)
    return blocks * (1 - (1 - 1 / blocks) ** k)


def filesystem_of(path: str) -> str:
    """'<fstype> (<device> on <mount point>)' of the mount holding ``path``, from /proc/mounts."""
    path = os.path.realpath(path)
    best = ("", "unknown", "?")
    try:
        with open("/proc/mounts") as f:
            for line in f:
                dev, mnt, fstype, *_ = line.split()
                mnt = mnt.replace("\\040", " ")
                if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best[0]):
                    best = (mnt, fstype, dev)
    except OSError:
        pass
    return f"{best[1]} ({best[2]} on {best[0] or '?'})"


def index_used_bytes(store) -> int:
    """Bytes of the LMDB B-tree pages in use (as bench_engine's d.): the index's real size, without the
    file's free pages."""
    return store.engine.index_space()["used_bytes"]


def open_close(path: str) -> None:
    cnrstore.open(path, readonly=True).close()


def write_version(store, rows: np.ndarray, values: np.ndarray, step: int) -> tuple[float, int]:
    """(seconds of put_rows + commit, bytes the version appended)."""
    ck = store.checkpoint(step=step)
    t0 = time.perf_counter()
    ck.put_rows(TABLE, rows, values)
    ck.commit()
    return time.perf_counter() - t0, store.latest().bytes


def touched_rows(rng: np.random.Generator, n: int, fraction: float) -> np.ndarray:
    return np.sort(rng.choice(n, max(1, int(round(fraction * n))), replace=False))


def perturbed(rng: np.random.Generator, values: np.ndarray, rows: np.ndarray) -> np.ndarray:
    return values[rows] + rng.standard_normal((rows.size, DIM), dtype=np.float32) * np.float32(1e-3)


# peak memory of a restore, in a fresh process: torch is imported as in this one, so read_table decodes
# with FBGEMM's kernel (torch-allocated output, invisible to tracemalloc); glibc's mmap threshold is fixed
# so that every large buffer is mapped and unmapped (no reuse of freed heap hides a peak)
MEM_CHILD = r"""
import json, sys, tracemalloc
import torch  # noqa: F401  (the benchmark's read path: FBGEMM's unpack kernel)
import cnrstore

def status():
    d = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmRSS", "VmHWM", "RssFile", "RssAnon"):
                d[k] = int(v.split()[0]) * 1024
    return d

def reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")

out = []
for path, table, versions in json.loads(sys.argv[1]):
    res = {}
    with cnrstore.open(path, readonly=True) as s:
        for label, v in versions:
            before = status()
            reset_peak()
            a = s.read_table(table, version=v)
            after = status()
            res[label] = {"returned": a.nbytes, "peak": after["VmHWM"] - before["VmRSS"],
                          "file": after["RssFile"] - before["RssFile"]}
            del a
        tracemalloc.start()
        a = s.read_table(table)
        res["traced"] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        del a
    out.append(res)
print(json.dumps(out))
"""


def restore_memory(jobs: list) -> list[dict]:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", MALLOC_TRIM_THRESHOLD_="131072")
    proc = subprocess.run([sys.executable, "-c", MEM_CHILD, json.dumps(jobs)], capture_output=True, text=True,
                          env=env, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"memory probe failed: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# -- 1. table size ----------------------------------------------------------------------------------

def sweep_size(args, root: str, values_all: np.ndarray, rng) -> list[dict]:
    out = []
    kept = []
    for n in args.sizes:
        values = values_all[:n]
        fp32 = n * DIM * 4
        log(f"1. size {fmt_rows(n)} rows ({fmt_bytes(fp32)} fp32)")
        rows = np.arange(n, dtype=np.int64)
        path = os.path.join(root, f"size-{n}")
        writes, incs = [], []
        for r in range(args.repeat):
            shutil.rmtree(path, ignore_errors=True)
            store = cnrstore.open(path, create=True)
            store.create_table(TABLE, n, DIM, codec=CODEC)
            t, nbytes = write_version(store, rows, values, 0)
            writes.append(t)
            inc = touched_rows(rng, n, INC_FRACTION)
            t, inc_bytes = write_version(store, inc, perturbed(rng, values, inc), 1)
            incs.append(t)
            if r < args.repeat - 1:
                store.close()
        inc_s = median(incs)
        v_base, v_new = [v.version for v in store.versions()]
        st = store.stats()
        used = index_used_bytes(store)
        block_rows = store.tables()[TABLE].block_rows
        store.close()
        log(f"   write {fmt_s(median(writes))} ({', '.join(fmt_s(t) for t in writes)}), 1% save {fmt_s(inc_s)}")

        pt = os.path.join(root, "table.pt")
        torch.save(torch.from_numpy(values), pt)
        pt_bytes = os.path.getsize(pt)
        load = lambda: torch.load(pt, weights_only=True)  # noqa: E731
        t_open = best_time(lambda: open_close(path), args.repeat_fast)
        with cnrstore.open(path, readonly=True) as s:
            t_ls = best_time(lambda: cli.versions_rows(s), args.repeat_fast)
            t_stats = best_time(s.stats, args.repeat_fast)
            # warm-up: page cache and mappings of both; the restore must match the input to int4 precision
            ref = load().numpy()
            got = s.read_table(TABLE, version=v_base)
            err = float(np.abs(got - ref).max())
            del got, ref
            t_load, t_base, t_new = [], [], []
            s.read_table(TABLE)
            for _ in range(args.repeat):  # interleaved: A B C A B C ...
                t_load.append(timed(load))
                t_base.append(timed(lambda: s.read_table(TABLE, version=v_base)))
                t_new.append(timed(lambda: s.read_table(TABLE)))
            point = [rng.choice(n, min(POINT_ROWS, n), replace=False) for _ in range(args.repeat_fast)]
            s.read_rows(TABLE, point[0])  # warm-up
            t_point = min(timed(lambda: s.read_rows(TABLE, p)) for p in point)
        os.remove(pt)
        log(f"   read_table {fmt_s(median(t_base))} / newest {fmt_s(median(t_new))}, torch.load "
            f"{fmt_s(median(t_load))}; 10k points {fmt_s(t_point)}; open {fmt_s(t_open)}, ls {fmt_s(t_ls)}")
        kept.append([path, TABLE, [["base", v_base], ["newest", v_new]]])
        out.append({
            "rows": n, "fp32": fp32, "block_rows": block_rows, "write_s": median(writes), "writes": writes,
            "save_bytes": nbytes, "inc_s": inc_s, "incs": incs, "inc_bytes": inc_bytes, "inc_rows": inc.size,
            "disk": st["bytes_on_disk"], "index_bytes": st["index_bytes"], "index_used": used,
            "index_entries": st["index_entries"], "chain": st["max_read_chain"], "pt_bytes": pt_bytes,
            "load_s": median(t_load), "base_s": median(t_base), "new_s": median(t_new), "point_s": t_point,
            "open_s": t_open, "ls_s": t_ls, "stats_s": t_stats, "err": err,
        })
    log("1. peak memory of restores (fresh process) ...")
    for r, m in zip(out, restore_memory(kept)):
        r["mem"] = m
    for path, _t, _v in kept:
        shutil.rmtree(path, ignore_errors=True)
    return out


# -- 2. versions ------------------------------------------------------------------------------------

def sweep_versions(args, root: str, values_all: np.ndarray, rng) -> list[dict]:
    n = args.version_rows
    values = values_all[:n].copy()  # trained in place
    path = os.path.join(root, "versions")
    marks = args.marks
    log(f"2. versions: {n:,} rows, 1% increments up to {marks[-1]:,} versions")
    store = cnrstore.open(path, create=True)
    store.create_table(TABLE, n, DIM, codec=CODEC)
    write_version(store, np.arange(n), values, 0)
    count = 1
    out = []
    window_s, window_b = [], []
    old = None
    t_build = time.perf_counter()
    for mark in marks:
        while count < mark:
            rows = touched_rows(rng, n, INC_FRACTION)
            values[rows] = perturbed(rng, values, rows)
            t, b = write_version(store, rows, values[rows], count)
            window_s.append(t)
            window_b.append(b)
            count += 1
        if old is None:
            old = store.versions()[1].version  # the first increment
        st = store.stats()
        used = index_used_bytes(store)
        store.close()
        t_open = best_time(lambda: open_close(path), args.repeat_fast)
        with cnrstore.open(path, readonly=True) as s:
            t_ls = best_time(lambda: cli.versions_rows(s), args.repeat_fast)
            t_stats = best_time(s.stats, args.repeat_fast)
            s.read_table(TABLE)  # warm-up
            t_read = med_time(lambda: s.read_table(TABLE), args.repeat)
            point = [rng.choice(n, min(POINT_ROWS, n), replace=False) for _ in range(args.repeat_fast)]
            s.read_rows(TABLE, point[0])
            s.read_rows(TABLE, point[0], version=old)
            t_new = min(timed(lambda: s.read_rows(TABLE, p)) for p in point)
            t_old = min(timed(lambda: s.read_rows(TABLE, p, version=old)) for p in point)
        out.append({
            "versions": mark, "open_s": t_open, "ls_s": t_ls, "stats_s": t_stats, "read_s": t_read,
            "point_new_s": t_new, "point_old_s": t_old, "index_bytes": st["index_bytes"], "index_used": used,
            "index_entries": st["index_entries"], "disk": st["bytes_on_disk"], "chain": st["max_read_chain"],
            "save_s": median(window_s), "save_bytes": float(np.mean(window_b)), "save_bytes_max": max(window_b),
            "wa": st["write_amplification"], "old": old,
        })
        log(f"   {mark:,} versions: open {fmt_s(t_open)}, ls {fmt_s(t_ls)}, stats {fmt_s(t_stats)}, read_table "
            f"{fmt_s(t_read)}, points {fmt_s(t_new)} / old {fmt_s(t_old)}, chain {st['max_read_chain']}, save "
            f"{fmt_s(median(window_s))}, {fmt_bytes(np.mean(window_b))}/save")
        window_s, window_b = [], []
        if mark != marks[-1]:
            store = cnrstore.open(path)
    out[-1]["build_s"] = time.perf_counter() - t_build
    shutil.rmtree(path, ignore_errors=True)
    return out


# -- 3. touched fraction ----------------------------------------------------------------------------

def sweep_fraction(args, root: str, values_all: np.ndarray, rng) -> tuple[list[dict], dict]:
    n = args.fraction_rows
    values = values_all[:n]
    base = os.path.join(root, "fraction-base")
    log(f"3. touched fraction: {n:,} rows, one incremental save of {', '.join(fmt_pct(f) for f in FRACTIONS)}")
    with cnrstore.open(base, create=True) as store:
        store.create_table(TABLE, n, DIM, codec=CODEC)
        base_s, base_bytes = write_version(store, np.arange(n), values, 0)
    out = []
    path = os.path.join(root, "fraction")
    for f in FRACTIONS:
        times, sizes = [], []
        for _ in range(args.repeat):
            shutil.rmtree(path, ignore_errors=True)
            shutil.copytree(base, path)
            rows = touched_rows(rng, n, f)
            new = perturbed(rng, values, rows)
            with cnrstore.open(path) as store:
                t, b = write_version(store, rows, new, 1)
            times.append(t)
            sizes.append(b)
        with cnrstore.open(path, readonly=True) as s:
            s.read_table(TABLE)
            t_read = med_time(lambda: s.read_table(TABLE), args.repeat)
            chain = s.stats()["max_read_chain"]
        shutil.rmtree(path, ignore_errors=True)
        k = rows.size
        out.append({"fraction": f, "rows": k, "save_s": median(times), "save_bytes": median(sizes),
                    "per_row": median(sizes) / k, "gbs": k * DIM * 4 / 1e9 / median(times), "read_s": t_read,
                    "chain": chain})
        log(f"   {fmt_pct(f)} ({k:,} rows): save {fmt_s(median(times))}, {fmt_bytes(median(sizes))} "
            f"({median(sizes) / k:.1f} B/row), restore newest {fmt_s(t_read)}")
    shutil.rmtree(base, ignore_errors=True)
    return out, {"rows": n, "base_s": base_s, "base_bytes": base_bytes}


# -- report -----------------------------------------------------------------------------------------

def verdict(exp: float | None, expected: str) -> str:
    if exp is None:
        return "-"
    if exp > FAST:
        return "**faster than the work**"
    if expected == "O(1)" and exp > FLAT:
        return "**grows (expected flat)**"
    return "ok"


def exponent_rows(work_name: str, xs, metrics) -> tuple[list[str], list[tuple]]:
    """metrics: [(name, ys, expected)] -> markdown rows and [(name, exponent, expected, verdict)]."""
    lines = [f"| metric (against {work_name}) | expected | exponent ± s.e. | range measured | verdict |",
             "|---|---|---:|---|---|"]
    fits = []
    for name, ys, expected, fmt in metrics:
        e = exponent(xs, ys)
        v = verdict(e, expected)
        fits.append((name, e, expected, v, list(xs), list(ys), f"{fmt(ys[0])} → {fmt(ys[-1])}"))
        se = exponent_se(xs, ys)
        lines.append(f"| {name} | {expected} | {'-' if e is None else f'{e:.2f}'}"
                     f"{'' if se is None else f' ± {se:.2f}'} | "
                     f"{fmt(ys[0])} → {fmt(ys[-1])} | {v} |")
    return lines, fits


def report(args, size, versions, fraction, fbase, seconds: float, load_start: str, tmpdir: str) -> tuple[str, dict]:
    lines = ["## Scale curves: how costs grow with the work", ""]
    lines += [f"- {line}" for line in machine_description()]
    lines += [
        f"- load average (1/5/15 min) at start: {load_start}; at end: {load_average()} (a shared machine); "
        f"total run {seconds:.0f} s{' (--quick)' if args.quick else ''}",
        f"- stores in {tmpdir}: {filesystem_of(tmpdir)}; writes include the fsync of the log and the synced "
        "LMDB commit; reads are warm (the store and the torch.save file were just written, and each is read "
        "once untimed before timing)",
        f"- one table of dim {DIM}, fp32 input, codec {CODEC} ({cnrstore.codecs.get(CODEC).row_bytes(DIM)} B/row "
        f"encoded), random values; store defaults: `cnrstore.open(path, create=True)` (compaction=None, no "
        f"background work), the writer bounds read chains at knobs.READ_CHAIN_BOUND = {knobs.READ_CHAIN_BOUND} "
        "with cumulative deltas; no retention (every version kept)",
        f"- writes and restores: median of {args.repeat} reps; the short operations (open + close, ls, stats(), "
        f"10k point reads): best of {args.repeat_fast}, as timeit does, since on a loaded machine a longer call is "
        "likelier to lose its core for a time slice, which would bend the curves",
        "- growth exponent = slope of the least-squares line through log(cost) against log(work), ± its standard "
        "error from the fit's residuals (the machine's noise shows there); "
        f"flagged when > {FAST} (faster than the work), or > {FLAT} where the cost should be O(1)",
        "",
    ]
    fits_all = {}

    # 1. size
    xs = [r["rows"] for r in size]
    lines += [f"### 1. Table size ({', '.join(fmt_rows(x) for x in xs)} rows x {DIM})", "",
              f"A fresh store per size; block_rows {size[0]['block_rows']:,} (the engine's default). Write = put_rows "
              "+ commit of the whole table; 1% save = one incremental save of 1% random rows after it; restore = "
              "read_table of the whole table at the baseline and at the newest version (baseline + the 1% save: "
              "chain 2); torch.load of the same fp32 tensor saved with torch.save in the same run.", "",
              "| rows | blocks | fp32 | write | GB/s of fp32 in | bytes/save | disk | 1% save | 1% save bytes | "
              "index (stats / used pages) |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in size:
        lines.append(f"| {fmt_rows(r['rows'])} | {-(-r['rows'] // r['block_rows']):,} | {fmt_bytes(r['fp32'])} | "
                     f"{fmt_s(r['write_s'])} | "
                     f"{r['fp32'] / 1e9 / r['write_s']:.2f} | {fmt_bytes(r['save_bytes'])} "
                     f"({r['save_bytes'] / r['rows']:.2f} B/row) | {fmt_bytes(r['disk'])} | {fmt_s(r['inc_s'])} | "
                     f"{fmt_bytes(r['inc_bytes'])} | {fmt_bytes(r['index_bytes'])} / {fmt_bytes(r['index_used'])} |")
    lines += ["", "| rows | restore baseline | restore newest (chain 2) | torch.load | torch.load / restore | "
              "10k point reads | open+close | ls | stats() | restore peak RSS / returned: baseline (anon), newest |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in size:
        mb, mn = r["mem"]["base"], r["mem"]["newest"]
        lines.append(f"| {fmt_rows(r['rows'])} | {fmt_s(r['base_s'])} | {fmt_s(r['new_s'])} | {fmt_s(r['load_s'])} | "
                     f"{r['load_s'] / r['new_s']:.2f}x | {fmt_s(r['point_s'])} | {fmt_s(r['open_s'])} | "
                     f"{fmt_s(r['ls_s'])} | {fmt_s(r['stats_s'])} | {mb['peak'] / mb['returned']:.2f} "
                     f"({(mb['peak'] - mb['file']) / mb['returned']:.2f}), {mn['peak'] / mn['returned']:.2f} |")
    peak = lambda r: r["mem"]["newest"]["peak"]  # noqa: E731
    b = lambda v: fmt_bytes(v)  # noqa: E731
    lines.append("")
    tbl, fits = exponent_rows("table rows", xs, [
        ("write time (put_rows + commit)", [r["write_s"] for r in size], "O(n)", fmt_s),
        ("bytes per full save", [r["save_bytes"] for r in size], "O(n)", b),
        ("1% incremental save: time", [r["inc_s"] for r in size], "O(n)", fmt_s),
        ("1% incremental save: bytes", [r["inc_bytes"] for r in size], "O(n)", b),
        ("restore (read_table), baseline", [r["base_s"] for r in size], "O(n)", fmt_s),
        ("restore (read_table), newest, chain 2", [r["new_s"] for r in size], "O(n)", fmt_s),
        ("torch.load (reference)", [r["load_s"] for r in size], "O(n)", fmt_s),
        ("10k random point reads", [r["point_s"] for r in size], "O(1)", fmt_s),
        ("open + close (readonly)", [r["open_s"] for r in size], "O(1)", fmt_s),
        ("ls (versions + read chains)", [r["ls_s"] for r in size], "O(blocks)", fmt_s),
        ("stats()", [r["stats_s"] for r in size], "O(blocks)", fmt_s),
        ("index bytes, used pages", [r["index_used"] for r in size], "O(blocks)", b),
        ("bytes on disk", [r["disk"] for r in size], "O(n)", b),
        ("peak RSS growth of a restore", [peak(r) for r in size], "O(n)", b),
        ("peak RSS growth / bytes returned", [peak(r) / r["mem"]["newest"]["returned"] for r in size], "O(1)",
         lambda v: f"{v:.2f}"),
    ])
    fits_all["size"] = fits
    lines += ["Growth exponents:", "", *tbl, ""]
    r0, r1 = size[0], size[-1]
    lines += [
        f"- restore peak memory: measured in a fresh process that imports torch like this one (read_table then "
        f"decodes with FBGEMM's unpack kernel into torch-allocated memory, which tracemalloc does not see: it "
        f"traced only {fmt_bytes(r1['mem']['traced'])} at {fmt_rows(r1['rows'])} rows, numpy's buffers), "
        "as the growth of VmHWM over VmRSS before the call (peak reset through /proc/self/clear_refs; glibc's mmap "
        "threshold fixed at 128 KiB so freed buffers are returned, not reused). The baseline is read first: its "
        "figure includes the segment pages the read maps (file-backed, in the page cache; 'anon' leaves them "
        "out), which the newest version's read, next, finds mapped already. At "
        f"{fmt_rows(r1['rows'])} rows: baseline {r1['mem']['base']['peak'] / r1['mem']['base']['returned']:.2f}x, "
        f"newest {r1['mem']['newest']['peak'] / r1['mem']['newest']['returned']:.2f}x the "
        f"{fmt_bytes(r1['mem']['newest']['returned'])} returned.",
        f"- point reads: {POINT_ROWS:,} random rows fall in "
        + ", ".join(f"{expected_blocks(r['rows'], r['block_rows'], POINT_ROWS):,.0f}" for r in size)
        + " distinct blocks (expected) at these sizes; a point read checks the checksum of every record it reads whole (knobs.py), so its cost "
        "follows the blocks touched, not only the rows asked for.",
        f"- restores match the fp32 input to int4 precision: max |restored - fp32| {max(r['err'] for r in size):.3g}; "
        f"torch.save file {r1['pt_bytes'] / r1['fp32']:.3f}x the fp32 bytes at {fmt_rows(r1['rows'])}.",
        f"- write reps (ms) at {fmt_rows(r0['rows'])}: {', '.join(f'{t * 1e3:.0f}' for t in r0['writes'])} (1% "
        f"saves {', '.join(f'{t * 1e3:.0f}' for t in r0['incs'])}); at {fmt_rows(r1['rows'])}: "
        f"{', '.join(f'{t * 1e3:.0f}' for t in r1['writes'])} (1% saves {', '.join(f'{t * 1e3:.0f}' for t in r1['incs'])}).",
        f"- index: {r0['index_entries']:,} → {r1['index_entries']:,} row-index entries (one per block and version); "
        "stats()['index_bytes'] is the LMDB files (data.mdb + lock.mdb, with free pages), 'used pages' the "
        "B-tree pages in use.",
        "",
    ]

    # 2. versions
    xs = [r["versions"] for r in versions]
    last = versions[-1]
    lines += [f"### 2. Versions ({', '.join(f'{x:,}' for x in xs)})", "",
              f"One store of {args.version_rows:,} rows: a baseline, then saves of 1% random rows each (a "
              f"random walk on the touched rows); built in {last['build_s']:.0f} s. At each mark the writer is "
              f"closed and a readonly store opened for the reads; 'old' point reads are at v{last['old']} (the "
              "first increment). Save time and bytes: median time and mean bytes of the saves since the previous mark.",
              "", "| versions | open+close | ls | stats() | restore newest | 10k points newest | 10k points old | "
              "index (stats / used) | disk | longest read chain | save time | bytes/save (max) | write ampl. |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in versions:
        lines.append(f"| {r['versions']:,} | {fmt_s(r['open_s'])} | {fmt_s(r['ls_s'])} | {fmt_s(r['stats_s'])} | "
                     f"{fmt_s(r['read_s'])} | {fmt_s(r['point_new_s'])} | {fmt_s(r['point_old_s'])} | "
                     f"{fmt_bytes(r['index_bytes'])} / {fmt_bytes(r['index_used'])} | {fmt_bytes(r['disk'])} | "
                     f"{r['chain']} | {fmt_s(r['save_s'])} | {fmt_bytes(r['save_bytes'])} "
                     f"({fmt_bytes(r['save_bytes_max'])}) | {r['wa']:.2f} |")
    tbl, fits = exponent_rows("versions", xs, [
        ("open + close (readonly)", [r["open_s"] for r in versions], "O(1)", fmt_s),
        ("ls (versions + read chains)", [r["ls_s"] for r in versions], "O(versions)", fmt_s),
        ("stats()", [r["stats_s"] for r in versions], "O(versions)", fmt_s),
        ("restore (read_table) of the newest", [r["read_s"] for r in versions], "O(1)", fmt_s),
        ("10k point reads, newest", [r["point_new_s"] for r in versions], "O(1)", fmt_s),
        ("10k point reads, old version", [r["point_old_s"] for r in versions], "O(1)", fmt_s),
        ("index bytes, used pages", [r["index_used"] for r in versions], "O(versions)", b),
        ("bytes on disk", [r["disk"] for r in versions], "O(versions)", b),
        ("time per save", [r["save_s"] for r in versions], "O(1)", fmt_s),
        ("bytes per save", [r["save_bytes"] for r in versions], "O(1)", b),
        ("write amplification (all bytes appended / own rows)", [r["wa"] for r in versions], "O(1)",
         lambda v: f"{v:.2f}"),
        ("longest read chain", [r["chain"] for r in versions], "O(1)", str),
    ])
    fits_all["versions"] = fits
    lines += ["", "Growth exponents (the work is the number of versions; a listing, the index and the disk hold "
              "every version, so O(versions) is the expected growth there, and O(1) for what reads or writes one "
              "version):", "", *tbl, ""]

    # 3. touched fraction
    xs = [r["rows"] for r in fraction]
    lines += [f"### 3. Touched fraction ({', '.join(fmt_pct(r['fraction']) for r in fraction)} of "
              f"{fbase['rows']:,} rows)", "",
              f"A baseline ({fmt_bytes(fbase['base_bytes'])}, {fmt_s(fbase['base_s'])}), then one incremental save of "
              f"uniformly random rows, {args.repeat} reps each on a copy of the baseline store; restore = read_table "
              "of the newest.", "",
              "| touched | rows | bytes/save | of a full save | B per touched row | save time | GB/s of touched fp32 | restore newest |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in fraction:
        lines.append(f"| {fmt_pct(r['fraction'])} | {r['rows']:,} | {fmt_bytes(r['save_bytes'])} | "
                     f"{r['save_bytes'] / fbase['base_bytes']:.1%} | {r['per_row']:.2f} | {fmt_s(r['save_s'])} | "
                     f"{r['gbs']:.2f} | {fmt_s(r['read_s'])} |")
    tbl, fits = exponent_rows("touched rows", xs, [
        ("bytes per save", [r["save_bytes"] for r in fraction], "O(k)", b),
        ("save time (put_rows + commit)", [r["save_s"] for r in fraction], "O(k)", fmt_s),
        ("bytes per touched row", [r["per_row"] for r in fraction], "O(1)", lambda v: f"{v:.2f} B"),
        ("restore (read_table) of the newest", [r["read_s"] for r in fraction], "O(1)", fmt_s),
    ])
    fits_all["fraction"] = fits
    lines += ["", "Growth exponents (k = touched rows):", "", *tbl, ""]

    # conclusions, from the fits
    lines += ["### Where cost grows faster than the work", ""]
    sweep_names = {"size": "table size", "versions": "number of versions", "fraction": "touched fraction"}
    fast = [(sweep_names[s], n, e, xs, ys, span) for s, fits in fits_all.items() for n, e, _x, v, xs, ys, span in fits
            if v.startswith("**faster")]
    grows = [(sweep_names[s], n, e, span) for s, fits in fits_all.items() for n, e, _x, v, _xs, _ys, span in fits
             if v.startswith("**grows")]

    def per_unit(xs, ys) -> str:
        """Cost per unit of work at the first and last points, and the slope over the last two."""
        last = np.log(ys[-1] / ys[-2]) / np.log(xs[-1] / xs[-2])
        return (f"cost per unit of work {ys[-1] / xs[-1] / (ys[0] / xs[0]):.2f}x its value at the smallest point; "
                f"slope {last:.2f} over the last two points")

    if fast:
        lines.append("- Faster than the work (exponent > %.1f): " % FAST
                     + "; ".join(f"{n} against {s}, {span} (exponent {e:.2f}; {per_unit(xs, ys)})"
                                 for s, n, e, xs, ys, span in fast) + ".")
    else:
        top = max(((sweep_names[s], n, e) for s, fits in fits_all.items() for n, e, x, _v, _xs, _ys, _r in fits
                   if e is not None and x != "O(1)"), key=lambda t: t[2])
        lines.append(f"- No measured cost grows faster than its work: every exponent is at most {FAST}; the steepest "
                     f"is {top[1]} against {top[0]} ({top[2]:.2f}).")
    if grows:
        lines.append("- Costs that should not grow but do (expected O(1), exponent > %.1f): " % FLAT
                     + "; ".join(f"{n} against {s}, {span} (exponent {e:.2f})" for s, n, e, span in grows) + ".")
    else:
        lines.append(f"- Every cost expected O(1) stays within exponent {FLAT}.")
    sub = [(sweep_names[s], n, e) for s, fits in fits_all.items() for n, e, x, _v, _xs, _ys, _r in fits
           if e is not None and x in ("O(n)", "O(k)", "O(versions)") and e < 0.8]
    if sub:
        lines.append("- Sub-linear where linear was expected (a fixed cost such as a commit's fsync weighs at the "
                     "small end, or the shared machine's noise): "
                     + "; ".join(f"{n} against {s} ({e:.2f})" for s, n, e in sub) + ".")
    rel = [r["load_s"] / r["new_s"] for r in size]
    lines.append(f"- Restore of the newest against torch.load: {min(rel):.2f}x to {max(rel):.2f}x across sizes "
                 f"(exponents {exponent([r['rows'] for r in size], [r['new_s'] for r in size]):.2f} against "
                 f"{exponent([r['rows'] for r in size], [r['load_s'] for r in size]):.2f}).")
    lines.append("")
    return "\n".join(lines), fits_all


# -- plot -------------------------------------------------------------------------------------------

def plot(path: str, size, versions, fraction, fbase) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter, NullLocator
    except ImportError:
        return "matplotlib is not installed: no plot"

    def rel_fmt(v, _pos=None):
        return f"{v:g}×"

    def bytes_fmt(v, _pos=None):
        for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
            if v >= scale:
                return f"{v / scale:.3g} {unit}"
        return f"{v:.3g} B"

    def y_ticks(ax, lo, hi, fmt, mantissas=(1, 2, 5)):
        ticks = [m * 10.0 ** e for e in range(int(np.floor(np.log10(lo))) - 1, int(np.ceil(np.log10(hi))) + 1)
                 for m in mantissas]
        ticks = [t for t in ticks if lo / 1.05 <= t <= hi * 1.05]
        ax.yaxis.set_major_locator(FixedLocator(ticks))
        ax.yaxis.set_major_formatter(FuncFormatter(fmt))
        ax.yaxis.set_minor_locator(NullLocator())
        ax.yaxis.set_minor_formatter(NullFormatter())

    def x_ticks(ax, xs, labels):
        ax.xaxis.set_major_locator(FixedLocator(xs))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _p: labels.get(v, "")))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.xaxis.set_minor_formatter(NullFormatter())

    def rel_panel(ax, xs, series, title, xlabel, labels):
        lo, hi = 1.0, 1.0
        markers = "osD^v<>ph*Xd"
        for i, (name, ys) in enumerate(series):
            ys = np.asarray(ys, dtype=float)
            if not np.all(ys > 0):
                continue
            r = ys / ys[0]
            lo, hi = min(lo, r.min()), max(hi, r.max())
            e = exponent(xs, ys)
            ax.plot(xs, r, marker=markers[i % len(markers)], markersize=4, linewidth=1.3,
                    label=f"{name} (exp {e:.2f})")
        ref = np.asarray(xs, dtype=float) / xs[0]
        hi = max(hi, ref[-1])
        ax.plot(xs, ref, color="black", linestyle="--", linewidth=1, label="slope 1: cost ∝ work")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_ylim(lo / 1.3, hi * 1.3)
        x_ticks(ax, xs, labels)
        y_ticks(ax, lo / 1.3, hi * 1.3, rel_fmt)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(f"cost ÷ cost at {labels[xs[0]]}")
        ax.grid(alpha=0.3, which="major")
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), fontsize=8, ncol=1, frameon=False)

    fig, axes = plt.subplots(1, 3, figsize=(16, 8))
    xs = [r["rows"] for r in size]
    rel_panel(axes[0], xs, [
        ("write (put_rows + commit)", [r["write_s"] for r in size]),
        ("bytes per full save", [r["save_bytes"] for r in size]),
        ("restore newest (read_table)", [r["new_s"] for r in size]),
        ("torch.load, same fp32 table", [r["load_s"] for r in size]),
        ("10k random point reads", [r["point_s"] for r in size]),
        ("open + close", [r["open_s"] for r in size]),
        ("ls", [r["ls_s"] for r in size]),
        ("index bytes (used pages)", [r["index_used"] for r in size]),
        ("peak RSS growth of a restore", [r["mem"]["newest"]["peak"] for r in size]),
    ], f"1. table size (dim {DIM}, {CODEC})", "table rows", {x: fmt_rows(x) for x in xs})
    xs = [r["versions"] for r in versions]
    rel_panel(axes[1], xs, [
        ("open + close", [r["open_s"] for r in versions]),
        ("ls", [r["ls_s"] for r in versions]),
        ("stats()", [r["stats_s"] for r in versions]),
        ("restore newest (read_table)", [r["read_s"] for r in versions]),
        ("10k point reads, newest", [r["point_new_s"] for r in versions]),
        ("10k point reads, old version", [r["point_old_s"] for r in versions]),
        ("index bytes (used pages)", [r["index_used"] for r in versions]),
        ("bytes on disk", [r["disk"] for r in versions]),
        ("time per save", [r["save_s"] for r in versions]),
    ], f"2. versions ({fmt_rows(fbase['vrows'])} rows, 1% per save)", "versions",
        {x: f"{x:,}" for x in xs})

    ax = axes[2]
    xs = [r["fraction"] for r in fraction]
    ys = np.array([r["save_bytes"] for r in fraction], dtype=float)
    e = exponent([r["rows"] for r in fraction], ys)
    ax.plot(xs, ys, marker="o", markersize=5, linewidth=1.6, color="C0", label=f"bytes per incremental save (exp {e:.2f})")
    ax.plot(xs, ys[0] * np.asarray(xs) / xs[0], color="black", linestyle="--", linewidth=1,
            label="slope 1: bytes ∝ touched rows")
    full = fbase["base_bytes"]
    fp32 = fbase["rows"] * DIM * 4
    ax.axhline(full, color="C2", linestyle=":", linewidth=1.3, label=f"full int4 save ({bytes_fmt(full)})")
    ax.axhline(fp32, color="C3", linestyle=":", linewidth=1.3, label=f"full fp32 table ({bytes_fmt(fp32)})")
    ax.set_xscale("log")
    ax.set_yscale("log")
    lo, hi = min(ys.min(), full) / 1.5, max(ys.max(), fp32) * 1.5
    ax.set_ylim(lo, hi)
    x_ticks(ax, xs, {x: fmt_pct(x) for x in xs})
    ax.tick_params(axis="x", labelrotation=45)
    y_ticks(ax, lo, hi, bytes_fmt, mantissas=(1, 3))
    ax.set_title(f"3. touched fraction ({fmt_rows(fbase['rows'])} rows): bytes per save", fontsize=10)
    ax.set_xlabel("fraction of the rows touched since the baseline")
    ax.set_ylabel("bytes appended by the save")
    ax.grid(alpha=0.3, which="major")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.22), fontsize=8, ncol=1, frameon=False)
    fig.suptitle("cnrstore: cost against work (log-log; dashed = slope 1)", fontsize=11)
    fig.subplots_adjust(left=0.05, right=0.99, top=0.91, bottom=0.37, wspace=0.3)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return None


# -- main -------------------------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small sizes for a smoke run (< 25 s)")
    p.add_argument("--out", help="also write the markdown report to this file")
    p.add_argument("--plot", default=None, help="PNG to draw (needs matplotlib); 'none' for no plot")
    p.add_argument("--dir", default=None, help="where to put the temporary stores (default: the system temp dir)")
    p.add_argument("--repeat", type=int, default=None, help="reps of the slow measurements (median; default 3, "
                   "2 with --quick); the fast ones (open, ls, stats, point reads: best of) get at least 7 (5 with --quick)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.repeat is None:
        args.repeat = 2 if args.quick else 3
    args.repeat_fast = max(args.repeat, 5 if args.quick else 7)
    args.sizes = SIZES_QUICK if args.quick else SIZES_FULL
    args.marks = MARKS_QUICK if args.quick else MARKS_FULL
    args.version_rows = 200_000
    args.fraction_rows = 200_000 if args.quick else 2_000_000
    if args.repeat < 1:
        p.error("--repeat must be positive")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    load_start = load_average()
    rng = np.random.default_rng(args.seed)
    tmpdir = args.dir or tempfile.gettempdir()
    root = tempfile.mkdtemp(prefix="cnrstore-bench-scale-", dir=tmpdir)
    need = max(max(args.sizes), args.version_rows, args.fraction_rows)
    log(f"values: {need:,} x {DIM} fp32 ...")
    values = rng.random((need, DIM), dtype=np.float32)
    values -= np.float32(0.5)
    values *= np.float32(0.1)
    walls = {}
    try:
        t = time.perf_counter()
        size = sweep_size(args, root, values, rng)
        walls["size"], t = time.perf_counter() - t, time.perf_counter()
        versions = sweep_versions(args, root, values, rng)
        walls["versions"], t = time.perf_counter() - t, time.perf_counter()
        fraction, fbase = sweep_fraction(args, root, values, rng)
        walls["fraction"] = time.perf_counter() - t
        log("sweep walls: " + ", ".join(f"{k} {v:.1f} s" for k, v in walls.items()))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    fbase["vrows"] = args.version_rows
    md, _fits = report(args, size, versions, fraction, fbase, time.perf_counter() - t0, load_start, tmpdir)
    publish(md, args.out, args.plot, lambda path: plot(path, size, versions, fraction, fbase))
    log(f"total {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
