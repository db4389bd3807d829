"""Runs replica groups of tools/torchft_replica.py under torchft's lighthouse, as a scheduler would:
one group SIGKILLs itself after a step and is started again, the others run on (no process of theirs is
restarted), or (``restart="all"``) every group is ended and started again. For tests/test_torchft_recovery.py
and benchmarks/bench_recovery.py."""

import json
import os
import subprocess
import sys
import time

os.environ.setdefault("RUST_LOG", "warn")  # (torchft's lighthouse logs every quorum at INFO otherwise)
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torchft_replica.py")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(tmp: str, *, tables: str, replicas: int, steps: int, kill: int | None, kill_at: int | None = None,
        reset_at: int | None = None, rows: int = 200, save_every: int = 5, step_sleep: float = 0.01,
        ckpt: str = "cnrstore", restart: str = "one", ecrm: bool = False, timeout: float = 240.0,
        spawner=None, async_quorum: bool = False) -> dict:
    """Run the job in ``tmp`` -> {"events": {replica: [event, ...]}, "spawned": {replica: [times]},
    "killed_at": the time the killed process ended (None without a kill)}. ``restart="all"``: at the kill,
    end every group and start them all again (torchrun's behaviour on a failure: the full restart). ``ecrm``:
    the groups keep ECRM parity (``tables="own"``), formed through a TCPStore this launcher hosts.
    ``spawner(script, arg, env)`` starts a group's process (a ``subprocess.Popen``-like: ``poll``, ``kill``,
    ``wait``); default: a fresh interpreter, as a scheduler starts one (the tests fork theirs from a server
    that imported torch already)."""
    from torchft._torchft import LighthouseServer

    os.makedirs(tmp, exist_ok=True)

    def new_lighthouse():  # (every group in each quorum: a lost one's step waits for its replacement)
        return LighthouseServer(bind="[::]:0", min_replicas=replicas, join_timeout_ms=100)

    lighthouse = new_lighthouse()
    rdzv = None
    if ecrm:
        from torch.distributed import TCPStore

        rdzv = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = dict(os.environ, OMP_NUM_THREADS="1", RUST_LOG="warn", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    logs = {r: os.path.join(tmp, f"replica-{r}.jsonl") for r in range(replicas)}

    def spawn(r: int, kill_at_step):
        spec = {"lighthouse": lighthouse.address(), "replica": r, "replicas": replicas, "steps": steps,
                "root": tmp, "log": logs[r], "tables": tables, "save_every": save_every, "rows": rows,
                "step_sleep": step_sleep, "kill_at": kill_at_step, "reset_at": reset_at if r == kill else None,
                "ckpt": ckpt, "ecrm": ecrm, "rdzv_port": rdzv.port if rdzv else None, "async_quorum": async_quorum}
        spawned[r].append(time.time())
        spec["incarnation"] = len(spawned[r]) - 1
        return _start(WORKER, spec, env, spawner)

    spawned = {r: [] for r in range(replicas)}
    procs = {r: spawn(r, kill_at if r == kill else None) for r in range(replicas)}
    killed_at = None

    def replace(r, rc) -> bool:
        nonlocal killed_at, lighthouse
        if not (rc == -9 and r == kill and killed_at is None):
            return False
        killed_at = time.time()
        if restart == "all":  # (a full restart: every other group is ended and started again)
            for q in list(procs):
                other = procs.pop(q)
                other.kill()
                other.wait()
            # and the rendezvous with them, as torchrun's is (the old lighthouse would hold the dead groups'
            # quorum requests)
            lighthouse.shutdown()
            lighthouse = new_lighthouse()
            for q in range(replicas):
                if q != r:
                    procs[q] = spawn(q, None)
        procs[r] = spawn(r, None)  # the scheduler replaces the lost group
        return True

    try:
        _supervise(procs, replace, lambda r: f"replica {r}", logs, timeout)
    finally:
        lighthouse.shutdown()
    events = {r: [json.loads(line) for line in open(logs[r])] for r in range(replicas)}
    return {"events": events, "spawned": spawned, "killed_at": killed_at}


def _start(script: str, spec: dict, env: dict, spawner):
    """``python script SPEC_JSON``: through ``spawner(script, arg, env)`` if given, else a fresh interpreter."""
    if spawner is not None:
        return spawner(script, json.dumps(spec), env)
    return subprocess.Popen([sys.executable, script, json.dumps(spec)], env=env)


def _supervise(procs: dict, replace, name, logs: dict, timeout: float) -> None:
    """Poll ``procs`` ({key: process}) until each has ended. An exit is first offered to ``replace(key, rc)``
    (True: it started what replaces it, and ``procs`` may have changed: poll afresh); any other non-zero exit
    raises, naming ``name(key)`` and the tail of its log; past ``timeout`` seconds, TimeoutError. What still
    runs when it raises is killed."""
    deadline = time.monotonic() + timeout
    try:
        while procs:
            for key, p in list(procs.items()):
                rc = p.poll()
                if rc is None:
                    continue
                del procs[key]
                if replace(key, rc):
                    break  # (the processes polled before this one may have been replaced too)
                if rc != 0:
                    raise RuntimeError(f"{name(key)} exited with {rc}; its log: {_tail(logs[key])}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the job did not end in {timeout:.0f} s")
            time.sleep(0.02)
    finally:
        for p in procs.values():
            p.kill()
            p.wait()


def _tail(path: str) -> str:
    try:
        return "".join(open(path).readlines()[-3:])
    except OSError:
        return "(none)"


GROUP_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torchft_group.py")


def run_groups(tmp: str, *, groups: int, group_size: int, steps: int, kill: tuple | None, kill_at: int | None = None,
               rows: int = 400, save_every: int = 4, timeout: float = 240.0, spawner=None) -> dict:
    """Replica groups of ``group_size`` ranks each (tools/torchft_group.py: a table sharded over a group's ranks).
    ``kill``: (group, rank) that SIGKILLs itself after step ``kill_at``; the scheduler then ends the rest of that
    group and starts the whole group again, as torchft expects (a group heals as a whole). -> {"events":
    {(group, rank): [event, ...]}, "spawned": {(group, rank): [times]}}."""
    from torch.distributed import TCPStore
    from torchft._torchft import LighthouseServer

    os.makedirs(tmp, exist_ok=True)
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=groups, join_timeout_ms=100)
    stores = {g: TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) for g in range(groups)}
    env = dict(os.environ, OMP_NUM_THREADS="1", RUST_LOG="warn",
               PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    members = [(g, r) for g in range(groups) for r in range(group_size)]
    logs = {m: os.path.join(tmp, f"group-{m[0]}-rank-{m[1]}.jsonl") for m in members}
    spawned = {m: [] for m in members}
    incarnation = {g: 0 for g in range(groups)}

    def spawn(m, kill_at_step):
        g, r = m
        spec = {"lighthouse": lighthouse.address(), "group": g, "rank": r, "group_size": group_size,
                "groups": groups, "group_port": stores[g].port, "incarnation": incarnation[g], "steps": steps,
                "root": tmp, "log": logs[m], "rows": rows, "save_every": save_every, "kill_at": kill_at_step}
        spawned[m].append(time.time())
        return _start(GROUP_WORKER, spec, env, spawner)

    procs = {m: spawn(m, kill_at if m == kill else None) for m in members}
    restarted = False

    def replace(m, rc) -> bool:
        nonlocal restarted
        if not (rc == -9 and m == kill and not restarted):
            return False
        restarted = True
        g = m[0]
        for q in [q for q in procs if q[0] == g]:  # (the group's other ranks go too)
            procs.pop(q).kill()
        incarnation[g] += 1
        # a new store for the new group, as a restarted torchrun's is (torchft's Manager finds its rank 0's
        # address there: the dead one's must not be found)
        stores[g] = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        for q in members:
            if q[0] == g:
                procs[q] = spawn(q, None)
        return True

    try:
        _supervise(procs, replace, lambda m: f"group {m[0]} rank {m[1]}", logs, timeout)
    finally:
        lighthouse.shutdown()
    events = {m: [json.loads(line) for line in open(logs[m])] for m in members}
    return {"events": events, "spawned": spawned}
