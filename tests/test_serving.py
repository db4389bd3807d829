"""cnrstore.serving.Follower: a replica's tables follow a store (issue 40, docs/DESIGN.md "Serving: following a
store"): full sync, polls of several commits, rollback and forward, retention dropping the version held (a
re-sync), compaction and GC beside it, the serving() pin, a race with GC by schedule, a remote tier, and a
follower process beside a writer process, both SIGKILLed at random instants."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import cnrstore
from cnrstore import codecs
from cnrstore.errors import InvalidArgument, VersionNotFound
from cnrstore.serving import Follower, FollowerLag

from support.schedule import Pause, run_in_thread

ROWS, DIM, BLOCK = 512, 8, 64


def bits(a) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def same_as_store(target: dict, store, version=None) -> None:
    for name, arr in target.items():
        assert np.array_equal(bits(arr), bits(store.read_table(name, version))), name


def save(store, step, rows, seed, tables=("t", "q")):
    rng = np.random.default_rng(seed)
    with store.checkpoint(step=step) as ck:
        for name in tables:
            ck.put_rows(name, rows, rng.standard_normal((len(rows), DIM), dtype=np.float32))
    return store.latest().version


@pytest.fixture
def two_tables(store):
    """fp32 table 't' and int8 table 'q', every row written at version 1."""
    store.create_table("t", ROWS, DIM, block_rows=BLOCK)
    store.create_table("q", ROWS, DIM, codec="int8", block_rows=BLOCK)
    save(store, 0, np.arange(ROWS), 0)
    return store


def test_dict_target_polls_several_commits_bit_for_bit(two_tables):
    store = two_tables
    target = {}
    f = Follower(store.path, target)
    try:
        assert sorted(target) == ["q", "t"] and f.version == 1
        assert f.stats["full_syncs"] == 1 and f.lag == FollowerLag(0, 0.0)
        same_as_store(target, store)
        assert f.poll() is None
        rng = np.random.default_rng(1)
        changed = set()
        for step in range(1, 4):
            rows = np.sort(rng.choice(ROWS, 10, replace=False))
            changed |= set(rows.tolist())
            save(store, step, rows, step)
        lag = f.lag
        assert lag.versions == 3 and lag.seconds > 0
        before = dict(f.stats)
        assert f.poll() == 4 and f.version == 4
        same_as_store(target, store)  # the int8 table as read_table decodes it
        assert f.lag == FollowerLag(0, 0.0)
        # an update reads the changed rows, in their codecs, not the tables
        want = len(changed) * (codecs.get("fp32").row_bytes(DIM) + codecs.get("int8").row_bytes(DIM))
        assert f.stats["bytes_read"] - before["bytes_read"] == want
        assert f.stats["rows_applied"] - before["rows_applied"] == 2 * len(changed)
        assert f.stats["updates"] == before["updates"] + 1 and f.stats["full_syncs"] == 1
    finally:
        f.close()


def test_rollback_and_forward_bit_for_bit(two_tables):
    store = two_tables
    rng = np.random.default_rng(2)
    for step in range(1, 5):
        save(store, step, np.sort(rng.choice(ROWS, 20, replace=False)), 10 + step)
    target = {"t": np.zeros((ROWS, DIM), np.float32), "q": np.zeros((ROWS, DIM), np.float32)}
    with Follower(store, target, version=2) as f:
        same_as_store(target, store, 2)
        assert f.poll() == 5
        same_as_store(target, store, 5)
        before = f.stats["bytes_read"]
        assert f.rollback(3) == 3 and f.version == 3
        same_as_store(target, store, 3)
        assert f.stats["bytes_read"] - before < 2 * 40 * (DIM * 4)  # the rows of versions 4 and 5 only
        assert f.rollback(1) == 1
        same_as_store(target, store, 1)
        assert f.rollback(5) == 5
        same_as_store(target, store, 5)
        assert f.stats["full_syncs"] == 1
        with pytest.raises(VersionNotFound):
            f.rollback(99)
        assert f.version == 5


def test_retention_dropping_the_version_held_resyncs_and_compaction_and_gc_beside(two_tables):
    store = two_tables
    target = {}
    with Follower(store.path, target) as f:
        rng = np.random.default_rng(3)
        for step in range(1, 4):
            save(store, step, np.sort(rng.choice(ROWS, 30, replace=False)), 20 + step)
        store.compact()
        store.retain(keep_last=1)  # drops version 1, which the follower holds
        store.gc()
        assert f.poll() == 4
        assert f.stats["full_syncs"] == 2
        same_as_store(target, store)
        save(store, 4, np.arange(5), 30)
        store.compact()
        store.gc()
        assert f.poll() == 5 and f.stats["full_syncs"] == 2  # f.version (4) retained: only the changes
        same_as_store(target, store)


def test_tables_restricts_and_bad_targets_are_refused(two_tables):
    store = two_tables
    target = {}
    with Follower(store, target, tables=["t"]):
        assert list(target) == ["t"]
    with pytest.raises(InvalidArgument):
        Follower(store, {"nope": np.zeros((2, 2), np.float32)})
    with pytest.raises(InvalidArgument):
        Follower(store, {"t": np.zeros((ROWS, DIM + 1), np.float32)})
    with pytest.raises(InvalidArgument):
        Follower(store, {}, tables=["nope"])


def test_module_target_saved_by_checkpointer_equals_the_writer_at_each_version(store):
    torch = pytest.importorskip("torch")
    from cnrstore.torch import Checkpointer

    from support.torch_models import Loader, make, train_step

    model, opt = make(0)
    ck = Checkpointer(store, model, opt)
    loader = Loader()
    train_step(model, opt, loader.next())
    ck.save(step=1).wait()
    replica, _ = make(7)  # other initial weights
    replica.eval()
    updates = []
    f = Follower(store.path, replica, on_update=lambda fol, old, new, stats: updates.append((old, new)))
    try:
        def check():
            got, want = replica.state_dict(), model.state_dict()
            assert list(got) == list(want)
            for k in want:
                assert torch.equal(got[k], want[k]), k
        check()
        for step in range(2, 5):
            train_step(model, opt, loader.next())
            ck.save(step=step).wait()
            if step != 3:  # two versions at once at step 4
                assert f.poll() == store.latest().version
                check()
        assert updates == [(1, 2), (2, 4)]
        # an on_update that raises is logged, never propagated
        f.on_update = lambda *a: 1 / 0
        train_step(model, opt, loader.next())
        ck.save(step=5).wait()
        assert f.poll() == 5
        check()
    finally:
        f.close()
        ck.close()


def test_embeddingbag_module_and_optimizer_tables_left_out(store):
    torch = pytest.importorskip("torch")
    from torch import nn

    store.create_table("bag", 64, 4, codec="int8")
    store.create_table("bag.optim.sum", 64, 4)
    vals = np.random.default_rng(4).standard_normal((64, 4), dtype=np.float32)
    with store.checkpoint() as ck:
        ck.put_rows("bag", np.arange(64), vals)
        ck.put_rows("bag.optim.sum", np.arange(64), vals)
    model = nn.Module()
    model.bag = nn.EmbeddingBag(64, 4)
    with Follower(store, model) as f:
        assert f.version == 1
        assert torch.equal(model.bag.weight.detach(), torch.from_numpy(store.read_table("bag")))


def test_serving_pin_blocks_an_update_and_a_batch_never_mixes_versions(store):
    """Every row of table 'v' holds the version number; a reader under serving() must see one number."""
    store.create_table("v", ROWS, DIM, block_rows=BLOCK)

    def put(n):
        with store.checkpoint(step=n) as ck:
            ck.put_rows("v", np.arange(ROWS), np.full((ROWS, DIM), float(n), np.float32))

    put(1)
    target = {}
    f = Follower(store, target)
    try:
        # a thread holding serving() blocks an update until it lets go
        held, go = threading.Event(), threading.Event()

        def hold():
            with f.serving() as v:
                held.set()
                go.wait(10)
                assert (target["v"] == v).all()

        t = run_in_thread(hold)
        held.wait(10)
        put(2)
        polled = run_in_thread(f.poll)
        time.sleep(0.2)
        assert not polled.done() and f.version == 1
        go.set()
        t.result(10)
        assert polled.result(10) == 2
        with f.serving():
            with pytest.raises(InvalidArgument):
                f.poll()  # would wait for itself
        # background mode: batches read while versions stream in
        f.start(interval_s=0.005)
        seen, stop = set(), threading.Event()

        def batches():
            while not stop.is_set():
                with f.serving() as v:
                    a = target["v"]
                    first = a[0, 0]
                    assert first == v and (a == first).all()
                    seen.add(v)

        readers = [run_in_thread(batches) for _ in range(2)]
        for n in range(3, 12):
            put(n)
            time.sleep(0.01)
        deadline = time.monotonic() + 10
        while f.version != 11 and time.monotonic() < deadline:
            time.sleep(0.01)
        stop.set()
        for r in readers:
            r.result(10)
        assert f.version == 11 and len(seen) > 1
        assert f.last_error is None
    finally:
        f.close()


def test_background_errors_are_logged_and_retried(two_tables, monkeypatch):
    store = two_tables
    f = Follower(store.path, {})
    try:
        calls = {"n": 0}
        real = f._compute

        def flaky(*a, **k):
            calls["n"] += 1
            if calls["n"] == 1:
                raise cnrstore.errors.StorageIOError("disk hiccup")
            return real(*a, **k)

        monkeypatch.setattr(f, "_compute", flaky)
        save(store, 1, np.arange(3), 40)
        f.start(interval_s=0.01)
        deadline = time.monotonic() + 10
        while f.version != 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        f.stop()
        assert f.version == 2 and isinstance(f.last_error, cnrstore.errors.StorageIOError)
        assert f.stats["errors"] == 1
    finally:
        f.close()


class _Path:
    """In BAD_ARGUMENTS: the store's path as source (a stable repr, for test ids every xdist worker agrees on)."""

    def __repr__(self):
        return "PATH"


PATH = _Path()
#: (call, keyword arguments, what the message starts with): each refused with InvalidArgument naming the argument
BAD_ARGUMENTS = [
    ("Follower", {"version": "3"}, "version must be a version number (an integer >= 1) or None, got '3'"),
    ("Follower", {"version": 1.5}, "version must be a version number"),
    ("Follower", {"version": np.float64(1)}, "version must be a version number"),
    ("Follower", {"version": True}, "version must be a version number"),  # bools are not versions
    ("Follower", {"version": False}, "version must be a version number"),
    ("Follower", {"version": -1}, "version must be a version number"),
    ("Follower", {"version": 0}, "version must be a version number"),  # 0 is no version
    ("Follower", {"version": "3", "source": PATH}, "version must be a version number"),
    ("Follower", {"tables": 5}, "tables must be None, a name or an iterable of names (str), got 5"),
    ("Follower", {"tables": [5]}, "tables must be None, a name or an iterable of names (str), got 5 in [5]"),
    ("Follower", {"tables": b"t"}, "tables must be None, a name or an iterable of names (str), got b't'"),
    ("Follower", {"tables": ["t", None]}, "tables must be None, a name or an iterable of names (str), got None"),
    ("Follower", {"tables": ["nope"]}, "tables=['nope'] are not tables of store"),
    ("Follower", {"on_update": 5}, "on_update must be None or a callable"),
    ("Follower", {"on_update": "print"}, "on_update must be None or a callable"),
    ("Follower", {"source": 5}, "source must be a store path (a str or os.PathLike) or an open cnrstore.Store"),
    ("Follower", {"source": None}, "source must be a store path"),
    ("Follower", {"target": 5}, "target must be an nn.Module or a dict {name: numpy array}, got int"),
    ("Follower", {"target": [np.zeros((ROWS, DIM), np.float32)]}, "target must be an nn.Module or a dict"),
    ("Follower", {"target": None}, "target must be an nn.Module or a dict"),
    ("Follower", {"target": {"t": np.zeros((2, 2), np.float32)}}, "target['t'] is (2, 2)"),
    ("Follower", {"target": {"t": [[0.0] * DIM] * ROWS}}, "target['t'] must be a writable numpy array"),
    ("Follower", {"cache_bytes": 0}, "remote, remote_options and cache_bytes apply to a store path"),
    ("Follower", {"source": PATH, "cache_bytes": "x"}, "remote_options, cache_bytes, remote_every and "),
    ("Follower", {"source": PATH, "remote": 5}, "remote=5 is not a URL"),
    ("start", {"interval_s": "x"}, "interval_s must be a number, got 'x'"),
    ("start", {"interval_s": "0.1"}, "interval_s must be a number, got '0.1'"),
    ("start", {"interval_s": None}, "interval_s must be a number, got None"),
    ("start", {"interval_s": True}, "interval_s must be a number, got True"),
    ("start", {"interval_s": float("inf")}, "interval_s must be a finite number > 0, got inf"),
    ("start", {"interval_s": -float("inf")}, "interval_s must be a finite number > 0"),
    ("start", {"interval_s": float("nan")}, "interval_s must be a finite number > 0, got nan"),
    ("start", {"interval_s": 0}, "interval_s must be a finite number > 0, got 0"),
    ("start", {"interval_s": -0.5}, "interval_s must be a finite number > 0"),
    ("start", {"interval_s": 1e300}, "interval_s must be at most "),  # finite, beyond the longest wait
    ("rollback", {"version": "2"}, "version must be a version number (an integer >= 1), got '2'"),
    ("rollback", {"version": 1.5}, "version must be a version number (an integer >= 1), got 1.5"),
    ("rollback", {"version": True}, "version must be a version number (an integer >= 1), got True"),
    ("rollback", {"version": 0}, "version must be a version number (an integer >= 1), got 0"),
    ("rollback", {"version": -1}, "version must be a version number (an integer >= 1), got -1"),
    ("rollback", {"version": None}, "version must be a version number (an integer >= 1), got None"),
]


@pytest.mark.parametrize("call,kwargs,message", BAD_ARGUMENTS,
                         ids=[f"{c}-{'-'.join(f'{k}={v!r}'[:30] for k, v in kw.items())}" for c, kw, _m in BAD_ARGUMENTS])
def test_bad_arguments_are_invalid_argument_naming_them_and_change_nothing(two_tables, call, kwargs, message):
    """Issue 49: every argument of Follower, start and rollback of the wrong type or range raises
    InvalidArgument whose message names it and says what to pass, before anything changes: the follower
    serves the version it held (no thread started), the target is untouched, a Store passed in stays open."""
    store = two_tables
    save(store, 1, np.arange(20), 70)  # version 2: something for a poll or a rollback to change
    held = {"t": np.zeros((ROWS, DIM), np.float32), "q": np.zeros((ROWS, DIM), np.float32)}
    f = Follower(store, held, version=1)
    try:
        before = {name: arr.copy() for name, arr in held.items()}
        stats = dict(f.stats)
        if call == "Follower":
            kwargs = dict(kwargs)
            source = kwargs.pop("source", store)
            target = kwargs.pop("target", {})
            original = {k: (np.array(v, copy=True) if isinstance(v, np.ndarray) else v)
                        for k, v in target.items()} if isinstance(target, dict) else None
            with pytest.raises(InvalidArgument) as err:
                Follower(store.path if source is PATH else source, target, **kwargs)
            if isinstance(target, dict):  # untouched: an empty dict is not filled, arrays keep their bits
                assert list(target) == list(original)
                for k, v in target.items():
                    assert np.array_equal(bits(v), bits(original[k])) if isinstance(v, np.ndarray) else v == original[k]
        else:
            with pytest.raises(InvalidArgument) as err:
                getattr(f, call)(**kwargs)
        assert str(err.value).startswith(message), str(err.value)
        assert f.version == 1 and not f.running and f.last_error is None and f.stats == stats
        for name, arr in held.items():
            assert np.array_equal(bits(arr), bits(before[name])), name
        same_as_store(held, store, 1)
        assert [v.version for v in store.versions()] == [1, 2]  # the Store given is still open
        assert f.poll() == 2  # and the follower still works
    finally:
        f.close()


def test_what_the_arguments_accept(two_tables):
    """numpy ints for versions, numpy floats and ints for interval_s, one name or any iterable of names."""
    store = two_tables
    save(store, 1, np.arange(20), 71)
    for tables in ("t", ("t",), {"t"}, {"t": 0}, (n for n in ["t"]), np.array(["t"])):
        target = {}
        with Follower(store, target, version=np.int64(1), tables=tables, on_update=print) as f:
            assert list(target) == ["t"] and f.version == 1
    with Follower(store.path, {}, version=np.uint8(1), tables=[]) as f:
        assert f.rollback(np.int32(2)) == 2 and f.rollback(np.uint64(1)) == 1
        for interval in (np.float32(0.01), 1, np.int64(2)):
            f.start(interval_s=interval)
            assert f.running
            f.stop()
            assert not f.running


def test_on_update_assigned_later_is_checked_as_at_construction(two_tables):
    store = two_tables
    save(store, 1, np.arange(20), 71)
    with Follower(store, {}) as f:
        for bad in (5, "print", [print]):
            with pytest.raises(InvalidArgument, match="on_update"):
                f.on_update = bad
        assert f.on_update is None
        seen = []
        f.on_update = lambda fol, old, new, stats: seen.append((old, new))
        old = f.version
        save(store, 2, np.arange(5), 72)
        new = f.poll()
        assert new > old and seen == [(old, new)]
        f.on_update = None


def test_an_unexpected_error_in_the_polling_thread_is_recorded_and_retried(two_tables, monkeypatch):
    """Any Exception a poll raises, not only a store's or the OS's (an OverflowError, a RuntimeError), is
    recorded in last_error and retried: the thread lives on and applies the next version."""
    store = two_tables
    f = Follower(store.path, {})
    try:
        real = f.poll
        raised = [OverflowError("timestamp out of range"), RuntimeError("something else")]

        def poll():
            if raised:
                raise raised.pop(0)
            return real()

        monkeypatch.setattr(f, "poll", poll)
        save(store, 1, np.arange(3), 41)
        f.start(interval_s=0.01)
        deadline = time.monotonic() + 10
        while f.version != 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert f.version == 2 and f.running  # retried past both errors, the thread still polling
        assert isinstance(f.last_error, RuntimeError) and f.stats["errors"] == 2
        f.stop()
        assert not f.running
    finally:
        f.close()


@pytest.mark.parametrize("where", ["poll", "on_update", "wait"])
def test_what_ends_the_polling_thread_is_recorded_and_stop_close_start_still_work(two_tables, monkeypatch, where):
    """What a poll raises that is no Exception (SystemExit from on_update, a KeyboardInterrupt), or anything
    raised outside the poll (the wait between polls): recorded in last_error and logged, and the thread ends
    (running False) instead of dying with a traceback; stop(), start() and close() work afterwards."""
    store = two_tables
    f = Follower(store.path, {})
    try:
        if where == "poll":
            monkeypatch.setattr(f, "poll", lambda: (_ for _ in ()).throw(KeyboardInterrupt()))
        elif where == "on_update":
            f.on_update = lambda *a: sys.exit(3)
        else:  # the wait between polls fails (as an infinite interval did: an OverflowError from the wait)
            monkeypatch.setattr(f._stop, "wait", lambda timeout: (_ for _ in ()).throw(OverflowError("time_t")))
        save(store, 1, np.arange(3), 42)
        f.start(interval_s=0.01)
        deadline = time.monotonic() + 10
        while f.running and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not f.running and f.stats["errors"] == 1
        expected = {"poll": KeyboardInterrupt, "on_update": SystemExit, "wait": OverflowError}[where]
        assert isinstance(f.last_error, expected)
        assert f.version == (2 if where == "on_update" else 1)  # (on_update runs once the update is applied)
        f.stop()
        monkeypatch.undo()
        f.on_update = None
        save(store, 2, np.arange(3), 43)
        f.start(interval_s=0.01)  # a new thread
        deadline = time.monotonic() + 10
        while f.version != 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert f.version == 3 and f.running
    finally:
        f.close()
    assert not f.running


@pytest.mark.parametrize("drop_held", [False, True])
def test_race_gc_deletes_the_segments_a_follower_reads(two_tables, drop_held):
    """The follower stops inside its read transaction (its reader pin) while retention drops versions and GC
    frees the segments they read: it reads the version whole, or (a version held dropped before its read
    began) re-syncs; never damaged or mixed rows."""
    store = two_tables
    target = {}
    with Follower(store.path, target) as f:
        rng = np.random.default_rng(5)
        for step in range(1, 4):
            save(store, step, np.sort(rng.choice(ROWS, 200, replace=False)), 50 + step)
        if drop_held:
            store.retain(keep_last=1)  # version 1, held, dropped before the read begins
        newest = store.latest().version
        expect = {name: store.read_table(name) for name in ("t", "q")}
        with Pause("follower_reading") as paused:
            polled = run_in_thread(f.poll)
            paused.wait_reached()
            save(store, 4, np.arange(ROWS), 60)  # every row again: every older record is shadowed
            store.retain(keep_last=1)
            store.compact()
            report = store.gc()
            assert report.segments_deleted == 0 or report.bytes_pending  # what the pinned reader reads waits
            paused.release()
            got = polled.result(30)
        if drop_held:  # the read of the changes since version 1 found it gone: a full sync of the newest
            assert got == newest + 1 and f.stats["full_syncs"] == 2
            same_as_store(target, store)
            assert f.poll() is None
            return
        assert got == newest  # read whole in its transaction, though retention and GC ran meanwhile
        for name in expect:
            assert np.array_equal(bits(target[name]), bits(expect[name])), name
        assert f.stats["full_syncs"] == 1
        assert f.poll() == newest + 1  # its version was dropped meanwhile: a re-sync
        assert f.stats["full_syncs"] == 2
        same_as_store(target, store)


def test_follow_a_remote_store(tmp_path):
    from support.crash_states import DictObjectStore

    objects = DictObjectStore()
    writer = cnrstore.open(tmp_path / "w", create=True, remote=objects, cache_bytes=0)
    try:
        writer.create_table("t", ROWS, DIM, block_rows=BLOCK)
        writer.create_table("q", ROWS, DIM, codec="int8", block_rows=BLOCK)
        save(writer, 0, np.arange(ROWS), 70)
        target = {}
        with Follower(str(tmp_path / "cache"), target, remote=objects) as f:
            same_as_store(target, writer)
            assert f.poll() is None
            for step in range(1, 3):
                save(writer, step, np.arange(step * 10), 70 + step)
            assert f.poll() == 3  # the bucket's last copy point
            same_as_store(target, writer)
            save(writer, 3, np.arange(7), 80)
            writer.retain(keep_last=1)  # drops version 3, which the follower holds
            writer.gc()
            save(writer, 4, np.arange(9), 90)  # (its copy point shows the bucket without version 3)
            assert f.poll() == 5 and f.stats["full_syncs"] == 2
            same_as_store(target, writer)
    finally:
        writer.close()


# -- processes: a writer with background compaction and a follower, SIGKILLed at random instants ----------

WORKER = os.path.join(os.path.dirname(__file__), "support", "follower_worker.py")


def _spawn(role, path, *args):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.dirname(__file__)),
                                                        os.path.dirname(__file__)])}
    return subprocess.Popen([sys.executable, WORKER, role, path, *map(str, args)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _checked(log: str) -> int:
    try:
        with open(log) as fh:
            return sum(1 for _ in fh)
    except FileNotFoundError:
        return 0


def test_follower_process_beside_a_writer_process_both_killed(tmp_path):
    path = str(tmp_path / "store")
    log = str(tmp_path / "checked.log")
    rng = np.random.default_rng(6)
    checked = 0
    for rnd in range(3):
        writer = _spawn("writer", path)
        follower = _spawn("follower", path, log)
        deadline = time.monotonic() + 20
        while _checked(log) <= checked and time.monotonic() < deadline and follower.poll() is None:
            time.sleep(0.02)  # until this round's follower checked its first version
        checked = _checked(log)
        time.sleep(0.2 + rng.random() * 0.5)
        for p in ([writer, follower] if rnd % 2 else [follower, writer]):
            p.send_signal(signal.SIGKILL)
            time.sleep(rng.random() * 0.1)
        for p in (writer, follower):
            _out, err = p.communicate(timeout=30)
            assert "MISMATCH" not in err, err[-2000:]
            assert "Traceback" not in err, err[-2000:]
    with open(log) as fh:
        lines = [ln.split() for ln in fh if ln.strip()]
    assert lines and all(ln[0] == "ok" for ln in lines)
    assert len({int(ln[1]) for ln in lines}) > 2  # it checked several versions
    # the store the kills left opens and reads
    with cnrstore.open(path, readonly=True) as s:
        from support.follower_worker import expected

        v = s.latest()
        assert np.array_equal(bits(s.read_table("t")), bits(expected(v.step)))


def test_the_constructors_full_sync_holds_one_tables_rows_at_a_time(tmp_path):
    """The first full sync writes each table into the target as it is read (no request can be served from
    the target yet): the host's peak of traced allocations is bounded by a few tables' rows, not by the
    model (10 tables of 2 MiB here; staging every table first peaked above 30 MiB)."""
    import tracemalloc

    store = cnrstore.open(tmp_path / "s", create=True)
    shape = (8192, 64)
    with store.checkpoint() as ck:
        for i in range(10):
            store.create_table(f"t{i}", *shape)
            ck.put_rows(f"t{i}", np.arange(shape[0]), np.random.default_rng(i).standard_normal(shape, np.float32))
    target = {f"t{i}": np.zeros(shape, np.float32) for i in range(10)}
    table_bytes = shape[0] * shape[1] * 4
    tracemalloc.start()
    try:
        follower = Follower(store, target)
        _current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 5 * table_bytes, f"peak {peak / 2**20:.1f} MiB for tables of {table_bytes / 2**20:.0f} MiB"
    for i in range(10):
        assert np.array_equal(target[f"t{i}"], store.read_table(f"t{i}"))
    follower.close()
    store.close()
