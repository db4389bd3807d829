"""TorchftTransport in one process: a sender's image of a step, rebuilt by a receiver from the store
(cnrstore/distributed/torchft_transport.py). The heals under torchft's own Manager, with processes killed
and replaced, are in test_torchft_recovery.py."""

import copy
import threading
import time
from datetime import timedelta

import pytest
import torch
from torch import nn

pytest.importorskip("torchft")

from cnrstore.distributed import TorchftTransport  # noqa: E402
from cnrstore.engine import fs  # noqa: E402
from cnrstore.errors import InvalidArgument, RecoveryFailed  # noqa: E402
from cnrstore.torch import Checkpointer  # noqa: E402
from support.torch_state import assert_state_equal  # noqa: E402

TIMEOUT = timedelta(seconds=20)


class Model(nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.bag = nn.EmbeddingBag(2000, 16, mode="sum")
        self.emb = nn.Embedding(500, 8)
        self.top = nn.Linear(24, 1)

    def forward(self, ids_a, ids_b):
        return self.top(torch.cat([self.bag(ids_a), self.emb(ids_b).sum(1)], 1)).sum()


class Trainer:
    """A model, an Adagrad on its tables (row-wise state), an Adam on its dense layer, and a Checkpointer."""

    def __init__(self, path, seed: int, **ckpt_args):
        self.model = Model(seed)
        self.sparse = torch.optim.Adagrad([self.model.bag.weight, self.model.emb.weight], lr=0.1)
        self.dense = torch.optim.Adam(self.model.top.parameters(), lr=0.01)
        self.ckpt = Checkpointer(path, self.model, [self.sparse, self.dense], **ckpt_args)
        self.loader = {"position": 0}

    def train(self, steps: int, seed: int = 0) -> None:
        for _ in range(steps):
            g = torch.Generator().manual_seed(seed + self.loader["position"])
            a, b = torch.randint(2000, (8, 5), generator=g), torch.randint(500, (8, 3), generator=g)
            self.sparse.zero_grad()
            self.dense.zero_grad()
            self.model(a, b).backward()
            self.sparse.step()
            self.dense.step()
            self.loader["position"] += 1

    def state_dict(self) -> dict:  # what torchft's Manager hands its transport (Manager._manager_state_dict)
        return {"user": {"default": {"model": self.model.state_dict(), "sparse": self.sparse.state_dict(),
                                     "dense": self.dense.state_dict(), "loader": dict(self.loader)}},
                "torchft": {"step": self.loader["position"], "batches_committed": 2 * self.loader["position"]}}

    def load_state_dict(self, sd: dict) -> None:
        user = sd["user"]["default"]
        self.model.load_state_dict(user["model"])
        self.sparse.load_state_dict(user["sparse"])
        self.dense.load_state_dict(user["dense"])
        self.loader = dict(user["loader"])


def trained_past_a_save(t: Trainer) -> int:
    """3 steps, a save (committed), then 2 steps that change rows after it -> the save's version."""
    t.train(3)
    version = t.ckpt.save(3).wait()
    t.train(2)
    return version


@pytest.fixture
def pair(tmp_path):
    made = []

    def make(kind: str = "replicated", **ckpt_args):
        source = Trainer(tmp_path / f"a{len(made)}", seed=1, **ckpt_args)
        healer = Trainer(tmp_path / f"b{len(made)}", seed=2)
        ta, tb = TorchftTransport(source.ckpt, tables=kind, host="127.0.0.1"), TorchftTransport(
            healer.ckpt, tables=kind, host="127.0.0.1")
        made.append((source, healer, ta, tb))
        return source, healer, ta, tb

    yield make
    for source, healer, ta, tb in made:
        ta.shutdown()
        tb.shutdown()
        source.ckpt.close()
        healer.ckpt.close()


def heal(source, healer, ta, tb, step: int):
    ta.send_checkpoint([1], step, source.state_dict(), TIMEOUT)
    got = tb.recv_checkpoint(0, ta.metadata(), step, TIMEOUT)
    healer.load_state_dict(got["user"] and got)
    return got


def test_heals_bit_for_bit_from_the_newest_save_and_the_rows_changed_since(pair):
    source, healer, ta, tb = pair()
    source.train(4)
    saved = source.ckpt.save(4)  # (not waited for: the peer's server waits for its commit)
    source.train(3)  # a few rows change after the save
    expected = source.state_dict()
    got = heal(source, healer, ta, tb, 7)
    assert_state_equal(expected, got)
    assert_state_equal(expected["user"], healer.state_dict()["user"])
    # only the changed rows travelled; the rest came from the store at the save's version
    assert tb.last_recv.version == saved.wait()
    assert not ta.last_send.whole and not tb.last_recv.whole
    assert 0 < ta.last_send.rows["bag"] < 2000 and ta.last_send.rows["bag.optim.sum"] == ta.last_send.rows["bag"]
    assert tb.last_recv.bytes < 2000 * 16 * 4  # less than one of the tables, whole
    healer.train(2)
    source.train(2)
    assert_state_equal(source.state_dict(), healer.state_dict())  # and they train on equal


def test_a_heal_waits_for_the_streamed_save_it_builds_on_then_is_exact(pair):
    """A schedule: the save the image builds on is still being written (a streamed save held at its first
    chunk) while the sender trains on and takes the image; the peer's answer waits for that save's commit."""
    source, healer, ta, tb = pair()
    trained_past_a_save(source)
    reached, release = threading.Event(), threading.Event()

    def hold(_name, *_detail):
        reached.set()
        release.wait(30)

    fs.pause_at("streamed_chunk_written", hold)
    got = {}
    try:
        pending = source.ckpt.save(5)  # an increment written from the live tensors: held at its first chunk
        assert reached.wait(30) and pending.report.streamed
        source.train(2)  # rows change under the save being written (copied aside before each step)
        expected = copy.deepcopy(source.state_dict())
        ta.send_checkpoint([1], 7, source.state_dict(), TIMEOUT)
        fetch = threading.Thread(target=lambda: got.update(state=tb.recv_checkpoint(0, ta.metadata(), 7, TIMEOUT)))
        fetch.start()
        time.sleep(0.5)
        assert fetch.is_alive() and not pending.done()  # the answer waits for the save's commit
    finally:
        release.set()
        fs.pause_at("streamed_chunk_written", None)
    fetch.join(30)
    assert_state_equal(expected, got["state"])
    assert tb.last_recv.version == pending.wait() and not tb.last_recv.whole


def test_the_image_is_the_step_sent_even_when_the_sender_trains_on_before_the_fetch(pair):
    source, healer, ta, tb = pair()
    trained_past_a_save(source)
    frozen = {k: v.clone() for k, v in source.model.state_dict().items()}
    ta.send_checkpoint([1], 5, source.state_dict(), TIMEOUT)
    ta.disallow_checkpoint()  # returns at once: the image is a copy
    source.train(4)  # the live tensors move on before the receiver asks
    got = tb.recv_checkpoint(0, ta.metadata(), 5, TIMEOUT)
    for k, v in frozen.items():
        assert torch.equal(got["user"]["default"]["model"][k], v)
    assert got["torchft"]["step"] == 5


@pytest.mark.parametrize("why", ["no save yet", "int8 codec"])
def test_tables_travel_whole_when_the_store_cannot_rebuild_them_exactly(pair, why):
    source, healer, ta, tb = pair(**({"codec": "int8"} if why == "int8 codec" else {}))
    source.train(3)
    if why == "int8 codec":
        source.ckpt.save(3).wait()
        source.train(1)
    expected = source.state_dict()
    got = heal(source, healer, ta, tb, source.loader["position"])
    assert_state_equal(expected, got)
    assert sorted(tb.last_recv.whole) == ["bag", "bag.optim.sum", "emb", "emb.optim.sum"]
    assert tb.last_recv.version is None


def test_own_tables_come_from_the_healing_groups_own_store_cpr(pair):
    source, healer, ta, tb = pair("own")
    healer.train(3, seed=100)  # the healing group's own shard (its predecessor's), saved at its step 3
    healer.ckpt.save(3).wait()
    own = {k: v.clone() for k, v in healer.model.state_dict().items() if k.endswith("weight") and "top" not in k}
    own_sum = healer.sparse.state_dict()["state"][0]["sum"].clone()
    healer.train(2, seed=100)  # lost with the process: CPR restores the saved rows
    source.train(6)
    expected = source.state_dict()
    got = heal(source, healer, ta, tb, 6)
    model = got["user"]["default"]["model"]
    for k, v in own.items():
        assert torch.equal(model[k], v), k
    assert torch.equal(got["user"]["default"]["sparse"]["state"][0]["sum"], own_sum)
    for k in ("top.weight", "top.bias"):  # the replicated layers come from the peer
        assert torch.equal(model[k], expected["user"]["default"]["model"][k])
    assert_state_equal(expected["user"]["default"]["dense"], got["user"]["default"]["dense"])
    assert got["torchft"] == expected["torchft"]
    assert ta.last_send.rows == {} and not ta.last_send.whole


def test_a_table_twice_in_the_state_dict_is_rebuilt_once_into_both_places(pair):
    source, healer, ta, tb = pair()
    trained_past_a_save(source)
    state = source.state_dict()
    state["user"]["default"]["tied"] = source.model.bag.weight  # an output layer tied to the table, say
    ta.send_checkpoint([1], 5, state, TIMEOUT)
    healer.ckpt.close()  # (a healing group with no tables of its own: the rows land in new tensors)
    healer.ckpt = Checkpointer(healer.ckpt.store.path + "-other", nn.Linear(2, 2))
    tb.checkpointer = healer.ckpt
    got = tb.recv_checkpoint(0, ta.metadata(), 5, TIMEOUT)
    user = got["user"]["default"]
    assert torch.equal(user["tied"], source.model.bag.weight) and user["tied"] is user["model"]["bag.weight"]


def test_keep_leaves_the_healing_groups_tables_to_it(pair):
    source, healer, ta, tb = pair("keep")
    healer.train(2, seed=100)
    mine = {k: v.clone() for k, v in healer.model.state_dict().items()}
    source.train(4)
    expected = source.state_dict()
    got = heal(source, healer, ta, tb, 4)
    model = got["user"]["default"]["model"]
    for k in ("bag.weight", "emb.weight"):  # untouched: ECRM decodes them next
        assert torch.equal(model[k], mine[k]) and model[k].data_ptr() == healer.model.state_dict()[k].data_ptr()
    for k in ("top.weight", "top.bias"):
        assert torch.equal(model[k], expected["user"]["default"]["model"][k])
    assert got["torchft"] == expected["torchft"] and tb.last_recv.version is None


def test_own_tables_without_a_stored_version_are_refused(pair):
    source, healer, ta, tb = pair("own")
    source.train(2)
    ta.send_checkpoint([1], 2, source.state_dict(), TIMEOUT)
    with pytest.raises(RecoveryFailed, match="holds no version"):
        tb.recv_checkpoint(0, ta.metadata(), 2, TIMEOUT)


def test_a_fetch_of_another_step_or_from_a_stranger_fails_with_the_reason(pair):
    source, healer, ta, tb = pair()
    source.train(2)
    ta.send_checkpoint([1], 2, source.state_dict(), TIMEOUT)
    with pytest.raises(RecoveryFailed, match="at step 2, not 1"):
        tb.recv_checkpoint(0, ta.metadata(), 1, TIMEOUT)
    with pytest.raises(RecoveryFailed, match="no image of step 3 within"):
        tb.recv_checkpoint(0, ta.metadata(), 3, timedelta(seconds=0.3))
    with pytest.raises(RecoveryFailed, match="not a cnrstore TorchftTransport"):
        tb.recv_checkpoint(0, "http://somewhere:1234/checkpoint", 2, TIMEOUT)
    ta.shutdown()
    with pytest.raises(RecoveryFailed, match="failed"):
        tb.recv_checkpoint(0, ta.metadata(), 2, timedelta(seconds=2))


def test_a_base_version_dropped_before_the_fetch_fails_the_heal_with_the_reason(pair):
    source, healer, ta, tb = pair()
    source.train(2)
    first = source.ckpt.save(2).wait()
    source.train(1)
    ta.send_checkpoint([1], 3, source.state_dict(), TIMEOUT)  # (its rows are relative to `first`)
    source.ckpt.save(3).wait()
    source.ckpt.store.drop_versions([first])  # retention, between the peer's image and the fetch
    with pytest.raises(RecoveryFailed, match=f"version {first} .* is gone"):
        tb.recv_checkpoint(0, ta.metadata(), 3, TIMEOUT)


def test_bad_arguments_are_refused(tmp_path):
    with pytest.raises(InvalidArgument, match="Checkpointer"):
        TorchftTransport(object())
    t = Trainer(tmp_path / "s", seed=0)
    with pytest.raises(InvalidArgument, match="'replicated', 'own', 'keep'"):
        TorchftTransport(t.ckpt, tables="mine")
    t.ckpt.close()
