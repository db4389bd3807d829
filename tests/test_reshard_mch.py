"""cnrstore/distributed/reshard_mch.py without torchrec processes: the pure-numpy parts (routing blocks, which
old ranks a new rank reads, the overflow choice, the buffers it builds), then a whole remap 2 -> 3 over real
rank stores (one written with keyed groups as mc_saves writes them, one with dense buffers as older versions
did) and a fake MCH module, and its refusals. tests/test_torchrec_mch.py runs it inside DMP-sharded jobs."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

import cnrstore
from cnrstore.distributed import reshard_mch as rm
from cnrstore.distributed.plan import Shard, ShardingPlan
from cnrstore.errors import InvalidArgument
from cnrstore.torch import mc_saves
from cnrstore.torch.payload import DENSE_PREFIX

EMPTY = np.iinfo(np.int64).max
PREFIX = "mc._managed_collision_collection._managed_collision_modules.t."
TABLE = "mc._embedding_module.embedding_bags.t"
MOMENTUM = f"{TABLE}.optim.momentum1"
H, Z, DIM = 24, 12, 2  # raw ids [0, 24), 12 slots


def test_blocks_and_the_old_ranks_a_new_rank_reads():
    assert rm.block(2 ** 20, 3) == 349526 and rm.block(10, 3) == 4 and rm.block(12, 3) == 4
    assert [rm.overlapping(r, 3, 2, 12) for r in range(3)] == [[0], [0, 1], [1]]  # ids [0,4) [4,8) [8,12) of [0,6) [6,12)
    assert [rm.overlapping(r, 2, 3, 12) for r in range(2)] == [[0, 1], [1, 2]]
    assert [rm.overlapping(r, 3, 3, 10) for r in range(3)] == [[0], [1], [2]]
    assert rm.overlapping(2, 3, 1, 10) == [0]


def test_keep_prefers_recent_access_then_counts_then_the_smaller_id():
    ids = np.array([10, 20, 30, 40, 50])
    cols = {rm.LAST_ACCESS: np.array([1, 3, 3, 2, 3]), rm.COUNTS: np.array([9, 1, 5, 7, 5])}
    assert rm.keep(ids, cols, 5).tolist() == [0, 1, 2, 3, 4]  # (all fit)
    assert rm.keep(ids, cols, 9).tolist() == [0, 1, 2, 3, 4]
    assert rm.keep(ids, cols, 4).tolist() == [1, 2, 3, 4]  # last access 3, 3, 3, then 2
    assert rm.keep(ids, cols, 3).tolist() == [1, 2, 4]
    assert rm.keep(ids, cols, 2).tolist() == [2, 4]  # counts 5, 5 over 1
    assert rm.keep(ids, cols, 1).tolist() == [2]  # the smaller id of a tie
    assert rm.keep(ids, {rm.COUNTS: cols[rm.COUNTS]}, 2).tolist() == [0, 3]  # no last access: counts alone
    assert rm.keep(ids, {}, 2).tolist() == [0, 1]
    assert rm.keep(ids[:0], {}, 0).size == 0


def test_buffers_put_the_ids_first_in_slot_order_and_a_fresh_tail():
    dtypes = {rm.kb.MCH_IDS: np.int64, rm.kb.MCH_MAPPING: np.int64, rm.COUNTS: np.int64, rm.LAST_ACCESS: np.int64}
    out = rm.buffers(np.array([7, 9]), {rm.COUNTS: np.array([3, 4]), rm.LAST_ACCESS: np.array([5, 6])}, 8, 4, dtypes)
    assert out[rm.kb.MCH_IDS].tolist() == [7, 9, EMPTY, EMPTY]
    assert out[rm.kb.MCH_MAPPING].tolist() == [8, 9, 10, 11]
    assert out[rm.COUNTS].tolist() == [3, 4, 0, 0] and out[rm.LAST_ACCESS].tolist() == [5, 6, 0, 0]
    with pytest.raises(InvalidArgument, match="keep"):
        rm.buffers(np.arange(5), {}, 0, 4, dtypes)


# -- a whole remap over real rank stores ---------------------------------------------------------------

#: the saved job, 2 ranks (ids [0, 12) and [12, 24); slots [0, 6) and [6, 12)): id -> (slot, counts, last)
OLD = {0: {0: (3, 4, 5), 1: (0, 2, 5), 2: (5, 1, 5), 3: (1, 2, 5), 5: (2, 7, 5), 9: (4, 1, 2)},
       1: {12: (9, 1, 1), 14: (6, 3, 4), 20: (11, 2, 2), 23: (7, 5, 3)}}
ITER = 6


def _row(slot):
    return np.array([slot, slot + 0.5], np.float32)


def _write_old(root, old=None, keyed_ranks=(1,), iters=(ITER, ITER)):
    """The old ranks' stores at version 1 (``old``: OLD): rank r's MCH group (keyed via mc_saves for ``keyed_ranks``, else
    dense buffers), its table rows (row g = [g, g + .5], momentum 10 g) under global row ids."""
    stores = {}
    for r, held in (OLD if old is None else old).items():
        ids = sorted(held)
        slots = list(range(6 * r, 6 * r + 6))
        free = [s for s in slots if s not in [held[i][0] for i in ids]]
        bufs = {PREFIX + rm.kb.MCH_IDS: np.array(ids + [EMPTY] * len(free), np.int64),
                PREFIX + rm.kb.MCH_MAPPING: np.array([held[i][0] for i in ids] + free, np.int64),
                PREFIX + rm.COUNTS: np.array([held[i][1] for i in ids] + [0] * len(free), np.int64),
                PREFIX + rm.LAST_ACCESS: np.array([held[i][2] for i in ids] + [0] * len(free), np.int64)}
        path = str(root / f"rank{r}")
        with cnrstore.open(path, create=True) as st:
            st.create_table(TABLE, num_rows=Z, dim=DIM)
            st.create_table(MOMENTUM, num_rows=Z, dim=1)
            with st.checkpoint(step=ITER) as ck:
                if r in keyed_ranks:
                    left, _done = mc_saves.put_groups(ck, st, bufs)
                    assert not left
                else:
                    for k, a in bufs.items():
                        ck.put_dense(DENSE_PREFIX + k, a)
                ck.put_dense(DENSE_PREFIX + PREFIX + rm.CURRENT_ITER, np.array([iters[r]], np.int64))
                ck.put_rows(TABLE, np.array(slots), np.stack([_row(s) for s in slots]))
                ck.put_rows(MOMENTUM, np.array(slots), np.array(slots, np.float32).reshape(-1, 1) * 10)
        stores[r] = path
    return stores


class FakeMCH(nn.Module):
    """What reshard_mch reads of torchrec's MCHManagedCollisionModule."""

    def __init__(self, offset, size, world, hashed=False, input_size=H):
        super().__init__()
        self.register_buffer("_mch_sorted_raw_ids", torch.full((size,), EMPTY))
        self._output_global_offset, self._size, self._world, self._input = offset, size, world, input_size
        self._input_hash_func = (lambda x, n: x % n) if hashed else None

    def input_size(self):
        return self._input

    def buckets(self):
        return self._world

    def output_size(self):
        return self._size


def _rw_plan(world):
    step = -(-Z // world)
    return ShardingPlan({TABLE: (Z, DIM)}, [Shard(TABLE, r, r * step, min(Z, (r + 1) * step)) for r in range(world)],
                        world, row_ids="global")


def _job(rank, world, stores, old_world=2, extra_state=None, **module):
    """plan()'s arguments for ``rank`` of ``world`` restoring the old stores: a fake DMP model, its state."""
    new_plan = _rw_plan(world)
    shard = new_plan.shards_of(rank)[TABLE]
    mch = FakeMCH(shard.row_start, shard.num_rows, world, **module)
    model = nn.Module()
    model.add_module("_dmp_wrapped_module", nn.Module())
    mc = nn.Module()
    model._dmp_wrapped_module.add_module("mc", mc)
    mc.add_module("_managed_collision_collection", nn.Module())
    mc._managed_collision_collection.add_module("_managed_collision_modules", nn.ModuleDict({"t": mch}))
    n = shard.num_rows
    dense = {PREFIX + rm.kb.MCH_IDS: torch.full((n,), EMPTY), PREFIX + rm.kb.MCH_MAPPING: torch.arange(n) + shard.row_start,
             PREFIX + rm.COUNTS: torch.zeros(n, dtype=torch.int64), PREFIX + rm.LAST_ACCESS: torch.zeros(n, dtype=torch.int64),
             PREFIX + rm.CURRENT_ITER: torch.zeros(1, dtype=torch.int64),
             PREFIX + rm.OUTPUT_SEGMENTS: torch.tensor([s.row_start for s in new_plan.shards_of_table(TABLE)] + [Z])}
    dense.update(extra_state or {})
    state = SimpleNamespace(dense=dense, tables=[SimpleNamespace(name=TABLE)])
    gv = SimpleNamespace(version=3, plan=_rw_plan(old_world), local_versions=(1,) * old_world)
    opened = {}

    def store_of(r):
        if r not in opened:
            opened[r] = cnrstore.open(stores[r], readonly=True)
        return opened[r]

    args = (gv, new_plan, rank, model, state, sorted(dense), new_plan.shards_of(rank), store_of)
    return args, opened, shard


def _remap(rank, world, stores, **kw):
    args, opened, shard = _job(rank, world, stores, **kw)
    remap = rm.plan(*args)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            state = {k: v.numpy() for k, v in remap.state().items()}
        weight = remap.rows(TABLE, TABLE, np.full((shard.num_rows, DIM), -1, np.float32))
        momentum = remap.rows(MOMENTUM, TABLE, np.full((shard.num_rows, 1), -1, np.float32))
        other = np.full((shard.num_rows, DIM), -1, np.float32)
        assert remap.rows("another", "another", other) is other  # (a table no MCH module manages: as read)
    finally:
        for st in opened.values():
            st.close()
    return state, weight, momentum, [str(w.message) for w in caught if w.category is RuntimeWarning], shard


@pytest.mark.parametrize("keyed_ranks", [(1,), (0, 1)])
def test_a_remap_from_2_to_3_ranks_keeps_each_id_with_its_rows_and_metadata(tmp_path, keyed_ranks):
    stores = _write_old(tmp_path, keyed_ranks=keyed_ranks)
    saved = {i: v for held in OLD.values() for i, v in held.items()}
    # new ranks: ids [0, 8) [8, 16) [16, 24), slots [0, 4) [4, 8) [8, 12); rank 0 gets 0 1 2 3 5 for 4 slots:
    # all last accessed at 5, id 2 the least counted: dropped
    want = {0: [0, 1, 3, 5], 1: [9, 12, 14], 2: [20, 23]}
    for rank in range(3):
        state, weight, momentum, warned, shard = _remap(rank, 3, stores)
        ids = state[PREFIX + rm.kb.MCH_IDS]
        n = len(want[rank])
        assert ids.tolist() == want[rank] + [EMPTY] * (shard.num_rows - n)
        assert state[PREFIX + rm.kb.MCH_MAPPING].tolist() == list(range(shard.row_start, shard.row_end))
        assert state[PREFIX + rm.COUNTS].tolist() == [saved[i][1] for i in want[rank]] + [0] * (shard.num_rows - n)
        assert state[PREFIX + rm.LAST_ACCESS].tolist() == [saved[i][2] for i in want[rank]] + [0] * (shard.num_rows - n)
        assert state[PREFIX + rm.CURRENT_ITER].tolist() == [ITER]
        assert state[PREFIX + rm.OUTPUT_SEGMENTS].tolist() == [0, 4, 8, 12]  # (the live layout)
        for j, i in enumerate(want[rank]):  # slot offset + j holds what the id's old slot held
            assert weight[j].tolist() == _row(saved[i][0]).tolist() and momentum[j, 0] == saved[i][0] * 10
        assert (weight[n:] == -1).all() and (momentum[n:] == -1).all()  # (free slots: as the positional read)
        if rank == 0:
            assert len(warned) == 1 and "gets 5 ids" in warned[0] and "dropped 1" in warned[0], warned
        else:
            assert warned == []


def test_a_remap_from_2_to_1_rank_reads_both(tmp_path):
    stores = _write_old(tmp_path)
    state, weight, _m, warned, _s = _remap(0, 1, stores)
    saved = {i: v for held in OLD.values() for i, v in held.items()}
    ids = [i for i in state[PREFIX + rm.kb.MCH_IDS].tolist() if i != EMPTY]
    assert ids == sorted(saved) and warned == []  # (10 ids, 12 slots)
    assert [r.tolist() for r in weight[:10]] == [_row(saved[i][0]).tolist() for i in ids]


def test_refusals(tmp_path):
    stores = _write_old(tmp_path)
    with pytest.raises(InvalidArgument, match="input_hash_func"):
        rm.plan(*_job(0, 3, stores, hashed=True)[0])
    with pytest.raises(InvalidArgument, match="input size 0"):
        rm.plan(*_job(0, 3, stores, input_size=0)[0])
    with pytest.raises(InvalidArgument, match="_mch_history"):
        rm.plan(*_job(0, 3, stores, extra_state={PREFIX + "_mch_history": torch.zeros(3)})[0])
    zch = {"mc._managed_collision_collection._managed_collision_modules.u._hash_zch_identities": torch.full((4, 1), -1),
           "mc._managed_collision_collection._managed_collision_modules.u._hash_zch_metadata": torch.zeros((4, 1),
                                                                                                      dtype=torch.int32)}
    with pytest.raises(InvalidArgument, match="MPZCH"):
        rm.plan(*_job(0, 3, stores, extra_state=zch)[0])

    class FakeZch(nn.Module):  # an MPZCH module whose buckets do not divide 3 ranks
        _hash_zch_identities = None

        def buckets(self):
            return 4

    args = _job(0, 3, stores, extra_state=zch)[0]
    args[3]._dmp_wrapped_module.mc._managed_collision_collection._managed_collision_modules["u"] = FakeZch()
    with pytest.raises(InvalidArgument, match="total_num_buckets 4, not a multiple of world size 3"):
        rm.plan(*args)
    args = _job(0, 2, stores)[0]
    assert rm.plan(args[0], args[0].plan, *args[2:]) is None  # (the same plan: each rank's state is its own)


def test_refused_when_the_old_ranks_disagree_or_ids_were_routed_otherwise(tmp_path):
    stores = _write_old(tmp_path / "a", iters=(ITER, ITER + 1))
    args, opened, _shard = _job(1, 3, stores)  # (rank 1 reads both old ranks)
    with pytest.raises(InvalidArgument, match="disagree"):
        rm.plan(*args).state()
    for st in opened.values():
        st.close()
    old = {0: {**{i: v for i, v in OLD[0].items() if i != 5}, 13: OLD[0][5]}, 1: OLD[1]}  # (13: old rank 1's id)
    stores = _write_old(tmp_path / "b", old)
    args, opened, _shard = _job(0, 3, stores)
    with pytest.raises(InvalidArgument, match="routed otherwise"):
        rm.plan(*args).state()
    for st in opened.values():
        st.close()
