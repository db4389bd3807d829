#!/usr/bin/env python3
"""cnrstore against its peers on the reference DLRM: bytes written, trainer stall, durability, restore, disk.

The model, optimizer (Adagrad) and data are those of ``tools/train_dlrm.py`` (26 EmbeddingBags with the
Criteo Kaggle cardinalities capped at a ``--max-rows`` chosen so the tables hold ``--emb-mib`` MiB of fp32
weights at dim 16; Zipf-distributed ids). Training runs ``--intervals`` checkpoint intervals of
``--steps`` steps each; after every interval the same state is checkpointed by every method, one after
the other, all in ONE run (each method's write is waited for before the next method starts, so no
method's foreground work overlaps another's measurement; cnrstore's background compaction may still run
while the others save, as it would beside a trainer):

  - cnrstore, intermittent + compaction: ``Checkpointer(codec="adaptive4", mode="intermittent")`` on a store
    opened with ``compaction="auto"`` (the trainer writes intermittent differentials and its own
    baselines; every version kept);
  - cnrstore, incremental + keep-last: ``Checkpointer(codec="adaptive4", mode="incremental")`` on a store
    opened with ``compaction=CompactionPolicy(retention=Retention(KeepLast(--keep)))``: the
    trainer writes only the rows touched since its previous save (the writer bounds read chains with
    deltas and per-block baselines, cnrstore/engine/merge.py), the background compactor drops all but the last
    ``--keep`` versions and collects (GC on);
  - each of them with Adagrad's state lossless (``optimizer_codec="fp32"``, the API default) and in int8;
  - torch.save: a blocking ``torch.save`` of model + optimizer state to a new file, then fsync;
  - DCP save: ``torch.distributed.checkpoint.save`` (single-process gloo group, loopback) to a new dir;
  - DCP async_save: ``torch.distributed.checkpoint.async_save`` to a new dir.

Per method: bytes written (per interval, median, and total; cnrstore's include compaction's), the trainer
stall (time until the call returns: for cnrstore ``save()``'s snapshot; for async_save its staging, until
it returns the future; for the blocking methods the whole save), the time until durable (cnrstore: until
``pending.wait()`` returns; async_save: until ``future.result()``; torch.save: with the fsync; DCP save:
until it returns — DCP does not fsync by default), the restore time of the newest checkpoint into a
freshly built model and optimizer (median of ``--restores``), and the disk use.

Disk and retention: the peers keep their last ``--keep`` checkpoints on disk (older files are deleted
after each interval, as a trainer with that retention would; keeping all of them at 1 GiB would need
~120 GiB). Their disk use is reported two ways: as measured (``du``, last ``--keep`` kept), and for
keeping all checkpoints (the sum of every checkpoint's ``du``, measured right after it was written;
each is an independent file or directory). intermittent + compaction keeps every version and compares
with the peers' all-kept figure; incremental + keep-last keeps the last ``--keep`` and compares with the
peers' measured figure.

Trainer stall over a run ( ``--stall-only`` runs just this part): intermittent + compaction trains
``--stall-saves`` checkpoint intervals of ``--stall-every`` steps and saves after each WITHOUT waiting for the
write, as a trainer does, twice from the same seed and batches: with the save queue (the default bound)
and with ``max_queue_bytes=0`` (one save at a time, the behaviour before the save queue: a save waits for the one
still writing). Per arm: every save()'s wall time (the stall), its median and maximum over the run
(baselines included; and after the first save), the baselines' stalls, and the save right after each
baseline against the median ordinary increment. A save waits, inside its stall, while ``max_lag`` (2, the
default) saves are still writing: saving after every step, the saves behind a baseline wait for its write.

    python benchmarks/bench_peers.py                 # full run (see --emb-mib for the scale)
    python benchmarks/bench_peers.py --quick         # smoke run (< 60 s)
    python benchmarks/bench_peers.py --quick --stall-only   # the trainer-stall run alone
    python benchmarks/bench_peers.py --out FILE --plot benchmarks/peers_intervals.png
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tools"))
from common import (dir_bytes, fmt_bytes, free_port, load_average, load_peer_checkpoint,  # noqa: E402
                          machine_description, median, peak_rss, publish, reset_peak_rss)
import dlrm_model  # noqa: E402

import cnrstore  # noqa: E402
from cnrstore.policy import CompactionPolicy, KeepLast, Retention  # noqa: E402
from cnrstore.torch import Checkpointer  # noqa: E402

WEIGHT_CODEC = "adaptive4"
PEERS = ("torch.save", "DCP save", "DCP async_save")
SCHEMES = ("intermittent", "incremental")
#: how each scheme is named in the report: the trainer's mode, and what keeps the versions bounded
SCHEME_LABELS = {"intermittent": "intermittent + compaction", "incremental": "incremental + keep-last"}
OPTIMIZER_CODECS = ("fp32", "int8")


@dataclass(frozen=True)
class CnrConfig:
    """One cnrstore configuration: the scheme (intermittent or incremental) and the optimizer state's codec."""

    scheme: str
    optimizer_codec: str

    @property
    def name(self) -> str:
        base = f"cnrstore, {SCHEME_LABELS[self.scheme]}"
        return base if self.optimizer_codec == "fp32" else f"{base}, optimizer {self.optimizer_codec}"


    @property
    def mode(self) -> str:
        return self.scheme

    def compaction(self, keep: int):
        if self.scheme == "intermittent":
            return "auto"
        # the default materialize rule: none while the writer bounds read chains (merge.py), as it does
        return CompactionPolicy(retention=Retention(KeepLast(keep)), gc=True)


def rows_cap_for(total_rows: int) -> int:
    """The smallest ``--max-rows`` cap whose capped Criteo cardinalities sum to >= ``total_rows``."""
    lo, hi = 1, max(dlrm_model.CRITEO_KAGGLE_CARDINALITIES)
    while lo < hi:
        mid = (lo + hi) // 2
        if sum(min(c, mid) for c in dlrm_model.CRITEO_KAGGLE_CARDINALITIES) >= total_rows:
            hi = mid
        else:
            lo = mid + 1
    return lo


def du(path: str) -> int:
    """Bytes allocated for the file or directory tree ``path`` (blocks, as ``du``; not apparent size)."""
    if os.path.isfile(path):
        return os.lstat(path).st_blocks * 512
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fmt_s(s: float) -> str:
    if s != s:
        return "n/a"
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


def fresh(args, seed: int):
    model = dlrm_model.build_model(args, seed)
    return model, dlrm_model.build_optimizer(model, args.lr)


def remove_path(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.exists(path):
        os.remove(path)


class PeerRetention:
    """Keeps a peer's last ``keep`` checkpoints on disk; remembers every checkpoint's ``du`` as written."""

    def __init__(self, keep: int):
        self.keep = keep
        self.paths: list[str] = []
        self.sizes: list[int] = []

    def written(self, path: str) -> None:
        self.paths.append(path)
        self.sizes.append(du(path))
        while len(self.paths) > self.keep:
            remove_path(self.paths.pop(0))

    @property
    def all_kept(self) -> int:
        return sum(self.sizes)


def run(args) -> tuple[str, dict]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    torch.set_num_threads(args.threads)
    rows_target = args.emb_mib * 2**20 // (4 * args.dim)
    args.max_rows = rows_cap_for(rows_target)
    card = dlrm_model.cardinalities(args)
    emb_bytes = sum(card) * args.dim * 4
    has_async = hasattr(dcp, "async_save")
    configs = [CnrConfig(s, oc) for s in args.schemes for oc in args.optimizer_codecs]
    cnr = {c.name: c for c in configs}
    methods = [c.name for c in configs] + list(PEERS)
    notes: list[str] = []

    root = tempfile.mkdtemp(prefix="bench_peers-", dir=args.tmp)
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{free_port()}")
    t_all = time.perf_counter()
    try:
        t0 = time.perf_counter()
        loader = dlrm_model.SyntheticCriteo(args)
        model, opt = fresh(args, args.seed)
        loss_fn = nn.BCEWithLogitsLoss()
        setup_s = time.perf_counter() - t0
        dirs = {m: os.path.join(root, "".join(ch if ch.isalnum() else "_" for ch in m)) for m in methods}
        for d in dirs.values():
            os.makedirs(d)
        stores = {m: cnrstore.open(dirs[m], create=True, compaction=c.compaction(args.keep))
                  for m, c in cnr.items()}
        ckpts = {m: Checkpointer(stores[m], model, opt, codec=args.codec, mode=c.mode,
                                 optimizer_codec=c.optimizer_codec) for m, c in cnr.items()}
        memory = {m: [] for m in methods}  # host memory a save held over the trainer's (its peak RSS - before)
        keepers = {m: PeerRetention(args.keep) for m in PEERS}
        stall = {m: [] for m in methods}
        durable = {m: [] for m in methods}
        written = {m: [] for m in methods}
        disk_trace = {m: [] for m in methods}
        method_s = {m: [] for m in methods}  # wall time of each method's part of an interval
        trainer_bytes = {m: 0 for m in cnr}
        trainer_baselines = {m: 0 for m in cnr}
        baselines_seen = {m: set() for m in cnr}
        touched_frac, train_s = [], []
        step = 0
        prev_cnr_bytes = {m: 0 for m in cnr}
        for interval in range(args.intervals):
            seen = [torch.zeros(n, dtype=torch.bool) for n in card]
            t0 = time.perf_counter()
            torch.set_num_threads(args.train_threads)  # training is not measured; checkpoints are, at --threads
            for _ in range(args.steps):
                dense, ids, labels = loader.next()
                for t in range(len(card)):
                    seen[t][ids[:, t]] = True
                opt.zero_grad(set_to_none=True)
                loss_fn(model(dense, ids), labels).backward()
                opt.step()
                step += 1
            torch.set_num_threads(args.threads)
            train_s.append(time.perf_counter() - t0)
            touched_frac.append(sum(int(s.sum()) for s in seen) / sum(card))

            # cnrstore: snapshot (the stall), then the background write until committed (durable).
            for m, ckpt in ckpts.items():
                rss0 = reset_peak_rss()
                t0 = time.perf_counter()
                pending = ckpt.save(step)
                stall[m].append(time.perf_counter() - t0)
                pending.wait()
                durable[m].append(time.perf_counter() - t0)
                memory[m].append(peak_rss() - rss0)
                trainer_baselines[m] += bool(pending.report.baseline)
                trainer_bytes[m] += int(stores[m].latest().bytes)
                b = int(stores[m].stats()["bytes_written"])  # the trainer's writes plus compaction's so far
                written[m].append(b - prev_cnr_bytes[m])
                prev_cnr_bytes[m] = b
                baselines_seen[m].add(stores[m].engine.history().baseline_version)
                disk_trace[m].append(du(dirs[m]))
                method_s[m].append(time.perf_counter() - t0)

            state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
            # torch.save: blocking, then fsync (file and directory).
            path = os.path.join(dirs["torch.save"], f"ckpt_{interval:03d}.pt")
            rss0 = reset_peak_rss()
            t0 = time.perf_counter()
            with open(path, "wb") as f:
                torch.save(state, f)
                stall["torch.save"].append(time.perf_counter() - t0)
                f.flush()
                os.fsync(f.fileno())
            fsync_dir(dirs["torch.save"])
            durable["torch.save"].append(time.perf_counter() - t0)
            memory["torch.save"].append(peak_rss() - rss0)
            written["torch.save"].append(os.path.getsize(path))
            keepers["torch.save"].written(path)
            method_s["torch.save"].append(time.perf_counter() - t0)

            # DCP save: blocking; returns once the files are written (no fsync of its own).
            d = os.path.join(dirs["DCP save"], f"step_{interval:03d}")
            rss0 = reset_peak_rss()
            t0 = time.perf_counter()
            dcp.save(state, checkpoint_id=d)
            stall["DCP save"].append(time.perf_counter() - t0)
            durable["DCP save"].append(stall["DCP save"][-1])
            memory["DCP save"].append(peak_rss() - rss0)
            written["DCP save"].append(dir_bytes(d))
            keepers["DCP save"].written(d)
            method_s["DCP save"].append(time.perf_counter() - t0)

            # DCP async_save: the stall is its staging (until it returns the future).
            if has_async:
                d = os.path.join(dirs["DCP async_save"], f"step_{interval:03d}")
                rss0 = reset_peak_rss()
                t0 = time.perf_counter()
                fut = dcp.async_save(state, checkpoint_id=d)
                stall["DCP async_save"].append(time.perf_counter() - t0)
                fut.result()
                durable["DCP async_save"].append(time.perf_counter() - t0)
                memory["DCP async_save"].append(peak_rss() - rss0)
                written["DCP async_save"].append(dir_bytes(d))
                keepers["DCP async_save"].written(d)
                method_s["DCP async_save"].append(time.perf_counter() - t0)
            del state
            for m in PEERS:
                if stall[m]:
                    disk_trace[m].append(du(dirs[m]))
            if not args.quiet:
                print(f"  interval {interval + 1}/{args.intervals}: step {step}, {touched_frac[-1]:.2%} of rows "
                      f"touched, train {train_s[-1]:.1f} s; per method s "
                      + " / ".join(f"{method_s[m][-1]:.1f}" for m in methods if method_s[m]),
                      file=sys.stderr, flush=True)

        # Let background compaction finish (it is part of the bytes written and of the disk use).
        drain_s, versions, max_chain = {}, {}, {}
        for m, store in stores.items():
            t0 = time.perf_counter()
            store.wait_for_compaction()
            drain_s[m] = time.perf_counter() - t0
            written[m][-1] += int(store.stats()["bytes_written"]) - prev_cnr_bytes[m]
            baselines_seen[m].add(store.engine.history().baseline_version)
            st = store.stats()
            versions[m], max_chain[m] = st["versions"], st["max_read_chain"]
            ckpts[m].close()
            store.close()
        del ckpts  # their host buffers (a full table each) before the restores allocate more
        gc.collect()
        disk = {m: du(d) for m, d in dirs.items()}
        disk_all = {m: (keepers[m].all_kept if m in keepers else
                        (disk[m] if cnr[m].scheme == "intermittent" else float("nan"))) for m in methods}
        disk_last = {m: (disk[m] if m in keepers or cnr[m].scheme == "incremental" else float("nan"))
                     for m in methods}
        compaction_baselines = {m: len(baselines_seen[m] - {None}) - 1 for m in cnr}  # the first is the trainer's

        # Restore the newest checkpoint into a freshly built model and optimizer (a restarted process).
        final = {k: v.detach().clone() for k, v in model.state_dict().items() if "embs" in k}
        final_sum = [opt.state[p]["sum"].abs().max() for p in model.parameters()]
        restore = {m: [] for m in methods}
        check = {}
        last = args.intervals - 1
        for m in methods:
            if not stall[m]:
                continue
            # one freshly built model + optimizer per method (building 2 GiB of state takes seconds): the
            # first restore fills it from scratch and is checked; the later ones overwrite the same state
            m2, o2 = fresh(args, args.seed + 1000)
            for r in range(args.restores):
                t0 = time.perf_counter()
                if m in cnr:
                    s2 = cnrstore.open(dirs[m])
                    c2 = Checkpointer(s2, m2, o2, codec=args.codec, mode=cnr[m].mode,
                                      optimizer_codec=cnr[m].optimizer_codec)
                    c2.restore()
                    restore[m].append(time.perf_counter() - t0)
                    c2.close()
                    s2.close()
                else:
                    path = os.path.join(dirs[m], f"ckpt_{last:03d}.pt" if m == "torch.save" else f"step_{last:03d}")
                    load_peer_checkpoint(m, path, m2, o2)
                    restore[m].append(time.perf_counter() - t0)
                if r == 0:  # how far the restored embeddings / optimizer state are from the trained ones
                    sd = m2.state_dict()
                    check[m] = (max(float((sd[k] - final[k]).abs().max()) for k in final),
                                max(float((o2.state[p]["sum"] - opt.state[q]["sum"]).abs().max() / (s + 1e-30))
                                    for p, q, s in zip(m2.parameters(), model.parameters(), final_sum)))
                gc.collect()
            del m2, o2
            gc.collect()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        shutil.rmtree(root, ignore_errors=True)
    total_s = time.perf_counter() - t_all
    if not has_async:
        notes.append("torch.distributed.checkpoint.async_save is not available in this torch "
                     f"({torch.__version__}): its row is left out and the stall goal cannot be checked.")

    full = median(written["torch.save"])
    rows = []
    for m in methods:
        if not stall[m]:
            rows.append((m, *["n/a"] * 11))
            continue
        rows.append((m, fmt_bytes(median(written[m])), fmt_bytes(sum(written[m])),
                     f"{sum(written['torch.save']) / sum(written[m]):.1f}x",
                     fmt_s(median(stall[m])), fmt_s(max(stall[m])), fmt_s(median(durable[m])),
                     fmt_s(median(restore[m])),
                     fmt_bytes(disk_all[m]) if disk_all[m] == disk_all[m] else "-",
                     fmt_bytes(disk_last[m]) if disk_last[m] == disk_last[m] else "-",
                     fmt_bytes(max(disk_trace[m])), fmt_bytes(max(0, max(memory[m])))))
    res = dict(methods=methods, stall=stall, durable=durable, written=written, disk_trace=disk_trace,
               restore=restore, full_bytes=full)

    def goal(name, ratio, target):
        ok = ratio == ratio and ratio >= target
        return f"  - {name}: {ratio:.1f}x (goal >= {target}x): **{'met' if ok else 'not met'}**"

    goals = []
    for m, c in cnr.items():
        if c.scheme == "intermittent":
            disk_ref, disk_what = disk_all["torch.save"], f"torch.save keeping all {args.intervals} checkpoints"
        else:
            disk_ref, disk_what = disk_last["torch.save"], f"torch.save keeping its last {args.keep}"
        later = written[m][1:]
        steady = (f"; the total includes the first, full save, so it grows with --intervals: intervals 2-"
                  f"{args.intervals} alone, {sum(written['torch.save'][1:]) / sum(later):.1f}x" if later else "")
        goals += [f"- {m}:",
                  goal(f"write volume over {args.intervals} intervals, torch.save's full fp32 checkpoints / this "
                       "(all bytes written, compaction included)", sum(written["torch.save"]) / sum(written[m]), 20)
                  + steady,
                  goal(f"disk use after {args.intervals} intervals, {disk_what} / this", disk_ref / disk[m], 8)]
        if has_async:
            goals.append(goal("trainer stall, DCP async_save's staging / this save() (medians)",
                              median(stall["DCP async_save"]) / median(stall[m]), 10))
        else:
            goals.append("  - trainer stall vs async_save staging: cannot be checked (async_save unavailable)")

    head = machine_description()
    lines = [f"## {args.title}", ""]
    lines += [f"- {h}" for h in head]
    lines += [
        f"- load average (1/5/15 min) at start: {args.load_start}; at end: {load_average()}",
        f"- model: reference DLRM of tools/train_dlrm.py, 26 EmbeddingBags, {sum(card):,} rows x dim "
        f"{args.dim} (--max-rows {args.max_rows:,}) = {fmt_bytes(emb_bytes)} of fp32 embeddings, Adagrad "
        f"(element-wise state of the same size); full state per checkpoint {fmt_bytes(full)}",
        f"- {args.intervals} checkpoint intervals of {args.steps} steps x batch {args.batch_size}; rows "
        f"touched per interval: median {median(touched_frac):.2%} (min {min(touched_frac):.2%}, max "
        f"{max(touched_frac):.2%}); training {median(train_s):.2f} s per interval (median, {args.train_threads} "
        f"thread(s)); checkpoints and restores measured with {args.threads} torch thread(s)",
        f"- weights in {args.codec}{' (lossless)' if args.codec == 'fp32' else ' (quantized: lossy)'}; intermittent + compaction: Checkpointer(mode=\"intermittent\") on "
        "open(compaction=\"auto\"), every version kept; incremental + keep-last: Checkpointer(mode=\"incremental\") on "
        f"open(compaction=CompactionPolicy(retention=Retention(KeepLast({args.keep})), gc=True)) (read chains "
        "bounded by the writer's deltas, no background baselines)",
    ]
    for m, c in cnr.items():
        lines.append(
            f"- {m}: {trainer_baselines[m]} baseline(s) written by the trainer, {compaction_baselines[m]} "
            f"materialized by compaction; {fmt_bytes(trainer_bytes[m])} written by the trainer, "
            f"{fmt_bytes(sum(written[m]) - trainer_bytes[m])} by compaction (baselines and GC copies); "
            f"{versions[m]} version(s) kept, longest read chain {max_chain[m]}; compaction drained "
            f"{fmt_s(drain_s[m])} after the last save; cnrstore's time per interval (save to durable, median) "
            f"{fmt_s(median(method_s[m]))}")
    lines += [
        f"- retention: the peers delete all but their last {args.keep} checkpoints after each interval; "
        "'disk, all kept' of a peer is the sum of its checkpoints' du, each measured right after it was "
        "written; 'disk, last K kept' is du at the end. 'disk peak' is the largest du sampled after each "
        "interval's save",
        "- DCP save and async_save do not fsync (their 'durable' is when the write returns); torch.save's "
        "includes fsync",
        "- host memory: the most resident memory a save added over the trainer's while it ran, max over the "
        "intervals (the process's peak RSS, reset before each method's save with /proc/self/clear_refs, less its "
        "RSS then): what a checkpointing trainer needs on top of one that does not checkpoint",
        f"- restore: newest checkpoint into a freshly built model + optimizer (one per method; its later "
        f"restores overwrite the same tensors), median of {args.restores}; max |emb "
        "diff| to the trained weights / max error of Adagrad's accumulators relative to their largest value: "
        + ", ".join(f"{m} {v[0]:.3g} / {v[1]:.3g}" for m, v in check.items()),
        f"- whole benchmark {total_s:.0f} s (setup {setup_s:.0f} s); reproduce: "
        f"`python benchmarks/bench_peers.py{' --quick' if args.quick else ''}"
        f"{f' --emb-mib {args.emb_mib}' if args.emb_mib != args.default_emb_mib else ''}"
        f"{args.extra_args}`",
        "",
        "| method | bytes written / interval (median) | bytes written, total | full ckpts / all written "
        "| trainer stall (median) | stall (max) | until durable (median) | restore newest (median) "
        f"| disk, all {args.intervals} kept | disk, last {args.keep} kept | disk peak | host memory held (max) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    lines += ["", "Targets, ratios from this run:", *goals]
    if notes:
        lines += ["", *[f"Note: {n}" for n in notes]]
    return "\n".join(lines) + "\n", res


def stall_run(args) -> str:
    """The trainer-stall run (module doc): markdown lines with both arms' figures and the issue-23 goals."""
    torch.set_num_threads(args.threads)
    if not getattr(args, "max_rows", None):
        args.max_rows = rows_cap_for(args.emb_mib * 2**20 // (4 * args.dim))
    card = dlrm_model.cardinalities(args)
    loss_fn = nn.BCEWithLogitsLoss()
    loader = dlrm_model.SyntheticCriteo(args)
    batches = [loader.next() for _ in range(args.stall_every * args.stall_saves)]
    arms = {"queued (default bound)": None, "one at a time (max_queue_bytes=0)": 0}
    out = {}
    # an untimed warm-up arm first (a process's first saves pay one-time costs), then the arms
    for arm, bound in [("warm-up", None), *arms.items()]:
        model, opt = fresh(args, args.seed)
        root = tempfile.mkdtemp(prefix="bench_peers-stall-", dir=args.tmp)
        try:
            store = cnrstore.open(os.path.join(root, "store"), create=True, compaction="auto")
            ck = Checkpointer(store, model, opt, codec=WEIGHT_CODEC, mode="intermittent", max_queue_bytes=bound)
            stalls, baseline, held, pendings = [], [], [], []
            t_run = time.perf_counter()
            for i in range(args.stall_saves if arm != "warm-up" else 3):
                torch.set_num_threads(args.train_threads)
                for dense, ids, labels in batches[i * args.stall_every:(i + 1) * args.stall_every]:
                    opt.zero_grad(set_to_none=True)
                    loss_fn(model(dense, ids), labels).backward()
                    opt.step()
                torch.set_num_threads(args.threads)
                t0 = time.perf_counter()
                pending = ck.save(i)
                stalls.append(time.perf_counter() - t0)
                baseline.append(pending.report.baseline)
                held.append(ck.queued_bytes())
                pendings.append(pending)
            versions = [p.wait() for p in pendings]
            run_s = time.perf_counter() - t_run
            assert versions == sorted(versions), "versions committed out of save order"
            if arm != "warm-up":
                out[arm] = dict(stalls=stalls, baseline=baseline, held=max(held), bound=ck.queue_bound(),
                                run_s=run_s, max_lag=ck.max_lag)
            ck.close()
            store.close()
        finally:
            shutil.rmtree(root, ignore_errors=True)
        del model, opt
        gc.collect()

    lines = ["### Trainer stall over a run", "",
             f"- {args.stall_saves} saves, one every {args.stall_every} step(s) of batch {args.batch_size}, "
             f"Checkpointer(codec={WEIGHT_CODEC!r}, mode='intermittent') on open(compaction='auto'), "
             f"{sum(card) * args.dim * 4 / 2**20:.0f} MiB of fp32 embeddings + Adagrad state; save() not waited "
             "for; the same seed and batches in every arm, run one after the other after an untimed warm-up (3 saves)", "",
             "| arm | saves (baselines) | stall median | p90 | stall max (save #, kind) | max / median | "
             "max / median after the first save | baseline stalls | save after a baseline / median increment "
             "| queued bytes, max (bound) | run |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    goals = []
    for arm, r in out.items():
        st, base = np.asarray(r["stalls"]), np.asarray(r["baseline"])
        after = np.zeros_like(base)
        after[1:] = base[:-1] & ~base[1:]
        ordinary = st[~base & ~after]
        med_inc = float(np.median(ordinary)) if ordinary.size else float("nan")
        ratio_after = float(st[after].max()) / med_inc if after.any() and ordinary.size else float("nan")
        p100 = float(st.max()) / float(np.median(st))
        later = float(st[1:].max()) / float(np.median(st)) if st.size > 1 else float("nan")
        lines.append(
            f"| {arm} | {st.size} ({int(base.sum())}) | {fmt_s(float(np.median(st)))} | "
            f"{fmt_s(float(np.percentile(st, 90)))} | {fmt_s(float(st.max()))} (#{int(st.argmax()) + 1}, "
            f"{'baseline' if base[st.argmax()] else 'after a baseline' if after[st.argmax()] else 'increment'}) | "
            f"{p100:.1f}x | {later:.1f}x | {', '.join(fmt_s(float(x)) for x in st[base])} | "
            + (f"{ratio_after:.1f}x ({', '.join(fmt_s(float(x)) for x in st[after])} / {fmt_s(med_inc)})"
               if ratio_after == ratio_after else "n/a")
            + f" | {fmt_bytes(r['held'])} ({fmt_bytes(r['bound'])}) | {r['run_s']:.1f} s |")
        goals.append(f"  - {arm}: stall max / median {p100:.1f}x (goal <= 2x): "
                     f"**{'met' if p100 <= 2 else 'not met'}** (after the first save: {later:.1f}x; "
                     + ("one save at a time: each waits for the one still writing" if r["bound"] == 0 else
                        f"a save waits inside its stall while max_lag={r['max_lag']} saves are still writing, so "
                        f"with a save every {args.stall_every} step(s) the saves behind a baseline wait for its write")
                     + "); save after a baseline / ordinary increment "
                     f"{ratio_after:.1f}x (goal <= 2x): **{'met' if ratio_after <= 2 else 'not met'}**")
    lines += ["", "Targets for the stall, ratios from this run:", *goals]
    return "\n".join(lines) + "\n"


#: Line styles of the peers, whose byte and disk lines coincide (each writes the same full state): distinct
#: markers and dashes, so that all three stay visible where they lie on top of each other.
PEER_STYLE = {
    "torch.save": dict(color="tab:red", marker="s", ms=8, mfc="none", mew=1.4, linestyle="-", lw=2.6),
    "DCP save": dict(color="tab:orange", marker="^", ms=5, linestyle="--", lw=1.6),
    "DCP async_save": dict(color="tab:brown", marker="x", ms=5, mew=1.2, linestyle=":", lw=1.6),
}
CNR_COLORS = ("tab:blue", "tab:cyan", "tab:green", "tab:olive", "tab:purple", "tab:pink")


def plot(res: dict, path: str) -> str | None:
    """Per-interval bytes written, trainer stall and disk use per method (log scale), and the restore time
    of the newest checkpoint per method; None or why skipped."""
    try:
        import matplotlib
    except ImportError:
        return "plot skipped: matplotlib is not installed (pip install matplotlib)"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    methods = [m for m in res["methods"] if res["stall"][m]]
    styles, k = {}, 0
    for m in methods:
        if m in PEER_STYLE:
            styles[m] = PEER_STYLE[m]
        else:
            styles[m] = dict(color=CNR_COLORS[k % len(CNR_COLORS)], marker="o", ms=3.5, linestyle="-", lw=1.4)
            k += 1
    fig, axes = plt.subplots(1, 4, figsize=(20, 5.6), gridspec_kw=dict(width_ratios=[1, 1, 1, 0.9]))
    peers = [m for m in PEERS if m in methods]
    for m in methods:
        xs = np.arange(1, len(res["stall"][m]) + 1)
        st = dict(styles[m], label=m)
        # where the peers' lines coincide (bytes, disk) their markers take turns: every len(peers)-th
        # interval, each peer from its own offset, the later-drawn ones on top
        turns = dict(st, markevery=(peers.index(m), len(peers)), zorder=3 + peers.index(m)) if m in peers else st
        axes[0].plot(xs, np.asarray(res["written"][m]) / 2**20, **turns)
        axes[1].plot(xs, np.asarray(res["stall"][m]) * 1e3, **st)
        axes[2].plot(xs, np.asarray(res["disk_trace"][m]) / 2**20, **turns)
    axes[0].set(yscale="log", xlabel="checkpoint interval", ylabel="MiB", title="bytes written per interval")
    axes[1].set(yscale="log", xlabel="checkpoint interval", ylabel="ms", title="trainer stall per checkpoint")
    axes[2].set(yscale="log", xlabel="checkpoint interval", ylabel="MiB",
                title="disk use after each interval (peers: last K kept)")
    if len(peers) > 1:
        w = [median(res["written"][m]) for m in peers]
        if max(w) <= 1.01 * min(w):
            axes[0].annotate(f"{', '.join(peers)}:\nsame bytes (each the full state, {fmt_bytes(res['full_bytes'])}):"
                             "\nlines coincide, markers take turns",
                             xy=(0.5, 0.97), xycoords="axes fraction", ha="center", va="top", fontsize=8,
                             bbox=dict(boxstyle="round", fc="white", ec="0.7"))
            axes[2].annotate(f"{', '.join(peers)}:\nsame disk use: lines coincide,\nmarkers take turns",
                             xy=(0.5, 0.97), xycoords="axes fraction", ha="center", va="top", fontsize=8,
                             bbox=dict(boxstyle="round", fc="white", ec="0.7"))
    for ax in axes[:3]:
        ax.grid(True, which="both", alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        lo, hi = ax.get_ylim()
        ax.set_ylim(lo, hi * 12)  # headroom for the notes above the peers' lines

    # restore of the newest checkpoint: median, whiskers min-max over --restores
    ax = axes[3]
    ys = np.arange(len(methods))[::-1]
    med = np.array([median(res["restore"][m]) for m in methods])
    lo = med - np.array([min(res["restore"][m]) for m in methods])
    hi = np.array([max(res["restore"][m]) for m in methods]) - med
    ax.barh(ys, med, xerr=[lo, hi], color=[styles[m]["color"] for m in methods], alpha=0.85,
            error_kw=dict(ecolor="black", capsize=3, lw=1))
    for y, v, h in zip(ys, med, hi):
        ax.text(v + h + 0.02 * med.max(), y, fmt_s(v), va="center", fontsize=8)
    ax.set_yticks(ys, [m.replace("cnrstore, ", "cnrstore,\n") for m in methods], fontsize=8)
    ax.set_xlim(0, 1.25 * float(max(med + hi)))
    n = len(next(iter(res["restore"].values())))
    ax.set(xlabel="seconds", title=f"restore newest checkpoint\n(median of {n}, whiskers min-max)")
    ax.grid(True, axis="x", alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.1, 1, 1), w_pad=1.0)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def csv_list(text: str, allowed: tuple, what: str, parser) -> list[str]:
    items = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in items if s not in allowed]
    if bad or not items:
        parser.error(f"{what} takes a comma-separated list of {', '.join(allowed)}; got {text!r}")
    return items


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small smoke run (< 60 s)")
    p.add_argument("--emb-mib", type=int, default=None,
                   help="fp32 embedding MiB (default 1024, the issue's ~1 GiB; --quick 16)")
    p.add_argument("--intervals", type=int, default=None, help="checkpoint intervals (default 7; --quick 6)")
    p.add_argument("--steps", type=int, default=None, help="training steps per interval (default 4; --quick 2)")
    p.add_argument("--batch-size", type=int, default=None, help="samples per step (default 4096; --quick 1024)")
    p.add_argument("--keep", type=int, default=None,
                   help="checkpoints kept by the peers and by incremental + keep-last (KeepLast; default 5; --quick 3)")
    p.add_argument("--schemes", default="intermittent,incremental", help="cnrstore schemes to run: intermittent, incremental")
    p.add_argument("--optimizer-codecs", default="fp32,int8", help="cnrstore optimizer_codec values to run")
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--restores", type=int, default=3, help="restores per method (median)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads while checkpointing and restoring (what is measured)")
    p.add_argument("--train-threads", type=int, default=None,
                   help="torch intra-op threads for the training steps between checkpoints (default: usable cores)")
    p.add_argument("--tmp", default=None, help="directory for the checkpoints (default: system temp)")
    p.add_argument("--out", default=None, help="also write the markdown to FILE")
    p.add_argument("--plot", default=None, help="write a PNG (e.g. benchmarks/peers_intervals.png); needs matplotlib")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--stall-saves", type=int, default=None, help="saves in the trainer-stall run (default 30; --quick 12)")
    p.add_argument("--stall-every", type=int, default=1, help="training steps between saves in the stall run")
    p.add_argument("--stall-only", action="store_true", help="run only the trainer-stall run")
    p.add_argument("--no-stall-run", action="store_true", help="skip the trainer-stall run")
    p.add_argument("--codec", default=WEIGHT_CODEC,
                   help=f"cnrstore's weight codec (default {WEIGHT_CODEC}; fp32 for the lossless comparison)")
    p.add_argument("--title", default="cnrstore against torch.save and torch.distributed.checkpoint",
                   help="the report's section heading")
    args = p.parse_args(argv)
    raw = list(sys.argv[1:] if argv is None else argv)
    keep_flags = ("--codec", "--steps", "--schemes", "--optimizer-codecs", "--intervals", "--batch-size")
    args.extra_args = "".join(f" {raw[i]} {raw[i + 1]}" for i in range(len(raw) - 1) if raw[i] in keep_flags)
    defaults = dict(emb_mib=(16, 1024), intervals=(6, 7), steps=(2, 4), batch_size=(1024, 4096), keep=(3, 5),
                    stall_saves=(12, 30))
    for k, (quick, full) in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, quick if args.quick else full)
    if args.train_threads is None:
        args.train_threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    args.default_emb_mib = defaults["emb_mib"][0 if args.quick else 1]
    args.default_stall_saves = defaults["stall_saves"][0 if args.quick else 1]
    if min(args.keep, args.intervals, args.restores, args.stall_saves, args.stall_every) < 1:
        p.error("--keep, --intervals, --restores, --stall-saves and --stall-every must be positive")
    args.schemes = csv_list(args.schemes, SCHEMES, "--schemes", p)
    args.optimizer_codecs = csv_list(args.optimizer_codecs, OPTIMIZER_CODECS, "--optimizer-codecs", p)
    args.load_start = load_average()
    warnings.filterwarnings("ignore")
    if args.stall_only:
        body = stall_run(args)
        head = [f"- {h}" for h in machine_description()]
        md = "\n".join(["## Trainer stall over a run", "", *head,
                        f"- load average at start: {args.load_start}; at end: {load_average()}", ""])
        publish(md + "\n" + body + f"\nreproduce: `python benchmarks/bench_peers.py"
                f"{' --quick' if args.quick else ''}{f' --emb-mib {args.emb_mib}' if args.emb_mib != args.default_emb_mib else ''}"
                f"{f' --stall-saves {args.stall_saves}' if args.stall_saves != args.default_stall_saves else ''}"
                f"{f' --stall-every {args.stall_every}' if args.stall_every != 1 else ''} --stall-only`\n",
                args.out, None, None)
        return 0
    md, res = run(args)
    if not args.no_stall_run:
        md += "\n" + stall_run(args)
    publish(md, args.out, args.plot, lambda path: plot(res, path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
