#!/usr/bin/env python3
"""Checkpoints on S3: bytes uploaded and seconds per save, cnrstore's object-store tier against
``torch.distributed.checkpoint`` with ``FsspecWriter``, both to the same S3 endpoint (moto's server, started
in this process on localhost: the figures measure the client side and a loopback endpoint, not a WAN link).

The model is ``--tables`` fp32 embedding tables of ``--rows`` x ``--dim`` (a DLRM's sparse part). Save 0
writes every row; each later save (``--saves`` in all) first changes ``--touch`` of every table's rows (a
random subset, as a training interval does) and saves again:

- cnrstore: ``cnrstore.open(dir, remote="s3://bucket/cnr", cache_bytes=...)``, one checkpoint per save with
  the touched rows (codec fp32, lossless, for a like-for-like comparison), committed; the commit's copy point
  (remote_every=1: the writer's segment sealed and uploaded, the index snapshot and the pointer) is part of
  the save's time. Bytes uploaded: the store's own count of object bytes it PUT.
- DCP: ``dcp.save(state_dict, storage_writer=FsspecWriter("s3://bucket/dcp/save-N", **options))``: every
  tensor, whole, each save. Bytes uploaded: the sizes of the objects the save left under its prefix. The
  previous save's objects are deleted after each save (keep-last-1), so moto's memory holds one.
- Reference for the copy point's cost: the same cnrstore saves into a local store (no remote), same run.

Then restore of the newest save on a "fresh machine": cnrstore recovers into an empty directory from the
remote (the pointer's index snapshot) and reads every table (a segment under a quarter of ``cache_bytes``
fetched whole into the local cache, a larger one by range); DCP ``dcp.load``
into preallocated tensors. Both are checked bit for bit against the model.

    python benchmarks/bench_s3.py            # 8 tables x 65,536 x 64 fp32 (128 MiB), 10 saves, 5% touched
    python benchmarks/bench_s3.py --quick    # 4 tables x 16,384 x 32 (8 MiB), 5 saves
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import cnrstore  # noqa: E402


def start_endpoint() -> tuple[object, str, dict]:
    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="bench", aws_secret_access_key="bench",
                 region_name="us-east-1").create_bucket(Bucket="bench")
    options = {"key": "bench", "secret": "bench", "skip_instance_cache": True,
               "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}}
    return server, endpoint, options


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tables", type=int, default=8)
    ap.add_argument("--rows", type=int, default=65536)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--saves", type=int, default=10)
    ap.add_argument("--touch", type=float, default=0.05, help="fraction of each table's rows changed per save")
    ap.add_argument("--quick", action="store_true", help="4 tables x 16,384 x 32, 5 saves")
    args = ap.parse_args()
    if args.quick:
        args.tables, args.rows, args.dim, args.saves = 4, 16384, 32, 5

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # (no_dist=True: one process)
    import fsspec
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    server, endpoint, options = start_endpoint()
    work = tempfile.mkdtemp(prefix="bench_s3-")
    rng = np.random.default_rng(0)
    names = [f"emb{i}" for i in range(args.tables)]
    model = {n: rng.standard_normal((args.rows, args.dim), dtype=np.float32) for n in names}
    state_bytes = sum(a.nbytes for a in model.values())
    touched = max(1, int(args.rows * args.touch))
    from common import machine_description  # noqa: PLC0415  (benchmarks/: the machine header)
    print("# Checkpoints on S3: cnrstore's remote tier against DCP's FsspecWriter\n")
    print("\n".join(f"- {line}" for line in machine_description()))
    print(f"- model: {args.tables} tables x {args.rows:,} x {args.dim} fp32 = {state_bytes / 2**20:.1f} MiB; "
          f"{args.saves} saves, {touched:,} rows ({args.touch:.0%}) of each table changed per save; endpoint "
          f"{endpoint} (moto, in process)")
    s3 = fsspec.filesystem("s3", **options)
    remote = cnrstore.open(os.path.join(work, "cnr"), create=True, remote="s3://bench/cnr", remote_options=options,
                           cache_bytes=state_bytes // 4)
    local = cnrstore.open(os.path.join(work, "local"), create=True)
    for store in (remote, local):
        for n in names:
            store.create_table(n, args.rows, args.dim, codec="fp32")
    rows_of_save: list[dict[str, np.ndarray]] = []
    cnr_s, cnr_b, loc_s, dcp_s, dcp_b = [], [], [], [], []
    try:
        for i in range(args.saves):
            if i == 0:
                changed = {n: np.arange(args.rows) for n in names}
            else:
                changed = {n: np.sort(rng.choice(args.rows, touched, replace=False)) for n in names}
                for n in names:
                    model[n][changed[n]] = rng.standard_normal((touched, args.dim), dtype=np.float32)
            rows_of_save.append(changed)
            for store, secs in ((local, loc_s), (remote, cnr_s)):
                before = store.stats().get("remote", {}).get("bytes_uploaded", 0)
                t0 = time.perf_counter()
                with store.checkpoint(step=i) as ck:
                    for n in names:
                        ck.put_rows(n, changed[n], model[n][changed[n]])
                secs.append(time.perf_counter() - t0)
                if store is remote:
                    cnr_b.append(store.stats()["remote"]["bytes_uploaded"] - before)
            state = {n: torch.from_numpy(model[n]) for n in names}
            url = f"s3://bench/dcp/save-{i}"
            t0 = time.perf_counter()
            dcp.save(state, storage_writer=FsspecWriter(url, **options), no_dist=True)
            dcp_s.append(time.perf_counter() - t0)
            dcp_b.append(int(s3.du(f"bench/dcp/save-{i}")))
            if i:
                s3.rm(f"bench/dcp/save-{i - 1}", recursive=True)
        status = remote.stats()["remote"]
        remote.close()
        local.close()

        # restore of the newest save on a fresh machine
        t0 = time.perf_counter()
        with cnrstore.open(os.path.join(work, "fresh"), readonly=True, remote="s3://bench/cnr",
                           remote_options=options) as fresh:
            got = fresh.read_tables({n: None for n in names})
        cnr_restore = time.perf_counter() - t0
        assert all(np.array_equal(got[n], model[n]) for n in names), "cnrstore restore differs"
        into = {n: torch.empty(args.rows, args.dim) for n in names}
        t0 = time.perf_counter()
        dcp.load(into, storage_reader=FsspecReader(f"s3://bench/dcp/save-{args.saves - 1}", **options), no_dist=True)
        dcp_restore = time.perf_counter() - t0
        assert all(np.array_equal(into[n].numpy(), model[n]) for n in names), "dcp restore differs"
    finally:
        shutil.rmtree(work, ignore_errors=True)
        server.stop()

    def row(label, secs, nbytes):
        inc_s = statistics.median(secs[1:]) if len(secs) > 1 else float("nan")
        inc_b = statistics.median(nbytes[1:]) if len(nbytes) > 1 else float("nan")
        return label, secs[0], inc_s, nbytes[0], inc_b, sum(nbytes)

    rows = [row("cnrstore -> S3", cnr_s, cnr_b), row("DCP FsspecWriter -> S3", dcp_s, dcp_b)]
    print("\n| method | save 0 | later saves (median) | save 0 uploaded | later save uploaded (median) | "
          "all saves uploaded | restore newest, fresh machine |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for (label, s0, si, b0, bi, tb), rest in zip(rows, (cnr_restore, dcp_restore)):
        print(f"| {label} | {s0:.3f} s | {si:.3f} s | {b0 / 2**20:.2f} MiB | {bi / 2**20:.2f} MiB | "
              f"{tb / 2**20:.2f} MiB | {rest:.3f} s |")
    (_, c0, ci, cb0, cbi, ctb), (_, d0, di, db0, dbi, dtb) = rows
    print(f"\n- later saves (median of {args.saves - 1}): cnrstore uploads {cbi / dbi:.3f}x DCP's bytes "
          f"({dbi / cbi:.1f}x fewer) in {ci / di:.3f}x DCP's seconds")
    print(f"- save 0 (every row): {cb0 / db0:.3f}x DCP's bytes, {c0 / d0:.3f}x its seconds; all {args.saves} saves: "
          f"{ctb / dtb:.3f}x DCP's bytes")
    lo = statistics.median(loc_s[1:]) if len(loc_s) > 1 else loc_s[0]
    print(f"- copy point cost: a later cnrstore save takes {ci:.3f} s to S3 against {lo:.3f} s into a local store "
          f"({ci / lo:.1f}x); {status['copy_points']} copy points, {status['copy_point_seconds']:.2f} s in them; "
          f"{status['objects_uploaded']} objects uploaded, {status['segments_evicted']} segments evicted "
          f"(cache {status['cache_bytes'] / 2**20:.0f} MiB)")
    print(f"- restore of the newest save on a fresh machine: cnrstore {cnr_restore:.3f} s (recover the index, read "
          f"every table: segments under a quarter of the cache whole, larger ones by range), DCP dcp.load "
          f"{dcp_restore:.3f} s (cnrstore / DCP {cnr_restore / dcp_restore:.2f}x)")
    print("- the endpoint is moto on localhost: these figures are the client side and a loopback link; over a "
          "network both methods scale with the bytes they move")

if __name__ == "__main__":
    main()
