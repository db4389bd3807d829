"""Planned reads from the bucket (docs/DESIGN.md "The remote tier", "Planned reads"): a whole-version read on a fresh
machine (an empty directory: a read cache) fetches the records it needs, planned from the index, coalesced into
fewer requests and fetched concurrently; every byte is still checked by its record's checksum, and a fault of the
endpoint during the fetch is a typed error that leaves nothing behind. Against moto through the fault proxy
(tests/support/s3_proxy.py), and against an in-memory object store that counts the requests in flight."""

from __future__ import annotations

import os
import threading
import time

import boto3
import numpy as np
import pytest

import cnrstore
from cnrstore.engine import filenames, fs, reader
from cnrstore.engine import remote as remote_tier
from cnrstore.errors import CorruptionError, RemoteObjectMissing, RemoteStorageError
from cnrstore.store import Store

from support import crash_states as cs
from support.s3_remote import DIM, ROWS, proxy, s3_options  # noqa: F401 (proxy: a fixture)

TABLES = ("t", "u")
BLOCK = 256


def _saves(store, saves=4, seed=0) -> dict[int, dict[str, np.ndarray]]:
    """``saves`` checkpoints of two tables of 8 blocks (every row, then a tenth touched), written block by block,
    the tables' records alternating (segments of 256 KiB hold a save's every record: a segment's records of one
    table lie between the other's), and a dense array: the content of each version."""
    rng = np.random.default_rng(seed)
    model = {n: rng.standard_normal((ROWS, DIM), dtype=np.float32) for n in TABLES}
    for n in TABLES:
        store.create_table(n, ROWS, DIM, codec="fp32", block_rows=BLOCK)
    content = {}
    for i in range(saves):
        with store.checkpoint(step=i) as ck:
            changed = {}
            for n in TABLES:
                changed[n] = np.ones(ROWS, bool) if i == 0 else rng.random(ROWS) < 0.1
                model[n][changed[n]] = rng.standard_normal((int(changed[n].sum()), DIM), dtype=np.float32)
            for block in range(ROWS // BLOCK):
                for n in TABLES:
                    rows = np.flatnonzero(changed[n][block * BLOCK:(block + 1) * BLOCK]) + block * BLOCK
                    ck.put_rows(n, rows, model[n][rows])
            ck.put_dense("mlp", np.full((64, 8), i, np.float32))
        content[ck.version] = {n: a.copy() for n, a in model.items()} | {"mlp": np.full((64, 8), i, np.float32)}
    return content


@pytest.fixture(scope="module")
def written_bucket(s3_endpoint, tmp_path_factory):
    """A bucket of this module's own holding a writer's store (written once, straight to the endpoint, every
    sealed segment evicted, closed): (bucket, the versions' content). Tests only read it, but the one that
    damages an object, which puts it back."""
    import uuid

    bucket = f"remote-reads-{uuid.uuid4().hex[:12]}"
    opts = s3_options(s3_endpoint)
    boto3.client("s3", endpoint_url=s3_endpoint, aws_access_key_id=opts["key"], aws_secret_access_key=opts["secret"],
                 region_name="us-east-1").create_bucket(Bucket=bucket)
    with cnrstore.open(tmp_path_factory.mktemp("writer") / "w", create=True, remote=f"s3://{bucket}/ckpt",
                       remote_options=opts, cache_bytes=0,
                       options=cnrstore.Options(segment_bytes=256 << 10)) as store:
        content = _saves(store)
    return bucket, content


@pytest.fixture
def written(written_bucket, proxy):
    """(remote: the module's store reached through this test's fault proxy, the versions' content)."""
    bucket, content = written_bucket
    return (f"s3://{bucket}/ckpt", s3_options(proxy.url)), content


def _fresh(path, remote, **options):
    url, opts = remote
    return cnrstore.open(path, readonly=True, remote=url, remote_options=opts,
                         options=cnrstore.Options(**options) if options else None)


@pytest.fixture
def records_read(monkeypatch):
    """The index locations of the records the reads fetch (every checked read of a table's record)."""
    seen = []
    real = reader.fetch

    def recording(storage, loc, expect=None):
        seen.append(loc)
        return real(storage, loc, expect)

    monkeypatch.setattr(reader, "fetch", recording)
    return seen


def test_a_fresh_machine_restore_is_bit_exact_and_fetches_only_the_records_it_needs(tmp_path, written, records_read):
    remote, content = written
    newest = max(content)
    # the whole version (tables and dense array): the segments' other bytes (headers, commit records) are few
    with _fresh(tmp_path / "fresh", remote) as fresh:
        snap = fresh.restore()
        status = fresh.stats()["remote"]
    for name in TABLES:
        np.testing.assert_array_equal(snap.tables[name], content[newest][name])
    np.testing.assert_array_equal(snap.dense["mlp"], content[newest]["mlp"])
    needed = sum(loc.length for loc in records_read) + 64 * 8 * 4 + 100  # (+ the dense record, read by restore)
    assert len(records_read) > 2 * len(TABLES) * ROWS // BLOCK, len(records_read)  # several records per block
    assert status["planned_read_bytes"] <= needed
    assert status["remote_read_bytes"] <= 1.1 * needed, (status, needed)
    assert status["remote_reads"] < len(records_read) / 4, status  # records of a segment come in few requests
    assert not os.listdir(filenames.segments_dir(str(tmp_path / "fresh"))), "nothing written into the cache"

    # one of the two tables, whose records lie between the other's: with no gap bridged, exactly its records;
    # with the default gap, at most the span of its records in each segment
    for gap in (0, None):
        records_read.clear()
        options = {} if gap is None else {"remote_read_gap_bytes": gap}
        with _fresh(tmp_path / f"fresh-{gap}", remote, **options) as fresh:
            got = fresh.read_tables({"t": None})
            status = fresh.stats()["remote"]
        np.testing.assert_array_equal(got["t"], content[newest]["t"])
        needed = sum(loc.length for loc in records_read)
        spans = {}
        for loc in records_read:
            lo, hi = spans.get(loc.segment, (loc.offset, loc.offset + loc.length))
            spans[loc.segment] = (min(lo, loc.offset), max(hi, loc.offset + loc.length))
        if gap == 0:
            assert status["remote_read_bytes"] == needed, (status, needed)
            assert status["remote_reads"] == len(records_read), "no two of its records are adjacent"
        else:
            assert needed < status["remote_read_bytes"] <= sum(hi - lo for lo, hi in spans.values()), status
            assert status["remote_reads"] == len(spans), "one request per segment"


def test_a_corrupted_byte_in_a_fetched_range_is_a_corruption_error(tmp_path, written, written_bucket, s3_endpoint):
    remote, content = written
    bucket = written_bucket[0]
    opts = s3_options(s3_endpoint)
    client = boto3.client("s3", endpoint_url=s3_endpoint, aws_access_key_id=opts["key"],
                          aws_secret_access_key=opts["secret"], region_name="us-east-1")
    listing = client.list_objects_v2(Bucket=bucket, Prefix="ckpt/")["Contents"]
    biggest = max((o for o in listing if "/segments/" in o["Key"]), key=lambda o: o["Size"])
    original = client.get_object(Bucket=bucket, Key=biggest["Key"])["Body"].read()
    body = bytearray(original)
    body[len(body) // 2] ^= 0x40  # a bit of some record's rows
    client.put_object(Bucket=bucket, Key=biggest["Key"], Body=bytes(body))
    try:
        with _fresh(tmp_path / "fresh", remote) as fresh:
            with pytest.raises(CorruptionError, match="checksum mismatch") as raised:
                fresh.read_tables({n: None for n in TABLES})
            assert raised.value.path.startswith(remote[0]), raised.value.path
            outs = {n: np.full((ROWS, DIM), 7.0, np.float32) for n in TABLES}
            with pytest.raises(CorruptionError):
                fresh.read_tables(outs)  # into the caller's arrays: every record checked before any is written
            assert all((a == 7.0).all() for a in outs.values()), "the caller's arrays were written"
    finally:
        client.put_object(Bucket=bucket, Key=biggest["Key"], Body=original)  # (the module's other tests read it)


@pytest.mark.parametrize("fault", ["503", "cut", "404"])
def test_a_fault_during_the_concurrent_fetch_is_typed_and_leaves_nothing_behind(tmp_path, written, proxy, fault):
    remote, content = written
    path = tmp_path / "fresh"
    with _fresh(path, remote) as fresh:  # (the index is installed before the fault)
        if fault == "503":
            proxy.slow_down(1000, "/segments/")
            expected = RemoteStorageError
        elif fault == "cut":
            proxy.cut_gets("/segments/", 1000)
            expected = RemoteStorageError
        else:
            proxy.hide("/segments/")
            expected = RemoteObjectMissing
        with pytest.raises(expected) as raised:
            fresh.read_tables({n: None for n in TABLES})
        assert not isinstance(raised.value, CorruptionError) or fault == "404"
        if fault == "503":
            assert "throttling" in str(raised.value)
        hits = [p for kind, p in proxy.log if kind == fault]
        assert hits and all("/segments/" in p for p in hits), proxy.log[-5:]  # the fetch's GETs met the fault
        proxy.heal()
        assert os.listdir(filenames.segments_dir(str(path))) == [], "nothing half-written into the cache"
        got = fresh.read_tables({n: None for n in TABLES})  # the same open store reads once the endpoint is back
    for n in TABLES:
        np.testing.assert_array_equal(got[n], content[max(content)][n])
    with _fresh(path, remote) as again:  # and the directory opens again, as it was
        np.testing.assert_array_equal(again.read_table("u"), content[max(content)]["u"])


def test_a_get_cut_mid_body_is_resumed_from_its_first_missing_byte(tmp_path, written, proxy, monkeypatch):
    """With a retry left, a ranged GET cut off mid-body goes on from the bytes that landed (a new GET of the rest
    of its range): the read succeeds, bit for bit."""
    import s3fs

    remote, content = written
    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 2)
    with _fresh(tmp_path / "fresh", remote) as fresh:
        proxy.cut_gets("/segments/", 1)
        got = fresh.read_tables({n: None for n in TABLES})
    assert [kind for kind, _p in proxy.log].count("cut") == 1
    for n in TABLES:
        np.testing.assert_array_equal(got[n], content[max(content)][n])


class CountingObjectStore(cs.DictObjectStore):
    """An in-memory object store whose ranged gets take a while and count how many run at once."""

    def __init__(self, objects=None, delay=0.02):
        super().__init__(objects)
        self.delay = delay
        self.count_lock = threading.Lock()
        self.running = self.peak = self.gets = 0

    def get(self, key, start=None, end=None):
        if "/segments/" not in key:
            return super().get(key, start, end)
        with self.count_lock:
            self.running += 1
            self.gets += 1
            self.peak = max(self.peak, self.running)
        try:
            time.sleep(self.delay)
            return super().get(key, start, end)
        finally:
            with self.count_lock:
                self.running -= 1


def test_the_requests_in_flight_are_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr(cnrstore.knobs, "SEGMENT_BYTES", 256 << 10)
    objects = CountingObjectStore()
    store = cs.remote_store(str(tmp_path / "w"), objects, create=True)
    with store:
        content = _saves(store, saves=6)
    newest = max(content)
    fresh = str(tmp_path / "fresh")  # recovered from the object store alone: 3 requests at once, of a record or two
    store = Store(fresh, create=False, readonly=True, filesystem=fs.DEFAULT,
                  storage=remote_tier.storage_for(fresh, objects, fs.DEFAULT, readonly=True, create=False),
                  options=cnrstore.Options(remote_read_requests=3, remote_read_request_bytes=8 << 10))
    objects.peak = objects.gets = 0
    with store:
        got = store.read_tables({n: None for n in TABLES})
        status = store.stats()["remote"]
    for n in TABLES:
        np.testing.assert_array_equal(got[n], content[newest][n])
    assert objects.peak == 3, (objects.peak, objects.gets)
    assert status["remote_reads"] == objects.gets > 10


def test_a_sub_store_streams_through_its_parent():
    """A rank store's object store (``ObjectStore.sub``) streams its planned reads through the parent's
    ``read_into`` (on S3: the body read into the buffer as it arrives), not through one whole ``get``."""
    class Streaming(cs.DictObjectStore):
        def read_into(self, key, start, buffer, arrived):
            self.streamed = key
            return super().read_into(key, start, buffer, arrived)

    parent = Streaming({"gen-1/rank-0/segments/a.seg": bytes(range(100))})
    buffer = memoryview(bytearray(10))
    landed = []
    assert parent.sub("gen-1/rank-0").read_into("segments/a.seg", 20, buffer, landed.append) == 10
    assert parent.streamed == "gen-1/rank-0/segments/a.seg" and bytes(buffer) == bytes(range(20, 30))
    assert landed == [10]
