"""Issue 49, faults 4-6: a save never waits for the bucket. A ``Checkpointer`` on a store with a remote tier makes
the store's copy points run behind its commits (engine/uploads.py): a commit marks one due, one thread makes
them, and they coalesce. The bucket's lag is a metric (``stats()["remote"]``, ``SaveReport``) with a bound in
seconds (``remote_lag_s``): past it a save waits (the default) or raises ``RemoteLagging``.

The bucket is a dict whose uploads can be held (``GatedBucket``): a slow endpoint, on demand. Races by schedule
(tests/support/schedule.py): a copy point held at each of its pause points while the next saves commit and
retention collects, then let go; the bucket is then read from alone, bit for bit.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from torch import nn

import cnrstore
from cnrstore.engine.uploads import BucketLag
from cnrstore.errors import InvalidArgument, RemoteLagging
from cnrstore.torch import Checkpointer

from support.crash_states import DictObjectStore
from support.schedule import Pause, run_in_thread

ROWS, DIM = 512, 8

pytestmark = pytest.mark.usefixtures("single_threaded_torch")


class GatedBucket(DictObjectStore):
    """A bucket whose puts wait while ``hold()`` is in force (``let_go()`` ends it); ``puts`` counts them."""

    def __init__(self):
        super().__init__()
        self._open = threading.Event()
        self._open.set()
        self.puts = 0

    def hold(self) -> None:
        self._open.clear()

    def let_go(self) -> None:
        self._open.set()

    def put(self, key, data) -> None:
        assert self._open.wait(30), "the bucket was held for good"
        self.puts += 1
        super().put(key, data)

    def put_if(self, key, data, tag) -> None:
        assert self._open.wait(30), "the bucket was held for good"
        super().put_if(key, data, tag)


def _trainer(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.ModuleDict({"emb": nn.EmbeddingBag(ROWS, DIM, mode="sum", sparse=True)})
    return model, torch.optim.Adagrad(model.parameters(), lr=0.1)


def _step(model, opt, rng) -> None:
    ids = torch.from_numpy(rng.integers(0, ROWS, 64)).view(16, 4)
    opt.zero_grad()
    model["emb"](ids).sum().backward()
    opt.step()


def _numbers(store) -> list[int]:
    return [v.version for v in store.versions()]


def _remote(store) -> dict:
    return store.engine.replication_status()


def _until(predicate, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def _rows_of(store, version) -> dict:
    return {t: store.read_table(t, version=version) for t in store.tables()}


def _read_back(tmp_path, bucket, name: str) -> tuple[list[int], dict]:
    """The versions a fresh machine recovers from the bucket alone, and the newest one's tables."""
    with cnrstore.open(tmp_path / name, readonly=True, remote=DictObjectStore(bucket.objects)) as fresh:
        versions = _numbers(fresh)
        return versions, _rows_of(fresh, versions[-1]) if versions else {}


def _assert_bucket_holds(tmp_path, bucket, newest: int, want: dict, name: str = "fresh") -> list[int]:
    """A fresh machine's recovery from ``bucket`` lists ``newest`` last and reads it as ``want``, bit for bit;
    returns the versions it lists."""
    versions, rows = _read_back(tmp_path, bucket, name)
    assert versions[-1] == newest
    assert rows.keys() == want.keys()
    for t in want:
        np.testing.assert_array_equal(rows[t], want[t], err_msg=f"{name}: {t}")
    return versions


def test_saves_go_on_while_the_bucket_is_held_and_the_copy_points_coalesce(tmp_path):
    bucket = GatedBucket()
    store = cnrstore.open(tmp_path / "node", create=True, remote=bucket)
    model, opt = _trainer()
    reports = []
    ck = Checkpointer(store, model, opt, on_report=reports.append)
    rng = np.random.default_rng(0)
    _step(model, opt, rng)
    ck.save(1).wait()
    _until(lambda: _remote(store)["lag_versions"] == 0, "the first save reached the bucket")
    bucket.hold()
    for step in range(2, 7):  # five saves, each committed locally while the bucket takes nothing
        _step(model, opt, rng)
        ck.save(step).wait()
    status = _remote(store)
    assert status["copy_points_behind"] and status["lag_versions"] == 5 and status["lag_s"] > 0
    assert [r.bucket_lag_versions for r in reports[2:]] == [1, 2, 3, 4]
    assert reports[-1].bucket_lag_versions == 4 and reports[-1].bucket_wait_s == 0.0
    copy_points = status["copy_points"]
    bucket.let_go()
    _until(lambda: _remote(store)["lag_versions"] == 0, "the bucket caught up")
    assert _remote(store)["copy_points"] - copy_points <= 2  # (the one held, then one for all the rest)
    newest = _numbers(store)[-1]
    _assert_bucket_holds(tmp_path, bucket, newest, _rows_of(store, newest))
    ck.close()
    store.close()


def test_close_makes_the_bucket_current(tmp_path):
    bucket = GatedBucket()
    store = cnrstore.open(tmp_path / "node", create=True, remote=bucket)
    model, opt = _trainer()
    ck = Checkpointer(store, model, opt)
    rng = np.random.default_rng(1)
    for step in range(1, 4):
        _step(model, opt, rng)
        ck.save(step)
    ck.close()
    newest = _numbers(store)[-1]
    want = _rows_of(store, newest)
    store.close()
    _assert_bucket_holds(tmp_path, bucket, newest, want)


def _lagging(tmp_path, seed: int, **kwargs):
    """A Checkpointer (``remote_lag_s=0.2``, ``kwargs``) whose first save committed while the bucket is held,
    0.3 s ago: (bucket, store, model, optimizer, checkpointer, rng, reports)."""
    bucket = GatedBucket()
    store = cnrstore.open(tmp_path / "node", create=True, remote=bucket)
    model, opt = _trainer()
    reports: list = []
    ck = Checkpointer(store, model, opt, remote_lag_s=0.2, on_report=reports.append, **kwargs)
    rng = np.random.default_rng(seed)
    bucket.hold()
    _step(model, opt, rng)
    ck.save(1).wait()
    time.sleep(0.3)
    return bucket, store, model, opt, ck, rng, reports


def test_past_remote_lag_s_a_save_raises_remote_lagging_and_takes_nothing(tmp_path):
    bucket, store, model, opt, ck, rng, _reports = _lagging(tmp_path, 2, on_remote_lag="raise")
    before = _numbers(store)
    with pytest.raises(RemoteLagging) as caught:
        ck.save(2)
    assert caught.value.lag_versions == 1 and caught.value.lag_s > 0.2
    assert "remote_lag_s=0.2" in str(caught.value)
    assert _numbers(store) == before  # nothing of it was taken
    bucket.let_go()
    _until(lambda: _remote(store)["lag_versions"] == 0, "the bucket caught up")
    _step(model, opt, rng)
    assert ck.save(3).wait() == before[-1] + 1
    ck.close()
    store.close()


def test_past_remote_lag_s_a_save_waits_for_the_bucket(tmp_path):
    bucket, store, model, opt, ck, rng, reports = _lagging(tmp_path, 3)
    timer = threading.Timer(0.5, bucket.let_go)
    timer.start()
    _step(model, opt, rng)
    started = time.monotonic()
    ck.save(2).wait()
    assert time.monotonic() - started >= 0.4
    assert reports[-1].bucket_wait_s >= 0.4 and reports[-1].stall_s >= reports[-1].bucket_wait_s
    assert reports[-1].bucket_lag_versions == 1
    timer.join()
    ck.close()
    store.close()


@pytest.mark.parametrize("bad", [0, -1.0, True, "10", None, float("nan")])
def test_remote_lag_s_is_checked(tmp_path, bad):
    model, opt = _trainer()
    with pytest.raises(InvalidArgument, match="remote_lag_s"):
        Checkpointer(str(tmp_path / "s"), model, opt, remote_lag_s=bad)
    with pytest.raises(InvalidArgument, match="on_remote_lag"):
        Checkpointer(str(tmp_path / "s"), model, opt, on_remote_lag="later")
    assert not (tmp_path / "s").exists()


def test_a_local_store_has_no_bucket_lag(tmp_path):
    model, opt = _trainer()
    reports = []
    with Checkpointer(str(tmp_path / "s"), model, opt, on_report=reports.append) as ck:
        ck.save(1).wait()
    assert reports[0].bucket_lag_s is None and reports[0].bucket_lag_versions is None


def test_bucket_lag_counts_what_no_copy_point_covered():
    lag = BucketLag()
    assert lag.versions() == 0 and lag.seconds() == 0.0
    lag.committed(5)
    lag.committed(7)
    lag.copied(6)
    assert lag.versions() == 1
    lag.copied(7)
    assert lag.versions() == 0 and lag.seconds() == 0.0
    lag.committed(7)  # (a commit a copy point covered already: not lagging)
    assert lag.versions() == 0


@pytest.mark.parametrize("point", ["remote_upload", "remote_snapshot_uploaded", "remote_pointer_replaced"])
def test_a_copy_point_held_while_saves_commit_and_retention_collects(tmp_path, point):
    """The copy point behind the commits held at ``point`` while three more saves commit and retention
    (keep_last=2) drops and collects the older versions; every state of the bucket meanwhile reads back
    exactly a version the store committed, and once let go the bucket lists the newest version."""
    bucket = DictObjectStore()
    store = cnrstore.open(tmp_path / "node", create=True, remote=bucket)
    model, opt = _trainer()
    ck = Checkpointer(store, model, opt, keep_last=2)
    rng = np.random.default_rng(4)
    committed = {}
    _step(model, opt, rng)
    v = ck.save(1).wait()
    committed[v] = _rows_of(store, v)
    _until(lambda: _remote(store)["lag_versions"] == 0, "the first save reached the bucket")
    with Pause(point) as held:
        _step(model, opt, rng)
        v = ck.save(2).wait()  # (its commit marks a copy point due: held at `point`)
        committed[v] = _rows_of(store, v)
        held.wait_reached()
        for step in (3, 4, 5):
            _step(model, opt, rng)
            v = ck.save(step).wait()
            committed[v] = _rows_of(store, v)
        versions, rows = _read_back(tmp_path, bucket, "while-held")
        for t, want in committed[versions[-1]].items():
            np.testing.assert_array_equal(rows[t], want, err_msg=f"{point}: {t}")
        held.release()
        _until(lambda: _remote(store)["lag_versions"] == 0, "the bucket caught up")
    newest = _numbers(store)[-1]
    assert len(_assert_bucket_holds(tmp_path, bucket, newest, committed[newest], "after")) <= 3
    ck.close()
    store.close()


def test_a_store_opened_by_the_key_value_api_still_copies_at_each_commit(tmp_path):
    """Without a Checkpointer the copy point after a commit is the commit's (docs/API.md, The remote tier)."""
    bucket = DictObjectStore()
    with cnrstore.open(tmp_path / "s", create=True, remote=bucket) as store:
        store.create_table("t", 64, 4)
        with store.checkpoint() as ck:
            ck.put_rows("t", np.arange(64), np.ones((64, 4), np.float32))
        status = _remote(store)
        assert not status["copy_points_behind"] and status["lag_versions"] == 0
        assert _read_back(tmp_path, bucket, "fresh")[0] == _numbers(store)


def test_a_waiting_save_learns_of_a_takeover(tmp_path):
    """A save waiting for a bucket another machine took over raises RemoteTakenOver, not a wait for good."""
    from cnrstore.errors import RemoteTakenOver

    bucket = GatedBucket()
    store = cnrstore.open(tmp_path / "a", create=True, remote=bucket)
    model, opt = _trainer()
    ck = Checkpointer(store, model, opt, remote_lag_s=0.2)
    rng = np.random.default_rng(5)
    _step(model, opt, rng)
    ck.save(1).wait()
    _until(lambda: _remote(store)["lag_versions"] == 0, "the first save reached the bucket")
    with cnrstore.open(tmp_path / "b", remote=bucket) as b:  # (machine B takes the prefix over, and commits)
        b.create_table("x", 8, 2)
        with b.checkpoint() as w:
            w.put_rows("x", np.arange(8), np.ones((8, 2), np.float32))
    _step(model, opt, rng)

    def saves():
        ck.save(2).wait()
        time.sleep(0.3)
        ck.save(3).wait()

    with pytest.raises(RemoteTakenOver):
        run_in_thread(saves).result(timeout=30)
    store.close()


def test_close_beside_a_copy_point_in_flight_waits_for_it_then_makes_the_last(tmp_path):
    """close() while the copy point behind the commits is held mid-way (its snapshot uploaded, the pointer not
    yet replaced): close waits for it, then makes the last copy point itself; the bucket then holds the newest
    version, and the thread is gone."""
    bucket = DictObjectStore()
    store = cnrstore.open(tmp_path / "node", create=True, remote=bucket)
    model, opt = _trainer()
    ck = Checkpointer(store, model, opt)
    rng = np.random.default_rng(6)
    _step(model, opt, rng)
    ck.save(1).wait()
    _until(lambda: _remote(store)["lag_versions"] == 0, "the first save reached the bucket")
    with Pause("remote_snapshot_uploaded") as held:
        _step(model, opt, rng)
        ck.save(2).wait()
        held.wait_reached()
        _step(model, opt, rng)
        ck.save(3).wait()
        ck.close()
        newest = _numbers(store)[-1]
        want = _rows_of(store, newest)
        closing = run_in_thread(store.close)
        time.sleep(0.2)
        assert not closing.done()  # (it waits for the copy point in flight)
        held.release()
        closing.result(timeout=30)
    assert not any(t.name.startswith("cnrstore-uploads") for t in threading.enumerate())
    _assert_bucket_holds(tmp_path, bucket, newest, want)


class UploadsBehindMachine(RuleBasedStateMachine):
    """Saves, a bucket held and let go, retention and GC, in any order, with the copy points behind the commits:
    at every step the bucket (read from alone) holds a version the store committed, bit for bit, and once the
    bucket is let go it catches up with the newest."""

    def __init__(self):
        super().__init__()
        import tempfile

        self.dir = tempfile.mkdtemp(prefix="uploads-behind-")
        self.bucket = GatedBucket()
        self.store = cnrstore.open(f"{self.dir}/node", create=True, remote=self.bucket)
        self.model, self.opt = _trainer()
        self.ck = Checkpointer(self.store, self.model, self.opt)
        self.rng = np.random.default_rng(7)
        self.committed: dict[int, dict] = {}
        self.held = False
        self.reads = 0

    @rule()
    def save(self):
        _step(self.model, self.opt, self.rng)
        v = self.ck.save(len(self.committed)).wait()
        self.committed[v] = _rows_of(self.store, v)

    @rule()
    def hold(self):
        self.bucket.hold()
        self.held = True

    @rule()
    def let_go(self):
        self.bucket.let_go()
        self.held = False

    @precondition(lambda self: len(self.committed) > 2)
    @rule()
    def retain_and_collect(self):
        self.store.retain(keep_last=2)
        self.store.gc()

    @invariant()
    def the_bucket_reads_a_committed_version(self):
        if not self.committed:
            return
        if not self.held:
            _until(lambda: _remote(self.store)["lag_versions"] == 0, "the bucket caught up")
        self.reads += 1
        try:
            versions, rows = _read_back(_Dir(self.dir), DictObjectStore(self.bucket.objects), f"read-{self.reads}")
        except cnrstore.errors.StoreNotFound:
            assert self.held, "the bucket holds no store although it was let go"
            return
        if not versions:  # (the pointer made at open, before any save reached the bucket)
            assert self.held, "the bucket lists no version although it was let go"
            return
        newest = versions[-1]
        assert newest in self.committed
        if not self.held:
            assert newest == max(self.committed)
        for t, want in self.committed[newest].items():
            np.testing.assert_array_equal(rows[t], want, err_msg=f"version {newest}: {t}")

    def teardown(self):
        import shutil

        self.bucket.let_go()
        self.ck.close()
        self.store.close()
        if self.committed:
            versions, _rows = _read_back(_Dir(self.dir), self.bucket, "final")
            assert versions[-1] == max(self.committed)
        shutil.rmtree(self.dir, ignore_errors=True)


class _Dir(str):
    """A str path that joins with ``/`` as a pathlib.Path does (what _read_back takes)."""

    def __truediv__(self, name):
        return f"{self}/{name}"


UploadsBehindMachine.TestCase.settings = settings(max_examples=12, stateful_step_count=10, deadline=None)
test_uploads_behind_in_any_order = UploadsBehindMachine.TestCase
