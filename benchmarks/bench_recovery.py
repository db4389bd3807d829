#!/usr/bin/env python3
"""Recovery under torchft: from a SIGKILL to the replacement's first step, split into phases, beside a DCP
full restart measured in the same run; and a 1 GiB shard's ``recv_checkpoint`` against a local ``restore()``.

1. **Partial recovery** (tools/torchft_job.py, tools/torchft_replica.py, ``tables="own"``): 3 replica groups
   of one process each under torchft's lighthouse, a DLRM split across them (group r owns table r; pooled
   embeddings and their gradients exchanged by allreduce; the dense layer averaged). One group SIGKILLs
   itself after a step; the scheduler (the launcher) starts it again; it heals through
   ``TorchftTransport(tables="own")``: its table from its own store's newest save (CPR), the rest from a peer.
   The other two keep their processes and wait in torchft's quorum. The same job again with ECRM
   (``ECRM(k=2, r=1)`` over a gloo group of its own; the replacement heals with ``tables="keep"``, then every
   group calls ``ECRM.recover``: its shard decoded from the parity, no update lost). Phases of the replacement, from its
   events: detect and respawn (the launcher seeing the exit, starting the process), interpreter start,
   imports (torch, torchft, cnrstore), start-up (model, Checkpointer, transport, torchft Manager), quorum and
   heal (of it: cnrstore's ``recv_checkpoint``), first step. "In cnrstore": cnrstore's imports, its
   Checkpointer and transport, and the heal.
2. **Full restart** (what torchrun does on a failure): the same job saving with torch.distributed.checkpoint
   (``dcp.save``, no process group, each group its own directory); at the kill every group is ended and all
   are started again, each ``dcp.load``s its newest save and every group rolls back to it. Measured: kill to
   the last group's first step, and the steps rolled back.
3. **A 1 GiB shard over the transport** (in one process): a table and its Adagrad state (512 MiB each)
   saved, 20 steps of 4096 lookups changed since; ``recv_checkpoint`` (the rows from the store at the save's
   version, the changed rows from the peer) against ``Checkpointer.restore()`` of the same version, 3 times
   each.

    python benchmarks/bench_recovery.py --quick      # one run of each, a 256 MiB shard
    python benchmarks/bench_recovery.py --repeats 3 --out /tmp/recovery.md
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tools"))
from common import load_average, machine_description, publish  # noqa: E402

import torchft_job  # noqa: E402

PHASES = ("detect and respawn", "interpreter", "import torch", "import torchft", "import cnrstore", "start-up",
          "quorum and heal", "ECRM decode", "first step")


def _only(events, **match):
    return [e for e in events if all(e.get(k) == v for k, v in match.items())]


def partial(tmp: str, args, ecrm: bool = False) -> dict:
    """One partial recovery: CPR (``TorchftTransport(tables="own")``) or, with ``ecrm``, ECRM's decode after a
    heal with ``tables="keep"`` (then "quorum and heal" ends at the heal and "ECRM decode" is the
    collective recovery that follows, re-formed group included)."""
    job = torchft_job.run(tmp, tables="own", replicas=3, steps=args.steps, kill=1, kill_at=args.kill_at,
                          rows=args.rows, save_every=args.save_every, step_sleep=args.step_sleep, ecrm=ecrm)
    ev = job["events"]
    (kill,) = _only(ev[1], ev="kill")
    pids = [e["pid"] for e in _only(ev[1], ev="start")]
    new = [e for e in ev[1] if e["pid"] == pids[-1]]
    (start,) = _only(new, ev="start")
    (healed,) = _only(new, ev="healed")
    decoded = _only(new, ev="ecrm")
    first = _only(new, ev="commit")[0]
    spawn = job["spawned"][1][-1]
    marks = [kill["t"], spawn, start["t0"], start["torch"], start["torchft"], start["imported"], start["t"],
             healed["t"], decoded[0]["t"] if decoded else healed["t"], first["t"]]
    phases = {name: b - a for name, a, b in zip(PHASES, marks, marks[1:])}
    survivors = [p for r in (0, 2) for p in {e["pid"] for e in _only(ev[r], ev="start")}]
    resumed = min(e["t"] for r in (0, 2) for e in _only(ev[r], ev="commit") if e["step"] == kill["step"] + 1)
    # (cnrstore's part of ECRM's recovery: its constructor and recover(); torch's init_process_group before
    # them is group formation, as torchft's quorum is)
    recover = healed["seconds"] + (decoded[0]["construct_s"] + decoded[0]["recover_s"] if decoded else 0.0)
    return {"total": first["t"] - kill["t"], "phases": phases, "recv": healed["seconds"],
            "decode": decoded[0]["construct_s"] + decoded[0]["recover_s"] if decoded else None,
            "group": decoded[0]["group_s"] if decoded else None, "ecrm_phases": decoded[0]["phases"] if decoded else None,
            "in_cnrstore": phases["import cnrstore"] + start["checkpointer_s"] + recover,
            "checkpointer": start["checkpointer_s"],
            "lost": 0 if ecrm else healed["step"] - 1 - healed["version_step"],
            "survivor_pids": len(survivors), "job_stalled": resumed - kill["t"], "step": healed["step"]}


def full_restart(tmp: str, args) -> dict:
    job = torchft_job.run(tmp, tables="own", replicas=3, steps=args.steps, kill=1, kill_at=args.kill_at,
                          rows=args.rows, save_every=args.save_every, step_sleep=args.step_sleep, ckpt="dcp",
                          restart="all")
    ev = job["events"]
    (kill,) = _only(ev[1], ev="kill")
    firsts, loaded = [], []
    for r in range(3):
        pid = [e["pid"] for e in _only(ev[r], ev="start")][-1]
        (start,) = _only(ev[r], ev="start", pid=pid)
        loaded.append(start["dcp_loaded"])
        firsts.append(_only(ev[r], ev="commit", pid=pid)[0]["t"])
    return {"total": max(firsts) - kill["t"], "rolled_back": kill["step"] - min(loaded),
            "load": max(e["dcp_load_s"] for r in range(3) for e in _only(ev[r], ev="start") if e.get("dcp_load_s"))}


def transfer(tmp: str, args) -> dict:
    """recv_checkpoint of a shard of ``args.shard_mib`` (table + Adagrad state) against a local restore()."""
    import torch  # noqa: PLC0415
    from torch import nn  # noqa: PLC0415

    from cnrstore.distributed import TorchftTransport  # noqa: PLC0415
    from cnrstore.torch import Checkpointer  # noqa: PLC0415

    rows = args.shard_mib * 2**20 // 2 // (64 * 4)
    made = []
    for name in ("source", "healer"):
        torch.manual_seed(len(made))
        emb = nn.Embedding(rows, 64)
        opt = torch.optim.Adagrad(emb.parameters(), lr=0.05)
        made.append((emb, opt, Checkpointer(os.path.join(tmp, name), emb, opt)))
    (emb, opt, ckpt), (h_emb, h_opt, h_ckpt) = made
    g = torch.Generator().manual_seed(0)

    def train(steps: int) -> None:
        for _ in range(steps):
            opt.zero_grad()
            emb(torch.randint(rows, (4096,), generator=g)).square().sum().backward()
            opt.step()

    train(1)  # every row's Adagrad state exists from here
    with torch.no_grad():
        opt.state[emb.weight]["sum"].add_(torch.rand(rows, 64, generator=g))
    version = ckpt.save(0).wait()
    train(args.changed_steps)
    state = {"user": {"default": {"model": emb.state_dict(), "optim": opt.state_dict()}}, "torchft": {"step": 1}}
    send, recv = (TorchftTransport(ckpt, host="127.0.0.1"), TorchftTransport(h_ckpt, host="127.0.0.1"))
    recv_s, restore_s, send_s = [], [], []
    expected = emb.weight.detach().clone()
    for i in range(args.repeats):
        t = time.perf_counter()
        send.send_checkpoint([1], 1 + i, state, timedelta(seconds=600))
        send_s.append(time.perf_counter() - t)
        t = time.perf_counter()
        got = recv.recv_checkpoint(0, send.metadata(), 1 + i, timedelta(seconds=600))
        recv_s.append(time.perf_counter() - t)
        assert torch.equal(got["user"]["default"]["model"]["weight"], expected)
        report = recv.last_recv
        del got
    send.shutdown()
    recv.shutdown()
    ckpt.close()
    h_ckpt.close()
    del expected, state, emb, opt
    # the reference: a local restore() of the same version, into the healer's live tensors
    with Checkpointer(os.path.join(tmp, "source"), h_emb, h_opt) as local:
        for _ in range(args.repeats):
            t = time.perf_counter()
            local.restore(version)
            restore_s.append(time.perf_counter() - t)
    return {"rows": rows, "recv": recv_s, "restore": restore_s, "send": send_s, "bytes": report.bytes,
            "changed": report.rows.get("embedding", 0), "read": report.read_seconds, "fetch": report.fetch_seconds}


def render(args, parts: list, ecrms: list, fulls: list, shard: dict, load: str, wall: float) -> str:
    med = statistics.median
    lines = ["# Recovery under torchft: kill to the replacement's first step", ""]
    lines += machine_description()
    lines += [f"- load average at start: {load}; wall {wall:.0f} s; {len(parts)} run(s) of each",
              f"- job: 3 replica groups, one process each; table rows {args.rows:,} x 16 per group; save every "
              f"{args.save_every} steps; group 1 SIGKILLs itself after step {args.kill_at}", "",
              "| phase of the replacement | CPR: median s | runs | ECRM: median s | runs |", "|---|---:|---|---:|---|"]
    for name in PHASES:
        xs, ys = [p["phases"][name] for p in parts], [p["phases"][name] for p in ecrms]
        lines.append(f"| {name} | {med(xs):.3f} | {', '.join(f'{x:.3f}' for x in xs)} | {med(ys):.3f} | "
                     f"{', '.join(f'{y:.3f}' for y in ys)} |")
    tot, etot = [p["total"] for p in parts], [p["total"] for p in ecrms]
    lines.append(f"| **kill to first step** | **{med(tot):.2f}** | {', '.join(f'{x:.2f}' for x in tot)} | "
                 f"**{med(etot):.2f}** | {', '.join(f'{x:.2f}' for x in etot)} |")
    cn = [p["in_cnrstore"] for p in parts]
    full = [f["total"] for f in fulls]
    ecn = [p["in_cnrstore"] for p in ecrms]
    lines += ["", f"- in cnrstore, CPR: median {med(cn):.3f} s (import {med([p['phases']['import cnrstore'] for p in parts]):.3f}"
              f", Checkpointer and transport {med([p['checkpointer'] for p in parts]):.3f}, recv_checkpoint "
              f"{med([p['recv'] for p in parts]):.3f}); ECRM: median {med(ecn):.3f} s (recv_checkpoint "
              f"{med([p['recv'] for p in ecrms]):.3f}, ECRM's constructor and recover() "
              f"{med([p['decode'] for p in ecrms]):.3f}; not counted: re-forming torch's default group "
              f"{med([p['group'] for p in ecrms]):.3f}); no update lost; ECRM.recover's phases (first run): "
              + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in ecrms[0]["ecrm_phases"].items()),
              f"- the other groups: never restarted ({parts[0]['survivor_pids']} processes, one each); the job's "
              f"next step after the kill committed {med([p['job_stalled'] for p in parts]):.2f} s after it; "
              f"updates of the replaced shard lost (CPR): {parts[0]['lost']} steps",
              f"- **DCP full restart** (every group ended and started again, dcp.load of each): kill to the last "
              f"group's first step median {med(full):.2f} s ({', '.join(f'{x:.2f}' for x in full)}); "
              f"dcp.load {med([f['load'] for f in fulls]):.3f} s; every group rolled back {fulls[0]['rolled_back']} steps",
              f"- ratio CPR / full restart: {med(tot) / med(full):.2f}; ECRM / full restart: {med(etot) / med(full):.2f}",
              "",
              f"## A {args.shard_mib} MiB shard over TorchftTransport", "",
              f"- table {shard['rows']:,} x 64 fp32 and its Adagrad state; {shard['changed']:,} rows "
              f"({shard['changed'] / shard['rows']:.1%}) changed since the save; {shard['bytes'] / 2**20:.1f} MiB "
              "received from the peer",
              f"- recv_checkpoint: median {med(shard['recv']):.3f} s ({', '.join(f'{x:.3f}' for x in shard['recv'])}; "
              f"store read {shard['read']:.3f}, peer {shard['fetch']:.3f})",
              f"- local Checkpointer.restore() of the same version: median {med(shard['restore']):.3f} s "
              f"({', '.join(f'{x:.3f}' for x in shard['restore'])})",
              f"- **ratio recv / restore: {med(shard['recv']) / med(shard['restore']):.2f}** (target <= 1.5)",
              f"- the sender's send_checkpoint (fingerprints, changed rows copied): median {med(shard['send']):.3f} s"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="one run of each, a 256 MiB shard")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each job, and of each transfer")
    ap.add_argument("--rows", type=int, default=100_000, help="rows of each group's table in the jobs")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--kill-at", type=int, default=22)
    ap.add_argument("--save-every", type=int, default=10)
    ap.add_argument("--step-sleep", type=float, default=0.02)
    ap.add_argument("--shard-mib", type=int, default=1024, help="the transferred shard: table + Adagrad state")
    ap.add_argument("--changed-steps", type=int, default=20, help="steps of 4096 lookups after the save")
    ap.add_argument("--out", help="also write the report here")
    args = ap.parse_args(argv)
    if args.quick:
        args.repeats, args.shard_mib = 1, 256
    load, t0 = load_average(), time.perf_counter()
    parts, ecrms, fulls = [], [], []
    with tempfile.TemporaryDirectory(prefix="bench_recovery") as tmp:
        for i in range(args.repeats):  # alternating, so that the machine's load hits both
            parts.append(partial(os.path.join(tmp, f"partial-{i}"), args))
            ecrms.append(partial(os.path.join(tmp, f"ecrm-{i}"), args, ecrm=True))
            fulls.append(full_restart(os.path.join(tmp, f"full-{i}"), args))
            print(f"run {i}: CPR {parts[-1]['total']:.2f} s, ECRM {ecrms[-1]['total']:.2f} s, full restart "
                  f"{fulls[-1]['total']:.2f} s", file=sys.stderr)
        shard = transfer(os.path.join(tmp, "shard"), args)
    publish(render(args, parts, ecrms, fulls, shard, load, time.perf_counter() - t0), args.out, None, None)


if __name__ == "__main__":
    main()
