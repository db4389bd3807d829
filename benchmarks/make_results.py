"""Run every benchmark and write benchmarks/RESULTS.md (``make bench``), or a quick pass (``make bench-quick``).

Each benchmark prints a markdown report of what it measured on this machine (header with the machine and
date, tables of medians and same-run ratios); this script runs them one after another, each in its own
process, and assembles their reports into one file, with how to reproduce each. A benchmark that fails
is reported as failed in the file (with the tail of its output), never silently left out.

    python benchmarks/make_results.py              # full: writes benchmarks/RESULTS.md and the PNGs
    python benchmarks/make_results.py --quick      # reduced: writes benchmarks/RESULTS-quick.md
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

import verdict  # noqa: E402  (benchmarks/verdict.py: the table that opens RESULTS.md)

HERE = os.path.dirname(os.path.abspath(__file__))
#: The issue's time budgets on 2 cores: ``make bench`` and ``make bench-quick``.
FULL_BUDGET_S = 30 * 60
QUICK_BUDGET_S = 3 * 60

# (script, title, what it answers, arguments of the full run, arguments of the quick run, PNG or None);
# quick runs never write the committed PNGs
SECTIONS = [
    ("bench_peers.py", "Against the peers",
     "cnrstore (adaptive 4-bit weights; intermittent + compaction: intermittent trainer + background compaction, "
     "and incremental + keep-last: incremental trainer, read chains bounded by the writer's deltas, KeepLast retention; "
     "optimizer state fp32 and int8) against a blocking torch.save and torch.distributed.checkpoint "
     "save/async_save on the reference DLRM: bytes written, trainer stall, time until durable, restore "
     "time, disk use.", ["--plot", "peers_intervals.png"], ["--quick"], "peers_intervals.png"),
    ("bench_peers.py", "Lossless against the peers: the reference DLRM's touched share",
     "The comparison a DCP user switching with the defaults gets: cnrstore lossless (fp32 tables, fp32 Adagrad "
     "state; incremental + keep-last) against torch.save, DCP save and async_save on the 1 GiB reference DLRM, "
     "with the worst stall (p100, the first baseline included) and the host memory each save holds.",
     LOSSLESS := ["--codec", "fp32", "--schemes", "incremental", "--optimizer-codecs", "fp32", "--no-stall-run"],
     ["--quick", *LOSSLESS], None),
    ("bench_peers.py", "Lossless against the peers: a fifth of the rows touched per save",
     "The same at about 20% of the rows touched per save (a user's own trainer saving every few dozen steps): a "
     "256 MiB DLRM, 130 steps per interval.",
     [*LOSSLESS, "--emb-mib", "256", "--steps", "130", "--intervals", "5"],
     ["--quick", *LOSSLESS, "--steps", "20"], None),
    ("bench_trainer.py", "A user's trainer: stalls, peak memory and lag",
     "Issue 48's trainer shape (1.6M rows x 64 fp32, sparse gradients under Adagrad, Adam on the MLP; a save every "
     "25 steps), each method in a process of its own: cnrstore at its defaults (streamed saves), with saves copied, "
     "DCP async_save, and no checkpoints: stall median and p100, peak RSS, the lag between save() and its commit, "
     "the step hooks' cost, the background write rate against the disk's.",
     [], ["--quick"], None),
    ("bench_accuracy.py", "Accuracy against the paper's bit-width table",
     "Every cell of the paper's table (1 restore -> 2-bit, 3 -> 3-bit, 20 -> 4-bit, more -> 8-bit), uniform, "
     "adaptive and k-means, on a DLRM that converges (learning rate decayed to 0): held-out logloss averaged "
     "over the last evaluations against the same seed's run without failures, paired over 8 seeds, with "
     "each verdict's minimum detectable effect; an fp16 control gives the noise floor, an fp32 control checks "
     "that restores are exact.", ["--plot", "accuracy.png"], ["--quick", "--plot", "none"], "accuracy.png"),
    ("bench_accuracy.py", "Accuracy: the cells that calibrate BitWidthPolicy",
     "The cells the paper's table leaves out but a bit-width rule needs (4-bit at 1 and 3 restores, 8-bit at 20), "
     "in the same design: cnrstore.policy.CALIBRATED_TABLE, BitWidthPolicy's default, and the README's decision "
     "table are read off these verdicts and the paper-table run above.",
     ["--cells", "1:4", "3:4", "20:8", "--plot", "none"], ["--quick", "--cells", "1:4", "3:4", "--plot", "none"], None),
    ("bench_accuracy.py", "Accuracy: the optimizer state in int8",
     "The same design with Adagrad's row-wise state checkpointed in int8 (optimizer_codec=\"int8\", which halves a "
     "save's bytes with Adagrad) instead of fp32: 4-bit weights at 1 restore, int8 weights at 20.",
     ["--cells", "1:4", "20:8", "--optimizer-codec", "int8", "--plot", "none"],
     ["--quick", "--cells", "1:4", "--optimizer-codec", "int8", "--plot", "none"], None),
    ("bench_policies.py", "Differential schemes and background compaction",
     "30 checkpoints of 25% Zipf-modified rows under each scheme: bytes the trainer wrote, peak disk, "
     "longest read chain, restore time, trainer checkpoint latency.", ["--plot", "policies.png"],
     ["--quick", "--plot", "none"], "policies.png"),
    ("bench_space.py", "Space management: write and space amplification, read chains",
     "A DLRM (26 Criteo tables capped at 100k rows, dim 64, adaptive4, SGD, incremental saves, 10 "
     "intervals of 30 steps) with no merges, with every save merging to hold read chains at 3 (the engine "
     "before background merges) and with the defaults (saves write their own rows, background merges bound each "
     "block's read cost): bytes written (saves and merges apart) against full fp32 checkpoints, write "
     "amplification, read chains and read amplification, space amplification after retain(5), disk after "
     "retain(1) against one fp32 checkpoint, restore against torch.load, point reads.",
     ["--plot", "space.png"], ["--quick", "--plot", "none"], "space.png"),
    ("bench_writecost.py", "Write cost over a long run: saves, merges and read amplification",
     "A long incremental run (IncrCP_paper's Check-N-Run baseline): 8 tables of 524,288 rows x 64 (1 GiB of "
     "fp32), a baseline and 20 increments each touching 2-5% of every table's rows with Zipf popularity, under "
     "the old policy (the save path merges to hold read chains at 3) and the new one (the package's defaults), "
     "fp32 and int4: bytes and time per save against the raw delta, background merge bytes, total write "
     "amplification, disk, read amplification per block, restore of the newest against torch.load with its "
     "peak extra memory.", ["--plot", "writecost.png"], ["--quick", "--plot", "none"], "writecost.png"),
    ("bench_codecs.py", "Codecs",
     "Encode and decode speed and relative L2 error of every codec beside FBGEMM's plain and greedy "
     "kernels on the same rows, and bytes per row; speed against error plotted.", ["--plot", "codecs.png"],
     ["--quick", "--plot", "none"], "codecs.png"),
    ("bench_tracking.py", "Change tracking overhead",
     "Step time of the reference DLRM with a Checkpointer's hooks active against none (interleaved ON/OFF blocks "
     "on one model; median with a 95% bootstrap interval), a save's fingerprint pass timed directly, and the "
     "tracking state's memory against the embedding bytes.", [], ["--quick"], None),
    ("bench_engine.py", "Storage engine",
     "int4 checkpoint write against FBGEMM's prepack kernel, full-table read against torch.load, 10k "
     "random point reads at an old version, index bytes per stored row; `cnrstore ls`, open and stats() of a "
     "10,000-version history against iterating its versions catalog.", [], ["--quick"], None),
    ("bench_restore.py", "Restore into a live model against dcp.load and torch.load",
     "8 nn.EmbeddingBag(sparse=True) x dim 64 with Adagrad at 1 GiB of state (8 GiB where RAM allows), the newest "
     "of a baseline and 5 increments restored by Checkpointer.restore (int4 weights + fp32 state, and all fp32) "
     "into the live model and optimizer, against dcp.load and torch.load of the same state in the same run, page "
     "cache warm: time ratios, peak extra memory over the state, and the fraction reached of the physical "
     "limit (bytes read at the measured page-cache bandwidth plus int4 decode at kernel speed).",
     [], ["--quick"], None),
    ("bench_restore.py", "Restore's peak memory: a user's trainer against dcp.load",
     "Issue 37's trainer shape (1.6M rows x 64 fp32, Adagrad, a small MLP) saved by Checkpointer at its defaults "
     "(a baseline and 3 increments) and by dcp.save, then restored in a fresh process per restore, methods "
     "interleaved: peak RSS as a memory monitor sees it (ru_maxrss), its file-mapped part, restore seconds and "
     "CPU time, as ratios against dcp.load in the same run.", ["--rss"], ["--rss", "--quick"], None),
    ("bench_scale.py", "Scale curves: how costs grow with the work",
     "One int4 table of dim 16 under the store's defaults, three sweeps: table size (1M to 16M rows: write "
     "throughput, bytes per save, restore against torch.load, 10k point reads, open, ls, stats(), index bytes, "
     "a restore's peak memory against what it returns), versions (10 to 1,000 saves of 1% of the rows: open, "
     "ls, stats(), restore, point reads at the newest and an old version, index and disk bytes, save cost) and "
     "touched fraction (0.1% to 50% of 2M rows in one save: bytes and time per save, restore); each curve's "
     "growth exponent from a log-log fit, and where a cost grows faster than the work.",
     ["--plot", "scale.png"], ["--quick", "--plot", "none"], "scale.png"),
    ("bench_cpr.py", "CPR: full against partial recovery",
     "A sharded DLRM on 2 gloo processes under one simulated failure schedule (MTBF as a parameter): full "
     "recovery against CPR's partial recovery, plain, MFU and SSU, each at the interval "
     "cnrstore.policy.CheckpointInterval picks from the measured save and restore costs: time lost to "
     "checkpoints and failures as a fraction of training time, lost updates, held-out logloss and AUC "
     "against the run without failures.", ["--plot", "cpr.png"], ["--quick", "--plot", "none"], "cpr.png"),
    ("bench_ecrm.py", "ECRM: erasure-coded recovery against full and partial recovery",
     "The same DLRM on 3 gloo processes, a rank SIGKILLed every 60 steps (bench_cpr's MTBF) and replaced: full "
     "recovery, CPR partial recovery and ECRM (parity 2,1) side by side: normal-operation and recovery "
     "overhead as fractions of the no-failure training time, the replaced rank's restore or decode, lost "
     "updates, final logloss/AUC, parity memory and the parity update's cost per step.",
     ["--plot", "ecrm.png"], ["--quick", "--plot", "none"], "ecrm.png"),
    ("bench_ecrm_step.py", "ECRM: the parity update as a share of a training step",
     "bench_ecrm's DLRM shard on 2 and 4 gloo processes (the issue's world sizes; k = world - 1, r = 1), "
     "trained with and without ECRM in alternating blocks (A/B in one run): the step time of each, the "
     "difference as a share of the step, and ECRM's own time by part (capture, encode, message round, apply; "
     "\"of which waiting\": blocked on the round's messages).", [], ["--quick"], None),
    ("bench_recovery.py", "Recovery under torchft: partial recovery against a DCP full restart",
     "3 torchft replica groups of one process each (tools/torchft_job.py), a DLRM split across them, one group "
     "SIGKILLed after a step and started again: it heals through TorchftTransport(tables=\"own\") (CPR: its "
     "table from its own store, the rest from a peer) while the others keep their processes; kill to its first "
     "step split into phases (respawn, interpreter, imports, start-up, quorum and heal, first step), cnrstore's "
     "share, beside every group restarted and loading torch.distributed.checkpoint saves in the same run; and a "
     "1 GiB shard's recv_checkpoint (store rows at the peer's save, changed rows from the peer) against a local "
     "restore() of the same version.", [], ["--quick"], None),
    ("bench_gf256.py", "ECRM: GF(2^8) kernels against zfec and galois",
     "Encoding r parity blocks of k data blocks, and scaling a step's code deltas run by run: "
     "cnrstore.distributed.gf256's pair tables against its byte table and, where installed, zfec and galois.",
     [], ["--quick"], None),
    ("bench_torchrec.py", "TorchRec: cnrstore against DCP async_save on a DMP-sharded model",
     "A DLRM whose EmbeddingBagCollection is sharded by DistributedModelParallel over 2 gloo processes (row- and "
     "table-wise, fused row-wise Adagrad; ~300 MB of state, Zipf lookups), saved every 10 steps through "
     "cnrstore's DistributedCheckpointer (incremental, int4 and fp32 weights) and, in a separate pass of the "
     "identical training run, through DCP async_save: trainer stall and bytes on disk per save as ratios "
     "DCP/cnrstore, the wait for the previous save, time until durable, restore of the newest version.",
     ["--plot", "torchrec.png"], ["--quick", "--plot", "none"], "torchrec.png"),
    ("bench_s3.py", "Checkpoints on S3: the remote tier against DCP's FsspecWriter",
     "8 fp32 tables (128 MiB), 10 saves each changing 5% of the rows, to the same S3 endpoint (moto's server on "
     "localhost, in a process of its own): cnrstore with its remote tier (copy point after every commit) against "
     "torch.distributed.checkpoint with FsspecWriter: seconds and bytes uploaded per save, the copy point's cost "
     "against a local store, restore of the newest save on a fresh machine against dcp.load and against the "
     "endpoint's bulk GET throughput for the same objects, bytes fetched against bytes needed.", [], ["--quick"],
     None),
    ("bench_s3.py", "Checkpoints on S3, 1 GiB: restore from the bucket",
     "bench_s3 with 8 fp32 tables of 1 GiB in all, 4 saves each changing 5% of the rows: the same figures, "
     "restores measured 3 times each.", ["--gib", "1", "--reps", "3"], ["--quick"], None),
    ("bench_serving.py", "Serving follows training: a replica applying every version",
     "The reference DLRM (26 tables capped at 100,000 rows x 64 fp32, Adagrad) saving every 3 s into a local store "
     "while a serving process follows it (polling every 0.2 s): freshness from a version's commit to the follower's "
     "tensors (p50, p99), bytes the replica reads per update against the changed rows in the table's codec, a "
     "TorchEasyRec-style dump of the touched ids (fp32 and int8 rows) and dcp.load of a full checkpoint, the "
     "follower's CPU; tools/serve_follow.py's drifting click stream over 5 seeds (following against full reloads "
     "every 100 steps); the same follow with the store on S3 (moto on localhost, a process of its own).",
     [], ["--quick"], None),
    ("bench_dist_s3.py", "Many nodes, one bucket: a 2-rank job on S3 against DCP's FsspecWriter",
     "2 gloo ranks, each a process with a node directory of its own, 2 fp32 tables of 262,144 x 64 row-wise with "
     "Adagrad, 5 saves each after a step touching 5% of the rows, to one S3 endpoint (moto in a process of its "
     "own): DistributedCheckpointer(remote=) against dcp.save with FsspecWriter: stall, commit and bytes uploaded "
     "per save, the bucket's cost against a root on local disk; saves every 0.15 s, faster than a publication, "
     "without waiting (the stall includes what a save waits for), against the same saves each waiting for the "
     "one before and against a local root; and restore after rank 1's node is lost (rank 1 on an empty "
     "directory) against dcp.load.", [], ["--quick"], None),
    ("bench_s3_trainer.py", "A trainer checkpointing to S3: does a save wait for the bucket?",
     "Issue 49's trainer: one nn.EmbeddingBag of 1,048,576 x 64 fp32 (sparse, Adagrad) and a small MLP, a save "
     "every 20 steps, 12 saves, to a local store, to a store in a bucket (moto on localhost, a process of its "
     "own), and the same as 2 gloo ranks (DistributedCheckpointer, a local root against a bucket root); 3 rounds "
     "interleaved: each save's stall, worst against median and against the local run's worst, the bucket's lag, "
     "bytes uploaded against bytes written, the seconds close() takes to make the bucket current.",
     [], ["--quick", "--rounds", "1"], None),
    ("bench_dynamic.py", "Dynamic embedding tables (bench_dynamic.py)",
     "Issue 50's benchmark: a numpy emulation of a dynamic-embedding trainer (ids from a 2^40 space drawn by a Zipf "
     "stream, 10-20% of the live count admitted per interval, the lowest decayed scores evicted to hold the live "
     "count; dim 64 fp32 with a score and a last-step column) checkpointed three ways: a cnrstore keyed table "
     "(the interval's puts and evictions), DCP full dumps, dynamicemb-style full dumps with key-only deltas: bytes "
     "and stall per save, cnrstore's bytes against the changes' bytes, restore of the newest checked against the "
     "emulator, and a restore at another world size (2 writer ranks, 3 readers by partition range) against "
     "reading every old rank's file; and a follower (cnrstore.serving.Follower into a KeyedReplica, a process of its "
     "own) following a keyed table while it is saved every 2 s: freshness from commit, stale reads of evicted ids "
     "(checked after every update), bytes fetched per update against the changes'.", ["--keys", "4000000"],
     ["--quick"], None),
]


#: The GPU section: run where torch sees a CUDA device (and then also rewrite RESULTS-gpu.md); elsewhere the
#: last GPU run's report, committed as RESULTS-gpu.md, is included as it is, saying so.
GPU_SCRIPT, GPU_RESULTS = "bench_gpu.py", os.path.join(HERE, "RESULTS-gpu.md")
GPU_TITLE = "On a GPU: save stall and restore with CUDA embeddings"
GPU_WHAT = ("8 nn.EmbeddingBag(sparse=True) of 1M rows x 64 on a CUDA device with Adagrad (3.8 GiB of state), a "
            "baseline and 5 increments of 2% Zipf-touched rows, saved by cnrstore (fp32 and int4 weights), "
            "torch.save, DCP save and DCP async_save: trainer stall, time until durable, bytes, restore of "
            "the newest into the CUDA model against torch.load and dcp.load.")


def has_cuda() -> bool:
    """Whether torch sees a CUDA device (asked in a child process: this parent never imports torch)."""
    probe = subprocess.run([sys.executable, "-c", "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"],
                           capture_output=True)
    return probe.returncode == 0


def gpu_section(quick: bool, timeout: float) -> tuple[str, float, bool]:
    """(the GPU section's markdown, seconds run, ok): measured here on a GPU, else the committed report."""
    if has_cuda():
        report, seconds, ok = run_section(GPU_SCRIPT, ["--quick"] if quick else [], timeout)
        if ok and not quick:
            with open(GPU_RESULTS, "w") as f:
                f.write(report)
        return report, seconds, ok
    if not os.path.exists(GPU_RESULTS):
        return "*Not run: this machine has no CUDA device, and no earlier GPU run is recorded.*\n", 0.0, True
    with open(GPU_RESULTS) as f:
        note = ("*This machine has no CUDA device: below is the last GPU run, as committed in "
                "`benchmarks/RESULTS-gpu.md` (`python benchmarks/bench_gpu.py --out benchmarks/RESULTS-gpu.md` "
                "on a GPU machine writes it).*\n\n")
        return note + f.read(), 0.0, True


def shown_args(args: list[str]) -> list[str]:
    """A section's arguments as its Reproduce line shows them: without ``--plot FILE``, which only draws."""
    out, skip = [], False
    for a in args:
        if skip or a == "--plot":
            skip = not skip
            continue
        out.append(a)
    return out


def load_average() -> str:
    """The 1/5/15-minute load averages (the machine is shared: the load beside each benchmark's time). The
    twin of bench_engine.load_average, kept here so that this long-lived parent never imports torch."""
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "unknown"


def run_section(script: str, args: list[str], timeout: float) -> tuple[str, float, bool]:
    """Run one benchmark; returns (its markdown report or a failure note, seconds, ok)."""
    path = os.path.join(HERE, script)
    if not os.path.exists(path):
        return f"*Not run: {script} does not exist yet.*\n", 0.0, False
    with tempfile.NamedTemporaryFile("r", suffix=".md") as out:
        cmd = [sys.executable, path, "--out", out.name, *args]
        t0 = time.monotonic()
        try:
            proc = subprocess.run(cmd, cwd=HERE, capture_output=True, text=True, timeout=timeout)
            ok = proc.returncode == 0
            tail = (proc.stdout + proc.stderr)[-2000:]
        except subprocess.TimeoutExpired as exc:
            ok, tail = False, f"timed out after {timeout:.0f} s\n{(exc.stdout or b'')[-1500:]!r}"
        seconds = time.monotonic() - t0
        report = open(out.name).read() if ok else ""
    if not ok or not report.strip():
        return f"*Failed: `{' '.join(os.path.basename(c) for c in cmd)}`*\n\n```\n{tail}\n```\n", seconds, False
    return report, seconds, True


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="reduced runs; writes RESULTS-quick.md")
    parser.add_argument("--out", help="output file (default: benchmarks/RESULTS.md, or RESULTS-quick.md)")
    parser.add_argument("--only", nargs="*", help="run only these scripts (e.g. bench_engine.py)")
    parser.add_argument("--timeout", type=float, default=None, help="seconds per benchmark (default 1200; 180 quick)")
    args = parser.parse_args(argv)
    out = args.out or os.path.join(HERE, "RESULTS-quick.md" if args.quick else "RESULTS.md")
    timeout = args.timeout or (180.0 if args.quick else 1200.0)
    parts = [
        "# Benchmark results\n",
        "Written by `benchmarks/make_results.py` (`make bench`; `make bench-quick` writes the reduced "
        "RESULTS-quick.md instead). Every figure was measured on the machine named in its section's header, "
        "in one run; comparisons are ratios against a reference measured in the same run, because these "
        "machines are shared and noisy. Re-run to refresh; don't edit by hand. How to read the figures, and the "
        "runs of earlier issues, are in `docs/BENCHMARK-NOTES.md`.\n",
    ]
    failed = []
    walls: list[tuple[str, float, bool, str, str]] = []
    t_all = time.monotonic()
    for script, title, what, full_args, quick_args, png in SECTIONS:
        if args.only and script not in args.only:
            continue
        print(f"== {script} ...", flush=True)
        load_before = load_average()
        report, seconds, ok = run_section(script, quick_args if args.quick else full_args, timeout)
        print(f"   {'ok' if ok else 'FAILED'} in {seconds:.0f} s", flush=True)
        walls.append((script, seconds, ok, load_before, load_average()))
        if not ok:
            failed.append(script)
        reproduce = f"`.venv/bin/python benchmarks/{' '.join([script, *shown_args(quick_args if args.quick else full_args)])}`"
        parts.append(f"\n## {title}\n\n{what}\n\nReproduce: {reproduce} ({seconds:.0f} s here).\n")
        if png and ok and not args.quick:
            parts.append(f"\n![{title}]({png})\n")
        # the report's own headings go one level under the section's
        parts.append("\n" + "\n".join("#" + line if line.startswith("#") else line for line in report.splitlines()) + "\n")
    if not args.only or GPU_SCRIPT in args.only:
        report, seconds, ok = gpu_section(args.quick, timeout)
        if not ok:
            failed.append(GPU_SCRIPT)
        parts.append(f"\n## {GPU_TITLE}\n\n{GPU_WHAT}\n\nReproduce: `python benchmarks/{GPU_SCRIPT}` on a machine "
                     f"with a CUDA device.\n")
        parts.append("\n" + "\n".join("#" + line if line.startswith("#") else line for line in report.splitlines()) + "\n")
    total = time.monotonic() - t_all
    budget = QUICK_BUDGET_S if args.quick else FULL_BUDGET_S
    parts.append("\n---\n\n| benchmark | wall time | result | load average (1/5/15 min) before | after |\n"
                 "|---|---:|---|---|---|\n")
    parts += [f"| {script} | {seconds:.0f} s | {'ok' if ok else 'FAILED'} | {before} | {after} |\n"
              for script, seconds, ok, before, after in walls]
    parts.append(f"| **all** | **{total:.0f} s** | budget {budget:.0f} s "
                 f"({'within' if total <= budget else 'OVER'}) | | |\n")
    print("wall times: " + ", ".join(f"{script} {seconds:.0f} s" for script, seconds, *_ in walls)
          + f"; all {total:.0f} s (budget {budget:.0f} s{'' if total <= budget else ': OVER'})")
    with open(out, "w") as f:
        f.write(verdict.put("".join(parts)))  # the user's verdict, read off the sections, opens the file
    print(f"wrote {out}" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
