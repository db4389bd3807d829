"""cnrstore.torch.Checkpointer: row tracking, modes, asynchronous saves, exact restore."""

import copy
import threading

import numpy as np
import pytest
import torch
from torch import nn

import cnrstore
from cnrstore.errors import InvalidArgument
from cnrstore.policy import BitWidthPolicy
from cnrstore.policy.bitwidth import PAPER_TABLE
from cnrstore.torch import Checkpointer

from support.options import options_changed
from support.torch_models import Loader, Table, TinyDLRM, batch, check_int4_restore, make, train_step
from support.torch_state import assert_state_equal


# -- exact round trip ----------------------------------------------------------------------------------

@pytest.mark.parametrize("optim", ["adagrad", "adam"])
def test_lossless_save_train_restore_is_bit_exact(store, optim):
    model, opt = make(0, optim)
    loader = Loader()
    ck = Checkpointer(store, model, opt, codec="fp32", mode="incremental", extra={"loader": loader})
    for _ in range(3):
        train_step(model, opt, loader.next())
    v = ck.save(step=loader.position, meta={"note": "x"}).wait()
    if optim == "adagrad":  # and an incremental save on top (dense Adam moves untouched rows too)
        train_step(model, opt, loader.next())
        v = ck.save(step=loader.position, meta={"note": "x"}).wait()
    expect_model = copy.deepcopy(model.state_dict())
    expect_opt = copy.deepcopy(opt.state_dict())
    expect_pos = loader.position
    for _ in range(4):
        train_step(model, opt, loader.next())
    assert not torch.equal(model.emb.weight, expect_model["emb.weight"])
    info = ck.restore()
    assert info.version == v and info.meta == {"note": "x"}
    assert_state_equal(expect_model, model.state_dict())
    assert_state_equal(expect_opt, opt.state_dict())
    assert loader.position == expect_pos
    # row-wise optimizer state went to its own tables
    names = set(store.tables())
    if optim == "adagrad":
        assert {"emb.optim.sum", "bag.optim.sum"} <= names
    else:
        assert {"emb.optim.exp_avg", "emb.optim.exp_avg_sq", "bag.optim.exp_avg_sq"} <= names
    ck.close()


def test_adam_restore_into_fresh_optimizer_without_state(store):
    model, opt = make(0, "adam")
    ck = Checkpointer(store, model, opt, codec="fp32")
    train_step(model, opt, batch(0))
    ck.save(1).wait()
    expect_model, expect_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    ck.close()
    model2, opt2 = make(5, "adam")  # no state yet: restore must create it
    ck2 = Checkpointer(store, model2, opt2, codec="fp32")
    ck2.restore()
    assert_state_equal(expect_model, model2.state_dict())
    assert_state_equal(expect_opt, opt2.state_dict())
    ck2.close()


def run(store_path, steps, *, fail_at=None, save_every=3, mode="intermittent"):
    store = cnrstore.open(store_path, create=True)
    model, opt = make(0)
    loader = Loader()
    ck = Checkpointer(store, model, opt, codec="fp32", mode=mode, extra=[loader])
    failed = False
    while loader.position < steps:
        train_step(model, opt, loader.next())
        if loader.position % save_every == 0:
            ck.save(loader.position)
        if not failed and loader.position == fail_at:
            failed = True
            # a failure: throw the in-memory state away, start over from the newest checkpoint
            ck.close()
            model, opt = make(123)
            loader = Loader()
            ck = Checkpointer(store, model, opt, codec="fp32", mode=mode, extra=[loader])
            info = ck.restore()
            assert info.step == loader.position and loader.position < fail_at
    ck.close()
    store.close()
    return model, opt


@pytest.mark.parametrize("mode", ["incremental", "one-shot", "intermittent"])
def test_failed_and_restored_run_matches_uninterrupted_run(tmp_path, mode):
    steps = 16
    ref_model, ref_opt = run(str(tmp_path / "a"), steps, mode=mode)
    got_model, got_opt = run(str(tmp_path / "b"), steps, fail_at=11, mode=mode)
    assert_state_equal(ref_model.state_dict(), got_model.state_dict())
    assert_state_equal(ref_opt.state_dict(), got_opt.state_dict())


# -- modes write exactly their rows --------------------------------------------------------------------

def change(model, ids):
    """Change exactly rows ``ids`` of the model's table, in place and announced to nobody."""
    with torch.no_grad():
        model.emb.weight[torch.tensor(sorted(set(ids)), dtype=torch.int64)] += 1.0


touch = change  # (the tests below: rows a training step changed)


def check_written(store, model, version, prev, expected_rows):
    """The version holds the model's current values exactly at expected_rows and the previous ones
    elsewhere."""
    now = model.emb.weight.detach().numpy()
    mask = np.zeros(len(now), dtype=bool)
    mask[list(expected_rows)] = True
    want = np.where(mask[:, None], now, prev)
    got = store.read_table("emb", version)
    np.testing.assert_array_equal(got, want)
    return got


@pytest.mark.parametrize("mode", ["incremental", "one-shot", "intermittent"])
def test_each_mode_writes_exactly_its_rows(store, mode):
    torch.manual_seed(0)
    model = Table()
    ck = Checkpointer(store, model, codec="fp32", mode=mode)
    all_rows = set(range(100))
    # (rows changed before the save, expected rows written by mode)
    plan = [
        ([], {"incremental": all_rows, "one-shot": all_rows, "intermittent": all_rows}),
        ([1, 2, 2], {"incremental": {1, 2}, "one-shot": {1, 2}, "intermittent": {1, 2}}),
        ([3], {"incremental": {3}, "one-shot": {1, 2, 3}, "intermittent": {1, 2, 3}}),
        (list(range(10, 30)), {"incremental": set(range(10, 30)), "one-shot": {1, 2, 3} | set(range(10, 30)),
                               "intermittent": {1, 2, 3} | set(range(10, 30))}),
        (list(range(30, 35)), {"incremental": set(range(30, 35)), "one-shot": {1, 2, 3} | set(range(10, 35)),
                               "intermittent": {1, 2, 3} | set(range(10, 35))}),
        # S = .02, .03, .23, .28, .53: 1 + 2.09 <= 6 * .53 -> intermittent takes a new baseline
        # (one step earlier, 1 + 1.56 > 5 * .28: not yet)
        (list(range(35, 60)), {"incremental": set(range(35, 60)), "one-shot": {1, 2, 3} | set(range(10, 60)),
                               "intermittent": all_rows}),
        ([5], {"incremental": {5}, "one-shot": {1, 2, 3, 5} | set(range(10, 60)), "intermittent": {5}}),
    ]
    prev = np.zeros((100, 3), dtype=np.float32)
    for step, (ids, expected) in enumerate(plan):
        if ids:
            change(model, ids)
        pending = ck.save(step)
        v = pending.wait()
        assert pending.done()
        want = expected[mode]
        assert pending.report.rows == {"emb": len(want)}
        assert pending.report.baseline == (want == all_rows)
        prev = check_written(store, model, v, prev, want)
    ck.close()


# -- what a save writes: the rows that changed, whatever changed them ----------------------------------

class Lookups(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(30, 2, padding_idx=0)
        self.bag = nn.EmbeddingBag(30, 2, mode="sum")
        self.bag2d = nn.EmbeddingBag(30, 2, mode="mean", padding_idx=29)


def written_rows(store, ck, step):
    """Per table, the rows the next incremental save writes, read back from the store's index of the
    version (the rows of its records), and the version."""
    v = ck.save(step).wait()
    got = {}
    for n in ["emb", "bag", "bag2d"]:
        before = store.read_table(n, v - 1)
        after = store.read_table(n, v)
        got[n] = set(np.flatnonzero((after != before).any(axis=1)).tolist())
    return got


def test_a_save_writes_the_rows_that_changed_whatever_changed_them(store):
    """Issue 48: increments came from the lookups, so rows changed otherwise (a gradient from elsewhere, an
    in-place write) were missed and rows looked up but unchanged (padding, evaluation) written. A save now
    writes exactly the rows whose value changed since the previous one."""
    model = Lookups()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ck = Checkpointer(store, model, opt, codec="fp32", mode="incremental")
    ck.save(0).wait()

    def train(loss):
        opt.zero_grad()
        loss.backward()
        opt.step()

    train(model.emb(torch.tensor([[0, 3], [7, 3]])).sum()  # 2-D input; padding_idx 0 gets no gradient
          + model.bag(torch.tensor([4, 5, 6, 9]), torch.tensor([0, 1]), per_sample_weights=torch.rand(4)).sum()
          + model.bag2d(torch.tensor([[11, 12], [13, 29]])).sum())  # 29 is padding_idx
    assert written_rows(store, ck, 1) == {"emb": {3, 7}, "bag": {4, 5, 6, 9}, "bag2d": {11, 12, 13}}
    with torch.no_grad():  # evaluation lookups change nothing
        model.emb(torch.tensor([20]))
    train(model.bag(torch.tensor([[1, 2, 3]]), per_sample_weights=torch.ones(1, 3)).sum()
          + (model.emb.weight[21] ** 2).sum())  # a gradient that is no lookup of the module
    assert written_rows(store, ck, 2) == {"emb": {21}, "bag": {1, 2, 3}, "bag2d": set()}
    model.bag.weight.data[[7, 8]] += 1.0  # through .data: nothing announced it
    model.bag2d.weight.detach().numpy()[14] = 5.0  # through numpy
    assert written_rows(store, ck, 3) == {"emb": set(), "bag": {7, 8}, "bag2d": {14}}
    ck.close()
    assert all(len(m._forward_pre_hooks) == 0 for m in model.modules())  # no hook left behind


# -- asynchrony and failures ---------------------------------------------------------------------------

def test_weight_shared_by_two_modules_is_one_table_tracked_through_both(store):
    model = nn.Module()
    model.a = nn.Embedding(20, 2)
    model.b = nn.EmbeddingBag(20, 2)
    model.b.weight = model.a.weight
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ck = Checkpointer(store, model, opt, codec="fp32", mode="incremental")
    assert set(store.tables()) == {"a"} and not ck._dense  # the tied weight is not saved twice
    ck.save(0).wait()
    (model.b(torch.tensor([[4, 5]])).sum() + model.a(torch.tensor([9])).sum()).backward()
    opt.step()
    p = ck.save(1)
    p.wait()
    assert p.report.rows == {"a": 3}
    np.testing.assert_array_equal(store.read_rows("a", [4, 5, 9]), model.a.weight.detach().numpy()[[4, 5, 9]])
    ck.close()


def test_background_failure_surfaces_in_wait_and_next_save(store, monkeypatch):
    torch.manual_seed(0)
    model = Table()
    ck = Checkpointer(store, model, codec="fp32", mode="incremental")
    ck.save(0).wait()
    real = store.checkpoint

    def broken(*a, **k):
        raise OSError("disk unplugged")

    monkeypatch.setattr(store, "checkpoint", broken)
    touch(model, [1])
    pending = ck.save(1)
    with pytest.raises(OSError, match="disk unplugged"):
        pending.wait()
    assert pending.done()
    with pytest.raises(OSError, match="disk unplugged"):
        pending.wait()  # and again
    monkeypatch.setattr(store, "checkpoint", real)
    with pytest.raises(OSError, match="disk unplugged"):
        ck.save(2)
    # delivered once; the next save is a full baseline, so the rows of the lost save are not lost
    p = ck.save(3)
    p.wait()
    assert p.report.baseline and p.report.rows == {"emb": 100}
    np.testing.assert_array_equal(store.read_table("emb"), model.emb.weight.detach().numpy())
    ck.close()


def test_unreported_background_failure_is_raised_by_close(store, monkeypatch):
    model = Table()
    ck = Checkpointer(store, model, codec="fp32")

    def broken(*a, **k):
        raise OSError("disk unplugged")

    monkeypatch.setattr(store, "checkpoint", broken)
    ck.save(0)
    with pytest.raises(OSError, match="disk unplugged"):
        ck.close()
    ck.close()  # idempotent


class Gate:
    """Holds every background write at its ``store.checkpoint`` call until ``open()``; counts the calls and
    can make chosen calls fail (1-based), as a write whose disk failed."""

    def __init__(self, store, monkeypatch, fail_calls=()):
        self.real, self.fail_calls, self.calls = store.checkpoint, set(fail_calls), 0
        self.event = threading.Event()
        self.entered = threading.Event()  # a write has reached the gate (it has started)
        monkeypatch.setattr(store, "checkpoint", self)

    def __call__(self, *a, **k):
        self.entered.set()
        assert self.event.wait(30), "the gate was never opened: a save waited for a write it held"
        self.calls += 1
        if self.calls in self.fail_calls:
            raise OSError("disk unplugged")
        return self.real(*a, **k)

    def open(self):
        self.event.set()


def test_saves_queue_behind_a_write_in_flight_and_commit_in_save_order(store, monkeypatch):
    """A save while earlier ones are still writing copies its rows and returns; versions commit in save
    order, each holding exactly the model at its save (the reusable buffers are not overwritten under a
    queued write)."""
    torch.manual_seed(0)
    model = Table()
    # (a model this small is mostly payload: the default bound of two full snapshots would hold 3 saves)
    ck = Checkpointer(store, model, codec="fp32", mode="incremental", max_queue_bytes=1 << 20, max_lag=None)
    gate = Gate(store, monkeypatch)
    pendings, models = [], []
    for i in range(4):
        touch(model, [i, 10 + i])
        with torch.no_grad():
            model.emb.weight[[i, 10 + i]] += 1.0  # (as an optimizer step would)
        pendings.append(ck.save(i))
        models.append(model.emb.weight.detach().numpy().copy())
    assert not any(p.done() for p in pendings)  # all four returned with the first still held
    assert pendings[0].report.baseline and not any(p.report.baseline for p in pendings[1:])
    gate.open()
    versions = [p.wait() for p in pendings]
    assert versions == sorted(versions) and len(set(versions)) == 4
    for v, want in zip(versions, models):
        np.testing.assert_array_equal(store.read_table("emb", v), want)
    assert [p.report.rows["emb"] for p in pendings[1:]] == [2, 2, 2]
    ck.close()


@pytest.mark.parametrize("stream", [True, False])
def test_coalesce_supersedes_the_queued_saves_that_have_not_started_and_writes_their_rows(store, monkeypatch,
                                                                                         stream):
    """on_backpressure="coalesce": with max_lag=2 and the first write held, save 1 queues; save 2 would wait
    for room, so it supersedes save 1 instead (its wait() raises SaveSuperseded), writes save 1's rows as well
    as its own, and says so in its report. Every committed version is the model at its save()."""
    from cnrstore.errors import SaveSuperseded
    torch.manual_seed(0)
    model = Table()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ck = Checkpointer(store, model, opt, codec="fp32", mode="incremental", on_backpressure="coalesce",
                      stream_saves=stream, max_queue_bytes=1 << 20)  # (max_lag=2 decides here)
    waits = []
    cnrstore.fs.pause_at("checkpointer_waits_for_room", lambda name: waits.append(name))
    gate = Gate(store, monkeypatch)
    try:
        first = ck.save(0)  # a baseline, held at the gate
        assert gate.entered.wait(30)  # (its write has started: it cannot be superseded)
        want = {0: model.emb.weight.detach().clone()}
        pendings = {0: first}
        for i, rows in ((1, [1, 2, 3]), (2, [3, 40])):
            opt.zero_grad()
            model(torch.tensor(rows)).sum().backward()
            opt.step()
            pendings[i] = ck.save(i)
            want[i] = model.emb.weight.detach().clone()
    finally:
        cnrstore.fs.pause_at("checkpointer_waits_for_room", None)
    assert not waits  # save 2 did not wait for room: it superseded save 1
    assert pendings[2].report.superseded == [1] and pendings[2].report.rows["emb"] == 4  # rows 1, 2, 3, 40
    with pytest.raises(SaveSuperseded, match="superseded by the save of step 2") as exc:
        pendings[1].wait()
    assert exc.value.by_step == 2 and isinstance(exc.value, cnrstore.SaveSkipped)
    gate.open()
    versions = [pendings[0].wait(), pendings[2].wait()]
    assert [v.step for v in store.versions()] == [0, 2]
    for v, step in zip(versions, (0, 2)):
        np.testing.assert_array_equal(store.read_table("emb", v), want[step].numpy())
    ck.close()


def test_on_backpressure_is_checked(store):
    with pytest.raises(InvalidArgument, match="on_backpressure"):
        Checkpointer(store, Table(), on_backpressure="drop")


def test_a_save_over_the_memory_bound_waits_and_only_then(store, monkeypatch):
    """The queued snapshots' host bytes stay within max_queue_bytes: a save that would pass it waits for
    the oldest first; max_queue_bytes=0 is one save at a time."""
    torch.manual_seed(0)
    model = Table()
    waits = []
    cnrstore.fs.pause_at("checkpointer_waits_for_room", lambda name: waits.append(name))
    try:
        ck = Checkpointer(store, model, codec="fp32", mode="incremental")
        base = ck.save(0)
        base.wait()
        touch(model, list(range(50)))
        half = ck.save(1)  # half the rows: the measure of an increment below
        half.wait()
        assert base.report.host_bytes > half.report.host_bytes > 50 * 4 * 4
        gate = Gate(store, monkeypatch)
        # room for one increment of 50 rows beside a queued baseline (which does not count: its copy exists
        # already), not two; max_lag off: the bytes alone decide here
        ck.max_queue_bytes = half.report.host_bytes + half.report.host_bytes // 2
        ck.max_lag = None
        ck.note_restore()
        first = ck.save(2)  # a baseline; an empty queue never waits
        touch(model, list(range(50)))
        second = ck.save(3)  # fits beside it: no wait
        assert not waits and not first.done()
        assert ck.queued_bytes() == first.report.host_bytes + second.report.host_bytes
        touch(model, list(range(50, 100)))
        threading.Timer(0.3, gate.open).start()
        third = ck.save(4)  # would pass the bound: waits for the baseline's write
        assert waits and first.done() and third.report.stall_s >= 0.2
        assert first.wait() < second.wait() < third.wait()
        ck.close()

        waits.clear()
        ck = Checkpointer(store, model, codec="fp32", mode="incremental", max_queue_bytes=0)
        gate.event.clear()
        ck.save(5)
        threading.Timer(0.3, gate.open).start()
        touch(model, [2])
        ck.save(6)  # one save at a time: waits for the one before, as before issue 23
        assert waits
        ck.close()
    finally:
        cnrstore.fs.pause_at("checkpointer_waits_for_room", None)
    with pytest.raises(InvalidArgument, match="max_queue_bytes"):
        Checkpointer(store, model, max_queue_bytes=-1)


def test_default_bound_is_a_quarter_of_a_full_snapshot_and_a_store_option(store):
    model = Table()
    ck = Checkpointer(store, model, codec="fp32")  # (no optimizer: the baseline is copied in full)
    base = ck.save(0)
    base.wait()
    assert base.report.baseline and not base.report.streamed
    assert ck.queue_bound() == int(0.25 * base.report.host_bytes)
    with options_changed(store, save_queue_state_fraction=0.5):  # (the store's option: its knob at open)
        assert ck.queue_bound() == base.report.host_bytes // 2
    ck.close()


def test_a_failed_queued_save_is_raised_by_the_next_save_and_the_increments_after_it_are_skipped(
        store, monkeypatch):
    torch.manual_seed(0)
    model = Table()
    ck = Checkpointer(store, model, codec="fp32", mode="incremental", max_queue_bytes=1 << 20, max_lag=None)
    ck.save(0).wait()
    gate = Gate(store, monkeypatch, fail_calls={1})
    touch(model, [1])
    failing = ck.save(1)  # save #2
    touch(model, [2])
    skipped = ck.save(2)  # an increment on save #2's rows: it must not commit without them
    gate.open()
    with pytest.raises(OSError, match="disk unplugged"):
        failing.wait()
    with pytest.raises(cnrstore.SaveSkipped, match="save #2") as info:
        skipped.wait()
    assert isinstance(info.value.__cause__, OSError)
    newest = store.latest().version
    with pytest.raises(OSError, match="disk unplugged") as info:
        ck.save(3)  # raised once, naming the save that failed and this one; no snapshot
    notes = " ".join(getattr(info.value, "__notes__", []))
    assert "save #2 (step 1)" in notes and "re-raised by save #4" in notes
    assert store.latest().version == newest  # neither the failed nor the skipped save committed
    p = ck.save(4)  # then a baseline: the rows of the lost saves are not lost
    p.wait()
    assert p.report.baseline
    np.testing.assert_array_equal(store.read_table("emb"), model.emb.weight.detach().numpy())
    ck.close()


def test_a_baseline_queued_after_a_failure_still_commits(store, monkeypatch):
    """Only increments depend on the save before them: a baseline queued behind a failed save is written."""
    torch.manual_seed(0)
    model = Table()
    ck = Checkpointer(store, model, codec="fp32", mode="incremental", max_queue_bytes=1 << 20, max_lag=None)
    gate = Gate(store, monkeypatch, fail_calls={1})
    failing = ck.save(0)  # the first save is a baseline; it fails
    with torch.no_grad():
        model.emb.weight.add_(1.0)
    ck.note_restore()  # (any path that makes the next save a baseline)
    second = ck.save(1)
    assert second.report.baseline
    gate.open()
    v = second.wait()
    np.testing.assert_array_equal(store.read_table("emb", v), model.emb.weight.detach().numpy())
    with pytest.raises(OSError):
        ck.close()  # the failure nobody was told of yet
    assert failing.done() and failing.failure() is not None


def test_close_and_restore_wait_for_every_queued_save(store, monkeypatch):
    torch.manual_seed(0)
    model = Table()
    ck = Checkpointer(store, model, codec="fp32", mode="incremental", max_queue_bytes=1 << 20, max_lag=None)
    gate = Gate(store, monkeypatch)
    pendings = []
    for i in range(3):
        touch(model, [i])
        with torch.no_grad():
            model.emb.weight[i] += 1.0
        pendings.append(ck.save(i))
    want = model.emb.weight.detach().numpy().copy()
    threading.Timer(0.2, gate.open).start()
    info = ck.restore()  # waits for all three; the newest is the third
    assert all(p.done() for p in pendings) and info.version == pendings[-1].wait()
    np.testing.assert_array_equal(model.emb.weight.detach().numpy(), want)
    gate.event.clear()
    touch(model, [5])
    queued = [ck.save(10), ck.save(11)]
    threading.Timer(0.2, gate.open).start()
    ck.close()
    assert all(p.done() for p in queued) and queued[0].wait() < queued[1].wait()


# -- wrong shapes ---------------------------------------------------------------------------------------

def test_wrong_shape_raises_clear_error(store):
    torch.manual_seed(0)
    model, opt = make(0)
    ck = Checkpointer(store, model, opt, codec="fp32")
    ck.save(0).wait()
    ck.close()

    class Wider(TinyDLRM):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(50, 8)

    with pytest.raises(InvalidArgument, match=r"'emb'.*50 rows x 4 dims.*50 x 8"):
        Checkpointer(store, Wider(), codec="fp32")

    other = TinyDLRM()
    other.bottom = nn.Linear(5, 4)
    before = copy.deepcopy(other.state_dict())
    ck2 = Checkpointer(store, other, codec="fp32")
    with pytest.raises(InvalidArgument, match=r"bottom.weight.*\(4, 3\).*\(4, 5\)"):
        ck2.restore()
    assert_state_equal(before, other.state_dict())  # nothing half-loaded
    ck2.close()


def test_list_of_optimizers_restores_exactly(store):
    model, _ = make(0)
    emb_params = [model.emb.weight, model.bag.weight]
    rest = [p for p in model.parameters() if all(p is not q for q in emb_params)]
    opts = [torch.optim.Adagrad(emb_params, lr=0.1), torch.optim.SGD(rest, lr=0.1, momentum=0.9)]

    class Both:
        def zero_grad(self):
            for o in opts:
                o.zero_grad()

        def step(self):
            for o in opts:
                o.step()

    ck = Checkpointer(store, model, opts, codec="fp32", mode="one-shot")
    for i in range(3):
        train_step(model, Both(), batch(i))
        ck.save(i)
    ck.save(3).wait()
    expect = copy.deepcopy([model.state_dict()] + [o.state_dict() for o in opts])
    for i in range(3):
        train_step(model, Both(), batch(10 + i))
    ck.restore()
    assert_state_equal(expect, [model.state_dict()] + [o.state_dict() for o in opts])
    ck.close()


def test_bad_arguments(store):
    with pytest.raises(InvalidArgument, match="mode"):
        Checkpointer(store, Table(), mode="sometimes")
    with pytest.raises(InvalidArgument):
        Checkpointer(store, Table(), codec="int99")
    ck = Checkpointer(store, Table(), codec="fp32")
    with pytest.raises(InvalidArgument, match="meta"):
        ck.save(0, meta={"f": object()})
    with pytest.raises(InvalidArgument, match="step"):
        ck.save("zero")
    assert ck.save(0).wait() == store.latest().version
    ck.close()


# -- lossy codecs ----------------------------------------------------------------------------------------

def test_int4_restore_gives_decoded_saved_rows(store):
    check_int4_restore(store)


def test_bit_width_policy_picks_codec_and_counts_restores(store):
    torch.manual_seed(0)
    model = Table()
    policy = BitWidthPolicy(expected_restores=0.5, table=PAPER_TABLE)  # -> 2 bits; 8 bits once a restore exceeds it
    ck = Checkpointer(store, model, codec=policy, mode="incremental")
    assert store.tables()["emb"].codec == "int2"
    saved = model.emb.weight.detach().numpy().copy()
    ck.save(0).wait()
    ck.restore()
    assert policy.restores == 1 and policy.codec() == "int8"
    c2 = cnrstore.codecs.get("int2")
    np.testing.assert_array_equal(model.emb.weight.detach().numpy(), c2.decode(c2.encode(saved), 3))
    with torch.no_grad():
        model.emb.weight.add_(0.5)
    touch(model, list(range(100)))
    saved = model.emb.weight.detach().numpy().copy()
    ck.save(1).wait()  # every row touched: all written, now in int8
    c8 = cnrstore.codecs.get("int8")
    np.testing.assert_array_equal(store.read_table("emb"), c8.decode(c8.encode(saved), 3))
    ck.close()


# -- restore straight into the live tensors --------------------------------------------------------------

@pytest.mark.parametrize("threads", [1, 4])
@pytest.mark.parametrize("codec", ["fp32", "int4"])
def test_restore_decodes_into_the_live_weights_and_optimizer_state(store, threads, codec):
    """The weights and Adagrad's ``sum`` tensors are written in place (same tensors, same memory) and hold
    what the plain reads give (store.read_table on one thread): the parallel path equals the old one."""
    model, opt = make(0)
    ck = Checkpointer(store, model, opt, codec=codec, mode="incremental")
    for i in range(2):
        train_step(model, opt, batch(i))
        ck.save(i).wait()
    for i in range(2, 5):
        train_step(model, opt, batch(i))
    weights = [model.emb.weight, model.bag.weight]
    ptrs = [w.data_ptr() for w in weights]
    sums = [opt.state[w]["sum"] for w in weights]
    with options_changed(store, decode_threads=threads, decode_inline_bytes=0):  # (small: the pool all the same)
        ck.restore()
    for name, w, ptr, s in zip(["emb", "bag"], weights, ptrs, sums):
        assert w.data_ptr() == ptr and opt.state[w]["sum"] is s
        assert np.array_equal(w.detach().numpy(), store.read_table(name))
        assert np.array_equal(s.numpy(), store.read_table(f"{name}.optim.sum"))
    ck.close()


def test_restore_of_a_corrupt_store_leaves_model_and_optimizer_unchanged(store):
    """A damaged record of the last table restore reads (a row-wise optimizer state) is found before the
    first byte of any weight or state changes: CorruptionError, and every tensor as it was."""
    from cnrstore.engine import filenames
    from cnrstore.errors import CorruptionError

    model, opt = make(0)
    ck = Checkpointer(store, model, opt, codec="fp32", mode="incremental")
    train_step(model, opt, batch(0))
    ck.save(0).wait()
    with store.engine.read() as view:
        ids = {info.id: name for name, info in view.tables().items()}
        loc = next(loc for t, _b, _v, loc in view.row_entries() if ids[t] == "bag.optim.sum")
    with open(filenames.segment_path(store.path, loc.segment), "r+b") as f:
        f.seek(loc.offset + loc.length - 20)
        byte = f.read(1)
        f.seek(loc.offset + loc.length - 20)
        f.write(bytes([byte[0] ^ 0x10]))
    train_step(model, opt, batch(1))
    expect_model = copy.deepcopy(model.state_dict())
    expect_opt = copy.deepcopy(opt.state_dict())
    with pytest.raises(CorruptionError):
        ck.restore()
    assert_state_equal(expect_model, model.state_dict())
    assert_state_equal(expect_opt, opt.state_dict())
    ck.close()
