"""Two writers on one prefix, enumerated: a takeover at every point of the old writer's work (tests/support/crash_states.py
section 4's object store, shared by both writers).

Writer A runs a fixed workload (checkpoints whose writes roll over several segments, each sealed one uploaded;
a copy point after each commit; retain, gc, close). For every k, the scenario is run afresh and, just before
A's k-th request to the object store (a pointer read, an upload, the pointer's compare-and-swap, a listing, a
delete), machine B recovers the prefix from the bucket into an empty directory, takes it over and commits a
version of its own (its copy point completes); A then goes on, learns at its next commit that it lost the
prefix (RemoteTakenOver), and stops. Checked:

- **every bucket state** of the scenario (after each put and delete, of either writer): recovery from the bucket
  alone lists exactly the versions of the last pointer put, each reading bit for bit as its writer committed it;
- **each local directory** at the end: A's lists what A committed (the stale version too) and reads it as A
  committed it, and refuses to write; B's reads B's; a read cache made before the takeover, opened again,
  follows the bucket to B's versions.

The count of scenarios and distinct bucket states checked is printed (``-s``) and recorded in docs/DESIGN.md.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import uuid

import numpy as np
import pytest

from cnrstore import knobs
from cnrstore.engine import filenames
from cnrstore.engine import remote as remote_tier
from cnrstore.errors import RemoteTakenOver, StoreNotFound

from support import crash_states as cs

ROWS, DIM, BLOCK = 512, 4, 64

pytestmark = pytest.mark.usefixtures("single_threaded_torch")


@pytest.fixture(autouse=True)
def small_segments(monkeypatch):
    """2 KiB segments: a full write of the table rolls over several (each sealed one is uploaded at once)."""
    monkeypatch.setattr(knobs, "SEGMENT_BYTES", 2 << 10)


class Bucket(cs.DictObjectStore):
    """The one bucket of a scenario. Every put and delete is logged with what a recovery from the bucket must
    then find: after a pointer put, the versions its writer listed and whose content they hold."""

    def __init__(self, objects: dict):
        super().__init__(objects)
        self.log: list[tuple[str, bytes | None, object]] = []
        self.expect = None  # (frozenset of versions, content dict) as of the last pointer put
        self.listed = None  # () -> (versions, content) of the writer now putting

    def put(self, key, data) -> None:
        with self._lock:
            super().put(key, data)
            if key == filenames.REMOTE_POINTER and self.listed is not None:
                self.expect = self.listed()
            self.log.append((key, bytes(data), self.expect))

    def delete(self, key) -> None:
        with self._lock:
            super().delete(key)
            self.log.append((key, None, self.expect))


class Client(cs.DictObjectStore):
    """One writer's view of the bucket; runs ``hook`` once, just before its ``trigger``-th request."""

    def __init__(self, bucket: Bucket, writer, trigger: int | None = None, hook=None):
        super().__init__()
        self.bucket, self.writer, self.trigger, self.hook, self.count = bucket, writer, trigger, hook, 0
        self.objects, self._lock = bucket.objects, bucket._lock

    def _request(self) -> None:
        n, self.count = self.count, self.count + 1
        if n == self.trigger and self.hook is not None:
            hook, self.hook = self.hook, None
            hook()

    def put(self, key, data):
        self._request()
        self.bucket.listed = self.writer.listed
        self.bucket.put(key, data)

    def put_if(self, key, data, tag):
        self._request()  # (one request: the endpoint compares and replaces atomically, nothing in between)
        with self.bucket._lock:
            self.bucket.listed = self.writer.listed
            cs.DictObjectStore.put_if(self.bucket, key, data, tag)

    def delete(self, key):
        self._request()
        self.bucket.delete(key)

    def get(self, key, start=None, end=None):
        self._request()
        return super().get(key, start, end)

    def get_tagged(self, key):
        self._request()
        return super().get_tagged(key)

    def list(self, folder):
        self._request()
        return super().list(folder)

    def size(self, key):
        return super().size(key)  # (no hook: not a point where a takeover changes anything)


class Writer:
    """A store on the bucket and what each of its versions reads."""

    def __init__(self, root: str, bucket: Bucket, seed: int, *, create=False, trigger=None, hook=None):
        self.client = Client(bucket, self, trigger, hook)
        self.store = None
        self.recovered = bucket.expect  # (what a takeover claims: the pointer it recovered from, as its writer listed)
        self.store = cs.remote_store(root, self.client, create=create, cache_bytes=0)
        self.rng = np.random.default_rng(seed)
        self.content: dict[int, np.ndarray] = {}
        self.pending: dict[int, np.ndarray] = {}
        versions = [v.version for v in self.store.versions()]
        self.model = self.store.read_table("t", version=max(versions)) if versions else np.zeros((ROWS, DIM), np.float32)
        self.content = {v: self.store.read_table("t", version=v) for v in versions}

    def listed(self):
        if self.store is None:  # the claim made while opening: the snapshot it recovered
            return self.recovered
        versions = frozenset(v.version for v in self.store.versions())
        return versions, {**self.content, **{v: m for v, m in self.pending.items() if v in versions}}

    def save(self, rows: int) -> int:
        picked = np.sort(self.rng.choice(ROWS, rows, replace=False))
        self.model[picked] = self.rng.standard_normal((rows, DIM)).astype(np.float32)
        w = self.store.checkpoint()
        w.put_rows("t", picked, self.model[picked])
        self.pending = {w.version: self.model.copy()}  # (its copy point runs inside the commit)
        try:
            w.commit()
        finally:
            if w.committed:
                self.content[w.version] = self.model.copy()
        return w.version


def check_bucket(objects: dict, expect, workdir: str) -> None:
    """Recovery from the bucket alone: exactly the last pointer's versions, as its writer committed them."""
    root = os.path.join(workdir, "fresh")
    shutil.rmtree(root, ignore_errors=True)
    try:
        store = cs.remote_store(root, cs.DictObjectStore(objects), readonly=True)
    except StoreNotFound:
        assert expect is None, f"no store recovered; the last pointer put listed {sorted(expect[0])}"
        return
    with store:
        listed = frozenset(v.version for v in store.versions())
        assert expect is not None and listed == expect[0], (sorted(listed), None if expect is None else sorted(expect[0]))
        for v in sorted(listed):
            np.testing.assert_array_equal(store.read_table("t", version=v), expect[1][v], err_msg=f"version {v}")
    shutil.rmtree(root, ignore_errors=True)


def base(path: str) -> dict:
    """A's store with version 1 (every row) and its copy point: the bucket's objects."""
    bucket = Bucket({})
    store = cs.remote_store(path, bucket, create=True, cache_bytes=0)
    with store:
        store.create_table("t", ROWS, DIM, codec="fp32", block_rows=BLOCK)
        with store.checkpoint() as ck:
            ck.put_rows("t", np.arange(ROWS), np.full((ROWS, DIM), 0.5, np.float32))
    return dict(bucket.objects)


def run_a(a: Writer) -> list[str]:
    """A's workload; stops at the RemoteTakenOver that tells it another machine took the prefix over."""
    done = []
    try:
        a.save(ROWS)  # rolls over several segments
        done.append("save")
        a.save(40)
        done.append("save")
        a.store.retain(keep_last=2)
        a.content = {v.version: a.content[v.version] for v in a.store.versions()}
        a.store.gc()
        done.append("retain+gc")
        a.save(ROWS // 2)
        done.append("save")
        a.store.close()  # (its last copy point)
        done.append("close")
    except RemoteTakenOver:
        done.append("taken over")
        a.store.close()
    return done


def test_a_takeover_at_every_request_of_the_old_writer(ram_tmp_path):
    objects0 = base(str(ram_tmp_path / "base"))
    # a dry run: how many requests A's workload makes
    shutil.copytree(ram_tmp_path / "base", ram_tmp_path / "dry")
    dry = Writer(str(ram_tmp_path / "dry"), Bucket(objects0), seed=1)
    run_a(dry)
    requests = dry.client.count
    seen, states, scenarios, takeovers_seen = set(), 0, 0, set()
    for k in range(requests + 1):
        work = ram_tmp_path / f"k{k}"
        shutil.copytree(ram_tmp_path / "base", work / "a")
        bucket = Bucket(objects0)
        bucket.expect = (frozenset({1}), {1: np.full((ROWS, DIM), 0.5, np.float32)})
        cache = cs.remote_store(str(work / "cache"), cs.DictObjectStore(bucket.objects), readonly=True)
        cache.close()  # a read cache made before the takeover
        b_box = {}

        def takeover(work=work, bucket=bucket, b_box=b_box):
            b = Writer(str(work / "b"), bucket, seed=2)  # recovers the bucket's last copy point, claims it
            b.save(30)
            b.store.close()
            b_box["b"] = b

        try:
            a = Writer(str(work / "a"), bucket, seed=1, trigger=k, hook=takeover)
            done = run_a(a)
        except RemoteTakenOver:  # (k == 0: the takeover before A's open read the pointer)
            a, done = None, ("refused at open",)
            a_content = {1: np.full((ROWS, DIM), 0.5, np.float32)}
        else:
            a_content = a.content
        b = b_box.get("b")
        if b is None:  # (k == requests: after A's last request) the takeover now
            takeover()
            b = b_box["b"]
        takeovers_seen.add(tuple(done))
        # every bucket state of the scenario
        replay = dict(objects0)
        for key, data, expect in bucket.log:
            if data is None:
                replay.pop(key, None)
            else:
                replay[key] = data
            h = hashlib.blake2b(digest_size=16)
            for name in sorted(replay):
                h.update(name.encode() + b"\0" + hashlib.blake2b(replay[name], digest_size=16).digest())
            state = (h.digest(), None if expect is None else tuple(sorted(expect[0])))
            if state in seen:
                continue
            seen.add(state)
            try:
                check_bucket(replay, expect, str(work))
            except Exception as exc:  # noqa: BLE001 - reported with the state's place
                raise AssertionError(f"takeover before A's request {k} (A did {done}); bucket after putting or "
                                     f"deleting {key}: {type(exc).__name__}: {exc}; the bucket's writes: "
                                     f"{[(kk, d is not None) for kk, d, _e in bucket.log]}") from exc
            states += 1
        # each local directory
        with cs.remote_store(str(work / "a"), cs.DictObjectStore(bucket.objects), readonly=True) as old:
            assert [v.version for v in old.versions()] == sorted(a_content)
            for v, values in a_content.items():
                np.testing.assert_array_equal(old.read_table("t", version=v), values, err_msg=f"A's version {v}")
        with pytest.raises(RemoteTakenOver):
            cs.remote_store(str(work / "a"), cs.DictObjectStore(bucket.objects))
        with cs.remote_store(str(work / "b"), cs.DictObjectStore(bucket.objects), readonly=True) as new:
            assert [v.version for v in new.versions()] == sorted(b.content)
            for v, values in b.content.items():
                np.testing.assert_array_equal(new.read_table("t", version=v), values, err_msg=f"B's version {v}")
        with cs.remote_store(str(work / "cache"), cs.DictObjectStore(bucket.objects), readonly=True) as cache:
            assert [v.version for v in cache.versions()] == sorted(b.content)
            for v, values in b.content.items():
                np.testing.assert_array_equal(cache.read_table("t", version=v), values, err_msg=f"cache's version {v}")
        scenarios += 1
        shutil.rmtree(work)
    print(f"\ntakeover sweep: {scenarios} takeover points (A's {requests} requests), {states} distinct bucket "
          f"states checked; A's workload ended as {sorted(takeovers_seen)}")
    assert scenarios == requests + 1 and states > requests
    assert {d[-1] for d in takeovers_seen} >= {"refused at open", "taken over", "close"}
