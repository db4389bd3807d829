#!/usr/bin/env python3
"""Restore of the newest version into a live model and optimizer: cnrstore against dcp.load and torch.load.

The model is ``--tables`` ``nn.EmbeddingBag(rows, dim, sparse=True)`` on the CPU, trained by Adagrad (its
``sum`` state as large as the weights: the state is twice the weights). A baseline, then ``--increments``
increments (each interval one step looks up ``--touch`` of every table's rows, Zipf over a random ranking),
saved by ``Checkpointer(..., mode="incremental")`` into two stores: int4 weights + fp32 optimizer state,
and everything fp32. The newest state is also written once with ``torch.save`` and once with
``torch.distributed.checkpoint.save``.

Each method then restores into the same model and optimizer, their tensors zeroed first (in place):
cnrstore ``Checkpointer.restore()`` (the newest of the chain); ``torch.load(weights_only=True)`` then
``load_state_dict``; ``dcp.load`` into the model's and optimizer's own state dicts then
``load_state_dict``. Every file is read once before timing, so all methods read from a warm page cache.
Figures are medians of ``--restores`` rounds (methods interleaved); ratios are against the references of
the same run. Each restore is checked against the trained state (fp32: bit for bit; int4 weights: within
the codec's error, state exact).

Peak extra memory: the process's anonymous resident memory (``RssAnon``: page-cache pages the store maps
are not counted, they are the kernel's cache) sampled every millisecond during a restore, above its level
before, as a fraction of the state's bytes.

Physical reference for each cnrstore restore: the bytes its read chains hold (every record the newest
version reads) at the page-cache read bandwidth measured in this run (copying a warm, mapped file into
resident memory on the decode threads), plus the int4 decode at the kernel's speed measured in this run
(FBGEMM's unpack into resident memory, on the same threads), against the restore's time.

    python benchmarks/bench_restore.py            # 8 tables, 1 GiB of state (and 8 GiB where RAM allows)
    python benchmarks/bench_restore.py --quick    # 8 tables, 128 MiB of state, 3 increments

``--rss``: restore's peak memory in a fresh process, as a memory monitor sees it. Issue 37's trainer shape (one
``nn.EmbeddingBag`` of 1.6M rows x 64 fp32 under Adagrad, state as large, and a small MLP) trains
``--rss-steps`` steps per interval (batches of 2048 x 8 uniform ids) and is saved by ``Checkpointer(path,
model, opt)`` at its defaults (fp32, incremental: a baseline then ``--increments`` increments), and its final
state once by ``dcp.save``. Then, ``--restores`` rounds, methods interleaved, each restore in a process of
its own that builds the model and optimizer and restores into them: ``Checkpointer.restore()``, or ``dcp.load``
into the model's and optimizer's state dicts then ``load_state_dict``. Per method: peak RSS (``ru_maxrss`` of
that process, from ``wait4``), its RSS before the restore (the model built), the file-mapped part
(``RssFile``) at the sampled peak (``/proc/self/status`` every millisecond on a thread: ``VmRSS``, ``RssAnon``,
``RssFile``) and its growth over the level before (the store's pages mapped; the libraries' are there
before), and the restore's seconds; ratios against dcp.load in the same run. Every restore is checked bit
for bit against the trained state (an XXH3 of every tensor).

    python benchmarks/bench_restore.py --rss          # 1.6M x 64, 3 increments, 5 rounds
    python benchmarks/bench_restore.py --rss --quick  # 200k x 64, 3 rounds
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import cnrstore  # noqa: E402
from common import (child_with_peak_rss, dir_bytes, fmt_bytes, free_port, load_average, load_peer_checkpoint,  # noqa: E402
                          machine_description, publish, zipf_rows)
from bench_gpu import Model, workload_args, zero_  # noqa: E402  (the same model and options)
from cnrstore import codecs  # noqa: E402
from cnrstore.maintenance.compaction import block_chains  # noqa: E402
from cnrstore.engine.table_decode import decode_threads  # noqa: E402
from cnrstore.torch import Checkpointer  # noqa: E402

CNR = ("cnrstore int4", "cnrstore fp32")
PEERS = ("dcp.load", "torch.load")
GIB = 1 << 30


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--sizes", default="1,8", help="GiB of state (weights + Adagrad sum), comma separated")
    workload_args(p, restores=5)
    p.add_argument("--quick", action="store_true", help="128 MiB of state, 3 increments, 3 restores")
    p.add_argument("--rss", action="store_true", help="restore's peak memory in a fresh process, against dcp.load "
                   "(issue 37's trainer; --increments defaults to 3 here)")
    p.add_argument("--rss-rows", type=int, default=1_600_000)
    p.add_argument("--rss-steps", type=int, default=10, help="training steps per save interval (--rss)")
    p.add_argument("--rss-child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.sizes = [float(s) for s in args.sizes.split(",")]
    if args.rss:
        if "--increments" not in (argv if argv is not None else sys.argv):
            args.increments = 3
        if args.quick:
            args.rss_rows, args.restores = 200_000, 3
    elif args.quick:
        args.sizes, args.increments, args.restores = [0.125], 3, 3
    return args


def _tensors(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The weights, then the optimizer's tensor state (detached: the live memory)."""
    return [*(p.detach() for p in model.parameters()),
            *(v for st in opt.state.values() for v in st.values() if torch.is_tensor(v) and v.dim() > 0)]


def rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


class PeakSampler:
    """Highest ``RssAnon`` seen every millisecond while the ``with`` block runs, above the level before it."""

    def __enter__(self):
        self.base = self.peak = rss_anon()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, rss_anon())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_anon())
        self.extra = self.peak - self.base


def chain_bytes(store) -> int:
    """Bytes of every record the newest version's read chains hold (what a restore of it reads)."""
    with store.engine.read() as view:
        newest = view.latest()[0]
        return sum(loc.length for chain in block_chains(view, newest).values() for _v, loc in chain)


def page_cache_bandwidth(path: str, threads: int) -> float:
    """Bytes per second copying the (warm) file ``path``, mapped, into resident memory on ``threads`` threads."""
    src = np.memmap(path, dtype=np.uint8, mode="r")
    dst = np.ones(src.size, dtype=np.uint8)  # resident: no page faults in the timing
    parts = np.array_split(np.arange(src.size, dtype=np.int64), threads * 4)
    bounds = [(int(p[0]), int(p[-1]) + 1) for p in parts if p.size]
    np.copyto(dst, src)  # warm
    best = float("inf")
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(3):
            t0 = time.perf_counter()
            list(pool.map(lambda b: np.copyto(dst[b[0]:b[1]], src[b[0]:b[1]]), bounds))
            best = min(best, time.perf_counter() - t0)
    return src.size / best


def int4_decode_seconds(rows: int, dim: int, tables: int, threads: int) -> float:
    """Seconds to decode ``tables`` int4 tables of ``rows`` x ``dim`` from memory into resident memory with
    the codec's kernel (``decode_into``), on ``threads`` threads in blocks of 32768 rows."""
    codec = codecs.get("int4")
    enc = codec.encode(np.random.default_rng(0).standard_normal((min(rows, 1 << 15), dim), dtype=np.float32))
    out = np.ones((enc.shape[0], dim), dtype=np.float32)
    per_thread = [np.ones_like(out) for _ in range(threads)]
    blocks = -(-rows // enc.shape[0]) * tables
    codec.decode_into(enc, dim, out)
    best = float("inf")
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(3):
            t0 = time.perf_counter()
            list(pool.map(lambda i: codec.decode_into(enc, dim, per_thread[i % threads]), range(blocks)))
            best = min(best, time.perf_counter() - t0)
    return best * rows * tables / (blocks * enc.shape[0])


def feasible(gib: float) -> str | None:
    """Why ``gib`` of state cannot run warm here, or None: the model and the four checkpoints (two stores
    of about 1.1x and 0.6x the state, torch.save and DCP of 1x each) must sit in RAM at once."""
    need = gib * GIB * (1 + 1.1 + 0.6 + 1 + 1 + 0.5)  # model, stores, torch.save, DCP, working room
    with open("/proc/meminfo") as f:
        avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable"))
    if need > avail:
        return (f"{gib:g} GiB of state needs about {need / GIB:.0f} GiB of RAM to restore all four checkpoints "
                f"from a warm page cache (model + checkpoints); this machine has {avail / GIB:.0f} GiB available")
    free = shutil.disk_usage(tempfile.gettempdir()).free
    if gib * GIB * 4 > free:
        return f"{gib:g} GiB of state needs about {gib * 4:.0f} GiB of disk; {free / GIB:.0f} GiB free"
    return None


def run_size(args, gib: float) -> dict:
    import torch.distributed.checkpoint as dcp

    rows = int(gib * GIB / (args.tables * args.dim * 4 * 2))
    root = tempfile.mkdtemp(prefix="bench_restore-", dir=args.tmp)
    try:
        torch.manual_seed(0)
        model = Model(args.tables, rows, args.dim)
        opt = torch.optim.Adagrad(model.parameters(), lr=0.05)
        rng = np.random.default_rng(0)
        perms = [rng.permutation(rows) for _ in range(args.tables)]
        touched = max(1, int(args.touch * rows))

        def step() -> None:
            ids = [torch.from_numpy(zipf_rows(rng, perm, touched)) for perm in perms]
            opt.zero_grad()
            model(ids).backward()
            opt.step()

        step()  # creates Adagrad's state
        stores = {m: cnrstore.open(os.path.join(root, m.split()[-1]), create=True) for m in CNR}
        ckpts = {m: Checkpointer(stores[m], model, opt, codec=m.split()[-1], mode="incremental") for m in CNR}
        for interval in range(args.increments + 1):
            if interval:
                step()
            for m in CNR:
                ckpts[m].save(interval).wait()
        state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
        pt = os.path.join(root, "ckpt.pt")
        torch.save(state, pt)
        dcp_dir = os.path.join(root, "dcp")
        dcp.save(state, checkpoint_id=dcp_dir)
        del state
        final = [t.detach().clone() for t in _tensors(model, opt)]
        state_bytes = sum(t.numel() * 4 for t in final)
        int4_err = max(float(np.abs(codecs.get("int4").decode(codecs.get("int4").encode(w.numpy()), args.dim)
                                    - w.numpy()).max()) for w in final[:args.tables])

        def restore(m: str) -> None:
            if m in CNR:
                ckpts[m].restore()
            else:
                load_peer_checkpoint("torch.save" if m == "torch.load" else "DCP", pt if m == "torch.load" else dcp_dir,
                                     model, opt)

        times = {m: [] for m in CNR + PEERS}
        extra = {m: 0 for m in CNR + PEERS}
        check = {}
        for m in CNR + PEERS:  # warm: every file read once (and the code paths run)
            zero_(model, opt)
            restore(m)
        for _ in range(args.restores):
            for m in CNR + PEERS:
                zero_(model, opt)
                with PeakSampler() as peak:
                    t0 = time.perf_counter()
                    restore(m)
                    times[m].append(time.perf_counter() - t0)
                extra[m] = max(extra[m], peak.extra)
                now = _tensors(model, opt)
                check[m] = (max(float((a - b).abs().max()) for a, b in zip(now[:args.tables], final)),
                            max(float((a - b).abs().max()) for a, b in zip(now[args.tables:], final[args.tables:])))
        threads = decode_threads(stores["cnrstore fp32"].options.decode_threads)
        bw = page_cache_bandwidth(pt, threads)
        read = {m: chain_bytes(stores[m]) for m in CNR}
        decode_s = int4_decode_seconds(rows, args.dim, args.tables, threads)
        limit = {"cnrstore int4": read["cnrstore int4"] / bw + decode_s, "cnrstore fp32": read["cnrstore fp32"] / bw}
        disk = {m: dir_bytes(os.path.join(root, m.split()[-1])) for m in CNR}
        disk["torch.load"], disk["dcp.load"] = os.path.getsize(pt), dir_bytes(dcp_dir)
        for m in CNR:
            ckpts[m].close()
            stores[m].close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return dict(gib=gib, rows=rows, times=times, extra=extra, check=check, state_bytes=state_bytes, bw=bw,
                read=read, decode_s=decode_s, limit=limit, disk=disk, int4_err=int4_err, threads=threads)


def report(args, results: list, skipped: list) -> str:
    med = statistics.median
    lines = [
        "### Restore of the newest version into a live model: cnrstore against dcp.load and torch.load",
        "",
        *[f"- {line}" for line in machine_description()],
        f"- load average (1/5/15 min) at end: {load_average()}",
        f"- model: {args.tables} nn.EmbeddingBag(sparse=True) x dim {args.dim} on the CPU, Adagrad (its sum state "
        f"as large as the weights); a baseline then {args.increments} increments, each interval one step looking up "
        f"{args.touch:.0%} of every table's rows (Zipf)",
        "- page cache warm for every method (each checkpoint read once before timing); medians of "
        f"{args.restores} restores per method, methods interleaved; decode threads: {results[0]['threads'] if results else '-'}",
        "",
        "| state | method | restore (median) | vs dcp.load | vs torch.load | peak extra memory / state | "
        "bytes read | physical limit | fraction of limit | max weight / state error |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        t = {m: med(r["times"][m]) for m in CNR + PEERS}
        for m in CNR + PEERS:
            lim = r["limit"].get(m)
            lines.append(
                f"| {fmt_bytes(r['state_bytes'])} | {m} | {t[m] * 1e3:.0f} ms | {t['dcp.load'] / t[m]:.2f}x | "
                f"{t['torch.load'] / t[m]:.2f}x | {r['extra'][m] / r['state_bytes']:.1%} | "
                f"{fmt_bytes(r['read'][m]) if m in CNR else fmt_bytes(r['disk'][m])} | "
                f"{f'{lim * 1e3:.0f} ms' if lim else '-'} | {f'{lim / t[m]:.0%}' if lim else '-'} | "
                f"{r['check'][m][0]:.3g} / {r['check'][m][1]:.3g} |")
    lines.append("")
    for r in results:
        t = {m: med(r["times"][m]) for m in CNR + PEERS}
        goals = [("int4 weights >= 1.5x dcp.load", t["dcp.load"] / t["cnrstore int4"], 1.5),
                 ("all fp32 >= 1.0x dcp.load", t["dcp.load"] / t["cnrstore fp32"], 1.0)]
        verdicts = "; ".join(f"{name}: {x:.2f}x, {'reached' if x >= goal else 'missed'}" for name, x, goal in goals)
        worst = max(r["extra"][m] for m in CNR) / r["state_bytes"]
        lines.append(f"- {fmt_bytes(r['state_bytes'])}: {verdicts}; extra memory <= 10% of the state: "
                     f"{worst:.1%}, {'reached' if worst <= 0.10 else 'missed'}. Page-cache read bandwidth "
                     f"{r['bw'] / GIB:.1f} GiB/s; int4 decode of the weights at kernel speed {r['decode_s'] * 1e3:.0f} ms "
                     f"(int4's own error bound: max {r['int4_err']:.3g}). All restore times (ms): "
                     + "; ".join(f"{m} {', '.join(f'{x * 1e3:.0f}' for x in r['times'][m])}" for m in CNR + PEERS))
    for why in skipped:
        lines.append(f"- not measured: {why}")
    lines += [
        "- 'vs dcp.load' / 'vs torch.load': the reference's time over this method's (above 1: faster). Peak extra "
        "memory: RssAnon high-water above the level before the restore (1 ms sampling), over the state's bytes.",
        "- physical limit: bytes read / page-cache bandwidth (+ int4 decode at kernel speed), both measured in "
        "this run on the decode threads; fraction = limit / restore time.",
        f"- reproduce: `python benchmarks/bench_restore.py{' --quick' if args.quick else ''}`",
    ]
    return "\n".join(lines) + "\n"


# -- --rss: restore's peak memory in a fresh process ------------------------------------------------------------

RSS_METHODS = ("cnrstore", "dcp.load")


def trainer(rows: int, dim: int):
    """Issue 37's trainer (bench_trainer.py's): an EmbeddingBag of ``rows`` x ``dim`` and a small MLP, Adagrad."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"emb": nn.EmbeddingBag(rows, dim, mode="sum"),
                           "mlp": nn.Sequential(nn.Linear(dim, 64), nn.ReLU(), nn.Linear(64, 1))})
    return model, torch.optim.Adagrad(model.parameters(), lr=0.05)


def state_digest(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    """{name: XXH3-64 of the tensor's bytes} of every parameter and optimizer state tensor (hashed in place)."""
    import xxhash

    out = {k: xxhash.xxh3_64_hexdigest(v.detach().contiguous().numpy()) for k, v in model.state_dict().items()}
    for i, st in enumerate(opt.state.values()):
        out.update((f"state {i} {k}", xxhash.xxh3_64_hexdigest(v.contiguous().numpy()))
                   for k, v in st.items() if torch.is_tensor(v) and v.dim())
    return out


def proc_status() -> dict:
    """VmRSS, RssAnon and RssFile of this process, bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key = line.split(":", 1)[0]
            if key in ("VmRSS", "RssAnon", "RssFile"):
                out[key] = int(line.split()[1]) * 1024
    return out


class StatusSampler:
    """``proc_status()`` every millisecond while the ``with`` block runs; ``peak``: the sample of highest VmRSS;
    ``cpu_s()``: the CPU seconds its thread has used so far (left out of the restore's)."""

    def __enter__(self):
        self.samples = [proc_status()]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        self._tid = threading.get_native_id()
        while not self._stop.wait(0.001):
            self.samples.append(proc_status())

    def cpu_s(self) -> float:
        try:
            with open(f"/proc/self/task/{self._tid}/schedstat") as f:
                return int(f.read().split()[0]) / 1e9  # (nanoseconds on a CPU)
        except (AttributeError, OSError):
            return 0.0

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.samples.append(proc_status())
        self.peak = max(self.samples, key=lambda s: s["VmRSS"])


def rss_child(task: str, root: str, rows: int, dim: int, increments: int, steps: int) -> dict:
    """In a process of its own: ``task`` "train" (train, save with the Checkpointer and dcp.save, note the
    state's digest) or a method of RSS_METHODS (build the model, restore into it, measure)."""
    import warnings

    import torch.distributed.checkpoint as dcp

    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    model, opt = trainer(rows, dim)
    store, dcp_dir = os.path.join(root, "store"), os.path.join(root, "dcp")
    if task == "train":
        rng = np.random.default_rng(0)
        ckpt = Checkpointer(store, model, opt)
        for interval in range(increments + 1):
            for _ in range(steps):
                ids = torch.from_numpy(rng.integers(0, rows, 2048 * 8)).view(2048, 8)
                opt.zero_grad()
                out = model["mlp"](model["emb"](ids)).squeeze(1)
                torch.nn.functional.binary_cross_entropy_with_logits(out, torch.ones_like(out)).backward()
                opt.step()
            ckpt.save(interval)
        ckpt.close()
        dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=dcp_dir)
        return {"digest": state_digest(model, opt)}
    before = proc_status()
    with StatusSampler() as sampler:
        if task == "cnrstore":
            ckpt = Checkpointer(store, model, opt)
            t0, r0, s0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF), sampler.cpu_s()
            ckpt.restore()
            seconds, r1, s1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF), sampler.cpu_s()
            ckpt.close()
        else:
            t0, r0, s0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF), sampler.cpu_s()
            state = {"model": model.state_dict(), "optim": opt.state_dict()}
            dcp.load(state, checkpoint_id=dcp_dir)
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optim"])
            seconds, r1, s1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF), sampler.cpu_s()
            del state
    # every thread's CPU time meanwhile but the sampler's
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime) - (s1 - s0)
    return {"seconds": seconds, "cpu": cpu, "before": before, "peak": sampler.peak,
            "file_max": max(s["RssFile"] for s in sampler.samples), "digest": state_digest(model, opt)}


def run_rss_child(args, task: str, root: str) -> dict:
    """``rss_child(task, ...)`` in a new process; its result with ``maxrss``: that process's peak RSS, bytes."""
    return child_with_peak_rss(__file__, "--rss-child", [task, root, args.rss_rows, args.dim, args.increments,
                                                         args.rss_steps], f"--rss {task}")


def run_rss(args) -> tuple[dict, dict]:
    """(the training run's result, {method: [each round's result]})."""
    root = tempfile.mkdtemp(prefix="bench_restore-rss-", dir=args.tmp)
    try:
        trained = run_rss_child(args, "train", root)
        for dirpath, _dirs, files in os.walk(root):  # every file read once: both methods from a warm page cache
            for name in files:
                with open(os.path.join(dirpath, name), "rb") as f:
                    while f.read(8 << 20):
                        pass
        runs = {m: [] for m in RSS_METHODS}
        for _ in range(args.restores):
            for m in RSS_METHODS:
                runs[m].append(run_rss_child(args, m, root))
        trained["disk"] = {"cnrstore": dir_bytes(os.path.join(root, "store")),
                           "dcp.load": dir_bytes(os.path.join(root, "dcp"))}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return trained, runs


def report_rss(args, trained: dict, runs: dict, seconds: float) -> str:
    med = statistics.median
    mib = lambda n: f"{n / 2**20:,.0f} MiB"  # noqa: E731
    state = args.rss_rows * args.dim * 4
    fig = {m: {"peak": med(r["maxrss"] for r in runs[m]), "before": med(r["before"]["VmRSS"] for r in runs[m]),
               "file": med(r["peak"]["RssFile"] for r in runs[m]),
               "mapped": med(r["peak"]["RssFile"] - r["before"]["RssFile"] for r in runs[m]),
               "anon": med(r["peak"]["RssAnon"] for r in runs[m]), "seconds": med(r["seconds"] for r in runs[m]),
               "cpu": med(r["cpu"] for r in runs[m]),
               "exact": all(r["digest"] == trained["digest"] for r in runs[m])} for m in RSS_METHODS}
    d = fig["dcp.load"]
    lines = [
        "### Restore's peak memory in a fresh process: cnrstore against dcp.load",
        "",
        *[f"- {line}" for line in machine_description()],
        f"- load average (1/5/15 min) at end: {load_average()}",
        f"- model: nn.EmbeddingBag {args.rss_rows:,} x {args.dim} fp32 ({mib(state)}) + Adagrad state of the same "
        f"size + a 2-layer MLP; {args.rss_steps} steps per interval (batches of 2048 x 8 uniform ids), saved by "
        f"Checkpointer at its defaults (fp32, incremental: a baseline then {args.increments} increments; store "
        f"{mib(trained['disk']['cnrstore'])}) and the final state by dcp.save ({mib(trained['disk']['dcp.load'])})",
        f"- each restore in a fresh process that builds the model and optimizer first; {args.restores} rounds, "
        f"methods interleaved, medians; page cache warm ({seconds:.0f} s in all)",
        "",
        "| method | peak RSS (ru_maxrss) | vs dcp.load | RSS before the restore | peak - before | file-mapped at "
        "peak | of it mapped by the restore | anonymous at peak | restore | vs dcp.load | restore CPU | vs dcp.load "
        "| bit-exact |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for m in RSS_METHODS:
        f = fig[m]
        lines.append(f"| {m} | {mib(f['peak'])} | {f['peak'] / d['peak']:.2f}x | {mib(f['before'])} | "
                     f"{mib(f['peak'] - f['before'])} | {mib(f['file'])} | {mib(f['mapped'])} | {mib(f['anon'])} | "
                     f"{f['seconds'] * 1e3:.0f} ms | {f['seconds'] / d['seconds']:.2f}x | {f['cpu'] * 1e3:.0f} ms | "
                     f"{f['cpu'] / d['cpu']:.2f}x | {'yes' if f['exact'] else 'NO'} |")
    c = fig["cnrstore"]
    ratio = c["peak"] / d["peak"]
    lines += [
        "",
        f"- peak RSS, cnrstore / dcp.load: {ratio:.2f}x (goal <= 1.1x): **{'met' if ratio <= 1.1 else 'not met'}**",
        f"- restore time, cnrstore / dcp.load: {c['seconds'] / d['seconds']:.2f}x (below 1: faster); CPU time "
        f"{c['cpu'] / d['cpu']:.2f}x",
        "- every round (peak RSS MiB / restore ms / CPU ms): " + "; ".join(
            f"{m} " + ", ".join(f"{r['maxrss'] / 2**20:.0f}/{r['seconds'] * 1e3:.0f}/{r['cpu'] * 1e3:.0f}" for r in runs[m])
            for m in RSS_METHODS),
        "- 'of it mapped by the restore': RssFile at the peak above its level before the restore (the libraries' "
        "pages are mapped before); 'restore': Checkpointer.restore() (its store opened before), or dcp.load and "
        "both load_state_dict calls; 'restore CPU': user + system time of every thread of the process meanwhile "
        "but the sampler's (less sensitive than the wall time to other jobs on a shared machine).",
        f"- reproduce: `python benchmarks/bench_restore.py --rss{' --quick' if args.quick else ''}`",
    ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    import torch.distributed as dist

    args = parse_args(argv)
    if args.rss_child:
        print(json.dumps(rss_child(*json.loads(args.rss_child))))
        return 0
    if args.rss:
        t0 = time.perf_counter()
        trained, runs = run_rss(args)
        publish(report_rss(args, trained, runs, time.perf_counter() - t0), args.out, None, None)
        return 0
    results, skipped = [], []
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{free_port()}")
    try:
        for gib in args.sizes:
            why = feasible(gib)
            if why:
                skipped.append(why)
                continue
            results.append(run_size(args, gib))
    finally:
        dist.destroy_process_group()
    publish(report(args, results, skipped), args.out, None, None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
