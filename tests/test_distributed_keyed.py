"""KeyedEmbeddings in a multi-rank job (DistributedCheckpointer, tests/support/keyed_dist_worker.py): each
rank holds the ids ``KeyedEmbedding.owner`` gives it; after a kill, a job at the same world size resumes bit
for bit (slots, metadata, optimizer state and the training that follows), and a job at another world size
(2 -> 3, 3 -> 2) gets every id on the rank that owns it there, with its row, metadata and optimizer state exactly,
each rank having read only the partitions it owns (cnrstore/distributed/reshard_keyed.py)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from support import prespawn
from support.dist_jobs import finish

from cnrstore import keyed_reshard
from cnrstore.errors import InvalidArgument
from cnrstore.distributed.reshard_keyed import keep_by_policy

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "support", "keyed_dist_worker.py")
STEPS = 6
P = 16


def _run(out, scenario: str, world: int, *, seed: int, capacity: int, tag: str, **cfg) -> None:
    procs = []
    for rank in range(world):
        c = {"scenario": scenario, "rank": rank, "world": world, "init": str(out / f"init-{tag}"), "out": str(out),
             "root": str(out / "root"), "steps": STEPS, "seed": seed, "capacity": capacity, **cfg}
        procs.append(prespawn.spawn(WORKER, json.dumps(c), env=dict(os.environ, OMP_NUM_THREADS="1")))
    bad = [(rc, text[-3000:]) for rc, text in finish(procs) if rc != 0]
    assert not bad, bad


def _npz(path) -> dict:
    with np.load(path) as z:
        return {k: z[k] for k in z.files}


def _by_id(dumps: list[dict]) -> dict:
    """{id: (weight row, last_step, count, Adagrad sum row)} over every rank's dump."""
    out = {}
    for d in dumps:
        for slot in np.flatnonzero(d["slot_ids"] >= 0):
            key = int(d["slot_ids"][slot])
            assert key not in out, f"id {key} on two ranks"
            out[key] = (d["weight"][slot].tobytes(), int(d["last_step"][slot]), int(d["count"][slot]),
                        d["sum"][slot].tobytes())
    return out


@pytest.fixture(scope="module")
def saved2(tmp_path_factory):
    out = tmp_path_factory.mktemp("keyed2")
    _run(out, "save", 2, seed=10, capacity=40, tag="save")
    return out


def test_a_keyed_embedding_job_resumes_bit_for_bit_at_the_same_world_size(saved2):
    _run(saved2, "restore", 2, seed=90, capacity=40, tag="same")
    for rank in range(2):
        for a, b in (("saved", "restored-w2"), ("continued-saved", "continued-w2")):
            want, got = _npz(saved2 / f"{a}-rank{rank}.npz"), _npz(saved2 / f"{b}-rank{rank}.npz")
            for k in want:
                assert np.array_equal(want[k], got[k]), (rank, b, k)
        assert (want["slot_ids"] >= 0).sum() == 40  # (the table was full: evictions happened)


@pytest.mark.parametrize("old,new,capacity", [(2, 3, 40), (3, 2, 48)])
def test_a_keyed_embedding_job_restored_at_another_world_size_gets_each_id_on_its_owner(tmp_path, saved2, old, new,
                                                                                       capacity):
    if old == 2:
        out = saved2
    else:
        out = tmp_path
        _run(out, "save", 3, seed=10, capacity=30, tag="save3")
    _run(out, "restore", new, seed=90, capacity=capacity, tag=f"to{new}")
    saved = [_npz(out / f"saved-rank{r}.npz") for r in range(old)]
    restored = [_npz(out / f"restored-w{new}-rank{r}.npz") for r in range(new)]
    assert _by_id(restored) == _by_id(saved)  # every id, with its row, metadata and optimizer state, exactly
    for rank, d in enumerate(restored):
        ids = d["slot_ids"][d["slot_ids"] >= 0]
        assert ids.size > 0 and (keyed_reshard.owner_of_keys(ids, P, new) == rank).all()
        n = ids.size  # the ids ascending in slots 0 .. n-1; the free slots zero, their optimizer state too
        assert np.array_equal(d["slot_ids"][:n], np.sort(ids)) and (d["slot_ids"][n:] == -1).all()
        assert not d["weight"][n:].any() and not d["sum"][n:].any()
        assert int(d["step"]) == int(saved[0]["step"]) and int(d["seed"]) == 90 + rank
        for k in ("head_w", "head_b", "head_sum"):  # the replicated dense layer: rank 0's
            assert np.array_equal(d[k], saved[0][k])
    for rank in range(new):  # the restored job trained on and saved again
        assert _npz(out / f"continued-w{new}-rank{rank}.npz")["step"] == STEPS + 2


def test_a_reshard_one_rank_refuses_is_refused_on_every_rank_with_nothing_loaded(tmp_path):
    """Rank 1 of a 2-rank job also held ids rank 0 owns: at 3 ranks only the rank that reads them sees it, and
    every rank raises before any loads (DistributedCheckpointer._reshard_agreed)."""
    _run(tmp_path, "save", 2, seed=10, capacity=40, tag="save", misroute=True)
    _run(tmp_path, "restore", 3, seed=90, capacity=40, tag="to3", expect_refusal=True)
    said = [(tmp_path / f"refused-w3-rank{r}.txt").read_text() for r in range(3)]
    assert "does not own it" in said[0] and "restore at the world size it was saved with" in said[0]
    for text in said[1:]:
        assert "refused on rank 0" in text and "nothing was loaded on any rank" in text


def test_a_rank_that_owns_more_ids_than_its_capacity_keeps_those_its_policy_keeps():
    keys = np.array([5, 9, 11, 20, 31], np.int64)
    last = np.array([3, 7, 7, 1, 7], np.int64)
    count = np.array([9, 1, 4, 9, 4], np.int64)
    assert keep_by_policy(keys, last, count, 5, "lru").tolist() == [0, 1, 2, 3, 4]
    assert keep_by_policy(keys, last, count, 3, "lru").tolist() == [1, 2, 4]   # the newest last_step
    assert keep_by_policy(keys, last, count, 2, "lru").tolist() == [1, 2]      # ties: the smaller id
    assert keep_by_policy(keys, last, count, 2, "lfu").tolist() == [0, 3]      # the largest count
    assert keep_by_policy(keys, last, count, 3, "lfu").tolist() == [0, 2, 3]   # then the newest last_step


def _rank_stores(tmp_path, world: int = 2):
    """A store per rank of a ``world``-rank job (each a plain Checkpointer of its KeyedEmbedding, holding the
    ids it owns): [(store, version)] and the union of what they hold, by id."""
    import torch

    import cnrstore
    from cnrstore.torch import Checkpointer, KeyedEmbedding

    ids = torch.arange(100, dtype=torch.int64) * 7919
    dumps = []
    for r in range(world):
        m = KeyedEmbedding(64, 4, partitions=P, seed=r)
        opt = torch.optim.Adagrad(m.parameters(), lr=0.1)
        m.bind_optimizer(opt)
        with Checkpointer(tmp_path / f"r{r}", m, opt) as ck:
            for step in range(3):
                mine = ids[(m.owner(ids, world) == r) & (ids % (step + 2) == 0)]
                m(mine).sum().backward()
                opt.step()
                opt.zero_grad()
            ck.save(3).wait()
        dumps.append({"weight": m.weight.detach().numpy(), "slot_ids": m.slot_ids.numpy(),
                      "last_step": m.last_step.numpy(), "count": m.count.numpy(),
                      "sum": opt.state[m.weight]["sum"].numpy()})
    stores = [cnrstore.open(tmp_path / f"r{r}", readonly=True) for r in range(world)]
    return [(s, s.latest().version) for s in stores], _by_id(dumps)


def test_a_rank_with_less_capacity_than_it_owns_keeps_what_its_policy_keeps_and_warns(tmp_path):
    import torch

    from cnrstore.distributed.reshard_keyed import KeyedReshard
    from cnrstore.torch import KeyedEmbedding
    from cnrstore.torch.keyed_save import find_keyed

    sources, union = _rank_stores(tmp_path)
    try:
        m = KeyedEmbedding(20, 4, partitions=P)
        reshard = KeyedReshard(find_keyed(m), sources, 0, 1, 1)
        with pytest.warns(RuntimeWarning, match=f"more than its capacity 20.*drops {len(union) - 20}"):
            reshard.read()
        reshard.load()
        got = _by_id([{"weight": m.weight.detach().numpy(), "slot_ids": m.slot_ids.numpy(),
                       "last_step": m.last_step.numpy(), "count": m.count.numpy(),
                       "sum": reshard.reads["keyed_embedding"]["optim.sum"].numpy()}])
        keys = np.array(sorted(union))
        keep = keep_by_policy(keys, np.array([union[k][1] for k in keys]), np.array([union[k][2] for k in keys]),
                              20, "lru")
        assert got == {int(k): union[int(k)] for k in keys[keep]}
        # a module built with other partitions would own other ids: refused, saying what to build
        with pytest.raises(InvalidArgument, match=f"build it with partitions={P}"):
            KeyedReshard(find_keyed(KeyedEmbedding(200, 4, partitions=8)), sources, 0, 1, 1).read()
        assert torch.equal(m.lookup(torch.from_numpy(keys[keep])), torch.arange(20))
    finally:
        for s, _v in sources:
            s.close()
