#!/usr/bin/env python3
"""Serving follows training: why a replica should apply every checkpoint version as it commits (issue 40).

A trainer (this process) trains a small DLRM (``dlrm_model.DLRM``: a few ``nn.EmbeddingBag`` tables, dot
interaction) on a synthetic click stream whose distribution DRIFTS: every ``--phase-steps`` steps each table's
set of popular ids (a Zipf popularity over a fresh random ranking) and every id's click propensity are drawn
anew, so the rows that matter now are rows the model learned only recently. It saves with
``cnrstore.torch.Checkpointer`` (fp32, incremental) every ``--save-every`` steps into a local store.

A serving process (``multiprocessing`` spawn) holds three copies of the model and, every ``--eval-every``
trainer steps, scores held-out samples of the stream *as it is now* (logloss, AUC) with each:

- **follow**: a follower applying every committed version (the changed rows only, in their codec), polling
  in a background thread every ``--poll-s`` seconds, and once more before each evaluation;
- **reload**: a full reload of the newest version every ``--reload-every`` trainer steps, as a DCP user
  would do it (every table and dense array read whole into the serving model);
- **static**: the initial model, never updated.

Printed per evaluation side by side; then per case the mean logloss/AUC, how far behind the trainer the
served model was at each evaluation (steps), freshness (a version's commit to the serving tensors holding
it, p50/p99, wall clock) and the bytes moved per update. The last line is ``RESULT {json}`` (for
``tests/test_serve_follow.py`` and ``benchmarks/bench_serving.py``).

Deterministic per seed, timings aside: the trainer waits at each evaluation until the serving process has
scored it (its saves committed, the follower at the newest version), so which version each case serves
depends on steps, never on timing.

    .venv/bin/python tools/serve_follow.py --quick
    .venv/bin/python tools/serve_follow.py --steps 1500 --save-every 10 --reload-every 100 --seed 1

The follower is ``cnrstore.serving.Follower`` (API.md, "Serving: following a store").
"""

from __future__ import annotations

import argparse
import copy
import json
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time

import numpy as np
import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cnrstore  # noqa: E402
from cnrstore import codecs  # noqa: E402
from cnrstore.serving import Follower  # noqa: E402
from dlrm_model import NUM_DENSE, DLRM, auc, logloss  # noqa: E402

DENSE_PREFIX = "torch.model/"


# --------------------------------------------------------------------------------------------- stream


class DriftingStream:
    """Click samples whose distribution changes every ``phase_steps`` trainer steps. In phase ``p`` each
    table's ids follow a Zipf(1.1) popularity over a random ranking of its rows drawn for ``p``, and each row
    has a click propensity drawn for ``p`` (normal); the label is Bernoulli(sigmoid(bias + dense term +
    scaled sum of the sample's propensities)). Sample batches are pure functions of (seed, stream, step)."""

    def __init__(self, seed: int, tables: int, rows: int, phase_steps: int):
        self.seed, self.tables, self.rows, self.phase_steps = seed, tables, rows, phase_steps
        w = 1.0 / np.arange(1, rows + 1, dtype=np.float64) ** 1.1
        self.cdf = np.cumsum(w) / w.sum()
        self.dense_w = np.random.default_rng([seed, 3]).normal(0, 0.3, NUM_DENSE)
        self._phases: dict[int, tuple] = {}

    def phase(self, p: int):
        if p not in self._phases:
            rng = np.random.default_rng([self.seed, 5, p])
            self._phases[p] = (np.stack([rng.permutation(self.rows) for _ in range(self.tables)]),
                               rng.normal(0.0, 1.0, (self.tables, self.rows)))
        return self._phases[p]

    def batch(self, step: int, n: int, stream: int = 0):
        perms, prop = self.phase(step // self.phase_steps)
        rng = np.random.default_rng([self.seed, stream, step])
        dense = np.log1p(np.floor(rng.lognormal(1.0, 1.5, (n, NUM_DENSE)))).astype(np.float32)
        ranks = np.minimum(np.searchsorted(self.cdf, rng.random((n, self.tables))), self.rows - 1)
        ids = perms[np.arange(self.tables), ranks]                        # (n, tables)
        logit = -1.0 + 0.5 * (dense - 1.0) @ self.dense_w + 1.6 * prop[np.arange(self.tables), ids].sum(1) / \
            np.sqrt(self.tables)
        labels = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(np.float32)
        return torch.from_numpy(dense), torch.from_numpy(ids.astype(np.int64)), torch.from_numpy(labels)


def build(args) -> DLRM:
    torch.manual_seed(args.seed)
    return DLRM([args.rows] * args.tables, args.dim, [32], [32], emb_scale=0.05)


# ---------------------------------------------------------------------------------------------- serving


def full_reload(store, model: nn.Module, version: int) -> int:
    """A DCP user's reload: every table and dense array of ``version`` read whole into ``model``; bytes read
    (the tables in their codec, the dense arrays)."""
    embs = {p: m.weight for p, m in model.named_modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))}
    infos = store.tables()
    store.read_tables({k: w.detach().numpy() for k, w in embs.items()}, version)
    nbytes = sum(infos[k].num_rows * codecs.get(infos[k].codec).row_bytes(infos[k].dim) for k in embs)
    ids = {id(w) for w in embs.values()}
    for k, v in model.state_dict(keep_vars=True).items():
        if id(v) not in ids:
            arr = store.read_dense(DENSE_PREFIX + k, version)
            v.detach().numpy()[...] = arr.reshape(v.shape)
            nbytes += arr.nbytes
    return nbytes


def serve(args_dict: dict, path: str, commands, results) -> None:
    """The serving process: three copies of the initial model; answers ("eval", step) with their metrics."""
    torch.set_num_threads(1)
    args = argparse.Namespace(**args_dict)
    stream = DriftingStream(args.seed, args.tables, args.rows, args.phase_steps)
    static = build(args).eval()
    follow, reload = copy.deepcopy(static), copy.deepcopy(static)
    while (cmd := commands.get())[0] != "start":   # the store exists once the trainer's first save committed
        pass
    store = cnrstore.open(path, readonly=True)
    applied: list[tuple[int, float]] = []  # (version, unix time the follower's tensors held it)
    cpu = {"s": 0.0}

    def on_update(follower, old, new, stats):
        applied.append((new, time.time()))

    f = Follower(path, follow, version=cmd[1], on_update=on_update)
    f_poll = f.poll

    def timed_poll():  # the follower's CPU time (this thread's), update by update
        t0 = time.thread_time()
        try:
            return f_poll()
        finally:
            cpu["s"] += time.thread_time() - t0
    f.poll = timed_poll
    f.start(interval_s=args.poll_s)
    reloads: list[tuple[int, float, int]] = []   # (version, time held, bytes)
    reload_version, reload_step = cmd[1], 0
    try:
        while (cmd := commands.get())[0] == "eval":
            step = cmd[1]
            f.poll()
            newest = store.latest()
            if step - reload_step >= args.reload_every:
                nbytes = full_reload(store, reload, newest.version)
                reloads.append((newest.version, time.time(), nbytes))
                reload_version, reload_step = newest.version, step
            dense, ids, labels = stream.batch(step, args.eval_samples, stream=1)
            out = {"step": step}
            with torch.no_grad(), f.serving() as v:
                for name, model, version in (("follow", follow, v), ("reload", reload, reload_version),
                                             ("static", static, None)):
                    p = torch.sigmoid(model(dense, ids)).numpy()
                    out[name] = {"logloss": logloss(labels.numpy(), p), "auc": auc(labels.numpy(), p),
                                 "version": version}
            results.put(out)
        f.stop()
        created = {v.version: (v.created, v.step) for v in store.versions()}
        results.put({"applied": applied, "reloads": reloads, "created": created, "follower_stats": dict(f.stats),
                     "follower_cpu_s": cpu["s"]})
    finally:
        f.close()
        store.close()


# ---------------------------------------------------------------------------------------------- trainer


def freshness(times: list[tuple[int, float]], created: dict) -> list[float]:
    """Seconds from each version's commit to the first time the serving tensors held it or a newer one."""
    out, held = [], 0
    for version, at in sorted(times, key=lambda x: x[1]):
        for v in range(held + 1, version + 1):
            if v in created:
                out.append(at - created[v][0])
        held = max(held, version)
    return out


def pct(xs, q) -> float:
    return float(np.percentile(xs, q)) if len(xs) else float("nan")


def run(args) -> dict:
    """The whole example; returns the figures (also printed, unless ``args.print_lines`` is False)."""
    torch.set_num_threads(1)
    from cnrstore.torch import Checkpointer  # noqa: PLC0415

    say = print if getattr(args, "print_lines", True) else (lambda *a, **k: None)
    root = tempfile.mkdtemp(prefix="serve_follow-", dir=getattr(args, "tmp", None))
    path = os.path.join(root, "store")
    ctx = mp.get_context("spawn")
    commands, results = ctx.Queue(), ctx.Queue()
    server = ctx.Process(target=serve, args=(vars(args), path, commands, results), daemon=True)
    server.start()
    stream = DriftingStream(args.seed, args.tables, args.rows, args.phase_steps)
    model = build(args)
    opt = torch.optim.Adagrad(model.parameters(), lr=args.lr)
    store = cnrstore.open(path, create=True)
    ckpt = Checkpointer(store, model, opt, codec="fp32", mode="incremental")
    touched: dict[int, int] = {}   # version -> embedding rows touched since the previous save
    since = [set() for _ in range(args.tables)]
    ckpt.save(0, meta={"step": 0}).wait()
    commands.put(("start", store.latest().version))
    evals = []
    say(f"{'step':>6} {'phase':>5} | {'follow: logloss   auc  behind':>29} | {'reload: logloss   auc  behind':>29} | "
        f"{'static: logloss   auc':>21}")
    pending = []
    t0 = time.perf_counter()
    try:
        for step in range(1, args.steps + 1):
            dense, ids, labels = stream.batch(step, args.batch)
            for t in range(args.tables):
                since[t].update(np.unique(ids[:, t].numpy()).tolist())
            opt.zero_grad()
            loss = nn.functional.binary_cross_entropy_with_logits(model(dense, ids), labels)
            loss.backward()
            opt.step()
            if step % args.save_every == 0:
                pending.append(ckpt.save(step, meta={"step": step}))
                touched[step] = sum(len(s) for s in since)
                since = [set() for _ in range(args.tables)]
            if step % args.eval_every == 0:
                for p in pending:
                    p.wait()
                pending = []
                commands.put(("eval", step))
                r = results.get(timeout=300)
                evals.append(r)
                steps_of = {v.version: v.step for v in store.versions()}
                for case in ("follow", "reload"):
                    r[case]["behind"] = step - steps_of.get(r[case]["version"], 0)
                say(f"{step:6d} {step // args.phase_steps:5d} | "
                    + " | ".join(f"{r[c]['logloss']:15.4f} {r[c]['auc']:.3f} {r[c]['behind']:6d}"
                                 for c in ("follow", "reload"))
                    + f" | {r['static']['logloss']:15.4f} {r['static']['auc']:.3f}")
        for p in pending:
            p.wait()
        commands.put(("stop", 0))
        tail = results.get(timeout=300)
        server.join(60)
    finally:
        if server.is_alive():
            server.terminate()
        ckpt.close()
        store.close()
        wall = time.perf_counter() - t0
        shutil.rmtree(root, ignore_errors=True)
    created = {int(k): v for k, v in tail["created"].items()}
    fresh_follow = freshness(tail["applied"], created)
    fresh_reload = freshness([(v, at) for v, at, _ in tail["reloads"]], created)
    fs = tail["follower_stats"]
    infos = {"rows": args.rows, "dim": args.dim}
    full_bytes = [b for *_, b in tail["reloads"]]
    summary = {"settings": {k: getattr(args, k) for k in ("steps", "save_every", "reload_every", "eval_every",
                                                          "phase_steps", "tables", "rows", "dim", "seed", "poll_s")},
               "wall_s": wall, "evals": evals, "cases": {}, "follower_stats": fs,
               "follower_cpu_s": tail["follower_cpu_s"], "table": infos}
    for case in ("follow", "reload", "static"):
        ll = [e[case]["logloss"] for e in evals]
        au = [e[case]["auc"] for e in evals]
        c = {"logloss": float(np.mean(ll)), "auc": float(np.nanmean(au))}
        if case != "static":
            fr = fresh_follow if case == "follow" else fresh_reload
            c.update(behind_mean=float(np.mean([e[case]["behind"] for e in evals])),
                     behind_max=int(max(e[case]["behind"] for e in evals)),
                     fresh_p50=pct(fr, 50), fresh_p99=pct(fr, 99), versions_held=len(fr))
        summary["cases"][case] = c
    summary["cases"]["follow"]["bytes_per_update"] = fs["bytes_read"] / max(fs["updates"], 1)
    summary["cases"]["reload"]["bytes_per_update"] = float(np.mean(full_bytes)) if full_bytes else float("nan")
    summary["touched_rows_per_save"] = float(np.mean(list(touched.values()))) if touched else 0.0
    say("")
    say(f"{'case':<8} {'logloss':>8} {'AUC':>6} {'behind (steps) mean/max':>24} {'fresh p50':>10} {'fresh p99':>10} "
        f"{'bytes/update':>13}")
    for case, c in summary["cases"].items():
        if case == "static":
            say(f"{case:<8} {c['logloss']:8.4f} {c['auc']:6.3f} {'never updated':>24}")
            continue
        say(f"{case:<8} {c['logloss']:8.4f} {c['auc']:6.3f} {c['behind_mean']:17.1f} / {c['behind_max']:<4d} "
            f"{c['fresh_p50'] * 1e3:8.0f}ms {c['fresh_p99'] * 1e3:8.0f}ms {c['bytes_per_update'] / 1024:10.1f}KiB")
    say(f"follower: {fs['updates']} updates, {fs['rows_applied']} rows, {fs['bytes_read'] / 2**20:.1f} MiB read, "
        f"CPU {tail['follower_cpu_s']:.2f} s; trainer touched {summary['touched_rows_per_save']:.0f} rows per save "
        f"(of {args.tables * args.rows}); wall {wall:.1f} s")
    say("RESULT " + json.dumps({k: v for k, v in summary.items() if k != "evals"}))
    return summary


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a small run (< 60 s on 2 cores)")
    p.add_argument("--steps", type=int, default=1200)
    p.add_argument("--save-every", type=int, default=10, help="trainer steps between checkpoints")
    p.add_argument("--reload-every", type=int, default=100, help="trainer steps between full reloads (case b)")
    p.add_argument("--eval-every", type=int, default=25, help="trainer steps between evaluations")
    p.add_argument("--phase-steps", type=int, default=300, help="trainer steps between distribution shifts")
    p.add_argument("--tables", type=int, default=4)
    p.add_argument("--rows", type=int, default=20_000)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--eval-samples", type=int, default=4096)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--poll-s", type=float, default=0.2, help="the follower's polling interval")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tmp", default=None)
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.phase_steps, args.rows = min(args.steps, 400), min(args.phase_steps, 100), min(args.rows, 5000)
    return args


if __name__ == "__main__":
    run(parse())
