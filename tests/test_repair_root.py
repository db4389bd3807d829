"""Issue 21, fault 6 on a multi-rank root: repair, gc, repair of every rank store loses no version a
global version names, so the newest global version still exports (bit for bit, fp32), as it did before.

Real DistributedCheckpointer saves from 2 spawned gloo ranks (tests/support/dist_worker.py). Each rank store then
drops local versions in the middle of its history, as start-up and retention drop the local versions of
failed global commits (orphans, DESIGN "Multi-rank jobs"): later local increments still read rows through
them, so their COMMIT records are what repair proves the kept versions from."""

from __future__ import annotations

import glob
import os
import shutil

import numpy as np
import torch

import cnrstore
from cnrstore.maintenance import compaction
from cnrstore.engine import filenames
from cnrstore.distributed import versions
from cnrstore.export import export_path
from support.dist_jobs import assemble, assert_ok, run_job, unsharded_state


def _rank_stores(root) -> list[str]:
    stores = sorted(glob.glob(os.path.join(str(root), "gen-*", "rank-*")))
    assert len(stores) == 2, stores
    return stores


def test_repair_fault6_repair_gc_repair_of_every_rank_store_keeps_the_newest_global_version(tmp_path):
    assert_ok(run_job(tmp_path, "save", 2, plan="row", train=[2, 2, 2, 2, 2]))
    root = tmp_path / "root"
    globals_ = versions(root)
    newest = globals_[-1]
    want = unsharded_state(assemble(tmp_path / "out", f"g{newest.version}"))
    for rank, store in enumerate(_rank_stores(root)):
        orphans = {g.local_versions[rank] for g in globals_[1:3]}  # as if global versions 2, 3 had failed
        with cnrstore.open(store) as s, s.engine.maintenance() as m:
            assert sorted(compaction.drop_versions(m, orphans)) == sorted(orphans)
        for round_ in range(2):
            shutil.rmtree(filenames.index_dir(store))
            report = cnrstore.repair(store)
            assert report.ok, (round_, report.versions_lost)
            assert newest.local_versions[rank] in report.versions_recovered
            if round_ == 0:
                with cnrstore.open(store) as s:
                    s.gc()
    export_path(root, "torch", tmp_path / "newest.pt", version=newest.version)
    got = torch.load(tmp_path / "newest.pt")
    assert set(got) == set(want)
    for key, arr in want.items():
        np.testing.assert_array_equal(got[key].numpy(), arr, err_msg=key)
