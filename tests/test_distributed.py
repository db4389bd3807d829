"""cnrstore.distributed on spawned gloo groups of 2-4 CPU processes (tests/support/dist_worker.py is one rank).

Each test starts real processes joined by a FileStore rendezvous, and compares the global tables that the
ranks' dumps assemble to: bit-exact round trips (fp32), SIGKILL of one rank in a save, resharding 4 -> 2
and 2 -> 4 ranks, row-wise <-> table-wise, partial recovery of one replaced rank, the same with a list of
optimizers, and SIGTERM of the ranks.
"""

from __future__ import annotations

import pytest

from support.dist_jobs import assemble, assert_ok, assert_same_state, check_partial_recovery, run_job

from cnrstore.distributed import Root, ShardingPlan, versions
from cnrstore.errors import InvalidArgument, StoreNotFound


# -- pure parts (the sharding plan's own tests: test_distributed_plan.py) ----------------------------------

def test_versions_of_a_missing_root(tmp_path):
    with pytest.raises(StoreNotFound):
        versions(tmp_path / "nothing")


def test_constructor_needs_a_process_group(tmp_path):
    import torch
    from cnrstore.distributed import DistributedCheckpointer
    with pytest.raises(InvalidArgument, match="init_process_group"):
        DistributedCheckpointer(tmp_path, torch.nn.Linear(2, 2),
                                plan=ShardingPlan.row_wise({"a": (4, 2)}, 1))


# -- spawned jobs -------------------------------------------------------------------------------------------

def test_round_trip_is_bit_exact_and_commits_in_order(tmp_path):
    assert_ok(run_job(tmp_path, "save", 2, train=[3, 2, 4]))
    gvs = versions(tmp_path / "root")
    assert [g.version for g in gvs] == [1, 2, 3]
    assert [g.step for g in gvs] == [3, 5, 9]
    assert all(g.world_size == 2 and len(set(g.local_versions)) >= 1 for g in gvs)
    for g in (1, 3):
        assert_ok(run_job(tmp_path, "restore", 2, tag=f"r{g}", version=g, seed=99))
        assert_same_state(assemble(tmp_path / "out", f"g{g}"), assemble(tmp_path / "out", f"restored-g{g}"),
                          skip=())


@pytest.mark.parametrize("src,dst", [(4, 2), (2, 4)])
def test_reshard_restore_between_world_sizes(tmp_path, src, dst):
    assert_ok(run_job(tmp_path, "save", src, tag="a", train=[3, 4]))
    saved = assemble(tmp_path / "out", "g2")
    assert_ok(run_job(tmp_path, "restore", dst, tag="b", seed=7, then_save=True))
    assert_same_state(saved, assemble(tmp_path / "out", "restored-g2"), skip=())
    gvs = versions(tmp_path / "root")
    assert [g.world_size for g in gvs] == [src, src, dst]
    assert gvs[-1].generation == gvs[0].generation + 1  # a new plan starts a new generation
    # and the version written after resharding restores under the new plan
    assert_ok(run_job(tmp_path, "restore", dst, tag="c", seed=3))
    assert_same_state(assemble(tmp_path / "out", "g3"), assemble(tmp_path / "out", "restored-g3"), skip=())


def test_a_list_of_optimizers_round_trips_and_reshards(tmp_path):
    # optimizer=[Adagrad on the shards, Adam on the dense layers]: every state of both comes back, in place and
    # resharded (row-wise -> table-wise: each optimizer's state by parameter name)
    assert_ok(run_job(tmp_path, "save", 2, tag="a", train=[3, 2], optimizers="split"))
    saved = assemble(tmp_path / "out", "g2")
    assert {"emb.t0/sum", "mlp/0.weight/exp_avg", "mlp/0.weight/exp_avg_sq", "mlp/0.weight/adam_step"} <= set(saved)
    assert not any(k.startswith("mlp/") and k.endswith("/sum") for k in saved)   # (Adam's, not Adagrad's)
    assert_ok(run_job(tmp_path, "restore", 2, tag="b", seed=9, optimizers="split"))
    assert_same_state(saved, assemble(tmp_path / "out", "restored-g2"), skip=())
    assert_ok(run_job(tmp_path, "restore", 2, tag="c", plan="table", seed=7, optimizers="split"))
    assert_same_state(saved, assemble(tmp_path / "out", "restored-g2"), skip=())


def test_reshard_restore_row_wise_to_table_wise(tmp_path):
    assert_ok(run_job(tmp_path, "save", 3, tag="a", train=[5]))
    assert_ok(run_job(tmp_path, "restore", 2, tag="b", plan="table", seed=5))
    assert_same_state(assemble(tmp_path / "out", "g1"), assemble(tmp_path / "out", "restored-g1"), skip=())


@pytest.mark.parametrize("crash_rank,crash_at,survives", [
    (1, "after_append", 1),            # rank 1 dies inside its local write
    (1, "after_fsync", 1),             # its local version is durable but never committed globally
    (0, "dist_before_manifest", 1),    # rank 0 dies with every local version durable
    (0, "dist_after_manifest", 2),     # the manifest is written: the global version exists
])
def test_sigkill_of_one_rank_in_a_save_leaves_the_previous_global_version_whole(tmp_path, crash_rank, crash_at,
                                                                                    survives):
    results = run_job(tmp_path, "crash", 2, crash_rank=crash_rank, crash_at=crash_at, timeout=20)
    assert results[crash_rank][0] == -9, results[crash_rank][1][-2000:]
    other = 1 - crash_rank
    assert results[other][0] == 0, results[other][1][-3000:]
    gvs = versions(tmp_path / "root")
    assert [g.version for g in gvs] == list(range(1, survives + 1))
    # the job restarts and restores the newest global version whole
    assert_ok(run_job(tmp_path, "restore", 2, tag="again", seed=11))
    if survives == 1:
        assert_same_state(assemble(tmp_path / "out", "g1"), assemble(tmp_path / "out", "restored-g1"), skip=())
    # orphaned local versions were dropped at start-up: every local version is referenced
    root = Root(tmp_path / "root")
    import cnrstore
    for r in range(2):
        with cnrstore.open(root.store_path(root.store_rel(gvs[0].generation, r)), readonly=True) as st:
            assert {v.version for v in st.versions()} == {g.local_versions[r] for g in gvs}


def test_partial_recovery_restores_only_the_failed_rank(tmp_path):
    check_partial_recovery(tmp_path)


@pytest.mark.parametrize("signalled", [(0, 1), (0,), (1,)])
def test_sigterm_after_save_returned_commits_its_global_version_then_exits_143(tmp_path, signalled):
    # each rank's Checkpointer handles SIGTERM (on_sigterm="finish"): the with block's close() waits for the global
    # commit in flight, which the commit threads of every rank complete, signalled (as a preemption) or not
    results = run_job(tmp_path, "sigterm", 2, signalled=list(signalled), where="after_save", timeout=30)
    for rank, (rc, text) in enumerate(results):
        assert rc == (143 if rank in signalled else 0), f"rank {rank} exited {rc}:\n{text[-3000:]}"
        assert f"rank {rank}: save of step 4 returned" in text
        assert rank in signalled or f"rank {rank}: global version 2" in text, text[-3000:]
    assert [g.step for g in versions(tmp_path / "root")] == [2, 4]


def test_sigterm_inside_one_ranks_save_keeps_the_save_that_returned_on_the_others(tmp_path):
    # a SIGTERM that lands inside one rank's save() (here between its local save and the start of its global
    # commit) is held until that rank has taken its part: the save that returned on the other rank commits
    # (it used to raise GlobalCommitError there: the signalled rank never joined the commit)
    results = run_job(tmp_path, "sigterm", 2, signalled=[0], where="inside_save", timeout=30)
    assert results[0][0] == 143, results[0][1][-3000:]
    assert "rank 1: save of step 4 returned" in results[1][1]
    assert [g.step for g in versions(tmp_path / "root")] == [2, 4]   # [2]: rank 1's wait() raised GlobalCommitError


def test_partial_recovery_with_a_list_of_optimizers(tmp_path):
    # the replaced rank gets each optimizer's state of the dense replicas (Adam's here) from a survivor
    check_partial_recovery(tmp_path, optimizers="split")
