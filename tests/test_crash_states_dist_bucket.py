"""Crash states and races of a multi-rank root in a bucket (cnrstore/distributed/remote_root.py), without
torch.distributed: one process drives the distributed protocol (tests/support/dist_bucket_states.py) with
two rank stores, and every object put and delete of the bucket is recorded.

Enumerated: for **every** prefix of the recorded puts and deletes (the root's and the rank stores' alike), the
bucket as of that prefix is recovered on empty local directories: the global versions listed are exactly
those of the last ``ROOT`` put, and each restores bit for bit (each rank store's readonly recovery, read at
the local version the manifest names; a rank store's state recovered once per distinct set of its objects).
At every prefix a new job's claim keeps those versions and finishes the clean-up (unlisted manifests and
doomed generations deleted). A new job starting there and saving (the resume check: claim, generation, rank
stores taken over, start-up reclaim, a save) runs at every prefix right after a root-level effect (marker,
``ROOT``, ``PLAN``, manifest) and at every 4th prefix besides. Workloads: one job's saves with ``keep_last``
retention and a plan change (a new generation, the old one doomed and deleted); and two jobs on one root,
the second claiming it and taking the rank stores over while the first keeps trying to save.

Races by schedule (tests/support/schedule.py): a commit paused between the manifest's put and the pointer
swap (or before the put) while another job claims; readers (``versions``, ``read``, ``latest``) racing
``drop``; a doomed generation's deletion stopped half-way, finished by the next claim; a stale job's new
generation racing the new owner's (and a PLAN a crash left before the swap).
"""

from __future__ import annotations

import time

import pytest

from cnrstore.distributed import RemoteRoot, ShardingPlan
from cnrstore.distributed.manifest import GLOBAL_DIR, PLAN_FILE, ROOT_POINTER, seal
from cnrstore.distributed.remote_root import manifest_key
from cnrstore.engine import fs
from cnrstore.errors import RemoteConflict, RemoteTakenOver, VersionNotFound

from support import dist_bucket_states as db
from support.crash_states import DictObjectStore
from support.schedule import Pause, run_in_thread

PLAN = ShardingPlan.row_wise(db.table_shapes(), db.WORLD)
PLAN2 = ShardingPlan.row_wise(db.table_shapes(extra=True), db.WORLD)
TAKEN = (RemoteTakenOver, RemoteConflict)

ROOT_LEVEL = ("CNRSTORE-DIST", ROOT_POINTER, GLOBAL_DIR + "/")


def _root_level(key: str) -> bool:
    return key.startswith(ROOT_LEVEL) or key.endswith("/PLAN")


def _explore(effects, content, workdir, *, resume_plan=None, extra_check=None) -> dict:
    """Check every prefix of ``effects`` (module docstring); returns counts of what was checked."""
    cache = db.RankCache(str(workdir / "ranks"))
    counts = {"prefixes": 0, "listed": 0, "resumed": 0}
    objects: dict = {}
    for k in range(len(effects) + 1):
        if k:
            e = effects[k - 1]
            if e.kind == "put":
                objects[e.key] = e.data
            else:
                objects.pop(e.key, None)
        what = f"after effect {k} ({effects[k - 1].kind} {effects[k - 1].key})" if k else "at the start"
        listed = db.check_bucket(objects, content, cache, str(workdir / f"p{k}"), what)
        db.check_claim(dict(objects), str(workdir / f"c{k}"), what)
        if extra_check is not None:
            extra_check(k, objects, listed, what)
        counts["prefixes"] += 1
        counts["listed"] += len(listed)
        if resume_plan is not None and (k == len(effects) or (k and _root_level(effects[k - 1].key)) or k % 4 == 0):
            _resume(dict(objects), content, workdir / f"r{k}", cache, resume_plan, k, what)
            counts["resumed"] += 1
    counts["rank_store_states"] = cache.opens
    return counts


def _resume(objects, content, workdir, cache, plan, seed, what) -> None:
    """A new job on fresh machines starts on the bucket (with the plan of its newest generation, else
    ``plan``), saves, and lists what was listed plus its new version, all restoring bit for bit."""
    bucket = DictObjectStore(objects)
    before = db.check_bucket(objects, content, cache, str(workdir / "before"), what, restore=False)
    job = db.Job(str(workdir / "node"), bucket, content=dict(content), seed=seed)
    p = job.root.pointer()
    job.start(job.root.plan_of(p.generations[-1]) if p is not None and p.generations else plan)
    try:
        number = job.save()
    finally:
        job.close()
    after = db.check_bucket(bucket.objects, job.content, cache, str(workdir / "after"), f"{what}, resumed")
    assert after == before + [manifest_key(number, job.root.job)], f"{what}: resumed job lists {after}"


# -- 1. one job: saves, retention, a plan change -------------------------------------------------------------

def test_every_prefix_of_a_two_rank_workload_lists_exactly_the_last_pointers_versions(ram_tmp_path):
    """Three saves under keep_last=2, a plan change (generation 2), two saves under keep_last=1 (generation 1
    doomed and deleted once no kept version reads it), close."""
    bucket = db.RecordingBucket()
    job = db.Job(str(ram_tmp_path / "node"), bucket, seed=1)
    job.start(PLAN)
    for _ in range(3):
        job.save()
        job.retain(2)
    job.change_plan(PLAN2)
    for _ in range(2):
        job.save()
        job.retain(1)
    job.close()
    effects = bucket.effects
    keys = [e.key for e in effects]
    assert any(e.kind == "delete" and e.key.startswith(GLOBAL_DIR) for e in effects)  # drop
    assert any(e.kind == "delete" and e.key.startswith("gen-000001/rank") and "/segments/" in e.key
               for e in effects)  # rank GC at a copy point, and the doomed generation's deletion
    assert "gen-000002/PLAN" in keys and not any(k.startswith("gen-000001/") for k in bucket.objects)
    assert [gv.version for gv in job.root.versions()] == [5]
    start = time.perf_counter()
    counts = _explore(effects, job.content, ram_tmp_path / "states", resume_plan=PLAN)
    print(f"\n2-rank bucket workload: {len(effects)} object effects, {counts} "
          f"in {time.perf_counter() - start:.1f} s")
    assert counts["prefixes"] == len(effects) + 1 and counts["rank_store_states"] > 40


def test_every_prefix_of_pipelined_saves_lists_exactly_the_last_pointers_versions(ram_tmp_path):
    """Saves published behind the trainer (a bucket root's order of effects): save K+1 is written, sealed and
    its ranks' unneeded local versions reclaimed before save K's copy points (which then hold K+1 as well) and
    listing; then a publication that fell behind lists two saves at once (one pointer swap); keep_last=2."""
    bucket = db.RecordingBucket()
    job = db.Job(str(ram_tmp_path / "node"), bucket, seed=2)
    job.start(PLAN)
    written = job.write_local()
    job.seal()
    for _ in range(2):
        following = job.write_local()  # (the next save, while this one publishes)
        job.seal()
        for rank in range(db.WORLD):
            job.reclaim(rank)
        job.copy_points()
        job.commit(written)
        job.drop_listed(2)
        written = following
    behind = [written, job.write_local()]  # a publication caught up with two saves
    job.seal()
    job.copy_points()
    job.commit_many(behind)
    job.drop_listed(2)
    job.close()
    assert [gv.version for gv in job.root.versions()] == [3, 4]
    counts = _explore(bucket.effects, job.content, ram_tmp_path / "states", resume_plan=PLAN)
    assert counts["prefixes"] == len(bucket.effects) + 1 and counts["listed"] > 0


# -- 2. two jobs on one root -------------------------------------------------------------------------------------

def _stale_save(job: db.Job, *, copy_points_fail: bool) -> None:
    """The stale job ``job`` tries a save: its local checkpoints may commit (or be refused once its store knows
    it lost the prefix); its ranks' copy points fail when the new job has taken their stores over, and its
    root commit always fails: it puts nothing that could be listed."""
    failed = 0
    written = []
    for rank, store in enumerate(job.stores):
        try:
            written.append(job.write_local_rank(rank))
            store.sync_remote()
        except TAKEN:
            failed += 1
    assert failed == (db.WORLD if copy_points_fail else 0)
    written += [(1, {})] * (db.WORLD - len(written))  # (a rank that failed: its version does not matter)
    with pytest.raises(TAKEN):
        job.commit(written)


def test_two_jobs_on_one_root_list_only_the_first_jobs_versions_before_the_claim_and_the_seconds(ram_tmp_path):
    """Job A saves twice; job B (fresh machines) claims the root; A saves again (its ranks' copy points still
    succeed: B has not opened the rank stores; its commit fails); B opens the rank stores (taking them over
    from the bucket) and drops A's unlisted local versions; A tries again (copy points and commit fail); B
    saves with retention; A tries once more. Every prefix: only A's versions from before the claim and B's
    are listed, each bit for bit; A lists nothing after the claim."""
    bucket = db.RecordingBucket()
    content: dict = {}
    a = db.Job(str(ram_tmp_path / "node-a"), bucket, content=content, seed=1)
    a.start(PLAN)
    a.save()
    a.save()
    before_claim = set(content)
    b = db.Job(str(ram_tmp_path / "node-b"), bucket, content=content, seed=2)
    claim_at = len(bucket.effects)
    b.root.create()
    _stale_save(a, copy_points_fail=False)
    b.join(PLAN)
    _stale_save(a, copy_points_fail=True)
    b.save()
    b.save()
    b.retain(2)
    _stale_save(a, copy_points_fail=True)
    b.save()
    a.close()
    b.close()
    assert {k for k in content if a.root.job in k} == before_claim
    assert [manifest_key(gv.version, b.root.job) for gv in b.root.versions()][-1] in content
    effects = bucket.effects
    a_puts_after = [e.key for e in effects[claim_at:] if e.kind == "put" and
                    (e.key.startswith(GLOBAL_DIR) or e.key == ROOT_POINTER) and a.root.job in e.key]
    assert not a_puts_after, a_puts_after

    def only_a_before_and_b(k, objects, listed, what):
        assert {key for key in listed if a.root.job in key} <= before_claim, what
        assert all(a.root.job in key or b.root.job in key for key in listed), what
        if k > claim_at:
            assert db.pointer_of(objects).owner == b.root.job, f"{what}: the pointer left job B"

    start = time.perf_counter()
    counts = _explore(effects, content, ram_tmp_path / "states", resume_plan=PLAN, extra_check=only_a_before_and_b)
    print(f"\ntwo jobs on a 2-rank root: {len(effects)} object effects, {counts} "
          f"in {time.perf_counter() - start:.1f} s")
    assert counts["prefixes"] == len(effects) + 1


# -- 3. races by schedule ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("point", ["dist_manifest_put", "dist_before_manifest"])
def test_a_commit_paused_around_its_manifest_put_while_another_job_claims(tmp_path, point):
    """Job A's commit paused after its manifest's put (or before it) while job B claims the root: A's swap fails
    (RemoteTakenOver) and A's manifest is never listed: B's claim deleted it (paused after the put), or it is
    left unlisted (put after the claim) and the next claim deletes it."""
    bucket = DictObjectStore()
    a = db.Job(str(tmp_path / "node-a"), bucket, seed=1)
    a.start(PLAN)
    a.save()
    written = a.write_local()
    a.copy_points()
    key = manifest_key(2, a.root.job)
    with Pause(point) as paused:
        commit = run_in_thread(a.commit, written)
        paused.wait_reached()
        assert (key in bucket.objects) == (point == "dist_manifest_put")
        b = db.Job(str(tmp_path / "node-b"), bucket, content=a.content, seed=2)
        b.root.create()
        assert key not in bucket.objects
        paused.release()
        with pytest.raises(RemoteTakenOver):
            commit.result()
    assert (key in bucket.objects) == (point == "dist_before_manifest")  # (put after the claim: unlisted)
    assert [manifest_key(gv.version, a.root.job) for gv in b.root.versions()] == [manifest_key(1, a.root.job)]
    b.join(PLAN)
    b.save()
    b.close()
    a.close()
    assert [gv.version for gv in RemoteRoot(str(tmp_path / "r"), objects=bucket).versions()] == [1, 2]
    RemoteRoot(str(tmp_path / "c"), objects=bucket).create()  # the next claim
    assert key not in bucket.objects
    db.check_bucket(bucket.objects, a.content, db.RankCache(str(tmp_path / "ranks")), str(tmp_path / "x"), point)


class PausingBucket(DictObjectStore):
    """Gets of manifests pass pause point ``manifest_get`` (a reader between the pointer and the manifest)."""

    def get(self, key, start=None, end=None):
        if key.startswith(GLOBAL_DIR + "/"):
            fs.pause_point("manifest_get", key)
        return super().get(key, start, end)


def _three_versions(tmp_path):
    bucket = PausingBucket()
    job = db.Job(str(tmp_path / "node"), bucket, seed=1)
    job.start(PLAN)
    for _ in range(3):
        job.save()
    return bucket, job


def _reader(tmp_path, bucket):
    return RemoteRoot(str(tmp_path / "reader"), objects=bucket)  # (another process: nothing cached)


def test_versions_racing_drop_skips_the_dropped_version(tmp_path):
    """A reader listing versions read the pointer (1, 2, 3) and is paused before manifest 1; the writer drops 1
    (pointer swapped, manifest deleted): the reader lists 2 and 3, never raising for 1."""
    bucket, job = _three_versions(tmp_path)
    with Pause("manifest_get") as paused:
        listing = run_in_thread(_reader(tmp_path, bucket).versions)
        paused.wait_reached()
        job.root.drop([1])
        assert manifest_key(1, job.root.job) not in bucket.objects
        paused.release()
        assert [gv.version for gv in listing.result()] == [2, 3]
    job.close()


def test_read_racing_drop_is_version_not_found(tmp_path):
    """A reader of version 1 read the pointer listing it and is paused before its manifest; the writer drops it:
    the read raises VersionNotFound (the version is gone), not a CorruptionError for a missing object."""
    bucket, job = _three_versions(tmp_path)
    reader = _reader(tmp_path, bucket)
    with Pause("manifest_get") as paused:
        read = run_in_thread(reader.read, 1)
        paused.wait_reached()
        job.root.drop([1])
        paused.release()
        with pytest.raises(VersionNotFound):
            read.result()
    assert reader.read(2).version == 2
    job.close()


def test_latest_racing_a_commit_and_drop_reads_the_newest_listed(tmp_path):
    """A reader of the newest version (3) is paused before its manifest; the writer commits 4 and drops 3 (as
    keep_last=1 does): the reader returns a version still listed (4), never raising for the dropped 3."""
    bucket, job = _three_versions(tmp_path)
    reader = _reader(tmp_path, bucket)
    with Pause("manifest_get") as paused:
        latest = run_in_thread(reader.latest)
        paused.wait_reached()
        job.save()
        job.retain(1)
        assert [gv.version for gv in job.root.versions()] == [4]
        paused.release()
        assert latest.result().version == 4
    job.close()


def test_a_doomed_generations_deletion_stopped_half_way_is_finished_by_the_next_claim(tmp_path):
    """Generations 1 and 2 doomed (retention, generation 3 current); the deletion stops after generation 1's
    objects (the process "crashes" there: abandoned at the pause point). The pointer still names both doomed,
    version 3 restores; the next job's claim deletes generation 2's objects and takes both off the pointer;
    the abandoned process, woken, fails (RemoteTakenOver) and changes nothing."""
    bucket = DictObjectStore()
    a = db.Job(str(tmp_path / "node-a"), bucket, seed=1)
    a.start(PLAN)
    a.save()
    a.change_plan(PLAN2)
    a.save()
    a.change_plan(ShardingPlan.table_wise(db.table_shapes(), db.WORLD))
    a.save()
    with Pause("root_generation_deleted") as paused:
        retain = run_in_thread(a.retain, 1)
        paused.wait_reached()
        p = a.root.pointer()
        assert p.doomed == (1, 2) and p.generations == (3,)
        assert not [k for k in bucket.objects if k.startswith("gen-000001/")]
        assert [k for k in bucket.objects if k.startswith("gen-000002/")]
        cache = db.RankCache(str(tmp_path / "ranks"))
        assert db.check_bucket(dict(bucket.objects), a.content, cache, str(tmp_path / "x"), "half-way") == \
            [manifest_key(3, a.root.job)]
        b = db.Job(str(tmp_path / "node-b"), bucket, content=a.content, seed=2)
        b.start(ShardingPlan.table_wise(db.table_shapes(), db.WORLD))
        p = b.root.pointer()
        assert p.doomed == () and p.generations == (3,) and p.owner == b.root.job
        assert not [k for k in bucket.objects if k.startswith(("gen-000001/", "gen-000002/"))]
        objects = dict(bucket.objects)
        paused.release()
        with pytest.raises(RemoteTakenOver):
            retain.result()
    assert bucket.objects.keys() == objects.keys()
    b.save()
    b.close()
    a.close()
    assert db.check_bucket(dict(bucket.objects), a.content, cache, str(tmp_path / "y"), "after the claim") == \
        [manifest_key(3, a.root.job), manifest_key(4, b.root.job)]


class PausingPlanBucket(DictObjectStore):
    """Puts of a generation's PLAN (plain or conditional) pass pause point ``plan_put`` first (outside the
    bucket's lock)."""

    def put(self, key, data):
        if key.endswith("/PLAN"):
            fs.pause_point("plan_put", key)
        super().put(key, data)

    def put_if(self, key, data, tag):
        if key.endswith("/PLAN"):
            fs.pause_point("plan_put", key)
        super().put_if(key, data, tag)


def test_a_stale_jobs_new_generation_never_replaces_the_new_owners_plan(tmp_path):
    """Job A starts a new generation (another plan) and is paused before its PLAN's put; job B claims the root
    and starts that same generation number under its own plan. A's put and swap then fail and B's PLAN stays
    (a PLAN a job puts never replaces another's): a job restarted with B's plan goes on in B's generation."""
    bucket = PausingPlanBucket()
    a = db.Job(str(tmp_path / "node-a"), bucket, seed=1)
    a.start(PLAN)
    a.save()
    plan_b = ShardingPlan.table_wise(db.table_shapes(), db.WORLD)
    with Pause("plan_put") as paused:
        new_generation = run_in_thread(a.root.generation_for, PLAN2)
        paused.wait_reached()
        b = db.Job(str(tmp_path / "node-b"), bucket, content=a.content, seed=2)
        b.start(plan_b)
        assert b.generation == 2
        paused.release()
        with pytest.raises(TAKEN):
            new_generation.result()
    assert RemoteRoot(str(tmp_path / "r"), objects=bucket).plan_of(2) == plan_b
    b.save()
    b.close()
    a.close()
    c = db.Job(str(tmp_path / "node-c"), bucket, content=a.content, seed=3)
    c.start(plan_b)
    assert c.generation == 2
    c.save()
    c.close()
    assert len(db.check_bucket(dict(bucket.objects), a.content, db.RankCache(str(tmp_path / "ranks")),
                               str(tmp_path / "x"), "after")) == 3


@pytest.mark.parametrize("same_plan", [True, False], ids=["restarted-with-its-plan", "restarted-with-another"])
def test_a_plan_left_by_a_crash_before_the_swap(tmp_path, same_plan):
    """A job crashed between a new generation's PLAN put and the pointer swap. Restarted with that plan, the
    next job takes the generation; with another, it skips the number (doomed: deleted with the next
    deletion of generations) and takes the next one."""
    bucket = DictObjectStore()
    a = db.Job(str(tmp_path / "node-a"), bucket, seed=1)
    a.start(PLAN)
    a.save()
    a.close()
    bucket.put("gen-000002/PLAN", seal(PLAN_FILE, {"plan": PLAN2.to_dict()}))  # (what the crash left)
    b = db.Job(str(tmp_path / "node-b"), bucket, content=a.content, seed=2)
    b.start(PLAN2 if same_plan else ShardingPlan.table_wise(db.table_shapes(), db.WORLD))
    p = b.root.pointer()
    assert (b.generation, p.generations, p.doomed) == ((2, (1, 2), ()) if same_plan else (3, (1, 3), (2,)))
    b.save()
    b.retain(1)
    b.close()
    p = b.root.pointer()
    assert p.generations == (b.generation,) and p.doomed == ()
    assert sorted({k.split("/")[0] for k in bucket.objects if k.startswith("gen-")}) == [f"gen-{b.generation:06d}"]
    assert len(db.check_bucket(dict(bucket.objects), a.content, db.RankCache(str(tmp_path / "ranks")),
                               str(tmp_path / "x"), "after")) == 1
