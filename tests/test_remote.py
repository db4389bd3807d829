"""The object-store tier (engine/remote.py) against an S3 endpoint on localhost (moto's server, started by the
session fixture in conftest.py), through a fault-injecting HTTP proxy (tests/support/s3_proxy.py): round trips,
reads of evicted segments by range, the cache bound, remote deletion only after the pointer moved, recovery
from the remote alone, one writer per prefix, and the faults (a connection cut mid-upload, throttling, a
missing object, an endpoint that is down): nothing committed is lost, every error is typed, and the store
stays usable."""

from __future__ import annotations

import os

import numpy as np
import pytest

import cnrstore
from cnrstore.engine import remote as remote_tier
from cnrstore.maintenance.repair import repair
from cnrstore.errors import CorruptionError, InvalidArgument, RemoteObjectMissing, RemoteStorageError, StoreNotFound

from support.s3_remote import (ROWS, Trainer, objects, open_remote, proxy, remote, s3_options, segment_ids,  # noqa: F401
                               small_segments, snapshots)  # (proxy, remote, small_segments: fixtures)


def test_round_trip_evicted_reads_and_cache_bound(tmp_path, remote):
    bound = 64 << 10
    with open_remote(tmp_path / "a", remote, cache_bytes=bound) as store:
        t = Trainer(store)
        for _ in range(6):
            t.save()
            status = store.stats()["remote"]
            assert status["cached_bytes"] <= bound, status  # the bound holds after every save
            assert status["last_error"] is None
        assert status["segments_evicted"] > 0 and status["evicted_segments"] > 0
        before = store.stats()["remote"]["remote_reads"]
        t.check(store)  # the old versions read evicted segments back by range
        assert store.stats()["remote"]["remote_reads"] > before
        assert not store.verify().problems


def test_recovery_from_the_remote_alone_is_bit_exact(tmp_path, remote, s3_bucket, s3_endpoint):
    url, opts = remote
    with open_remote(tmp_path / "a", remote, cache_bytes=0) as store:
        t = Trainer(store)
        for _ in range(5):
            t.save()
    assert "CURRENT" in objects(s3_endpoint, s3_bucket)
    # a fresh machine: an empty directory and the URL
    t.check_fresh(tmp_path / "fresh", remote)
    with cnrstore.open(tmp_path / "fresh2", remote=url, remote_options=opts) as store:  # writable: takes over
        t.check(store)
        t.store = store
        t.save()
        t.check(store)
    t.check_fresh(tmp_path / "fresh3", remote)


def test_remote_every_sets_the_copy_points(tmp_path, remote):
    store = open_remote(tmp_path / "a", remote, remote_every=3)
    t = Trainer(store)
    for _ in range(4):
        t.save()
    # copy point at the third commit: a machine that recovers now sees versions 1-3, not the fourth
    t.check_fresh(tmp_path / "r", remote, sorted(t.content)[:3])
    store.close()  # close is a copy point
    t.check_fresh(tmp_path / "r2", remote)


def test_gc_deletes_remote_segments_only_after_the_pointer_moved(tmp_path, remote, s3_bucket, s3_endpoint):
    with open_remote(tmp_path / "a", remote, cache_bytes=0) as store:
        t = Trainer(store)
        for _ in range(5):
            t.save(touched=ROWS // 2)
        before = segment_ids(objects(s3_endpoint, s3_bucket))
        kept = sorted(t.content)[-2:]
        store.retain(2)
        report = store.gc()
        assert report.segments_deleted > 0
        # GC freed segments locally; the pointer still names the index that reads them: all still remote
        assert segment_ids(objects(s3_endpoint, s3_bucket)) >= before
        t.check_fresh(tmp_path / "r", remote)  # every version of the last copy point, although GC dropped three since
        store.sync_remote()  # the pointer moves: now the freed ones go
        after = segment_ids(objects(s3_endpoint, s3_bucket))
        assert before - after  # the freed segments are gone from the remote
        with store.engine.read() as view:
            assert set(view.segments()) <= after  # and every one the index reads is still there
        assert len(snapshots(objects(s3_endpoint, s3_bucket))) == 1  # older snapshots deleted
        t.content = {v: t.content[v] for v in kept}
        t.check(store)
    t.check_fresh(tmp_path / "r2", remote)


def test_one_writer_per_prefix(tmp_path, remote):
    url, opts = remote
    with open_remote(tmp_path / "a", remote) as store:
        Trainer(store).save()
    with cnrstore.open(tmp_path / "b", remote=url, remote_options=opts) as other:  # recovered elsewhere
        Trainer(other, seed=1).save()
    with pytest.raises(RemoteStorageError, match="one writer per prefix"):
        cnrstore.open(tmp_path / "a", remote=url, remote_options=opts)
    with cnrstore.open(tmp_path / "a", readonly=True, remote=url, remote_options=opts) as old:
        assert len(old.versions()) == 1  # reading the stale copy is allowed


def test_a_local_store_is_attached_to_a_remote(tmp_path, remote):
    """A store made without remote= and opened writable with it: its first copy point uploads all of it."""
    with cnrstore.open(tmp_path / "a", create=True) as store:
        t = Trainer(store)
        t.save()
        t.save()
    url, opts = remote
    with pytest.raises(InvalidArgument, match="has no remote tier"):
        cnrstore.open(tmp_path / "a", readonly=True, remote=url, remote_options=opts)
    with cnrstore.open(tmp_path / "a", remote=url, remote_options=opts) as store:
        t.store = store
        t.save()
    t.check_fresh(tmp_path / "fresh", remote)
    with cnrstore.open(tmp_path / "b", create=True) as other:  # another store may not attach to the same prefix
        Trainer(other).save()
    with pytest.raises(RemoteStorageError, match="another store's copy"):
        cnrstore.open(tmp_path / "b", remote=url, remote_options=opts)


def test_open_arguments_are_checked(tmp_path, remote):
    url, opts = remote
    with pytest.raises(StoreNotFound, match="CURRENT"):
        cnrstore.open(tmp_path / "x", remote=url, remote_options=opts)
    with pytest.raises(InvalidArgument, match="not a URL"):
        cnrstore.open(tmp_path / "x", create=True, remote="bucket/prefix")
    with pytest.raises(InvalidArgument, match="need remote="):
        cnrstore.open(tmp_path / "x", create=True, cache_bytes=10)
    with pytest.raises(InvalidArgument, match="remote_every"):
        cnrstore.open(tmp_path / "x", create=True, remote=url, remote_options=opts, remote_every=0)
    with open_remote(tmp_path / "a", remote) as store:
        Trainer(store).save()
    with pytest.raises(InvalidArgument, match="open it with that remote="):
        cnrstore.open(tmp_path / "a")


def test_repair_without_the_remote_is_refused_and_deletes_nothing(tmp_path, remote, s3_bucket, s3_endpoint):
    """A repair that saw only the cached segments would index them alone; the next copy point would then
    delete every other segment object. Refused before the store is touched."""
    with open_remote(tmp_path / "a", remote, cache_bytes=0) as store:  # every sealed segment evicted
        trainer = Trainer(store)
        for _ in range(3):
            trainer.save()
    before = objects(s3_endpoint, s3_bucket)
    index_before = sorted(os.listdir(tmp_path / "a" / "index"))
    with pytest.raises(InvalidArgument, match="repair it with that remote="):
        repair(tmp_path / "a")
    assert sorted(os.listdir(tmp_path / "a" / "index")) == index_before
    url, opts = remote
    with cnrstore.open(tmp_path / "a", remote=url, remote_options=opts) as store:
        store.sync_remote()
        trainer.check(store)
    assert segment_ids(objects(s3_endpoint, s3_bucket)) == segment_ids(before)


# -- faults ---------------------------------------------------------------------------------------------------

def test_a_connection_cut_mid_upload_is_retried(tmp_path, remote, proxy):
    with open_remote(tmp_path / "a", remote, cache_bytes=0) as store:
        t = Trainer(store)
        t.save()
        proxy.drop_puts(1)
        t.save()
        assert any(kind == "drop" for kind, _ in proxy.log)
        assert store.stats()["remote"]["last_error"] is None  # the client's retry got it through
    t.check_fresh(tmp_path / "r", remote)


def test_uploads_failing_for_good_lose_nothing_and_are_retried(tmp_path, remote, proxy, monkeypatch):
    monkeypatch.setattr(remote_tier, "RETRY_BASE_S", 0.0)  # (the backoff between failing copy points: its own test)
    with open_remote(tmp_path / "a", remote, cache_bytes=0) as store:
        t = Trainer(store)
        t.save()
        proxy.drop_puts(1000)  # every upload cut off: past every retry
        v = t.save()  # the commit stands locally
        status = store.stats()["remote"]
        assert "failed after the client's retries" in status["last_error"]
        assert status["cached_bytes"] > 0  # what is not uploaded stays local (cache_bytes=0 notwithstanding)
        t.check(store)
        with pytest.raises(RemoteStorageError, match="check: the endpoint URL"):
            store.sync_remote()
        t.check_fresh(tmp_path / "r", remote, sorted(t.content)[:-1])  # the remote reads at its last copy point
        proxy.heal()
        t.save()  # the next copy point uploads what the failed ones did not
        assert store.stats()["remote"]["last_error"] is None
        assert v in [x.version for x in store.versions()]
    t.check_fresh(tmp_path / "r2", remote)


def test_throttling_within_the_retries_and_past_them(tmp_path, remote, proxy):
    with open_remote(tmp_path / "a", remote) as store:
        t = Trainer(store)
        t.save()
        proxy.slow_down(1)
        store.sync_remote()  # one 503 SlowDown: retried by the client
        assert ("503" in {k for k, _ in proxy.log})
        proxy.slow_down(1000)
        with pytest.raises(RemoteStorageError, match="kept throttling"):
            store.sync_remote()
        proxy.heal()
        t.save()
        store.sync_remote()
    t.check_fresh(tmp_path / "r", remote)


def test_a_missing_remote_segment_is_a_typed_corruption(tmp_path, remote, proxy):
    url, opts = remote
    with open_remote(tmp_path / "a", remote, cache_bytes=0) as store:
        t = Trainer(store)
        t.save()
        t.save()
        proxy.hide("/segments/")
        with pytest.raises(RemoteObjectMissing, match=r"ckpt/w/[0-9a-f]{32}/segments/[0-9a-f]{16}\.seg: the object is missing") as info:
            store.read_table("t", 1)
        assert isinstance(info.value, CorruptionError) and info.value.path.startswith(url)
        report = store.verify()
        assert report.problems and "missing" in str(report.problems[0])
        proxy.heal()
        t.check(store)  # usable again once the object is back


def test_an_endpoint_that_is_down_is_a_typed_error(tmp_path, s3_bucket):
    opts = s3_options("http://127.0.0.1:9", connect_timeout=1, retries={"max_attempts": 1})
    with pytest.raises(RemoteStorageError, match="failed after the client's retries"):
        cnrstore.open(tmp_path / "a", create=True, remote=f"s3://{s3_bucket}/ckpt", remote_options=opts)
    assert not (tmp_path / "a").exists() or not list((tmp_path / "a").iterdir())



def test_a_bucket_that_does_not_exist_is_a_storage_error_not_damage(tmp_path, s3_endpoint):
    """Opening a store on a bucket nobody made is the URL's fault, found at open (before any save), not a
    missing (corrupt) object: RemoteStorageError saying so, nothing created locally."""
    with pytest.raises(RemoteStorageError, match="the bucket does not exist") as raised:
        cnrstore.open(tmp_path / "a", create=True, remote="s3://no-such-bucket-anywhere/ckpt",
                      remote_options=s3_options(s3_endpoint))
    assert not isinstance(raised.value, CorruptionError)
    assert not (tmp_path / "a").exists() or not list((tmp_path / "a").iterdir())


# -- the command line -----------------------------------------------------------------------------------------

def test_cli_reads_verifies_exports_and_repairs_through_the_remote(tmp_path, remote, capsys):
    import json

    from cnrstore.cli import main

    url, opts = remote
    with open_remote(tmp_path / "a", remote, cache_bytes=0) as store:
        t = Trainer(store)
        for _ in range(3):
            t.save()
    args = ["--remote", url, "--remote-options", json.dumps(opts)]
    capsys.readouterr()
    assert main([*args, "ls", str(tmp_path / "cache"), "--json"]) == 0  # a fresh machine: recovered on the way
    assert [r["version"] for r in json.loads(capsys.readouterr().out)] == sorted(t.content)
    assert main([*args, "verify", str(tmp_path / "cache")]) == 0
    out = tmp_path / "v.npz"
    assert main([*args, "export", str(tmp_path / "cache"), "--format", "npz", str(out), "--version", "2"]) == 0
    with np.load(out) as z:
        (key,) = [k for k in z.files if k.endswith("t")]
        np.testing.assert_array_equal(z[key], t.content[2])
    # repair --remote into an empty directory: the last copy point's index
    capsys.readouterr()
    assert main([*args, "repair", str(tmp_path / "r"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["versions_recovered"] == sorted(t.content)
    t.check_fresh(tmp_path / "r", remote)
    # the index of the original store lost: repair --remote rebuilds it from local and remote segments
    import shutil

    shutil.rmtree(tmp_path / "a" / "index")
    assert main([*args, "repair", str(tmp_path / "a")]) == 0
    with cnrstore.open(tmp_path / "a", remote=url, remote_options=opts) as store:
        t.check(store)
    capsys.readouterr()
    assert main(["--remote", "s3://nobucket-here/x", *args[2:], "ls", str(tmp_path / "nothing")]) == 2
    assert "RemoteStorageError" in (err := capsys.readouterr().err) and "the bucket does not exist" in err


def test_a_conditional_put_whose_retry_meets_its_own_landed_write_succeeds(s3_endpoint, s3_bucket, monkeypatch):
    """S3 retries a request that timed out; if the first attempt landed, the retry's condition fails on the
    writer's own object (412). That is a success, not a lost race: a copy point that took it for one deleted
    the snapshot the pointer now named. A condition that fails on another writer's object still raises."""
    from cnrstore.engine.objects import FsspecObjectStore
    from cnrstore.errors import RemoteConflict

    objects = FsspecObjectStore(f"s3://{s3_bucket}/retried", s3_options(s3_endpoint))
    assert objects.conditional_writes
    objects.put_if("CURRENT", b"first", None)
    real = objects._run

    def landed_then_412(fn, *args, what, key, **kwargs):
        result = real(fn, *args, what=what, key=key, **kwargs)
        if what == "replacing":  # (the first attempt landed; the retry's condition fails)
            raise RemoteConflict(f"{what} {key}: another writer replaced it first")
        return result

    monkeypatch.setattr(objects, "_run", landed_then_412)
    objects.put_if("CURRENT", b"second", objects.get_tagged("CURRENT")[1])
    assert objects.get("CURRENT") == b"second"
    monkeypatch.setattr(objects, "_run", real)
    stale = objects.get_tagged("CURRENT")[1]
    objects.put_if("CURRENT", b"third", stale)
    with pytest.raises(RemoteConflict):
        objects.put_if("CURRENT", b"fourth", stale)
    assert objects.get("CURRENT") == b"third"
