"""Merged export of a multi-rank root (cnrstore/distributed/export.py): real DistributedCheckpointer saves
from 2 spawned gloo ranks (tests/support/dist_worker.py, via support/dist_jobs.py), exported as one state dict
of the unsharded model and compared with the ranks' own dumps of their shards."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

import cnrstore
from cnrstore.distributed import ShardingPlan, versions
from cnrstore.distributed.export import is_root, merged_snapshot
from cnrstore.errors import InvalidArgument, VersionNotFound
from cnrstore.export import export, export_path
from cnrstore.torch import Checkpointer, import_checkpoint
from support.dist_worker import TABLES, Model
from support.dist_jobs import assemble, assert_ok, run_job, unsharded_state


def unsharded(seed=123) -> Model:
    return Model(ShardingPlan.row_wise(TABLES, 1), 0, seed)


def assert_model_is(model, want: dict) -> None:
    sd = model.state_dict()
    assert set(sd) == set(want)
    for k, v in want.items():
        np.testing.assert_array_equal(sd[k].numpy(), v, err_msg=k)


@pytest.mark.parametrize("plan", ["row", "table"])
def test_a_root_exports_as_the_unsharded_model(tmp_path, plan):
    assert_ok(run_job(tmp_path, "save", 2, plan=plan, train=[3, 2]))
    root = tmp_path / "root"
    assert is_root(root) and [g.version for g in versions(root)] == [1, 2]
    for g in (1, 2):
        want = unsharded_state(assemble(tmp_path / "out", f"g{g}"))
        report = export_path(root, "torch", tmp_path / f"g{g}.pt", version=g if g == 1 else None)
        assert report.merged and report.version == g and report.layout == "state_dict"
        model = unsharded()
        model.load_state_dict(torch.load(tmp_path / f"g{g}.pt"))  # strict: exactly the unsharded keys
        assert_model_is(model, want)  # bit-exact: fp32 codec
    # DCP, loaded into a freshly built unsharded model
    export_path(root, "dcp", tmp_path / "m.dcp")
    model = unsharded(seed=7)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(model.state_dict(), checkpoint_id=tmp_path / "m.dcp")
    assert_model_is(model, unsharded_state(assemble(tmp_path / "out", "g2")))
    # the command line: `cnrstore export ROOT` writes the same merged model; a checkpoint layout is refused
    from cnrstore import cli
    from safetensors.torch import load_file

    assert cli.main(["export", str(root), "--format", "safetensors", str(tmp_path / "m.st"), "--version", "1"]) == 0
    got = {k: v.numpy() for k, v in load_file(tmp_path / "m.st").items()}
    want1 = unsharded_state(assemble(tmp_path / "out", "g1"))
    assert set(got) == set(want1) and all(np.array_equal(got[k], want1[k]) for k in want1)
    assert cli.main(["export", str(root), "--format", "torch", str(tmp_path / "c.pt"), "--layout", "checkpoint"]) == 2
    assert not (tmp_path / "c.pt").exists()
    if plan == "row":
        # the nested layout holds the assembled row-wise optimizer state too
        snap = merged_snapshot(root)
        dumps = assemble(tmp_path / "out", "g2")
        for t in TABLES:
            np.testing.assert_array_equal(snap.tables[f"{t}.optim.sum"].reshape(dumps[f"{t}/sum"].shape),
                                          dumps[f"{t}/sum"])
        with pytest.raises(InvalidArgument, match="model only"):
            export_path(root, "torch", tmp_path / "ck.pt", layout="checkpoint")
        with pytest.raises(InvalidArgument, match="model only"):  # the snapshot itself refuses, whoever exports it
            export(snap, "torch", tmp_path / "ck.pt", layout="checkpoint")
        assert not (tmp_path / "ck.pt").exists()
        with pytest.raises(VersionNotFound):
            export_path(root, "torch", tmp_path / "x.pt", version=9)
        # and the merged model seeds a single store that a plain Checkpointer restores
        import_checkpoint(tmp_path / "single", tmp_path / "g2.pt", model=unsharded())
        fresh = unsharded(seed=99)
        with cnrstore.open(tmp_path / "single") as store:
            Checkpointer(store, fresh).restore()
        assert_model_is(fresh, unsharded_state(dumps))
