"""Checkpointer partial saves are exact with every optimizer (issue 11, item 14): optimizers that change
rows a step did not look up (momentum, weight decay, Adam's moments, RMSprop's averages) get those rows
written too; optimizers that do not (plain SGD, Adagrad, SparseAdam) keep writing only looked-up rows."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

from support.torch_state import assert_same_state

import cnrstore
from cnrstore.torch import Checkpointer

ROWS, DIM = 64, 4

OPTIMIZERS = {
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "sgd_weight_decay": lambda p: torch.optim.SGD(p, lr=0.1, weight_decay=0.01),
    "adam": lambda p: torch.optim.Adam(p, lr=0.01),
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.01),  # weight_decay=0.01 by default
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=0.01),
    "adadelta": lambda p: torch.optim.Adadelta(p, lr=0.5),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1),  # the control: exact with looked-up rows
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1),  # control
}
EXACT_ALREADY = {"adagrad", "sgd"}


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(ROWS, DIM)
        self.head = nn.Linear(DIM, 1)

    def forward(self, ids):
        return self.head(self.emb(ids)).sum()


def _step(model, opt, i):
    ids = torch.arange(4 * i, 4 * i + 4) % ROWS  # each step looks up other rows
    opt.zero_grad()
    (model(ids) ** 2).backward()
    opt.step()


@pytest.mark.parametrize("mode", ["incremental", "one-shot", "intermittent"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_partial_saves_restore_weights_and_optimizer_state_bit_exactly(tmp_path, name, mode):
    path = str(tmp_path / "store")
    model = Model()
    opt = OPTIMIZERS[name](model.parameters())
    copies, reports = {}, []
    with cnrstore.open(path, create=True) as store:
        ck = Checkpointer(store, model, opt, codec="fp32", mode=mode)
        for i in range(6):
            _step(model, opt, i)
            pending = ck.save(step=i)
            v = pending.wait()
            copies[v] = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()))
            reports.append(pending.report)
        ck.close()
        if name in ("sgd_weight_decay", "adamw") and mode == "intermittent":
            assert all(r.baseline for r in reports)  # every row changes: the reset rule makes baselines
        else:
            assert not all(r.baseline for r in reports)  # partial saves happened
        for v, (saved_model, saved_opt) in copies.items():
            fresh = Model()
            with torch.no_grad():
                fresh.emb.weight.fill_(7.0)  # nothing of it may survive the restore
            fresh_opt = OPTIMIZERS[name](fresh.parameters())
            with Checkpointer(store, fresh, fresh_opt, codec="fp32", mode=mode) as ck2:
                ck2.restore(v)
            assert_same_state(fresh, fresh_opt, saved_model, saved_opt)
    if name in EXACT_ALREADY and mode == "incremental":  # the controls stay incremental: 4 rows a save
        assert [r.rows["emb"] for r in reports if not r.baseline] == [4] * 5


def test_drifting_optimizers_write_more_than_the_looked_up_rows_and_only_what_changed(tmp_path):
    """SGD with momentum: the rows with a non-zero momentum buffer move every step; rows never looked up
    keep a zero buffer and are not written."""
    model = Model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with cnrstore.open(str(tmp_path / "s"), create=True) as store:
        with Checkpointer(store, model, opt, codec="fp32", mode="incremental") as ck:
            _step(model, opt, 0)
            ck.save(step=0).wait()  # baseline
            written = []
            for i in range(1, 4):
                _step(model, opt, i)
                p = ck.save(step=i)
                p.wait()
                written.append(p.report.rows["emb"])
    assert written == [8, 12, 16]  # rows 0..4i+3: every row looked up so far, never the others


def test_weight_decay_writes_every_row_and_unknown_optimizers_are_treated_as_changing_every_row(tmp_path):
    class Custom(torch.optim.Optimizer):  # cnrstore cannot know which rows this one changes
        def __init__(self, params):
            super().__init__(params, {"lr": 0.1})

        @torch.no_grad()
        def step(self):
            for g in self.param_groups:
                for p in g["params"]:
                    p.mul_(0.99)  # decays every row, looked up or not

    for make in (lambda p: torch.optim.Adagrad(p, lr=0.1, weight_decay=0.1), Custom):
        model = Model()
        opt = make(model.parameters())
        with cnrstore.open(str(tmp_path / f"s{id(make)}"), create=True) as store:
            with Checkpointer(store, model, opt, codec="fp32", mode="incremental") as ck:
                _step(model, opt, 0)
                ck.save(step=0).wait()
                _step(model, opt, 1)
                pending = ck.save(step=1)
                pending.wait()
                assert not pending.report.baseline and pending.report.rows["emb"] == ROWS
                assert np.array_equal(store.read_table("emb"), model.emb.weight.detach().numpy())


# --- bad arguments and sizes fail in save(), not in the background write ----------------------------------

def test_save_with_a_step_the_store_cannot_hold_fails_at_once_and_the_next_save_stays_partial(tmp_path):
    model = Model()
    opt = torch.optim.Adagrad(model.parameters(), lr=0.1)
    with cnrstore.open(str(tmp_path / "s"), create=True) as store:
        with Checkpointer(store, model, opt, codec="fp32", mode="incremental") as ck:
            _step(model, opt, 0)
            ck.save(step=0).wait()
            _step(model, opt, 1)
            with pytest.raises(cnrstore.InvalidArgument, match="step"):
                ck.save(step=2**64)
            pending = ck.save(step=1)
            pending.wait()
            assert not pending.report.baseline and pending.report.rows["emb"] == 4
        assert [v.step for v in store.versions()] == [0, 1]


def test_save_refuses_dense_state_beyond_one_record_before_the_background_write(tmp_path, monkeypatch):
    from cnrstore.engine import arguments

    class Wide(Model):
        def __init__(self):
            super().__init__()
            self.wide = nn.Linear(DIM, 250)  # 4000 bytes of weight

        def forward(self, ids):
            return self.wide(self.emb(ids)).sum()

    model = Wide()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    with cnrstore.open(str(tmp_path / "s"), create=True) as store:
        with Checkpointer(store, model, opt, codec="fp32", mode="incremental") as ck:
            _step(model, opt, 0)
            monkeypatch.setattr(arguments, "max_dense_bytes", lambda: 3000)
            with pytest.raises(cnrstore.InvalidArgument, match="'wide.weight' is 4,000 bytes.*nn.Embedding"):
                ck.save(step=0)
            blob_limit = 12_000  # the parameters fit; Adam's moments of `wide` (8 KB) in the blob do not
            monkeypatch.setattr(arguments, "max_dense_bytes", lambda: blob_limit)
            with pytest.raises(cnrstore.InvalidArgument, match="optimizer state outside the embedding tables"):
                ck.save(step=0)
            monkeypatch.undo()
            ck.save(step=0).wait()  # nothing failed in the background: the next save just works
        assert len(store.versions()) == 1


@pytest.mark.parametrize("mode", ["incremental", "one-shot", "intermittent"])
@pytest.mark.parametrize("name", ["adam", "sgd_momentum", "adagrad"])
def test_queued_saves_restore_bit_exactly(tmp_path, name, mode, monkeypatch):
    """Saves taken while earlier ones are still writing (issue 23: they queue instead of waiting): every
    version still restores to the exact state at its save() call."""
    import threading
    model = Model()
    opt = OPTIMIZERS[name](model.parameters())
    copies, pendings = [], []
    with cnrstore.open(str(tmp_path / "store"), create=True) as store:
        real, release = store.checkpoint, threading.Event()

        def held(*a, **k):  # every write waits until all six saves are taken
            release.wait(30)
            return real(*a, **k)

        monkeypatch.setattr(store, "checkpoint", held)
        ck = Checkpointer(store, model, opt, codec="fp32", mode=mode, max_queue_bytes=1 << 24, max_lag=None)
        for i in range(6):
            _step(model, opt, i)
            pendings.append(ck.save(step=i))
            copies.append((copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())))
        assert not any(p.done() for p in pendings)  # all queued behind the first
        release.set()
        versions = [p.wait() for p in pendings]
        assert versions == sorted(versions)
        ck.close()
        assert not all(p.report.baseline for p in pendings[1:]) or mode == "intermittent"
        for v, (saved_model, saved_opt) in zip(versions, copies):
            fresh = Model()
            with torch.no_grad():
                fresh.emb.weight.fill_(7.0)
            fresh_opt = OPTIMIZERS[name](fresh.parameters())
            with Checkpointer(store, fresh, fresh_opt, codec="fp32", mode=mode) as ck2:
                ck2.restore(v)
            assert_same_state(fresh, fresh_opt, saved_model, saved_opt)
