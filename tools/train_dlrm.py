#!/usr/bin/env python3
"""A reference DLRM trainer with failure injection, checkpointed by cnrstore (or ``torch.save``).

The model is the DLRM of Naumov et al.: a bottom MLP over 13 dense features, 26 ``nn.EmbeddingBag``
tables (sum pooling, one id per feature per sample) with the Criteo Kaggle cardinalities capped at
``--max-rows``, a dot interaction of every pair of the 27 feature vectors, and a top MLP with a sigmoid
output. The data is synthetic but shaped like Criteo Kaggle: 13 log-normal count features and 26
Zipf-distributed categorical ids (a fixed random permutation per table, so hot rows are spread over
the table), with labels ``Bernoulli(sigmoid(teacher(x)))`` from a fixed random teacher DLRM of the same
architecture, so the task is learnable. Batch ``k`` is a pure function of ``(seed, k)``: the data
loader's position is just the batch index, saved with every checkpoint.

Every ``--ckpt-every`` steps the state is checkpointed; every ``--fail-every`` steps a failure strikes
(after the step's update and before its checkpoint): model, optimizer and loader are thrown away and
rebuilt from a *different* random init, the newest committed version is restored into them and
training resumes from the saved data position (the steps since that checkpoint are replayed). Steps count
from 0, and the save after step ``s`` is ``save(s)``: a restore resumes at ``info.step + 1`` (the README's
idiom), and that is also the number of steps done and the data position. The
store is closed and reopened, as a restarted process would. An in-flight asynchronous save is allowed
to finish first: it stands for a version that committed just before the crash.

The run ends with a table comparing the cnrstore checkpoints against a full blocking ``torch.save`` of
the same state (bytes written, trainer stall, restore time), and the final held-out logloss / AUC
against the same run without failures (and without checkpoints), trained in the same invocation, then says
in words whether the final state equals that run's bit for bit, and how the restore compares. Both restores
are timed as a restarted trainer pays them: each in a new process once the model is built, reading from the
page cache (``--restore-probe-rounds`` processes each, taking turns; the restores after each simulated
failure, inside this process, are in the progress lines only: there torch.load's tensors reuse memory the
process freed, which a restarted process does not have).

The default (``make demo``) runs the lossless default, ``--codec fp32``, first: its final weights and
optimizer state equal the run without failures' bit for bit. Then ``int8``, a choice: fewer bytes per
checkpoint, and resumes from table rows rounded to 8 bits, so the run departs from the one without failures.
A summary of both runs, lossless first, ends the output.

    python tools/train_dlrm.py                    # the default (demo) configuration: fp32, then int8
    python tools/train_dlrm.py --quick            # a smaller, faster configuration
    python tools/train_dlrm.py --backend torch    # checkpoint with torch.save only
    python tools/train_dlrm.py --codec fp32       # lossless only: the same weights as without failures

``--world-size N`` trains on N processes with sharded embeddings instead, checkpointed by
``cnrstore.distributed``, where a failure kills one rank and ``--recovery full|partial|ecrm`` picks how
the job recovers (CPR's partial recovery, with ``--priority mfu|ssu`` priority saves; ECRM's erasure-coded
parity, ``--parity K,R``): see tools/dlrm_dist.py. ``--remote s3://bucket/prefix`` (``--remote-options JSON``)
keeps that job's checkpoints in a bucket, each rank with a node directory of its own and a replaced rank with
an empty one, as on a fresh machine (README, "Multi-node jobs: one bucket").

``--torchrec`` builds the same DLRM from torchrec instead: the 26 tables in one ``EmbeddingBagCollection``
(table ``t<i>`` pools feature ``f<i>``; same cardinalities, dims and initial weights, copied from the plain
model; the same bottom/top MLP modules and interaction), fed the same id batch as a ``KeyedJaggedTensor``
of one id per feature per sample. In one process its tables are ``nn.EmbeddingBag``s that the same
``Checkpointer``, failures and table handle as above (it computes bit for bit what the plain model does).
With ``--world-size N`` the collection is sharded by ``DistributedModelParallel`` (torchrec's planner,
``--sharding row|table``, fused row-wise Adagrad on the tables) and checkpointed by
``DistributedCheckpointer(plan=None)``; ``--recovery ecrm`` is refused (ECRM protects ``nn.Embedding``
shards only). It needs the ``[torchrec-cpu]`` extra (README, "TorchRec").

    python tools/train_dlrm.py --torchrec --quick --codec fp32 --mode incremental
    python tools/train_dlrm.py --torchrec --world-size 2 --quick --recovery partial

``--backend cnrstore`` needs ``cnrstore.torch.Checkpointer``; when it cannot be imported the run falls
back to ``torch.save`` and says so.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

import cnrstore
from dlrm_model import (
    Holdout,
    Progress,
    SyntheticCriteo,
    build_optimizer,
    cardinalities,
    fmt_bytes,
    fmt_ms,
    make_model,
    quiet_torchrec,
)

# ---------------------------------------------------------------------------------------- checkpoints


def full_state(model, optimizer, loader, step: int) -> dict:
    """What ``torch.save`` writes after training step ``step`` (counted from 0)."""
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "loader": loader.state_dict(), "step": step}


def timed_torch_save(state: dict, path: str) -> tuple[float, float, int]:
    """Blocking ``torch.save`` to ``path``: (seconds to return, seconds including fsync, file bytes)."""
    t0 = time.perf_counter()
    with open(path + ".tmp", "wb") as f:
        torch.save(state, f)
        t1 = time.perf_counter()
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)
    t2 = time.perf_counter()
    return t1 - t0, t2 - t0, os.path.getsize(path)


class Position:
    """What the restore probe loads the loader's state into: ``SyntheticCriteo``'s state is its position."""

    def __init__(self):
        self.position = 0

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = state["position"]


def restore_probe(args, kind: str, path: str) -> dict:
    """*In a new process* (``--restore-probe``): build the model, optimizer and loader as a restarted trainer
    does, then time the restore of ``path``: the newest version of a cnrstore store (opening it and the
    ``Checkpointer`` included) or a ``torch.save`` file (``torch.load`` and ``load_state_dict``)."""
    model = make_model(args, args.seed + 999)
    optimizer, loader = build_optimizer(model, args.lr), Position()
    Checkpointer, _why = load_checkpointer()   # (imported at start-up, as a trainer does)
    t0 = time.perf_counter()
    if kind == "cnrstore":
        backend = CnrstoreBackend(path, model, optimizer, loader, args, Checkpointer)
        t1 = time.perf_counter()
        backend.restore()
    else:
        t1 = t0
        state = torch.load(path, weights_only=False)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        loader.load_state_dict(state["loader"])
    t2 = time.perf_counter()
    if kind == "cnrstore":
        backend.close()
    return {"seconds": t2 - t0, "open": t1 - t0}


def restore_in_new_processes(argv: list[str], codec: str, store: str, torch_file: str,
                             rounds: int) -> tuple[float, float, float]:
    """What a restarted trainer pays to restore, each in a fresh process of its own once the model is built:
    (cnrstore's seconds, the part that opened the store and made the Checkpointer, torch.save's seconds), the
    means of ``rounds`` processes each, the two kinds taking turns (a process takes ~2.5 s, most of it importing
    torch). Both read from the page cache (both were just written)."""
    def probe(kind: str, path: str) -> dict:
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), *argv, "--codec", codec, "--no-progress",
                               "--restore-probe", f"{kind}:{path}"], capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"the {kind} restore probe failed:\n{proc.stdout}{proc.stderr}")
        return json.loads(proc.stdout.strip().splitlines()[-1])

    ours, theirs = [], []
    for i in range(rounds):
        for kind in (("cnrstore", "torch") if i % 2 == 0 else ("torch", "cnrstore")):
            if kind == "cnrstore":
                ours.append(probe(kind, store))
            else:
                theirs.append(probe(kind, torch_file))
    mean = (lambda key, xs: float(np.mean([x[key] for x in xs])))  # noqa: E731
    return mean("seconds", ours), mean("open", ours), mean("seconds", theirs)


class TorchSaveBackend:
    """The reference: a full, blocking ``torch.save`` of model + optimizer + loader (fsynced, atomic)."""

    name = "torch.save"

    def __init__(self, root: str, model, optimizer, loader):
        self.root = root
        os.makedirs(root, exist_ok=True)
        self.model, self.optimizer, self.loader = model, optimizer, loader
        self.bytes_written = 0

    def _path(self) -> str:
        return os.path.join(self.root, "latest.pt")

    def save(self, step: int) -> float:
        """Save after training step ``step`` (counted from 0); the trainer's stall in seconds."""
        t0 = time.perf_counter()
        _, _, size = timed_torch_save(full_state(self.model, self.optimizer, self.loader, step), self._path())
        self.bytes_written += size
        return time.perf_counter() - t0

    def restore(self) -> int:
        """Load the newest save; the step to run next (the saved step + 1)."""
        state = torch.load(self._path(), weights_only=False)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.loader.load_state_dict(state["loader"])
        return int(state["step"]) + 1

    def finish(self) -> None:
        pass

    def close(self) -> None:
        pass


class CnrstoreBackend:
    """``cnrstore.torch.Checkpointer``: touched rows only, snapshot then background write."""

    name = "cnrstore"

    def __init__(self, root: str, model, optimizer, loader, args, Checkpointer):
        self.root = root
        self.store = cnrstore.open(root, create=True)
        self.ckpt = Checkpointer(self.store, model, optimizer, codec=args.codec, mode=args.mode,
                                 extra={"loader": loader})
        self.pending = None

    @property
    def bytes_written(self) -> int:
        return int(self.store.stats()["bytes_written"])

    def save(self, step: int) -> float:
        """Save after training step ``step`` (counted from 0); the trainer's stall in seconds."""
        t0 = time.perf_counter()
        self.pending = self.ckpt.save(step, meta={"step": step})
        return time.perf_counter() - t0

    def restore(self) -> int:
        """Load the newest version; the step to run next (README's idiom: ``info.step + 1``)."""
        info = self.ckpt.restore()
        return int(info.step) + 1

    def finish(self) -> None:
        """Wait for the in-flight save (it re-raises a background failure)."""
        if self.pending is not None:
            self.pending.wait()
            self.pending = None

    def close(self) -> None:
        self.finish()
        self.ckpt.close()
        self.store.close()


def torchrec_missing() -> str | None:
    """Why ``--torchrec`` cannot run here (torchrec or fbgemm-gpu missing), or None."""
    try:
        for name in ("fbgemm_gpu", "torchrec"):
            importlib.import_module(name)  # imported, not only found: a broken install shows here
    except ImportError as e:
        return str(e)
    return None


def load_checkpointer():
    """``cnrstore.torch.Checkpointer`` if it can be imported, else None (with the reason)."""
    try:
        from cnrstore.torch import Checkpointer  # noqa: PLC0415
        return Checkpointer, None
    except ImportError as e:
        return None, str(e)


# ------------------------------------------------------------------------------------------- training


@dataclass
class RunResult:
    label: str
    wall_s: float = 0.0
    steps_executed: int = 0
    failures: int = 0
    checkpoints: int = 0
    stalls: list[float] = field(default_factory=list)
    restores: list[float] = field(default_factory=list)
    bytes_written: int = 0
    curve: list[tuple[int, float, float]] = field(default_factory=list)
    final: tuple[float, float] = (float("nan"), float("nan"))
    torch_save: list[tuple[float, float, int]] = field(default_factory=list)   # (stall, durable, bytes)
    torch_file: str | None = None   # torch.save of the newest version's state (a cnrstore run's reference)
    probe_s: float = 0.0   # time spent measuring torch.save beside the run (left out of wall_s)
    #: (ours, opening the store, torch.save's): a restore in a new process (cnrstore runs; main() fills it)
    new_process_restore: tuple[float, float, float] | None = None
    model: nn.Module | None = None
    optimizer: torch.optim.Optimizer | None = None


def train(args, holdout: Holdout, *, label: str, checkpoint: bool, fail_every: int,
          backend_name: str, Checkpointer, store_root: str | None) -> RunResult:
    """Train ``args.steps`` steps; checkpoint and inject failures as asked. Returns the measurements."""
    res = RunResult(label)
    restarts = 0

    def fresh():
        # A restarted process builds its model again; a different init seed makes any state the
        # restore misses show up in the final metrics instead of hiding behind an identical init.
        model = make_model(args, args.seed + 1000 * restarts)
        return model, build_optimizer(model, args.lr), SyntheticCriteo(args)

    def open_backend(model, optimizer, loader):
        if not checkpoint:
            return None
        if backend_name == "cnrstore":
            return CnrstoreBackend(store_root, model, optimizer, loader, args, Checkpointer)
        return TorchSaveBackend(store_root, model, optimizer, loader)

    model, optimizer, loader = fresh()
    backend = open_backend(model, optimizer, loader)
    loss_fn = nn.BCEWithLogitsLoss()
    prog = Progress(args.steps, label, enabled=not args.no_progress)
    eval_every = max(1, args.steps // 4)
    res.curve.append((0, *holdout.evaluate(model)))
    bytes_before_restart = 0
    torch_probe_at = {args.ckpt_every, (args.steps // args.ckpt_every) * args.ckpt_every}
    t_start = time.perf_counter()
    ema = None
    step = 0   # the steps done (steps count from 0: this is also the next step's index and the data position)
    failed_at: set[int] = set()
    while step < args.steps:
        dense, ids, labels = loader.next()
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(dense, ids), labels)
        loss.backward()
        optimizer.step()
        step += 1
        res.steps_executed += 1
        lv = float(loss.detach())
        ema = lv if ema is None else 0.98 * ema + 0.02 * lv
        prog.update(step, ema)

        if checkpoint and fail_every and step % fail_every == 0 and step < args.steps \
                and step not in failed_at:
            # A failure strikes after this step's update, before its checkpoint; once per multiple of
            # K (the replayed steps after a restore do not fail again).
            failed_at.add(step)
            res.failures += 1
            restarts += 1
            backend.close()                                   # a save in flight commits, as said above
            bytes_before_restart += backend.bytes_written if backend.name == "torch.save" else 0
            del model, optimizer, loader, backend
            model, optimizer, loader = fresh()
            t0 = time.perf_counter()
            backend = open_backend(model, optimizer, loader)
            step = backend.restore()                          # the step to run next: steps 0..step-1 done
            res.restores.append(time.perf_counter() - t0)
            prog.message(f"  failure #{res.failures}: restored the save after step {step - 1} in "
                         f"{res.restores[-1]:.3f}s; resuming at step {step}, data position {loader.position}")
            continue

        if checkpoint and step % args.ckpt_every == 0:
            res.stalls.append(backend.save(step - 1))          # after step step-1: steps count from 0
            res.checkpoints += 1
            if backend.name == "cnrstore" and step in torch_probe_at:
                # The reference on the same state: a full blocking torch.save (timed and sized). The last
                # checkpoint's file is kept: it holds the newest version's state, for main()'s restore probe.
                t0 = time.perf_counter()
                res.torch_file = os.path.join(args.probe_dir, f"{label}-{args.codec}.pt")
                res.torch_save.append(timed_torch_save(full_state(model, optimizer, loader, step - 1),
                                                       res.torch_file))
                res.probe_s += time.perf_counter() - t0

        if step % eval_every == 0 and step < args.steps and step not in {c[0] for c in res.curve}:
            res.curve.append((step, *holdout.evaluate(model)))
            prog.message(f"  {label} step {step}: holdout logloss {res.curve[-1][1]:.4f} "
                         f"AUC {res.curve[-1][2]:.4f}")
    if backend is not None:
        backend.finish()
    res.wall_s = time.perf_counter() - t_start - res.probe_s
    prog.update(args.steps, ema if ema is not None else float("nan"), force=True)
    prog.close()
    res.final = holdout.evaluate(model)
    res.curve.append((args.steps, *res.final))
    if backend is not None:
        if backend.name == "torch.save":
            res.bytes_written = bytes_before_restart + backend.bytes_written
        else:
            res.bytes_written = backend.bytes_written
        backend.close()
    res.model, res.optimizer = model, optimizer
    return res


# -------------------------------------------------------------------------------------------- summary


def compare_states(run: RunResult, base: RunResult) -> tuple[bool, float]:
    """Whether the final model and optimizer state of ``run`` equal ``base``'s bit for bit, and the largest
    absolute difference of the model's state (its weights)."""
    pairs = list(zip(run.model.state_dict().values(), base.model.state_dict().values()))
    diff = max(float((p - q).abs().max()) for p, q in pairs)
    opt_a, opt_b = run.optimizer.state_dict()["state"], base.optimizer.state_dict()["state"]
    same = all(torch.equal(p, q) for p, q in pairs) and opt_a.keys() == opt_b.keys()
    for k in opt_a:
        for name, v in opt_a[k].items():
            w = opt_b[k].get(name)
            same = same and (torch.equal(v, w) if torch.is_tensor(v) and torch.is_tensor(w) else v == w)
    return same, diff


def summary(args, backend_name: str, run: RunResult, base: RunResult | None, torch_bytes: int,
            torch_stall: float, torch_durable: float) -> str:
    rows: list[tuple[str, str, str]] = []
    ours = "cnrstore" if backend_name == "cnrstore" else "torch.save"
    n = max(run.checkpoints, 1)
    per_ckpt = run.bytes_written / n
    rows.append(("checkpoints written / failures", f"{run.checkpoints} / {run.failures}", ""))
    rows.append(("bytes written, all checkpoints", fmt_bytes(run.bytes_written),
                 fmt_bytes(torch_bytes * run.checkpoints)))
    rows.append(("bytes written per checkpoint", fmt_bytes(per_ckpt),
                 f"{fmt_bytes(torch_bytes)}  ({per_ckpt / torch_bytes:.1%} of it)" if torch_bytes else ""))
    if run.stalls:
        rows.append(("trainer stall per ckpt, mean", fmt_ms(float(np.mean(run.stalls))),
                     f"{fmt_ms(torch_stall)} (+fsync {fmt_ms(torch_durable)})"))
        rows.append(("trainer stall per ckpt, max", fmt_ms(float(np.max(run.stalls))), ""))
    if run.new_process_restore is not None:   # cnrstore: both restores in a new process, as after a failure
        ours_s, open_s, torch_s = run.new_process_restore
        rows.append(("restore time, in a new process", f"{fmt_ms(ours_s)} (open {fmt_ms(open_s)})",
                     f"{fmt_ms(torch_s)} (torch.load + load_state_dict: {compared(ours_s, torch_s)})"))
    elif run.restores:
        mean = fmt_ms(float(np.mean(run.restores)))
        rows.append(("restore time, mean", mean, mean if backend_name != "cnrstore" else ""))
    rows.append(("steps executed (replayed)", f"{run.steps_executed} ({run.steps_executed - args.steps})",
                 f"{args.steps} (no failures)"))
    ll, a = run.final
    if base is not None:
        bll, ba = base.final
        rows.append(("final holdout logloss", f"{ll:.5f}", f"{bll:.5f} (no failures)"))
        rows.append(("final holdout AUC", f"{a:.5f}", f"{ba:.5f} (no failures)"))
        same, diff = compare_states(run, base)
        rows.append(("max |weight diff| vs no failures", f"{diff:.3g}", "bit for bit the same" if same else ""))
        rows.append(("training wall time", f"{run.wall_s:.1f} s", f"{base.wall_s:.1f} s (no ckpt)"))
    else:
        rows.append(("final holdout logloss / AUC", f"{ll:.5f} / {a:.5f}", ""))
        rows.append(("training wall time", f"{run.wall_s:.1f} s", ""))
    start_ll, start_auc = run.curve[0][1], run.curve[0][2]
    rows.append(("holdout logloss / AUC at step 0", f"{start_ll:.5f} / {start_auc:.5f}", ""))

    head = (f"{ours}" + (f" (codec {args.codec}, mode {args.mode})" if backend_name == "cnrstore" else ""),
            "full blocking torch.save")
    w0 = max(len(r[0]) for r in rows) + 2
    w1 = max(max(len(r[1]) for r in rows), len(head[0])) + 2
    lines = [f"{'':<{w0}}{head[0]:<{w1}}{head[1]}", "-" * (w0 + w1 + 34)]
    lines += [f"{r[0]:<{w0}}{r[1]:<{w1}}{r[2]}" for r in rows]
    return "\n".join(lines)


def compared(ours: float, theirs: float) -> str:
    """cnrstore's time against the reference's, in words: slower, faster or about the same (within 10%)."""
    ratio = ours / theirs
    if ratio > 1.1:
        return f"cnrstore {ratio:.1f}x SLOWER"
    if ratio < 1 / 1.1:
        return f"cnrstore {1 / ratio:.1f}x faster"
    return "about the same"


def restore_note(run: RunResult) -> str:
    """What the table's restore row says, in words, slower or not."""
    if run.new_process_restore is None:
        return ""
    ours, opened, theirs = run.new_process_restore
    how = (f"({fmt_ms(ours)} against {fmt_ms(theirs)}: each in a new process once the model is built, as after a "
           "real failure, from the page cache)")
    ratio = ours / theirs
    if ratio > 1.1:
        return (f"The restore is {ratio:.1f}x SLOWER than torch.load's of the same state here {how}. Opening the "
                f"store and making the Checkpointer takes {fmt_ms(opened)}; the rest plans the reads of the version's "
                "records from the index (a baseline and the increments since), checks each record's checksum, "
                "decodes it into the model's tensors and reads the trainer payload as data "
                "(torch.load(weights_only=True)). That work per record and per table weighs more than the bytes at "
                "this size; at 1 GiB of state the restore is faster than torch.load (benchmarks/RESULTS.md, "
                "\"Restore into a live model\").")
    if ratio < 1 / 1.1:
        return f"The restore is {1 / ratio:.1f}x faster than torch.load's of the same state here {how}."
    return f"The restore takes about as long as torch.load's of the same state here {how}."


def verdict(run: RunResult, base: RunResult | None, codec: str, lossless: RunResult | None) -> list[str]:
    """What the run shows, in words: exact or not against the run without failures (``base``); for a lossy
    codec, what it saved against ``lossless`` (the fp32 run, if there was one)."""
    out = []
    if base is not None:
        same, diff = compare_states(run, base)
        n = run.failures
        if same:
            out.append(f"{codec}: after {n} failure{'s' * (n != 1)} and restores, the final weights and optimizer "
                       "state are bit for bit those of the run without failures (so are its logloss and AUC): "
                       "every restore resumed exactly where its save left off.")
        else:
            ll, bll = run.final[0], base.final[0]
            lossy = not cnrstore.codecs.get(codec).lossless
            why = (f"each restore resumed from table rows as {codec} stores them (rounded), so the run departs "
                   "from the one without failures" if lossy else "NOT the same as the run without failures")
            out.append(f"{codec}: {why}: max |weight diff| {diff:.3g}, final holdout logloss {ll:.5f} against "
                       f"{bll:.5f} ({(ll - bll) / bll:+.3%}).")
    if lossless is not None and lossless is not run and lossless.checkpoints and run.checkpoints:
        a, b = run.bytes_written / run.checkpoints, lossless.bytes_written / lossless.checkpoints
        out.append(f"It wrote {fmt_bytes(a)} per checkpoint against fp32's {fmt_bytes(b)} ({a / b - 1:+.0%}: only the "
                   "tables are quantized; their Adagrad state stays fp32, optimizer_codec's default). A choice, for "
                   "when bytes matter more than exact resumes: README, \"Choosing a codec, mode and optimizer codec\".")
    note = restore_note(run)
    if note:
        out.append(note)
    return out


def in_short(args, runs: list[tuple[str, RunResult]], base: RunResult | None,
             torch_ref: list[tuple[float, float, int]]) -> str:
    """The runs side by side, lossless first as they ran, and the torch.save reference."""
    mean = (lambda xs: float(np.mean(xs)) if xs else float("nan"))  # noqa: E731
    failures = sorted({r.failures for _c, r in runs})
    head = ("", "per checkpoint", "stall, mean", "restore", "final state vs the run without failures")
    rows = []
    for codec, r in runs:
        final = ""
        if base is not None:
            same, diff = compare_states(r, base)
            final = ("bit for bit the same" if same else
                     f"max |weight diff| {diff:.3g}, logloss {(r.final[0] - base.final[0]) / base.final[0]:+.3%}")
        label = f"{codec} (the default)" if codec == "fp32" else codec
        restore = r.new_process_restore[0] if r.new_process_restore is not None else float("nan")
        rows.append((label, fmt_bytes(r.bytes_written / max(r.checkpoints, 1)), fmt_ms(mean(r.stalls)),
                     fmt_ms(restore), final))
    loads = [r.new_process_restore[2] for _c, r in runs if r.new_process_restore is not None]
    rows.append(("full torch.save", fmt_bytes(torch_ref[-1][2]) if torch_ref else "n/a",
                 fmt_ms(mean([t[0] for t in torch_ref])), fmt_ms(mean(loads)), "(blocking; the reference)"))
    widths = [max(len(row[i]) for row in [head, *rows]) + 2 for i in range(4)]
    lines = [f"In short: {args.steps} steps, a checkpoint every {args.ckpt_every}, "
             f"{'/'.join(map(str, failures))} failures in each run"]
    lines += ["".join(f"{c:<{w}}" for c, w in zip(row[:4], widths)) + row[4] for row in [head, *rows]]
    return "\n".join(lines)


def wrap(text: str, width: int = 110) -> str:
    return "\n".join(textwrap.wrap(text, width))


# ----------------------------------------------------------------------------------------------- main


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except the ``None`` ones that ``--quick`` resolves (their help states both)."""

    def _get_help_string(self, action):
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=_HelpFormatter)
    p.add_argument("--steps", type=int, default=None, help="training steps (default 800; --quick 200)")
    p.add_argument("--batch-size", type=int, default=512, help="samples per training step")
    p.add_argument("--max-rows", type=int, default=None,
                   help="cap on each table's Criteo Kaggle cardinality (default 50000; --quick 10000)")
    p.add_argument("--dim", type=int, default=16, help="embedding dimension")
    p.add_argument("--lr", type=float, default=0.05, help="Adagrad learning rate")
    p.add_argument("--ckpt-every", type=int, default=None, help="checkpoint every N steps (default 50; --quick 25)")
    p.add_argument("--fail-every", type=int, default=None,
                   help="simulate a failure every K steps, 0 for none (default 170; --quick 70)")
    p.add_argument("--backend", choices=("cnrstore", "torch"), default="cnrstore",
                   help="checkpoint backend; cnrstore falls back to torch.save if its Checkpointer is missing")
    p.add_argument("--codec", default="fp32,int8",
                   help="embedding codec (cnrstore backend); several, comma-separated, run one after the other "
                        "against the same reference (default: lossless fp32, then quantized int8)")
    p.add_argument("--mode", default="incremental", choices=("incremental", "one-shot", "intermittent"),
                   help="cnrstore checkpoint mode")
    p.add_argument("--store", default=None, help="checkpoint directory, new or empty (default: a temp dir, removed)")
    p.add_argument("--seed", type=int, default=0, help="seeds the data, the teacher and the model init")
    p.add_argument("--holdout-batches", type=int, default=8, help="held-out batches of 4096 samples")
    p.add_argument("--compare", action=argparse.BooleanOptionalAction, default=True,
                   help="also train the same run without failures or checkpoints, for the final metrics")
    p.add_argument("--quick", action="store_true", help="a smaller configuration (tests, smoke runs)")
    p.add_argument("--no-progress", action="store_true", help="no progress output")
    p.add_argument("--restore-probe-rounds", type=int, default=2,
                   help="after each cnrstore run, time its restore and torch.save's of the same state, each in new "
                        "processes (as after a real failure), this many times each (about 2.5 s a process); 0: not")
    p.add_argument("--restore-probe", default=None, help=argparse.SUPPRESS)   # KIND:PATH, in such a process
    p.add_argument("--torchrec", action="store_true",
                   help="the same DLRM (same init) with its tables in a torchrec EmbeddingBagCollection fed a "
                        "KeyedJaggedTensor, checkpointed as above; with --world-size, sharded by "
                        "DistributedModelParallel (--sharding row|table, fused row-wise Adagrad for the tables, each "
                        "rank a slice of the batch), checkpointed by DistributedCheckpointer(plan=None), --recovery "
                        "full or partial (not ecrm: it protects nn.Embedding shards only). Needs the [torchrec-cpu] extra")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (0: torch's default); 1 leaves a core to the background writer "
                        "and avoids thread oversubscription on small machines")
    d = p.add_argument_group("multi-rank training (tools/dlrm_dist.py)")
    d.add_argument("--world-size", type=int, default=None,
                   help="train on N processes (gloo) with sharded embeddings, checkpointed by "
                        "cnrstore.distributed; a failure kills one rank (default: one process, as above). "
                        "Shorter defaults: --steps 240 (--quick 120), --max-rows 20000 (--quick 5000), "
                        "--batch-size 256, --ckpt-every 20, --fail-every 70 (--quick 50)")
    d.add_argument("--sharding", choices=("row", "table"), default="row", help="embedding sharding plan")
    d.add_argument("--recovery", choices=("full", "partial", "ecrm"), default="partial",
                   help="after a rank fails: every rank restores the newest global version (full), only "
                        "the replaced rank restores its shards (partial, CPR), or the replaced rank decodes "
                        "its shards from the parity the others hold (ecrm: no update lost, no checkpoint read)")
    d.add_argument("--parity", default=None, metavar="K,R",
                   help="ECRM stripes: K data and R parity units, K + R <= world size (default: world size - 1, 1)")
    d.add_argument("--fail-rank", type=int, default=None, help="the rank each failure kills (default: round-robin)")
    d.add_argument("--priority", choices=("mfu", "ssu"), default=None,
                   help="CPR priority saves of the most updated rows between regular checkpoints (partial recovery)")
    d.add_argument("--priority-every", type=int, default=None,
                   help="steps between priority saves (default: --ckpt-every / 4)")
    d.add_argument("--priority-top", type=float, default=0.05,
                   help="fraction of each table's rows a priority save writes (the most updated touched ones)")
    d.add_argument("--remote", default=None, metavar="URL",
                   help="keep the checkpoints in this bucket prefix (s3://bucket/prefix, any fsspec URL): each rank "
                        "a node directory of its own under --store (or the run's temp dir), a replaced rank an "
                        "empty one, as a fresh machine (DistributedCheckpointer(remote=))")
    d.add_argument("--remote-options", default=None, metavar="JSON",
                   help="the object store client's options, e.g. '{\"client_kwargs\": {\"endpoint_url\": ...}}'")
    d.add_argument("--job-timeout", type=float, default=600.0, help="seconds before the launcher gives up on a job")
    d.add_argument("--pg-timeout", type=float, default=60.0,
                   help="seconds a collective may wait for a peer (gloo's timeout); recovery never waits it out: "
                        "the launcher posts each failure on a failure board and the survivors leave at once")
    args = p.parse_args(argv)
    defaults = dict(steps=(200, 800), max_rows=(10_000, 50_000), ckpt_every=(25, 50), fail_every=(70, 170))
    if args.world_size is not None:
        defaults = dict(steps=(120, 240), max_rows=(5_000, 20_000), ckpt_every=(20, 20), fail_every=(50, 70))
        if "--batch-size" not in (argv if argv is not None else sys.argv[1:]):
            args.batch_size = 256
    for k, (quick, full) in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, quick if args.quick else full)
    if args.priority_every is None:
        args.priority_every = max(1, args.ckpt_every // 4)
    if args.restore_probe_rounds < 0:
        p.error("--restore-probe-rounds must be >= 0")
    if args.steps <= 0 or args.batch_size <= 0 or args.max_rows <= 0 or args.dim <= 0 or args.ckpt_every <= 0:
        p.error("--steps, --batch-size, --max-rows, --dim and --ckpt-every must be positive")
    if args.fail_every < 0:
        p.error("--fail-every must be >= 0")
    if (args.remote or args.remote_options) and args.world_size is None:
        p.error("--remote and --remote-options are for multi-rank runs: add --world-size N")
    if args.remote_options and not args.remote:
        p.error("--remote-options needs --remote URL")
    if args.fail_every and args.fail_every <= args.ckpt_every:
        # A failure strikes before its step's checkpoint: the first one needs an earlier version.
        p.error("--fail-every must be greater than --ckpt-every (else no checkpoint exists to restore)")
    return args


def main(argv=None) -> int:
    argv_list = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.restore_probe:   # (a child of restore_in_new_processes)
        if args.torchrec:
            quiet_torchrec()
        torch.set_num_threads(args.threads or torch.get_num_threads())
        kind, _, path = args.restore_probe.partition(":")
        print(json.dumps(restore_probe(args, kind, path)))
        return 0
    if args.torchrec:
        quiet_torchrec()
        problem = torchrec_missing()
        if problem:
            print(f"error: --torchrec needs torchrec and fbgemm-gpu ({problem}): pip install 'cnrstore[torchrec-cpu]' "
                  "then pip install --no-deps torchrec==1.8.0 (README, 'Install')",
                  file=sys.stderr)
            return 2
    codecs_ = [c.strip() for c in args.codec.split(",") if c.strip()]
    if args.world_size is not None:
        if len(codecs_) != 1:
            args.codec = codecs_[0]  # (one codec per multi-rank run)
        import dlrm_dist  # noqa: PLC0415 (tools/, beside this file)
        return dlrm_dist.run(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    backend_name = args.backend
    Checkpointer = None
    if backend_name == "cnrstore":
        Checkpointer, why = load_checkpointer()
        if Checkpointer is None:
            print(f"note: cnrstore.torch.Checkpointer is not available ({why}); "
                  "falling back to torch.save checkpoints", file=sys.stderr)
            backend_name = "torch"
        else:
            unknown = [c for c in codecs_ if c not in cnrstore.codecs.names()]
            if unknown or not codecs_:
                print(f"error: unknown codec {unknown or args.codec!r}; one of {', '.join(cnrstore.codecs.names())}",
                      file=sys.stderr)
                return 2
    if backend_name != "cnrstore":
        codecs_ = codecs_[:1]

    tmp = tempfile.mkdtemp(prefix="train_dlrm-")
    try:
        if args.store:
            if os.path.exists(args.store) and os.listdir(args.store):
                print(f"error: --store {args.store} is not empty; give a new or empty directory",
                      file=sys.stderr)
                return 2
            store_root = args.store
        else:
            store_root = os.path.join(tmp, "store")
        args.probe_dir = tmp
        t_all = time.perf_counter()
        args.codec = codecs_[0]
        card = cardinalities(args)
        tables = "a torchrec EmbeddingBagCollection of 26 tables" if args.torchrec else "26 EmbeddingBags"
        print(f"DLRM: {tables}, {sum(card):,} rows x dim {args.dim}, bottom 13-64-32-{args.dim}, "
              f"top 64-32-1; {args.steps} steps x batch {args.batch_size}; checkpoint every "
              f"{args.ckpt_every}, failure every {args.fail_every or 'never'}; backend "
              f"{'cnrstore Checkpointer' if backend_name == 'cnrstore' else 'torch.save'}"
              + (f" (codec {', then '.join(codecs_)}, mode {args.mode})" if backend_name == "cnrstore" else ""))
        holdout = Holdout(args, args.holdout_batches)
        print(f"held-out set: {holdout.labels.size} samples, positive rate {holdout.labels.mean():.3f}, "
              f"teacher (Bayes-optimal) logloss {holdout.ceiling[0]:.4f} AUC {holdout.ceiling[1]:.4f}")
        base = None
        if args.compare:
            base = train(args, holdout, label="no failures", checkpoint=False, fail_every=0,
                         backend_name=backend_name, Checkpointer=None, store_root=None)
        runs: list[tuple[str, RunResult]] = []
        torch_ref: list[tuple[float, float, int]] = []   # the reference saves of every run
        for i, codec in enumerate(codecs_):
            args.codec = codec
            if len(codecs_) > 1:
                what = (("(lossless): the default" if codec == "fp32" else "(lossless)")
                        if cnrstore.codecs.get(codec).lossless else
                        "(quantized): a choice, fewer bytes and approximate resumes")
                print(f"\n=== {i + 1}. codec {codec} {what} ===")
            run = train(args, holdout, label="with failures" if args.fail_every else "checkpointed",
                        checkpoint=True, fail_every=args.fail_every, backend_name=backend_name,
                        Checkpointer=Checkpointer, store_root=store_root if len(codecs_) == 1 else
                        f"{store_root}-{codec}")
            # The reference numbers: a full blocking torch.save of the same state.
            if backend_name == "cnrstore" and run.torch_save:
                torch_stall = float(np.mean([t[0] for t in run.torch_save]))
                torch_durable = float(np.mean([t[1] for t in run.torch_save]))
                torch_bytes = run.torch_save[-1][2]
                torch_ref += run.torch_save
            else:
                torch_stall = float(np.mean(run.stalls)) if run.stalls else float("nan")
                torch_durable = torch_stall
                torch_bytes = run.bytes_written // max(run.checkpoints, 1)
            if backend_name == "cnrstore" and args.restore_probe_rounds > 0 and run.torch_file:
                run.new_process_restore = restore_in_new_processes(
                    argv_list, codec, store_root if len(codecs_) == 1 else f"{store_root}-{codec}", run.torch_file,
                    args.restore_probe_rounds)
            print()
            print("holdout logloss / AUC during training (" + run.label + "): " +
                  ", ".join(f"step {s}: {ll:.4f}/{a:.4f}" for s, ll, a in run.curve))
            print()
            print(summary(args, backend_name, run, base, torch_bytes, torch_stall, torch_durable))
            if backend_name == "cnrstore":
                lossless = next((r for c, r in runs if cnrstore.codecs.get(c).lossless), None)
                notes = verdict(run, base, codec, None if cnrstore.codecs.get(codec).lossless else lossless)
                if notes:
                    print("\n" + "\n\n".join(wrap(t) for t in notes))
            runs.append((codec, run))
        if backend_name == "cnrstore" and len(runs) > 1:
            print("\n" + in_short(args, runs, base, torch_ref))
        print(f"\ntotal run time {time.perf_counter() - t_all:.1f} s")
        return 0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
