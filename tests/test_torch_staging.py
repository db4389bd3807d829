"""cnrstore.torch.staging: a save's snapshot staged asynchronously, driven on CPU through the code path a
CUDA device takes (tests/test_cuda.py runs the real CUDA backend where a GPU is present).

``DeferredBackend`` keeps the CUDA backend's contract (cnrstore/torch/staging.py): the reads of the live
tensors happen when ``save()`` enqueues them (phase A: on a GPU, the trainer's next step is ordered after
them), and the copies into the host buffers land only when the handle is waited on (phase B). Until then
a host buffer holds poison (NaN, or a sentinel integer), so a writer that read a buffer before waiting
would store poison: the bit-exact restores below fail if the wait in ``async_save.write`` is removed.
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch

from cnrstore.errors import InvalidArgument
from cnrstore.torch import Checkpointer
from cnrstore.torch.staging import Staged, Stager

from support.torch_models import Loader, make, train_step
from support.torch_state import assert_state_equal

POISON_INT = -0x5A5A


def poison(t: torch.Tensor) -> None:
    t.fill_(float("nan") if t.dtype.is_floating_point else POISON_INT)


class DeferredBackend:
    """A staging backend on CPU that defers every copy into a host buffer until the handle's wait. ``gate``
    (a threading.Event), when given, holds each wait until it is set (a test keeps a save's write waiting).
    Counts the host buffers it makes and the waits."""

    def __init__(self, gate: threading.Event | None = None):
        self.gate = gate
        self.made: list[torch.Tensor] = []
        self.waits = 0
        self.landed = 0

    def host_empty(self, shape, dtype=torch.float32) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype)
        poison(t)
        self.made.append(t)
        return t

    def batch(self):
        return _DeferredBatch(self)


class _DeferredBatch:
    def __init__(self, backend: DeferredBackend):
        self.backend = backend
        self.later: list = []

    def gather(self, src, rows, out) -> None:
        snap = src.clone() if rows is None else src.index_select(0, rows)  # phase A: read now
        poison(out)  # the buffer's contents are undefined until the copy lands
        self.later.append((snap, out))

    def finish(self):
        backend, later = self.backend, self.later

        def wait():
            backend.waits += 1
            if backend.gate is not None:
                assert backend.gate.wait(30), "the test never opened the gate"
            for snap, out in later:  # phase B: land the copies
                out.copy_(snap)
            backend.landed += 1
        return wait


def gated(store, seed: int):
    """(gate, backend, model, optimizer, loader, Checkpointer): an incremental fp32 Checkpointer whose
    staged copies land only once ``gate`` is set."""
    gate = threading.Event()
    backend = DeferredBackend(gate)
    model, opt = make(seed, "adagrad")
    loader = Loader()
    # (a model this small is mostly payload: room in the queue for the saves a test holds at the gate)
    ck = Checkpointer(store, model, opt, codec="fp32", mode="incremental", extra={"loader": loader},
                      stager=Stager(backend), max_queue_bytes=1 << 24, max_lag=None)
    return gate, backend, model, opt, loader, ck


def snapshot(model, opt, loader):
    return copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()), loader.position


def assert_restores(ck, model, opt, loader, expected: dict) -> None:
    """Each version restores bit-exact to the state it was saved from."""
    for v, (want_model, want_opt, position) in expected.items():
        train_step(model, opt, loader.next())  # (something to undo)
        ck.restore(v)
        assert loader.position == position
        assert_state_equal(want_model, model.state_dict())
        assert_state_equal(want_opt, opt.state_dict())


@pytest.mark.parametrize("mode", ["incremental", "one-shot", "intermittent"])
@pytest.mark.parametrize("optim", ["adagrad", "adam"])
def test_the_writer_stores_the_staged_copies_bit_exact(store, optim, mode):
    backend = DeferredBackend()
    model, opt = make(0, optim)
    loader = Loader()
    ck = Checkpointer(store, model, opt, codec="fp32", mode=mode, extra={"loader": loader},
                      stager=Stager(backend))
    expected = {}
    for _ in range(4):
        for _ in range(2):
            train_step(model, opt, loader.next())
        pending = ck.save(step=loader.position)
        want = snapshot(model, opt, loader)
        train_step(model, opt, loader.next())  # the trainer goes on before the write has read anything
        loader.position -= 1
        v = pending.wait()
        expected[v] = want
    assert backend.waits == backend.landed == 4
    # the weights, the row-wise state and the dense layers all went through the backend
    assert any(t.shape == model.emb.weight.shape for t in backend.made)
    assert any(t.dtype == torch.int64 for t in backend.made)  # BatchNorm's num_batches_tracked
    assert_restores(ck, model, opt, loader, expected)
    ck.close()


def test_nothing_of_the_snapshot_is_read_before_the_copies_land(store):
    """The write of a save whose copies have not landed has written nothing; once they land it commits
    exactly the state at save()."""
    gate, backend, model, opt, loader, ck = gated(store, 1)
    train_step(model, opt, loader.next())
    pending = ck.save(step=1)
    want = snapshot(model, opt, loader)
    for _ in range(3):
        train_step(model, opt, loader.next())  # in-place writes of the weights after save()
    assert not pending.wait_done(0.3)
    assert store.versions() == [] and backend.landed == 0
    gate.set()
    v = pending.wait()
    loader.position = 0
    assert_restores(ck, model, opt, loader, {v: want})
    ck.close()


def test_host_buffers_are_reused_save_after_save(store):
    backend = DeferredBackend()
    model, opt = make(2, "adagrad")
    loader = Loader()
    ck = Checkpointer(store, model, opt, codec="fp32", mode="incremental", stager=Stager(backend))
    tables = {t.name: t for t in ck.trainer_state().tables}
    ptrs = None
    for i in range(5):
        train_step(model, opt, loader.next())
        ck.save(step=i).wait()
        now = {(name, key): buf.data_ptr() for name, t in tables.items() for key, buf in t.buffers.items()}
        assert set(now) >= {("emb", "emb"), ("emb", "emb.optim.sum"), ("bag", "bag"), ("bag", "bag.optim.sum")}
        if ptrs is not None:
            assert now == ptrs  # the baseline's buffers (the largest) serve every increment
        ptrs = now
    made = len(backend.made)
    train_step(model, opt, loader.next())
    ck.save(step=9).wait()
    # the next save makes host memory only for the dense arrays, none for the tables
    assert len(backend.made) - made == len(ck.trainer_state().dense)
    ck.close()


def test_a_queued_save_keeps_its_buffers_while_the_next_save_copies(store):
    """Save 1's write waits (its copies have not landed) while the trainer goes on and saves again: save 2
    gets buffers of its own, so nothing of save 1's snapshot is overwritten; both restore bit-exact."""
    gate, backend, model, opt, loader, ck = gated(store, 3)
    emb = ck.trainer_state().tables[0]
    train_step(model, opt, loader.next())
    first = ck.save(step=loader.position)
    want1 = snapshot(model, opt, loader)
    first_buf = emb.buffers["emb"]
    train_step(model, opt, loader.next())
    second = ck.save(step=loader.position)  # queued behind the first, whose write waits at the gate
    want2 = snapshot(model, opt, loader)
    assert emb.buffers["emb"] is first_buf and "emb" in emb.busy
    ptrs = [t.data_ptr() for t in backend.made if t.shape[1:] == (model.emb.weight.shape[1],)]
    assert len(set(ptrs)) == len(ptrs) >= 2  # the second save's rows went into another buffer
    train_step(model, opt, loader.next())
    assert not first.done() and not second.done()
    gate.set()
    v1, v2 = first.wait(), second.wait()
    loader.position = 0
    assert_restores(ck, model, opt, loader, {v1: want1, v2: want2})
    ck.close()


def test_a_failed_snapshot_lands_its_copies_before_lending_its_buffers(store, monkeypatch):
    backend = DeferredBackend()
    model, opt = make(4, "adagrad")
    ck = Checkpointer(store, model, opt, codec="fp32", stager=Stager(backend))
    train_step(model, opt, (torch.randn(8, 3), torch.arange(8), torch.arange(16), torch.arange(0, 16, 2),
                            torch.ones(8)))

    def boom(*a, **k):
        raise InvalidArgument("payload refused")
    monkeypatch.setattr(ck, "_state_blob", boom)
    with pytest.raises(InvalidArgument):
        ck.save(step=1)
    assert backend.waits == backend.landed == 1  # the copies enqueued before the failure landed
    assert not any(t.busy for t in ck.trainer_state().tables)
    monkeypatch.undo()
    ck.save(step=2).wait()
    ck.close()


def test_cpu_tables_keep_the_immediate_numpy_path(store):
    model, opt = make(5, "adagrad")
    ck = Checkpointer(store, model, opt, codec="fp32", stream_saves=False)  # (streamed saves copy nothing)
    assert ck.stager.backend(torch.device("cpu")) is None
    train_step(model, opt, (torch.randn(8, 3), torch.arange(8), torch.arange(16), torch.arange(0, 16, 2),
                            torch.ones(8)))
    ck.save(step=1).wait()  # (a baseline: streamed from the live tensors, no buffer)
    train_step(model, opt, (torch.randn(8, 3), torch.arange(8), torch.arange(16), torch.arange(0, 16, 2),
                            torch.ones(8)))
    ck.save(step=2).wait()  # an increment: its rows copied into the reused host buffers
    bufs = [b for t in ck.trainer_state().tables for b in t.buffers.values()]
    assert bufs and not any(b.is_pinned() for b in bufs if torch.cuda.is_available())
    ck.close()


def test_staged_wait_runs_each_wait_once_from_any_thread():
    calls = []
    staged = Staged([lambda: calls.append(1)])
    threads = [threading.Thread(target=staged.wait) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    staged.wait()
    assert calls == [1] and staged.landed()
    assert Staged().landed()


def test_stager_argument_is_checked(store):
    model, opt = make(6, "sgd")
    with pytest.raises(InvalidArgument, match="stager"):
        Checkpointer(store, model, opt, stager=object())


def test_the_cuda_backend_orders_the_trainers_stream_after_the_reads(monkeypatch):
    """CudaBackend's calls, with torch.cuda's streams and events replaced by recorders (CPU tensors do the
    copies): the side stream first waits for the current one; the event the current stream waits on is
    recorded after every read of a live tensor (the rows gathered, the whole tensor copied) and before the
    gathered rows are copied to the host; the handle's wait synchronizes on an event recorded after them;
    the sources and row indices are marked record_stream(side)."""
    import contextlib

    from cnrstore.torch.staging import CudaBackend

    log = []
    nan = float("nan")
    src = torch.arange(12.0).reshape(6, 2)
    rows = torch.tensor([4, 1])
    out_rows, out_whole = torch.full((2, 2), nan), torch.full((6, 2), nan)

    def landed():
        return (not out_rows.isnan().any().item(), not out_whole.isnan().any().item())

    class Stream:
        def __init__(self, name):
            self.name = name

        def wait_stream(self, other):
            log.append(("wait_stream", self.name, other.name))

        def wait_event(self, event):
            log.append(("wait_event", self.name, event.name))

    class Event:
        made = 0

        def __init__(self):
            Event.made += 1
            self.name = f"event{Event.made}"

        def record(self, stream):
            log.append(("record", stream.name, self.name, landed()))

        def synchronize(self):
            log.append(("synchronize", self.name))

    @contextlib.contextmanager
    def on(stream):
        log.append(("enter", stream.name))
        yield
        log.append(("exit", stream.name))

    current = Stream("current")
    monkeypatch.setattr(torch.Tensor, "record_stream",
                        lambda self, stream: log.append(("record_stream", stream.name, self.data_ptr())))
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: Stream("side"))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "stream", on)
    batch = CudaBackend(torch.device("cpu")).batch()
    batch.gather(src, rows, out_rows)
    batch.gather(src, None, out_whole)
    wait = batch.finish()
    src.add_(100.0)  # the trainer's next step (ordered after the reads on a GPU)
    wait()
    assert log[0] == ("wait_stream", "side", "current")
    records = [e for e in log if e[0] == "record"]
    assert [r[1] for r in records] == ["side", "side"]
    read, copied = records[0][2], records[1][2]
    assert records[0][3] == (False, True)   # at the read event: the whole copy done, the rows not yet on the host
    assert records[1][3] == (True, True)
    assert log.index(("wait_event", "current", read)) > log.index(records[0])
    assert log[-1] == ("synchronize", copied)
    assert torch.equal(out_rows, torch.tensor([[8.0, 9.0], [2.0, 3.0]]))
    assert torch.equal(out_whole, torch.arange(12.0).reshape(6, 2))
    # the tensors made on the trainer's stream and read on the side one are marked for the allocator
    marked = {e[2] for e in log if e[0] == "record_stream" and e[1] == "side"}
    assert {src.data_ptr(), rows.data_ptr()} <= marked
