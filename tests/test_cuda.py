"""cnrstore.torch and cnrstore.distributed with the model on a CUDA device.

Skipped where torch sees no GPU (CI has none); run on a lent GPU machine with ``pytest tests/test_cuda.py``.
The same properties as the CPU tests: tracking catches every looked-up row, every mode writes exactly the
rows it must, restores are bit-exact (fp32) or equal the decoded saved rows (int4), a store written from
CUDA restores onto the CPU and back, and a one-rank NCCL job saves and restores through its own gloo group.
The staged snapshot: pinned host buffers reused across saves, the ordering of the trainer's next in-place
write after the snapshot's reads, and a save() stall below a synchronous copy's.
"""

from __future__ import annotations

import copy
from datetime import timedelta

import numpy as np
import pytest
import torch
from torch import nn

import cnrstore
from cnrstore.torch import Checkpointer

from support.torch_models import Loader, batch, check_int4_restore, make, train_step
from support.torch_state import assert_state_equal

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CUDA = torch.device("cuda")


def on_cpu(state):
    """A deep copy of a state dict with every tensor on the CPU (for comparing across devices)."""
    if torch.is_tensor(state):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        return {k: on_cpu(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(on_cpu(v) for v in state)
    return copy.deepcopy(state)


@pytest.mark.parametrize("mode", ["incremental", "one-shot", "intermittent"])
@pytest.mark.parametrize("optim", ["adagrad", "adam", "sgd"])
def test_cuda_save_train_restore_is_bit_exact_at_every_version(store, optim, mode):
    model, opt = make(0, optim, CUDA)
    loader = Loader()
    ck = Checkpointer(store, model, opt, codec="fp32", mode=mode, extra={"loader": loader})
    expected = {}
    for _ in range(5):
        for _ in range(2):
            train_step(model, opt, loader.next())
        v = ck.save(step=loader.position).wait()
        expected[v] = (on_cpu(model.state_dict()), on_cpu(opt.state_dict()), loader.position)
    for v, (want_model, want_opt, position) in expected.items():
        train_step(model, opt, loader.next())
        info = ck.restore(v)
        assert info.version == v and loader.position == position
        assert model.emb.weight.device.type == "cuda"
        assert all(t.device.type == "cuda" for st in opt.state.values() for t in st.values()
                   if torch.is_tensor(t) and t.dim() > 0)
        assert_state_equal(want_model, on_cpu(model.state_dict()))
        assert_state_equal(want_opt, on_cpu(opt.state_dict()))
    ck.close()


def test_cuda_incremental_save_writes_exactly_the_looked_up_rows(store):
    model, _ = make(0, "sgd", CUDA)
    ck = Checkpointer(store, model, codec="fp32", mode="incremental")
    ck.save(0).wait()  # the baseline
    ids = torch.tensor([3, 7, 7, 41], device=CUDA)
    bag_ids = torch.tensor([0, 5, 39], device=CUDA)
    model.emb(ids)  # (a lookup under no_grad is not tracked: it changes no row)
    model.bag(bag_ids, torch.tensor([0], device=CUDA))
    pending = ck.save(1)
    pending.wait()
    report = pending.report
    assert report.rows["emb"] == 3 and report.rows["bag"] == 3
    ck.close()


def test_a_store_written_from_cuda_restores_on_cpu_and_back(tmp_path):
    cuda_model, cuda_opt = make(0, "adagrad", CUDA)
    with cnrstore.open(str(tmp_path / "from-cuda"), create=True) as store:
        ck = Checkpointer(store, cuda_model, cuda_opt, codec="fp32")
        for i in range(3):
            train_step(cuda_model, cuda_opt, batch(i))
        ck.save(3).wait()
        ck.close()
    cpu_model, cpu_opt = make(7, "adagrad", "cpu")
    with cnrstore.open(str(tmp_path / "from-cuda")) as store:
        ck = Checkpointer(store, cpu_model, cpu_opt, codec="fp32")
        ck.restore()
        ck.close()
    assert_state_equal(on_cpu(cuda_model.state_dict()), cpu_model.state_dict())
    assert_state_equal(on_cpu(cuda_opt.state_dict()), cpu_opt.state_dict())

    for i in range(3, 5):
        train_step(cpu_model, cpu_opt, batch(i))
    with cnrstore.open(str(tmp_path / "from-cpu"), create=True) as store:
        ck = Checkpointer(store, cpu_model, cpu_opt, codec="fp32")
        ck.save(5).wait()
        ck.close()
    back_model, back_opt = make(9, "adagrad", CUDA)
    with cnrstore.open(str(tmp_path / "from-cpu")) as store:
        ck = Checkpointer(store, back_model, back_opt, codec="fp32")
        ck.restore()
        ck.close()
    assert back_model.emb.weight.device.type == "cuda"
    assert_state_equal(cpu_model.state_dict(), on_cpu(back_model.state_dict()))
    assert_state_equal(cpu_opt.state_dict(), on_cpu(back_opt.state_dict()))


def test_cuda_sparse_embedding_with_sparse_adam(store):
    torch.manual_seed(0)
    emb = nn.Embedding(200, 8, sparse=True).to(CUDA)
    model = nn.ModuleDict({"emb": emb})
    opt = torch.optim.SparseAdam(list(model.parameters()), lr=0.01)
    ck = Checkpointer(store, model, opt, codec="fp32", mode="incremental")

    def step(i):
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(0, 200, (16,), generator=g).to(CUDA)
        opt.zero_grad()
        emb(ids).pow(2).sum().backward()
        opt.step()

    for i in range(3):
        step(i)
        ck.save(i).wait()
    want_model, want_opt = on_cpu(model.state_dict()), on_cpu(opt.state_dict())
    for i in range(3, 6):
        step(i)
    ck.restore()
    assert_state_equal(want_model, on_cpu(model.state_dict()))
    assert_state_equal(want_opt, on_cpu(opt.state_dict()))
    ck.close()


def test_cuda_int4_restore_gives_the_decoded_saved_rows(store):
    check_int4_restore(store, CUDA)


@pytest.mark.parametrize("priority", ["mfu", "ssu"])
def test_cuda_priority_save_writes_the_most_looked_up_rows(store, priority):
    model, _ = make(0, "sgd", CUDA)
    ck = Checkpointer(store, model, codec="fp32", mode="incremental", priority=priority, ssu_rate=1.0)
    ck.save(0).wait()
    hot = torch.tensor([4] * 9 + [11] * 5 + [30], device=CUDA)
    model.emb(hot)
    pending = ck.save(1, top=2 / 50)
    pending.wait()
    report = pending.report
    assert report.priority and report.rows["emb"] == 2
    v = store.versions()[-1].version
    rows = store.read_rows("emb", np.array([4, 11], dtype=np.int64), version=v)
    np.testing.assert_array_equal(rows, model.emb.weight.detach().cpu().numpy()[[4, 11]])
    ck.close()


def test_one_rank_nccl_job_saves_and_restores_bit_exact(tmp_path):
    import torch.distributed as dist

    from cnrstore.distributed import DistributedCheckpointer, ShardingPlan

    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'rdzv'}", rank=0, world_size=1,
                            timeout=timedelta(seconds=60), device_id=torch.device("cuda", 0))
    try:
        tables = {"emb.a": (50, 4), "emb.b": (30, 2)}
        torch.manual_seed(0)
        model = nn.Module()
        model.emb = nn.ModuleDict({k.split(".")[1]: nn.EmbeddingBag(n, d, mode="sum") for k, (n, d) in tables.items()})
        model.lin = nn.Linear(3, 1)
        model.to(CUDA)
        opt = torch.optim.Adagrad(model.parameters(), lr=0.1)

        def step(rows):
            loss = model.lin(torch.ones(2, 3, device=CUDA)).sum()
            for bag in model.emb.values():
                loss = loss + bag(torch.tensor(rows, device=CUDA), torch.tensor([0], device=CUDA)).pow(2).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()

        ck = DistributedCheckpointer(str(tmp_path / "root"), model, opt, plan=ShardingPlan.row_wise(tables, 1),
                                     codec="fp32", mode="incremental", keep_last=2)
        step((1, 2, 3))
        ck.save(1).wait()
        step((4, 5))
        ck.save(2).wait()
        want_model, want_opt = on_cpu(model.state_dict()), on_cpu(opt.state_dict())
        step((6, 7))
        gv = ck.restore()
        assert gv.step == 2
        assert_state_equal(want_model, on_cpu(model.state_dict()))
        assert_state_equal(want_opt, on_cpu(opt.state_dict()))
        ck.close()
    finally:
        dist.destroy_process_group()


# -- the staged snapshot (cnrstore/torch/staging.py): pinned buffers, a side stream, the ordering contract --

def test_cuda_snapshot_stages_into_pinned_buffers_reused_across_saves(store):
    from cnrstore.torch.staging import CudaBackend

    model, opt = make(0, "adagrad", CUDA)
    ck = Checkpointer(store, model, opt, codec="fp32", mode="incremental")
    assert isinstance(ck.stager.backend(model.emb.weight.device), CudaBackend)
    ptrs = None
    for i in range(4):
        train_step(model, opt, batch(i))
        ck.save(i).wait()
        bufs = {(t.name, key): buf for t in ck.trainer_state().tables for key, buf in t.buffers.items()}
        assert ("emb", "emb.optim.sum") in bufs and all(buf.is_pinned() for buf in bufs.values())
        now = {k: buf.data_ptr() for k, buf in bufs.items()}
        if ptrs is not None:
            assert now == ptrs  # the baseline's buffers serve every increment
        ptrs = now
    want = on_cpu(model.state_dict()), on_cpu(opt.state_dict())
    train_step(model, opt, batch(9))
    ck.restore()
    assert_state_equal(want[0], on_cpu(model.state_dict()))
    assert_state_equal(want[1], on_cpu(opt.state_dict()))
    ck.close()


def test_cuda_save_reads_the_weights_before_the_trainers_next_in_place_write(tmp_path):
    """save() returns with its copies in flight on the side stream; the trainer's stream at once writes
    every row in place. The version holds the rows as they were at save(): the trainer's stream waited for
    the snapshot's reads (a 256 MiB table: the copies take milliseconds, the race is real)."""
    rows, dim = 1 << 20, 64
    with cnrstore.open(str(tmp_path / "s"), create=True) as store:
        emb = nn.Embedding(rows, dim).to(CUDA)
        ck = Checkpointer(store, nn.ModuleDict({"emb": emb}), codec="fp32", mode="incremental")
        w = emb.weight
        with torch.no_grad():
            w.fill_(1.0)
        first = ck.save(1)  # a baseline: every row, copied straight from the weight
        with torch.no_grad():
            w.add_(1.0)
        v1 = first.wait()
        emb(torch.arange(0, rows, 2, device=CUDA))  # tracked: the even rows
        second = ck.save(2)  # an increment: index_select on the side stream, then device-to-host
        with torch.no_grad():
            w.mul_(10.0)
        v2 = second.wait()
        got1 = store.read_table("emb", version=v1)
        got2 = store.read_table("emb", version=v2)
        ck.close()
    assert (got1 == 1.0).all()
    assert (got2[0::2] == 2.0).all() and (got2[1::2] == 1.0).all()


def test_cuda_save_stalls_less_than_a_synchronous_copy(store):
    """The trainer's stall in save() (launching the side stream's copies) against a synchronous
    device-to-host copy of the same rows, both measured here (every row of a 512 MiB table)."""
    import statistics
    import time

    rows, dim = 1 << 21, 64
    emb = nn.Embedding(rows, dim).to(CUDA)
    ck = Checkpointer(store, nn.ModuleDict({"emb": emb}), codec="fp32", mode="incremental")
    ids = torch.arange(rows, device=CUDA)
    ck.save(0).wait()  # the baseline (and the pinned buffer's allocation)
    stalls, syncs = [], []
    for i in range(3):
        emb(ids)  # every row looked up: the increment gathers them all
        torch.cuda.synchronize()
        pending = ck.save(i + 1)
        stalls.append(pending.report.stall_s)
        pending.wait()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        emb.weight.detach().index_select(0, ids).cpu()
        syncs.append(time.perf_counter() - t0)
    ck.close()
    stall, sync = statistics.median(stalls), statistics.median(syncs)
    print(f"save() stall {stall * 1e3:.2f} ms, synchronous copy {sync * 1e3:.2f} ms ({sync / stall:.1f}x)")
    assert stall < 0.5 * sync


def test_watched_object_collectives_on_a_one_rank_nccl_group(tmp_path):
    """cnrstore.distributed.failures' object collectives under a failure watch carry their messages on the
    current CUDA device when the group is NCCL's (a trainer's own default group)."""
    import torch.distributed as dist

    from cnrstore.distributed import failures

    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'rdzv'}", rank=0, world_size=1,
                            timeout=timedelta(seconds=60), device_id=torch.device("cuda", 0))
    board = failures.FailureBoard()
    failures.install(failures.FailureWatch(board.host, board.port, rank=0, epoch=0))
    try:
        assert failures.message_device().type == "cuda"
        got = [None]
        failures.all_gather_object(got, {"rows": [1, 2]})
        assert got == [{"rows": [1, 2]}]
        answer = [("ok", 3)]
        failures.broadcast_object_list(answer, src=0)
        assert answer == [("ok", 3)]
    finally:
        failures.uninstall()
        dist.destroy_process_group()


# -- several ranks sharing the one GPU: a gloo default group (NCCL refuses two ranks on one device) ----------

def test_two_cuda_ranks_save_and_a_cpu_job_restores_bit_exact(tmp_path):
    from support.dist_jobs import assemble, assert_ok, assert_same_state, run_job

    assert_ok(run_job(tmp_path, "save", 2, train=[3, 2], device="cuda"))
    assert_ok(run_job(tmp_path, "restore", 2, tag="cpu", version=2, seed=99))
    assert_same_state(assemble(tmp_path / "out", "g2"), assemble(tmp_path / "out", "restored-g2"), skip=())
    assert_ok(run_job(tmp_path, "restore", 2, tag="cuda", version=1, seed=98, device="cuda"))
    assert_same_state(assemble(tmp_path / "out", "g1"), assemble(tmp_path / "out", "restored-g1"), skip=())


def test_cuda_partial_recovery_restores_only_the_failed_rank(tmp_path):
    from support.dist_jobs import check_partial_recovery

    check_partial_recovery(tmp_path, device="cuda")


def test_cuda_ecrm_recovers_one_killed_rank_bit_exactly(tmp_path, tmp_path_factory):
    from support.ecrm_jobs import assert_bit_equal, run_job

    ref, _ = run_job(tmp_path_factory.mktemp("ref"), "ref", 3, 2, 1, device="cuda")
    states, reports = run_job(tmp_path, "kill", 3, 2, 1, victims=[1], crash="kill", device="cuda")
    assert_bit_equal(states, ref)
    assert {rep["recoveries"][-1]["mode"] for rep in reports.values()} == {"ecrm"}
    cpu, _ = run_job(tmp_path_factory.mktemp("cpu"), "cpu", 3, 2, 1)
    for q in ref:  # the same training on the CPU ends in the same embeddings, to float rounding
        for key in ref[q]:
            if key.startswith("model/emb."):
                np.testing.assert_allclose(ref[q][key], cpu[q][key], rtol=1e-5, atol=1e-6)
