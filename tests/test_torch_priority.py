"""CPR-MFU / CPR-SSU in cnrstore.torch.Checkpointer: update counting, priority saves, the state blob's
parameter names."""

import copy
import io

import numpy as np
import pytest
import torch
from torch import nn

from cnrstore.errors import InvalidArgument
from cnrstore.torch import Checkpointer
from cnrstore.torch.checkpointer import STATE_BLOB

from support.torch_models import Table  # the one-embedding model test_torch_checkpointer trains too


class Lookups(nn.Module):
    def __init__(self, rows=30):
        super().__init__()
        self.emb = nn.Embedding(rows, 2)
        self.bag = nn.EmbeddingBag(rows, 2, mode="sum")




def counts(ck):
    """Per table name, the update counts as numpy."""
    return {t.name: t.counts.numpy().copy() for t in ck._tables}


def touch(model, ids):
    """Look ``ids`` up (counted) and change those rows, as a training step would."""
    model(torch.tensor(ids)).sum().backward()
    change(model.emb, ids)


def change(module, ids):
    """Change rows ``ids`` of an embedding module's weight in place."""
    with torch.no_grad():
        module.weight[torch.tensor(sorted(set(ids)), dtype=torch.int64)] += 1.0


def bump(model):
    """Move every parameter without tracking it, so any row a save writes shows as changed."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)


def expected_top(cnt, k):
    """Reference pick: rows with a positive count, highest count first, then lower row id."""
    rows = np.flatnonzero(cnt)
    order = np.lexsort((rows, -cnt[rows]))  # last key is primary
    return set(rows[order][:k].tolist())


# -- counting ----------------------------------------------------------------------------------------------

def test_mfu_counts_are_exact(store):
    model = Lookups()
    ck = Checkpointer(store, model, codec="fp32", mode="incremental", priority="mfu")
    want = {"emb": np.zeros(30, np.int64), "bag": np.zeros(30, np.int64)}
    model.emb(torch.tensor([1, 2, 2, 2, 5]))  # duplicates in one batch all count
    np.add.at(want["emb"], [1, 2, 2, 2, 5], 1)
    model.emb(torch.tensor([[3, 3], [1, 29]], dtype=torch.int32))  # 2-D, int32 ids
    np.add.at(want["emb"], [3, 3, 1, 29], 1)
    model.bag(torch.tensor([4, 4, 6, 7, 4]), torch.tensor([0, 2]))  # 1-D with offsets
    np.add.at(want["bag"], [4, 4, 6, 7, 4], 1)
    model.bag(input=torch.tensor([[8, 9, 8]]), per_sample_weights=torch.ones(1, 3))  # 2-D bags, keyword
    np.add.at(want["bag"], [8, 9, 8], 1)
    with torch.no_grad():  # evaluation: neither tracked nor counted
        model.emb(torch.tensor([1, 20]))
        model.bag(torch.tensor([4, 21]), torch.tensor([0]))
    got = counts(ck)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name])
        assert got[name].dtype == np.int32
    ck.close()


def skewed_ids(n, rows, seed):
    g = torch.Generator().manual_seed(seed)
    p = 1.0 / torch.arange(1, rows + 1, dtype=torch.float64)  # Zipf-like popularity
    return torch.multinomial(p, n, replacement=True, generator=g)


def test_ssu_estimate_tracks_exact_counts_and_leaves_global_rng_alone(store, tmp_path):
    rows, rate = 1000, 0.125
    model = Table(rows, 2)
    ck = Checkpointer(store, model, codec="fp32", mode="incremental", priority="ssu", ssu_rate=rate)
    batches = [skewed_ids(50_000, rows, seed) for seed in range(4)]
    torch.manual_seed(7)
    rng_before = torch.get_rng_state()
    for ids in batches:
        model(ids)
    assert torch.equal(torch.get_rng_state(), rng_before)  # the training RNG stream is untouched
    exact = np.bincount(torch.cat(batches).numpy(), minlength=rows)
    est = counts(ck)["emb"] / rate
    assert ck._tables[0].count_scale == 1 / rate
    assert abs(est.sum() - exact.sum()) <= 0.01 * exact.sum()  # sample size: rate * n, up to rounding
    heavy = exact >= 2000  # a sampled count ~ Binomial(c, rate): 6 sigma of the estimate, loose on purpose
    assert heavy.sum() >= 10
    sigma = np.sqrt(exact[heavy] * (1 - rate) / rate)
    assert np.all(np.abs(est[heavy] - exact[heavy]) <= 6 * sigma + 1)
    # the most used rows by estimate are (mostly) the most used rows
    assert len(set(np.argsort(-est)[:10]) & set(np.argsort(-exact)[:10])) >= 8
    # deterministic: the same lookups give the same counts in another Checkpointer
    import cnrstore
    other = cnrstore.open(str(tmp_path / "other"), create=True)
    ck2 = Checkpointer(other, Table(rows, 2), codec="fp32", priority="ssu", ssu_rate=rate)
    for ids in batches:
        ck2.model(ids)
    np.testing.assert_array_equal(counts(ck2)["emb"], counts(ck)["emb"])
    ck2.close()
    other.close()
    ck.close()


def test_ssu_is_unbiased_for_batches_smaller_than_one_over_rate(store):
    model = Table(10, 2)
    ck = Checkpointer(store, model, codec="fp32", priority="ssu", ssu_rate=0.1)
    ids = torch.tensor([3, 3, 4])  # 0.3 expected samples per batch: rounded stochastically
    for _ in range(2000):
        model(ids)
    est = counts(ck)["emb"] / 0.1
    # exact: 4000 for row 3, 2000 for row 4; a sampled count ~ Binomial-like with sd ~ sqrt(c * 9)
    assert abs(est[3] - 4000) <= 6 * np.sqrt(4000 * 9) and abs(est[4] - 2000) <= 6 * np.sqrt(2000 * 9)
    assert est[[0, 1, 2, 5, 6, 7, 8, 9]].sum() == 0
    ck.close()


# -- priority saves write exactly their rows ------------------------------------------------------------

@pytest.mark.parametrize("mode", ["incremental", "one-shot", "intermittent"])
def test_priority_save_writes_the_top_rows_and_the_next_save_the_rest(store, mode):
    torch.manual_seed(0)
    model = Table()
    ck = Checkpointer(store, model, codec="fp32", mode=mode, priority="mfu")
    v0 = ck.save(0).wait()
    # counts: row 5 x5; rows 3, 7, 9 x4 (a tie at the cut); rows 10..19 x1
    touch(model, [5] * 5 + [7, 9, 3] * 4 + list(range(10, 20)))
    before = counts(ck)["emb"]
    assert before[5] == 5 and before[3] == before[7] == before[9] == 4 and before[10:20].tolist() == [1] * 10
    now = model.emb.weight.detach().numpy().copy()
    prev = store.read_table("emb", v0)
    pending = ck.save(1, top=0.03)  # 3 of 100 rows: 5, then the tie at 4 goes to the lower rows 3 and 7
    v1 = pending.wait()
    rep = pending.report
    assert rep.priority and not rep.baseline and rep.rows == {"emb": 3}
    picked = {3, 5, 7}
    assert picked == expected_top(before, 3)
    got = store.read_table("emb", v1)
    mask = np.isin(np.arange(100), list(picked))
    np.testing.assert_array_equal(got[mask], now[mask])
    np.testing.assert_array_equal(got[~mask], prev[~mask])  # the others: as in the previous version
    after = counts(ck)["emb"]
    np.testing.assert_array_equal(after[list(picked)], 0)  # written rows: count cleared
    keep = ~mask
    np.testing.assert_array_equal(after[keep], before[keep])  # the rest keep theirs
    t = ck._tables[0]
    if mode != "incremental":
        assert set(t.since_baseline.rows().tolist()) == picked
    assert ck._plan.diffs == []  # a priority save is no differential of the intermittent rule

    # the next regular save writes the remaining changed rows (and, since the baseline, the picked ones)
    now = model.emb.weight.detach().numpy().copy()
    pending = ck.save(2)
    v2 = pending.wait()
    rest = {9} | set(range(10, 20))
    want = rest if mode == "incremental" else rest | picked
    assert not pending.report.priority and not pending.report.baseline
    assert pending.report.rows == {"emb": len(want)}
    mask = np.isin(np.arange(100), list(want))
    np.testing.assert_array_equal(store.read_table("emb", v2)[mask], now[mask])
    np.testing.assert_array_equal(store.read_table("emb", v2)[~mask], got[~mask])
    assert not counts(ck)["emb"].any()  # a regular save clears every count
    if mode == "intermittent":
        assert ck._plan.diffs == [len(want) / 100]
    ck.close()


def test_priority_save_caps_at_the_changed_rows_and_covers_every_table(store):
    model = Lookups(rows=40)
    ck = Checkpointer(store, model, codec="fp32", mode="incremental", priority="mfu")
    ck.save(0).wait()
    model.emb(torch.tensor([1, 1, 2]))
    model.bag(torch.tensor([5, 6, 6, 6, 7]), torch.tensor([0]))
    change(model.emb, [1, 2])
    change(model.bag, [5, 6, 7])
    p = ck.save(1, top=0.05)  # 2 of 40 rows per table: emb 1 (x2), 2; bag 6 (x3), then 5 before 7 (x1 each)
    p.wait()
    assert p.report.rows == {"emb": 2, "bag": 2}
    assert counts(ck)["bag"][[5, 6, 7]].tolist() == [0, 0, 1] and not counts(ck)["emb"].any()
    p = ck.save(2, top=1.0)  # every remaining changed row
    p.wait()
    assert p.report.rows == {"emb": 0, "bag": 1} and p.report.priority
    p = ck.save(3, top=0.5)  # nothing changed: a priority save of dense state only
    p.wait()
    assert p.report.rows == {"emb": 0, "bag": 0}
    ck.close()


def test_first_save_with_top_is_a_regular_baseline(store):
    model = Table()
    ck = Checkpointer(store, model, codec="fp32", priority="mfu")
    touch(model, [1, 2])
    p = ck.save(0, top=0.01)
    p.wait()
    assert p.report.baseline and not p.report.priority and p.report.rows == {"emb": 100}
    np.testing.assert_array_equal(store.read_table("emb"), model.emb.weight.detach().numpy())
    assert not counts(ck)["emb"].any()
    ck.close()


# -- restore from a priority version --------------------------------------------------------------------

class SmallDLRM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(200, 4)
        self.bag = nn.EmbeddingBag(150, 4, mode="sum")
        self.top = nn.Linear(8, 1)

    def forward(self, ids, bag_ids, offsets):
        return self.top(torch.cat([self.emb(ids), self.bag(bag_ids, offsets)], dim=1)).squeeze(1)


def step(model, opt, i):
    g = torch.Generator().manual_seed(i)
    ids = torch.randint(0, 200, (16,), generator=g)
    bag_ids = torch.randint(0, 150, (32,), generator=g)
    y = torch.randint(0, 2, (16,), generator=g).float()
    opt.zero_grad()
    out = model(ids, bag_ids, torch.arange(0, 32, 2))
    nn.functional.binary_cross_entropy_with_logits(out, y).backward()
    opt.step()


@pytest.mark.parametrize("priority", ["mfu", "ssu"])
def test_restore_of_a_priority_version_follows_store_semantics(store, priority):
    torch.manual_seed(0)
    model = SmallDLRM()
    opt = torch.optim.Adagrad(model.parameters(), lr=0.1)
    ck = Checkpointer(store, model, opt, codec="fp32", mode="intermittent", priority=priority, ssu_rate=0.5)
    for i in range(3):
        step(model, opt, i)
    ck.save(3).wait()
    at_regular = copy.deepcopy((model.state_dict(), opt.state_dict()))
    for i in range(3, 8):
        step(model, opt, i)
    before = counts(ck)
    at_priority = copy.deepcopy((model.state_dict(), opt.state_dict()))
    touched = {}  # the rows changed since the regular save (weight or Adagrad's sum)
    for i, name in enumerate(("emb", "bag")):
        w, w0 = at_priority[0][f"{name}.weight"], at_regular[0][f"{name}.weight"]
        s1, s0 = at_priority[1]["state"][i]["sum"], at_regular[1]["state"][i]["sum"]
        touched[name] = ((w != w0).any(1) | (s1 != s0).any(1)).numpy()
    p = ck.save(8, top=0.1)
    v = p.wait()
    assert p.report.priority
    picked = {}
    for name, n in (("emb", 200), ("bag", 150)):
        cnt = before[name].astype(np.int64)
        if priority == "ssu":  # changed rows never sampled may fill the budget too, in row order
            cnt = cnt + touched[name]
        picked[name] = expected_top(cnt, int(np.ceil(0.1 * n)))
        assert p.report.rows[name] == p.report.rows[f"{name}.optim.sum"] == len(picked[name]) == 0.1 * n
    for i in range(8, 12):
        step(model, opt, i)
    ck.restore(v)
    params = [model.emb.weight, model.bag.weight, model.top.weight, model.top.bias]
    for name, param in zip(["emb", "bag"], params):
        rows = np.arange(param.shape[0])
        mask = torch.from_numpy(np.isin(rows, list(picked[name])))[:, None]
        key = f"{name}.weight"
        want = torch.where(mask, at_priority[0][key], at_regular[0][key])
        assert torch.equal(param.detach(), want)
        state_idx = 0 if name == "emb" else 1
        want_sum = torch.where(mask, at_priority[1]["state"][state_idx]["sum"],
                               at_regular[1]["state"][state_idx]["sum"])
        assert torch.equal(opt.state_dict()["state"][state_idx]["sum"], want_sum)
    for key in ("top.weight", "top.bias"):  # dense parameters: exactly as at the priority save
        assert torch.equal(model.state_dict()[key], at_priority[0][key])
    assert torch.equal(opt.state_dict()["state"][2]["sum"], at_priority[1]["state"][2]["sum"])
    assert not any(counts(ck)[n].any() for n in ("emb", "bag"))  # restore clears the counts
    ck.close()


# -- the state blob's parameter names -------------------------------------------------------------------

def blob(store, version=None):
    return torch.load(io.BytesIO(store.read_dense(STATE_BLOB, version).tobytes()), weights_only=False)


def test_state_blob_names_parameters_and_restore_accepts_blobs_without_names(store):
    torch.manual_seed(0)
    model = SmallDLRM()
    stray = nn.Parameter(torch.zeros(3))  # optimized but not the model's
    opts = [torch.optim.Adagrad([model.emb.weight, model.bag.weight], lr=0.1),
            torch.optim.SGD([{"params": [model.top.bias, stray]}, {"params": [model.top.weight]}], lr=0.1)]
    ck = Checkpointer(store, model, opts, codec="fp32", mode="incremental")
    v = ck.save(0).wait()
    payload = blob(store, v)
    assert payload["param_names"] == [["emb.weight", "bag.weight"], ["top.bias", None, "top.weight"]]
    expect = copy.deepcopy(model.state_dict())
    # a version whose blob has no param_names (as written before they existed) still restores
    del payload["param_names"]
    out = io.BytesIO()
    torch.save(payload, out)
    with store.checkpoint(1) as c:
        c.put_dense(STATE_BLOB, np.frombuffer(out.getbuffer(), dtype=np.uint8).copy())
    bump(model)
    ck.restore()
    for k, val in expect.items():
        assert torch.equal(model.state_dict()[k], val)
    ck.close()


# -- errors ------------------------------------------------------------------------------------------------

def test_bad_priority_arguments(store):
    with pytest.raises(InvalidArgument, match="priority"):
        Checkpointer(store, Table(), priority="lfu")
    for rate in (0, 1.5, -0.1, float("nan"), True, "0.1"):
        with pytest.raises(InvalidArgument, match="ssu_rate"):
            Checkpointer(store, Table(), priority="ssu", ssu_rate=rate)
    plain = Checkpointer(store, Table(), codec="fp32")
    with pytest.raises(InvalidArgument, match="priority='mfu'"):
        plain.save(0, top=0.5)
    plain.close()
    ck = Checkpointer(store, Table(), codec="fp32", priority="mfu")
    for top in (0, 0.0, 1.01, -0.5, float("nan"), True, "0.5"):
        with pytest.raises(InvalidArgument, match="top"):
            ck.save(0, top=top)
    assert store.latest() is None  # nothing was written by the refused saves
    ck.save(0).wait()
    assert ck.save(1, top=1).wait() == store.latest().version
    ck.close()
