"""``cnrstore import`` takes the layouts DCP and trainers use: DCP's ``{"app": AppState(model, optimizer)}``
(optimizer state keyed by parameter name, from ``get_state_dict``), and a flat ``{"model", "optim", "step",
...}`` (``optimizer.state_dict()``, keyed by position) with the optimizer state carried across when the model
names its parameters, refused with a reason the user can act on when it cannot; a trainer's scalar entries go
into the version's meta. A Checkpointer then restores model and optimizer bit for bit."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import cnrstore
from cnrstore.cli import main
from cnrstore.errors import InvalidArgument
from cnrstore.torch import Checkpointer, import_checkpoint


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.EmbeddingBag(500, 8, mode="sum")
        self.top = nn.Linear(8, 1)

    def forward(self, x):
        return self.top(self.emb(x))


def trained():
    torch.manual_seed(0)
    m = Model()
    opt = torch.optim.Adam(m.parameters())
    for _ in range(3):
        m(torch.randint(0, 500, (16, 3))).sum().backward()
        opt.step()
        opt.zero_grad()
    return m, opt


def restored(path, make_opt=lambda m: torch.optim.Adam(m.parameters())):
    torch.manual_seed(1)
    m = Model()
    opt = make_opt(m)
    with Checkpointer(cnrstore.open(path), m, opt) as ck:
        info = ck.restore()
    return m, opt, info


def assert_same(m0, o0, m1, o1):
    for (k, a), (_, b) in zip(m0.state_dict().items(), m1.state_dict().items()):
        assert torch.equal(a, b), k
    s0, s1 = o0.state_dict()["state"], o1.state_dict()["state"]
    assert s0.keys() == s1.keys()
    for i in s0:
        for k in s0[i]:
            assert torch.equal(torch.as_tensor(s0[i][k]), torch.as_tensor(s1[i][k])), (i, k)


def dcp_app(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.checkpoint.stateful import Stateful

    m, opt = trained()

    class AppState(Stateful):
        def state_dict(self):
            msd, osd = get_state_dict(m, opt)
            return {"model": msd, "optim": osd}

        def load_state_dict(self, sd):
            raise NotImplementedError

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"app": AppState()}, checkpoint_id=str(tmp_path / "dcp"))
    return m, opt


def test_dcps_app_layout_imports_model_and_optimizer_from_the_command_line(tmp_path):
    m, opt = dcp_app(tmp_path)
    assert main(["import", str(tmp_path / "store"), str(tmp_path / "dcp")]) == 0
    m1, o1, _ = restored(tmp_path / "store")
    assert_same(m, opt, m1, o1)


def test_a_flat_checkpoint_with_a_positional_optimizer_carries_it_with_the_model(tmp_path):
    m, opt = trained()
    torch.save({"model": m.state_dict(), "optim": opt.state_dict(), "step": 30, "epoch": 2}, tmp_path / "ck.pt")
    report = import_checkpoint(tmp_path / "store", str(tmp_path / "ck.pt"), model=Model())
    assert report.optimizers == 1 and report.step == 30
    m1, o1, info = restored(tmp_path / "store")
    assert_same(m, opt, m1, o1)
    assert info.step == 30 and info.meta["epoch"] == 2


def test_a_positional_optimizer_the_model_cannot_name_is_refused_with_what_to_pass(tmp_path, capsys):
    m, _ = trained()
    sub = torch.optim.Adam([m.top.weight, m.top.bias, m.emb.weight])  # not model.parameters()' order
    m(torch.randint(0, 500, (4, 3))).sum().backward()
    sub.step()
    torch.save({"model": m.state_dict(), "optim": sub.state_dict(), "step": 3}, tmp_path / "ck.pt")
    assert main(["import", str(tmp_path / "s1"), str(tmp_path / "ck.pt")]) == 2
    assert "keyed by position" in capsys.readouterr().err
    with pytest.raises(InvalidArgument, match="not made with model.parameters"):
        import_checkpoint(tmp_path / "s2", str(tmp_path / "ck.pt"), model=Model())
    model = Model()
    ordered = torch.optim.Adam([model.top.weight, model.top.bias, model.emb.weight])
    import_checkpoint(tmp_path / "s3", str(tmp_path / "ck.pt"), model=model, optimizer=ordered)
    m1, o1, _ = restored(tmp_path / "s3", lambda mm: torch.optim.Adam([mm.top.weight, mm.top.bias, mm.emb.weight]))
    assert_same(m, sub, m1, o1)
