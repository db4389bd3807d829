#!/usr/bin/env python3
"""Checkpointing schemes side by side: bytes written, disk use, read chains, restore time, latency.

One workload, replayed identically under each scheme, each in a fresh store: a ``--rows`` x 64 fp32
table stored in int4; before every checkpoint a training interval modifies ~25% of the rows, drawn
from a Zipf(1.1) popularity over a random ranking of the rows (unique ids), with a deterministic
"trained" update of those rows. Checkpoint 1 writes every row (the first full baseline); then:

  1.  consecutive incremental: each checkpoint writes the rows modified since the previous one.
  2.  one-shot differential: each writes every row modified since the first baseline (the trainer
      keeps the union).
  3.  intermittent differential: one-shot, plus a new full baseline written by the trainer (all rows)
      when Check-N-Run's reset rule says so: with S_i the bytes of the i-th differential over the
      baseline's bytes, the next checkpoint is a baseline once 1 + S_1 + ... + S_i <= (i + 1) * S_i.
  4.  incremental writes, opened with compaction="auto": the engine materializes baselines in the
      background (the same reset rule, applied to the chain of increments in the log).
  4b. as 4 with CompactionPolicy(materialize=MaxChain(3), retention=Retention(KeepLast(5))).

Per scheme: the bytes the trainer wrote (sum of VersionInfo.bytes) and, apart, the bytes compaction
wrote (stats()["bytes_written"] minus the trainer's); peak disk use and the longest read chain
(stats() after every checkpoint, once the compactor is idle); the time of store.read_table at the
newest version; and the trainer's checkpoint latency (``with store.checkpoint()`` entry to commit
return). Schemes 4 and 4b are run twice: once timed, with the compactor genuinely running beside the
trainer (no waiting between checkpoints, no stats calls), and once "settled" (wait for the compactor
after each checkpoint) for the disk-use and read-chain samples. The latency passes of 1, 4 and 4b are
interleaved (1 4 4b 1 4 4b ...) ``--repeat`` times so that machine drift hits them alike.

Every scheme's newest version must read bit-identically to int4(final trained table); the benchmark
checks it.

    python benchmarks/bench_policies.py                      # full run (~2 minutes on 2 cores)
    python benchmarks/bench_policies.py --quick              # smoke run (< 20 s)
    python benchmarks/bench_policies.py --out FILE --plot benchmarks/policies.png

The plot needs matplotlib (``pip install matplotlib``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import load_average, machine_description, median, zipf_rows  # noqa: E402

import cnrstore  # noqa: E402
from cnrstore.policy import CompactionPolicy, KeepLast, MaxChain, Retention  # noqa: E402

TABLE = "emb"
DIM = 64
CODEC = "int4"
FRACTION = 0.25  # of the rows modified per training interval
ZIPF_A = 1.1
LR = np.float32(0.01)


@dataclass(frozen=True)
class Scheme:
    key: str
    label: str
    mode: str  # "incremental" | "one-shot" | "intermittent"
    compaction: object = None

    @property
    def background(self) -> bool:
        return self.compaction is not None


SCHEMES = [
    Scheme("1", "1. consecutive incremental", "incremental"),
    Scheme("2", "2. one-shot differential", "one-shot"),
    Scheme("3", "3. intermittent differential (trainer baselines)", "intermittent"),
    Scheme("4", "4. incremental + background baselines (compaction=\"auto\")", "incremental", "auto"),
    Scheme("4b", "4b. incremental + background MaxChain(3), KeepLast(5)", "incremental",
           CompactionPolicy(materialize=MaxChain(3), retention=Retention(KeepLast(5)))),
]
TIMED = ("1", "4", "4b")  # schemes whose latency passes are repeated and interleaved


@dataclass
class PassResult:
    scheme: Scheme
    settled: bool
    trainer_bytes: list = field(default_factory=list)  # VersionInfo.bytes per checkpoint
    rows_written: list = field(default_factory=list)
    full: list = field(default_factory=list)  # True where the trainer wrote every row
    latency: list = field(default_factory=list)  # seconds per checkpoint
    compactor_busy: list = field(default_factory=list)  # compactor busy when the checkpoint began
    disk: list = field(default_factory=list)  # stats()["bytes_on_disk"] after each checkpoint (sampled passes)
    chain: list = field(default_factory=list)  # stats()["max_read_chain"] after each checkpoint
    written_total: list = field(default_factory=list)  # stats()["bytes_written"] after each checkpoint
    baselines: list = field(default_factory=list)  # newest baseline version after each checkpoint
    final_stats: dict = field(default_factory=dict)
    drain_s: float = 0.0  # time for the compactor to go idle after the last commit (timed passes)
    compactor_steps: int = 0
    compactor_errors: int = 0
    restore: list = field(default_factory=list)  # seconds per read_table rep
    wall_s: float = 0.0

    @property
    def sampled(self) -> bool:
        return bool(self.disk)


def p90(xs) -> float:
    return float(np.percentile(np.asarray(xs), 90))


def fmt_bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}" if n < 10 * scale else f"{n / scale:.1f} {unit}" if n < 100 * scale \
                else f"{n / scale:.0f} {unit}"
    return f"{n:.0f} B"


def fmt_ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}" if seconds < 0.1 else f"{seconds * 1e3:.0f}"


class Bench:
    def __init__(self, args):
        self.args = args
        self.n = args.rows
        self.c = args.checkpoints
        self.root = tempfile.mkdtemp(prefix="cnrstore-bench-policies-", dir=args.dir)
        rng = np.random.default_rng(args.seed)
        t0 = time.perf_counter()
        self.values0 = rng.standard_normal((self.n, DIM), dtype=np.float32) * np.float32(0.05)
        perm = rng.permutation(self.n)
        count = max(1, round(FRACTION * self.n))
        self.intervals = [zipf_rows(rng, perm, count, ZIPF_A) for _ in range(self.c)]
        self.grad = rng.standard_normal((count, DIM), dtype=np.float32)
        self.reference = None  # int4 read of the final table, set by the first pass
        self.passes: list[PassResult] = []
        self.block_rows = None
        union = np.zeros(self.n, dtype=bool)
        self.union_fraction = []
        for rows in self.intervals[1:]:
            union[rows] = True
            self.union_fraction.append(union.mean())
        self.log(f"workload: {self.c} intervals of {count:,} Zipf({ZIPF_A}) rows of {self.n:,} "
                 f"(union after all: {self.union_fraction[-1] if self.union_fraction else 0:.0%}) "
                 f"in {time.perf_counter() - t0:.1f} s")

    @staticmethod
    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    def train(self, values: np.ndarray, k: int) -> np.ndarray:
        """Training interval k: a deterministic update of its rows; returns the rows."""
        rows = self.intervals[k]
        scale = LR * np.float32(1.0 + 0.1 * (k % 7))
        values[rows] -= scale * self.grad[: rows.size]
        return rows

    def run_pass(self, scheme: Scheme, settled: bool, measure_restore: bool) -> PassResult:
        """Replay the workload under ``scheme`` in a fresh store. ``settled``: wait for the compactor
        after each checkpoint and sample stats(); otherwise (a timed pass of a background scheme) let
        it run beside the trainer, and sample nothing until the end."""
        res = PassResult(scheme, settled)
        sample = settled or not scheme.background
        path = os.path.join(self.root, f"s{scheme.key}-{len(self.passes)}")
        t_start = time.perf_counter()
        values = self.values0.copy()
        union = np.zeros(self.n, dtype=bool)  # rows modified since the last baseline (one-shot, intermittent)
        reset_due = False
        s_fracs: list[float] = []  # S_i of the differentials since the last trainer baseline
        baseline_bytes = 0
        all_rows = np.arange(self.n, dtype=np.int64)
        store = cnrstore.open(path, create=True, compaction=scheme.compaction)
        try:
            info = store.create_table(TABLE, self.n, DIM, codec=CODEC)
            self.block_rows = info.block_rows
            compacting = scheme.compaction is not None  # a background compactor runs beside the trainer
            for k in range(self.c):
                modified = self.train(values, k)
                if k == 0 or reset_due:
                    rows, full = all_rows, True
                    union[:] = False
                    s_fracs = []
                    reset_due = False
                elif scheme.mode == "incremental":
                    rows, full = modified, False
                else:
                    union[modified] = True
                    rows, full = np.flatnonzero(union), False
                vals = values if full else values[rows]  # the trainer's snapshot, taken before the clock
                busy = compacting and not store.wait_for_compaction(0)
                t0 = time.perf_counter()
                with store.checkpoint(step=k + 1) as ck:
                    ck.put_rows(TABLE, rows, vals)
                res.latency.append(time.perf_counter() - t0)
                res.compactor_busy.append(busy)
                del vals
                nbytes = store.latest().bytes
                res.trainer_bytes.append(nbytes)
                res.rows_written.append(int(rows.size))
                res.full.append(full)
                if full:
                    baseline_bytes = nbytes
                elif scheme.mode == "intermittent":
                    s_fracs.append(nbytes / baseline_bytes)
                    i = len(s_fracs)
                    reset_due = 1 + sum(s_fracs) <= (i + 1) * s_fracs[-1]
                if sample:
                    store.wait_for_compaction()
                    st = store.stats()
                    res.disk.append(st["bytes_on_disk"])
                    res.chain.append(st["max_read_chain"])
                    res.written_total.append(st["bytes_written"])
                    res.baselines.append(store.engine.history().baseline_version)
            if compacting:
                t0 = time.perf_counter()
                store.wait_for_compaction()
                res.drain_s = time.perf_counter() - t0
                st = store.stats()
                res.compactor_steps = st["compaction_steps"]
                res.compactor_errors = st["compaction_errors"]
            res.final_stats = store.stats()
            if self.reference is None:
                codec = cnrstore.codecs.get(CODEC)
                self.reference = codec.decode(codec.encode(values), DIM)
            got = store.read_table(TABLE)
            if not np.array_equal(got, self.reference):
                raise AssertionError(f"scheme {scheme.label}: newest version does not read as int4 of the "
                                     f"final table ({int((got != self.reference).any(axis=1).sum())} rows differ)")
            del got
            if measure_restore:
                for _ in range(self.args.restore_reps):
                    t0 = time.perf_counter()
                    store.read_table(TABLE)
                    res.restore.append(time.perf_counter() - t0)
        finally:
            store.close()
            shutil.rmtree(path, ignore_errors=True)
        res.wall_s = time.perf_counter() - t_start
        self.passes.append(res)
        lat = res.latency[1:] or res.latency
        self.log(f"  {scheme.label} ({'settled' if settled else 'timed'}): trainer {fmt_bytes(sum(res.trainer_bytes))}, "
                 f"compaction {fmt_bytes(res.final_stats['bytes_written'] - sum(res.trainer_bytes))}, "
                 f"latency median {fmt_ms(median(lat))} ms, "
                 f"{f'drain {res.drain_s * 1e3:.0f} ms, ' if scheme.background else ''}"
                 f"{res.wall_s:.1f} s")
        return res

    def run(self) -> None:
        by_key = {s.key: s for s in SCHEMES}
        for rep in range(self.args.repeat):
            self.log(f"latency passes, rep {rep + 1}/{self.args.repeat}")
            for key in TIMED:
                scheme = by_key[key]
                self.run_pass(scheme, settled=False, measure_restore=(rep == 0 and not scheme.background))
        self.log("the other passes")
        for key in ("2", "3"):
            self.run_pass(by_key[key], settled=True, measure_restore=True)
        for key in ("4", "4b"):
            self.run_pass(by_key[key], settled=True, measure_restore=True)

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    # report ---------------------------------------------------------------------------------------
    def results(self, key: str) -> tuple[PassResult, list[PassResult]]:
        """(the sampled pass, the passes whose latency counts) of a scheme."""
        passes = [p for p in self.passes if p.scheme.key == key]
        sampled = next(p for p in passes if p.sampled)
        timed = [p for p in passes if not p.settled] or passes
        return sampled, timed

    def markdown(self) -> tuple[str, list[str]]:
        fp32 = self.n * DIM * 4
        header = ("scheme", "trainer wrote (vs full fp32 every time)", "compaction wrote", "peak disk",
                  "longest read chain", "restore newest (read_table)",
                  f"ckpt latency median / p90, ckpts 2-{self.c}")
        lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
        notes = []
        lat_by_key = {}
        for scheme in SCHEMES:
            sampled, timed = self.results(scheme.key)
            trainer = sum(sampled.trainer_bytes)
            per_pass = [sum(p.trainer_bytes) for p in self.passes if p.scheme.key == scheme.key]
            if not scheme.background:
                # no compaction beside the trainer: every pass writes the same deltas, byte for byte
                for b in per_pass:
                    if b != trainer:
                        raise AssertionError(f"{scheme.label}: the trainer wrote {b} bytes in one pass and "
                                             f"{trainer} in another")
                trainer_cell = f"{fmt_bytes(trainer)} ({trainer / (self.c * fp32):.1%})"
            else:
                # a checkpoint's cumulative deltas depend on the chain at its parent, which background
                # materialization may or may not have replaced yet: the bytes legitimately vary by pass
                lo, hi, med = min(per_pass), max(per_pass), median(per_pass)
                trainer_cell = (f"{fmt_bytes(med)} ({med / (self.c * fp32):.1%}); median of {len(per_pass)} "
                                f"passes, range {fmt_bytes(lo)}-{fmt_bytes(hi)}")
                if lo != hi:
                    notes.append(f"- {scheme.label}: the trainer's bytes vary between its {len(per_pass)} passes "
                                 f"({', '.join(fmt_bytes(b) for b in per_pass)}; settled pass {fmt_bytes(trainer)}): "
                                 "its cumulative deltas depend on whether background materialization had "
                                 "replaced the parent's chain when it wrote them. 'compaction wrote' and the "
                                 "disk and chain columns are from the settled pass.")
            compaction = sampled.final_stats["bytes_written"] - trainer
            lat = [t for p in timed for t in p.latency[1:]]
            lat_by_key[scheme.key] = lat
            restore = next(p.restore for p in self.passes if p.scheme.key == scheme.key and p.restore)
            lines.append("| " + " | ".join([
                scheme.label,
                trainer_cell,
                fmt_bytes(compaction) if scheme.background else "-",
                fmt_bytes(max(sampled.disk)),
                str(max(sampled.chain)),
                f"{fmt_ms(median(restore))} ms",
                f"{fmt_ms(median(lat))} / {fmt_ms(p90(lat))} ms",
            ]) + " |")
        lines.append("| " + " | ".join([
            "reference: full fp32 checkpoint every time (not run)",
            f"{fmt_bytes(self.c * fp32)} (100%)", "-", f"{fmt_bytes(self.c * fp32)} (all kept)", "1", "-", "-",
        ]) + " |")

        # notes ------------------------------------------------------------------------------------
        s1, _ = self.results("1")
        notes.append(f"Full fp32 checkpoint: {fmt_bytes(fp32)}; full int4 checkpoint (checkpoint 1 of every scheme): "
                     f"{fmt_bytes(s1.trainer_bytes[0])} ({fp32 / s1.trainer_bytes[0]:.1f}x less). "
                     f"Rows modified per interval: {self.intervals[0].size:,} ({FRACTION:.0%}); the union since "
                     f"checkpoint 1 covers {self.union_fraction[0]:.0%} of the rows after one interval, "
                     f"{self.union_fraction[min(4, len(self.union_fraction) - 1)]:.0%} after "
                     f"{min(5, len(self.union_fraction))}, {self.union_fraction[-1]:.0%} after {len(self.union_fraction)}.")
        incr = s1.trainer_bytes[1:]
        if incr:
            span = fmt_bytes(min(incr)) if min(incr) == max(incr) else f"{fmt_bytes(min(incr))}-{fmt_bytes(max(incr))}"
            notes.append(f"1: increments {span} each "
                         f"({fp32 / median(incr):.0f}x less than full fp32).")
        s2, _ = self.results("2")
        if len(s2.trainer_bytes) > 1:
            notes.append(f"2: differentials grow from {fmt_bytes(s2.trainer_bytes[1])} to {fmt_bytes(s2.trainer_bytes[-1])} "
                         f"({s2.trainer_bytes[-1] / s2.trainer_bytes[0]:.0%} of the int4 baseline). Its read chain still "
                         f"grows to {max(s2.chain)}: a differential holds every row changed since the baseline, but the "
                         f"engine does not know it, so a read of a row left unchanged walks back through every "
                         f"differential to the baseline (only a record holding a whole block stops a read).")
        s3, _ = self.results("3")
        resets = [i + 1 for i, f in enumerate(s3.full) if f]
        notes.append(f"3: trainer baselines (all rows) at checkpoints {', '.join(map(str, resets))} "
                     f"({len(resets)} in {self.c}).")
        for key in ("4", "4b"):
            sampled, timed = self.results(key)
            bases = sorted({b for b in sampled.baselines if b is not None and b > 1})
            trainer = sum(sampled.trainer_bytes)
            notes.append(
                f"{key}: settled pass: baselines materialized in the background at versions "
                f"{', '.join(map(str, bases)) or 'none'}; compaction (baselines and GC copies) wrote "
                f"{fmt_bytes(sampled.final_stats['bytes_written'] - trainer)} "
                f"({(sampled.final_stats['bytes_written'] - trainer) / trainer:.0%} on top of the trainer's); "
                f"{sampled.final_stats['versions']} versions retained at the end; "
                f"disk {fmt_bytes(sampled.disk[-1])} at the end. Timed passes: compactor busy when "
                f"{', '.join(f'{sum(p.compactor_busy)}' for p in timed)} of {self.c} checkpoints began "
                f"(per rep); it went idle {', '.join(f'{p.drain_s * 1e3:.0f}' for p in timed)} ms after the last "
                f"commit; compaction wrote {', '.join(fmt_bytes(p.final_stats['bytes_written'] - trainer) for p in timed)}; "
                f"max_read_chain at the end {', '.join(str(p.final_stats['max_read_chain']) for p in timed)}"
                f"{'; compactor errors: ' + str(sum(p.compactor_errors for p in self.passes if p.scheme.key == key)) if any(p.compactor_errors for p in self.passes if p.scheme.key == key) else ''}.")
        l1, l4, l4b = lat_by_key["1"], lat_by_key["4"], lat_by_key["4b"]
        notes.append(
            f"Latency, background compaction against none (same rows written): median 4 / 1 = "
            f"{median(l4) / median(l1):.2f}x, p90 {p90(l4) / p90(l1):.2f}x; 4b / 1 = {median(l4b) / median(l1):.2f}x, "
            f"p90 {p90(l4b) / p90(l1):.2f}x ({len(l1)} checkpoints per scheme: {self.args.repeat} interleaved "
            f"passes x {self.c - 1}). Per pass medians (ms): "
            + "; ".join(f"{key}: " + ", ".join(fmt_ms(median(p.latency[1:])) for p in self.results(key)[1])
                        for key in TIMED) + ".")
        for key in ("4", "4b"):
            timed = self.results(key)[1]
            busy = [t for p in timed for t, b in zip(p.latency[1:], p.compactor_busy[1:]) if b]
            idle = [t for p in timed for t, b in zip(p.latency[1:], p.compactor_busy[1:]) if not b]
            if busy and idle:
                notes.append(f"{key}: checkpoints that began while the compactor was working: {len(busy)}, median "
                             f"{fmt_ms(median(busy))} ms (p90 {fmt_ms(p90(busy))}); with it idle: {len(idle)}, median "
                             f"{fmt_ms(median(idle))} ms (p90 {fmt_ms(p90(idle))}); scheme 1: median {fmt_ms(median(l1))} ms.")
        notes.append("Checkpoint 1 (full int4 write) latency per scheme (ms): "
                     + ", ".join(f"{s.key} {fmt_ms(median([p.latency[0] for p in self.results(s.key)[1]]))}"
                                 for s in SCHEMES) + ".")
        notes.append("Restore = store.read_table of the newest version (warm page cache), median of "
                     f"{self.args.restore_reps}, in ms: "
                     + "; ".join(f"{s.key} " + ", ".join(fmt_ms(t) for t in next(
                         p.restore for p in self.passes if p.scheme.key == s.key and p.restore)) for s in SCHEMES) + ".")
        notes.append("Every scheme's newest version read bit-identically to int4(final trained table).")
        return "\n".join(lines), notes

    # plot -----------------------------------------------------------------------------------------
    def plot(self, path: str) -> str | None:
        try:
            import matplotlib
        except ImportError:
            return "plot skipped: matplotlib is not installed (pip install matplotlib)"
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fp32 = self.n * DIM * 4
        x = np.arange(1, self.c + 1)
        fig, axes = plt.subplots(2, 2, figsize=(13, 9.5), constrained_layout=True)
        ax_w, ax_d, ax_c, ax_l = axes.ravel()
        styles = {"1": ("tab:blue", "o", "-"), "2": ("tab:orange", "s", "-"), "3": ("tab:green", "^", "-"),
                  "4": ("tab:red", "D", "--"), "4b": ("tab:purple", "v", ":")}
        offsets = {"1": -0.16, "2": -0.08, "3": 0.0, "4": 0.08, "4b": 0.16}  # so equal values stay visible
        handles = []
        for scheme in SCHEMES:
            sampled, timed = self.results(scheme.key)
            color, marker, ls = styles[scheme.key]
            xs = x + offsets[scheme.key]
            kw = dict(marker=marker, ms=6.5 if scheme.key == "2" else 4, color=color, ls=ls, lw=1.3,
                      zorder=3 if scheme.key == "1" else 2)  # 1 drawn over 2 where their chains coincide
            (h,) = ax_w.plot(xs, np.asarray(sampled.trainer_bytes) / 1e6, **kw)
            handles.append((h, scheme.label))
            if scheme.background:
                comp = np.diff(np.asarray(sampled.written_total), prepend=0) - np.asarray(sampled.trainer_bytes)
                nz = comp > 0
                ax_w.scatter(xs[nz], comp[nz] / 1e6, marker=marker, s=70, facecolors="none", edgecolors=color,
                             linewidths=1.5)
            ax_d.plot(xs, np.asarray(sampled.disk) / 1e6, **kw)
            ax_c.plot(xs, sampled.chain, **kw)
            lat = np.median(np.asarray([p.latency for p in timed]), axis=0)
            ax_l.plot(xs, lat * 1e3, **kw)
        int4_full = self.results("1")[0].trainer_bytes[0]
        ax_w.axhline(fp32 / 1e6, color="black", ls="--", lw=1)
        ax_w.axhline(int4_full / 1e6, color="grey", ls=":", lw=1)
        ax_w.text(1, fp32 / 1e6 * 1.08, "full fp32 checkpoint", fontsize=8, va="bottom")
        ax_w.text(1, int4_full / 1e6 * 1.08, "full int4 checkpoint", fontsize=8, va="bottom", color="grey")
        ax_w.scatter([], [], marker="D", s=70, facecolors="none", edgecolors="black", label="hollow: written by background compaction after this checkpoint (4, 4b)")
        ax_w.legend(fontsize=8, loc="upper right")
        ax_w.set_yscale("log")
        ax_w.set_ylim(top=fp32 / 1e6 * 4)
        ax_w.set_ylabel("MB")
        ax_w.set_title("Bytes written per checkpoint (log scale)")
        ax_d.set_title("Disk use after each checkpoint (compactor idle)")
        ax_d.set_ylabel("MB")
        ax_d.set_ylim(bottom=0)
        ax_c.set_title("Longest read chain (records a point read may visit per block)")
        ax_c.set_ylabel("records")
        ax_c.set_ylim(bottom=0)
        ax_l.set_title(f"Trainer checkpoint latency (median of {self.args.repeat} timed passes for 1, 4, 4b)")
        ax_l.set_ylabel("ms")
        ax_l.set_ylim(bottom=0)
        for ax in axes.ravel():
            ax.set_xlabel("checkpoint")
            ax.grid(True, which="major", alpha=0.3)
        fig.legend([h for h, _ in handles], [label for _, label in handles], loc="outside lower center", ncol=3,
                   fontsize=9)
        fig.suptitle(f"cnrstore checkpointing schemes: {self.n:,} x {DIM} int4, {self.c} checkpoints, "
                     f"{FRACTION:.0%} Zipf({ZIPF_A}) rows per interval", fontsize=11)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return None


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Compare checkpointing schemes (incremental, one-shot, intermittent, "
                                            "background baselines) on one Zipf workload.")
    p.add_argument("--quick", action="store_true", help="tiny sizes for a smoke run (< 20 s)")
    p.add_argument("--rows", type=int, default=None, help="table rows (default 1000000; 100000 with --quick)")
    p.add_argument("--checkpoints", type=int, default=None, help="checkpoints per scheme (default 30; 10 with --quick)")
    p.add_argument("--repeat", type=int, default=None,
                   help="interleaved latency passes of schemes 1, 4 and 4b (default 3; 1 with --quick)")
    p.add_argument("--restore-reps", type=int, default=None, help="read_table reps per scheme (default 5; 3 with --quick)")
    p.add_argument("--out", help="also write the markdown report to this file")
    p.add_argument("--plot", default=None,
                   help="PNG of bytes per checkpoint, disk use, read chains and latency "
                        "(default benchmarks/policies.png; 'none' to skip)")
    p.add_argument("--dir", default=None, help="where to put the temporary stores (default: the system temp dir)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--segment-mb", type=int, default=None,
                   help="segment size in MiB (cnrstore.knobs.SEGMENT_BYTES; default: the engine's). GC reclaims "
                        "only sealed segments, so smaller segments let 4b's retention free disk sooner")
    args = p.parse_args(argv)
    if args.rows is None:
        args.rows = 100_000 if args.quick else 1_000_000
    if args.checkpoints is None:
        args.checkpoints = 10 if args.quick else 30
    if args.repeat is None:
        args.repeat = 1 if args.quick else 3
    if args.restore_reps is None:
        args.restore_reps = 3 if args.quick else 5
    if args.plot is None:
        args.plot = os.path.join(os.path.dirname(os.path.abspath(__file__)), "policies.png")
    if min(args.rows, args.repeat, args.restore_reps) < 1 or args.checkpoints < 2:
        p.error("--rows, --repeat and --restore-reps must be positive and --checkpoints at least 2")
    if args.segment_mb is not None and args.segment_mb < 1:
        p.error("--segment-mb must be positive")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.segment_mb is not None:
        cnrstore.knobs.SEGMENT_BYTES = args.segment_mb << 20
    t_start = time.perf_counter()
    head = machine_description()
    load_start = load_average()
    for line in head:
        print(line)
    print(f"sizes: {args.rows:,} x {DIM} {CODEC}, {args.checkpoints} checkpoints per scheme, "
          f"{args.repeat} latency passes{' (--quick)' if args.quick else ''}\n", flush=True)
    bench = Bench(args)
    try:
        bench.run()
        table, notes = bench.markdown()
        plot_msg = None if args.plot.lower() == "none" else bench.plot(args.plot)
    finally:
        bench.close()
    elapsed = time.perf_counter() - t_start
    plot_line = ("- plot: none" if args.plot.lower() == "none" else f"- {plot_msg}" if plot_msg
                 else f"- plot: {os.path.relpath(args.plot)}")
    report = "\n".join([
        "## cnrstore checkpointing schemes", "",
        *[f"- {line}" for line in head],
        f"- workload: {args.rows:,} x {DIM} fp32 table stored in {CODEC} (block_rows {bench.block_rows}); "
        f"{args.checkpoints} checkpoints, the first a full baseline; {FRACTION:.0%} of the rows modified per "
        f"interval, Zipf({ZIPF_A}) over a random ranking; latency = `with store.checkpoint()` entry to commit "
        f"return (fsync + synced index commit), pooled over checkpoints 2-{args.checkpoints} of "
        f"{args.repeat} interleaved passes for 1/4/4b (one pass for 2/3); segments of "
        f"{cnrstore.knobs.SEGMENT_BYTES >> 20} MiB; total run {elapsed:.0f} s",
        f"- load average (1/5/15 min) at start: {load_start}; at end: {load_average()} "
        f"(a shared machine: other processes compete for the {os.cpu_count()} cores)",
        plot_line,
        "",
        table,
        "",
        *[f"- {note}" for note in notes],
    ])
    print(report)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
