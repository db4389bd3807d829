"""The bucket never serves another writer's bytes, and never calls an intact store damaged: one named test per
fault found by trying (issue "The bucket never serves another writer's bytes"), against moto's S3 server
through the fault proxy (the fixtures test_remote.py uses: tests/support/s3_remote.py).

- a stale writer that commits after another machine took the prefix over: its bytes never reach the new
  writer's versions, from any directory or from the bucket; it learns at that commit (RemoteTakenOver);
- a read cache (`cnrstore --remote URL ls DIR`) has an identity of its own: opened writable later it takes
  the prefix over, and the old writer's restart is refused;
- reads of old versions while uploads fail: a fetched segment is never evicted under the read;
- a readonly process beside the writer reads what was committed after it opened;
- a read cache opened again follows the bucket (retain, gc and saves since);
- a damaged CURRENT or REMOTE is a typed error naming the fix; the writer's own directory still opens readonly;
- a hung endpoint costs a save at most the request deadline, and a failing one costs later saves nothing
  while the copy points back off;
- bad remote_options are InvalidArgument at open.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest

import cnrstore
from cnrstore.cli import main
from cnrstore.engine import filenames
from cnrstore.engine import remote as remote_tier
from cnrstore.engine.remote_layout import CACHE, WRITER, decode_identity, decode_pointer
from cnrstore.errors import (CorruptionError, InvalidArgument, RemoteObjectMissing, RemoteStorageError,
                             RemoteTakenOver)

from support.s3_remote import (ROWS, Trainer, open_remote, proxy, remote, s3_options,  # noqa: F401
                               small_segments)  # (proxy, remote, small_segments: fixtures)


def ident(path) -> dict:
    with open(os.path.join(path, filenames.REMOTE), "rb") as f:
        return json.loads(f.read())


def cli(remote, *args) -> int:
    url, opts = remote
    return main(["--remote", url, "--remote-options", json.dumps(opts), *map(str, args)])


# -- 1. a stale writer ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("rollover", [False, True], ids=["one-segment-save", "save-with-rollovers"])
def test_a_stale_writers_commit_never_reaches_the_new_writers_versions(tmp_path, remote, rollover):
    """A writes v1; machine B recovers the prefix and commits v2 (its copy point completes); A, still alive,
    commits one more save. B's v2, a fresh recovery's v2 and B's directory read B's rows; A learns at that
    commit (RemoteTakenOver naming B), keeps what it committed readable locally, and takes no more
    checkpoints; A's restart is refused."""
    url, opts = remote
    a = open_remote(tmp_path / "a", remote, cache_bytes=0)
    ta = Trainer(a, seed=1)
    ta.save()
    with cnrstore.open(tmp_path / "b", remote=url, remote_options=opts, cache_bytes=0) as b:
        tb = Trainer(b, seed=2)
        tb.resume(ta)
        assert b.stats()["remote"]["role"] == WRITER and b.stats()["remote"]["store_id"] != a.stats()["remote"]["store_id"]
        v2 = tb.save()
    with pytest.raises(RemoteTakenOver, match="taken over by another store") as raised:
        ta.save(touched=ROWS if rollover else 64)  # a stale commit (with a full rewrite: several segments seal)
    assert raised.value.version == v2  # both allocated the same number: A's is committed in A's directory only
    assert raised.value.writer == ident(tmp_path / "b")["store_id"]
    ta.content[v2] = ta.model.copy()  # (committed: the error came after the commit)
    ta.check(a)  # what A committed, the stale version too, reads back in A's directory
    with pytest.raises(RemoteTakenOver):
        a.checkpoint()  # no more checkpoints from A
    assert a.stats()["remote"]["taken_over"]
    a.close()
    # B's directory, and recovery from the bucket alone, read B's rows at v2, never A's
    with cnrstore.open(tmp_path / "b", readonly=True, remote=url, remote_options=opts) as b:
        tb.check(b)
    tb.check_fresh(tmp_path / "fresh", remote)
    with pytest.raises(RemoteTakenOver, match="one writer per prefix"):
        cnrstore.open(tmp_path / "a", remote=url, remote_options=opts)
    with cnrstore.open(tmp_path / "a", readonly=True, remote=url, remote_options=opts) as old:
        ta.check(old)  # the stale directory stays readable as it was (every segment fetched back)
    with cnrstore.open(tmp_path / "b", remote=url, remote_options=opts, cache_bytes=0) as b:  # B writes on
        tb.store = b
        tb.save()
    tb.check_fresh(tmp_path / "fresh2", remote)


def test_two_machines_taking_the_prefix_over_from_one_copy_point_one_wins(tmp_path, remote):
    """Two recoveries of the same copy point, both opened writable: the second's claim (a conditional PUT on
    the pointer it read) fails, so only one becomes the writer."""
    url, opts = remote
    with open_remote(tmp_path / "a", remote) as a:
        t = Trainer(a)
        t.save()
    b = cnrstore.open(tmp_path / "b", readonly=True, remote=url, remote_options=opts)  # both recovered from
    c = cnrstore.open(tmp_path / "c", readonly=True, remote=url, remote_options=opts)  # generation 1
    b.close()
    c.close()
    with cnrstore.open(tmp_path / "b", remote=url, remote_options=opts) as b:
        Trainer(b, seed=5).save()
        # c was installed from the pointer b replaced: its writable open installs the newest, then claims it
        with cnrstore.open(tmp_path / "c", remote=url, remote_options=opts):
            pass
        with pytest.raises(RemoteTakenOver):
            Trainer(b, seed=6).save()  # b lost it to c


# -- 2. a read cache is no writer ------------------------------------------------------------------------------

def test_a_read_cache_has_its_own_identity_and_a_later_writable_open_takes_the_prefix_over(tmp_path, remote):
    url, opts = remote
    with open_remote(tmp_path / "a", remote) as a:
        ta = Trainer(a, seed=1)
        ta.save()
        ta.save()
        writer_id = a.stats()["remote"]["store_id"]
    assert cli(remote, "ls", tmp_path / "b") == 0  # a read cache
    cache = ident(tmp_path / "b")
    assert cache["role"] == CACHE and cache["store_id"] != writer_id
    with cnrstore.open(tmp_path / "b", remote=url, remote_options=opts) as b:  # writable: a takeover
        tb = Trainer(b, seed=2)
        tb.resume(ta)
        tb.save()
        assert ident(tmp_path / "b")["role"] == WRITER
    with pytest.raises(RemoteTakenOver):  # A's restarted trainer is refused
        cnrstore.open(tmp_path / "a", remote=url, remote_options=opts)
    tb.check_fresh(tmp_path / "fresh", remote)


# -- 3. reads while uploads fail -------------------------------------------------------------------------------

def test_reads_of_old_versions_while_uploads_fail_never_lose_the_fetched_segment(tmp_path, remote, proxy):
    """Uploads answer 500 while GETs work; 4 saves stand locally, more than the 128 KiB cache holds. Reads of v1
    (its segments evicted earlier) fetch them back and read them, verify is clean, a merge that reads old
    records works; the cache says it is over its bound and deletes nothing it has not uploaded."""
    with open_remote(tmp_path / "a", remote, cache_bytes=128 << 10) as store:
        t = Trainer(store)
        t.save()
        t.save(touched=ROWS)
        assert store.stats()["remote"]["segments_evicted"] > 0
        proxy.fail_puts(10_000)
        for _ in range(4):
            t.save(touched=ROWS // 2)
        status = store.stats()["remote"]
        assert status["last_error"] and status["over_bound_bytes"] > 0, status
        t.check(store)  # v1 and v2 read back through fetched segments
        report = store.verify()
        assert report.ok, report.problems[:3]
        store.compact()  # reads old records to write a baseline
        t.check(store)
        proxy.heal()
        store.sync_remote()
    t.check_fresh(tmp_path / "r", remote)


# -- 4. a reader beside the writer ------------------------------------------------------------------------------

def test_a_readonly_store_beside_the_writer_reads_what_was_committed_after_it_opened(tmp_path, remote):
    url, opts = remote
    with open_remote(tmp_path / "a", remote, cache_bytes=0) as writer:
        t = Trainer(writer)
        t.save()
        with cnrstore.open(tmp_path / "a", readonly=True, remote=url, remote_options=opts) as reader:
            for _ in range(6):
                t.save()  # each copy point evicts the segments the reader has not seen
            assert writer.stats()["remote"]["evicted_segments"] > 0
            t.check(reader)
            assert reader.verify().ok
        assert not [n for n in os.listdir(tmp_path / "a" / "segments") if n.endswith(".download")]


# -- 5. a read cache follows the bucket --------------------------------------------------------------------------

def test_a_read_cache_opened_again_follows_the_bucket(tmp_path, remote, capsys):
    url, opts = remote
    with open_remote(tmp_path / "a", remote, cache_bytes=0) as a:
        t = Trainer(a)
        for _ in range(3):
            t.save()
        assert cli(remote, "ls", tmp_path / "cache", "--json") == 0  # day 1
        assert [r["version"] for r in json.loads(capsys.readouterr().out)] == [1, 2, 3]
        assert cli(remote, "export", tmp_path / "cache", "--format", "npz", tmp_path / "day1.npz") == 0
        live = cnrstore.open(tmp_path / "live", readonly=True, remote=url, remote_options=opts)  # nothing cached
        for _ in range(2):
            t.save(touched=ROWS)
        a.retain(keep_last=2)
        a.gc()
        t.save(touched=ROWS)
        t.content = {v: t.content[v] for v in [x.version for x in a.versions()]}
    # a cache open since day 1 that reads a version the bucket dropped: the bucket moved on, nothing is damaged
    with pytest.raises(RemoteStorageError, match="moved on") as raised:
        live.read_table("t", version=1)
    assert not isinstance(raised.value, CorruptionError)
    with pytest.raises(RemoteStorageError, match="moved on"):
        live.verify()  # (verify cannot tell: it says why, and reports no damage)
    live.close()
    capsys.readouterr()
    assert cli(remote, "ls", tmp_path / "cache", "--json") == 0  # day 2: the newest copy point installed
    assert [r["version"] for r in json.loads(capsys.readouterr().out)] == sorted(t.content)
    assert cli(remote, "verify", tmp_path / "cache") == 0
    assert cli(remote, "export", tmp_path / "cache", "--format", "npz", tmp_path / "day2.npz") == 0
    with np.load(tmp_path / "day2.npz") as z:
        (key,) = [k for k in z.files if k.endswith("t")]
        np.testing.assert_array_equal(z[key], t.content[max(t.content)])
    with cnrstore.open(tmp_path / "cache", readonly=True, remote=url, remote_options=opts) as cache:
        t.check(cache)
    assert not [n for n in os.listdir(tmp_path / "cache") if filenames.is_index_replaced(n)]


# -- 6. parsers ------------------------------------------------------------------------------------------------

def _put_pointer(s3_endpoint, bucket, body: bytes) -> None:
    import boto3

    o = s3_options(s3_endpoint)
    boto3.client("s3", endpoint_url=s3_endpoint, aws_access_key_id=o["key"], aws_secret_access_key=o["secret"],
                 region_name="us-east-1").put_object(Bucket=bucket, Key="ckpt/CURRENT", Body=body)


def _pointer_body(s3_endpoint, bucket) -> dict:
    import boto3

    o = s3_options(s3_endpoint)
    data = boto3.client("s3", endpoint_url=s3_endpoint, aws_access_key_id=o["key"], aws_secret_access_key=o["secret"],
                        region_name="us-east-1").get_object(Bucket=bucket, Key="ckpt/CURRENT")["Body"].read()
    return json.loads(data)["pointer"]


def _crafted(good: dict):
    """``good`` with each field dropped, and replaced by values of the wrong type or range."""
    for field in sorted(good):
        yield {k: v for k, v in good.items() if k != field}
        for bad in (None, "x", -1, [], {}, 2 ** 70, 1.5, True, [["", -1]], [["zz", 0]]):
            yield {**good, field: bad}


def _checksummed(body: dict) -> bytes:
    import xxhash

    text = json.dumps(body, sort_keys=True)
    return json.dumps({"pointer": body, "xxh3": f"{xxhash.xxh3_64_intdigest(text.encode()):016x}"}).encode()


def test_a_damaged_pointer_is_a_typed_error_and_the_writers_directory_still_opens_readonly(
        tmp_path, remote, s3_endpoint, s3_bucket, capsys):
    url, opts = remote
    with open_remote(tmp_path / "a", remote, cache_bytes=0) as a:
        t = Trainer(a)
        t.save()
    good = _pointer_body(s3_endpoint, s3_bucket)
    untyped = []
    for body in _crafted(good):  # every field dropped or replaced, checksum valid: the decoder alone
        try:
            decode_pointer(_checksummed(body), "ckpt/CURRENT", "fix")
        except CorruptionError as exc:
            assert "CURRENT" in str(exc)
        except Exception as exc:  # noqa: BLE001 - what this test counts
            untyped.append((body, f"{type(exc).__name__}: {exc}"))
    assert not untyped, untyped[:3]
    for i, body in enumerate([{k: v for k, v in good.items() if k != "generation"}, {**good, "writers": {}},
                              {**good, "snapshot": "../../etc/passwd"}]):  # and through open, end to end
        _put_pointer(s3_endpoint, s3_bucket, _checksummed(body))
        with pytest.raises(CorruptionError, match="CURRENT is damaged"):
            cnrstore.open(tmp_path / f"r{i}", readonly=True, remote=url, remote_options=opts)
    _put_pointer(s3_endpoint, s3_bucket, _checksummed({**good, "writer": 7}))
    assert cli(remote, "ls", tmp_path / "fresh") == 2
    assert "CorruptionError" in capsys.readouterr().err
    with cnrstore.open(tmp_path / "a", readonly=True, remote=url, remote_options=opts) as a:  # no request needed
        t.check(a)
    with pytest.raises(CorruptionError, match="repair"):
        cnrstore.open(tmp_path / "a", remote=url, remote_options=opts)


@pytest.mark.parametrize("body", [b"{}", b"[]", b"not json", b'{"url": 1, "store_id": "x"}',
                                  b'{"format": 2, "url": "s3://b/c", "store_id": "' + b"a" * 32 + b'", "role": "boss"}',
                                  b'{"format": 2, "url": "s3://b/c", "store_id": "' + b"a" * 32
                                  + b'", "role": "writer", "writers": [["", 5]]}',
                                  b'{"format": 9, "url": "s3://b/c", "store_id": "' + b"a" * 32 + b'"}'],
                         ids=["empty-object", "list", "not-json", "bad-url", "bad-role", "history-not-from-0",
                              "newer-format"])
def test_a_damaged_remote_file_is_a_typed_error(tmp_path, remote, body, capsys):
    url, opts = remote
    with open_remote(tmp_path / "a", remote) as a:
        Trainer(a).save()
    with open(tmp_path / "a" / filenames.REMOTE, "wb") as f:
        f.write(body)
    for readonly in (True, False):
        with pytest.raises(CorruptionError, match="REMOTE is damaged"):
            cnrstore.open(tmp_path / "a", readonly=readonly, remote=url, remote_options=opts)
    with pytest.raises(CorruptionError):
        cnrstore.open(tmp_path / "a")  # (without remote=: the check that it has one reads it too)
    assert cli(remote, "ls", tmp_path / "a") == 2
    assert "REMOTE is damaged" in capsys.readouterr().err


def test_the_identity_decoder_fails_typed_on_every_field():
    """The REMOTE decoder over each field dropped or replaced (no endpoint needed): a typed error or a value."""
    good = {"format": 2, "url": "s3://b/c", "store_id": "a" * 32, "role": "writer", "writers": [["a" * 32, 0]],
            "claimed_from": {"writer": "b" * 32, "generation": 3}}
    assert decode_identity(json.dumps(good).encode(), "REMOTE").role == WRITER
    untyped = []
    for body in _crafted(good):
        try:
            decode_identity(json.dumps(body).encode(), "REMOTE")
        except CorruptionError:
            pass
        except Exception as exc:  # noqa: BLE001 - what this test counts
            untyped.append((body, f"{type(exc).__name__}: {exc}"))
    assert not untyped, untyped[:3]


# -- 9. timeouts, backoff, options ------------------------------------------------------------------------------

def test_a_hung_endpoint_costs_a_save_at_most_the_request_deadline(tmp_path, remote, proxy):
    """Uploads hang (never answered): the save that meets it makes one request, which ends at its deadline;
    the saves within the backoff make none; the store catches up once the endpoint answers again."""
    url, opts = remote
    store = cnrstore.open(tmp_path / "a", create=True, remote=url, remote_options=opts, remote_timeout_s=2)
    t = Trainer(store)
    t.save()
    proxy.hang("PUT")
    started = time.monotonic()
    t.save()
    first = time.monotonic() - started
    hung = [p for kind, p in proxy.log if kind == "hang"]
    status = store.stats()["remote"]
    assert "no answer within" in status["last_error"] and status["next_retry_s"] > 0, status
    assert len(hung) == 1 and first < 30, (hung, first)  # one request, ended by its deadline (2 s)
    for _ in range(3):
        t.save()  # within the backoff: no request to the endpoint at all
    assert len([p for kind, p in proxy.log if kind == "hang"]) == 1
    proxy.heal()
    store.sync_remote()  # caught up
    store.close()
    t.check_fresh(tmp_path / "r", remote)


def test_bad_remote_options_are_an_invalid_argument_at_open(tmp_path, remote, capsys):
    url, opts = remote
    with pytest.raises(InvalidArgument, match="remote_options"):
        cnrstore.open(tmp_path / "a", create=True, remote=url, remote_options={**opts, "no_such_option": 1})
    with pytest.raises(InvalidArgument, match="remote_options"):
        cnrstore.open(tmp_path / "a", create=True, remote=url,
                      remote_options={**opts, "config_kwargs": {"no_such_setting": 1}})
    with pytest.raises(InvalidArgument, match="remote_timeout_s"):
        cnrstore.open(tmp_path / "a", create=True, remote=url, remote_options=opts, remote_timeout_s=0)
    assert main(["--remote", url, "--remote-options", json.dumps({**opts, "bogus": 1}), "ls", str(tmp_path / "x")]) == 2
    assert "InvalidArgument" in capsys.readouterr().err


# -- pointer format 1 -------------------------------------------------------------------------------------------

def _as_format_1(root, bucket: dict) -> None:
    """Rewrite a one-writer store made by this cnrstore into the layout pointer format 1 wrote: its objects at
    the prefix's root, a format-1 pointer naming its store id, and a format-1 REMOTE file."""
    import xxhash

    ident_ = ident(root)
    writer = ident_["store_id"]
    for key in list(bucket):
        if key.startswith(f"w/{writer}/"):
            bucket[key[len(f"w/{writer}/"):]] = bucket.pop(key)
    body = json.loads(bucket["CURRENT"])["pointer"]
    old = {"format": 1, "generation": body["generation"], "snapshot": body["snapshot"].split("/", 2)[-1],
           "snapshot_bytes": body["snapshot_bytes"], "snapshot_xxh3": body["snapshot_xxh3"], "store_id": writer,
           "versions": body["versions"], "newest_version": body["newest_version"], "written": body["written"]}
    text = json.dumps(old, sort_keys=True)
    bucket["CURRENT"] = json.dumps({"pointer": old, "xxh3": f"{xxhash.xxh3_64_intdigest(text.encode()):016x}"},
                                   sort_keys=True).encode() + b"\n"
    with open(os.path.join(root, filenames.REMOTE), "w") as f:
        json.dump({"url": ident_["url"], "store_id": writer, "after": None}, f)


def test_a_prefix_written_by_pointer_format_1_is_read_recovered_and_written_on(tmp_path):
    from support import crash_states as cs

    bucket = cs.DictObjectStore()
    store = cs.remote_store(str(tmp_path / "a"), bucket, create=True, cache_bytes=0)
    t = Trainer(store)
    t.save()
    t.save()
    store.close()
    _as_format_1(str(tmp_path / "a"), bucket.objects)
    assert not [k for k in bucket.objects if k.startswith("w/")]
    with cs.remote_store(str(tmp_path / "a"), bucket, readonly=True) as old:  # its writer's directory
        t.check(old)
    with cs.remote_store(str(tmp_path / "fresh"), cs.DictObjectStore(bucket.objects), readonly=True) as fresh:
        t.check(fresh)  # recovery from a format-1 prefix
    with cs.remote_store(str(tmp_path / "a"), bucket, cache_bytes=0) as store:  # its writer goes on: format 2
        t.store = store
        t.save()
        store.retain(keep_last=2)
        store.gc()
        t.save()
        t.content = {v.version: t.content[v.version] for v in store.versions()}
        t.check(store)
    assert json.loads(bucket.objects["CURRENT"])["pointer"]["format"] == 2
    assert ident(tmp_path / "a")["format"] == 2
    with cs.remote_store(str(tmp_path / "fresh2"), cs.DictObjectStore(bucket.objects), readonly=True) as fresh:
        t.check(fresh)
        assert fresh.verify().ok


def test_a_maintenance_command_never_takes_the_prefix_over(tmp_path, remote, capsys):
    """`cnrstore --remote URL gc DIR` on a read cache (or an empty directory) would make it the prefix's writer and
    stop the trainer: refused with exit 2, naming the writer's directory as the place to run it."""
    with open_remote(tmp_path / "a", remote) as a:
        t = Trainer(a)
        t.save()
        assert cli(remote, "ls", tmp_path / "cache") == 0
        for command in ("gc", "compact"):
            for where in (tmp_path / "cache", tmp_path / "empty"):
                capsys.readouterr()
                assert cli(remote, command, where) == 2
                assert "would take the prefix over" in capsys.readouterr().err
        t.save()  # the writer was not disturbed
    assert cli(remote, "gc", tmp_path / "a") == 0  # on the writer's own directory it runs
    t.check_fresh(tmp_path / "fresh", remote)


def test_repair_of_a_read_cache_installs_the_newest_copy_point(tmp_path, remote, capsys):
    import shutil

    with open_remote(tmp_path / "a", remote) as a:
        t = Trainer(a)
        t.save()
        assert cli(remote, "ls", tmp_path / "cache") == 0
        t.save()
        shutil.rmtree(tmp_path / "cache" / "index")  # a cache whose index is lost, and behind the bucket
        capsys.readouterr()
        assert cli(remote, "repair", tmp_path / "cache", "--json") == 0
        report = json.loads(capsys.readouterr().out)
        assert report["versions_recovered"] == sorted(t.content) and "read cache" in " ".join(report["notes"])
        url, opts = remote
        with cnrstore.open(tmp_path / "cache", readonly=True, remote=url, remote_options=opts) as cache:
            t.check(cache)


def test_the_command_line_reads_the_remote_from_the_stores_remote_file(tmp_path, remote, capsys):
    """A store with an object-store tier names its remote in REMOTE: commands on it need no --remote (only the
    client's options, --remote-options, where the environment does not give them)."""
    url, opts = remote
    with open_remote(tmp_path / "a", remote, cache_bytes=0) as a:
        t = Trainer(a)
        t.save()
        t.save()
    capsys.readouterr()
    assert main(["--remote-options", json.dumps(opts), "ls", str(tmp_path / "a"), "--json"]) == 0
    assert [r["version"] for r in json.loads(capsys.readouterr().out)] == sorted(t.content)
    assert main(["--remote-options", json.dumps(opts), "verify", str(tmp_path / "a")]) == 0
    assert main(["--remote-options", json.dumps(opts), "ls", str(tmp_path / "nowhere")]) == 2
    assert "needs --remote URL" in capsys.readouterr().err


def test_an_upload_of_a_segments_prefix_never_replaces_a_longer_upload_of_it(tmp_path):
    """A copy point uploads the committed prefix of an active segment while the segment, sealed meanwhile, is
    uploaded whole by the thread that sealed it: uploads of one segment run one at a time, and one no
    longer than what the bucket holds is skipped, so the bucket never ends up holding the shorter one
    while the writer records the longer."""
    from support.crash_states import DictObjectStore

    objects = DictObjectStore()
    store = cnrstore.open(tmp_path / "s", create=True, remote=objects)
    store.create_table("t", 64, 4)
    with store.checkpoint() as ck:
        ck.put_rows("t", np.arange(64), np.ones((64, 4), np.float32))
    store.sync_remote()
    storage = store.engine.storage
    [(seg, length)] = [(s, n) for s, n in storage._remote.items()]
    key = storage._key(seg)
    whole = objects.get(key)
    storage._upload(seg, length // 2)  # (the late, shorter upload)
    assert objects.get(key) == whole and storage._remote[seg] == length
    store.close()


def test_a_deleted_store_pointer_is_damage_and_create_refuses_the_prefix(tmp_path):
    """A single store whose CURRENT is deleted: a fresh reader gets RemoteObjectMissing (not "no store here,
    pass create=True"), create=True refuses the prefix and changes nothing, and with CURRENT back every
    version reads as before. The writer's own directory rewrites the pointer from its index."""
    from support.crash_states import DictObjectStore
    from cnrstore.errors import RemoteObjectMissing

    objects = DictObjectStore()
    store = cnrstore.open(tmp_path / "w", create=True, remote=objects)
    store.create_table("t", 64, 4)
    for v in range(3):
        with store.checkpoint(step=v) as ck:
            ck.put_rows("t", np.arange(64), np.full((64, 4), v, np.float32))
    store.sync_remote()
    store.close()
    current = objects.objects.pop("CURRENT")
    before = dict(objects.objects)
    for readonly, create in ((True, False), (False, False), (False, True)):
        with pytest.raises(RemoteObjectMissing, match="CURRENT is missing.*`create=True` refuses"):
            cnrstore.open(tmp_path / f"fresh-{readonly}-{create}", readonly=readonly, create=create, remote=objects)
    assert objects.objects == before
    objects.objects["CURRENT"] = current
    with cnrstore.open(tmp_path / "fresh", readonly=True, remote=objects) as again:
        assert [v.step for v in again.versions()] == [0, 1, 2]
        assert (again.read_table("t") == 2).all()
    objects.objects.pop("CURRENT")
    with cnrstore.open(tmp_path / "w", remote=objects) as writer:  # the writer's directory: its index
        writer.sync_remote()
    assert "CURRENT" in objects.objects
    with cnrstore.open(tmp_path / "fresh2", readonly=True, remote=objects) as again:
        assert [v.step for v in again.versions()] == [0, 1, 2]


def test_a_reader_that_meets_a_newer_pointer_follows_it_instead_of_calling_the_bucket_damaged(tmp_path):
    """Issue 49 fault 2, by schedule: a reader reads the pointer, then the live writer makes a copy point (a new
    snapshot, the pointer swapped, the old snapshot deleted), then the reader fetches the snapshot the pointer
    it read named: gone. That is no damage: the reader reads the pointer again and fetches the new snapshot
    (it raised RemoteObjectMissing on an intact bucket). A snapshot the current pointer names that is missing
    is still damage."""
    from support.crash_states import DictObjectStore
    from cnrstore.errors import RemoteObjectMissing

    class Racing(DictObjectStore):
        """The writer's copy point lands between the reader's pointer read and its snapshot fetch."""
        race = None

        def get(self, key, start=None, end=None):
            if self.race is not None and "/index/" in key:
                race, self.race = self.race, None
                race()
            return super().get(key, start, end)

    objects = Racing()
    writer = cnrstore.open(tmp_path / "w", create=True, remote=objects)
    writer.create_table("t", 16, 2)

    def commit(step):
        with writer.checkpoint(step=step) as ck:
            ck.put_rows("t", np.arange(16), np.full((16, 2), step, np.float32))
        writer.sync_remote()

    commit(1)
    first = next(k for k in objects.objects if "/index/" in k)
    objects.race = lambda: commit(2)
    with cnrstore.open(tmp_path / "reader", readonly=True, remote=objects) as reader:
        assert first not in objects.objects  # (the copy point deleted the snapshot the reader first read of)
        assert [v.step for v in reader.versions()] == [1, 2] and (reader.read_table("t") == 2).all()
    commit(3)
    for key in [k for k in objects.objects if "/index/" in k]:
        objects.objects.pop(key)  # the current pointer's snapshot gone: damage
    with pytest.raises(RemoteObjectMissing):
        cnrstore.open(tmp_path / "reader2", readonly=True, remote=objects)
    writer.close()


def commit_and_copy(store, step):
    """A version of table t holding ``step`` in every row, then a copy point."""
    with store.checkpoint(step=step) as ck:
        ck.put_rows("t", np.arange(16), np.full((16, 2), step, np.float32))
    store.sync_remote()


def a_writer(tmp_path, objects):
    """Store "a" on ``objects``, its version 1 copied."""
    a = cnrstore.open(tmp_path / "a", create=True, remote=objects)
    a.create_table("t", 16, 2)
    commit_and_copy(a, 1)
    return a


def _racing_pointer_reads():
    from support.crash_states import DictObjectStore

    class Racing(DictObjectStore):
        """Reads of ``CURRENT`` call ``on_pointer_read()`` first (while it is set)."""

        on_pointer_read = None

        def get_tagged(self, key):
            hook = self.on_pointer_read
            if key == "CURRENT" and hook is not None:
                hook()
            return super().get_tagged(key)

    return Racing()


def test_a_takeover_wins_against_the_stale_writers_copy_point_between_its_recovery_and_its_claim(tmp_path):
    """Issue 49 fault 3, by schedule: machine B recovers a prefix from the bucket to take it over, and the
    stale writer A (not quite dead) makes a copy point before B's claim. B used to lose (RemoteTakenOver: "one
    writer per prefix ... stop this writer"), and A kept the prefix. The one started last wins: B's claim
    replaces A's newer pointer, B writes on, and A fails at its next copy point."""
    objects = _racing_pointer_reads()
    a = a_writer(tmp_path, objects)
    reads = []

    def race():
        reads.append(1)
        if len(reads) == 2:  # B's claim is about to read the pointer: A's copy point lands first
            objects.on_pointer_read = None
            commit_and_copy(a, 2)

    objects.on_pointer_read = race
    b = cnrstore.open(tmp_path / "b", remote=objects)  # a writable open of a fresh directory: a takeover
    assert len(reads) >= 2
    assert [v.step for v in b.versions()] == [1]  # what B recovered: A's version 2 is nobody's now
    commit_and_copy(b, 3)
    with pytest.raises(RemoteTakenOver):
        commit_and_copy(a, 4)
    with cnrstore.open(tmp_path / "reader", readonly=True, remote=objects) as reader:
        assert [v.step for v in reader.versions()] == [1, 3] and (reader.read_table("t") == 3).all()
    b.close()
    a.close()


def test_a_takeover_whose_swap_loses_to_the_stale_writer_swaps_again(tmp_path):
    """The same race one step later: the stale writer's copy point lands between the claim's pointer read and
    its compare-and-swap. The claim swaps again, from the newer pointer, and wins."""
    from support.crash_states import DictObjectStore

    class Racing(DictObjectStore):
        before_swap = None

        def put_if(self, key, data, tag):
            hook, self.before_swap = self.before_swap, None
            if key == "CURRENT" and hook is not None:
                hook()
            return super().put_if(key, data, tag)

    objects = Racing()
    a = a_writer(tmp_path, objects)
    objects.before_swap = lambda: commit_and_copy(a, 2)  # (fires on B's claim: the first swap after this line)
    b = cnrstore.open(tmp_path / "b", remote=objects)
    commit_and_copy(b, 3)
    with pytest.raises(RemoteTakenOver):
        commit_and_copy(a, 4)
    with cnrstore.open(tmp_path / "reader", readonly=True, remote=objects) as reader:
        assert [v.step for v in reader.versions()] == [1, 3]
    b.close()
    a.close()


def test_a_takeover_whose_stale_writer_deleted_what_it_recovered_recovers_again_and_wins(tmp_path):
    """The race above, where the stale writer A's copy point (after retention and GC) also deletes the segment
    B's recovery reads: B's claim must not take over a pointer whose snapshot no longer holds what B reads, so
    nothing is claimed; B's open of its fresh directory then recovers again, from A's newest copy point, and
    claims that. B owns the prefix, reads A's newest version bit for bit, and A fails at its next copy point."""
    objects = _racing_pointer_reads()
    a = a_writer(tmp_path, objects)
    first = {k for k in objects.objects if k.endswith(".seg")}
    reads = []

    def race():
        reads.append(1)
        if len(reads) == 2:  # B's claim is about to read the pointer: A's copy point lands first
            objects.on_pointer_read = None
            with a.checkpoint(step=2) as ck:
                ck.put_rows("t", np.arange(16), np.full((16, 2), 2, np.float32))
            a.retain(keep_last=1)
            a.gc()
            a.sync_remote()
            assert not first & set(objects.objects), "the stale copy point deleted what B recovered"

    objects.on_pointer_read = race
    b = cnrstore.open(tmp_path / "b", remote=objects)  # recovered, refused, recovered again, claimed
    assert [v.step for v in b.versions()] == [2] and (b.read_table("t") == 2).all()
    commit_and_copy(b, 3)
    with pytest.raises(RemoteTakenOver):
        commit_and_copy(a, 4)
    with cnrstore.open(tmp_path / "reader", readonly=True, remote=objects) as reader:
        assert [v.step for v in reader.versions()] == [2, 3] and (reader.read_table("t") == 3).all()
    b.close()
    a.close()
