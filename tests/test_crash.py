"""I3: a crash at any instant leaves every committed version intact and the version in flight absent.

Three kinds of crash:

- named crash points (``CNRSTORE_CRASH_AT``: after_append, after_fsync, inside_index_commit, after_delta_merge) in a
  writer subprocess, which dies by SIGKILL there with some versions acknowledged behind it;
- SIGKILL of a writer subprocess at random instants while it commits versions continuously, over
  several crash/recover cycles of one store, with small segments so crashes land on segment rolls;
- a simulated power loss: a FileSystem that, from a chosen call on, fails every effect and then
  drops every segment byte not yet fsynced (leveldb's fault_injection_test), in this process.

After each crash the store is reopened; every acknowledged version must read back exactly (the
workload of tests/support/crash_writer.py is a function of the version number, so the expected content is
recomputed here), the version in flight must be absent, torn segment tails must be truncated,
``verify()`` must pass and a new checkpoint must write and read back.
"""

from __future__ import annotations

import errno
import importlib.util
import json
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time

import pytest

import cnrstore
from cnrstore.engine import filenames, fs
from cnrstore import knobs

HERE = os.path.dirname(os.path.abspath(__file__))
WRITER = os.path.join(HERE, "support", "crash_writer.py")
_spec = importlib.util.spec_from_file_location("crash_writer", WRITER)
cw = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cw)

CRASH_POINTS = ["after_append", "after_fsync", "inside_index_commit", "after_delta_merge"]
#: The writer subprocesses run FBGEMM single-threaded: on a loaded 2-core machine, OpenMP barriers
#: make each small encode call ~500x slower, which would only cost wall time here.
CHILD_ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
CHILD_ENV.pop(fs.CRASH_ENV, None)


#: the expected values are computed with the codecs here too: keep that fast (conftest.py)
pytestmark = pytest.mark.usefixtures("single_threaded_torch")


# -- helpers ------------------------------------------------------------------------------------------

def seed_store(path: str, segment_bytes: int) -> None:
    """Create the store with the workload's tables and version 1 (every row of every table)."""
    old = knobs.SEGMENT_BYTES
    knobs.SEGMENT_BYTES = segment_bytes
    try:
        with cnrstore.open(path, create=True) as store:
            cw.create_tables(store)
            with store.checkpoint(step=cw.STEP, meta=cw.META) as ck:
                cw.write_version(ck)
            assert ck.version == 1
    finally:
        knobs.SEGMENT_BYTES = old


def segment_files(path: str) -> dict[int, int]:
    """{segment id: file size} of every segment file on disk."""
    out = {}
    for name in os.listdir(filenames.segments_dir(path)):
        seg = filenames.parse_segment_name(name)
        if seg is not None:
            out[seg] = os.path.getsize(filenames.segment_path(path, seg))
    return out


def committed_lengths(store) -> dict[int, int]:
    with store.engine.read() as view:
        return view.segments()


def has_torn_state(path: str, committed: dict[int, int]) -> bool:
    """Whether segments/ holds bytes past the committed lengths (a torn tail or an unknown segment)."""
    files = segment_files(path)
    return any(seg not in committed or size > committed[seg] for seg, size in files.items())


def check_store(store, model: cw.Model, expect: list[int], versions_to_read=None) -> list[int]:
    """Assert the store's committed versions are ``expect`` and that each (or those given) reads exactly."""
    present = [info.version for info in store.versions()]
    assert present == expect
    for v in present if versions_to_read is None else versions_to_read:
        cw.check_version(store, model, present, v)
    if present:
        cw.check_version(store, model, present, present[-1])
        latest = store.latest()
        assert latest is not None and latest.version == present[-1]
    report = store.verify()
    assert report.ok, report.problems
    return present


def check_recovered(path: str, model: cw.Model, expect: list[int], *, torn: bool | None) -> None:
    """Open writable (recovery), check the tail was truncated, versions read, and a new one writes."""
    with cnrstore.open(path) as store:
        if torn is not None:
            assert bool(store.recovery_notes) == torn, store.recovery_notes
        committed = committed_lengths(store)
        assert segment_files(path) == committed, "torn tails truncated, uncommitted segments removed"
        check_store(store, model, expect)


def write_one_more(path: str, model: cw.Model, expect: list[int], not_reused: int | None,
                   sample: int | None = None) -> list[int]:
    """Write a new version after recovery; read it and every older version (or ``sample`` of them) back."""
    with cnrstore.open(path) as store:
        with store.checkpoint(step=cw.STEP, meta=cw.META) as ck:
            cw.write_version(ck)
        v = ck.version
        assert v > expect[-1]
        if not_reused is not None:
            assert v > not_reused, "a version number handed to a crashed writer is never reused"
        expect = expect + [v]
        older = expect if sample is None else random.Random(v).sample(expect, min(sample, len(expect)))
        check_store(store, model, expect, versions_to_read=sorted(set(older) | {v}))
        assert segment_files(path) == committed_lengths(store)
    return expect


class WriterServer:
    """A crash_writer.py fork server: one writer child per ``run``, killed or crashing at will."""

    def __init__(self, stderr_path: str):
        self._stderr = open(stderr_path, "w")
        self.proc = subprocess.Popen([sys.executable, WRITER, "serve"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._stderr, text=True, bufsize=1,
                                     env=CHILD_ENV)
        self._lines: queue.Queue = queue.Queue()
        self._early: list[list[str]] = []
        self._thread = threading.Thread(target=self._pump, daemon=True)
        self._thread.start()

    def _pump(self):
        for line in self.proc.stdout:
            self._lines.put(line.split())
        self._lines.put(None)

    def _next(self, timeout: float) -> list[str]:
        try:
            words = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"the crash writer server sent nothing for {timeout} s") from None
        assert words is not None, "crash writer server exited"
        return words

    def start(self, **cmd) -> int:
        """Fork a writer child; returns its pid (the child is already running)."""
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        self._early = []
        while True:
            words = self._next(60)
            if words[0] == "pid":
                return int(words[1])
            self._early.append(words)  # the child's first lines may overtake the server's

    def finish(self, pid: int, timeout: float = 30) -> "Run":
        """Wait for the child to end; returns what it printed and how it ended.

        A child still running after ``timeout`` seconds without a word is killed, and the test fails.
        """
        run = Run()
        for words in self._early:
            run.add(words)
        while True:
            try:
                words = self._next(timeout)
            except TimeoutError:
                os.kill(pid, signal.SIGKILL)
                raise AssertionError(f"writer child {pid} hung; it printed {run.lines[-5:]}") from None
            if words[0] == "exit":
                assert int(words[1]) == pid
                run.status = int(words[2])
                return run
            run.add(words)

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(30)
        self._stderr.close()


class Run:
    def __init__(self):
        self.begun: list[int] = []
        self.committed: list[int] = []
        self.ready = False
        self.done = False
        self.status: int | None = None
        self.lines: list[list[str]] = []

    def add(self, words: list[str]) -> None:
        self.lines.append(words)
        if words[0] == "begin":
            self.begun.append(int(words[1]))
        elif words[0] == "committed":
            self.committed.append(int(words[1]))
        elif words[0] == "ready":
            self.ready = True
        elif words[0] == "done":
            self.done = True
        elif words[0] == "error":
            raise AssertionError(f"the writer failed: {' '.join(words[1:])}")

    @property
    def killed(self) -> bool:
        return os.WIFSIGNALED(self.status) and os.WTERMSIG(self.status) == signal.SIGKILL


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = WriterServer(str(tmp_path_factory.mktemp("server") / "stderr.txt"))
    yield srv
    srv.close()


# -- named crash points ---------------------------------------------------------------------------------

def _check_named_crash(path: str, run: "Run", acked_before: list[int]) -> None:
    assert run.ready and len(run.committed) == 3, run.lines
    assert run.begun[:-1] == run.committed, run.lines
    in_flight = run.begun[-1]
    expect = acked_before + run.committed
    model = cw.Model()
    # a readonly open recovers nothing: it must read every acknowledged version past the torn tail
    with cnrstore.open(path, readonly=True) as store:
        assert has_torn_state(path, committed_lengths(store)), "the crashed version left bytes on disk"
        check_store(store, model, expect)
        assert in_flight not in [i.version for i in store.versions()]
    check_recovered(path, model, expect, torn=True)
    write_one_more(path, model, expect, not_reused=in_flight)


@pytest.mark.parametrize("segment_bytes", [16 << 10, 1], ids=["segments16k", "segment_per_append"])
@pytest.mark.parametrize("point", CRASH_POINTS)
def test_named_crash_point(server, tmp_path, point, segment_bytes):
    """The writer dies by SIGKILL at a named point of its 4th commit; the 3 before survive, it does not."""
    path = str(tmp_path / "store")
    seed_store(path, segment_bytes)
    pid = server.start(store=path, segment_bytes=segment_bytes, crash_at=point, arm_after=3)
    run = server.finish(pid)
    assert run.killed, (run.status, run.lines)
    _check_named_crash(path, run, [1])


def test_named_crash_point_fresh_process(tmp_path):
    """The same, in a freshly started interpreter with ``$CNRSTORE_CRASH_AT`` set in its environment."""
    path = str(tmp_path / "store")
    seed_store(path, 16 << 10)
    env = {**CHILD_ENV, fs.CRASH_ENV: "after_fsync"}
    proc = subprocess.run([sys.executable, WRITER, "write", path, "--segment-bytes", "16384", "--arm-after", "3"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, proc.stdout, proc.stderr)
    run = Run()
    for line in proc.stdout.splitlines():
        run.add(line.split())
    _check_named_crash(path, run, [1])


def test_crash_before_any_checkpoint_of_the_run(server, tmp_path):
    """A crash in the very first commit after open: only the seeded version exists afterwards."""
    path = str(tmp_path / "store")
    seed_store(path, 1 << 20)
    pid = server.start(store=path, segment_bytes=1 << 20, crash_at="inside_index_commit", arm_after=0)
    run = server.finish(pid)
    assert run.killed and run.committed == [] and len(run.begun) == 1, run.lines
    model = cw.Model()
    check_recovered(path, model, [1], torn=True)
    write_one_more(path, model, [1], not_reused=run.begun[0])


# -- random instants ------------------------------------------------------------------------------------

def test_sigkill_at_random_instants(server, tmp_path):
    """Repeated SIGKILLs of a continuously committing writer, each followed by recovery and checks."""
    path = str(tmp_path / "store")
    segment_bytes = 12 << 10  # a version is ~10-20 KiB: most commits roll a segment
    seed_store(path, segment_bytes)
    rng = random.Random(20220404)
    model = cw.Model()
    begun, acked, present = {1}, [1], [1]
    in_flight_absent = in_flight_present = 0
    for i in range(24):
        # at least 8 kills, and more while too few landed after commits or inside checkpoints (a loaded
        # machine starts the writer slowly): a few land while it opens and recovers the store, most while
        # it commits
        if i >= 8 and len(present) > 8 and in_flight_absent + in_flight_present >= 2:
            break
        delay = rng.uniform(0.0, 0.05) if i % 4 == 0 else rng.uniform(0.1, 0.4)
        pid = server.start(store=path, segment_bytes=segment_bytes)
        time.sleep(delay)
        os.kill(pid, signal.SIGKILL)
        run = server.finish(pid)
        assert run.killed and not run.done, run.lines
        begun.update(run.begun)
        acked += run.committed
        assert run.begun[: len(run.committed)] == run.committed
        if i % 2:  # a readonly open first: it must read through whatever the crash left
            with cnrstore.open(path, readonly=True) as store:
                now = [info.version for info in store.versions()]
                cw.check_version(store, model, now, now[-1])
        with cnrstore.open(path) as store:
            assert segment_files(path) == committed_lengths(store), "torn tails truncated"
            now = [info.version for info in store.versions()]
            assert set(acked) <= set(now) <= begun, (acked, now, sorted(begun))
            assert now[: len(present)] == present, "committed versions never disappear"
            new = now[len(present):]
            if len(run.begun) > len(run.committed):  # killed with a version in flight
                if run.begun[-1] in now:  # its commit had finished, just not been acknowledged
                    in_flight_present += 1
                else:
                    in_flight_absent += 1
            # every version committed since the last crash, and a sample of older ones
            older = rng.sample(present, min(3, len(present)))
            check_store(store, model, now, versions_to_read=sorted(set(new) | set(older)))
            present = now
    assert len(present) > 8, "the kills should land after some commits"
    assert in_flight_absent + in_flight_present >= 2, "kills should land inside checkpoints"
    # reads take time linear in the chain of increments (no compaction yet): re-read a sample
    present = write_one_more(path, model, present, not_reused=max(begun), sample=10)
    with cnrstore.open(path, readonly=True) as store:
        check_store(store, model, present, versions_to_read=rng.sample(present, 10))


# -- power loss: unsynced segment bytes dropped ------------------------------------------------------------

class PowerLoss(OSError):
    def __init__(self):
        super().__init__(errno.EIO, "simulated power loss")


class PowerCutFS(fs.FileSystem):
    """Records, per file, the length made durable by fsync; from call ``cut_at`` on, every effect fails.

    ``power_off()`` then does what a power loss does to the page cache: each file written through
    this seam is cut back to its last-synced length (optionally keeping a random part of what was
    written after it, as a disk may), and files whose directory entry was never synced vanish.
    """

    def __init__(self, cut_at: int | None):
        self.cut_at = cut_at
        self.calls = 0
        self.dead = False
        self.paths: dict[int, str] = {}  # fd -> path
        self.synced: dict[str, int] = {}  # path -> durable length
        self.unsynced_entries: set[str] = set()  # created since their directory was last synced

    def _effect(self) -> bool:
        """Count one call; raises once the power is off. Returns True if this call is the cut."""
        if self.dead:
            raise PowerLoss()
        self.calls += 1
        if self.calls == self.cut_at:
            self.dead = True
            return True
        return False

    def open_append(self, path, *, create):
        if self._effect():
            raise PowerLoss()
        fd = super().open_append(path, create=create)
        self.paths[fd] = path
        if create:
            self.synced[path] = 0
            self.unsynced_entries.add(path)
        else:
            self.synced.setdefault(path, os.path.getsize(path))
        return fd

    def pwritev(self, fd, buffers, offset):
        if self._effect():  # the power fails mid-write: part of the bytes reach the page cache
            data = b"".join(bytes(memoryview(b).cast("B")) for b in buffers)
            os.pwrite(fd, data[: len(data) // 2], offset)
            raise PowerLoss()
        return super().pwritev(fd, buffers, offset)

    def fsync(self, fd):
        if self._effect():
            raise PowerLoss()
        super().fsync(fd)
        self.synced[self.paths[fd]] = os.fstat(fd).st_size

    def fsync_dir(self, path):
        if self._effect():
            raise PowerLoss()
        super().fsync_dir(path)
        self.unsynced_entries = {p for p in self.unsynced_entries if os.path.dirname(p) != path.rstrip("/")}

    def truncate(self, path, length):
        if self._effect():
            raise PowerLoss()
        super().truncate(path, length)
        if path in self.synced:
            self.synced[path] = min(self.synced[path], length)

    def remove(self, path):
        if self._effect():
            raise PowerLoss()
        super().remove(path)
        self.synced.pop(path, None)
        self.unsynced_entries.discard(path)

    def write_file_atomic(self, path, tmp_path, data):
        if self._effect():
            raise PowerLoss()
        super().write_file_atomic(path, tmp_path, data)

    def close(self, fd):
        self.paths.pop(fd, None)
        super().close(fd)  # closing loses nothing: allowed even with the power off

    def power_off(self, rng: random.Random | None) -> None:
        for path in self.unsynced_entries:
            if os.path.exists(path):
                os.remove(path)
        for path, durable in self.synced.items():
            if path in self.unsynced_entries or not os.path.exists(path):
                continue
            size = os.path.getsize(path)
            keep = durable if rng is None else durable + rng.randint(0, size - durable)
            if size > keep:
                os.truncate(path, keep)


def _power_cut_trial(path: str, cut_at: int | None, rng: random.Random | None, versions: int = 4):
    """Write up to ``versions`` versions through a PowerCutFS cut at call ``cut_at``; then lose power.

    Returns (acknowledged versions, version in flight or None, number of effects counted).
    """
    seed_store(path, 8 << 10)
    pfs = PowerCutFS(cut_at)
    store = cnrstore.Store(path, create=False, readonly=False, filesystem=pfs)
    acked, in_flight = [1], None
    old = knobs.SEGMENT_BYTES
    knobs.SEGMENT_BYTES = 8 << 10
    try:
        for _ in range(versions):
            in_flight = None
            with store.checkpoint(step=cw.STEP, meta=cw.META) as ck:
                in_flight = ck.version
                cw.write_version(ck)
            acked.append(ck.version)
            in_flight = None
    except (PowerLoss, cnrstore.errors.StorageIOError) as exc:  # EIO from the seam is typed on the way up
        assert cut_at is not None
        assert isinstance(exc, PowerLoss) or isinstance(exc.__cause__, PowerLoss)
    finally:
        knobs.SEGMENT_BYTES = old
        store.close()
    if cut_at is not None:
        assert pfs.dead, "the cut happened"
        pfs.power_off(rng)
    return acked, in_flight, pfs.calls


def test_power_loss_drops_only_unsynced_bytes(tmp_path):
    """Committed versions survive losing every byte not fsynced, whichever effect the power fails at."""
    acked, _, total = _power_cut_trial(str(tmp_path / "clean"), None, None)
    assert len(acked) == 5 and total > 10
    rng = random.Random(7)
    cuts = sorted(set(range(1, total + 1, max(1, total // 10))) | {total, rng.randint(1, total)})
    model = cw.Model()
    for n, cut in enumerate(cuts):
        path = str(tmp_path / f"cut{cut}")
        keep_some = rng if n % 2 else None
        acked, in_flight, _ = _power_cut_trial(path, cut, keep_some)
        assert in_flight is not None, "the cut lands inside a checkpoint"
        check_recovered(path, model, acked, torn=None)
        if n % 3 == 0:
            write_one_more(path, model, acked, not_reused=in_flight)


QUEUED_SAVES = r'''
import os, signal, sys
import numpy as np, torch
from torch import nn
import cnrstore
from cnrstore.torch import Checkpointer

path, out, saves, acked = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
torch.manual_seed(0)
emb = nn.Embedding(200_000, 16)
store = cnrstore.open(path, create=True)
ck = Checkpointer(store, emb, codec="fp32", mode="incremental", max_queue_bytes=1 << 30)
rng = np.random.default_rng(1)
pendings = []
for i in range(saves):
    ids = torch.from_numpy(rng.choice(200_000, 20_000, replace=False))
    emb(ids).sum().backward()
    with torch.no_grad():
        emb.weight[ids] += 1.0
    np.save(os.path.join(out, f"save{i}.npy"), emb.weight.detach().numpy())
    pendings.append(ck.save(i))
print("queued", sum(not p.done() for p in pendings), flush=True)
pendings[acked - 1].wait()        # acknowledged: its version must survive what follows
os.kill(os.getpid(), signal.SIGKILL)   # while later saves are queued or being written
'''


@pytest.mark.parametrize("acked", [1, 2])
def test_sigkill_with_saves_queued_keeps_a_prefix_of_them_in_save_order(tmp_path, acked):
    """A Checkpointer's queued saves (issue 23) commit in save order: after a SIGKILL while later saves are
    queued or half written, the store holds a prefix of the saves, every acknowledged one (its wait()
    returned) included, each exactly the model at its save(); the store then takes a new checkpoint."""
    path, out, saves = str(tmp_path / "store"), tmp_path / "models", 5
    out.mkdir()
    proc = subprocess.run([sys.executable, "-c", QUEUED_SAVES, path, str(out), str(saves), str(acked)],
                          env=CHILD_ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr[-3000:]
    import numpy as np

    with cnrstore.open(path) as store:
        versions = [v.version for v in store.versions()]
        steps = [v.step for v in store.versions()]
        assert steps == list(range(len(steps))) and acked <= len(steps) <= saves, (steps, proc.stdout)
        for v, step in zip(versions, steps):
            want = np.load(out / f"save{step}.npy")
            np.testing.assert_array_equal(store.read_table("embedding", v), want)
        with store.checkpoint(step=99) as ck:
            ck.put_rows("embedding", np.array([0]), np.zeros((1, 16), np.float32))
        assert store.latest().step == 99
