#!/usr/bin/env python3
"""Many nodes, one bucket: a 2-rank job checkpoints to S3 with cnrstore's bucket root against
``torch.distributed.checkpoint`` with ``FsspecWriter`` on the same endpoint, then loses a node.

The endpoint is moto's S3 server **in a process of its own** (as a real endpoint is; on localhost, so the
figures are the client side and a loopback link). Each rank is a process of its own with its own "node
disk" (a directory no other rank reads), joined by gloo; the model on each rank is its row-wise shard of
``--tables`` fp32 tables of ``--rows`` x ``--dim`` (``nn.EmbeddingBag(sparse=True)``, Adagrad, whose
row-wise ``sum`` state is saved too). Each of ``--saves`` intervals trains one step that looks up
``--touch`` of every shard's rows, then saves:

- cnrstore: ``DistributedCheckpointer(node_dir, ..., remote="s3://bench/cnr")``; stall = the time
  ``save()`` takes (the trainer's pause), commit = until ``wait()`` returns (the copy points and the
  manifest included, in the background); bytes = the rank stores' own count of bytes PUT;
- reference for the copy point's cost: the same saves into a root on this machine's disk (no bucket);
- DCP: ``dcp.save`` of each rank's shards and Adagrad state with ``FsspecWriter("s3://bench/dcp/save-N")``
  (blocking: its stall is its whole save); bytes = the objects under the save's prefix.

Then rank 1's node is lost: a new job starts with rank 0 on its old directory and rank 1 on an empty one,
and both restore the newest version (rank 1 from the bucket alone); against it, each rank's ``dcp.load``
of the newest DCP save. Both are checked bit for bit against the state saved.

    python benchmarks/bench_dist_s3.py            # 2 tables x 262,144 x 64 (128 MiB of weights), 5 saves, 5%
    python benchmarks/bench_dist_s3.py --quick    # 2 tables x 32,768 x 32, 3 saves

Last, saves every ``--interval`` seconds (a step padded with sleep, standing in for a GPU's compute),
without waiting for them: the bucket root (publications pipelined; a save waits for none, ``remote_lag_s``), the same waiting
for each previous save (the behaviour before), and a local root; the stall includes what a save waits for.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

WORLD = 2


# -- one rank ------------------------------------------------------------------------------------------------

def rank_main(cfg: dict) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch import nn
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    from cnrstore.distributed import DistributedCheckpointer, ShardingPlan

    rank = cfg["rank"]
    warnings.filterwarnings("ignore", message="Sparse invariant checks")  # (Adagrad on sparse gradients)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{cfg['rdzv']}", rank=rank, world_size=WORLD)
    tables = {f"emb.t{i}": (cfg["rows"], cfg["dim"]) for i in range(cfg["tables"])}
    plan = ShardingPlan.row_wise(tables, WORLD)
    shards = plan.shards_of(rank)

    def build(seed):
        model = nn.Module()
        model.emb = nn.ModuleDict()
        g = torch.Generator().manual_seed(seed * 100 + rank)
        for name, s in shards.items():
            bag = nn.EmbeddingBag(s.num_rows, cfg["dim"], mode="sum", sparse=True)
            with torch.no_grad():
                bag.weight.copy_(torch.randn(s.num_rows, cfg["dim"], generator=g))
            model.emb[name.split(".", 1)[1]] = bag
        return model, torch.optim.Adagrad(model.parameters(), lr=0.05)

    def train(model, opt, step):
        g = torch.Generator().manual_seed(step * 1000 + rank)
        loss = 0
        for bag in model.emb.values():
            n = bag.num_embeddings
            ids = torch.randperm(n, generator=g)[:max(1, int(n * cfg["touch"]))]
            loss = loss + bag(ids, torch.tensor([0])).pow(2).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()

    def flat_state(model, opt):
        out = {}
        for key, bag in model.emb.items():
            out[f"emb.{key}.r{rank}"] = bag.weight.detach()
            out[f"emb.{key}.r{rank}.sum"] = opt.state[bag.weight]["sum"]
        return out

    def snapshot(model, opt):
        return {k: v.clone() for k, v in flat_state(model, opt).items()}

    def same(model, opt, want) -> bool:
        return all(torch.equal(v, want[k]) for k, v in flat_state(model, opt).items())

    result: dict = {"rank": rank}
    node = os.path.join(cfg["work"], f"node{rank}")
    kinds = (("cnrstore -> S3", dict(remote="s3://bench/cnr", remote_options=cfg["options"])),
             ("cnrstore -> local disk", {}))
    for label, remote in kinds:
        model, opt = build(0)
        root = node if remote else os.path.join(cfg["work"], "shared-root")
        ck = DistributedCheckpointer(root, model, opt, plan=plan, codec="fp32", **remote)
        stalls, commits, uploaded = [], [], []
        for i in range(cfg["saves"]):
            train(model, opt, i)
            before = (ck.store.stats().get("remote") or {}).get("bytes_uploaded", 0)
            t0 = time.perf_counter()
            pending = ck.save(step=i)
            stalls.append(time.perf_counter() - t0)
            pending.wait()
            commits.append(time.perf_counter() - t0)
            uploaded.append((ck.store.stats().get("remote") or {}).get("bytes_uploaded", 0) - before)
        if remote:
            final = snapshot(model, opt)
        ck.close()
        result[label] = {"stall": stalls, "commit": commits, "bytes": uploaded}

    # saves at a fixed interval shorter than a publication: a step (padded with sleep to --interval, standing
    # in for a GPU's compute), then a save, without waiting; the stall includes whatever the save waits for.
    # Three ways: the bucket root (a save waits for no publication, within remote_lag_s), the same but waiting
    # for the previous save's wait() before each save (what a save did before publications were pipelined),
    # and a root on this disk (the reference)
    variants = (("bucket", kinds[0][1], False), ("bucket, waiting for the previous save", kinds[0][1], True),
                ("local root", {}, False))
    for n, (label, remote, serial) in enumerate(variants):
        model, opt = build(0)
        root = os.path.join(node if remote else os.path.join(cfg["work"], "shared-root"), f"interval-{n}")
        ck = DistributedCheckpointer(root, model, opt, plan=plan, codec="fp32",
                                     **({**remote, "remote": f"{remote['remote']}-interval-{n}"} if remote else {}))
        train(model, opt, 0)
        ck.save(step=0).wait()  # the baseline, published (its upload is the whole model: not what is measured)
        stalls, pending = [], None
        started = time.perf_counter()
        for i in range(1, cfg["saves"] * 2 + 1):
            t0 = time.perf_counter()
            train(model, opt, i)
            time.sleep(max(0.0, cfg["interval"] - (time.perf_counter() - t0)))
            t0 = time.perf_counter()
            if serial and pending is not None:
                pending.wait()
            pending = ck.save(step=i)
            stalls.append(time.perf_counter() - t0)
        ck.close()
        result["interval: " + label] = {"stall": stalls, "wall": time.perf_counter() - started}

    # DCP with FsspecWriter on the same endpoint, the same training
    import fsspec
    s3 = fsspec.filesystem("s3", **cfg["options"])
    model, opt = build(0)
    stalls, sizes = [], []
    for i in range(cfg["saves"]):
        train(model, opt, i)
        t0 = time.perf_counter()
        dcp.save(flat_state(model, opt), storage_writer=FsspecWriter(f"s3://bench/dcp/save-{i}", **cfg["options"]))
        stalls.append(time.perf_counter() - t0)
        dist.barrier()
        if rank == 0:
            sizes.append(int(s3.du(f"bench/dcp/save-{i}")))
            if i:
                s3.rm(f"bench/dcp/save-{i - 1}", recursive=True)
        dist.barrier()
    result["DCP FsspecWriter -> S3"] = {"stall": stalls, "commit": stalls, "bytes": sizes}
    dcp_final = snapshot(model, opt)
    del model, opt

    # rank 1's node is lost: a new job, rank 1 on an empty directory
    if rank == 1:
        shutil.rmtree(node)
        node = os.path.join(cfg["work"], "node1-replacement")
    dist.barrier()
    model, opt = build(7)
    ck = DistributedCheckpointer(node, model, opt, plan=plan, codec="fp32", remote="s3://bench/cnr",
                                 remote_options=cfg["options"])
    t0 = time.perf_counter()
    ck.restore()
    result["restore cnrstore"] = time.perf_counter() - t0
    result["restore cnrstore exact"] = same(model, opt, final)
    ck.close()
    model, opt = build(7)
    train(model, opt, 99)  # (Adagrad's state exists to load into)
    state = flat_state(model, opt)
    t0 = time.perf_counter()
    dcp.load(state, storage_reader=FsspecReader(f"s3://bench/dcp/save-{cfg['saves'] - 1}", **cfg["options"]))
    result["restore DCP"] = time.perf_counter() - t0
    result["restore DCP exact"] = same(model, opt, dcp_final)
    with open(os.path.join(cfg["work"], f"result-{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


# -- the driver ----------------------------------------------------------------------------------------------

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tables", type=int, default=2)
    ap.add_argument("--rows", type=int, default=262144)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--saves", type=int, default=5)
    ap.add_argument("--touch", type=float, default=0.05)
    ap.add_argument("--interval", type=float, default=0.15, help="seconds between saves in the interval runs")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None, help="also write the markdown to FILE")
    ap.add_argument("--rank-config", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank_config:
        rank_main(json.loads(args.rank_config))
        return
    if args.quick:
        args.rows, args.dim, args.saves = 32768, 32, 3
    from common import MotoEndpoint, machine_description, publish

    endpoint = MotoEndpoint()
    options = endpoint.options
    work = tempfile.mkdtemp(prefix="bench_dist_s3-")
    try:
        cfg = {"tables": args.tables, "rows": args.rows, "dim": args.dim, "saves": args.saves, "touch": args.touch,
               "interval": args.interval,
               "options": options, "work": work, "rdzv": os.path.join(work, "rdzv")}
        env = dict(os.environ, OMP_NUM_THREADS="1")
        ranks = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--rank-config",
                                   json.dumps({**cfg, "rank": r})], env=env) for r in range(WORLD)]
        if any(p.wait() != 0 for p in ranks):
            raise SystemExit("a rank failed")
        results = [json.load(open(os.path.join(work, f"result-{r}.json"))) for r in range(WORLD)]
    finally:
        endpoint.stop()
        shutil.rmtree(work, ignore_errors=True)
    weights = args.tables * args.rows * args.dim * 4
    md: list[str] = []
    md.append("# Many nodes, one bucket: a 2-rank job on S3, cnrstore's bucket root against DCP's FsspecWriter\n")
    md.append("\n".join(f"- {line}" for line in machine_description()))
    md.append(f"- model: {args.tables} tables x {args.rows:,} x {args.dim} fp32, row-wise over {WORLD} ranks "
              f"({weights / 2**20:.0f} MiB of weights, as much Adagrad state); {args.saves} saves, each after a "
              f"step touching {args.touch:.0%} of every shard's rows; endpoint {endpoint.url} (moto, a process of its "
              "own); each rank a process with a node directory of its own\n")
    restore = {"cnrstore -> S3": f"{results[1]['restore cnrstore']:.3f} s",
               "DCP FsspecWriter -> S3": f"{results[1]['restore DCP']:.3f} s"}
    md.append("| method | save 0 stall | later stall (median) | later commit (median) | save 0 uploaded | "
              "later uploaded (median) | restore, node lost (rank 1) |")
    md.append("|---|---:|---:|---:|---:|---:|---:|")
    figures = {}
    for label in ("cnrstore -> S3", "cnrstore -> local disk", "DCP FsspecWriter -> S3"):
        stall = [max(r[label]["stall"][i] for r in results) for i in range(args.saves)]
        commit = [max(r[label]["commit"][i] for r in results) for i in range(args.saves)]
        if label == "DCP FsspecWriter -> S3":
            nbytes = results[0][label]["bytes"]
        else:
            nbytes = [sum(r[label]["bytes"][i] for r in results) for i in range(args.saves)]
        later = lambda xs: statistics.median(xs[1:]) if len(xs) > 1 else float("nan")  # noqa: E731
        figures[label] = (stall[0], later(stall), later(commit), nbytes[0], later(nbytes))
        b0 = f"{nbytes[0] / 2**20:.2f} MiB" if label != "cnrstore -> local disk" else "-"
        bi = f"{later(nbytes) / 2**20:.2f} MiB" if label != "cnrstore -> local disk" else "-"
        md.append(f"| {label} | {stall[0]:.3f} s | {later(stall):.3f} s | {later(commit):.3f} s | {b0} | {bi} | "
                  f"{restore.get(label, '-')} |")
    cs, cl, dc = figures["cnrstore -> S3"], figures["cnrstore -> local disk"], figures["DCP FsspecWriter -> S3"]
    md.append(f"\n- later saves: cnrstore uploads {cs[4] / dc[4]:.3f}x DCP's bytes ({dc[4] / cs[4]:.1f}x fewer); its "
              f"stall is {cs[1] / dc[1]:.3f}x DCP's blocking save ({dc[1] / cs[1]:.0f}x shorter)")
    md.append(f"- the bucket's cost: stall {cs[1]:.3f} s against {cl[1]:.3f} s into a local root "
              f"({(cs[1] / cl[1] - 1) * 100:+.0f}%); commit (in the background) {cs[2]:.3f} s against {cl[2]:.3f} s")
    iv = {}
    for label in ("bucket", "bucket, waiting for the previous save", "local root"):
        runs = [r["interval: " + label] for r in results]
        stall = [max(r["stall"][i] for r in runs) for i in range(len(runs[0]["stall"]))]
        iv[label] = (statistics.median(stall), max(stall), max(r["wall"] for r in runs))
    md.append(f"- saves every {args.interval:.2f} s ({2 * args.saves} incremental saves after a published baseline; a step "
              f"padded with sleep to the interval; no wait()): stall median / max "
              + "; ".join(f"{label} {a:.3f} s / {b:.3f} s" for label, (a, b, _w) in iv.items())
              + f". The bucket's median stall is {iv['bucket'][0] / iv['local root'][0]:.2f}x the local root's "
              f"(goal: at most 1.10x), against {iv['bucket, waiting for the previous save'][0] / iv['local root'][0]:.2f}x "
              "when each save waits for the previous one's upload")
    rc = [r["restore cnrstore"] for r in results]
    rd = [r["restore DCP"] for r in results]
    exact = all(r["restore cnrstore exact"] and r["restore DCP exact"] for r in results)
    md.append(f"- rank 1's node lost, a new job (rank 1 on an empty directory): restore of the newest version, "
              f"rank 0 {rc[0]:.3f} s / rank 1 {rc[1]:.3f} s (cnrstore) against {rd[0]:.3f} s / {rd[1]:.3f} s "
              f"(dcp.load); rank 1: {rd[1] / rc[1]:.2f}x faster; bit for bit: {'yes' if exact else 'NO'}")
    publish("\n".join(md) + "\n", args.out, None, None)
    if not exact:
        raise SystemExit("a restore differs from the state saved")


if __name__ == "__main__":
    main()
