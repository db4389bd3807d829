"""Multi-rank roots in a bucket (``DistributedCheckpointer(local_dir, ..., remote=URL)``, remote_root.py).

Multi-node, simulated on this machine: each rank has a "node disk" of its own (a directory no other rank
reads) and every rank reaches one S3 endpoint (moto). Spawned gloo jobs (support/dist_worker.py): a 2-rank
job saves, then fresh machines restore at another world size and at the same one, bit for bit; a rank
SIGKILLed between its manifest's put and the pointer's swap; partial recovery (CPR) with the replacement on
an empty node. In the test process (a one-rank group over an in-memory object store): ownership (a second
job takes the root over, the first fails at its next save and lists nothing), a node's stale directory,
retention of manifests and generations in the bucket, damaged root objects, and faults of the endpoint.
"""

from __future__ import annotations

import collections
import threading
import time

import pytest
import torch

from support import ecrm_jobs
from support.crash_states import DictObjectStore
from support.dist_jobs import assemble, assert_ok, assert_same_state, check_partial_recovery, run_job
from support.s3_remote import proxy, s3_options  # noqa: F401 (a fixture)
from support.torch_models import ShardModel

from cnrstore.distributed import DistributedCheckpointer, RemoteRoot, ShardingPlan, versions
from cnrstore.distributed.remote_root import RootPointer
from cnrstore.errors import CorruptionError, InvalidArgument, RemoteStorageError, RemoteTakenOver, StoreNotFound

TABLES = {"emb.a": (50, 4), "emb.b": (30, 2)}


# -- spawned jobs on the session's S3 endpoint ------------------------------------------------------------

@pytest.fixture
def bucket_root(s3_endpoint, s3_bucket):
    """Worker config of a root in a fresh bucket."""
    return {"remote": f"s3://{s3_bucket}/job", "remote_options": s3_options(s3_endpoint)}


def test_a_job_on_a_bucket_restores_on_fresh_machines_at_another_world_size(tmp_path, bucket_root):
    assert_ok(run_job(tmp_path, "save", 2, tag="a", train=[3, 2], **bucket_root))
    saved = assemble(tmp_path / "out", "g2")
    # three fresh machines (empty node directories): reshard 2 -> 3 from the bucket, then save under 3 ranks
    assert_ok(run_job(tmp_path, "restore", 3, tag="b", seed=7, then_save=True, node="fresh", **bucket_root))
    assert_same_state(saved, assemble(tmp_path / "out", "restored-g2"), skip=())
    gvs = versions(tmp_path / "nowhere", **bucket_root)
    assert [g.world_size for g in gvs] == [2, 2, 3]
    # two more fresh machines: the 3-rank version, resharded 3 -> 2
    assert_ok(run_job(tmp_path, "restore", 2, tag="c", seed=3, node="other", **bucket_root))
    assert_same_state(assemble(tmp_path / "out", "g3"), assemble(tmp_path / "out", "restored-g3"), skip=())
    # nothing of a global version is on a shared file system: the node directories were never shared
    assert not (tmp_path / "root" / "CNRSTORE-DIST").exists()


def test_a_crash_between_the_manifest_and_the_pointer_leaves_the_previous_global_version(tmp_path, bucket_root):
    results = run_job(tmp_path, "crash", 2, crash_rank=0, crash_at="dist_manifest_put", timeout=20, **bucket_root)
    assert results[0][0] == -9, results[0][1][-2000:]
    assert results[1][0] == 0, results[1][1][-3000:]
    assert [g.version for g in versions(tmp_path / "x", **bucket_root)] == [1]
    assert_ok(run_job(tmp_path, "restore", 2, tag="again", seed=11, **bucket_root))
    assert_same_state(assemble(tmp_path / "out", "g1"), assemble(tmp_path / "out", "restored-g1"), skip=())
    # the restarted job's claim deleted the manifest no pointer listed
    root = RemoteRoot(tmp_path / "x", bucket_root["remote"], bucket_root["remote_options"])
    assert sorted(root.objects.list("global")) == [f"g-000000000001-{root.pointer().versions[0][1]}.cnrg"]


def test_partial_recovery_from_a_bucket_on_a_fresh_node(tmp_path, bucket_root):
    check_partial_recovery(tmp_path, **bucket_root)


def test_ecrm_falls_back_to_the_bucket_when_more_than_r_ranks_fail(tmp_path, bucket_root):
    _states, reports = ecrm_jobs.run_job(tmp_path, "many", 3, 2, 1, victims=[1, 2], crash="kill", fail_step=3,
                                         ckpt_every=2, **bucket_root)
    for rep in reports.values():
        rec = rep["recoveries"][-1]
        assert rec["mode"] == "fallback-partial" and rec["step"] == 3, rec
    assert [g.step for g in versions(tmp_path / "x", **bucket_root)][:1] == [2]


# -- one rank in the test process, an in-memory bucket -------------------------------------------------------

def Model(seed=0, tables=TABLES):
    return ShardModel(tables, seed)


def train(model, opt, i):
    loss = model.lin(torch.ones(2, 3)).sum()
    for bag in model.emb.values():
        loss = loss + bag(torch.tensor([i % 10, (i + 7) % 10]), torch.tensor([0])).pow(2).sum()
    opt.zero_grad()
    loss.backward()
    opt.step()


def job(node, objects, seed=0, tables=TABLES, **kw):
    model = Model(seed, tables)
    opt = torch.optim.Adagrad(model.parameters(), lr=0.1)
    ck = DistributedCheckpointer(node, model, opt, plan=ShardingPlan.row_wise(tables, 1), codec="fp32",
                                 remote=objects, **kw)
    return ck, model, opt


def state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_state(model, want):
    for k, v in model.state_dict().items():
        assert torch.equal(v, want[k]), k


def test_a_second_job_takes_the_root_over_and_the_first_lists_nothing_more(tmp_path, group):
    objects = DictObjectStore()
    first, m1, o1 = job(tmp_path / "node1", objects)
    train(m1, o1, 0)
    first.save(step=0).wait()
    want = state(m1)
    second, m2, o2 = job(tmp_path / "node2", objects, seed=5)  # another machine: recovers rank 0's store
    assert second.restore().version == 1
    assert_state(m2, want)
    train(m1, o1, 1)
    with pytest.raises(RemoteTakenOver):  # the stale job fails before anything of it is listed
        first.save(step=1).wait()
    train(m2, o2, 2)
    assert second.save(step=2).wait() == 2
    assert [(g.version, g.step) for g in second.versions()] == [(1, 0), (2, 2)]
    for attempt in range(2):  # (the failure is raised again at the next save; then the store refuses)
        with pytest.raises(RemoteTakenOver):
            first.save(step=3 + attempt).wait()
    assert [g.version for g in second.versions()] == [1, 2]
    first.close()
    want = state(m2)
    second.close()
    # the first node's stale directory: a job back on it discards it and goes on from the bucket
    third, m3, _ = job(tmp_path / "node1", objects, seed=9)
    assert third.restore().version == 2
    assert_state(m3, want)
    third.close()


class GatedObjects(DictObjectStore):
    """An in-memory bucket whose PUTs into the rank stores' prefixes (``gen-*``: copy points) can be held."""

    def __init__(self):
        super().__init__()
        self.gate = threading.Event()
        self.gate.set()
        self.held = 0
        self.puts = collections.Counter()
        self.pointers: list[bytes] = []  # every ROOT put

    def put(self, key, data):
        if key.startswith("gen-") and not self.gate.is_set():
            self.held += 1
            assert self.gate.wait(60)
        self.puts[key] += 1
        if key == "ROOT":
            self.pointers.append(bytes(data))
        super().put(key, data)


def wait_until(predicate, seconds=30.0):
    end = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


@pytest.mark.parametrize("remote_every", [1, 2])
def test_saves_go_on_while_the_bucket_lags_by_at_most_remote_every_saves(tmp_path, group, remote_every):
    """A bucket root publishes each save (copy points, then the listing) behind the trainer: while one
    save's upload hangs, the next ``remote_every`` saves snapshot and commit locally; the save after them
    waits for the hung publication. Every save is listed, in order, and each segment is uploaded once; with
    remote_every=2 the publication behind the hung one lists the saves queued at once (one pointer swap)."""
    objects = GatedObjects()
    ck, model, opt = job(tmp_path / "n", objects, remote_every=remote_every, keep_last=3)
    train(model, opt, 0)
    assert ck.save(step=0).wait() == 1
    objects.gate.clear()
    train(model, opt, 1)
    pendings = [ck.save(step=1)]
    saved = {1: state(model)}  # by step
    wait_until(lambda: objects.held)  # its publication hangs in its copy point's upload
    for step in range(2, 2 + remote_every):  # these do not wait for it
        train(model, opt, step)
        pendings.append(ck.save(step=step))
        saved[step] = state(model)
        wait_until(lambda: pendings[-1].report.version is not None)  # (committed locally)
    assert not pendings[0].done() and [g.version for g in ck.versions()] == [1]
    train(model, opt, 9)
    blocked: list = []
    waiter = threading.Thread(target=lambda: blocked.append(ck.save(step=9)))
    waiter.start()
    time.sleep(0.5)
    assert not blocked and waiter.is_alive()  # the bucket may lag by remote_every saves, no more
    saved[9] = state(model)
    objects.gate.set()
    waiter.join(60)
    assert blocked and [p.wait() for p in pendings + blocked] == list(range(2, 4 + remote_every))
    if remote_every == 2:  # (the hung one, then saves 2 and 3 together, then save 9 alone or with them)
        from cnrstore.distributed.remote_root import decode_pointer

        listed = [set(decode_pointer(body, "ROOT", "t").numbers()) for body in objects.pointers]
        assert any(len(b - a) >= 2 for a, b in zip(listed, listed[1:])), listed
    ck.close()
    segments = {k: n for k, n in objects.puts.items() if k.endswith(".seg")}
    assert segments and max(segments.values()) == 1, segments  # (each sealed whole before the next save opened)
    listed = versions(tmp_path / "x", remote=objects)
    assert [g.step for g in listed] == [*range(1, 2 + remote_every), 9][-3:]
    fresh, m2, _ = job(tmp_path / "fresh", objects, seed=3)
    for gv in listed:
        fresh.restore(gv.version)
        assert_state(m2, saved[gv.step])
    fresh.close()


def test_without_remote_every_saves_never_wait_for_the_bucket_until_it_lags_past_remote_lag_s(tmp_path, group):
    """Issue 49, fault 5: with the default remote_every=None, saves go on while the bucket takes nothing
    (their publications queue behind the held one), and only a save that finds the bucket trailing past
    remote_lag_s waits for it; its SaveReport says how long. Once let go, one publication lists the saves
    queued, and a fresh machine restores the newest bit for bit."""
    objects = GatedObjects()
    reports = []
    ck, model, opt = job(tmp_path / "n", objects, remote_lag_s=1.0, on_report=reports.append)
    train(model, opt, 0)
    assert ck.save(step=0).wait() == 1
    objects.gate.clear()
    pendings, saved = [], {}
    for step in range(1, 6):  # five saves, none waits for the held publication
        train(model, opt, step)
        started = time.monotonic()
        pendings.append(ck.save(step=step))
        assert time.monotonic() - started < 1.0
        saved[step] = state(model)
        wait_until(lambda: pendings[-1].report.version is not None)  # (committed locally)
    assert [g.version for g in ck.versions()] == [1] and not pendings[0].done()
    # (as save 5 began, saves 1-3 were gathered and unlisted, and save 4 too unless its gather was still running)
    assert pendings[-1].report.bucket_lag_versions in (3, 4) and pendings[-1].report.bucket_wait_s == 0.0
    wait_until(lambda: ck._bucket_lag.versions() == 5)
    wait_until(lambda: ck._bucket_lag.seconds() > 1.0)
    train(model, opt, 9)
    threading.Timer(0.5, objects.gate.set).start()
    started = time.monotonic()
    late = ck.save(step=9)  # the bucket trails past remote_lag_s: this one waits for it
    assert time.monotonic() - started >= 0.4 and late.report.bucket_wait_s >= 0.4
    assert late.report.stall_s >= late.report.bucket_wait_s
    saved[9] = state(model)
    assert [p.wait() for p in pendings + [late]] == list(range(2, 8))
    ck.close()
    listed = versions(tmp_path / "x", remote=objects)
    assert [g.step for g in listed][-1] == 9
    fresh, m2, _ = job(tmp_path / "fresh", objects, seed=3)
    fresh.restore()
    assert_state(m2, saved[9])
    fresh.close()


def test_a_failed_publication_is_not_raised_by_the_next_saves_and_the_next_publication_lists_them(tmp_path, group):
    """Without remote_every a publication's failure (an upload refused) is its save's wait(), logged, and
    left to the next publication: the saves after it are not failed, and the bucket lists them."""
    objects = FailingObjects()
    ck, model, opt = _saved_once(tmp_path, objects)
    objects.fail_puts = 1
    train(model, opt, 1)
    failing = ck.save(step=1)
    with pytest.raises(RemoteStorageError, match="a test's flaky endpoint"):
        failing.wait()
    train(model, opt, 2)
    assert ck.save(step=2).wait() == 2  # (not raised here; the bucket lists step 2 as version 2)
    train(model, opt, 3)
    assert ck.save(step=3).wait() == 3
    assert [g.step for g in ck.versions()] == [0, 2, 3]
    ck.close()


class FailingObjects(DictObjectStore):
    """An in-memory bucket that refuses the next ``fail_puts`` PUTs into the rank stores' prefixes, and the next
    ``refuse_root`` conditional writes of the root's pointer."""

    fail_puts = 0
    refuse_root = 0

    def put(self, key, data):
        if key.startswith("gen-") and self.fail_puts:
            self.fail_puts -= 1
            raise RemoteStorageError(f"PUT {key}: refused (a test's flaky endpoint)")
        super().put(key, data)

    def put_if(self, key, data, tag):
        if key == "ROOT" and self.refuse_root:
            self.refuse_root -= 1
            raise RemoteStorageError("replacing ROOT failed after the client's retries (a test's endpoint)")
        super().put_if(key, data, tag)


def _saved_once(tmp_path, objects):
    """A one-rank job on ``objects`` whose first save is listed: (checkpointer, model, optimizer)."""
    ck, model, opt = job(tmp_path / "n", objects)
    train(model, opt, 0)
    assert ck.save(step=0).wait() == 1
    return ck, model, opt


@pytest.mark.parametrize("bad", [0, -2.0, True, "60"])
def test_remote_lag_s_is_checked(tmp_path, group, bad):
    with pytest.raises(InvalidArgument, match="remote_lag_s"):
        job(tmp_path / "a", DictObjectStore(), remote_lag_s=bad)


def test_remote_every_is_refused_without_a_bucket_and_checked(tmp_path, group):
    with pytest.raises(InvalidArgument, match="remote_every"):
        job(tmp_path / "a", None, remote_every=2)
    with pytest.raises(InvalidArgument, match="remote_every"):
        job(tmp_path / "b", DictObjectStore(), remote_every=0)


def test_retention_deletes_manifests_and_unreferenced_generations_from_the_bucket(tmp_path, group):
    objects = DictObjectStore()
    ck, model, opt = job(tmp_path / "n", objects, keep_last=2)
    for i in range(3):
        train(model, opt, i)
        ck.save(step=i).wait()
    ck.close()
    gen1 = {k for k in objects.objects if k.startswith("gen-000001/")}
    assert gen1 and len([k for k in objects.objects if k.startswith("global/")]) == 2
    # a model with one more table: another plan, a new generation; once no kept version reads generation 1,
    # its objects go
    ck, model, opt = job(tmp_path / "n", objects, keep_last=1, tables=dict(TABLES, **{"emb.c": (10, 3)}))
    assert ck.generation == 2
    train(model, opt, 5)
    ck.save(step=5).wait()
    assert [g.generation for g in ck.versions()] == [2]
    ck.close()
    assert not {k for k in objects.objects if k.startswith("gen-000001/")}
    assert (tmp_path / "n" / "gen-000001").exists()  # this node's directory goes at the next start
    job(tmp_path / "n", objects, tables=dict(TABLES, **{"emb.c": (10, 3)}))[0].close()
    assert not (tmp_path / "n" / "gen-000001").exists() and (tmp_path / "n" / "gen-000002").exists()
    assert len([k for k in objects.objects if k.startswith("global/")]) == 1
    root = RemoteRoot(tmp_path / "n", objects=objects)
    assert root.pointer().generations == (2,) and root.pointer().doomed == ()


def test_damaged_or_missing_root_objects_are_typed_errors(tmp_path, group):
    objects = DictObjectStore()
    with pytest.raises(StoreNotFound):
        versions(tmp_path, remote=objects)
    ck, model, opt = job(tmp_path / "n", objects)
    train(model, opt, 0)
    ck.save(step=0).wait()
    ck.close()
    good = dict(objects.objects)
    for key in ("ROOT", "CNRSTORE-DIST", next(k for k in good if k.startswith("global/"))):
        objects.objects[key] = good[key][:-1] + bytes([good[key][-1] ^ 1])
        with pytest.raises(CorruptionError):
            versions(tmp_path, remote=objects)
        objects.objects[key] = good[key]
    objects.objects.pop(next(k for k in good if k.startswith("global/")))
    with pytest.raises(CorruptionError):  # a listed manifest that is gone is damage, not "no version"
        versions(tmp_path, remote=objects)


def test_the_root_pointer_decoder_refuses_crafted_fields():
    from cnrstore.distributed.remote_root import decode_pointer

    good = RootPointer("ab" * 16, (1, 2), (), 3, ((1, "cd" * 16),))
    assert decode_pointer(good.encode(), "ROOT", "t")._replace(tag=None) == good
    for bad in (good._replace(owner="../x"), good._replace(next_generation=2), good._replace(generations=(0,)),
                good._replace(versions=((2, "ab"), (1, "ab"))), good._replace(versions=((1, "x/y"),))):
        with pytest.raises(CorruptionError):
            decode_pointer(bad.encode(), "ROOT", "t")


def test_faults_of_the_endpoint_fail_a_save_and_the_next_succeeds(tmp_path, group, s3_bucket, proxy):
    """500s, 503 SlowDown past the client's retries, uploads cut mid-body: each fails the save it strikes (the
    rank's own RemoteStorageError), the previous global version stays the newest, the next save succeeds,
    and the one after it (which waits for the failed publication: remote_every=1) raises the failure once;
    a fresh machine restores every version bit for bit."""
    url, opts = f"s3://{s3_bucket}/job", s3_options(proxy.url)
    ck, model, opt = job(tmp_path / "n", url, remote_options=opts, remote_every=1)
    train(model, opt, 0)
    assert ck.save(step=0).wait() == 1
    saved = {1: state(model)}
    for i, fault in enumerate((proxy.fail_puts, proxy.slow_down, proxy.drop_puts)):
        train(model, opt, 2 * i + 1)
        fault(10_000)
        with pytest.raises(RemoteStorageError):  # (the rank whose upload failed raises its own error)
            ck.save(step=2 * i + 1).wait()
        proxy.heal()
        assert [g.version for g in ck.versions()] == sorted(saved)
        train(model, opt, 2 * i + 2)
        version = ck.save(step=2 * i + 2).wait()  # (it started while the failed publication was let run)
        assert version == max(saved) + 1, fault
        saved[version] = state(model)
        with pytest.raises(RemoteStorageError):  # the failure is raised once more, at the save that waits for it
            ck.save(step=2 * i + 3)
    ck.close()
    fresh, m2, _ = job(tmp_path / "fresh", url, seed=3, remote_options=opts)
    for version, want in saved.items():
        fresh.restore(version)
        assert_state(m2, want)
    fresh.close()


def test_a_manifest_the_endpoint_cannot_find_is_damage(tmp_path, group, s3_bucket, proxy):
    url, opts = f"s3://{s3_bucket}/job", s3_options(proxy.url)
    ck, model, opt = job(tmp_path / "n", url, remote_options=opts)
    train(model, opt, 0)
    ck.save(step=0).wait()
    ck.close()
    proxy.hide("/global/g-")  # (404 to every GET and HEAD of a manifest)
    # (a job cannot start: which local versions it may drop depends on every listed manifest)
    with pytest.raises(CorruptionError, match="global/g-000000000001"):
        job(tmp_path / "fresh", url, seed=3, remote_options=opts)
    with pytest.raises(CorruptionError, match="global/g-000000000001"):
        versions(tmp_path / "fresh", remote=url, remote_options=opts)
    proxy.heal()
    fresh, m2, _ = job(tmp_path / "fresh", url, seed=3, remote_options=opts)
    assert fresh.restore().version == 1
    fresh.close()


def test_a_sub_prefix_and_a_tree_listing_on_s3(s3_endpoint, s3_bucket):
    from cnrstore.engine.objects import FsspecObjectStore

    objects = FsspecObjectStore(f"s3://{s3_bucket}/job", s3_options(s3_endpoint))
    rank = objects.sub("gen-000001/rank-00000")
    rank.put("CURRENT", b"p")
    rank.put("w/abc/segments/1.seg", b"xyz")
    objects.put("gen-000002/PLAN", b"q")
    assert rank.url == f"s3://{s3_bucket}/job/gen-000001/rank-00000"
    assert objects.list_tree("gen-000001") == {"rank-00000/CURRENT": 1, "rank-00000/w/abc/segments/1.seg": 3}
    assert rank.list("w/abc/segments") == {"1.seg": 3} and objects.list_tree("gen-000009") == {}
    rank.put_if("CURRENT", b"r", rank.get_tagged("CURRENT")[1])
    assert objects.get("gen-000001/rank-00000/CURRENT") == b"r"


def four_versions(tmp_path):
    """(an in-memory bucket holding a root with global versions 1-4 of a one-rank job, {version: its state})."""
    objects = DictObjectStore()
    ck, model, opt = job(tmp_path / "n1", objects)
    states = {}
    for i in range(4):
        train(model, opt, i)
        states[ck.save(step=i).wait()] = state(model)
    ck.close()
    return objects, states


def test_a_deleted_root_pointer_is_damage_no_job_claims_the_root_and_nothing_is_deleted(tmp_path, group):
    """Issue 49 fault 1: with ROOT deleted (an operator's rm, a lifecycle rule) and every other object there,
    a reader saw an empty root and the next job's claim deleted every manifest, segment and snapshot. Now a
    reader gets RemoteObjectMissing naming the fix, a job refuses to start, nothing is deleted, and with ROOT
    back every version restores bit for bit."""
    from cnrstore.errors import RemoteObjectMissing

    objects, states = four_versions(tmp_path)
    root = objects.objects.pop("ROOT")
    before = dict(objects.objects)
    with pytest.raises(RemoteObjectMissing, match="ROOT is missing.*repair") as exc:
        versions(tmp_path / "fresh", remote=objects)
    assert "global/g-000000000001" in str(exc.value) or "gen-000001" in str(exc.value)
    for node in ("n1", "n2"):  # the job restarted on its old directory, and on a fresh machine
        with pytest.raises(RemoteObjectMissing, match="No job may start"):
            job(tmp_path / node, objects, seed=3)
        assert objects.objects == before  # nothing deleted, nothing written
    objects.objects["ROOT"] = root
    assert [g.version for g in versions(tmp_path / "fresh2", remote=objects)] == [1, 2, 3, 4]
    for v, want in states.items():
        again, m2, _ = job(tmp_path / f"n3-{v}", objects, seed=7)
        assert again.restore(v).version == v
        assert_state(m2, want)
        again.close()


def test_repair_rebuilds_a_deleted_or_damaged_root_pointer_from_its_objects(tmp_path, group):
    """`cnrstore --remote URL repair DIR` (repair_root) on a root whose ROOT was deleted, or damaged: the
    pointer is rebuilt from the manifests, plans and rank stores, listing every global version that passes,
    each restoring bit for bit; a job then starts and goes on. Its one write is the pointer's put: a repair
    that died before it left the root as it was (the explorer of its effects: none or that one), and a repair
    run again leaves a sound pointer as it is. A stale job's unlisted manifest, and a manifest whose rank
    version is gone, are reported and not listed; nothing is deleted."""
    from cnrstore.distributed import repair_root
    from cnrstore.distributed.remote_root import manifest_key

    objects, states = four_versions(tmp_path)
    good = dict(objects.objects)
    # a stale job's manifest of version 4 (never listed), and a manifest naming a local version that is gone
    objects.objects[manifest_key(4, "ab" * 16)] = objects.objects[next(k for k in good if k.startswith("global/g-000000000004"))]
    gv3 = RemoteRoot(tmp_path / "r", objects=objects).read(3)
    bogus = gv3.to_dict() | {"version": 9, "local_versions": [99]}
    from cnrstore.distributed.manifest import seal
    objects.objects[manifest_key(9, "cd" * 16)] = seal("manifest", bogus)
    for damage in ("deleted", "damaged"):
        if damage == "deleted":
            objects.objects.pop("ROOT")
        else:
            objects.objects["ROOT"] = b"not a pointer"
        before = {k: v for k, v in objects.objects.items() if k != "ROOT"}
        effects = []
        real_put, real_delete = objects.put, objects.delete
        objects.put = lambda key, data: (effects.append(("put", key)), real_put(key, data))[1]
        objects.delete = lambda key: (effects.append(("delete", key)), real_delete(key))[1]
        try:
            report = repair_root(RemoteRoot(tmp_path / f"repair-{damage}", objects=objects))
        finally:
            del objects.put, objects.delete
        assert effects == [("put", "ROOT")]  # its only effect: every crash state is "before" or "repaired"
        assert report.rebuilt and report.versions == [1, 2, 3, 4] and report.generations == [1]
        assert report.previous.startswith("missing" if damage == "deleted" else "damaged")
        assert len(report.problems) == 2 and any("version 9" in p for p in report.problems)
        assert {k: v for k, v in objects.objects.items() if k != "ROOT"} == before  # nothing else touched
        again = repair_root(RemoteRoot(tmp_path / f"again-{damage}", objects=objects))
        assert not again.rebuilt and again.previous == "sound"
        assert [g.version for g in versions(tmp_path / f"fresh-{damage}", remote=objects)] == [1, 2, 3, 4]
    for v, want in states.items():
        reader, m2, _ = job(tmp_path / f"n2-{v}", objects, seed=7)
        assert reader.restore(v).version == v
        assert_state(m2, want)
        reader.close()
    resumed, m3, o3 = job(tmp_path / "n3", objects, seed=9)  # a job claims the repaired root and goes on
    assert resumed.restore().version == 4
    train(m3, o3, 5)
    assert resumed.save(step=5).wait() == 5
    resumed.close()


@pytest.mark.parametrize("lost", [1, 99])
def test_a_claim_that_loses_to_the_live_jobs_own_swap_claims_again_or_says_the_job_is_still_saving(tmp_path, lost):
    """Issue 49 fault 2, by schedule: a claim (a new job's start, `gc --take-over`) reads the pointer, the job
    still running swaps it (an ordinary save), the claim's compare-and-swap loses. It used to fail saying
    another job claimed the root at the same moment, when none had: now it claims again, and succeeds (the
    running job then fails at its next change with RemoteTakenOver); if the running job swaps every time, it
    fails saying that job is still saving."""
    from cnrstore.distributed.remote_root import CLAIM_TRIES
    from cnrstore.errors import RemoteConflict

    objects = DictObjectStore()
    live = RemoteRoot(tmp_path / "live", objects=objects)
    live.create()
    plans = iter(ShardingPlan.row_wise({"emb.a": (50 + i, 4)}, 1) for i in range(200))
    live.generation_for(next(plans))
    claimer = RemoteRoot(tmp_path / "claimer", objects=objects)
    real, fired = objects.put_if, []

    def put_if(key, data, tag):
        if key == "ROOT" and not getattr(put_if, "inside", False) and len(fired) < lost:
            put_if.inside = True
            try:
                fired.append(live.generation_for(next(plans)))  # the live job's own swap lands first
            finally:
                put_if.inside = False
        return real(key, data, tag)

    objects.put_if = put_if
    if lost < CLAIM_TRIES:
        claimer.create()
        assert claimer.pointer().owner == claimer.job and len(fired) == lost
        with pytest.raises(RemoteTakenOver):
            live.generation_for(next(plans))
    else:
        with pytest.raises(RemoteConflict, match=f"the job {live.job} is still saving.*stop that job first"):
            claimer.create()
        assert claimer.pointer().owner == live.job and len(fired) == CLAIM_TRIES


def test_a_failed_root_pointer_write_is_a_global_commit_error_caused_by_the_object_stores(tmp_path, group):
    """Issue 49, fault 7: a 1-rank job whose root pointer cannot be written: GlobalCommitError (as on every
    rank), whose __cause__ on rank 0 is the object store's RemoteStorageError; the next save lists again."""
    from cnrstore.errors import GlobalCommitError

    objects = FailingObjects()
    ck, model, opt = _saved_once(tmp_path, objects)
    objects.refuse_root = 1
    train(model, opt, 1)
    with pytest.raises(GlobalCommitError) as caught:
        ck.save(step=1).wait()
    assert isinstance(caught.value.__cause__, RemoteStorageError)
    assert "replacing ROOT failed" in str(caught.value)
    train(model, opt, 2)
    assert ck.save(step=2).wait() == 2
    ck.close()


def test_a_commit_whose_collective_failed_says_why_in_words(tmp_path, group):
    """Issue 49, fault 6: not torch's raw message alone."""
    ck, _model, _opt = job(tmp_path / "n", DictObjectStore())
    destroyed = ck._incomplete(7, RuntimeError("Process group 3 is not initialized in the world group map"))
    assert "process group was destroyed before the commit ended" in str(destroyed)
    assert "torch.distributed: RuntimeError: Process group 3" in str(destroyed)
    died = ck._incomplete(7, RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:11180"))
    assert "closed its connection: it died" in str(died)
    ck.close()


def test_repair_root_rebuilds_a_rank_stores_deleted_pointer_too(tmp_path, group, capsys):
    """A rank store's own CURRENT deleted (ROOT sound, or deleted as well): its global versions do not read;
    `cnrstore --remote URL repair DIR` (repair_root) rebuilds the rank store's pointer from its newest snapshot
    that verifies, and every version restores bit for bit again. Nothing is deleted."""
    from cnrstore import cli
    from cnrstore.distributed import repair_root

    objects, states = four_versions(tmp_path)
    rank_pointer = next(k for k in objects.objects if k.startswith("gen-") and k.endswith("/rank-00000/CURRENT"))
    for also_root in (False, True):
        objects.objects.pop(rank_pointer)
        if also_root:
            objects.objects.pop("ROOT")
        before = set(objects.objects)
        with pytest.raises(RemoteStorageError, match="repair"):  # (RemoteObjectMissing: no job starts on it)
            job(tmp_path / f"broken-{also_root}", objects, seed=7)
        report = repair_root(RemoteRoot(tmp_path / f"repair-{also_root}", objects=objects))
        assert report.ok and report.rebuilt == also_root
        assert len(report.rank_stores) == 1 and report.rank_stores[0].startswith(rank_pointer.rsplit("/", 1)[0])
        assert before <= set(objects.objects) and rank_pointer in objects.objects  # (only pointers were put)
        for v, want in states.items():
            fresh, m2, _ = job(tmp_path / f"fresh-{also_root}-{v}", objects, seed=8)
            assert fresh.restore(v).version == v
            assert_state(m2, want)
            fresh.close()
    objects.objects.pop(rank_pointer)
    url_root = RemoteRoot(tmp_path / "cli", objects=objects)
    assert cli.cmd_repair_root(type("Args", (), {"json": False, "progress": False, "quiet": True})(), url_root) == 0
    out = capsys.readouterr().out
    assert "rebuilt: gen-" in out and "1 rank store pointer(s) rebuilt" in out


def test_without_remote_every_a_failed_local_write_is_raised_by_the_second_save_after_it(tmp_path, group):
    """A save on a bucket root waits for the commit of the save before the previous one only: a local write
    that fails is raised (on every rank: by the gather's outcome) by the second save after it, never by one
    rank alone earlier; that save takes no snapshot, and the saves after it go on."""
    from cnrstore.errors import StorageIOError

    objects = DictObjectStore()
    ck, model, opt = _saved_once(tmp_path, objects)
    store = ck.store
    real = store.checkpoint
    calls = []

    def failing_once(*a, **k):
        calls.append(1)
        if len(calls) == 1:
            raise StorageIOError("a test's disk refused the write")
        return real(*a, **k)

    store.checkpoint = failing_once
    try:
        train(model, opt, 1)
        failed = ck.save(step=1)
        with pytest.raises(StorageIOError):
            failed.wait()
        train(model, opt, 2)
        ck.save(step=2)  # (the save right after it: not raised here)
        train(model, opt, 3)
        with pytest.raises(StorageIOError, match="refused the write"):
            ck.save(step=3)  # the second save after it
        train(model, opt, 4)
        assert ck.save(step=4).wait() == 3  # (versions 1, then step 2's, then this one)
    finally:
        del store.checkpoint
    assert [g.step for g in ck.versions()] == [0, 2, 4]
    ck.close()


def test_a_root_repair_killed_at_any_object_effect_then_run_again_repairs_the_root(tmp_path, group):
    """The crash-state explorer of repair_root with a rank store's CURRENT and ROOT both deleted: its effects
    are conditional puts (the rank store's pointer, then ROOT); the bucket as of every prefix of them, repaired
    again, lists versions 1-4, each restoring bit for bit, and nothing is ever deleted."""
    from cnrstore.distributed import repair_root

    objects, states = four_versions(tmp_path)
    rank_pointer = next(k for k in objects.objects if k.startswith("gen-") and k.endswith("/rank-00000/CURRENT"))
    objects.objects.pop(rank_pointer)
    objects.objects.pop("ROOT")
    damaged = dict(objects.objects)
    effects = []
    real_put, real_delete = objects.put, objects.delete
    objects.put = lambda key, data: (effects.append(("put", key, bytes(data))), real_put(key, data))[1]
    objects.delete = lambda key: (effects.append(("delete", key, None)), real_delete(key))[1]
    try:
        repair_root(RemoteRoot(tmp_path / "recorded", objects=objects))
    finally:
        del objects.put, objects.delete
    assert [(kind, key) for kind, key, _ in effects] == [("put", rank_pointer), ("put", "ROOT")]
    for k in range(len(effects) + 1):
        state = DictObjectStore(damaged)
        for _kind, key, data in effects[:k]:
            state.objects[key] = data
        report = repair_root(RemoteRoot(tmp_path / f"again-{k}", objects=state))
        assert report.ok and report.versions in ([1, 2, 3, 4], [])  # ([] : ROOT was there and sound already)
        assert set(damaged) <= set(state.objects)
        assert [g.version for g in versions(tmp_path / f"fresh-{k}", remote=state)] == [1, 2, 3, 4]
        reader, m2, _ = job(tmp_path / f"reader-{k}", state, seed=5)
        for v, want in states.items():
            assert reader.restore(v).version == v
            assert_state(m2, want)
        reader.close()
