"""Jobs of spawned gloo ranks (support/dist_worker.py), for the tests of ``cnrstore.distributed``: start the
ranks of a scenario, wait for them (killing one that hangs), check their exits, and assemble the global
state their dumps describe."""

from __future__ import annotations

import glob
import json
import os
import subprocess

import numpy as np

from . import prespawn

WORKER = os.path.join(os.path.dirname(__file__), "dist_worker.py")
TIMEOUT = 180


def spawn(cfg: dict, rank: int, env_extra=None):
    """Rank ``rank`` of the job ``cfg`` (a worker forked from the preloaded server: prespawn.py)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("CNRSTORE_CRASH_AT", None)
    env.update(env_extra or {})
    return prespawn.spawn(WORKER, json.dumps({**cfg, "rank": rank}), env=env)


def finish(procs, timeout: float = TIMEOUT) -> list[tuple[int, str]]:
    """(exit status, output) of each of ``procs``, waiting at most ``timeout`` seconds for each (one that
    takes longer is killed)."""
    out = []
    for p in procs:
        try:
            text, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            text, _ = p.communicate()
        out.append((p.returncode, text))
    return out


def run_job(tmp_path, scenario: str, world: int, tag: str = "job", **cfg) -> list[tuple[int, str]]:
    cfg = {"scenario": scenario, "world": world, "init": str(tmp_path / f"rdzv-{tag}"),
           "root": str(tmp_path / "root"), "out": str(tmp_path / "out"), **cfg}
    os.makedirs(cfg["out"], exist_ok=True)
    return finish([spawn(cfg, r) for r in range(world)])


def assert_ok(results) -> None:
    for rank, (rc, text) in enumerate(results):
        assert rc == 0, f"rank {rank} exited {rc}:\n{text[-3000:]}"


def assemble(out_dir, tag: str) -> dict[str, np.ndarray]:
    """The global state the ranks' dumps ``<tag>-rank*.npz`` describe: tables by global row."""
    parts: dict[str, list] = {}
    merged: dict[str, np.ndarray] = {}
    files = sorted(glob.glob(os.path.join(out_dir, f"{tag}-rank*.npz")))
    assert files, f"no dumps {tag}"
    for f in files:
        with np.load(f) as z:
            for key in z.files:
                if key.endswith("/start"):
                    continue
                table = key.split("/")[0]
                if f"{table}/start" in z.files and key.endswith(("/weight", "/sum")):
                    parts.setdefault(key, []).append((int(z[f"{table}/start"]), z[key]))
                elif key.endswith("/step") or key == "position":
                    merged.setdefault(key, z[key])
                else:  # replicated: every rank must hold the same bytes
                    if key in merged:
                        np.testing.assert_array_equal(merged[key], z[key], err_msg=f"replicas of {key} differ")
                    merged[key] = z[key]
    for key, pieces in parts.items():
        merged[key] = np.concatenate([a for _s, a in sorted(pieces, key=lambda p: p[0])])
    return merged


def assert_same_state(a: dict, b: dict, skip=("position",)) -> None:
    keys = (set(a) | set(b)) - set(skip)
    for k in sorted(keys):
        assert k in a and k in b, f"{k} missing from one state"
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
