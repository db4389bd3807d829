"""TorchRec managed-collision (MCH) models sharded by DistributedModelParallel on 2 gloo CPU ranks, checkpointed
by cnrstore.distributed.DistributedCheckpointer (tests/support/mch_worker.py): each rank's managed-collision
buffers (its local shard) are saved in its own store as keyed rows, the ids admitted, evicted or touched since
the last save; after a kill, a fresh job at the same world size resumes bit for bit (tables, fused optimizer
state, remap buffers, dense layers, and the training that follows). At another world size (2 -> 3, 3 -> 2) the
buffers are remapped (cnrstore/distributed/reshard_mch.py): every id kept on the rank torchrec now routes it to,
with its row, optimizer state and metadata, and the job trains on.
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


def _run(out, scenario: str, world: int, seed: int, worker: str = WORKER, **cfg) -> None:
    procs = []
    for rank in range(world):
        c = {"scenario": scenario, "rank": rank, "world": world,
             "init": str(out / f"init-{os.path.basename(worker)}-{scenario}-{world}"),
             "out": str(out), "root": str(out / "root"), "steps": STEPS, "seed": seed, "zch": ZCH, **cfg}
        procs.append(prespawn.spawn(worker, json.dumps(c), env=dict(os.environ, OMP_NUM_THREADS="1")))
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


EMPTY = np.iinfo(np.int64).max
HASH = 2 ** 20  # (the worker's input hash size: torchrec routes raw id x to rank x // ceil(HASH / world))
MC = "mc._managed_collision_collection._managed_collision_modules.t."
ROOMY = 96  # slots of the saved_roomy job: 48 a rank at 2 ranks, 32 at 3


@pytest.fixture(scope="module")
def saved_roomy(tmp_path_factory):
    """A 2-rank job as ``saved`` with ROOMY slots: no rank is full at the save, and each of 3 ranks' 32 slots
    can hold every saved id routed to it (2 -> 3 drops none)."""
    out = tmp_path_factory.mktemp("mch-roomy")
    _run(out, "save", 2, seed=0, zch=ROOMY)
    return out


@pytest.fixture(scope="module")
def saved3(tmp_path_factory):
    """A 3-rank job as ``saved`` (ZCH slots: 22, 22 and 20, every rank full at the save)."""
    out = tmp_path_factory.mktemp("mch3")
    _run(out, "save", 3, seed=0)
    return out


def _layout(dump: dict) -> dict:
    """A rank's MCH buffers, table shard and row-wise momentum from its ``state_of`` dump."""
    (key,) = [k for k in dump if k.startswith(MC + "_mch_sorted_raw_ids@")]
    off = int(key.rsplit("@", 1)[1])
    (mom,) = [k for k in dump if k.startswith("optim/") and k.endswith(f"momentum1@{off}")]
    ids = dump[key]
    return {"offset": off, "ids": ids, "live": int((ids != EMPTY).sum()),
            "mapping": dump[f"{MC}_mch_remapped_ids_mapping@{off}"], "counts": dump[f"{MC}_mch_counts@{off}"],
            "last": dump[f"{MC}_mch_last_access_iter@{off}"],
            "weight": dump[f"mc._embedding_module.embedding_bags.t.weight@{off}"], "momentum": dump[mom],
            "iter": dump[f"dense/{MC}_current_iter_tensor"], "segments": dump[f"dense/{MC}_output_segments_tensor"]}


def _ids_of(dumps: list[dict]) -> dict:
    """{raw id: (embedding row, momentum, counts, last access)} over every rank's dump."""
    out = {}
    for d in map(_layout, dumps):
        for j in range(d["live"]):
            row = d["mapping"][j] - d["offset"]
            out[int(d["ids"][j])] = (d["weight"][row], d["momentum"][row], d["counts"][j], d["last"][j])
    return out


def _check_buffers(dumps: list[dict], zch: int) -> list[dict]:
    """Every rank's buffers are an MCH module's (ids ascending then empty, the mapping a permutation of the
    rank's slots, the free tail's metadata zero) over its row shard, holding only ids torchrec routes to it."""
    world, block = len(dumps), -(-HASH // len(dumps))
    layouts = [_layout(d) for d in dumps]
    offsets = [d["offset"] for d in layouts] + [zch]
    for r, d in enumerate(layouts):
        n, size = d["live"], offsets[r + 1] - offsets[r]
        assert d["ids"].size == size and (d["ids"][n:] == EMPTY).all()
        assert (np.diff(d["ids"][:n]) > 0).all() and (d["ids"][:n] // block == r).all(), r
        assert np.array_equal(np.sort(d["mapping"]), np.arange(offsets[r], offsets[r + 1])), r
        assert d["segments"][:world + 1].tolist() == offsets and (d["segments"][world + 1:] == -1).all()
    return layouts


def _check_reshard(old_dir, old_world, new_dir, tag, new_world, zch) -> list[int]:
    """The restored job at ``new_world`` holds, for every id it kept, exactly the saved id's embedding row,
    row-wise momentum, counts and last access; it kept every saved id routed to a rank unless that rank
    overflowed, then the most recently accessed (then most counted, then smallest) and said so; and it trained
    on. Returns the ids dropped per new rank."""
    old = [_npz(old_dir / f"saved-rank{r}.npz") for r in range(old_world)]
    new = [_npz(new_dir / f"{tag}-restored-rank{r}.npz") for r in range(new_world)]
    warned = [json.loads((new_dir / f"{tag}-warnings-rank{r}.json").read_text()) for r in range(new_world)]
    saved, block = _ids_of(old), -(-HASH // new_world)
    layouts = _check_buffers(new, zch)
    restored = _ids_of(new)
    dropped = []
    for r, d in enumerate(layouts):
        routed = sorted(i for i in saved if i // block == r)
        size = d["ids"].size
        want = routed
        if len(routed) > size:  # (the rule, spelled out independently of reshard_mch.keep)
            want = sorted(sorted(routed, key=lambda i: (-saved[i][3], -saved[i][2], i))[:size])
            assert len(warned[r]) == 1 and f"dropped {len(routed) - size}" in warned[r][0], warned[r]
        else:
            assert warned[r] == [], warned[r]
        assert d["ids"][:d["live"]].tolist() == want, r
        assert np.array_equal(d["mapping"][:d["live"]], d["offset"] + np.arange(d["live"]))  # (slots renumbered)
        assert (d["counts"][d["live"]:] == 0).all() and (d["last"][d["live"]:] == 0).all()
        assert d["iter"].tolist() == _layout(old[0])["iter"].tolist()
        dropped.append(len(routed) - len(want))
    assert set(restored) <= set(saved) and len(saved) - len(restored) == sum(dropped)
    for i, (row, mom, count, last) in restored.items():
        s_row, s_mom, s_count, s_last = saved[i]
        assert np.array_equal(row, s_row) and mom == s_mom and count == s_count and last == s_last, i
    # the restored job trained two more steps (torchrec's MCH forward, admissions and evictions on the remapped
    # buffers) and saved: its buffers are still an MCH module's, its ids still routed to it
    trained = _check_buffers([_npz(new_dir / f"{tag}-trained-rank{r}.npz") for r in range(new_world)], zch)
    grew = 0
    for before, after in zip(layouts, trained):
        assert after["iter"].tolist() == [int(before["iter"][0]) + 2]
        assert not np.array_equal(after["weight"], before["weight"])
        # torchrec's remap found kept ids in the remapped buffers: their counts went on from the saved ones
        counts = dict(zip(after["ids"][:after["live"]].tolist(), after["counts"][:after["live"]].tolist()))
        grew += sum(counts.get(i, -1) > c for i, c in zip(before["ids"][:before["live"]].tolist(),
                                                         before["counts"][:before["live"]].tolist()))
    assert grew > 0
    return dropped


def test_a_sharded_mch_model_saved_at_2_ranks_resumes_at_3(saved_roomy):
    _run(saved_roomy, "reshard", 3, seed=7, zch=ROOMY, tag="to3")
    dropped = _check_reshard(saved_roomy, 2, saved_roomy, "to3", 3, ROOMY)
    assert dropped == [0, 0, 0]  # (ROOMY: every rank's saved ids fit its new slots, all are kept)


def test_a_sharded_mch_model_saved_at_3_ranks_resumes_at_2(saved3):
    _run(saved3, "reshard", 2, seed=7, tag="to2")
    dropped = _check_reshard(saved3, 3, saved3, "to2", 2, ZCH)
    # (every old rank is full: new rank 0's ids, old rank 0's and the lower half of old rank 1's, outnumber its
    # 32 slots in this job, so the overflow choice runs end to end)
    assert dropped[0] > 0 and dropped[1] == 0, dropped


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


MPZCH_WORKER = os.path.join(HERE, "support", "mpzch_worker.py")


def test_a_sharded_mpzch_model_resumes_bit_for_bit_after_a_kill(tmp_path):
    """DMP-sharded MPZCH (``HashZchManagedCollisionModule``) on 2 gloo ranks: its identity buffer (one id per
    slot, (slots, 1)) is each rank's keyed group, saved as the slots changed since the last save; a fresh job
    restores identities, table shards, fused optimizer state and dense layers bit for bit and trains on the
    same. (fbgemm's CPU MPZCH lookup is read-only, so the worker writes each step's admissions into the
    identities by hand, as the CUDA kernel would: tests/support/mpzch_worker.py.)"""
    _run(tmp_path, "save", 2, seed=0, worker=MPZCH_WORKER)
    saved_continued = {r: _npz(tmp_path / f"mpzch-save-continued-rank{r}.npz") for r in range(2)}
    _run(tmp_path, "restore", 2, seed=7, worker=MPZCH_WORKER)
    for rank in range(2):
        for a, b in (("mpzch-save-saved", "mpzch-restore-restored"), ("mpzch-save-continued", "mpzch-restore-continued")):
            want = saved_continued[rank] if a.endswith("continued") else _npz(tmp_path / f"{a}-rank{rank}.npz")
            got = _npz(tmp_path / f"{b}-rank{rank}.npz")
            assert sorted(want) == sorted(got)
            assert any("_hash_zch_identities" in k for k in want) and any(k.startswith("optim/") for k in want)
            for k in want:
                assert np.array_equal(want[k], got[k]), (rank, b, k)
        with open(tmp_path / f"mpzch-restore-stores-rank{rank}.json") as f:
            report = json.load(f)
        assert report["ok"]
        (table,) = [k for k in report if k.endswith(".keyed")]
        assert report[table]["live"] == ZCH // 2  # every slot of the rank's shard is a key
        assert not any("_hash_zch_identities" in n and not n.startswith("torch.keyed-tail/") for n in report["dense"])
        # each save wrote the slots whose identity changed in its two steps (4 writes a step), not the shard
        changed = report[table]["changed"]
        assert len(changed) == STEPS // 2 and 0 < max(changed) <= 8


def _global(dumps: list[dict]) -> dict:
    """{state name: the whole array} from every rank's dump: local shards (``key@row offset``) put at their rows,
    the rest (dense layers) rank 0's."""
    parts: dict = {}
    for d in dumps:
        for k, v in d.items():
            name, _, at = k.rpartition("@")
            if name and at.isdigit():
                parts.setdefault(name, []).append((int(at), v))
            else:
                parts.setdefault(k, [(0, v)])
    return {k: np.concatenate([v for _a, v in sorted(ps, key=lambda x: x[0])]) for k, ps in parts.items()}


@pytest.mark.parametrize("old,new", [(2, 3), (3, 2)])
def test_a_sharded_mpzch_model_restored_at_another_world_size_keeps_every_slot(tmp_path, old, new):
    """MPZCH reshards by whole buckets (total_num_buckets 12: a multiple of 2 and 3): every global slot keeps
    its identity, embedding row and row-wise optimizer state; the dense layers are rank 0's; the job trains on
    and saves."""
    cfg = {"zch": 96, "buckets": 12, "worker": MPZCH_WORKER}
    _run(tmp_path, "save", old, seed=0, tag="zs", **cfg)
    _run(tmp_path, "restore", new, seed=7, tag="zr", **cfg)
    want = _global([_npz(tmp_path / f"zs-saved-rank{r}.npz") for r in range(old)])
    got = _global([_npz(tmp_path / f"zr-restored-rank{r}.npz") for r in range(new)])
    assert sorted(want) == sorted(got)
    ident = next(k for k in want if k.endswith("_hash_zch_identities"))
    assert want[ident].shape == (96, 1) and (want[ident] >= 0).sum() > 12  # (admissions on every rank)
    for k in want:
        assert np.array_equal(want[k], got[k]), k
    for r in range(new):
        assert (tmp_path / f"zr-continued-rank{r}.npz").exists()
