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
"""

from __future__ import annotations

import argparse
import os
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
from common import (dir_bytes, fmt_bytes, free_port, load_average, load_peer_checkpoint,  # noqa: E402
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
    args = p.parse_args(argv)
    args.sizes = [float(s) for s in args.sizes.split(",")]
    if args.quick:
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


def main(argv=None) -> int:
    import torch.distributed as dist

    args = parse_args(argv)
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
