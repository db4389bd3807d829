"""The job started last wins a bucket root, at any timing: a new job's start interleaved with every request of
a stale job's save (and the other way round), enumerated. No torch.distributed: one process drives both jobs'
distributed protocol (tests/support/dist_bucket_states.py), each job through a client of the shared bucket
that counts its requests (tests/support/claim_races.py).

Job A (2 ranks) starts on the root and saves three times under ``keep_last=2``. Then, for every k, the scenario
is run afresh, and just before the k-th request of A's next save (local checkpoints, the ranks' copy points,
the manifest and root-pointer swap, then retention: the drop, the reclaim of local versions and their GC),
job B (fresh node directories, the same plan) does its whole start: the claim of the root, the rank stores
taken over from the bucket, the newest global version restored, a save. A then goes on. Checked for every k:

- B's start and save succeed, and B's pointer owns the root;
- A's save fails with a typed ``RemoteTakenOver``/``RemoteConflict`` (its commit, when the claim came before
  its root-pointer swap; its retention, when after), and so does its next save;
- no version of A's committed after the claim is ever listed: every bucket state after each ``ROOT`` put, and
  the final bucket, recovered from the bucket alone on fresh directories, lists exactly the versions of
  the last ``ROOT`` put (A's from before the claim, then B's), each bit for bit.

The symmetrical sweep runs A's whole save just before each request of B's start (claim, join, restore) and
B's save: A's save succeeds (listed, and kept by B's claim) or fails typed (never listed); B's start and save
succeed at every point.

The counts of scenarios and distinct bucket states checked are printed (``-s``) and recorded in
docs/DESIGN.md.
"""

from __future__ import annotations

import contextlib
import hashlib
import shutil
import time

import pytest

from cnrstore.distributed import ShardingPlan
from cnrstore.distributed.manifest import ROOT_POINTER
from cnrstore.distributed.remote_root import manifest_key
from cnrstore.errors import RemoteConflict, RemoteTakenOver

from support import dist_bucket_states as db
from support.claim_races import Client

PLAN = ShardingPlan.row_wise(db.table_shapes(), db.WORLD)
TAKEN = (RemoteTakenOver, RemoteConflict)
KEEP = 2


def _a_save(a: db.Job) -> None:
    """One save of A's as the checkpointer makes it with keep_last: local checkpoints, copy points, the
    manifest and pointer swap, then retention."""
    a.save()
    a.retain(KEEP)


def _job_a(workdir, bucket, content) -> tuple[db.Job, Client]:
    client = Client(bucket)
    a = db.Job(str(workdir / "node-a"), client, content=content, seed=1)
    a.start(PLAN)
    for _ in range(3):
        _a_save(a)
    return a, client


def _close(job: db.Job) -> None:
    """Close every rank store of a job, a stale one's too (its close's copy point may learn it lost)."""
    for store in job.stores:
        with contextlib.suppress(*TAKEN):
            store.close()
    job.stores = []


def _listed(bucket) -> list[str]:
    p = db.pointer_of(bucket.objects)
    return [manifest_key(v, job) for v, job in p.versions]


class States:
    """Distinct bucket states checked (after every ``ROOT`` put of a scenario, and at its end), by digest."""

    def __init__(self, workdir):
        self.workdir = workdir
        self.cache = db.RankCache(str(workdir / "ranks"))
        self.seen: set = set()
        self.n = 0

    def check_all(self, effects, start: int, content, what: str) -> None:
        """Every state from effect ``start`` on: after each ``ROOT`` put, and the last."""
        objects = db.replay(effects, start)
        for i in range(start, len(effects)):
            e = effects[i]
            objects = db.replay([e], 1, objects)
            if e.key == ROOT_POINTER or i == len(effects) - 1:
                self.check(objects, content, f"{what}, after effect {i + 1} ({e.kind} {e.key})")

    def check(self, objects, content, what: str) -> list[str]:
        h = hashlib.blake2b(digest_size=16)
        for key in sorted(objects):
            h.update(key.encode() + b"\0" + hashlib.blake2b(objects[key], digest_size=16).digest())
        if h.digest() in self.seen:
            return db.check_bucket(objects, content, self.cache, str(self.workdir / "x"), what, restore=False)
        listed = db.check_bucket(objects, content, self.cache, str(self.workdir / f"s{self.n}"), what)
        shutil.rmtree(self.workdir / f"s{self.n}", ignore_errors=True)
        self.seen.add(h.digest())
        self.n += 1
        return listed


def _final_checks(bucket, content, a: db.Job, b: db.Job, before_claim: set, b_versions: list, what: str):
    p = db.pointer_of(bucket.objects)
    assert p.owner == b.root.job, f"{what}: the root's pointer names job {p.owner}, not B ({b.root.job})"
    listed = _listed(bucket)
    a_listed = [k for k in listed if a.root.job in k]
    assert set(a_listed) <= before_claim, f"{what}: A's versions after the claim are listed: {a_listed}"
    assert listed == sorted(before_claim) + b_versions, (
        f"{what}: the bucket lists {listed}; expected A's from before the claim {sorted(before_claim)} then B's "
        f"{b_versions}")


def _scenario(root, k: int):
    """Scenario ``k``'s fresh start: (its directory, a recording bucket, the content map, job A with its saves,
    A's counting client)."""
    work = root / f"k{k}"
    bucket = db.RecordingBucket()
    content: dict = {}
    a, client = _job_a(work, bucket, content)
    return work, bucket, content, a, client


def test_a_new_jobs_start_before_every_request_of_a_stale_jobs_save(ram_tmp_path):
    # a dry run: how many requests A's save makes
    dry_bucket = db.RecordingBucket()
    a, client = _job_a(ram_tmp_path / "dry", dry_bucket, {})
    client.arm(None)
    _a_save(a)
    requests = client.count
    _close(a)
    shutil.rmtree(ram_tmp_path / "dry")
    states = States(ram_tmp_path / "states")
    scenarios, outcomes, started = 0, {}, time.perf_counter()
    for k in range(requests + 1):
        work, bucket, content, a, client = _scenario(ram_tmp_path, k)
        box: dict = {}

        def start_b(work=work, bucket=bucket, content=content, box=box):
            box["before_claim"] = set(_listed(bucket))
            box["claim_at"] = len(bucket.effects)
            b = db.Job(str(work / "node-b"), Client(bucket), content=content, seed=2)
            b.start(PLAN)  # the claim, the rank stores taken over, the newest version restored
            box["b"] = b
            box["b_versions"] = [manifest_key(b.save(), b.root.job)]

        client.arm(k, start_b)
        what = f"B's start before A's request {k} of {requests}"
        keys = set(content)
        try:
            _a_save(a)
            outcome = "A's save done"
        except TAKEN as exc:
            outcome = f"A's save refused ({type(exc).__name__})"
        a_new = {key for key in set(content) - keys if a.root.job in key}  # (A's commit's, if it returned)
        client.arm(None)
        if "b" not in box:  # (k == requests: after A's last request) B starts now
            assert k == requests, f"{what}: the hook never ran ({client.count} requests)"
            start_b()
        # A's commit returned only if its swap came before the claim (then the claim keeps it); a save that
        # returned had nothing left for the bucket after the claim (its retention's local reclaim)
        assert a_new <= box["before_claim"], f"{what}: A's commit {a_new} returned after B's claim"
        assert outcome != "A's save done" or a_new, f"{what}: A's save returned without committing"
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
        b = box["b"]
        before_claim = box["before_claim"]
        # A's next save fails too, typed, and lists nothing; B saves on
        with pytest.raises(TAKEN):
            _a_save(a)
        box["b_versions"].append(manifest_key(b.save(), b.root.job))
        _close(a)
        b.close()
        _final_checks(bucket, content, a, b, before_claim, box["b_versions"], what)
        states.check_all(bucket.effects, box["claim_at"], content, what)
        # the final bucket alone, on fresh directories: A's from before the claim, then B's, bit for bit
        assert states.check(dict(bucket.objects), content, f"{what}, at the end") == \
            sorted(before_claim) + box["b_versions"]
        scenarios += 1
        shutil.rmtree(work)
    print(f"\nclaim against a stale save: {scenarios} scenarios (A's save makes {requests} requests), "
          f"{states.n} distinct bucket states checked, {states.cache.opens} rank-store states; outcomes "
          f"{outcomes} in {time.perf_counter() - started:.1f} s")
    assert scenarios == requests + 1 and states.n > requests


def test_a_stale_jobs_save_before_every_request_of_a_new_jobs_start(ram_tmp_path):
    # a dry run: how many requests B's start and save make
    dry_bucket = db.RecordingBucket()
    a, _client = _job_a(ram_tmp_path / "dry", dry_bucket, {})
    bc = Client(dry_bucket)
    bc.arm(None)
    b = db.Job(str(ram_tmp_path / "dry" / "node-b"), bc, seed=2)
    b.start(PLAN)
    b.save()
    requests = bc.count
    b.close()
    _close(a)
    shutil.rmtree(ram_tmp_path / "dry")
    states = States(ram_tmp_path / "states")
    scenarios, outcomes, started = 0, {}, time.perf_counter()
    for k in range(requests + 1):
        work, bucket, content, a, _client = _scenario(ram_tmp_path, k)
        box: dict = {"outcome": "A's save after B's"}
        start_at = len(bucket.effects)

        def a_saves(a=a, box=box, content=content):
            keys = set(content)
            try:
                _a_save(a)
                box["outcome"] = "A's save done"
            except TAKEN as exc:
                box["outcome"] = f"A's save refused ({type(exc).__name__})"
            box["a_new"] = set(content) - keys  # (a commit that returned: its manifest key)

        bc = Client(bucket)
        bc.arm(k, a_saves)
        what = f"A's save before B's request {k} of {requests}"
        b = db.Job(str(work / "node-b"), bc, content=content, seed=2)
        b.start(PLAN)
        kept = set(_listed(bucket))  # what B's claim kept (B has not saved yet... unless A's save came later)
        b_versions = [manifest_key(b.save(), b.root.job)]
        bc.arm(None)
        if "a_new" not in box:
            assert k == requests, f"{what}: the hook never ran"
            a_saves()
        outcomes[box["outcome"]] = outcomes.get(box["outcome"], 0) + 1
        assert box["a_new"] <= kept, f"{what}: A's save returned but B's claim did not keep it"
        with pytest.raises(TAKEN):
            _a_save(a)
        b_versions.append(manifest_key(b.save(), b.root.job))
        _close(a)
        b.close()
        before_claim = {key for key in kept if a.root.job in key}
        _final_checks(bucket, content, a, b, before_claim, b_versions, what)
        states.check_all(bucket.effects, start_at, content, what)
        assert states.check(dict(bucket.objects), content, f"{what}, at the end") == sorted(before_claim) + b_versions
        scenarios += 1
        shutil.rmtree(work)
    print(f"\nstale save against a claim: {scenarios} scenarios (B's start and save make {requests} requests), "
          f"{states.n} distinct bucket states checked, {states.cache.opens} rank-store states; outcomes "
          f"{outcomes} in {time.perf_counter() - started:.1f} s")
    assert scenarios == requests + 1 and states.n > requests
