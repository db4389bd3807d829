#!/usr/bin/env python3
"""Save stall and restore time with the embeddings on a CUDA device: cnrstore against torch.save and DCP.

Needs a GPU (without one it says so and exits 0; ``--device cpu`` is a dry run of the same code). The
model is ``--tables`` ``nn.EmbeddingBag(rows, dim, sparse=True)`` on ``cuda``, trained by Adagrad (sparse
gradients; its ``sum`` state is as large as the weights). Each interval, one training step looks up
``--touch`` of every table's rows, drawn by Zipf popularity over a fixed random ranking (hashed ids). After
a baseline at step 0 come ``--increments`` intervals; at every interval each method saves the same state,
in turn:

  - cnrstore fp32 / int4: ``Checkpointer(store, model, opt, codec=..., mode="incremental")`` (weights in
    fp32 or int4, Adagrad's state in fp32); the stall is ``save()`` (the device-to-host copy of the
    looked-up rows, enqueued on the Checkpointer's side stream into pinned buffers: the stall is the
    launch; the trainer's next step waits on the device for the reads, which ``step`` times show); the
    write runs in a background thread until ``wait()``;
  - torch.save: ``torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()})`` then fsync,
    which blocks the trainer for the whole device-to-host copy and the write;
  - DCP save: ``torch.distributed.checkpoint.save`` of the same dict (blocks; does not fsync);
  - DCP async_save: ``async_save``, the stall being its staging (until it returns the future), durable
    when the future completes.

Then every method restores its newest checkpoint (the baseline plus all increments for cnrstore) into the
same model and optimizer, their tensors zeroed first: cnrstore ``restore()``; ``torch.load(...,
map_location="cuda")`` then ``load_state_dict``; ``dcp.load`` into the model's and optimizer's own state
dicts. Each restore ends with ``torch.cuda.synchronize()`` and is checked against the trained state
(fp32 exact; int4 within its quantization error). Figures are medians; ratios are against the references
measured in this run.

    python benchmarks/bench_gpu.py                 # 8 tables x 1M rows x 64 (2 GiB of weights, 4 GiB state)
    python benchmarks/bench_gpu.py --quick         # 8 x 100k rows, 3 increments
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np
import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import cnrstore  # noqa: E402
from common import (dir_bytes, fmt_bytes, free_port, load_average, load_peer_checkpoint,  # noqa: E402
                          machine_description, publish, zipf_rows)
from cnrstore.torch import Checkpointer  # noqa: E402

CNR = ("cnrstore fp32", "cnrstore int4")
PEERS = ("torch.save", "DCP save", "DCP async_save")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--rows", type=int, default=1_000_000, help="rows per table")
    workload_args(p, restores=3)
    p.add_argument("--quick", action="store_true", help="8 x 100k rows, 3 increments, 2 restores")
    p.add_argument("--device", default="cuda", help="where the model lives (cpu: a dry run of the benchmark)")
    args = p.parse_args(argv)
    if args.quick:
        args.rows, args.increments, args.restores = 100_000, 3, 2
    return args


def workload_args(p: argparse.ArgumentParser, restores: int) -> None:
    """The options bench_gpu and bench_restore share: dim, increments, touched fraction, restores, paths."""
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--increments", type=int, default=5)
    p.add_argument("--touch", type=float, default=0.02, help="fraction of each table's rows looked up per interval")
    p.add_argument("--restores", type=int, default=restores, help="timed restores per method (median)")
    p.add_argument("--tmp", default=None, help="where the checkpoints go (default: the system's temp dir)")
    p.add_argument("--out", default=None, help="also write the markdown report here")


class Model(nn.Module):
    def __init__(self, tables: int, rows: int, dim: int):
        super().__init__()
        self.emb = nn.ModuleList(nn.EmbeddingBag(rows, dim, mode="sum", sparse=True) for _ in range(tables))

    def forward(self, ids: list[torch.Tensor]) -> torch.Tensor:
        return sum(bag(i, torch.arange(0, i.numel(), 8, device=i.device)).pow(2).sum() for bag, i in zip(self.emb, ids))


def zero_(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        for st in opt.state.values():
            for v in st.values():
                if torch.is_tensor(v) and v.dim() > 0:
                    v.zero_()


def run(args) -> str:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    root = tempfile.mkdtemp(prefix="bench_gpu-", dir=args.tmp)
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{free_port()}")
    t_all = time.perf_counter()
    try:
        torch.manual_seed(0)
        model = Model(args.tables, args.rows, args.dim).to(dev)
        opt = torch.optim.Adagrad(model.parameters(), lr=0.05)
        rng = np.random.default_rng(0)
        perms = [rng.permutation(args.rows) for _ in range(args.tables)]
        touched = max(1, int(args.touch * args.rows))

        def step() -> float:
            ids = [torch.from_numpy(zipf_rows(rng, perm, touched)).to(dev) for perm in perms]
            sync()
            t0 = time.perf_counter()
            opt.zero_grad()
            model(ids).backward()
            opt.step()
            sync()
            return time.perf_counter() - t0

        plain_steps = [step() for _ in range(4)][1:]  # (the first one warms up and creates Adagrad's state)
        dirs = {m: os.path.join(root, m.replace(" ", "_").replace(".", "_")) for m in CNR + PEERS}
        for d in dirs.values():
            os.makedirs(d)
        stores = {m: cnrstore.open(dirs[m], create=True) for m in CNR}
        ckpts = {m: Checkpointer(stores[m], model, opt, codec=m.split()[-1], mode="incremental") for m in CNR}
        stall = {m: [] for m in CNR + PEERS}
        durable = {m: [] for m in CNR + PEERS}
        written = {m: [] for m in CNR + PEERS}
        tracked_steps = []
        for interval in range(args.increments + 1):
            if interval:
                tracked_steps.append(step())
            state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
            for m in CNR:
                before = stores[m].stats()["bytes_written"]
                t0 = time.perf_counter()
                pending = ckpts[m].save(interval)
                stall[m].append(time.perf_counter() - t0)
                pending.wait()
                durable[m].append(time.perf_counter() - t0)
                written[m].append(stores[m].stats()["bytes_written"] - before)
            path = os.path.join(dirs["torch.save"], "ckpt.pt")
            t0 = time.perf_counter()
            with open(path, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
            stall["torch.save"].append(time.perf_counter() - t0)
            durable["torch.save"].append(stall["torch.save"][-1])
            written["torch.save"].append(os.path.getsize(path))
            for m in ("DCP save", "DCP async_save"):
                d = os.path.join(dirs[m], f"step_{interval:03d}")
                t0 = time.perf_counter()
                if m == "DCP save":
                    dcp.save(state, checkpoint_id=d)
                    stall[m].append(time.perf_counter() - t0)
                else:
                    fut = dcp.async_save(state, checkpoint_id=d)
                    stall[m].append(time.perf_counter() - t0)
                    fut.result()
                durable[m].append(time.perf_counter() - t0)
                written[m].append(dir_bytes(d))
                if interval:
                    shutil.rmtree(os.path.join(dirs[m], f"step_{interval - 1:03d}"))
            del state
        final = {k: v.detach().clone() for k, v in model.state_dict().items()}
        final_sum = [opt.state[p]["sum"].clone() for p in model.parameters()]
        last = args.increments

        restore = {m: [] for m in CNR + PEERS}
        check = {}
        for _ in range(args.restores):
            for m in CNR + PEERS:
                zero_(model, opt)
                sync()
                t0 = time.perf_counter()
                if m in CNR:
                    ckpts[m].restore()
                else:
                    path = os.path.join(dirs[m], "ckpt.pt" if m == "torch.save" else f"step_{last:03d}")
                    load_peer_checkpoint(m, path, model, opt, map_location=dev)
                sync()
                restore[m].append(time.perf_counter() - t0)
                sd = model.state_dict()
                check[m] = (max(float((sd[k] - final[k]).abs().max()) for k in final),
                            max(float((opt.state[p]["sum"] - s).abs().max()) for p, s in zip(model.parameters(), final_sum)))
        for m in CNR:
            ckpts[m].close()
            stores[m].close()
        disk = {m: dir_bytes(dirs[m]) for m in CNR + PEERS}
    finally:
        dist.destroy_process_group()
        shutil.rmtree(root, ignore_errors=True)
    whole_s = time.perf_counter() - t_all
    return report(args, plain_steps, tracked_steps, stall, durable, written, restore, check, disk, whole_s)


def report(args, plain_steps, tracked_steps, stall, durable, written, restore, check, disk, whole_s) -> str:
    med = statistics.median
    emb = args.tables * args.rows * args.dim * 4
    lines = [
        "### cnrstore against torch.save and DCP with the embeddings on a GPU",
        "",
        *[f"- {line}" for line in machine_description()],
        (f"- gpu: {torch.cuda.get_device_name()} ({torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} "
         f"GiB), CUDA {torch.version.cuda}" if args.device.startswith("cuda") else f"- device: {args.device}"),
        f"- load average (1/5/15 min) at end: {load_average()}",
        f"- model: {args.tables} nn.EmbeddingBag(sparse=True) x {args.rows:,} rows x dim {args.dim} on {args.device} = "
        f"{fmt_bytes(emb)} of fp32 weights; Adagrad (its sum state as large); full state per checkpoint "
        f"{fmt_bytes(2 * emb)}",
        f"- a baseline, then {args.increments} increments; each interval one step looks up {args.touch:.1%} of "
        f"each table's rows (Zipf over a random ranking)",
        f"- step time without a Checkpointer {med(plain_steps) * 1e3:.1f} ms, with two attached "
        f"{med(tracked_steps) * 1e3:.1f} ms (medians)",
        "",
        "| method | stall, baseline | stall, increment (median) | durable, increment (median) | bytes per "
        "increment (median) | disk at end | restore newest (median) | vs torch.load | vs dcp.load | "
        "max weight error / max state error |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m in CNR + PEERS:
        inc = slice(1, None)
        r = med(restore[m])
        lines.append(
            f"| {m} | {stall[m][0] * 1e3:.1f} ms | {med(stall[m][inc]) * 1e3:.1f} ms | "
            f"{med(durable[m][inc]) * 1e3:.0f} ms | {fmt_bytes(med(written[m][inc]))} | {fmt_bytes(disk[m])} | "
            f"{r * 1e3:.0f} ms | {med(restore['torch.save']) / r:.2f}x | {med(restore['DCP save']) / r:.2f}x | "
            f"{check[m][0]:.3g} / {check[m][1]:.3g} |")
    inc = slice(1, None)
    lines += [
        "",
        f"- trainer stall per increment, torch.save / cnrstore fp32: "
        f"{med(stall['torch.save'][inc]) / med(stall['cnrstore fp32'][inc]):.0f}x; DCP async_save's staging / "
        f"cnrstore fp32: {med(stall['DCP async_save'][inc]) / med(stall['cnrstore fp32'][inc]):.0f}x",
        "- 'vs torch.load' and 'vs dcp.load': the reference's restore time over this method's (above 1: faster)",
        "- DCP save and async_save do not fsync; torch.save's figure includes its fsync; cnrstore's durable "
        "includes fsync and the index commit",
        f"- whole benchmark {whole_s:.0f} s; reproduce: `python benchmarks/bench_gpu.py"
        f"{' --quick' if args.quick else ''}` on a machine with a CUDA device",
    ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("bench_gpu: torch sees no CUDA device on this machine; nothing measured (run it where one is, "
              "or pass --device cpu for a dry run)")
        return 0
    publish(run(args), args.out, None, None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
