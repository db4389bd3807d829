"""cnrstore/distributed/export.py: one unsharded snapshot of a global version, assembled from rank stores
written here by hand (no process group: the root's files are what a DistributedCheckpointer leaves).
The same from real spawned jobs, exported and loaded into the unsharded model: test_export_merged.py."""

from __future__ import annotations

import numpy as np
import pytest

import cnrstore
from cnrstore.distributed import GlobalVersion, Root, ShardingPlan
from cnrstore.distributed.export import is_root, merged_snapshot
from cnrstore.errors import CorruptionError, InvalidArgument, StoreNotFound, VersionNotFound
from cnrstore.export import export_path

TABLES = {"emb": (10, 2), "small": (3, 4)}


def table(name: str, version: int) -> np.ndarray:
    """What global version ``version`` holds of table ``name``: row ``i`` is ``(version, i, ...)``."""
    rows, dim = TABLES[name]
    out = np.zeros((rows, dim), np.float32)
    out[:, 0] = version
    out[:, 1] = np.arange(rows)
    return out


def make_root(path, plan: ShardingPlan, versions=(1, 2), *, optim: bool = True) -> Root:
    """A root whose rank stores hold each version's shards (row-wise state ``emb.optim.sum`` of ``emb``
    too), dense arrays on every rank, and a manifest per version."""
    root = Root(str(path))
    root.create()
    gen = root.generation_for(plan)
    stores = [cnrstore.open(root.store_path(root.store_rel(gen, r)), create=True) for r in range(plan.world_size)]
    try:
        for rank, st in enumerate(stores):
            for name, shard in plan.shards_of(rank).items():
                st.create_table(name, shard.num_rows, TABLES[name][1], codec="fp32")
                if optim and name == "emb":
                    st.create_table("emb.optim.sum", shard.num_rows, 1, codec="fp32")
        for v in versions:
            local = []
            for rank, st in enumerate(stores):
                with st.checkpoint() as ck:
                    for name, shard in plan.shards_of(rank).items():
                        rows = np.arange(shard.num_rows)
                        ck.put_rows(name, rows, table(name, v)[shard.row_start:shard.row_end])
                        if optim and name == "emb":
                            ck.put_rows("emb.optim.sum", rows, np.full((rows.size, 1), rank, np.float32))
                    ck.put_dense("torch.model/top.weight", np.full(3, 10 * v + rank, np.float32))
                    ck.put_dense("other", np.zeros(1))
                local.append(ck.version)
            root.commit(GlobalVersion(version=v, step=100 * v, meta={"v": v}, created=0.0, generation=gen,
                                      plan=plan, local_versions=tuple(local),
                                      stores=tuple(root.store_rel(gen, r) for r in range(plan.world_size))))
    finally:
        for st in stores:
            st.close()
    return root


@pytest.mark.parametrize("cut", ["row_wise", "table_wise"])
def test_a_global_version_reads_as_the_unsharded_tables_with_rank_0s_dense_state(tmp_path, cut):
    plan = getattr(ShardingPlan, cut)(TABLES, 3)
    root = make_root(tmp_path / "root", plan)
    assert is_root(root.path) and not is_root(tmp_path)
    for v in (1, 2):
        snap = merged_snapshot(root.path, v)
        assert (snap.version, snap.step, snap.meta) == (v, 100 * v, {"v": v})
        for name in TABLES:
            assert np.array_equal(snap.tables[name], table(name, v)), (cut, name)
        owner = np.concatenate([np.full(s.num_rows, s.rank) for s in plan.shards_of_table("emb")])
        assert snap.tables["emb.optim.sum"][:, 0].tolist() == owner.tolist()     # each shard's own state
        assert set(snap.dense) == {"torch.model/top.weight"}                      # rank 0's model arrays only
        assert snap.dense["torch.model/top.weight"].tolist() == [10 * v] * 3
    assert merged_snapshot(root.path).version == 2                                  # default: the newest


def test_a_row_state_some_shard_lacks_has_no_merged_form(tmp_path):
    plan = ShardingPlan.row_wise(TABLES, 2)
    root = make_root(tmp_path / "root", plan, optim=False)
    assert set(merged_snapshot(root.path).tables) == set(TABLES)


def test_export_path_of_a_root_writes_the_merged_model(tmp_path):
    root = make_root(tmp_path / "root", ShardingPlan.row_wise(TABLES, 2))
    report = export_path(root.path, "npz", tmp_path / "m.npz", version=1)
    assert report.merged and report.version == 1 and report.layout == "nested"
    with np.load(tmp_path / "m.npz") as z:
        assert np.array_equal(z["tables/emb"], table("emb", 1))


def test_what_is_no_root_or_no_version_says_so(tmp_path):
    with pytest.raises(StoreNotFound):
        merged_snapshot(tmp_path)
    empty = Root(str(tmp_path / "empty"))
    empty.create()
    with pytest.raises(InvalidArgument, match="no global version yet"):
        merged_snapshot(empty.path)
    root = make_root(tmp_path / "root", ShardingPlan.row_wise(TABLES, 2), versions=(1,))
    with pytest.raises(VersionNotFound):
        merged_snapshot(root.path, 5)


def test_a_rank_store_without_its_shard_is_a_damaged_root(tmp_path):
    plan = ShardingPlan.row_wise(TABLES, 2)
    root = make_root(tmp_path / "root", plan, versions=(1,))
    other = ShardingPlan.row_wise({**TABLES, "extra": (4, 2)}, 2)       # claims a table no store has
    gen = root.generation_for(other)
    root.commit(GlobalVersion(version=2, step=0, meta=None, created=0.0, generation=gen, plan=other,
                              local_versions=(1, 1), stores=tuple(root.store_rel(1, r) for r in range(2))))
    with pytest.raises(InvalidArgument, match="rank 0's store has no table for table 'extra'"):
        merged_snapshot(root.path, 2)


def test_a_plan_claiming_more_rows_than_the_segments_hold_fails_before_allocating(tmp_path):
    huge = {"emb": (2 * 10**9, 2)}
    plan = ShardingPlan.row_wise(huge, 1)
    root = Root(str(tmp_path / "root"))
    root.create()
    gen = root.generation_for(plan)
    with cnrstore.open(root.store_path(root.store_rel(gen, 0)), create=True) as st:
        st.create_table("emb", 2 * 10**9, 2, codec="fp32")      # a catalog that agrees with the plan
        with st.checkpoint() as ck:
            ck.put_rows("emb", [0], np.ones((1, 2), np.float32))
    root.commit(GlobalVersion(version=1, step=0, meta=None, created=0.0, generation=gen, plan=plan,
                              local_versions=(1,), stores=(root.store_rel(gen, 0),)))
    with pytest.raises(CorruptionError, match="claims more than the root holds"):
        merged_snapshot(root.path)
