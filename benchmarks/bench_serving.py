#!/usr/bin/env python3
"""Serving follows training (issue 40): how fresh a follower's tensors are, what it reads per update and what
it costs, against a TorchEasyRec-style dump of touched rows and a full ``dcp.load``; and whether following
beats periodic full reloads on a drifting stream.

The trainer (this process) trains the reference DLRM (``tools/dlrm_model.py``: 26 Criteo tables capped at
``--max-rows``, ``--dim``, Adagrad, synthetic Criteo batches) and saves with ``cnrstore.torch.Checkpointer``
(fp32, incremental, its own store with background compaction) every ``--save-s`` seconds. A serving
process (spawned, a process of its own) holds a DLRM of the same shape and follows the store with
``cnrstore.serving.Follower``, polling every ``--poll-s`` seconds. Measured:

- **freshness**: a version's commit (``VersionInfo.created``) to the follower's tensors holding it (or a
  newer version), wall clock, p50 and p99 over the run's versions;
- **bytes per update**: what the follower read (``stats["bytes_read"]``: the changed rows as stored, in their
  codec, and the dense arrays) against the rows that changed (the union of the ids the trainer looked up over
  the versions the update covered; Adagrad moves exactly those) in the table's codec plus the dense arrays,
  the same run; beside it what a TorchEasyRec-style incremental dump of the same touched ids would be (ids
  int64 + rows fp32, and with its int8 row-wise option: int8 codes + fp32 scale and bias per row; dense
  arrays as they are) and ``dcp.load`` of a full checkpoint of the model (``dcp.save`` of its state dict to a
  directory after the run: bytes = the directory; load timed, median of 3);
- **CPU**: the serving process's CPU time over each poll that applied something, and the serving process's
  CPU over the whole run against its wall time (the share of one core following costs);
- **quality**: ``tools/serve_follow.py`` at its quick sizes over ``--seeds`` seeds: mean logloss of the
  follower against full reloads every 100 steps on the drifting stream, the margin with its 95% t interval;
- **S3**: the same follow with the store on S3 (moto's server on localhost, a process of its own; the
  trainer's store ``remote=`` with a copy point after every commit, the follower a read cache reopened at each
  poll: only the last copy point is visible to it): freshness from commit, p50 and p99. The baseline's copy
  point (``sync_remote()``) and the follower's full sync come before the measured saves.

    .venv/bin/python benchmarks/bench_serving.py [--quick] [--out FILE]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
TOOLS = os.path.join(os.path.dirname(HERE), "tools")
sys.path.insert(0, HERE)
sys.path.insert(0, TOOLS)
sys.path.insert(0, os.path.dirname(HERE))

GOAL_P50_S, GOAL_P99_S, GOAL_BYTES = 1.0, 2.4, 1.1


def model_args(args) -> argparse.Namespace:
    return argparse.Namespace(max_rows=args.max_rows, dim=args.dim, batch_size=args.batch, seed=0)


def follower_child(margs: dict, path: str, remote, remote_options, poll_s: float, ready, stop,
                   results) -> None:
    """The serving process: a DLRM of the trainer's shape, following ``path`` until ``stop`` is set; puts
    its per-update log and its CPU and wall time."""
    import torch

    from dlrm_model import build_model
    from cnrstore.serving import Follower

    torch.set_num_threads(1)
    model = build_model(argparse.Namespace(**margs), 1)
    if remote is not None:  # a read cache of the bucket's last copy point
        f = Follower(path, model, remote=remote, remote_options=remote_options, version=None)
    else:
        f = Follower(path, model, version=None)
    f.poll()  # the full sync, not measured
    ready.set()
    log = []
    cpu0, wall0 = time.process_time(), time.perf_counter()
    while not stop.is_set():
        t0, c0, v0, b0, r0 = time.perf_counter(), time.process_time(), f.version, f.stats["bytes_read"], \
            f.stats["rows_applied"]
        got = f.poll()
        if got is not None:
            log.append({"from": v0, "to": got, "at": time.time(), "wall_s": time.perf_counter() - t0,
                        "cpu_s": time.process_time() - c0, "bytes": f.stats["bytes_read"] - b0,
                        "rows": f.stats["rows_applied"] - r0})
        time.sleep(max(0.0, poll_s - (time.perf_counter() - t0)))
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    f.close()
    results.put({"log": log, "cpu_s": cpu, "wall_s": wall})


def follow_run(args, label: str, endpoint=None) -> dict:
    """Train for ``args.seconds`` with a save every ``args.save_s`` s while a serving process follows."""
    import torch

    import cnrstore
    from cnrstore import codecs
    from cnrstore.torch import Checkpointer
    from dlrm_model import SyntheticCriteo, build_model, build_optimizer

    torch.set_num_threads(1)
    margs = model_args(args)
    root = tempfile.mkdtemp(prefix=f"bench_serving-{label}-", dir=args.tmp)
    remote = options = None
    if endpoint is not None:
        remote, options = f"s3://bench/serve-{label}", endpoint.options
        store = cnrstore.open(os.path.join(root, "trainer"), create=True, remote=remote, remote_options=options, remote_every=1,
                              compaction="auto")
        follow_path = os.path.join(root, "replica")
    else:
        store = cnrstore.open(os.path.join(root, "trainer"), create=True, compaction="auto")
        follow_path = store.path
    model = build_model(margs, 0)
    opt = build_optimizer(model, 0.05)
    data = SyntheticCriteo(margs)
    ckpt = Checkpointer(store, model, opt, codec="fp32", mode="incremental")
    ckpt.save(0, meta={"step": 0}).wait()
    if endpoint is not None:
        store.sync_remote()  # the baseline's copy point, before the measured saves
    ctx = mp.get_context("spawn")
    ready, stop, results = ctx.Event(), ctx.Event(), ctx.Queue()
    child = ctx.Process(target=follower_child, args=(vars(margs), follow_path, remote, options, args.poll_s,
                                                     ready, stop, results), daemon=True)
    child.start()
    if not ready.wait(600):  # the child's imports and full sync (not measured)
        raise RuntimeError("the follower did not finish its full sync in 600 s")
    touched: dict[int, list[np.ndarray]] = {}  # version -> per table, the ids looked up since the last save
    since = [[] for _ in model.embs]
    pending, step, steps_per_save = [], 0, []
    t_end = time.perf_counter() + args.seconds
    last_save, n_since = time.perf_counter(), 0
    try:
        while time.perf_counter() < t_end:
            step += 1
            dense, ids, labels = data.batch(step)
            for t in range(ids.shape[1]):
                since[t].append(ids[:, t].numpy())
            opt.zero_grad()
            loss = torch.nn.functional.binary_cross_entropy_with_logits(model(dense, ids), labels)
            loss.backward()
            opt.step()
            n_since += 1
            if time.perf_counter() - last_save >= args.save_s:
                p = ckpt.save(step, meta={"step": step})
                p.wait()  # (its version number; the save ran behind training until here)
                v = store.latest().version
                touched[v] = [np.unique(np.concatenate(s)) for s in since]
                since = [[] for _ in model.embs]
                steps_per_save.append(n_since)
                last_save, n_since = time.perf_counter(), 0
        time.sleep(max(2.0, 4 * args.poll_s))  # the follower catches up with the last save
        stop.set()
        out = results.get(timeout=300)
        child.join(60)
        created = {v.version: v.created for v in store.versions()}
        infos = store.tables()
    finally:
        if child.is_alive():
            child.terminate()
        ckpt.close()
        store.close()
    emb_names = [p for p, m in model.named_modules() if isinstance(m, torch.nn.EmbeddingBag)]
    dims = {n: infos[n].dim for n in emb_names}
    row_bytes = {n: codecs.get(infos[n].codec).row_bytes(infos[n].dim) for n in emb_names}
    emb_ids = {id(m.weight) for m in model.embs}
    dense_bytes = sum(v.numel() * v.element_size() for v in model.state_dict(keep_vars=True).values()
                      if id(v) not in emb_ids)
    fresh, held = [], 0
    updates = []
    for u in sorted(out["log"], key=lambda u: u["at"]):
        for v in range(max(held, u["from"] or 0) + 1, u["to"] + 1):
            if v in created and v in touched:
                fresh.append(u["at"] - created[v])
        held = max(held, u["to"])
        covered = [v for v in touched if (u["from"] or 0) < v <= u["to"]]
        if not covered:
            continue
        rows = [np.unique(np.concatenate([touched[v][t] for v in covered])) for t in range(len(emb_names))]
        n_rows = sum(r.size for r in rows)
        changed = sum(r.size * row_bytes[n] for r, n in zip(rows, emb_names)) + dense_bytes
        updates.append({**u, "changed_bytes": changed, "changed_rows": n_rows,
                        "tfrec_fp32": sum(r.size * (8 + 4 * dims[n]) for r, n in zip(rows, emb_names)) + dense_bytes,
                        "tfrec_int8": sum(r.size * (8 + dims[n] + 8) for r, n in zip(rows, emb_names)) + dense_bytes})
    dcp = dcp_reference(model, root) if endpoint is None else None
    shutil.rmtree(root, ignore_errors=True)
    return {"fresh": fresh, "updates": updates, "cpu_s": out["cpu_s"], "wall_s": out["wall_s"],
            "versions": len(touched), "steps": step, "steps_per_save": float(np.median(steps_per_save)) if
            steps_per_save else 0.0, "save_s": args.save_s, "dcp": dcp,
            "state_bytes": sum(v.numel() * v.element_size() for v in model.state_dict().values()),
            "rows": sum(infos[n].num_rows for n in emb_names)}


def dcp_reference(model, root: str) -> dict:
    """``dcp.save`` of the model's state dict into a directory, then ``dcp.load`` of it (median of 3)."""
    import torch.distributed.checkpoint as dcp

    from common import dir_bytes

    path = os.path.join(root, "dcp")
    dcp.save(model.state_dict(), checkpoint_id=path)
    times = []
    for _ in range(3):
        sd = {k: v.clone() for k, v in model.state_dict().items()}
        t0 = time.perf_counter()
        dcp.load(sd, checkpoint_id=path)
        times.append(time.perf_counter() - t0)
    return {"bytes": dir_bytes(path), "load_s": float(np.median(times))}


def quality(args) -> dict:
    """tools/serve_follow.py at its quick sizes over ``args.seeds`` seeds: logloss and AUC per case."""
    import serve_follow

    per = []
    for seed in range(args.seeds):
        a = serve_follow.parse(["--quick", "--seed", str(seed)] + (["--tmp", args.tmp] if args.tmp else []))
        a.print_lines = False
        per.append(serve_follow.run(a))
    return {"runs": per, "settings": per[0]["settings"]}


def mean_ci(xs) -> tuple[float, float]:
    from common import T975, Z975, t_quantile

    xs = np.asarray(xs, dtype=np.float64)
    if xs.size < 2:
        return float(xs.mean()), float("nan")
    return float(xs.mean()), t_quantile(T975, Z975, xs.size - 1) * float(xs.std(ddof=1)) / np.sqrt(xs.size)


def report(args, local: dict, s3: dict | None, q: dict, seconds: float) -> str:
    from common import fmt_bytes, load_average, machine_description

    def ms(x):
        return f"{x * 1e3:.0f} ms"

    lines = [f"## {args.title}", "",
             f"Reproduce: `.venv/bin/python benchmarks/bench_serving.py{' --quick' if args.quick else ''}` "
             f"({seconds:.0f} s here).", ""]
    lines += [f"- {m}" for m in machine_description()]
    who = "cnrstore.serving.Follower"
    lines += [f"- load average at end: {load_average()}",
              f"- trainer: the reference DLRM, 26 tables capped at {args.max_rows:,} rows ({local['rows']:,} rows) x "
              f"{args.dim} fp32, Adagrad, batch {args.batch}; model state {fmt_bytes(local['state_bytes'])}; a save every "
              f"{args.save_s:g} s ({local['steps_per_save']:.0f} steps, median) for {args.seconds:g} s: "
              f"{local['versions']} versions",
              f"- follower: {who}, in a spawned process, polling every {args.poll_s:g} s", ""]
    ups = local["updates"]
    fr = local["fresh"]
    p50, p99 = float(np.percentile(fr, 50)), float(np.percentile(fr, 99))
    ratio = np.array([u["bytes"] / u["changed_bytes"] for u in ups])
    med = {k: float(np.median([u[k] for u in ups])) for k in ("bytes", "changed_bytes", "tfrec_fp32", "tfrec_int8",
                                                               "changed_rows", "rows", "cpu_s", "wall_s")}
    dcp = local["dcp"]
    lines += ["| method | bytes read per update (median) | vs changed rows in the codec | update time (median) |",
              "|---|---:|---:|---:|",
              f"| changed rows in the table's codec (+ dense arrays) | {fmt_bytes(med['changed_bytes'])} | 1.00x | - |",
              f"| cnrstore follower | {fmt_bytes(med['bytes'])} | {np.median(ratio):.2f}x (max {ratio.max():.2f}x) | "
              f"{ms(med['wall_s'])} |",
              f"| TorchEasyRec-style dump, ids int64 + fp32 rows | {fmt_bytes(med['tfrec_fp32'])} | "
              f"{med['tfrec_fp32'] / med['changed_bytes']:.2f}x | - |",
              f"| TorchEasyRec-style dump, ids int64 + int8 rows + fp32 scale, bias | {fmt_bytes(med['tfrec_int8'])} | "
              f"{med['tfrec_int8'] / med['changed_bytes']:.2f}x | - |",
              f"| dcp.load of a full checkpoint | {fmt_bytes(dcp['bytes'])} | {dcp['bytes'] / med['changed_bytes']:.1f}x | "
              f"{ms(dcp['load_s'])} |", ""]
    lines += [f"Per update (median): {med['changed_rows']:,.0f} rows changed, {med['rows']:,.0f} rows applied by the "
              f"follower; {len(ups)} updates measured.", ""]
    cpu_share = local["cpu_s"] / local["wall_s"]
    lines += ["| freshness: commit -> follower's tensors | p50 | p99 | versions |", "|---|---:|---:|---:|",
              f"| local store | {ms(p50)} | {ms(p99)} | {len(fr)} |"]
    if s3 is not None:
        s50, s99 = float(np.percentile(s3["fresh"], 50)), float(np.percentile(s3["fresh"], 99))
        lines.append(f"| S3 (moto, localhost; copy point every commit; the follower sees copy points only) | "
                     f"{ms(s50)} | {ms(s99)} | {len(s3['fresh'])} |")
    lines.append("")
    runs = q["runs"]
    margin = [r["cases"]["reload"]["logloss"] - r["cases"]["follow"]["logloss"] for r in runs]
    amargin = [r["cases"]["follow"]["auc"] - r["cases"]["reload"]["auc"] for r in runs]
    m, ci = mean_ci(margin)
    am, aci = mean_ci(amargin)
    st = q["settings"]
    lines += [f"Quality on the drifting stream (`tools/serve_follow.py --quick`: {st['steps']} steps, the distribution "
              f"shifting every {st['phase_steps']}, a save every {st['save_every']}, a full reload every "
              f"{st['reload_every']}, an evaluation every {st['eval_every']}; seeds 0-{len(runs) - 1}):", "",
              "| case | mean logloss | mean AUC | steps behind the trainer (mean) |", "|---|---:|---:|---:|"]
    for case in ("follow", "reload", "static"):
        ll = np.mean([r["cases"][case]["logloss"] for r in runs])
        au = np.mean([r["cases"][case]["auc"] for r in runs])
        behind = np.mean([r["cases"][case].get("behind_mean", np.nan) for r in runs])
        lines.append(f"| {case} | {ll:.4f} | {au:.3f} | {'never updated' if case == 'static' else f'{behind:.1f}'} |")
    lines += ["", "Targets, from this run:"]

    def goal(text, ok):
        lines.append(f"- {text}: **{'met' if ok else 'not met'}**")

    goal(f"freshness p50, commit to the follower's tensors: {ms(p50)} (goal <= {GOAL_P50_S:g} s)", p50 <= GOAL_P50_S)
    goal(f"freshness p99: {ms(p99)} (goal <= {GOAL_P99_S:g} s)", p99 <= GOAL_P99_S)
    goal(f"bytes a replica reads per update / the changed rows in the codec: {np.median(ratio):.2f}x median, "
         f"{ratio.max():.2f}x max (goal <= {GOAL_BYTES:g}x)", ratio.max() <= GOAL_BYTES)
    goal(f"following beats full reloads every {st['reload_every']} steps on the drifting stream: logloss lower by "
         f"{m:.4f} ± {ci:.4f} (95% t interval over {len(runs)} seeds; AUC higher by {am:.3f} ± {aci:.3f})",
         m - ci > 0)
    lines.append(f"- follower CPU: {ms(med['cpu_s'])} per update (median; {med['cpu_s'] / med['wall_s']:.0%} of a core "
                 f"while updating); over the run {cpu_share:.1%} of one core for a save every {args.save_s:g} s")
    lines.append(f"- a full reload reads {dcp['bytes'] / med['bytes']:.0f}x the follower's bytes per update "
                 f"(dcp.load {ms(dcp['load_s'])} against the follower's {ms(med['wall_s'])})")
    if s3 is not None:
        lines.append(f"- S3: freshness p50 {ms(s50)}, p99 {ms(s99)} (the commit's copy point, then the follower's "
                     f"reopen of its read cache and read of the changed rows; {len(s3['updates'])} updates)")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a smoke run (about 40 s)")
    p.add_argument("--max-rows", type=int, default=100_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=2048)
    p.add_argument("--seconds", type=float, default=60.0, help="training time of the local follow run")
    p.add_argument("--save-s", type=float, default=3.0, help="seconds between saves")
    p.add_argument("--poll-s", type=float, default=0.2, help="the follower's polling interval")
    p.add_argument("--seeds", type=int, default=5, help="seeds of the quality comparison")
    p.add_argument("--s3-seconds", type=float, default=30.0, help="training time of the S3 follow run (0: none)")
    p.add_argument("--tmp", default=None)
    p.add_argument("--out", default=None)
    p.add_argument("--title", default="Serving follows training: freshness, bytes per update, quality")
    args = p.parse_args(argv)
    if args.quick:
        args.max_rows, args.dim, args.batch = 20_000, 16, 512
        args.seconds, args.save_s, args.seeds, args.s3_seconds = 8.0, 1.5, 3, 5.0
    t0 = time.perf_counter()
    local = follow_run(args, "local")
    s3 = None
    if args.s3_seconds > 0:
        from common import MotoEndpoint

        endpoint = MotoEndpoint()
        try:
            s = argparse.Namespace(**{**vars(args), "seconds": args.s3_seconds})
            s3 = follow_run(s, "s3", endpoint)
        finally:
            endpoint.stop()
    q = quality(args)
    from common import publish
    publish(report(args, local, s3, q, time.perf_counter() - t0), args.out, None, None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
