"""ECRM jobs of spawned gloo ranks (support/ecrm_worker.py), for test_ecrm.py and test_cuda.py: run a job, kill and
replace its victims, and compare the ranks' final states bit for bit with a reference run's."""

from __future__ import annotations

import json
import os

import numpy as np

from cnrstore.distributed import failures

from . import prespawn
from .dist_jobs import finish

WORKER = os.path.join(os.path.dirname(__file__), "ecrm_worker.py")
TIMEOUT = 120
STEPS = 6
#: The process groups' timeout in the spawned jobs: far beyond TIMEOUT, so that a recovery that waited
#: on a timeout instead of learning of the failure at once would fail the test (its workers killed).
PG_TIMEOUT_S = 3600


def _spawn(cfg: dict, rank: int, crash: str | None = None, **extra):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("CNRSTORE_CRASH_AT", None)
    if crash:
        env["CNRSTORE_CRASH_AT"] = crash
    return prespawn.spawn(WORKER, json.dumps({**cfg, "rank": rank, **extra}), env=env)


def _wait_all(procs) -> None:
    bad = [(i, rc, out[-3000:]) for i, (rc, out) in enumerate(finish(procs, TIMEOUT)) if rc != 0]
    assert not bad, bad


def run_job(tmp_path, tag: str, world: int, k: int, r: int, *, victims=(), crash="kill", fail_step=3,
            replacement_crash=None, **extra) -> tuple[dict, dict]:
    """Run a job; replace every victim that dies (and a replacement that dies in the decode). Returns
    ({rank: final state}, {rank: report})."""
    out = tmp_path / tag
    out.mkdir()
    board = failures.FailureBoard()          # this test is the launcher: it posts every death it sees
    cfg = {"world": world, "k": k, "r": r, "steps": STEPS, "fail_step": fail_step, "victims": list(victims),
           "crash": crash, "rdzv": str(out / "rdzv"), "out": str(out), "root": str(out / "root"),
           "board": [board.host, board.port], "pg_timeout": PG_TIMEOUT_S, **extra}
    procs = {q: _spawn(cfg, q) for q in range(world)}
    if victims:
        for v in victims:
            procs[v].wait(timeout=TIMEOUT)
            assert procs[v].returncode == -9, procs[v].communicate()[0][-3000:]
            board.post(0, f"rank {v} died")
        epoch = 1
        if replacement_crash:
            first = {v: _spawn(cfg, v, crash=replacement_crash, replacement=True, epoch=epoch) for v in victims}
            for v, p in first.items():
                p.wait(timeout=TIMEOUT)
                assert p.returncode == -9, p.communicate()[0][-3000:]
                board.post(epoch, f"rank {v}'s replacement died")
            epoch += 1
        for v in victims:
            procs[v] = _spawn(cfg, v, replacement=True, epoch=epoch)
    _wait_all(procs.values())
    states = {q: dict(np.load(out / f"final-rank{q}.npz")) for q in range(world)}
    reports = {q: json.load(open(out / f"report-rank{q}.json")) for q in range(world)}
    return states, reports


_REFERENCE: dict = {}


def reference(tmp_path_factory, world, k, r):
    key = (world, k, r)
    if key not in _REFERENCE:
        _REFERENCE[key] = run_job(tmp_path_factory.mktemp("ref"), "ref", world, k, r, count_traffic=True)
    return _REFERENCE[key]


def assert_bit_equal(a: dict, b: dict) -> None:
    for q in a:
        assert a[q].keys() == b[q].keys()
        for key in a[q]:
            assert a[q][key].tobytes() == b[q][key].tobytes(), (q, key)
