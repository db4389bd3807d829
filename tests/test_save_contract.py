"""Issue 48: a checkpoint is the state at ``save()``, whatever the trainer does -- exact, or refused with a typed
error, never torn.

A trainer is drawn as a random interleaving of what real DLRM trainers do: forward/backward passes whose
gradients come from the module's lookups, from an L2 penalty on the table, from an output layer tied to the
table or from ``F.embedding`` on its weight (sampled negatives); micro-batches accumulated before a step; two
optimizers stepping around a save; ``step(closure)``; ``zero_grad``; in-place writes announced to the
Checkpointer (``changing``, ``reset_rows``) and not (``torch.no_grad()`` indexing, ``.data``); ``restore``;
and saves, whose background write is held at each chunk until the trainer lets it go on (so that training
runs *inside* a streamed write at every point of it), waiting for room or superseding the queued saves that
have not started (``on_backpressure``). At each ``save()`` the model's and the optimizers'
state is cloned; afterwards every committed version is restored into a fresh trainer and compared with its
clone bit for bit. A save may fail only with ``SaveRefused`` (and the ``SaveSkipped`` of the increments queued
behind it), and only when an unannounced write landed while that save was being written from the live
tensors. Mutations that drop the protection of one row, or one changed row of an increment, must fail it.
"""

from __future__ import annotations

import copy
import threading
import time

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings, strategies as st
from hypothesis.control import currently_in_test_context
from torch import nn
from torch.nn import functional as F

import cnrstore
from cnrstore.engine import fs
from cnrstore.errors import SaveRefused, SaveSkipped
from cnrstore.torch import Checkpointer, save_plan, streamed

from support.torch_state import bits

ROWS, DIM, BLOCK = 256, 4, 32


class TwoTables(nn.Module):
    """Two embedding tables and a head: ``emb`` (the one every gradient kind reaches) and ``bag``."""

    def __init__(self, sparse: bool):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(ROWS, DIM, sparse=sparse)
        self.bag = nn.EmbeddingBag(ROWS, DIM, mode="sum", sparse=sparse)
        self.head = nn.Linear(2 * DIM, 1)

    def forward(self, ids):
        return self.head(torch.cat([self.emb(ids), self.bag(ids.reshape(-1, 1))], 1)).sum()


TABLE_OPTIMIZERS = {
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.1),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),  # (steps move rows without gradients: copied at save)
}


def make_trainer(setup: dict):
    model = TwoTables(setup["sparse"])
    tables = [model.emb.weight, model.bag.weight]
    make = TABLE_OPTIMIZERS[setup["optimizer"]]
    if setup["split"]:  # two optimizers: the tables', and Adam on the head (a save may come between steps)
        opts = [make(tables), torch.optim.Adam(model.head.parameters(), lr=1e-3)]
    else:
        opts = [make(list(model.parameters()))]
    return model, opts


def note(what: str) -> None:
    """A statistic for ``--hypothesis-show-statistics`` (outside a hypothesis test: nothing)."""
    if currently_in_test_context():
        event(what)


def snapshot(model, opts):
    return copy.deepcopy(model.state_dict()), [copy.deepcopy(o.state_dict()) for o in opts]


def same(a, b) -> bool:
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


class Gate:
    """Holds the background write at each chunk it has written (pause point ``streamed_chunk_written``) until
    the trainer lets it go on (:meth:`advance`); opened wide while the trainer itself waits for the writer
    (``save()`` waiting for room, ``close()``/``restore()`` waiting for the queue)."""

    def __init__(self):
        self.cv = threading.Condition()
        self.permits = 0
        self.wide = False
        self.held = 0  # writers waiting at the gate

    def hook(self, *_detail):
        with self.cv:
            self.held += 1
            self.cv.notify_all()
            assert self.cv.wait_for(lambda: self.permits > 0 or self.wide, timeout=60), "the gate was never opened"
            if not self.wide:
                self.permits -= 1
            self.held -= 1
            self.cv.notify_all()

    def open_wide(self, *_detail):
        with self.cv:
            self.wide = True
            self.cv.notify_all()

    def narrow(self):
        with self.cv:
            self.wide = False

    def advance(self, n: int, idle) -> None:
        """Let the writer take ``n`` more chunks; return once it waits at the gate again or ``idle()``."""
        with self.cv:
            self.permits += n
            self.cv.notify_all()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with self.cv:
                if self.permits == 0 and self.held:
                    return
                self.cv.wait(0.005)
            if idle():
                with self.cv:
                    self.permits = 0
                return
        raise AssertionError("the writer neither reached the gate nor finished")

    def __enter__(self):
        fs.pause_at("streamed_chunk_written", self.hook)
        fs.pause_at("checkpointer_waits_for_room", self.open_wide)
        fs.pause_at("checkpointer_waits_for_save", self.open_wide)
        return self

    def __exit__(self, *exc):
        self.open_wide()
        for point in ("streamed_chunk_written", "checkpointer_waits_for_room", "checkpointer_waits_for_save"):
            fs.pause_at(point, None)


GRADIENTS = ("lookup", "l2", "tied", "f_embedding")
WRITES = ("changing", "reset_rows", "no_grad", "data")  # the first two are announced


def run_trainer(tmp_path, setup: dict, ops: list) -> list[str]:
    """Train by ``ops``, saving as they say; the problems found (empty: every version exact, every failure
    allowed)."""
    model, opts = make_trainer(setup)
    store = cnrstore.open(str(tmp_path), create=True,
                          options=cnrstore.Options(block_target_bytes=BLOCK * DIM * 4, min_block_rows=BLOCK))
    ck = Checkpointer(store, model, opts, mode=setup["mode"], stream_saves=setup["stream"],
                      on_backpressure=setup.get("backpressure", "wait"))
    clones: dict = {}         # save seq -> (state at save(), pending)
    unannounced: list = []    # save seqs in flight when an unannounced write landed
    problems: list[str] = []
    rng = np.random.default_rng(setup["seed"])
    seq = 0

    def in_flight() -> list:
        return [s for s, (_c, p) in clones.items() if not p.done()]

    def backward(kind: str, n: int):
        ids = torch.from_numpy(rng.integers(0, ROWS, n))
        loss = model(ids)
        if kind == "l2":
            loss = loss + 1e-2 * model.emb.weight.pow(2).sum()
        elif kind == "tied":
            loss = loss + (model.emb(ids) @ model.emb.weight.t()).logsumexp(1).sum()
        elif kind == "f_embedding":
            loss = loss + F.embedding(torch.from_numpy(rng.integers(0, ROWS, n)), model.emb.weight).sum()
        loss.backward()

    def write(how: str, n: int):
        rows = torch.from_numpy(np.unique(rng.integers(0, ROWS, n)))
        if how == "changing":
            with ck.changing("emb", rows):
                model.emb.weight.data[rows] += 0.5
        elif how == "reset_rows":
            ck.reset_rows(model.bag, rows, torch.full((rows.numel(), DIM), 0.25))
        else:
            unannounced.extend(in_flight())
            if how == "no_grad":
                with torch.no_grad():
                    model.bag.weight[rows] *= 0.5
            else:
                model.emb.weight.data[rows] -= 0.125

    with Gate() as gate:
        idle = lambda: not in_flight()  # noqa: E731
        for op, arg in ops:
            gate.narrow()
            if op == "backward":
                backward(*arg)
            elif op == "step":
                for i in ([0, 1] if arg == "both" else [int(arg)]):
                    if i < len(opts):
                        opts[i].step()
            elif op == "closure":
                kind, n = arg

                def closure():
                    for o in opts:
                        o.zero_grad()
                    backward(kind, n)
                    return 0.0

                for o in opts:
                    o.step(closure)
            elif op == "zero_grad":
                for o in opts:
                    o.zero_grad()
            elif op == "write":
                write(*arg)
            elif op == "advance":
                gate.advance(arg, idle)
            elif op == "save":
                state = snapshot(model, opts)
                try:
                    pending = ck.save(seq)
                except (SaveRefused, SaveSkipped):  # an earlier save's refusal, raised once: no snapshot
                    continue
                clones[seq] = (state, pending)
                seq += 1
            elif op == "restore":
                try:
                    info = ck.restore()
                except (SaveRefused, SaveSkipped):
                    continue  # (raised by the wait for the queue; the next restore reads the newest)
                if info is not None and not same(snapshot(model, opts), clones[info.step][0]):
                    problems.append(f"restore of the newest version (step {info.step}) is not its save's state")
        gate.open_wide()
        try:
            ck.close()
        except (SaveRefused, SaveSkipped):
            pass
    for s, (state, pending) in clones.items():
        err = pending.failure()
        if pending.report.streamed:
            note("a streamed save")
        if pending.report.preserved_bytes:
            note("rows preserved while a save was written")
        if err is None:
            continue
        note(f"a save failed: {type(err).__name__}")
        if isinstance(err, SaveRefused) and s not in unannounced:
            problems.append(f"save {s} was refused though nothing unannounced wrote during it: {err}")
        elif not isinstance(err, (SaveRefused, SaveSkipped)):
            problems.append(f"save {s} failed: {type(err).__name__}: {err}")
    for info in store.versions():
        fresh, fresh_opts = make_trainer(setup)
        with torch.no_grad():
            for p in fresh.parameters():
                p.fill_(7.0)  # nothing of it may survive
        with Checkpointer(store, fresh, fresh_opts) as reader:
            reader.restore(info.version)
        if not same(snapshot(fresh, fresh_opts), clones[info.step][0]):
            problems.append(f"version {info.version} (save {info.step}) is not the state at its save()")
    store.close()
    return problems


SUPPORTED_OPS = st.one_of(
    st.tuples(st.just("backward"), st.tuples(st.sampled_from(GRADIENTS), st.integers(1, 64))),
    st.tuples(st.just("step"), st.sampled_from(["0", "1", "both"])),
    st.tuples(st.just("closure"), st.tuples(st.sampled_from(GRADIENTS), st.integers(1, 64))),
    st.tuples(st.just("zero_grad"), st.none()),
    st.tuples(st.just("write"), st.tuples(st.sampled_from(WRITES[:2]), st.integers(1, 64))),
    st.tuples(st.just("advance"), st.integers(1, 4)),
    st.tuples(st.just("save"), st.none()),
    st.tuples(st.just("restore"), st.none()),
)
ANY_OPS = st.one_of(SUPPORTED_OPS,
                    st.tuples(st.just("write"), st.tuples(st.sampled_from(WRITES[2:]), st.integers(1, 64))))
SETUPS = st.fixed_dictionaries({
    "mode": st.sampled_from(["incremental", "one-shot", "intermittent"]),
    "stream": st.booleans(),
    "sparse": st.booleans(),
    "optimizer": st.sampled_from(list(TABLE_OPTIMIZERS)),
    "split": st.booleans(),
    "backpressure": st.sampled_from(["wait", "coalesce"]),
    "seed": st.integers(0, 2**16),
}).filter(lambda s: not (s["sparse"] and s["optimizer"] == "adam"))  # (Adam takes no sparse gradient)


def trainer_program(ops):
    """A trainer's program: some training first (so that state exists), then ``ops``, ending with a save."""
    return st.lists(ops, min_size=4, max_size=22).map(
        lambda xs: [("backward", ("lookup", 32)), ("step", "both"), ("save", None)] + xs + [("save", None)])


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(streamed, "CHUNK_BYTES", 1)  # one block per chunk: the gate holds the writer often


#: the profile's number of examples (30 in dev and ci, 500 in deep), each a trainer of a few dozen operations
CONTRACT = settings(deadline=None, suppress_health_check=list(HealthCheck))


@CONTRACT
@given(setup=SETUPS, ops=trainer_program(SUPPORTED_OPS))
def test_every_version_is_the_state_at_save_for_supported_trainer_code(tmp_path_factory, small_chunks, setup, ops):
    problems = run_trainer(tmp_path_factory.mktemp("s"), setup, ops)
    assert not problems, (setup, ops, problems)


@CONTRACT
@given(setup=SETUPS, ops=trainer_program(ANY_OPS))
def test_unannounced_writes_give_exact_versions_or_a_refusal_never_a_torn_one(tmp_path_factory, small_chunks,
                                                                              setup, ops):
    problems = run_trainer(tmp_path_factory.mktemp("s"), setup, ops)
    assert not problems, (setup, ops, problems)


# -- mutations: the property must catch each ------------------------------------------------------------------

STREAMING = {"mode": "incremental", "stream": True, "sparse": True, "optimizer": "adagrad", "split": True,
             "seed": 1}
#: a streamed baseline, trained through at every chunk of its write, then an increment trained through too
THROUGH_A_WRITE = [("backward", ("lookup", 64)), ("step", "both"), ("save", None)] + [
    ("backward", ("lookup", 64)), ("step", "0"), ("advance", 1)] * 6 + [
    ("backward", ("lookup", 64)), ("step", "both"), ("save", None)] + [
    ("backward", ("tied", 16)), ("step", "0"), ("advance", 1)] * 4 + [("save", None)]


def test_dropping_the_protection_of_one_row_fails_the_property(tmp_path, small_chunks, monkeypatch):
    real = streamed.StreamedTable.preserve

    def preserve_all_but_one(self, ids):
        flat = ids.reshape(-1)
        real(self, flat[flat != flat.max()] if flat.numel() else flat)

    assert not run_trainer(tmp_path / "a", STREAMING, THROUGH_A_WRITE)
    monkeypatch.setattr(streamed.StreamedTable, "preserve", preserve_all_but_one)
    problems = run_trainer(tmp_path / "b", STREAMING, THROUGH_A_WRITE)
    assert any("refused though nothing unannounced" in p for p in problems), problems


def test_without_the_writers_check_a_dropped_protection_is_a_torn_version_the_property_finds(tmp_path, small_chunks,
                                                                                           monkeypatch):
    real = streamed.StreamedTable.preserve

    def preserve_all_but_one(self, ids):
        flat = ids.reshape(-1)
        real(self, flat[flat != flat.max()] if flat.numel() else flat)

    monkeypatch.setattr(streamed.StreamedTable, "preserve", preserve_all_but_one)
    monkeypatch.setattr(streamed.StreamedTable, "check", lambda *a, **k: None)
    problems = run_trainer(tmp_path, STREAMING, THROUGH_A_WRITE)
    assert any("is not the state at its save()" in p for p in problems), problems


def test_dropping_one_changed_row_from_an_increment_fails_the_property(tmp_path, monkeypatch):
    real = save_plan.SavePlanner._changed

    def changed_but_one(self, t, now):
        mask = real(self, t, now)
        hit = mask.nonzero()
        if t.saved is not None and hit.numel():
            mask[hit[-1]] = False
        return mask

    copied = {**STREAMING, "stream": False}
    program = [("backward", ("lookup", 64)), ("step", "both"), ("save", None),
               ("backward", ("l2", 8)), ("step", "0"), ("save", None)]
    assert not run_trainer(tmp_path / "a", copied, program)
    monkeypatch.setattr(save_plan.SavePlanner, "_changed", changed_but_one)
    problems = run_trainer(tmp_path / "b", copied, program)
    assert any("is not the state at its save()" in p for p in problems), problems


def test_without_the_closure_hook_a_closures_gradients_go_unprotected(tmp_path, small_chunks, monkeypatch):
    from cnrstore.torch import guard
    monkeypatch.setattr(guard.StepGuard, "_gradient_hook", lambda self, ref: (lambda grad: None))
    program = [("backward", ("lookup", 64)), ("step", "both"), ("save", None)] + [
        ("closure", ("lookup", 64)), ("advance", 1)] * 6 + [("save", None)]
    problems = run_trainer(tmp_path, STREAMING, program)
    assert any("refused though nothing unannounced" in p for p in problems), problems
