#!/usr/bin/env python3
"""A guided tour of cnrstore: a simulated DLRM training run checkpointed incrementally.

It creates a store with one embedding table (1M rows x 64 by default, codec int4), writes a baseline
version holding every row, then about ten incremental versions. Between checkpoints a simulated
training interval touches a Zipf-distributed set of rows (hot rows are touched again and again, as in
real recommendation traffic) and nudges each of them by a small random update; each checkpoint
writes only those rows, plus a dense array (a bottom-MLP weight) and the data-loader position.

It then reads an old version back (a point read and the whole table) and checks it equals exactly
what was written at that version -- for a lossy codec, ``decode(encode(values))`` -- and prints
what each checkpoint cost next to a full fp32 checkpoint of the table.

    python tools/demo.py                 # a fresh temp store, removed at the end
    python tools/demo.py --path ckpt     # keep the store in ./ckpt (must be new or empty)
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

import numpy as np

import cnrstore

TABLE = "emb"
DENSE = "bottom_mlp.0.weight"
STEPS_PER_INTERVAL = 1000
BATCH_SIZE = 2048


def zipf_rows(rng: np.random.Generator, perm: np.ndarray, count: int, a: float = 1.1) -> np.ndarray:
    """``count`` unique row ids drawn from a Zipf(a) popularity over the random ranking ``perm``.

    Rank ``k`` (1-based, from ``rng.zipf``) maps to row ``perm[(k - 1) % num_rows]``; draws continue
    until ``count`` distinct rows have been seen, in order of first appearance. Returned sorted.
    """
    num_rows = perm.size
    count = min(count, num_rows)
    seen = np.zeros(0, dtype=np.int64)
    while True:
        draws = perm[(rng.zipf(a, size=max(2 * count, 1024)) - 1) % num_rows]
        cand = np.concatenate([seen, draws])
        uniq, first = np.unique(cand, return_index=True)
        if uniq.size >= count:
            order = np.argsort(first, kind="stable")[:count]
            return np.sort(uniq[order])
        seen = uniq[np.argsort(first, kind="stable")]


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Simulate a DLRM training run checkpointed incrementally into a cnrstore store, "
                    "read an old version back and check it, and print what each checkpoint cost.")
    p.add_argument("--path", help="store directory (must not exist or be empty; kept afterwards). "
                                  "Default: a fresh temporary directory, removed at the end")
    p.add_argument("--rows", type=int, default=1_000_000, help="rows of the embedding table (default 1000000)")
    p.add_argument("--dim", type=int, default=64, help="embedding dimension (default 64)")
    p.add_argument("--versions", type=int, default=11,
                   help="checkpoints to write: one baseline, then incremental ones (default 11)")
    p.add_argument("--codec", default="int4", choices=cnrstore.codecs.names(),
                   help="codec of the table (default int4)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    args = p.parse_args(argv)
    if args.rows <= 0 or args.dim <= 0:
        p.error("--rows and --dim must be positive")
    if args.versions < 2:
        p.error("--versions must be at least 2 (a baseline and one increment)")
    if args.path and os.path.exists(args.path) and (not os.path.isdir(args.path) or os.listdir(args.path)):
        p.error(f"--path {args.path!r} exists and is not an empty directory; choose a new path")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    rng = np.random.default_rng(args.seed)
    codec = cnrstore.codecs.get(args.codec)
    temp = None
    if args.path:
        path = args.path
    else:
        temp = tempfile.mkdtemp(prefix="cnrstore-demo-")
        path = os.path.join(temp, "store")
    t_start = time.perf_counter()
    try:
        return run(args, rng, codec, path)
    finally:
        if temp is not None:
            shutil.rmtree(temp, ignore_errors=True)
        print(f"\ndemo finished in {time.perf_counter() - t_start:.1f} s"
              + ("" if temp is None else " (temporary store removed)"))


def run(args, rng: np.random.Generator, codec, path: str) -> int:
    n, dim = args.rows, args.dim
    full_bytes = n * dim * 4
    print(f"cnrstore demo: table {TABLE!r} {n:,} x {dim}, codec {codec.name}, {args.versions} checkpoints, "
          f"seed {args.seed}")
    print(f"store: {path}\n")

    # the "model": an embedding table and one dense layer, trained in place
    table = (rng.standard_normal((n, dim), dtype=np.float32) * np.float32(0.05))
    dense = rng.standard_normal((256, 512), dtype=np.float32) * np.float32(0.02)
    popularity = rng.permutation(n)  # rank -> row id of the Zipf popularity

    # what each version must read back as: codec round trip of the values put, row by row
    expected = np.empty_like(table)
    check_at = max(1, args.versions // 2 - 1)  # an old version, with increments before and after it
    check_version = None
    snapshot = None  # (expected table, dense, meta) at check_version
    sample = np.sort(rng.choice(n, size=min(10_000, n), replace=False))  # rows point-read back later
    exp_fp32_sample = None

    results = []
    with cnrstore.open(path, create=True) as store:
        store.create_table(TABLE, n, dim, codec=codec.name)
        step = 0
        for i in range(args.versions):
            if i == 0:
                rows = np.arange(n, dtype=np.int64)
            else:
                # one training interval: Zipf traffic touches 10-25% of the rows; each gets an SGD-like nudge
                fraction = rng.uniform(0.10, 0.25)
                rows = zipf_rows(rng, popularity, int(fraction * n))
                table[rows] += rng.standard_normal((rows.size, dim), dtype=np.float32) * np.float32(1e-3)
                dense += rng.standard_normal(dense.shape, dtype=np.float32) * np.float32(1e-4)
                step += STEPS_PER_INTERVAL
            meta = {"step": step, "loader_pos": step * BATCH_SIZE}
            values = table[rows]
            t0 = time.perf_counter()
            with store.checkpoint(step=step, meta=meta) as ck:
                ck.put_rows(TABLE, rows, values)
                ck.put_dense(DENSE, dense)
            seconds = time.perf_counter() - t0
            info = store.versions()[-1]
            assert info.version == ck.version
            expected[rows] = codec.decode(codec.encode(values), dim)
            if i == check_at:
                check_version = ck.version
                snapshot = (expected.copy(), dense.copy(), meta)
                exp_fp32_sample = table[sample]
            results.append((info, rows.size, seconds))
            kind = "baseline" if i == 0 else "increment"
            print(f"  [{i + 1:>2}/{args.versions}] v{info.version:<3} {kind:<9} step {step:>6}: "
                  f"{rows.size:>9,} rows ({100 * rows.size / n:5.1f}%), {human_bytes(info.bytes):>10} "
                  f"in {seconds * 1e3:6.0f} ms")

        # read an old version back and check it
        print(f"\nreading back v{check_version} (an old version: v{results[0][0].version} is the baseline, "
              f"{len(results) - 1 - check_at} newer versions were written after it)")
        exp_table, exp_dense, exp_meta = snapshot
        t0 = time.perf_counter()
        got_rows = store.read_rows(TABLE, sample, version=check_version)
        t_rows = time.perf_counter() - t0
        t0 = time.perf_counter()
        got_table = store.read_table(TABLE, version=check_version)
        t_table = time.perf_counter() - t0
        got_dense = store.read_dense(DENSE, version=check_version)
        got_meta = {v.version: v for v in store.versions()}[check_version].meta
        checks = [
            (f"read_rows of {sample.size:,} random rows", np.array_equal(got_rows, exp_table[sample]), t_rows),
            ("read_table (every row)", np.array_equal(got_table, exp_table), t_table),
            (f"read_dense {DENSE!r}", np.array_equal(got_dense, exp_dense) and got_dense.dtype == exp_dense.dtype,
             None),
            ("meta (step, loader_pos)", got_meta == exp_meta, None),
        ]
        newest = store.read_table(TABLE)
        checks.append((f"read_table at newest v{results[-1][0].version}", np.array_equal(newest, expected), None))
        for what, ok, secs in checks:
            timing = "" if secs is None else f"  ({secs * 1e3:.0f} ms)"
            print(f"  {'OK  ' if ok else 'FAIL'} {what}{timing}")
        err = np.abs(got_rows - exp_fp32_sample)
        print(f"  {codec.name} error vs the fp32 training values at v{check_version} (sampled rows): "
              f"max {float(err.max()):.2e}, mean {float(err.mean()):.2e}"
              + ("" if codec.lossless else " -- reads equal decode(encode(values)) exactly"))

        # summary table
        print()
        header = ("version", "step", "rows modified", "cnrstore bytes", "full fp32 bytes", "ratio", "time (ms)")
        lines = []
        for info, count, secs in results:
            lines.append((f"v{info.version}", f"{info.step:,}", f"{count:,} ({100 * count / n:.1f}%)",
                          f"{info.bytes:,}", f"{full_bytes:,}", f"{full_bytes / info.bytes:.1f}x",
                          f"{secs * 1e3:.0f}"))
        total_bytes = sum(r[0].bytes for r in results)
        total_full = full_bytes * len(results)
        total_rows = sum(r[1] for r in results)
        total_secs = sum(r[2] for r in results)
        footer = ("total", "", f"{total_rows:,}", f"{total_bytes:,}", f"{total_full:,}",
                  f"{total_full / total_bytes:.1f}x", f"{total_secs * 1e3:.0f}")
        widths = [max(len(str(row[c])) for row in [header, *lines, footer]) for c in range(len(header))]

        def fmt(row):
            return "  ".join(str(v).ljust(w) if c == 0 else str(v).rjust(w) for c, (v, w) in enumerate(zip(row, widths)))

        print(fmt(header))
        print("  ".join("-" * w for w in widths))
        for line in lines:
            print(fmt(line))
        print("  ".join("-" * w for w in widths))
        print(fmt(footer))
        print(f"(cnrstore bytes: all bytes appended for that version, the {human_bytes(dense.nbytes)} dense array "
              f"{DENSE!r} included; ratio = full fp32 checkpoint of the table / cnrstore bytes; "
              "time = put_rows + put_dense + durable commit)")

        print("\nstore.stats():")
        stats = store.stats()
        for key, value in stats.items():
            shown = f"{value:>13,}" + (f"  ({human_bytes(value)})" if "bytes" in key else "")
            print(f"  {key:<16} {shown}")

        t0 = time.perf_counter()
        report = store.verify()
        t_verify = time.perf_counter() - t0
        print(f"\nstore.verify(): ok={report.ok}, {report.records_checked:,} records, "
              f"{human_bytes(report.bytes_checked)} checked in {t_verify * 1e3:.0f} ms")
        for problem in report.problems[:10]:
            print(f"  problem: {problem}")

    ok = all(c[1] for c in checks) and report.ok
    print("\nall checks passed" if ok else "\nSOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
