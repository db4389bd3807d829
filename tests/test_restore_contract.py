"""Checkpointer.restore is all or nothing, and can be asked for less: each kind of mismatch between a stored
version and the live objects raises a typed error naming it, with every live tensor (weights, optimizer state,
extra state) bit-identical afterwards; ``only=`` loads a part; ``strict=False`` loads what matches a changed
model and reports the rest; an empty store restores nothing (None)."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from torch import nn

import cnrstore
from cnrstore.errors import CorruptionError, InvalidArgument
from cnrstore.torch import Checkpointer

from support.torch_state import assert_state_equal


class Model(nn.Module):
    def __init__(self, tables=("e1", "e2"), rows=300, dim=8, dense=True):
        super().__init__()
        self.emb = nn.ModuleDict({n: nn.EmbeddingBag(rows, dim, sparse=True, mode="sum") for n in tables})
        self.top = nn.Linear(dim * len(tables), 1) if dense else None
        self.tables = tables

    def forward(self, ids):
        out = torch.cat([self.emb[n](ids) for n in self.tables], 1)
        return out if self.top is None else self.top(out)


class Counter:
    def __init__(self, n=0, fail=False):
        self.n, self.fail = n, fail

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, sd):
        if self.fail:
            raise RuntimeError("this counter refuses to load")
        self.n = sd["n"]


def optimizers(model, sparse="adagrad", groups=1):
    params = [m.weight for m in model.emb.values()]
    if sparse == "adagrad":
        s = torch.optim.Adagrad(params, lr=0.1)
    else:
        s = torch.optim.SparseAdam(params, lr=0.1)
    opts = [s]
    if model.top is not None:
        dense = list(model.top.parameters())
        opts.append(torch.optim.Adam(dense if groups == 1 else [{"params": dense[:1]}, {"params": dense[1:]}]))
    return opts


def train(model, opts, steps=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        model(torch.randint(0, 300, (32, 3), generator=g)).sum().backward()
        for o in opts:
            o.step()
            o.zero_grad()


def saved(tmp_path, **kwargs):
    """A store with two versions of a trained Model (its model, optimizers and a Counter saved as extra)."""
    model = Model(**kwargs)
    opts = optimizers(model)
    counter = Counter(5)
    with Checkpointer(tmp_path / "store", model, opts, codec="fp32", mode="incremental",
                      extra={"counter": counter}) as ck:
        train(model, opts)
        ck.save(1)
        train(model, opts, seed=1)
        ck.save(2)
    return model, opts, counter


def live_state(model, opts, extra):
    return (copy.deepcopy(model.state_dict()), [copy.deepcopy(o.state_dict()) for o in opts],
            {k: copy.deepcopy(v.state_dict()) for k, v in extra.items()})


def fresh(model_kwargs=None, sparse="adagrad", groups=1, extra=None, seed=7):
    torch.manual_seed(seed)
    model = Model(**(model_kwargs or {}))
    opts = optimizers(model, sparse, groups)
    train(model, opts, steps=1, seed=9)  # optimizer state exists: it must survive a refused restore
    return model, opts, extra if extra is not None else {"counter": Counter(1)}


MISMATCHES = {
    "one-table-fewer": (dict(model_kwargs={"tables": ("e1",)}), "table"),
    "one-table-more": (dict(model_kwargs={"tables": ("e1", "e2", "e3")}), "table"),
    "adagrad-into-sparse-adam": (dict(sparse="adam"), "Adagrad"),
    "adam-one-group-into-two": (dict(groups=2), "parameter group"),
    "extra-missing": (dict(extra={}), "extra"),
    "extra-beyond": (dict(extra={"counter": Counter(1), "other": Counter(2)}), "extra"),
    "dense-beyond": (dict(model_kwargs={"dense": False}), "dense"),
    "extra-refuses-to-load": (dict(extra={"counter": Counter(1, fail=True)}), "refuses"),
}


@pytest.mark.parametrize("case", sorted(MISMATCHES))
def test_a_mismatch_raises_naming_it_and_changes_nothing(tmp_path, case):
    saved(tmp_path)
    kwargs, words = MISMATCHES[case]
    model, opts, extra = fresh(**kwargs)
    if case == "dense-beyond":  # (the stored version has a dense part; this model has none and one optimizer)
        pass
    before = live_state(model, opts, extra)
    with Checkpointer(tmp_path / "store", model, opts, codec="fp32", mode="incremental", extra=extra) as ck:
        with pytest.raises(InvalidArgument, match=words):
            ck.restore()
    assert_state_equal(before, live_state(model, opts, extra))


def test_a_damaged_record_changes_nothing(tmp_path):
    saved(tmp_path)
    store_dir = tmp_path / "store" / "segments"
    for name in sorted(os.listdir(store_dir)):  # a byte of every segment flipped past its header
        path = store_dir / name
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    model, opts, extra = fresh()
    before = live_state(model, opts, extra)
    with Checkpointer(cnrstore.open(tmp_path / "store", readonly=True), model, opts, codec="fp32",
                      extra=extra) as ck:
        with pytest.raises(CorruptionError):
            ck.restore()
    assert_state_equal(before, live_state(model, opts, extra))


def test_only_the_model(tmp_path):
    model0, _opts0, _c = saved(tmp_path)
    model, opts, extra = fresh(extra={})  # no extra, no matching optimizers needed
    opt_before = [copy.deepcopy(o.state_dict()) for o in opts]
    with Checkpointer(tmp_path / "store", model, opts, codec="fp32", extra=extra) as ck:
        info = ck.restore(only="model")
        assert info.version == 2 and ck.last_restore.restored == ["emb.e1", "emb.e2", "top.bias", "top.weight"]
    assert_state_equal(model0.state_dict(), model.state_dict())
    assert_state_equal(opt_before, [o.state_dict() for o in opts])  # the optimizers as they were


def test_only_named_tables_and_extra(tmp_path):
    model0, _o, _c = saved(tmp_path)
    model, opts, extra = fresh()
    before = live_state(model, opts, extra)
    with Checkpointer(tmp_path / "store", model, opts, codec="fp32", extra=extra) as ck:
        ck.restore(only=["emb.e2", "counter"])
    assert torch.equal(model.emb["e2"].weight, model0.emb["e2"].weight)
    assert torch.equal(model.emb["e1"].weight, before[0]["emb.e1.weight"])
    assert extra["counter"].n == 5
    with Checkpointer(tmp_path / "store", model, opts, codec="fp32", extra=extra) as ck:
        with pytest.raises(InvalidArgument, match="names nothing"):
            ck.restore(only=["nope"])


def test_strict_false_loads_what_matches_a_changed_model_and_reports_the_rest(tmp_path):
    model0, opts0, _c = saved(tmp_path)
    model, opts, extra = fresh(model_kwargs={"tables": ("e1", "e3")})  # e2 gone, e3 new: the dense part resized too
    e3_before = model.emb["e3"].weight.detach().clone()
    with Checkpointer(tmp_path / "store", model, opts, codec="fp32", extra=extra) as ck:
        ck.restore(strict=False)
        report = ck.last_restore
    assert torch.equal(model.emb["e1"].weight, model0.emb["e1"].weight)
    assert torch.equal(model.emb["e3"].weight, e3_before)
    assert "emb.e3" in report.missing and "emb.e2" in report.unexpected
    # Adagrad's state follows the parameters by name: e1's is the stored one, e3 keeps its own
    stored_sum = opts0[0].state[model0.emb["e1"].weight]["sum"]
    assert torch.equal(opts[0].state[model.emb["e1"].weight]["sum"], stored_sum)
    train(model, opts, steps=1)  # and training goes on


def test_an_empty_store_restores_nothing(tmp_path):
    model, opts, extra = fresh()
    before = live_state(model, opts, extra)
    with Checkpointer(tmp_path / "store", model, opts, codec="fp32", extra=extra) as ck:
        assert ck.restore() is None
    assert_state_equal(before, live_state(model, opts, extra))
