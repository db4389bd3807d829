"""cnrstore.distributed in a one-rank gloo group inside the test process: retention, generations, errors,
corruption and priority saves (the multi-process behaviour is in test_distributed.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import cnrstore
from cnrstore.distributed import DistributedCheckpointer, Root, ShardingPlan, versions
from cnrstore.errors import CorruptionError, InvalidArgument
from cnrstore.policy import CompactionPolicy, KeepLast, Retention

from support.torch_models import ShardModel

TABLES = {"emb.a": (50, 4), "emb.b": (30, 2)}


def Model(tables=TABLES, seed=0):
    return ShardModel(tables, seed)


def step(model, opt, rows=(1, 2, 3)):
    loss = model.lin(torch.ones(2, 3)).sum()
    for bag in model.emb.values():
        loss = loss + bag(torch.tensor(rows), torch.tensor([0])).pow(2).sum()
    opt.zero_grad()
    loss.backward()
    opt.step()


def make(root, model=None, **kw):
    model = model or Model()
    opt = torch.optim.Adagrad(model.parameters(), lr=0.1)
    kw.setdefault("codec", "fp32")
    return DistributedCheckpointer(root, model, opt, plan=ShardingPlan.row_wise(TABLES, 1), **kw), model, opt


def test_keep_last_drops_old_global_versions_and_their_local_versions(tmp_path, group):
    ck, model, opt = make(tmp_path / "root", keep_last=2, mode="incremental")
    for i in range(5):
        step(model, opt, rows=(i, i + 1))
        ck.save(step=i).wait()
    gvs = ck.versions()
    assert [g.version for g in gvs] == [4, 5]
    assert {v.version for v in ck.store.versions()} >= {g.local_versions[0] for g in gvs}
    # local versions older than the newest referenced one and referenced by no global version are gone
    assert {v.version for v in ck.store.versions()} == {g.local_versions[0] for g in gvs}
    want = {k: v.detach().clone() for k, v in model.state_dict().items()}
    step(model, opt)
    ck.restore()
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, want[k], rtol=0, atol=0)
    ck.close()


def test_a_new_plan_starts_a_new_generation_and_old_ones_go_once_unreferenced(tmp_path, group):
    root = tmp_path / "root"
    ck, model, opt = make(root)
    step(model, opt)
    ck.save(step=1).wait()
    ck.close()
    # a model with one more table: another plan, so another generation; version 1 stays restorable
    tables2 = dict(TABLES, **{"emb.c": (10, 3)})
    model2 = Model(tables2, seed=1)
    opt2 = torch.optim.Adagrad(model2.parameters(), lr=0.1)
    with pytest.raises(InvalidArgument, match="tables"):  # a restore needs the same tables
        with DistributedCheckpointer(root, model2, opt2, plan=ShardingPlan.row_wise(tables2, 1), codec="fp32") as ck2:
            ck2.restore(1)
    ck2 = DistributedCheckpointer(root, model2, opt2, plan=ShardingPlan.row_wise(tables2, 1), codec="fp32",
                                  keep_last=1)
    assert ck2.generation == 2
    ck2.save(step=2).wait()
    ck2.close()
    assert [g.generation for g in versions(root)] == [2]
    assert not os.path.exists(Root(root).gen_dir(1))  # nothing refers to generation 1 any more


def test_model_and_plan_must_agree(tmp_path, group):
    model = Model()
    opt = torch.optim.Adagrad(model.parameters())
    with pytest.raises(InvalidArgument, match="does not\\s+give this rank|not give"):
        DistributedCheckpointer(tmp_path, model, opt, plan=ShardingPlan.row_wise({"emb.a": (50, 4)}, 1))
    with pytest.raises(InvalidArgument, match="shard"):
        DistributedCheckpointer(tmp_path, model, opt,
                                plan=ShardingPlan.row_wise({"emb.a": (51, 4), "emb.b": (30, 2)}, 1))
    with pytest.raises(InvalidArgument, match="no\\s+embedding module"):
        DistributedCheckpointer(tmp_path, model, opt,
                                plan=ShardingPlan.row_wise(dict(TABLES, **{"emb.z": (5, 1)}), 1))
    with pytest.raises(InvalidArgument, match="ranks"):
        DistributedCheckpointer(tmp_path, model, opt, plan=ShardingPlan.row_wise(TABLES, 2))
    with pytest.raises(InvalidArgument, match="retention"):
        DistributedCheckpointer(tmp_path, model, opt, plan=ShardingPlan.row_wise(TABLES, 1),
                                compaction=CompactionPolicy(retention=Retention(KeepLast(2))))
    with pytest.raises(InvalidArgument, match="keep_last"):
        DistributedCheckpointer(tmp_path, model, opt, plan=ShardingPlan.row_wise(TABLES, 1), keep_last=0)


def test_restore_without_versions_and_unknown_version(tmp_path, group):
    ck, _model, _opt = make(tmp_path / "root")
    with pytest.raises(InvalidArgument, match="save"):
        ck.restore()
    with pytest.raises(cnrstore.VersionNotFound):
        ck.restore(7)
    ck.close()


def test_a_corrupted_manifest_is_reported(tmp_path, group):
    ck, model, opt = make(tmp_path / "root")
    step(model, opt)
    ck.save(step=1).wait()
    ck.close()
    path = tmp_path / "root" / "global" / "g-000000000001.cnrg"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptionError) as info:
        versions(tmp_path / "root")
    assert info.value.path == str(path)
    from cnrstore.distributed.verify import verify_root
    report = verify_root(tmp_path / "root")
    assert not report.ok and report.global_versions == 0
    assert report.problems[0].startswith("global version 1: CorruptionError")


def test_priority_saves_become_global_versions(tmp_path, group):
    ck, model, opt = make(tmp_path / "root", priority="mfu", mode="incremental")
    step(model, opt)
    ck.save(step=1).wait()  # the first save is a baseline
    for _ in range(3):
        step(model, opt, rows=(7, 7, 8))
    step(model, opt, rows=(20,))
    pending = ck.save(step=2, top=0.04)  # 2 of 50 rows of emb.a, 2 of 30 of emb.b
    g = pending.wait()
    assert pending.report.priority
    gv = ck.versions()[-1]
    assert gv.version == g and gv.step == 2 and gv.priority and not ck.versions()[0].priority
    local = ck.store.read_rows("emb.a", [7, 8], gv.local_versions[0])
    np.testing.assert_array_equal(local, model.emb["a"].weight.detach().numpy()[[7, 8]])
    # row 20 was not picked: it still reads as in version 1, and the next regular save writes it
    assert not np.array_equal(ck.store.read_rows("emb.a", [20], gv.local_versions[0]),
                              model.emb["a"].weight.detach().numpy()[[20]])
    ck.save(step=3).wait()
    np.testing.assert_array_equal(ck.store.read_rows("emb.a", [20]), model.emb["a"].weight.detach().numpy()[[20]])
    ck.close()


def test_orphaned_local_versions_are_dropped_at_start_up(tmp_path, group):
    ck, model, opt = make(tmp_path / "root", mode="incremental")
    step(model, opt)
    ck.save(step=1).wait()
    gv = ck.latest()
    # a local version no manifest names: what a rank leaves when a peer dies during the commit
    step(model, opt, rows=(4,))
    ck.local.save(step=2).wait()
    assert len(ck.store.versions()) == 2
    ck.close()
    ck, model, opt = make(tmp_path / "root", mode="incremental")
    assert [v.version for v in ck.store.versions()] == [gv.local_versions[0]]
    ck.close()


def test_cli_lists_and_verifies_a_root_and_points_other_commands_at_rank_stores(tmp_path, group, capsys):
    from cnrstore import cli
    ck, model, opt = make(tmp_path / "root")
    for i in range(2):
        step(model, opt)
        ck.save(step=10 * (i + 1)).wait()
    ck.close()
    root = str(tmp_path / "root")
    assert cli.main(["ls", root]) == 0
    out = capsys.readouterr().out
    assert "2 global version(s)" in out and " 20 " in out
    assert cli.main(["verify", root]) == 0
    assert "ok: 2 global version(s), 1 rank store(s)" in capsys.readouterr().out
    assert cli.main(["rows", root, "emb.a", "0"]) == 2  # (a command of one store: it names the rank stores)
    assert "rank-RRRRR" in capsys.readouterr().err
    # reading a root's manifests needs no torch (cnrstore.distributed loads its torch modules lazily)
    code = ("import sys; from cnrstore import cli; rcs = [cli.main(a) for a in (['ls', sys.argv[1]], "
            "['verify', sys.argv[1], '--json'])]; assert rcs == [0, 0], rcs; "
            "assert 'torch' not in sys.modules, 'reading a root imported torch'")
    proc = subprocess.run([sys.executable, "-c", code, root], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    # damage one byte of the rank store's log: verify of the root finds it
    seg_dir = os.path.join(Root(root).store_path(Root(root).store_rel(1, 0)), "segments")
    seg = os.path.join(seg_dir, sorted(os.listdir(seg_dir))[0])
    with open(seg, "r+b") as f:
        f.seek(200)
        b = f.read(1)
        f.seek(200)
        f.write(bytes([b[0] ^ 0xFF]))
    assert cli.main(["verify", root, "--json"]) == 1
    assert "rank-00000" in capsys.readouterr().out


def test_a_later_increment_that_reads_through_an_orphan_survives_its_reclaim(tmp_path, group):
    ck, model, opt = make(tmp_path / "root", mode="incremental")
    step(model, opt)
    ck.save(step=1).wait()
    step(model, opt, rows=(11, 12))
    ck.local.save(step=2).wait()  # an orphan: rows 11 and 12 live only in this local version
    step(model, opt, rows=(25,))
    ck.save(step=3).wait()  # incremental: holds row 25 only, reads rows 11 and 12 through the orphan
    want = {k: v.detach().clone() for k, v in model.state_dict().items()}
    want_sum = opt.state[model.emb["a"].weight]["sum"].clone()
    ck.close()
    ck, model, opt = make(tmp_path / "root", model=Model(seed=5), mode="incremental")
    assert [v.version for v in ck.store.versions()] == [g.local_versions[0] for g in ck.versions()]
    ck.restore()
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, want[k], rtol=0, atol=0)
    torch.testing.assert_close(opt.state[model.emb["a"].weight]["sum"], want_sum, rtol=0, atol=0)
    ck.store.gc()
    assert ck.store.verify().ok
    ck.close()


def test_recover_estimates_lost_updates_from_the_checkpoint_and_the_last_regular_save(tmp_path, group):
    ck, model, opt = make(tmp_path / "root", priority="mfu", mode="incremental")
    step(model, opt)
    ck.save(step=1).wait()
    step(model, opt, rows=(9,))
    ck.save(step=5, top=0.05).wait()
    saved = model.emb["a"].weight.detach().clone()
    step(model, opt, rows=(9, 10))
    rep = ck.recover([0], step=9)  # one rank: the failed rank is this one, and it reloads version 2
    assert rep.restored and rep.global_version == 2 and rep.lost_steps == 4
    assert rep.lost_update_fraction == pytest.approx(4 / 9)
    assert rep.lost_update_fraction_max == pytest.approx(8 / 9)
    torch.testing.assert_close(model.emb["a"].weight.detach(), saved, rtol=0, atol=0)
    with pytest.raises(InvalidArgument, match="failed_ranks"):
        ck.recover([1], step=9)
    ck.close()


def test_on_report_gets_global_versions_and_restores_and_logging_is_the_default(tmp_path, group, caplog):
    import logging

    from cnrstore.torch import RestoreReport, SaveReport

    got = []
    ck, model, opt = make(tmp_path / "root", on_report=got.append)
    for i in range(3):
        step(model, opt, rows=(i,))
        pending = ck.save(step=10 * i)
        assert pending.wait() == got[-1].version  # reported before wait() returns, with the global version
    gv = ck.restore()
    ck.close()
    assert [type(r) for r in got] == [SaveReport] * 3 + [RestoreReport]
    assert [r.version for r in got[:3]] == [g.version for g in versions(tmp_path / "root")]
    assert [r.step for r in got] == [0, 10, 20, 20] and got[3].version == gv.version
    assert all(r.stall_s > 0 and r.bytes_written for r in got[:3])
    with pytest.raises(InvalidArgument, match="on_report"):
        make(tmp_path / "other", on_report="tensorboard")

    ck, model, opt = make(tmp_path / "logged")
    with caplog.at_level(logging.INFO, logger="cnrstore.torch"):
        ck.save(step=1).wait()
        ck.restore()
    ck.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "cnrstore.torch"]
    assert len(lines) == 2 and lines[0].startswith("save of step 1 -> version 1") and "restored version 1" in lines[1]


def test_every_collective_of_the_checkpointer_runs_on_its_own_gloo_group(tmp_path, group, monkeypatch):
    """Nothing of cnrstore.distributed runs on the default group, which may be NCCL (it carries no CPU
    tensors): construction, saves, restores and recovery use the checkpointer's own gloo group."""
    import torch.distributed as dist

    from cnrstore.distributed import failures

    seen = []
    for name in ("all_gather_object", "broadcast_object_list"):
        real = getattr(failures, name)

        def spy(*args, _real=real, _name=name, **kw):
            g = kw.get("group")
            seen.append((_name, g is not None and g is not dist.group.WORLD, g is not None and dist.get_backend(g)))
            return _real(*args, **kw)
        monkeypatch.setattr(failures, name, spy)
    ck, model, opt = make(tmp_path / "root", mode="incremental")
    step(model, opt)
    ck.save(step=1).wait()
    step(model, opt, rows=(4, 5))
    ck.save(step=2).wait()
    ck.restore()
    ck.recover([0], step=3)
    ck.close()
    assert {n for n, _o, _b in seen} == {"all_gather_object", "broadcast_object_list"}
    assert all(own and backend == "gloo" for _n, own, backend in seen), seen
