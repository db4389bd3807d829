"""Streamed saves (issue 37): a save, baseline or increment, written from the live tables while training
goes on, a row copied aside only just before an optimizer step changes it (cnrstore/torch/streamed.py).

The saved version must equal the state at ``save()``, bit for bit:
- with training in lockstep between every two chunks of the write (a schedule, the same every run), and
  inside the window where the writer has read a chunk but not yet moved its cursor past it;
- with training at full speed during the write;
- in every mode, with Adagrad and plain SGD (streamed) and with Adam and momentum SGD (copied at save);
- in every crash state of a streamed baseline's write (the crash-state explorer), and after a SIGKILL in
  the middle of one.
Memory: a streamed baseline holds only the rows training changed during its write. Durability: ``max_lag``
bounds the saves not yet committed when ``save()`` returns; ``durable_step`` says where a kill lands.
"""

from __future__ import annotations

import copy
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch
from torch import nn

import cnrstore
from cnrstore import knobs
from cnrstore.engine import fs
from cnrstore.store import Store
from cnrstore.torch import Checkpointer, streamed

from support import crash_states as cs
from support.schedule import Pause
from support.torch_state import assert_same_state

ROWS, DIM, BLOCK = 4096, 8, 256

OPTIMIZERS = {
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1),
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1),
    "adam": lambda p: torch.optim.Adam(p, lr=0.01),
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
}
STREAMED = {"adagrad", "sgd"}


class Model(nn.Module):
    def __init__(self, rows=ROWS, dim=DIM):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(rows, dim)
        self.head = nn.Linear(dim, 1)

    def forward(self, ids):
        return self.head(self.emb(ids)).mean()


def step(model, opt, ids):
    opt.zero_grad()
    (model(torch.as_tensor(ids)) ** 2).backward()
    opt.step()


def spread_ids(rng, rows=ROWS, n=64):
    """Ids over the whole table: before the writer's cursor, in the chunk it reads, and beyond."""
    return torch.from_numpy(rng.choice(rows, size=n, replace=False))


@pytest.fixture
def small_chunks(monkeypatch):
    """One block (256 rows) per chunk: a 4096-row table is written in 16 chunks."""
    monkeypatch.setattr(streamed, "CHUNK_BYTES", 1)


def make_store(path, block_rows=BLOCK, width=DIM):
    store = cnrstore.open(path, create=True)
    store.create_table("emb", ROWS, DIM, codec="fp32", block_rows=block_rows)
    store.create_table("emb.optim.sum", ROWS, width, codec="fp32", block_rows=block_rows)
    return store


def state_of(model, opt):
    return copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())


def assert_restores_to(store, version, saved, name, mode):
    saved_model, saved_opt = saved
    fresh = Model()
    with torch.no_grad():
        fresh.emb.weight.fill_(7.0)  # nothing of it may survive the restore
    fresh_opt = OPTIMIZERS[name](fresh.parameters())
    with Checkpointer(store, fresh, fresh_opt, codec="fp32", mode=mode) as ck:
        ck.restore(version)
    assert_same_state(fresh, fresh_opt, saved_model, saved_opt)


class Lockstep:
    """At every chunk the writer has written (pause point ``streamed_chunk_written``), the writer waits
    while the trainer's thread runs ``steps`` training steps; the same interleaving every run."""

    def __init__(self, point="streamed_chunk_written"):
        self.point = point
        self.at_chunk = threading.Semaphore(0)
        self.go = threading.Semaphore(0)
        self.chunks = 0
        self.done = threading.Event()

    def hook(self, _name, *_detail):
        self.chunks += 1
        self.at_chunk.release()
        assert self.go.acquire(timeout=60), "the trainer never let the writer go on"

    def __enter__(self):
        fs.pause_at(self.point, self.hook)
        return self

    def __exit__(self, *exc):
        fs.pause_at(self.point, None)

    def train_between_chunks(self, pending, train):
        """Until ``pending`` has ended: at each chunk, ``train()`` then let the writer go on."""
        while not pending.done():
            if self.at_chunk.acquire(timeout=0.05):
                train()
                self.go.release()


@pytest.mark.parametrize("mode", ["incremental", "one-shot", "intermittent"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_baseline_holds_the_state_at_save_while_training_runs_between_its_chunks(tmp_path, small_chunks,
                                                                                  name, mode):
    rng = np.random.default_rng(0)
    model = Model()
    opt = OPTIMIZERS[name](model.parameters())
    store = make_store(str(tmp_path / "s"), width=DIM)
    ck = Checkpointer(store, model, opt, codec="fp32", mode=mode)
    step(model, opt, spread_ids(rng))  # (Adam's state exists before the baseline)
    saved = {}
    with Lockstep() as lock:
        pending = ck.save(0)
        saved[0] = state_of(model, opt)
        assert pending.report.baseline
        lock.train_between_chunks(pending, lambda: [step(model, opt, spread_ids(rng)) for _ in range(2)])
    v0 = pending.wait()
    if name in STREAMED:
        assert pending.report.streamed == ["emb"] and lock.chunks == ROWS // BLOCK
        # only the rows training changed during the write were copied: 2 steps x 64 ids per chunk, at most
        assert 0 < pending.report.preserved_bytes <= 16 * 2 * 64 * 2 * DIM * 4
        assert pending.report.host_bytes < ROWS * DIM * 4  # less than one copy of the table
    else:
        assert pending.report.streamed == [] and lock.chunks == 0  # copied at save: drift "state"
    # increments on top, also streamed (a chunk per block of their rows), training between their chunks
    for i in range(1, 3):
        step(model, opt, spread_ids(rng, n=512))
        with Lockstep() as lock:
            p = ck.save(i)
            saved[i] = state_of(model, opt)
            lock.train_between_chunks(p, lambda: [step(model, opt, spread_ids(rng)) for _ in range(2)])
        saved[p.wait()] = saved.pop(i)
        if name in STREAMED:
            assert p.report.streamed == ["emb"] and lock.chunks > 4
            if not p.report.baseline:
                # nothing copied at save(); aside, at most the save's rows (weights and state), as training reached them
                assert p.report.rows["emb"] < ROWS and 0 < p.report.preserved_bytes <= p.report.rows["emb"] * 2 * DIM * 4
    ck.close()
    saved[v0] = saved.pop(0)
    for v, want in saved.items():
        assert_restores_to(store, v, want, name, mode)
    store.close()


def test_rows_changed_while_the_writer_reads_their_chunk_are_its_preserved_values(tmp_path, small_chunks):
    """The window of ``StreamedTable.take``: the writer has read chunk k's live rows and not yet moved its
    cursor; the trainer steps on rows of that chunk meanwhile (preserving them first: they are at or
    above the cursor), and the write must overlay their preserved values."""
    model = Model()
    opt = OPTIMIZERS["adagrad"](model.parameters())
    store = make_store(str(tmp_path / "s"))
    ck = Checkpointer(store, model, opt, codec="fp32", mode="incremental")
    reached, go = threading.Event(), threading.Event()

    def hold(_name, start):
        if start == 3 * BLOCK:  # chunk 3 is read; its rows are not passed yet
            reached.set()
            assert go.wait(60)

    fs.pause_at("streamed_chunk_read", hold)
    try:
        pending = ck.save(0)
        saved = state_of(model, opt)
        assert reached.wait(60)
        in_chunk = torch.arange(3 * BLOCK, 3 * BLOCK + 32)
        step(model, opt, in_chunk)  # changes rows the writer has read but not passed
        go.set()
        version = pending.wait()
    finally:
        fs.pause_at("streamed_chunk_read", None)
    assert pending.report.preserved_bytes >= 32 * 2 * DIM * 4
    stored = store.read_table("emb", version)
    np.testing.assert_array_equal(stored, saved[0]["emb.weight"].numpy())
    assert not np.array_equal(stored[3 * BLOCK:3 * BLOCK + 32], model.emb.weight.detach().numpy()[3 * BLOCK:3 * BLOCK + 32])
    ck.close()
    assert_restores_to(store, version, saved, "adagrad", "incremental")
    store.close()


def test_training_at_full_speed_during_the_write_does_not_reach_the_baseline(tmp_path, small_chunks):
    rng = np.random.default_rng(1)
    model = Model()
    opt = OPTIMIZERS["adagrad"](model.parameters())
    store = make_store(str(tmp_path / "s"))
    ck = Checkpointer(store, model, opt, codec="fp32", mode="incremental")
    pending = ck.save(0)
    saved = state_of(model, opt)
    steps = 0
    while not pending.done() or steps < 5:
        step(model, opt, spread_ids(rng, n=256))
        steps += 1
    version = pending.wait()
    ck.close()
    assert pending.report.streamed == ["emb"]
    assert_restores_to(store, version, saved, "adagrad", "incremental")
    store.close()


def test_streaming_off_copies_the_tables_at_save(tmp_path):
    model = Model()
    opt = OPTIMIZERS["adagrad"](model.parameters())
    with cnrstore.open(str(tmp_path / "s"), create=True) as store:
        with Checkpointer(store, model, opt, stream_saves=False) as ck:
            p = ck.save(0)
            p.wait()
        assert p.report.streamed == [] and p.report.host_bytes >= 2 * ROWS * DIM * 4


def test_tables_that_change_outside_a_step_are_copied_at_save(tmp_path):
    """max_norm renormalizes looked-up rows inside the forward pass; weight decay changes every row; a
    weight no optimizer of the Checkpointer holds may change anywhere."""
    with cnrstore.open(str(tmp_path / "s"), create=True) as store:
        model = Model()
        model.emb.max_norm = 1.0
        with Checkpointer(store, model, torch.optim.Adagrad(model.parameters())) as ck:
            assert ck.save(0).report.streamed == []
    with cnrstore.open(str(tmp_path / "t"), create=True) as store:
        model = Model()
        with Checkpointer(store, model, torch.optim.Adagrad(model.parameters(), weight_decay=0.1)) as ck:
            assert ck.save(0).report.streamed == []
    with cnrstore.open(str(tmp_path / "u"), create=True) as store:
        model = Model()
        with Checkpointer(store, model, torch.optim.Adagrad(model.head.parameters())) as ck:
            assert ck.save(0).report.streamed == []


def test_a_failed_streamed_write_stops_preserving_and_the_next_save_is_a_baseline(tmp_path, monkeypatch):
    model = Model()
    opt = OPTIMIZERS["adagrad"](model.parameters())
    with cnrstore.open(str(tmp_path / "s"), create=True) as store:
        ck = Checkpointer(store, model, opt)
        real = store.checkpoint

        def broken(*a, **k):
            raise OSError("disk unplugged")

        monkeypatch.setattr(store, "checkpoint", broken)
        p = ck.save(0)
        with pytest.raises(OSError):
            p.wait()
        table = ck._tables[0]
        step(model, opt, torch.arange(10))
        assert table.open_streams() == []  # the closed stream is let go
        monkeypatch.setattr(store, "checkpoint", real)
        with pytest.raises(OSError):
            ck.save(1)  # the failure, raised once
        again = ck.save(2)
        assert again.report.baseline and again.report.streamed == ["emb"]
        again.wait()
        ck.close()


# -- durability: max_lag, durable_step, lag_s --------------------------------------------------------------

def test_max_lag_bounds_the_saves_not_yet_committed_when_save_returns(tmp_path, monkeypatch):
    model = Model(rows=64)
    opt = OPTIMIZERS["adagrad"](model.parameters())
    with cnrstore.open(str(tmp_path / "s"), create=True) as store:
        real, gate = store.checkpoint, threading.Event()

        def held(*a, **k):
            assert gate.wait(60)
            return real(*a, **k)

        monkeypatch.setattr(store, "checkpoint", held)
        ck = Checkpointer(store, model, opt, max_lag=2, max_queue_bytes=1 << 24)
        assert ck.durable_step is None
        first, second = ck.save(0), ck.save(1)
        got = {}
        third = threading.Thread(target=lambda: got.setdefault("p", ck.save(2)))
        third.start()
        time.sleep(0.3)
        assert third.is_alive() and not first.done()  # the third save waits: two are not committed yet
        gate.set()
        third.join(60)
        assert first.done()  # it returned once the oldest had committed
        assert ck.durable_step is not None and ck.durable_step >= 0
        got["p"].wait()
        assert ck.durable_step == 2 and ck.durable_version == got["p"].report.version
        assert got["p"].report.stall_s >= 0.25  # the wait counts as the save's stall
        assert first.report.lag_s >= 0.3 and second.report.lag_s > 0
        ck.close()
    with pytest.raises(cnrstore.InvalidArgument, match="max_lag"):
        Checkpointer(str(tmp_path / "x"), model, opt, max_lag=0)


# -- crashes ---------------------------------------------------------------------------------------------

def test_every_crash_state_of_a_streamed_baseline_recovers(tmp_path, monkeypatch):
    """The crash-state explorer over a streamed baseline, then a streamed increment, each written while
    training runs between its chunks:
    every prefix of its file effects, killed, powered off or torn, opens with the versions before it or
    after it, each reading bit for bit."""
    monkeypatch.setattr(knobs, "SEGMENT_BYTES", 4 << 10)
    monkeypatch.setattr(streamed, "CHUNK_BYTES", 1)
    rows, block = 512, 64
    path, base = str(tmp_path / "store"), str(tmp_path / "base")
    rng = np.random.default_rng(2)
    model = Model(rows=rows, dim=4)
    opt = torch.optim.Adagrad(model.parameters(), lr=0.1)
    with Store(path, create=True, readonly=False, filesystem=fs.DEFAULT) as store:
        store.create_table("emb", rows, 4, codec="fp32", block_rows=block)
        store.create_table("emb.optim.sum", rows, 4, codec="fp32", block_rows=block)
        with store.checkpoint() as w:
            w.put_rows("emb", np.arange(rows), np.zeros((rows, 4), np.float32))
    shutil.copytree(path, base)
    content = {1: {"emb": np.zeros((rows, 4), np.float32)}}
    with cs.RecordingFileSystem(path) as rec:
        store = Store(path, create=False, readonly=False, filesystem=rec)
        try:
            ck = Checkpointer(store, model, opt, codec="fp32")
            listed = lambda: frozenset(v.version for v in store.versions())  # noqa: E731
            for i, what in enumerate(["streamed baseline", "streamed increment"]):
                if i:
                    step(model, opt, spread_ids(rng, rows, 200))  # (the increment's rows: about a third)
                with Lockstep() as lock:
                    rec.op_start(what, listed())
                    pending = ck.save(i)
                    weights = model.emb.weight.detach().numpy().copy()
                    state = opt.state_dict()["state"][0]["sum"].numpy().copy()
                    lock.train_between_chunks(pending, lambda: step(model, opt, spread_ids(rng, rows, 32)))
                    version = pending.wait()
                    rec.op_end(listed())
                assert pending.report.streamed == ["emb"] and pending.report.baseline == (i == 0)
                assert lock.chunks == rows // block  # (every block holds rows of the increment too)
                content[version] = {"emb": weights, "emb.optim.sum": state}
            ck.close()
        finally:
            store.close()

    def write_more(s: Store) -> None:
        with s.checkpoint() as w:
            w.put_rows("emb", np.array([1, 300]), np.full((2, 4), 7.25, np.float32))
        np.testing.assert_array_equal(s.read_rows("emb", np.array([1, 300])), np.full((2, 4), 7.25, np.float32))

    work = str(tmp_path / "states")
    os.makedirs(work)
    sweep = cs.explore(base, rec.effects, content, work, write_more, initial=frozenset({1}))
    print(f"\nstreamed saves: {sweep.effects} effects, {sweep.states} distinct crash states {sweep.by_variant}")
    assert not sweep.failures, "\n".join(sweep.failures)
    assert sweep.states > 60  # (8 chunks of two tables per save, over 4 KiB segments)


KILLED_TRAINER = r"""
import os, signal, sys
import numpy as np, torch
from torch import nn
import cnrstore
from cnrstore.engine import fs
from cnrstore.torch import Checkpointer, streamed
streamed.CHUNK_BYTES = 1
path, out = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
model = nn.Sequential(nn.Embedding(4096, 8))
opt = torch.optim.Adagrad(model.parameters(), lr=0.1)
rng = np.random.default_rng(0)
def train():
    opt.zero_grad()
    model(torch.from_numpy(rng.choice(4096, 64, replace=False))).pow(2).sum().backward()
    opt.step()
store = cnrstore.open(path, create=True)
store.create_table("0", 4096, 8, codec="fp32", block_rows=256)
store.create_table("0.optim.sum", 4096, 8, codec="fp32", block_rows=256)
ck = Checkpointer(store, model, opt)
for i in range(3):  # a streamed baseline, then increments: all committed
    train()
    v = ck.save(i).wait()
    np.save(os.path.join(out, f"{v}.npy"), model[0].weight.detach().numpy())
chunks = []
def die(_name, *_d):
    chunks.append(1)
    if len(chunks) == 5:
        os.kill(os.getpid(), signal.SIGKILL)  # in the middle of the second baseline's write
ck2 = Checkpointer(store, model, opt, max_lag=None)  # a new Checkpointer: its first save is a baseline
fs.pause_at("streamed_chunk_written", die)
train()
p = ck2.save(3)
while True:
    train()
"""


def test_a_kill_in_the_middle_of_a_streamed_baseline_loses_nothing_committed(tmp_path):
    path, out = str(tmp_path / "s"), str(tmp_path / "out")
    os.makedirs(out)
    proc = subprocess.run([sys.executable, "-c", KILLED_TRAINER, path, out], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    committed = sorted(int(f[:-4]) for f in os.listdir(out))
    assert len(committed) == 3
    with cnrstore.open(path) as store:
        assert [v.version for v in store.versions()] == committed  # the torn baseline is not listed
        for v in committed:
            np.testing.assert_array_equal(store.read_table("0", v), np.load(os.path.join(out, f"{v}.npy")))
        assert store.verify().ok
        with store.checkpoint() as w:
            w.put_rows("0", np.array([5]), np.ones((1, 8), np.float32))


@pytest.mark.parametrize("baseline", [True, False])
def test_a_save_between_a_forward_pass_and_its_step_holds_the_state_before_the_step(tmp_path, small_chunks,
                                                                                    baseline):
    """The rows a forward pass looked up before save() change in the step after it: the step's hook must
    preserve them though the lookup came before the save opened its stream."""
    model = Model()
    opt = OPTIMIZERS["adagrad"](model.parameters())
    store = make_store(str(tmp_path / "s"))
    ck = Checkpointer(store, model, opt, codec="fp32", mode="incremental")
    if not baseline:
        step(model, opt, torch.arange(0, ROWS, 7))
        ck.save(0).wait()
        step(model, opt, torch.arange(0, ROWS, 7))  # (the increment then spans every block: many chunks)
    ids = torch.arange(ROWS - 64, ROWS)  # rows in the last chunk: the writer reaches them last
    with Lockstep() as lock:
        opt.zero_grad()
        (model(ids) ** 2).backward()  # the forward pass and its gradient ...
        pending = ck.save(1)  # ... then the save ...
        saved = state_of(model, opt)
        stepped = []
        lock.train_between_chunks(pending, lambda: stepped or stepped.append(opt.step()))  # ... then its step
    version = pending.wait()
    assert stepped and pending.report.streamed == ["emb"] and pending.report.baseline == baseline
    assert not torch.equal(model.emb.weight[ids], saved[0]["emb.weight"][ids])  # the step did change them
    ck.close()
    assert_restores_to(store, version, saved, "adagrad", "incremental")
    store.close()


def test_gradients_accumulated_before_a_save_are_preserved_by_the_step_after_it_and_in_the_next_increment(
        tmp_path, small_chunks):
    """Issue 48 fault 1: micro-batches accumulate gradients, a save comes between them and their step. The
    save streams; the step after it preserves every row its gradient changes (whatever looked them up, and
    however long ago), and the NEXT increment holds what that step changed (it used to miss those rows)."""
    model = Model()
    opt = OPTIMIZERS["adagrad"](model.parameters())
    store = make_store(str(tmp_path / "s"))
    ck = Checkpointer(store, model, opt, codec="fp32", mode="incremental")
    rng = np.random.default_rng(3)
    ck.save(0).wait()
    rows = spread_ids(rng, n=1024)
    step(model, opt, rows)  # (save 1 writes these rows: their step after it must not reach it)
    opt.zero_grad()
    for _ in range(300):  # more micro-batches than any bound on remembered lookups
        (model(rows[torch.from_numpy(rng.choice(1024, 8))]) ** 2).backward()
    with Lockstep() as lock:
        pending = ck.save(1)
        saved = state_of(model, opt)
        stepped = []
        lock.train_between_chunks(pending, lambda: stepped or stepped.append(opt.step()))
    v1 = pending.wait()
    assert stepped and pending.report.streamed == ["emb"]
    after_step = state_of(model, opt)
    v2 = ck.save(2).wait()  # the step's rows, changed after save(1): this increment must hold them
    ck.close()
    assert_restores_to(store, v1, saved, "adagrad", "incremental")
    assert_restores_to(store, v2, after_step, "adagrad", "incremental")
    store.close()
