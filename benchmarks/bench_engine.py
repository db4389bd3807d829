#!/usr/bin/env python3
"""Engine benchmark: cnrstore side by side with a reference measured in the same run.

Machines here are shared and noisy, so every figure is the median of ``--repeat`` runs, and each
cnrstore figure is reported as a ratio against a reference measured in the same process, interleaved
with it (A B A B ...), so that drift hits both alike.

  a. int4 checkpoint write of N x 64 fp32 rows: put_rows + commit (fsync and index commit included)
     into a fresh store, against FBGEMM's 4-bit prepack kernel alone on the same rows.
  b. full-table read: store.read_table at the newest version (baseline + 9 increments, and a fresh
     baseline only), against torch.load of the same table saved fp32 with torch.save. Both warm: the
     files are in the page cache (one untimed warm-up call each before timing).
  c. 10k random point reads: store.read_rows at an old version (v5: baseline v1, 4 increments before,
     5 after) and at the newest, one call each; against a gather from the table in RAM (a floor).
  d. index bytes per stored row after workload (c): LMDB size over all rows stored in all versions.
  e. listing a long history: ``cnrstore ls`` (every version's read-chain length), a readonly open and
     stats() of a store of --versions versions (default 10,000; built on /dev/shm where it exists),
     against iterating the versions catalog (store.versions()) in the same run.

    python benchmarks/bench_engine.py                 # full run (a few minutes on 2 cores)
    python benchmarks/bench_engine.py --quick         # smoke run (< 30 s)
    python benchmarks/bench_engine.py --profile       # also cProfile the write and read paths
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import shutil
import sys
import tempfile
import time

import numpy as np
import torch

import cnrstore
from cnrstore.maintenance.compaction import block_chains as compaction_block_chains

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import fmt_list, fmt_s, load_average, machine_description, median, timed, zipf_rows  # noqa: E402

TABLE = "emb"
DIM = 64
INCREMENTS = 9
INCREMENT_FRACTION = 0.25
OLD_VERSION = 5
POINT_ROWS = 10_000


class Bench:
    def __init__(self, args):
        self.args = args
        self.rows: list[tuple] = []  # (measurement, cnrstore, reference, ratio, goal, met)
        self.notes: list[str] = []
        self.rng = np.random.default_rng(args.seed)
        self.n = args.rows
        self.fp32_bytes = self.n * DIM * 4
        self.root = tempfile.mkdtemp(prefix="cnrstore-bench-", dir=args.dir)
        self.block_rows = None  # as the engine chose it

    def log(self, msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    def add(self, measurement, ours, reference, ratio, goal, met) -> None:
        self.rows.append((measurement, ours, reference, ratio, goal, "-" if met is None else "yes" if met else "**no**"))

    # a. write ------------------------------------------------------------------------------------
    def bench_write(self, values: np.ndarray) -> None:
        n, reps = self.n, self.args.repeat
        self.log(f"a. write: {n:,} x {DIM} fp32 ({self.fp32_bytes / 1e9:.2f} GB) -> int4, {reps} reps")
        tensor = torch.from_numpy(values)
        torch.ops.quantized.embedding_bag_4bit_prepack(tensor)  # warm the kernel and the pages of values
        rows = np.arange(n, dtype=np.int64)
        ours_total, ours_put, ours_commit, ref = [], [], [], []
        for r in range(reps):
            t, _ = timed(lambda: torch.ops.quantized.embedding_bag_4bit_prepack(tensor))
            ref.append(t)
            path = os.path.join(self.root, f"write{r}")
            with cnrstore.open(path, create=True) as store:
                store.create_table(TABLE, n, DIM, codec="int4", block_rows=self.args.block_rows)
                ck = store.checkpoint(step=0)
                t0 = time.perf_counter()
                ck.put_rows(TABLE, rows, values)
                t1 = time.perf_counter()
                ck.commit()
                t2 = time.perf_counter()
                written = store.latest().bytes
            shutil.rmtree(path)
            ours_put.append(t1 - t0)
            ours_commit.append(t2 - t1)
            ours_total.append(t2 - t0)
            self.log(f"   rep {r + 1}: cnrstore {fmt_s(t2 - t0)} (put_rows {fmt_s(t1 - t0)}, commit "
                     f"{fmt_s(t2 - t1)}); prepack {fmt_s(t)}")
        ours, theirs = median(ours_total), median(ref)
        gbs = self.fp32_bytes / 1e9
        ratio = (gbs / ours) / (gbs / theirs)
        self.add(f"a. int4 checkpoint write, {n:,} x {DIM} (GB/s of fp32 input; time)",
                 f"{gbs / ours:.2f} GB/s ({fmt_s(ours)})", f"{gbs / theirs:.2f} GB/s ({fmt_s(theirs)}) "
                 "FBGEMM 4bit prepack alone", f"{ratio:.2f}", ">= 0.5", ratio >= 0.5)
        put, commit = median(ours_put), median(ours_commit)
        self.add("a'. write split: put_rows, then commit (fsync + LMDB commit)",
                 f"{fmt_s(put)}, then {fmt_s(commit)}", f"prepack {fmt_s(theirs)}",
                 f"put_rows/prepack {put / theirs:.2f}x", "-", None)
        self.notes.append(f"a. every rep (ms): cnrstore {fmt_list(ours_total)} (put_rows {fmt_list(ours_put)}; "
                          f"commit {fmt_list(ours_commit)}); prepack {fmt_list(ref)}.")
        self.notes.append(f"a. {written:,} bytes appended per write ({written / n:.1f} B/row; "
                          f"int4 payload is {cnrstore.codecs.get('int4').row_bytes(DIM)} B/row).")

    # workload for b, c, d ----------------------------------------------------------------------
    def build_workload(self, values: np.ndarray) -> dict:
        """Baseline v1 + INCREMENTS Zipf increments in one store; a baseline-only store of the final
        state; the final fp32 table saved with torch.save."""
        n = self.n
        self.log(f"workload: baseline + {INCREMENTS} increments of {INCREMENT_FRACTION:.0%} Zipf rows, {n:,} rows")
        table = values  # trained in place from here on
        perm = self.rng.permutation(n)
        inc_path = os.path.join(self.root, "incremental")
        store = cnrstore.open(inc_path, create=True)
        store.create_table(TABLE, n, DIM, codec="int4", block_rows=self.args.block_rows)
        rows_stored = 0
        self.block_rows = store.tables()[TABLE].block_rows
        for i in range(1 + INCREMENTS):
            if i == 0:
                rows = np.arange(n, dtype=np.int64)
            else:
                rows = zipf_rows(self.rng, perm, int(INCREMENT_FRACTION * n))
                table[rows] += self.rng.standard_normal((rows.size, DIM), dtype=np.float32) * np.float32(1e-3)
            with store.checkpoint(step=i, meta={"step": i}) as ck:
                ck.put_rows(TABLE, rows, table[rows])
            rows_stored += rows.size
        base_path = os.path.join(self.root, "baseline")
        base = cnrstore.open(base_path, create=True)
        base.create_table(TABLE, n, DIM, codec="int4", block_rows=self.args.block_rows)
        with base.checkpoint(step=INCREMENTS) as ck:
            ck.put_rows(TABLE, np.arange(n), table)
        pt_path = os.path.join(self.root, "table.pt")
        torch.save(torch.from_numpy(table), pt_path)
        return {"store": store, "base": base, "pt": pt_path, "table": table, "rows_stored": rows_stored}

    # b. full-table read ------------------------------------------------------------------------
    def bench_read_table(self, w: dict) -> None:
        reps = self.args.repeat
        store, base, pt = w["store"], w["base"], w["pt"]
        self.log(f"b. full-table read, {reps} reps (all warm)")
        load = lambda: torch.load(pt, weights_only=True)  # noqa: E731
        # warm-up (page cache, mmaps) and a correctness check: the incremental chain's newest version
        # reads exactly as a fresh baseline of the same final values
        ref_table = load().numpy()
        a, b = store.read_table(TABLE), base.read_table(TABLE)
        if not np.array_equal(a, b):
            raise SystemExit("read_table of the incremental store differs from the baseline store")
        err = float(np.abs(a - ref_table).max())
        self.notes.append(f"b. read_table(newest) of both stores is identical; max |int4 - fp32| = {err:.2e}.")
        del a, b, ref_table
        t_inc, t_base, t_load = [], [], []
        for r in range(reps):
            t_load.append(timed(load)[0])
            t_inc.append(timed(lambda: store.read_table(TABLE))[0])
            t_base.append(timed(lambda: base.read_table(TABLE))[0])
            self.log(f"   rep {r + 1}: read_table incremental {fmt_s(t_inc[-1])}, baseline {fmt_s(t_base[-1])}; "
                     f"torch.load {fmt_s(t_load[-1])}")
        self.notes.append(f"b. every rep (ms): read_table incremental {fmt_list(t_inc)}; baseline {fmt_list(t_base)}; "
                          f"torch.load {fmt_list(t_load)}.")
        ref = median(t_load)
        gb = self.fp32_bytes / 1e9
        for label, ts in ((f"newest of v1 baseline + {INCREMENTS} increments", t_inc), ("fresh baseline only", t_base)):
            ours = median(ts)
            self.add(f"b. read_table, {label} (time; GB/s of fp32 out)", f"{fmt_s(ours)} ({gb / ours:.2f} GB/s)",
                     f"{fmt_s(ref)} ({gb / ref:.2f} GB/s) torch.load fp32, warm", f"{ref / ours:.2f}x",
                     ">= 1.0x", ref / ours >= 1.0)

    # c. point reads ------------------------------------------------------------------------------
    def bench_point_reads(self, w: dict) -> None:
        reps, n = self.args.repeat, self.n
        store, table = w["store"], w["table"]
        newest = store.latest().version
        k = min(POINT_ROWS, n)
        self.log(f"c. {k:,} random point reads per call, at v{OLD_VERSION} and at newest v{newest}, {reps} reps")
        store.read_rows(TABLE, self.rng.choice(n, k, replace=False), version=OLD_VERSION)  # warm-up
        t_old, t_new, t_ram = [], [], []
        for r in range(reps):
            rows = self.rng.choice(n, k, replace=False)
            t_ram.append(timed(lambda: table[rows])[0])
            t_old.append(timed(lambda: store.read_rows(TABLE, rows, version=OLD_VERSION))[0])
            t_new.append(timed(lambda: store.read_rows(TABLE, rows))[0])
            self.log(f"   rep {r + 1}: v{OLD_VERSION} {fmt_s(t_old[-1])}, newest {fmt_s(t_new[-1])}, "
                     f"RAM gather {fmt_s(t_ram[-1])}")
        self.notes.append(f"c. every rep (ms): v{OLD_VERSION} {fmt_list(t_old)}; newest {fmt_list(t_new)}; "
                          f"RAM gather {fmt_list(t_ram)}.")
        ref = median(t_ram)
        chain = store.stats()["max_read_chain"]
        for label, ts in ((f"v{OLD_VERSION} (old)", t_old), (f"v{newest} (newest, chain {chain})", t_new)):
            ours = median(ts)
            self.add(f"c. read_rows of {k:,} random rows at {label}, one call", fmt_s(ours),
                     f"{fmt_s(ref)} fp32 gather from RAM (floor)", f"{ours / ref:.0f}x slower",
                     "<= 10 ms", ours <= 0.010)

    # d. index size -------------------------------------------------------------------------------
    def bench_index(self, w: dict) -> None:
        store = w["store"]
        stats = store.stats()
        rows_stored = w["rows_stored"]
        space = store.engine.index_space()  # pages in use (+ the two meta pages), high-water mark, data.mdb
        used_bytes, high_water, data_mdb = space["used_bytes"], space["high_water_bytes"], space["file_bytes"]
        data_per_row = stats["segment_bytes"] / rows_stored
        ref = f"{data_per_row:.1f} B/row of log data"
        self.add(f"d. index bytes per stored row, used B-tree pages ({used_bytes:,} B / {rows_stored:,} rows)",
                 f"{used_bytes / rows_stored:.3f} B/row", ref, f"{used_bytes / stats['segment_bytes']:.2%} of data",
                 "<= 2 B", used_bytes / rows_stored <= 2)
        self.add(f"d. index bytes per stored row, data.mdb file ({data_mdb:,} B)",
                 f"{data_mdb / rows_stored:.3f} B/row", ref, f"{data_mdb / stats['segment_bytes']:.2%} of data",
                 "<= 2 B", data_mdb / rows_stored <= 2)
        self.notes.append(
            f"d. {stats['index_entries']:,} row-index entries ({stats['index_entries'] and used_bytes // stats['index_entries']} "
            f"B/entry in used pages); stats()['index_bytes'] = {stats['index_bytes']:,} (data.mdb + lock.mdb); "
            f"LMDB high-water mark {high_water:,} B; "
            f"max_read_chain {stats['max_read_chain']}.")

    # e. long histories ---------------------------------------------------------------------------
    def bench_history(self) -> None:
        """ls / open / stats at ``--versions`` versions: each must stay linear in versions and index
        entries (one pass over the row index), so a long history lists in well under a second."""
        from cnrstore import cli

        count = self.args.versions
        shm = "/dev/shm" if self.args.dir is None and os.path.isdir("/dev/shm") else self.args.dir
        root = tempfile.mkdtemp(prefix="cnrstore-bench-history-", dir=shm)
        path = os.path.join(root, "store")
        try:
            self.log(f"building a store of {count:,} versions ...")
            t0 = time.perf_counter()
            rng = np.random.default_rng(self.args.seed)
            with cnrstore.open(path, create=True) as store:
                store.create_table("t", 1 << 16, 8, codec="int8", block_rows=256)
                with store.checkpoint(step=0) as ck:
                    ck.put_rows("t", np.arange(1 << 16), np.ones((1 << 16, 8), np.float32))
                for i in range(1, count):
                    with store.checkpoint(step=i) as ck:
                        rows = np.unique(rng.integers(0, 1 << 16, 16))
                        ck.put_rows("t", rows, np.ones((rows.size, 8), np.float32))
                    if i % 500 == 0:
                        store.compact()
            build = time.perf_counter() - t0

            def open_close():
                cnrstore.open(path, readonly=True).close()

            ref_ts, ls_ts, open_ts, stats_ts = [], [], [], []
            for _ in range(self.args.repeat):  # interleaved: A B C D A B C D ...
                open_ts.append(timed(open_close)[0])  # no other handle open: a real LMDB open
                with cnrstore.open(path, readonly=True) as store:
                    ref_ts.append(timed(store.versions)[0])
                    ls_ts.append(timed(lambda: cli.versions_rows(store))[0])
                    stats_ts.append(timed(store.stats)[0])
            with cnrstore.open(path, readonly=True) as store:
                entries = store.stats()["index_entries"]
                # the old listing walked the whole row index once per version: time one such walk
                with store.engine.read() as view:
                    walk = median([timed(lambda: compaction_block_chains(view, count))[0]
                                   for _ in range(self.args.repeat)])
            ref = median(ref_ts)
            label = f"{count:,} versions, {entries:,} row-index entries"
            for name, ts, goal, limit in (("ls (versions + read chains)", ls_ts, "< 1 s", 1.0),
                                          ("open readonly + close", open_ts, "< 0.1 s", 0.1),
                                          ("stats()", stats_ts, "< 1 s", 1.0)):
                ours = median(ts)
                self.add(f"e. {name}, {label}", fmt_s(ours), f"{fmt_s(ref)} store.versions()",
                         f"{ours / ref:.2g}x", goal, ours < limit)
            self.notes.append(
                f"e. store of {count:,} versions built in {build:.0f} s on {shm or 'the temp dir'}; the "
                f"listing before one-pass chain lengths walked the row index once per version: one walk "
                f"takes {fmt_s(walk)} here, {count:,} walks about {fmt_s(walk * count)}.")
        finally:
            shutil.rmtree(root, ignore_errors=True)

    # profile -------------------------------------------------------------------------------------
    def profile(self, values: np.ndarray, w: dict) -> str:
        out = io.StringIO()

        def run(label, fn):
            prof = cProfile.Profile()
            prof.enable()
            fn()
            prof.disable()
            out.write(f"\n### cProfile: {label}\n```\n")
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(14)
            text = s.getvalue()
            out.write(text[text.find("   ncalls"):].rstrip() + "\n```\n")

        path = os.path.join(self.root, "profile-write")

        def write():
            with cnrstore.open(path, create=True) as store:
                store.create_table(TABLE, self.n, DIM, codec="int4", block_rows=self.args.block_rows)
                with store.checkpoint() as ck:
                    ck.put_rows(TABLE, np.arange(self.n), values)

        self.log("profiling ...")
        run(f"write {self.n:,} rows (put_rows + commit)", write)
        shutil.rmtree(path)
        store = w["store"]
        run("read_table newest (incremental store)", lambda: store.read_table(TABLE))
        run("read_table (baseline store)", lambda: w["base"].read_table(TABLE))
        rows = self.rng.choice(self.n, min(POINT_ROWS, self.n), replace=False)
        run(f"read_rows {rows.size:,} rows at v{OLD_VERSION}", lambda: store.read_rows(TABLE, rows, version=OLD_VERSION))
        return out.getvalue()

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    def markdown(self) -> str:
        header = ("measurement", "cnrstore", "reference", "ratio", "goal", "met?")
        lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
        lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in self.rows]
        return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Benchmark the cnrstore engine against same-run references "
                                            "(medians of --repeat runs).")
    p.add_argument("--quick", action="store_true", help="smaller sizes for a smoke run (< 30 s)")
    p.add_argument("--repeat", type=int, default=None, help="repetitions per measurement (default 5; 3 with --quick)")
    p.add_argument("--rows", type=int, default=None, help="table rows (default 2000000; 200000 with --quick)")
    p.add_argument("--out", help="also write the markdown report to this file")
    p.add_argument("--dir", default=None, help="where to put the temporary stores (default: the system temp dir)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--block-rows", type=int, default=None,
                   help="block_rows of the tables (default: the engine's default for int4 x 64)")
    p.add_argument("--versions", type=int, default=None,
                   help="versions of the history benchmark (e.; default 10000; 1000 with --quick; 0 skips it)")
    p.add_argument("--profile", action="store_true", help="also cProfile the write and read paths and print the top functions")
    args = p.parse_args(argv)
    if args.repeat is None:
        args.repeat = 3 if args.quick else 5
    if args.rows is None:
        args.rows = 200_000 if args.quick else 2_000_000
    if args.versions is None:
        args.versions = 1_000 if args.quick else 10_000
    if args.repeat < 1 or args.rows < 1 or args.versions < 0:
        p.error("--repeat and --rows must be positive, --versions not negative")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    head = machine_description()
    load_start = load_average()
    for line in head:
        print(line)
    print(f"sizes: {args.rows:,} x {DIM} rows, median of {args.repeat} reps{' (--quick)' if args.quick else ''}\n",
          flush=True)
    bench = Bench(args)
    try:
        values = bench.rng.standard_normal((args.rows, DIM), dtype=np.float32) * np.float32(0.05)
        bench.bench_write(values)
        w = bench.build_workload(values)  # trains `values` in place from here on
        try:
            bench.bench_read_table(w)
            bench.bench_point_reads(w)
            bench.bench_index(w)
            if args.versions:
                bench.bench_history()
            prof = bench.profile(values, w) if args.profile else ""
        finally:
            w["store"].close()
            w["base"].close()
    finally:
        bench.close()
    elapsed = time.perf_counter() - t_start
    report = "\n".join([
        "## cnrstore engine benchmark", "",
        *[f"- {line}" for line in head],
        f"- sizes: {args.rows:,} x {DIM}, int4, block_rows {bench.block_rows}; median of {args.repeat} reps; "
        f"total run {elapsed:.0f} s",
        f"- load average (1/5/15 min) at start: {load_start}; at end: {load_average()} "
        f"(a shared machine: other processes compete for the {os.cpu_count()} cores)",
        "- store and reference files in the page cache (warm); writes include fsync of the log and the "
        "synced LMDB commit",
        "",
        bench.markdown(),
        "",
        *[f"- {note}" for note in bench.notes],
    ])
    print(report)
    if prof:
        print(prof)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report + "\n" + prof)
    return 0


if __name__ == "__main__":
    sys.exit(main())
