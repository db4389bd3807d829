"""Jobs of spawned gloo ranks (support/dist_worker.py), for the tests of ``cnrstore.distributed``: start the
ranks of a scenario, wait for them (killing one that hangs), check their exits, and assemble the global
state their dumps describe; the partial-recovery scenario that test_distributed and test_cuda run."""

from __future__ import annotations

import glob
import json
import os
import subprocess

import numpy as np

from cnrstore.distributed import versions

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


def unsharded_state(dumps: dict) -> dict:
    """The unsharded model's state dict from the ranks' assembled dumps (``emb.t0/weight``, ``mlp/0.weight``)."""
    out = {}
    for key, arr in dumps.items():
        if key.endswith("/weight") and key.startswith("emb."):
            out[key.replace("/weight", ".weight")] = arr
        elif key.startswith("mlp/") and not key.endswith("/sum"):
            out["mlp." + key[4:]] = arr
    return out


def check_partial_recovery(tmp_path, **extra) -> None:
    """Rank 1 of 3 is SIGKILLed after a checkpoint; a replacement restores its shards from the checkpoint and
    the survivors' dense replicas, the survivors keep their live state (``extra``: more worker config)."""
    cfg = {"scenario": "partial", "world": 3, "init": str(tmp_path / "rdzv1"), "init2": str(tmp_path / "rdzv2"),
           "root": str(tmp_path / "root"), "out": str(tmp_path / "out"), "fail_rank": 1, **extra}
    os.makedirs(cfg["out"])
    procs = [spawn(cfg, r) for r in range(3)]
    procs[1].wait(timeout=TIMEOUT)
    assert procs[1].returncode == -9
    # (on a bucket root the replacement runs on a fresh machine: a node directory of its own, empty)
    replacement = spawn({**cfg, "init": cfg["init2"], "replacement": True, "seed": 1234, "node": "fresh"}, 1)
    results = finish([procs[0], replacement, procs[2]])
    assert_ok(results)
    assert "lost_update_fraction=" in results[0][1]
    out = tmp_path / "out"
    for r in (0, 2):  # survivors kept their live state
        live = dict(np.load(out / f"live-rank{r}.npz"))
        rec = dict(np.load(out / f"recovered-rank{r}.npz"))
        assert live.keys() == rec.keys()
        for k in live:
            np.testing.assert_array_equal(live[k], rec[k], err_msg=k)
    # the replaced rank holds the checkpoint's shards and the survivors' dense replicas
    ck = dict(np.load(out / "g1-rank1.npz"))
    rec = dict(np.load(out / "recovered-rank1.npz"))
    live0 = dict(np.load(out / "live-rank0.npz"))
    for k in rec:
        if k.startswith("mlp/"):
            np.testing.assert_array_equal(rec[k], live0[k], err_msg=k)
        elif k != "position":
            np.testing.assert_array_equal(rec[k], ck[k], err_msg=k)
    # and the survivors' state moved on from the checkpoint (so the comparison above means something)
    assert not np.array_equal(dict(np.load(out / "g1-rank0.npz"))["emb.t0/weight"], live0["emb.t0/weight"])
    remote = {"remote": extra["remote"], "remote_options": extra["remote_options"]} if extra.get("remote") else {}
    assert [g.version for g in versions(tmp_path / "root", **remote)] == [1, 2]
