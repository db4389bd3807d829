"""Deletion only with proof (docs/DESIGN.md): every path that deletes objects of a bucket (a root's claim,
retention's drop and doomed generations, a store's copy point, gc --take-over's takeovers) deletes only
what a pointer it read and still owns says is garbage (``objects.delete_with_proof``). Races by schedule
(tests/support/schedule.py): a claim against a live job's pointer swap, in both orders and against a later
claim; gc --take-over against a live writer's copy point.
"""

from __future__ import annotations

import pytest

from cnrstore import cli
from cnrstore.distributed import RemoteRoot, ShardingPlan
from cnrstore.distributed import maintenance
from cnrstore.distributed.manifest import GLOBAL_DIR, ROOT_POINTER
from cnrstore.distributed.remote_root import manifest_key
from cnrstore.engine import fs
from cnrstore.engine.objects import FsspecObjectStore, delete_with_proof
from cnrstore.errors import RemoteConflict, RemoteTakenOver

from support import dist_bucket_states as db
from support.crash_states import DictObjectStore
from support.schedule import Pause, run_in_thread

PLAN = ShardingPlan.row_wise(db.table_shapes(), db.WORLD)
TAKEN = (RemoteTakenOver, RemoteConflict)


class PausingBucket(DictObjectStore):
    """The root pointer's compare-and-swap passes pause point ``root_swap`` first (outside the lock)."""

    def put_if(self, key, data, tag):
        if key == ROOT_POINTER:
            fs.pause_point("root_swap", key)
        super().put_if(key, data, tag)


def _manifests(bucket) -> set[str]:
    return {k for k in bucket.objects if k.startswith(GLOBAL_DIR + "/")}


def _named(bucket) -> set[str]:
    p = db.pointer_of(bucket.objects)
    return {manifest_key(v, job) for v, job in p.versions}


def _restores(bucket, content, tmp_path, what) -> list[str]:
    return db.check_bucket(dict(bucket.objects), content, db.RankCache(str(tmp_path / f"ranks-{what}")),
                           str(tmp_path / f"check-{what}"), what)


def test_delete_with_proof_deletes_nothing_without_it():
    bucket = DictObjectStore({"a": b"1", "b": b"2"})

    def refused(keys):
        raise RemoteTakenOver("not the owner any more")

    with pytest.raises(RemoteTakenOver):
        delete_with_proof(bucket, ["a", "b"], refused)
    assert set(bucket.objects) == {"a", "b"}
    calls = []
    assert delete_with_proof(bucket, [], calls.append) == [] and calls == []  # (nothing to delete: no request)
    assert delete_with_proof(bucket, ["b", "a"], calls.append) == ["a", "b"] and calls == [["a", "b"]]
    assert bucket.objects == {}


def test_a_claim_paused_before_its_clean_up_while_a_later_job_claims_and_saves_deletes_nothing(tmp_path):
    """Job B's claim is paused after its swap, before it lists and deletes unlisted manifests; job C claims the
    root meanwhile and saves (its manifest listed). B, resumed, must not take C's manifest for garbage: it
    fails with RemoteTakenOver and deletes nothing; C's versions restore bit for bit."""
    bucket = DictObjectStore()
    a = db.Job(str(tmp_path / "node-a"), bucket, seed=1)
    a.start(PLAN)
    a.save()
    a.close()
    b = db.Job(str(tmp_path / "node-b"), bucket, content=a.content, seed=2)
    with Pause("root_claimed") as paused:
        claim = run_in_thread(b.root.create)
        paused.wait_reached()
        c = db.Job(str(tmp_path / "node-c"), bucket, content=a.content, seed=3)
        c.start(PLAN)
        c.save()
        before = dict(bucket.objects)
        paused.release()
        with pytest.raises(RemoteTakenOver):
            claim.result()
    assert bucket.objects == before  # nothing deleted by the superseded claim
    assert _named(bucket) <= _manifests(bucket) and len(_named(bucket)) == 2
    c.close()
    assert _restores(bucket, a.content, tmp_path, "after") == sorted(_named(bucket))


def _a_mid_save_and_b(tmp_path, bucket):
    """Job A with one save listed and its second written locally, copy points made, not yet committed; job B
    on fresh machines, not started: (A, A's local versions, B)."""
    a = db.Job(str(tmp_path / "node-a"), bucket, seed=1)
    a.start(PLAN)
    a.save()
    written = a.write_local()
    a.copy_points()
    return a, written, db.Job(str(tmp_path / "node-b"), bucket, content=a.content, seed=2)


def test_a_live_jobs_swap_between_a_claims_read_and_its_swap_is_kept(tmp_path):
    """The first order: job A's commit (manifest, then swap) lands between job B's pointer read and B's swap.
    B's claim swaps again and keeps A's new version; B's clean-up deletes nothing the pointer names."""
    bucket = PausingBucket()
    a, written, b = _a_mid_save_and_b(tmp_path, bucket)
    with Pause("root_swap") as paused:
        claim = run_in_thread(b.root.create)
        paused.wait_reached()
        fs.pause_at("root_swap", None)  # (A's own swap passes)
        a.commit(written)
        paused.release()
        claim.result()
    assert b.root.pointer().owner == b.root.job
    assert _named(bucket) == {manifest_key(1, a.root.job), manifest_key(2, a.root.job)} == _manifests(bucket)
    with pytest.raises(TAKEN):
        a.save()
    b.join(PLAN)
    b.save()
    b.close()
    a.close()
    assert len(_restores(bucket, a.content, tmp_path, "after")) == 3


def test_a_live_jobs_swap_after_a_claim_fails_and_its_manifest_is_garbage(tmp_path):
    """The other order: job A's commit found the root its own; job B's claim swaps and is paused before its
    clean-up; A's commit puts its manifest and fails its swap (RemoteTakenOver). B's clean-up, resumed, deletes A's unlisted manifest (B
    still owns the pointer, which does not name it) and nothing else."""
    bucket = DictObjectStore()
    a, written, b = _a_mid_save_and_b(tmp_path, bucket)
    with Pause("dist_before_manifest") as committing, Pause("root_claimed") as claimed:
        commit = run_in_thread(a.commit, written)  # (A found the root its own, and is about to put)
        committing.wait_reached()
        claim = run_in_thread(b.root.create)
        claimed.wait_reached()
        committing.release()
        with pytest.raises(RemoteTakenOver):
            commit.result()
        assert manifest_key(2, a.root.job) in bucket.objects
        claimed.release()
        claim.result()
    assert _manifests(bucket) == _named(bucket) == {manifest_key(1, a.root.job)}
    b.join(PLAN)
    b.save()
    b.close()
    a.close()
    assert len(_restores(bucket, a.content, tmp_path, "after")) == 2


def _live_job(tmp_path, url):
    """A job on a bucket root at ``url`` (fsspec's in-memory file system): two saves, the rank stores open."""
    bucket = FsspecObjectStore(url)
    job = db.Job(str(tmp_path / "node-live"), bucket, seed=1)
    job.start(PLAN)
    job.save()
    job.save()
    return job


@pytest.mark.parametrize("point", ["remote_snapshot_uploaded", "remote_pointer_replaced"])
def test_gc_take_over_against_a_live_writers_copy_point(tmp_path, capsys, point):
    """`cnrstore gc --take-over` runs while a live job's rank-0 copy point is paused before its swap (or after
    it, before its deletions). The gc succeeds or fails with one typed line; no object a current pointer names
    is deleted (every listed version restores bit for bit from the bucket alone); the live job fails at its
    next save with RemoteTakenOver."""
    url = f"memory://proof-{point}/job"
    live = _live_job(tmp_path, url)
    written = live.write_local()
    with Pause(point) as paused:
        copy = run_in_thread(live.stores[0].sync_remote)
        paused.wait_reached()
        status = cli.main(["--remote", url, "gc", str(tmp_path / "admin"), "--take-over"])
        out, err = capsys.readouterr()
        assert status == 0 or (status == 2 and len(err.strip().splitlines()) == 1), (status, out, err)
        paused.release()
        try:
            copy.result()
            copied = True
        except RemoteTakenOver:
            copied = False
    with pytest.raises(TAKEN):
        if copied:
            live.stores[1].sync_remote()
        live.commit(written)
    with pytest.raises(TAKEN):
        live.save()
    for store in live.stores:
        try:
            store.close()
        except RemoteTakenOver:
            pass
    objects = dict(FsspecObjectStore(url).fs.store)  # (fsspec's memory: every object, by path)
    snapshot = DictObjectStore({k.split("/job/", 1)[1]: bytes(v.getvalue()) for k, v in objects.items()
                                if f"proof-{point}/job/" in k})
    listed = _restores(snapshot, live.content, tmp_path, point)
    assert listed == [manifest_key(1, live.root.job), manifest_key(2, live.root.job)]
    assert db.pointer_of(snapshot.objects).owner != live.root.job
    # the rank stores' pointers name snapshots that are there, and a later gc finds nothing wrong
    assert cli.main(["--remote", url, "gc", str(tmp_path / "admin2"), "--take-over"]) == 0
    capsys.readouterr()
    RemoteRoot(str(tmp_path / "reader"), url).versions()
