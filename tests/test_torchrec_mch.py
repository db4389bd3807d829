"""TorchRec managed-collision (MCH) models sharded by DistributedModelParallel on 2 gloo CPU ranks, checkpointed
by cnrstore.distributed.DistributedCheckpointer (tests/support/mch_worker.py): each rank's managed-collision
buffers (its local shard) are saved in its own store as keyed rows, the ids admitted, evicted or touched since
the last save; after a kill, a fresh job at the same world size resumes bit for bit (tables, fused optimizer
state, remap buffers, dense layers, and the training that follows). Another world size is refused, saying why.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

if os.environ.get("CNRSTORE_REQUIRE_TORCHREC") == "1":
    import torchrec  # noqa: F401
else:
    pytest.importorskip("torchrec")

from support import prespawn  # noqa: E402
from support.dist_jobs import finish  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "support", "mch_worker.py")
ZCH = 64
STEPS = 6


def _run(out, scenario: str, world: int, seed: int, **cfg) -> None:
    procs = []
    for rank in range(world):
        c = {"scenario": scenario, "rank": rank, "world": world, "init": str(out / f"init-{scenario}-{world}"),
             "out": str(out), "root": str(out / "root"), "steps": STEPS, "seed": seed, "zch": ZCH, **cfg}
        procs.append(prespawn.spawn(WORKER, json.dumps(c), env=dict(os.environ, OMP_NUM_THREADS="1")))
    bad = [(rc, text[-3000:]) for rc, text in finish(procs) if rc != 0]
    assert not bad, bad


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A 2-rank job that trained STEPS steps, saving every other one, then was killed (nothing closed)."""
    out = tmp_path_factory.mktemp("mch")
    _run(out, "save", 2, seed=0)
    return out


def _npz(path) -> dict:
    with np.load(path) as z:
        return {k: z[k] for k in z.files}


def test_a_sharded_mch_model_resumes_bit_for_bit_after_a_kill(saved):
    _run(saved, "restore", 2, seed=7)  # a fresh job: another seed's model, the newest global version restored
    for rank in range(2):
        for a, b in (("saved", "restored"), ("continued-saved", "continued-restored")):
            want, got = _npz(saved / f"{a}-rank{rank}.npz"), _npz(saved / f"{b}-rank{rank}.npz")
            assert sorted(want) == sorted(got)
            assert any("_mch_sorted_raw_ids" in k for k in want) and any(k.startswith("optim/") for k in want)
            for k in want:
                assert np.array_equal(want[k], got[k]), (rank, b, k)
        # (the store's newest version: the save after the restore, of the state after two more steps)
        ids = next(v for k, v in _npz(saved / f"continued-saved-rank{rank}.npz").items() if "_mch_sorted_raw_ids" in k)
        live = ids[ids != np.iinfo(np.int64).max]
        assert live.size > ZCH // 4  # (both ranks hold ids: torchrec routes them by range)
        with open(saved / f"stores-rank{rank}.json") as f:
            report = json.load(f)
        assert report["ok"]
        (table,) = [k for k in report if k.endswith(".keyed")]
        assert report[table]["live"] == live.size
        # the slot buffers are keyed rows, not dense arrays; each save wrote at most the rank's changed ids
        assert not any("_mch_sorted_raw_ids" in n and not n.startswith("torch.keyed-tail/") for n in report["dense"])
        changed = report[table]["changed"]
        assert len(changed) == STEPS // 2 and max(changed) <= ZCH // 2 and max(changed) > 0


def test_restoring_a_sharded_mch_model_at_another_world_size_is_refused(saved):
    _run(saved, "restore", 3, seed=7)
    for rank in range(3):
        text = (saved / f"error-rank{rank}.txt").read_text()
        assert "managed-collision" in text and "world size 2, this job 3" in text, text


def test_partial_recovery_gives_a_replaced_rank_its_own_managed_collision_state(tmp_path):
    _run(tmp_path, "recover", 2, seed=0)
    dumps = {(kind, r): _npz(tmp_path / f"{kind}-rank{r}.npz") for kind in ("at-save", "live", "recovered")
             for r in range(2)}
    for k in dumps["live", 0]:  # the survivor keeps its live state, managed-collision buffers included
        assert np.array_equal(dumps["recovered", 0][k], dumps["live", 0][k]), k
    mc = [k for k in dumps["live", 1] if "_managed_collision_modules" in k]
    assert any("_mch_sorted_raw_ids" in k for k in mc)
    assert not np.array_equal(*(next(v for k, v in dumps["at-save", r].items() if "_mch_sorted_raw_ids" in k)
                                for r in range(2)))
    for k in dumps["live", 1]:
        # the replaced rank: its saved buffers (not the survivor's), table shard and fused optimizer state; the
        # dense layers (replicated) the survivor's
        want = dumps["live", 0][k] if k.startswith("dense/") and k not in mc else dumps["at-save", 1][k]
        assert np.array_equal(dumps["recovered", 1][k], want), k
