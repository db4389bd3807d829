"""KeyedEmbedding (cnrstore/torch/keyed_embedding.py) and its saves through the Checkpointer as keyed tables
(keyed_save.py): admission and eviction, resumes bit for bit, rows changed without a lookup, bytes per save."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import cnrstore
from cnrstore.engine.record import HEADER_BYTES, TRAILER_BYTES
from cnrstore.errors import InvalidArgument
from cnrstore.torch import Checkpointer, KeyedEmbedding


class Model(nn.Module):
    def __init__(self, capacity=96, dim=8, eviction="lru", sparse=False):
        super().__init__()
        self.emb = KeyedEmbedding(capacity, dim, eviction=eviction, init_std=0.1, seed=7, sparse=sparse,
                                  partitions=4)
        self.top = nn.Linear(dim, 1)

    def forward(self, ids):
        return self.top(self.emb(ids).sum(1))


def make(opt_name="adagrad", eviction="lru", capacity=96, dim=8):
    torch.manual_seed(0)
    m = Model(capacity, dim, eviction, sparse=opt_name == "sparseadam")
    if opt_name == "sparseadam":
        opts = [torch.optim.SparseAdam([m.emb.weight], lr=0.05), torch.optim.SGD(m.top.parameters(), lr=0.05)]
    elif opt_name == "adam":
        opts = [torch.optim.Adam(m.parameters(), lr=0.05)]
    else:
        opts = [torch.optim.Adagrad(m.parameters(), lr=0.1)]
    for o in opts:
        m.emb.bind_optimizer(o)
    return m, opts


def batch(i, space=300, n=(12, 3)):
    g = torch.Generator().manual_seed(1000 + i)
    # a skewed id stream over a space larger than the capacity: admissions and evictions every step
    return (torch.rand(n, generator=g).pow(2) * space).long() * 7919 + 10**12


def train_step(m, opts, i):
    loss = m(batch(i)).pow(2).mean()
    for o in opts:
        o.zero_grad()
    loss.backward()
    for o in opts:
        o.step()


def state_of(m, opts):
    out = {f"model/{k}": v.clone() for k, v in m.state_dict().items()}
    for j, o in enumerate(opts):
        for idx, st in o.state_dict()["state"].items():
            for k, v in st.items():
                out[f"opt{j}/{idx}/{k}"] = v.clone() if torch.is_tensor(v) else v
    return out


def assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        x, y = a[k], b[k]
        if torch.is_tensor(x):
            assert x.dtype == y.dtype and x.shape == y.shape, k
            assert torch.equal(x.view(-1).view(torch.uint8) if x.is_floating_point() else x,
                               y.view(-1).view(torch.uint8) if y.is_floating_point() else y), k
        else:
            assert x == y, k


def assert_store_matches(store, m, version=None):
    """The keyed table at ``version`` holds exactly the live ids, each with its slot, row and metadata."""
    rows = store.read_keyed("emb", version)
    live = m.emb.slot_ids >= 0
    assert np.array_equal(rows.keys, np.sort(m.emb.slot_ids[live].numpy()))
    slots = torch.from_numpy(rows.columns["slot"])
    assert torch.equal(m.emb.slot_ids[slots], torch.from_numpy(rows.keys))
    assert torch.equal(m.emb.weight.detach()[slots], torch.from_numpy(rows.values))
    assert torch.equal(m.emb.last_step[slots], torch.from_numpy(rows.columns["last_step"]))
    assert torch.equal(m.emb.count[slots], torch.from_numpy(rows.columns["count"]))


# -- the module -------------------------------------------------------------------------------------------
def test_admission_and_lru_eviction():
    e = KeyedEmbedding(4, 3, eviction="lru")
    e(torch.tensor([10, 20, 10]))
    assert e.slot_ids.tolist() == [10, 20, -1, -1] and e.count.tolist() == [2, 1, 0, 0]
    e(torch.tensor([30, 40]))
    e(torch.tensor([50, 20]))  # full: 10 (last looked up at step 1) is evicted, 20 is in the batch
    assert e.slot_ids.tolist() == [50, 20, 30, 40]
    assert e.last_step.tolist() == [3, 3, 2, 2] and e.count.tolist() == [1, 2, 1, 1]
    assert e.lookup(torch.tensor([[50, 10], [20, 99]])).tolist() == [[0, -1], [1, -1]]
    e.eval()
    out = e(torch.tensor([99, 50]))
    assert torch.equal(out[0], torch.zeros(3)) and torch.equal(out[1], e.weight[0])
    assert int(e.step) == 3  # (eval changes nothing)
    with pytest.raises(InvalidArgument):
        e.train()(torch.arange(100, 105))
    with pytest.raises(InvalidArgument):
        e(torch.tensor([-5]))


def test_lfu_evicts_the_least_counted():
    e = KeyedEmbedding(3, 2, eviction="lfu")
    e(torch.tensor([1, 1, 1, 2, 3, 3]))
    e(torch.tensor([4]))  # 2 has the smallest count
    assert sorted(e.slot_ids.tolist()) == [1, 3, 4] and int(e.lookup(torch.tensor([4]))) == 1


def test_admitted_rows_are_drawn_from_the_state_alone():
    a, b = KeyedEmbedding(8, 4, seed=3), KeyedEmbedding(8, 4, seed=3)
    a(torch.tensor([5, 6]))
    b.load_state_dict(a.state_dict())
    assert torch.equal(a(torch.tensor([7, 5])), b(torch.tensor([7, 5])))
    assert torch.equal(a.weight, b.weight) and torch.equal(a.slot_ids, b.slot_ids)


# -- saves and resumes ----------------------------------------------------------------------------------
@pytest.mark.parametrize("opt_name,eviction", [("adagrad", "lru"), ("adam", "lfu"), ("sparseadam", "lru")])
def test_killed_and_resumed_run_equals_the_uninterrupted_one(tmp_path, opt_name, eviction):
    steps, kill_after, saved_at = 16, 10, 8
    m, opts = make(opt_name, eviction)
    with Checkpointer(tmp_path / "a", m, opts) as ck:
        for i in range(steps):
            train_step(m, opts, i)
            if i % 4 == 0:
                ck.save(i).wait()
                assert_store_matches(ck.store, m)
        full = state_of(m, opts)

    m, opts = make(opt_name, eviction)
    ck = Checkpointer(tmp_path / "b", m, opts)
    for i in range(kill_after):  # saves at 0, 4, 8; steps 9 and 10 are lost with the process
        train_step(m, opts, i)
        if i % 4 == 0:
            ck.save(i).wait()
    ck.close()
    del m, opts, ck

    m, opts = make(opt_name, eviction)
    opts_before = len(opts[0].state_dict()["state"])
    with Checkpointer(tmp_path / "b", m, opts) as ck:
        info = ck.restore()
        assert info.step == saved_at and "emb" in ck.last_restore.restored
        assert len(opts[0].state_dict()["state"]) >= opts_before
        assert_store_matches(ck.store, m)
        for i in range(info.step + 1, steps):
            train_step(m, opts, i)
            if i % 4 == 0:
                ck.save(i).wait()
                assert_store_matches(ck.store, m)
        assert_same(full, state_of(m, opts))


def test_restore_of_an_older_version_then_saves_delete_what_it_lacks(tmp_path):
    m, opts = make()
    with Checkpointer(tmp_path / "s", m, opts) as ck:
        for i in range(6):
            train_step(m, opts, i)
            ck.save(i).wait()
        first = ck.versions()[1].version
        ck.restore(first)
        want = state_of(m, opts)
        train_step(m, opts, 50)
        pending = ck.save(50)
        pending.wait()
        assert pending.report.baseline  # (a restore of an older version: the next save is whole)
        assert_store_matches(ck.store, m)
    m2, opts2 = make()
    with Checkpointer(tmp_path / "s", m2, opts2) as ck:
        ck.restore(first)
        assert_same(want, state_of(m2, opts2))


def test_rows_changed_without_a_lookup_are_saved(tmp_path):
    m, opts = make()
    with Checkpointer(tmp_path / "s", m, opts) as ck:
        for i in range(3):
            train_step(m, opts, i)
        ck.save(2).wait()
        slot = int((m.emb.slot_ids >= 0).nonzero()[5])
        key = int(m.emb.slot_ids[slot])
        with torch.no_grad():
            m.emb.weight[slot] += 1.0  # no lookup, no optimizer step
        p = ck.save(3)
        p.wait()
        assert p.report.rows["emb"] == 1
        got = ck.store.read_keys("emb", [key])
        assert got.found[0] and torch.equal(torch.from_numpy(got.values[0]), m.emb.weight.detach()[slot])
        opts[0].state[m.emb.weight]["sum"][slot + 1] *= 2  # optimizer state only, another slot
        p = ck.save(4)
        p.wait()
        assert p.report.rows["emb"] == 1 and p.report.rows["emb.optim.sum"] == 1
        assert p.report.bytes_written < 4096
        with torch.no_grad():  # a hand-written weight decay moves every live row, none looked up
            m.emb.weight.mul_(0.99)
        p = ck.save(5)
        p.wait()
        assert p.report.rows["emb"] == int((m.emb.slot_ids >= 0).sum())
        assert_store_matches(ck.store, m)
        rows = ck.store.read_keyed("emb.optim.sum")
        slots = torch.from_numpy(ck.store.read_keyed("emb").columns["slot"])
        assert torch.equal(opts[0].state[m.emb.weight]["sum"][slots], torch.from_numpy(rows.values))


def test_a_save_writes_about_the_bytes_of_the_ids_changed(tmp_path):
    dim, capacity, partitions = 16, 4096, 4
    m, opts = make("adagrad", capacity=capacity, dim=dim)
    with Checkpointer(tmp_path / "s", m, opts) as ck:
        for i in range(40):
            train_step(m, opts, i)
        ck.save(0).wait()
        with torch.no_grad():  # fill the table, so that the next steps evict
            m.emb(torch.arange(capacity, dtype=torch.int64) + 5 * 10**12)
        ck.save(2).wait()
        results = []
        for i in range(3):
            # a step of the dense layer alone: a save of the dense state, the payload and the commit
            opts[0].zero_grad()
            m.top(torch.randn(4, dim, generator=torch.Generator().manual_seed(i))).sum().backward()
            opts[0].step()
            fixed = ck.save(10 * i)
            fixed.wait()
            assert fixed.report.rows["emb"] == 0
            train_step(m, opts, 100 + i)
            before = set(ck.store.keys("emb").tolist())
            p = ck.save(10 * i + 1)
            p.wait()
            now = set(m.emb.slot_ids[m.emb.slot_ids >= 0].tolist())
            deleted = len(before - now)
            n = p.report.rows["emb"]
            assert deleted and n >= deleted and p.report.rows["emb.optim.sum"] == n  # evictions, admissions
            # each id put: key, row, 3 int64 columns; its Adagrad row in emb.optim.sum; each id deleted: a key in both
            raw = n * (8 + 4 * dim + 3 * 8) + n * (8 + 4 * dim) + 2 * deleted * 8
            # per record (a partition of a table): header, trailer, the key count, deletion flags; the COMMIT's
            # larger table list
            overhead = 2 * partitions * (HEADER_BYTES + TRAILER_BYTES + 8) + 2 * (n + deleted + 7) // 8 + 256
            keyed_bytes = p.report.bytes_written - fixed.report.bytes_written
            results.append((n, deleted, keyed_bytes, raw, overhead))
            assert raw <= keyed_bytes <= 1.2 * raw + overhead, results
            assert_store_matches(ck.store, m)
        print("bytes per save (ids put, ids deleted, keyed bytes, raw bytes, record overhead):", results)


def test_every_version_is_the_state_at_save_under_accumulation_closures_two_optimizers_and_in_place_writes(tmp_path):
    """The contract ("a committed version is the state at save()") for a KeyedEmbedding: the trainer
    accumulates gradients over two backward passes, steps one optimizer through a closure, keeps two optimizers
    (Adagrad on the keyed rows, Adam on the dense head), and writes rows in place without announcing it (a
    decay of every slot, a manual edit) -- and each save returns while training goes on. Every version, restored
    into fresh objects, equals clones of the model and both optimizers taken at its save()."""
    torch.manual_seed(0)
    m = Model(capacity=64, dim=8)
    emb_opt = torch.optim.Adagrad([m.emb.weight], lr=0.1)
    top_opt = torch.optim.Adam(m.top.parameters(), lr=0.05)
    m.emb.bind_optimizer(emb_opt)
    ck = Checkpointer(str(tmp_path / "s"), m, [emb_opt, top_opt])
    clones = {}
    g = torch.Generator().manual_seed(1)
    for step in range(8):
        for _ in range(2):  # accumulation: two backward passes, then one step
            ids = torch.randint(0, 40 + 12 * step, (6, 3), generator=g)
            m(ids).pow(2).mean().backward()

        def closure():
            return torch.zeros(())

        emb_opt.step(closure)
        top_opt.step()
        emb_opt.zero_grad()
        top_opt.zero_grad()
        with torch.no_grad():
            m.emb.weight.mul_(0.999)  # unannounced: every slot
            m.emb.weight[step % 64] += 1.0  # unannounced: one slot
        pending = ck.save(step)
        clones[step] = ({k: v.clone() for k, v in m.state_dict().items()},
                        [copy_optimizer_state(o) for o in (emb_opt, top_opt)])
        if step % 3 == 2:
            pending.wait()
    ck.close()
    with cnrstore.open(tmp_path / "s", readonly=True) as s:
        versions = {v.step: v.version for v in s.versions()}
    assert sorted(versions) == list(range(8))
    for step, (model_sd, opt_sds) in clones.items():
        torch.manual_seed(123)
        m2 = Model(capacity=64, dim=8)
        o2 = [torch.optim.Adagrad([m2.emb.weight], lr=0.1), torch.optim.Adam(m2.top.parameters(), lr=0.05)]
        m2.emb.bind_optimizer(o2[0])
        ck2 = Checkpointer(str(tmp_path / "s"), m2, o2)
        ck2.restore(versions[step])
        for k, v in m2.state_dict().items():
            assert torch.equal(v, model_sd[k]), (step, k)
        for got, want in zip((copy_optimizer_state(o) for o in o2), opt_sds):
            assert got.keys() == want.keys(), step
            for pid in want:
                for name, t in want[pid].items():
                    assert torch.equal(torch.as_tensor(got[pid][name]), torch.as_tensor(t)), (step, pid, name)
        ck2.close()


def copy_optimizer_state(opt) -> dict:
    """{param index: {state name: a clone}} of an optimizer, as it is at the call."""
    return {i: {k: (v.clone() if torch.is_tensor(v) else v) for k, v in st.items()}
            for i, st in opt.state_dict()["state"].items()}
