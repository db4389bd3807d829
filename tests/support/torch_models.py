"""The small models, batches and data loader of test_torch_checkpointer.py, shared by the Checkpointer tests
(test_torch_staging, test_torch_priority, test_security) and by test_cuda.py, which runs the same checks on a
GPU."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

import cnrstore
from cnrstore.torch import Checkpointer


class TinyDLRM(nn.Module):
    def __init__(self, rows=(50, 40), dim=4, hidden=8):
        super().__init__()
        self.emb = nn.Embedding(rows[0], dim)
        self.bag = nn.EmbeddingBag(rows[1], dim, mode="sum")
        self.bottom = nn.Linear(3, dim)
        self.norm = nn.BatchNorm1d(dim)  # buffers: running stats, num_batches_tracked
        self.top = nn.Sequential(nn.Linear(3 * dim, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, dense, ids, bag_ids, offsets):
        x = self.norm(self.bottom(dense))
        return self.top(torch.cat([x, self.emb(ids), self.bag(bag_ids, offsets)], dim=1)).squeeze(1)


def batch(i, n=8):
    g = torch.Generator().manual_seed(1000 + i)
    dense = torch.randn(n, 3, generator=g)
    ids = torch.randint(0, 50, (n,), generator=g)
    bag_ids = torch.randint(0, 40, (2 * n,), generator=g)
    offsets = torch.arange(0, 2 * n, 2)
    y = torch.randint(0, 2, (n,), generator=g).float()
    return dense, ids, bag_ids, offsets, y


class Loader:
    """A data position with state_dict/load_state_dict, saved as `extra`."""

    def __init__(self):
        self.position = 0

    def next(self):
        b = batch(self.position)
        self.position += 1
        return b

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


def train_step(model, opt, b):
    device = next(model.parameters()).device  # (tests/test_cuda.py trains on a GPU)
    dense, ids, bag_ids, offsets, y = (x.to(device) for x in b)
    opt.zero_grad()
    loss = nn.functional.binary_cross_entropy_with_logits(model(dense, ids, bag_ids, offsets), y)
    loss.backward()
    opt.step()


def make(seed, optim="adagrad", device="cpu"):
    torch.manual_seed(seed)
    model = TinyDLRM().to(device)
    if optim == "adagrad":
        opt = torch.optim.Adagrad(model.parameters(), lr=0.1)
    elif optim == "adam":
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return model, opt


class Table(nn.Module):
    def __init__(self, rows=100, dim=3):
        super().__init__()
        self.emb = nn.Embedding(rows, dim)

    def forward(self, ids):
        return self.emb(ids)


class Position:
    """An `extra` object: a data loader's position (test_import, test_security)."""

    def __init__(self, pos=0):
        self.pos = pos

    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, sd):
        self.pos = sd["pos"]


def check_int4_restore(store, device="cpu") -> None:
    """An int4 save restores as the codec decodes the saved rows; dense parameters stay exact (tests/test_cuda.py
    runs it on a GPU)."""
    torch.manual_seed(0)
    model = TinyDLRM().to(device)
    ck = Checkpointer(store, model, codec="int4")
    saved = model.emb.weight.detach().cpu().numpy().copy()
    saved_bag = model.bag.weight.detach().cpu().numpy().copy()
    saved_dense = model.bottom.weight.detach().clone()
    ck.save(0).wait()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    ck.restore()
    codec = cnrstore.codecs.get("int4")
    np.testing.assert_array_equal(model.emb.weight.detach().cpu().numpy(), codec.decode(codec.encode(saved), 4))
    np.testing.assert_array_equal(model.bag.weight.detach().cpu().numpy(), codec.decode(codec.encode(saved_bag), 4))
    assert torch.equal(model.bottom.weight, saved_dense)  # dense parameters stay exact
    ck.close()


class ShardModel(nn.Module):
    """A one-rank job's model for tests of ``cnrstore.distributed``: an ``nn.EmbeddingBag`` (sum) per table of
    ``tables`` ({"emb.<name>": (rows, dim)}, the module ``emb.<name>``) and a dense ``lin``, seeded."""

    def __init__(self, tables, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.ModuleDict({k.split(".")[1]: nn.EmbeddingBag(n, d, mode="sum") for k, (n, d) in tables.items()})
        self.lin = nn.Linear(3, 1)
