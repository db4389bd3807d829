#!/usr/bin/env python3
"""Checkpoints on S3: bytes uploaded and seconds per save, cnrstore's object-store tier against
``torch.distributed.checkpoint`` with ``FsspecWriter``, both to the same S3 endpoint: moto's server, run in a
process of its own on localhost (as a real endpoint is: it does not share the client's interpreter and GIL),
started for the run and stopped after it. The figures measure the client side and a loopback endpoint, not a
WAN link.

The model is ``--tables`` fp32 embedding tables of ``--rows`` x ``--dim`` (a DLRM's sparse part; ``--gib G``
sizes the rows for G GiB). Save 0 writes every row; each later save (``--saves`` in all) first changes
``--touch`` of every table's rows (a random subset, as a training interval does) and saves again:

- cnrstore: ``cnrstore.open(dir, remote="s3://bucket/cnr", cache_bytes=...)``, one checkpoint per save with
  the touched rows (codec fp32, lossless, for a like-for-like comparison), committed; the commit's copy point
  (remote_every=1: the writer's segment sealed and uploaded, the index snapshot and the pointer) is part of
  the save's time. Bytes uploaded: the store's own count of object bytes it PUT.
- DCP: ``dcp.save(state_dict, storage_writer=FsspecWriter("s3://bucket/dcp/save-N", **options))``: every
  tensor, whole, each save. Bytes uploaded: the sizes of the objects the save left under its prefix. The
  previous save's objects are deleted after each save (keep-last-1), so the endpoint holds one.
- Reference for the copy point's cost: the same cnrstore saves into a local store (no remote), same run.

Then restore of the newest save on a "fresh machine" (an empty directory), each checked bit for bit:

- cnrstore: ``cnrstore.open(dir, readonly=True, remote=...)`` recovers the index from the bucket, then
  ``read_tables`` reads every table: the records it needs are planned from the index, coalesced into ranged
  GETs and fetched 16 at a time while it decodes what arrived (docs/DESIGN.md "Planned reads"). Reported:
  the bytes it fetched and the bytes of the records it needed.
- DCP: ``dcp.load`` with ``FsspecReader`` into preallocated tensors.
- The endpoint's bulk GET throughput, the physical reference: the segment objects cnrstore's restore reads,
  fetched whole by s3fs (``cat``) with the same 16 requests at once, and DCP's objects the same way.

    python benchmarks/bench_s3.py            # 8 tables x 65,536 x 64 fp32 (128 MiB), 10 saves, 5% touched
    python benchmarks/bench_s3.py --gib 1    # 8 tables x 524,288 x 64 (1 GiB), 4 saves
    python benchmarks/bench_s3.py --quick    # 4 tables x 16,384 x 32 (8 MiB), 5 saves
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import http.client
import urllib.parse
import warnings
from concurrent.futures import ThreadPoolExecutor

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import cnrstore  # noqa: E402


def bulk_get(s3, paths: list[str], lanes: int, per_object: int | None = None) -> tuple[float, int]:
    """(seconds, bytes) to fetch ``paths`` whole with s3fs, ``lanes`` objects at once; ``per_object``: at most
    that many requests per object (1: one GET each; None: s3fs's own, ranges of 50 MiB, 10 at a time)."""
    s3.invalidate_cache()
    kw = {} if per_object is None else {"max_concurrency": per_object}
    t0 = time.perf_counter()
    got = s3.cat(paths, batch_size=lanes, on_error="raise", **kw)
    return time.perf_counter() - t0, sum(len(v) for v in got.values())


def raw_get(endpoint: "Endpoint", paths: list[str], lanes: int) -> tuple[float, int]:
    """(seconds, bytes) to fetch ``paths`` whole with plain HTTP GETs of presigned URLs (http.client, each body
    read into a buffer of its size), ``lanes`` at once: the endpoint's throughput with as little client as
    there can be."""
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint.url, aws_access_key_id="bench", aws_secret_access_key="bench",
                          region_name="us-east-1")
    host, port = urllib.parse.urlsplit(endpoint.url).hostname, urllib.parse.urlsplit(endpoint.url).port
    urls = [client.generate_presigned_url("get_object", Params={"Bucket": p.split("/", 1)[0],
                                                                "Key": p.split("/", 1)[1]}, ExpiresIn=3600)
            for p in paths]

    def get(url: str) -> int:
        conn = http.client.HTTPConnection(host, port, timeout=120)
        try:
            conn.request("GET", url[len(endpoint.url):])
            resp = conn.getresponse()
            if resp.status != 200:
                raise RuntimeError(f"GET {url}: HTTP {resp.status}")
            view, got = memoryview(bytearray(int(resp.getheader("Content-Length")))), 0
            while got < len(view):
                n = resp.readinto(view[got:])
                if not n:
                    break
                got += n
            return got
        finally:
            conn.close()

    with ThreadPoolExecutor(lanes) as pool:
        t0 = time.perf_counter()
        nbytes = sum(pool.map(get, urls))
        return time.perf_counter() - t0, nbytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tables", type=int, default=8)
    ap.add_argument("--rows", type=int, default=65536)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--saves", type=int, default=10)
    ap.add_argument("--touch", type=float, default=0.05, help="fraction of each table's rows changed per save")
    ap.add_argument("--gib", type=float, default=None,
                    help="size the tables' rows for this many GiB of fp32 (and 4 saves unless --saves is given)")
    ap.add_argument("--reps", type=int, default=5, help="restores of each method, interleaved (medians reported)")
    ap.add_argument("--quick", action="store_true", help="4 tables x 16,384 x 32, 5 saves")
    ap.add_argument("--out", help="also write the report (markdown) to this file")
    args = ap.parse_args()
    if args.quick:
        args.tables, args.rows, args.dim, args.saves, args.reps = 4, 16384, 32, 5, 1
    if args.gib:
        args.rows = int(args.gib * 2**30) // (args.tables * args.dim * 4)
        if "--saves" not in sys.argv:
            args.saves = 4

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # (no_dist=True: one process)
    import fsspec
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    from common import MotoEndpoint  # noqa: PLC0415  (benchmarks/)

    endpoint = MotoEndpoint()
    options = endpoint.options
    work = tempfile.mkdtemp(prefix="bench_s3-")
    rng = np.random.default_rng(0)
    names = [f"emb{i}" for i in range(args.tables)]
    model = {n: rng.standard_normal((args.rows, args.dim), dtype=np.float32) for n in names}
    state_bytes = sum(a.nbytes for a in model.values())
    touched = max(1, int(args.rows * args.touch))
    lanes = cnrstore.Options().remote_read_requests
    from common import machine_description, publish  # noqa: PLC0415  (benchmarks/: the machine header)
    lines: list[str] = []
    say = lines.append
    say(f"# Checkpoints on S3 ({state_bytes / 2**20:.0f} MiB of tables): cnrstore's remote tier against DCP's "
        "FsspecWriter\n")
    say("\n".join(f"- {line}" for line in machine_description()))
    say(f"- model: {args.tables} tables x {args.rows:,} x {args.dim} fp32 = {state_bytes / 2**20:.1f} MiB; "
          f"{args.saves} saves, {touched:,} rows ({args.touch:.0%}) of each table changed per save; endpoint "
          f"{endpoint.url} (moto's server, in a process of its own)")
    s3 = fsspec.filesystem("s3", **options)
    remote = cnrstore.open(os.path.join(work, "cnr"), create=True, remote="s3://bench/cnr", remote_options=options,
                           cache_bytes=state_bytes // 4)
    local = cnrstore.open(os.path.join(work, "local"), create=True)
    for store in (remote, local):
        for n in names:
            store.create_table(n, args.rows, args.dim, codec="fp32")
    cnr_s, cnr_b, loc_s, dcp_s, dcp_b = [], [], [], [], []
    try:
        for i in range(args.saves):
            if i == 0:
                changed = {n: np.arange(args.rows) for n in names}
            else:
                changed = {n: np.sort(rng.choice(args.rows, touched, replace=False)) for n in names}
                for n in names:
                    model[n][changed[n]] = rng.standard_normal((touched, args.dim), dtype=np.float32)
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

        # restore of the newest save on a fresh machine (an empty directory, the URL), each method in turn,
        # --reps times (the machine is shared: medians of interleaved runs), each checked bit for bit
        whole_segments = cnrstore.Options(remote_read_request_bytes=4 << 30, remote_read_window_bytes=4 << 30)
        s3.invalidate_cache()
        cnr_objects = sorted(p for p in s3.find("bench/cnr") if "/segments/" in p)
        dcp_objects = sorted(s3.find(f"bench/dcp/save-{args.saves - 1}"))
        runs: dict[str, list] = {}
        for rep in range(args.reps):
            for label, opts in (("cnr", None), ("cnr-whole", whole_segments)):
                t0 = time.perf_counter()
                with cnrstore.open(os.path.join(work, f"fresh-{label}-{rep}"), readonly=True, remote="s3://bench/cnr",
                                   remote_options=options, options=opts) as fresh:
                    opened = time.perf_counter() - t0
                    got = fresh.read_tables({n: None for n in names})
                    total = time.perf_counter() - t0
                    read = fresh.stats()["remote"]
                assert all(np.array_equal(got[n], model[n]) for n in names), "cnrstore restore differs"
                del got
                runs.setdefault(label, []).append((total, opened, read))
            into = {n: torch.empty(args.rows, args.dim) for n in names}
            t0 = time.perf_counter()
            dcp.load(into, storage_reader=FsspecReader(f"s3://bench/dcp/save-{args.saves - 1}", **options),
                     no_dist=True)
            runs.setdefault("dcp", []).append(time.perf_counter() - t0)
            assert all(np.array_equal(into[n].numpy(), model[n]) for n in names), "dcp restore differs"
            del into
            # the physical reference: the same objects fetched whole, as many at once as cnrstore's requests: by
            # s3fs's cat as it is (it splits an object past 50 MiB into ranges itself), and one GET per object
            for label, paths in (("cnr-objects", cnr_objects), ("dcp-objects", dcp_objects)):
                runs.setdefault((label, "raw"), []).append(raw_get(endpoint, paths, lanes))
                for how, per_object in (("cat", None), ("one GET", 1)):
                    runs.setdefault((label, how), []).append(bulk_get(s3, paths, lanes, per_object))
    finally:
        shutil.rmtree(work, ignore_errors=True)
        endpoint.stop()

    def row(label, secs, nbytes):
        inc_s = statistics.median(secs[1:]) if len(secs) > 1 else float("nan")
        inc_b = statistics.median(nbytes[1:]) if len(nbytes) > 1 else float("nan")
        return label, secs[0], inc_s, nbytes[0], inc_b, sum(nbytes)

    med = statistics.median
    cnr_restore = med(t for t, _o, _r in runs["cnr"])
    dcp_restore = med(runs["dcp"])
    rows = [row("cnrstore -> S3", cnr_s, cnr_b), row("DCP FsspecWriter -> S3", dcp_s, dcp_b)]
    say("\n| method | save 0 | later saves (median) | save 0 uploaded | later save uploaded (median) | "
          "all saves uploaded | restore newest, fresh machine |")
    say("|---|---:|---:|---:|---:|---:|---:|")
    for (label, s0, si, b0, bi, tb), rest in zip(rows, (cnr_restore, dcp_restore)):
        say(f"| {label} | {s0:.3f} s | {si:.3f} s | {b0 / 2**20:.2f} MiB | {bi / 2**20:.2f} MiB | "
              f"{tb / 2**20:.2f} MiB | {rest:.3f} s |")
    (_, c0, ci, cb0, cbi, ctb), (_, d0, di, db0, dbi, dtb) = rows
    say(f"\n- later saves (median of {args.saves - 1}): cnrstore uploads {cbi / dbi:.3f}x DCP's bytes "
          f"({dbi / cbi:.1f}x fewer) in {ci / di:.3f}x DCP's seconds")
    say(f"- save 0 (every row): {cb0 / db0:.3f}x DCP's bytes, {c0 / d0:.3f}x its seconds; all {args.saves} saves: "
          f"{ctb / dtb:.3f}x DCP's bytes")
    lo = statistics.median(loc_s[1:]) if len(loc_s) > 1 else loc_s[0]
    say(f"- copy point cost: a later cnrstore save takes {ci:.3f} s to S3 against {lo:.3f} s into a local store "
          f"({ci / lo:.1f}x); {status['copy_points']} copy points, {status['copy_point_seconds']:.2f} s in them; "
          f"{status['objects_uploaded']} objects uploaded, {status['segments_evicted']} segments evicted "
          f"(cache {status['cache_bytes'] / 2**20:.0f} MiB)")

    def mib_s(nbytes, secs):
        return f"{nbytes / 2**20 / secs:.0f} MiB/s"

    def cnr_row(label, what):
        total = med(t for t, _o, _r in runs[label])
        reading = med(t - o for t, o, _r in runs[label])
        read = runs[label][0][2]
        fetched = read["remote_read_bytes"]
        say(f"| {what} | {total:.3f} s ({reading:.3f} s reading the tables) | {fetched / 2**20:.2f} MiB (records "
              f"needed: {read['planned_read_bytes'] / 2**20:.2f} MiB) | {read['remote_reads']} | "
              f"{mib_s(fetched, reading)} |")
        return total, reading, read

    say(f"\n| restore of the newest save, fresh machine (median of {args.reps}) | seconds | bytes from the "
          "endpoint | GET requests | throughput |")
    say("|---|---:|---:|---:|---:|")
    total, reading, read = cnr_row("cnr", "cnrstore: recover the index, read every table (default options)")
    w_total, w_reading, w_read = cnr_row(
        "cnr-whole", "cnrstore, requests as large as whole segments (remote_read_request_bytes and "
        "remote_read_window_bytes 4 GiB)")
    dcp_bytes = runs[("dcp-objects", "cat")][0][1]
    say(f"| DCP: dcp.load, FsspecReader | {dcp_restore:.3f} s | {dcp_bytes / 2**20:.2f} MiB (its objects) | - | "
          f"{mib_s(dcp_bytes, dcp_restore)} |")
    refs = {}
    for label, what, count in (("cnr-objects", "cnrstore's segment objects", len(cnr_objects)),
                               ("dcp-objects", "DCP's objects", len(dcp_objects))):
        for how in ("raw", "one GET", "cat"):
            secs = med(t for t, _b in runs[(label, how)])
            nbytes = runs[(label, how)][0][1]
            refs[(label, how)] = (secs, nbytes)
            detail = {"raw": "one plain HTTP GET per object (http.client)", "one GET": "s3fs, one GET per object",
                      "cat": "s3fs cat: 50 MiB ranges, 10 per object"}[how]
            say(f"| endpoint bulk GET: {what} ({count}) whole, {lanes} at once, {detail} | {secs:.3f} s | "
                  f"{nbytes / 2**20:.2f} MiB | - | {mib_s(nbytes, secs)} |")
    fetched, needed = read["remote_read_bytes"], read["planned_read_bytes"]

    def per_rep(label, reference):
        """Median over the runs of the fraction of ``reference``'s throughput (same run, same bytes) that
        ``label``'s table reads reached: the machine is shared, so each run is compared with its neighbour."""
        out = []
        for (t, o, r), (ref_s, ref_b) in zip(runs[label], runs[reference]):
            out.append((r["remote_read_bytes"] / (t - o)) / (ref_b / ref_s))
        return med(out)

    speedup = med(d / t for d, (t, _o, _r) in zip(runs["dcp"], runs["cnr"]))
    w_speedup = med(d / t for d, (t, _o, _r) in zip(runs["dcp"], runs["cnr-whole"]))
    say(f"\n- restore of the newest save on a fresh machine: cnrstore {total:.3f} s ({total - reading:.3f} s of it "
          f"recovering the index from the bucket), DCP dcp.load {dcp_restore:.3f} s: cnrstore {speedup:.2f}x "
          f"faster (median of the runs' ratios; goal: 3x); with requests as large as its segments {w_speedup:.2f}x")
    say(f"- bytes: cnrstore fetched {fetched / 2**20:.2f} MiB for {needed / 2**20:.2f} MiB of records it needed "
          f"({fetched / needed:.3f}x) in {read['remote_reads']} ranged GETs; DCP's objects hold "
          f"{dcp_bytes / 2**20:.2f} MiB (cnrstore reads {fetched / dcp_bytes:.2f}x their bytes: the newest "
          "version's read chains, a baseline and the increments above it)")
    raw, one, cat = (("cnr-objects", how) for how in ("raw", "one GET", "cat"))
    say(f"- against the endpoint's bulk GET throughput for its segment objects, fetched whole and not decoded "
          f"(median of the runs' ratios; goal: 90%): plain HTTP GETs ({mib_s(refs[raw][1], refs[raw][0])}): "
          f"cnrstore's table reads reach {per_rep('cnr', raw):.0%} with the default options, "
          f"{per_rep('cnr-whole', raw):.0%} with requests as large as its segments; s3fs, one GET per object "
          f"({mib_s(refs[one][1], refs[one][0])}): {per_rep('cnr', one):.0%} and {per_rep('cnr-whole', one):.0%}; "
          f"s3fs's cat ({mib_s(refs[cat][1], refs[cat][0])}): {per_rep('cnr', cat):.0%} and "
          f"{per_rep('cnr-whole', cat):.0%}")
    d_raw = refs[("dcp-objects", "raw")]
    say(f"- DCP's dcp.load moves its objects' bytes at {dcp_bytes / dcp_restore / (d_raw[1] / d_raw[0]):.0%} of "
          f"plain HTTP GETs of them ({mib_s(d_raw[1], d_raw[0])})")
    say("- the endpoint is moto on localhost, in its own process, sharing this machine's cores with the client. "
          "moto reads a whole object to serve any range of it, so a request there costs its object's size (S3 "
          "reads the range): fewer, larger requests suit it. These figures are the client side and a loopback "
          "link; over a network every method scales with the bytes it moves")
    publish("\n".join(lines), args.out, None, None)


if __name__ == "__main__":
    main()
