"""ECRM: the erasure code and recovery on spawned gloo jobs (tests/support/ecrm_worker.py); the parity layout and
the fingerprints are test_distributed_stripes.py's; the jobs are run by tests/support/ecrm_jobs.py.

The code tests run in one process. The spawned tests kill ranks
with SIGKILL at named points of the parity update (and of the decode), re-form the group with
replacement processes, and compare every rank's final state -- weights, Adagrad state, dense head and the
parity itself -- bit for bit with the same job run without a failure.
"""

from __future__ import annotations

import functools
import gc
import itertools
import threading
import types
import weakref

import numpy as np
import pytest
import torch

from support.ecrm_jobs import STEPS, assert_bit_equal, reference, run_job

from cnrstore.distributed import ECRM, gf256
from cnrstore.distributed.ecrm import _Item, _Poster, _row_bits
from cnrstore.distributed.ecrm_space import DataSpace
from cnrstore.distributed.stripes import StripeLayout
from cnrstore.errors import InvalidArgument, PeerFailure
from cnrstore.torch.guard import grad_rows


# -- the code ------------------------------------------------------------------------------------------------

def gf_matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    out = np.zeros((a.shape[0], b.shape[1]), dtype=np.uint8)
    for i in range(a.shape[0]):
        for j in range(b.shape[1]):
            acc = 0
            for m in range(a.shape[1]):
                acc ^= int(gf256.MUL[a[i, m], b[m, j]])
            out[i, j] = acc
    return out


def test_field_tables():
    a = np.arange(256)
    assert (gf256.MUL[1] == a).all() and (gf256.MUL[0] == 0).all()
    assert (gf256.MUL == gf256.MUL.T).all()
    assert (gf256.MUL[a[1:], gf256.INV[1:]] == 1).all()
    x, y, z = 0x53, 0xCA, 0x9E                         # distributive over XOR
    assert gf256.MUL[x, y ^ z] == gf256.MUL[x, y] ^ gf256.MUL[x, z]


@pytest.mark.parametrize("k,r", [(1, 1), (2, 1), (3, 2), (4, 2), (4, 3), (6, 4)])
def test_every_k_shards_decode_the_data(k, r):
    g = gf256.generator_matrix(k, r)
    assert (g[k] == 1).all()                           # parity 0 is XOR
    for avail in itertools.combinations(range(k + r), k):
        d = gf256.decode_matrix(k, r, list(avail))
        assert (gf_matmul(d, g[list(avail)]) == np.eye(k, dtype=np.uint8)).all(), avail


def test_the_pair_table_kernel_equals_the_byte_table():
    rng = np.random.default_rng(5)
    data = rng.integers(0, 256, 3 * gf256.PAIR_MIN_BYTES, dtype=np.uint8)
    for c in (0, 1, 2, 0x53, 255):
        assert np.array_equal(gf256.mul(c, data), gf256.MUL[c][data])
        assert np.array_equal(gf256.mul(c, data[:7]), gf256.MUL[c][data[:7]])      # short / odd: byte table
    lens = rng.integers(0, 9, 40)
    coefs = rng.integers(0, 256, 40).astype(np.uint8)
    words = rng.integers(0, 2**32, int(lens.sum()), dtype=np.uint32)
    out = gf256.mul_words(words, coefs, lens)
    ends = np.cumsum(lens)
    for c, lo, hi in zip(coefs, ends - lens, ends):
        assert np.array_equal(out[lo:hi].view(np.uint8), gf256.MUL[c][words[lo:hi].view(np.uint8)])
    with pytest.raises(InvalidArgument, match="runs cover"):
        gf256.mul_words(words, coefs, lens + 1)


def test_bad_codes_are_refused():
    with pytest.raises(InvalidArgument, match="k \\+ r <= 256"):
        gf256.encode_matrix(200, 100)
    with pytest.raises(InvalidArgument, match="singular"):
        gf256.invert(np.array([[1, 1], [1, 1]], dtype=np.uint8))


# -- the step's bookkeeping, in one process ------------------------------------------------------------------

def _space(block: int, shift: int = 0):
    """Two row-tracked tables (5 x 4 and 3 x 8 words, each with a row-wise state) and a one-word fixed
    item, placed at multiples of ``block`` (plus ``shift``) as ECRM places them."""
    tensors = [(torch.arange(20, dtype=torch.int32).view(5, 4), 0), (torch.arange(100, 120, dtype=torch.int32).view(5, 4), 0),
               (torch.arange(200, 224, dtype=torch.int32).view(3, 8), 1), (torch.tensor([7], dtype=torch.int32), None),
               (torch.arange(300, 324, dtype=torch.int32).view(3, 8), 1)]
    items, base = [], 0
    for n, (t, table) in enumerate(tensors):
        base = -(-base // block) * block + (shift if n == 1 else 0)
        words = t.view(t.shape[0] if t.dim() else 1, -1)
        items.append(_Item(f"item{n}", words, base, table, t))
        base += words.numel()
    words = -(-base // block) * block
    return DataSpace(items, [5, 3], words, block), [t.clone() for t, _table in tensors], items


def test_a_step_gathers_and_scatters_whole_blocks_of_the_rows_it_names():
    space, before, items = _space(4)
    rows = np.array([1, 4, 5 + 2])                               # rows 1, 4 of table 0, row 2 of table 1
    blocks = space.blocks(rows)
    got = space.gather(blocks)
    assert got.shape == (blocks.size, 4) and len(set(blocks.tolist())) == blocks.size
    want = np.concatenate([before[0][1], before[1][1], before[0][4], before[1][4], before[2][2], before[4][2],
                           before[3], np.zeros(3, dtype=np.int32)]).view(np.uint32)
    assert np.array_equal(got.reshape(-1), want)                # row after row, its items in order, then fixed
    space.scatter(blocks, got ^ np.uint32(0xFFFFFFFF))
    assert (items[2].tensor[2] == ~before[2][2]).all() and (items[0].tensor[0] == before[0][0]).all()
    space.scatter(blocks, got)
    assert all(torch.equal(it.tensor, b) for it, b in zip(items, before))
    with pytest.raises(InvalidArgument, match="must divide"):
        _space(4, shift=2)                                       # a table's state not at a block boundary


def test_the_gradient_rows_are_read_from_the_raw_bits_like_grad_rows():
    """Every row a gradient has a non-zero bit in is marked (-0.0 and NaN too), for the layouts the
    row-wise ``any`` reads (fp32, an odd bfloat16 row) and those it leaves to ``grad_rows`` (sparse)."""
    grads = [torch.zeros(6, 4), torch.zeros(5, 3, dtype=torch.bfloat16),
             torch.sparse_coo_tensor(torch.tensor([[4, 1]]), torch.ones(2, 2), (6, 2), check_invariants=True), None]
    grads[0][1, 3], grads[0][2, 0], grads[0][5, 2] = -0.0, float("nan"), 1e-30
    grads[1][3, 2] = -0.0
    assert _row_bits(grads[0], 6).dtype == torch.int64 and _row_bits(grads[1], 5).dtype == torch.int16
    assert _row_bits(grads[2], 6) is None and _row_bits(grads[0], 7) is None
    rows = [6, 5, 6, 4]
    space = types.SimpleNamespace(grad_mask=torch.ones(sum(rows), dtype=torch.bool))
    ends = np.cumsum(rows)
    masks = [space.grad_mask[e - n:e] for e, n in zip(ends, rows)]
    tables = [types.SimpleNamespace(weight=types.SimpleNamespace(grad=g)) for g in grads]
    ECRM._mark_grad_rows(types.SimpleNamespace(space=space, _tables=tables, _grad_masks=masks))
    for g, m, n in zip(grads, masks, rows):
        want = torch.zeros(n, dtype=torch.bool)
        want[grad_rows(g, n)] = True
        assert torch.equal(m, want)
    assert masks[0].nonzero().flatten().tolist() == [1, 2, 5] and masks[2].nonzero().flatten().tolist() == [1, 4]


@pytest.mark.parametrize("wide", [False, True])
@pytest.mark.parametrize("world,k,r", [(2, 1, 1), (4, 3, 1), (5, 2, 2)])
def test_a_steps_messages_carry_each_holder_its_scaled_blocks(world, k, r, wide, monkeypatch):
    """``_messages`` then ``_parse``: every changed block reaches the holder of each of its parity slots,
    at its parity block, times its coefficient (uint32 block indices, or int64 ones for a parity of 2^32
    blocks or more)."""
    g, rank = 4, 1
    lay = StripeLayout(world, k, r, [4000] * world, unit_words=64, block=g)
    me = types.SimpleNamespace(layout=lay, r=r, rank=rank, world_size=world, _wide_index=lambda: wide)
    me._parse = lambda body: ECRM._parse(me, body)
    rng = np.random.default_rng(world * 10 + r)
    blocks = rng.choice(lay.data_words // g, 300, replace=False)
    payload = rng.integers(0, 2**32, (300, g), dtype=np.uint64).astype(np.uint32)
    out = ECRM._messages(me, blocks, payload)
    assert rank not in out
    got = {}
    for dst, parts in out.items():
        assert all(p.dtype == np.uint32 for p in parts)
        index, words = me._parse(np.concatenate(parts))
        assert index.dtype == (np.int64 if wide else np.uint32) and len(set(index.tolist())) == index.size
        got.update({(dst, int(i)): w for i, w in zip(index, words)})
    assert len(got) == 300 * r
    for b, w in zip(blocks, payload):
        for j in range(r):
            dest, ppos, idx = lay.route(rank, np.array([b * g]), j)
            coef = lay.matrix[j, idx[0]]
            assert np.array_equal(got[(int(dest[0]), int(ppos[0]) // g)].view(np.uint8), gf256.MUL[coef][w.view(np.uint8)])


def test_the_posting_thread_hands_back_errors_holds_nothing_between_rounds_and_stops():
    """``_Poster``: a round's error is raised at ``join`` (on the training thread), a round not out in time
    is a PeerFailure, the thread keeps no reference to the last round (which holds the exchange and its
    process group: a daemon frame keeping it aborted the process at exit), and ``close`` ends the thread."""
    poster = _Poster()

    class Round:
        def __init__(self):
            self.ran = threading.Event()

        def post(self):
            self.ran.set()

    rnd = Round()
    poster.submit(functools.partial(rnd.post))
    poster.join(5)
    assert rnd.ran.is_set()
    ref = weakref.ref(rnd)
    del rnd
    gc.collect()
    assert ref() is None                                 # the thread let go of the round it posted

    def fail():
        raise RuntimeError("peer gone")

    poster.submit(fail)
    with pytest.raises(RuntimeError, match="peer gone"):
        poster.join(5)
    release = threading.Event()
    poster.submit(release.wait)
    with pytest.raises(PeerFailure, match="not out after"):
        poster.join(0.05)
    release.set()
    thread = poster._thread
    poster.close()
    assert not thread.is_alive()


# -- spawned jobs -------------------------------------------------------------------------------------------

def test_parity_memory_and_traffic_are_what_the_layout_implies(tmp_path_factory):
    states, reports = reference(tmp_path_factory, 3, 2, 1)
    for q, rep in reports.items():
        lengths = rep["data_words"]
        lay = StripeLayout(3, 2, 1, lengths, block=rep["block"])
        assert rep["block"] == 2 and lay.unit % 2 == 0   # rows of 8, 4 and 6 words: whole blocks of 2
        assert rep["parity_bytes"] == lay.parity_words * 4 == states[q]["parity"].nbytes
        assert rep["parity_bytes"] <= (max(lengths) / 2 + 2 * lay.unit) * 4   # about r/k of the largest shard
        assert len(rep["traffic"]) == STEPS
        for t in rep["traffic"]:
            assert t["changed_words"] > 0
            assert t["payload"] == 1 * 4 * t["changed_words"]      # r copies of each changed block
            assert t["sent"] > t["payload"]                         # plus the positions
    _s2, reports2 = reference(tmp_path_factory, 4, 2, 2)
    for rep in reports2.values():
        for t in rep["traffic"]:
            assert t["payload"] == 2 * 4 * t["changed_words"]


@pytest.mark.parametrize("crash,overlap", [("kill", True), ("kill", False), ("ecrm_before_send", True),
                                           ("ecrm_partial_send", True), ("ecrm_after_apply", True),
                                           ("ecrm_after_apply", False)])
def test_one_failure_r1_is_recovered_bit_exactly(tmp_path, tmp_path_factory, crash, overlap):
    ref, _ = reference(tmp_path_factory, 3, 2, 1)
    states, reports = run_job(tmp_path, crash, 3, 2, 1, victims=[1], crash=crash, overlap=overlap)
    assert_bit_equal(states, ref)
    recs = [rep["recoveries"][-1] for rep in reports.values()]
    assert {r["mode"] for r in recs} == {"ecrm"}
    steps = {r["step"] for r in recs}
    assert len(steps) == 1                                  # every rank is at the same step
    if crash == "kill" and overlap:
        # killed right after its step: its round may not have left (then step 3 is redone); never older
        assert steps <= {2, 3}
    else:
        # before the send (or a send that reached only some holders) the step is undone and redone; with
        # overlap, step 3's first apply is step 2's round (at step 3's start): the victim dies before step 3
        early = ("ecrm_before_send", "ecrm_partial_send") + (("ecrm_after_apply",) if overlap else ())
        assert steps == {2 if crash in early else 3}
    assert reports[1]["recoveries"][-1]["replacement"] and reports[1]["recoveries"][-1]["bytes_received"] > 0
    assert_learned_promptly(reports, [1])


def test_rows_changed_by_a_gradient_no_lookup_made_are_in_the_parity(tmp_path, tmp_path_factory):
    """Issue 48's fault class in ECRM: an L2 penalty on the tables gives every row a gradient no lookup made.
    The parity followed the looked-up rows only, so a decoded shard was silently wrong (or its fingerprint
    refused); the rows of each weight's gradient are now in every step's undo log, and recovery is exact."""
    ref, _ = run_job(tmp_path_factory.mktemp("ref-l2"), "ref", 3, 2, 1, l2=1e-3)
    states, reports = run_job(tmp_path, "l2", 3, 2, 1, victims=[1], l2=1e-3, overlap=False)
    assert_bit_equal(states, ref)
    assert {rep["recoveries"][-1]["mode"] for rep in reports.values()} == {"ecrm"}


def test_messages_longer_than_their_capacity_take_a_second_send(tmp_path, tmp_path_factory):
    """Every pair starts at a capacity of 16 words: the first rounds send each message's tail as a second
    message, later ones fit (the capacity follows the lengths); recovery is still bit-exact."""
    ref, _ = reference(tmp_path_factory, 3, 2, 1)
    states, reports = run_job(tmp_path, "cap", 3, 2, 1, victims=[2], crash="kill", capacity=16)
    assert_bit_equal(states, ref)
    assert {rep["recoveries"][-1]["mode"] for rep in reports.values()} == {"ecrm"}


def test_two_simultaneous_failures_r2_are_recovered_bit_exactly(tmp_path, tmp_path_factory):
    ref, _ = reference(tmp_path_factory, 4, 2, 2)
    states, reports = run_job(tmp_path, "two", 4, 2, 2, victims=[1, 2], crash="kill")
    assert_bit_equal(states, ref)
    assert {rep["recoveries"][-1]["mode"] for rep in reports.values()} == {"ecrm"}


def assert_learned_promptly(reports: dict, victims) -> None:
    """Every survivor left the broken group through the failure board or a failed collective (a
    PeerFailure), never by a timeout: the jobs run with PG_TIMEOUT_S far beyond the test's TIMEOUT
    (support/ecrm_jobs.py)."""
    for q, rep in reports.items():
        if q in victims:
            continue
        assert rep["learned"], (q, rep)
        for seen in rep["learned"]:
            assert seen["how"] in ("board", "collective"), (q, seen)
            assert "Timed out" not in seen["cause"], (q, seen)


def test_r2_partial_send_is_recovered_bit_exactly(tmp_path, tmp_path_factory):
    """Rank 3 dies having sent its step-3 deltas to some of their holders only. Every survivor learns of
    it promptly: from a failed collective, or from the failure board where its own collective is one gloo
    does not fail (its peers left the group alive; tests/test_distributed_failures.py shows the board
    ending such a wait). Waiting out the process group's timeout (PG_TIMEOUT_S) fails the test."""
    ref, _ = reference(tmp_path_factory, 4, 2, 2)
    states, reports = run_job(tmp_path, "p2", 4, 2, 2, victims=[3], crash="ecrm_partial_send")
    assert_bit_equal(states, ref)
    assert_learned_promptly(reports, [3])


def test_a_replacement_killed_in_the_decode_is_replaced_again(tmp_path, tmp_path_factory):
    ref, _ = reference(tmp_path_factory, 3, 2, 1)
    states, reports = run_job(tmp_path, "dec", 3, 2, 1, victims=[2], crash="kill", replacement_crash="ecrm_decode")
    assert_bit_equal(states, ref)
    assert len(reports[0]["recoveries"]) == 1 and reports[0]["recoveries"][0]["mode"] == "ecrm"
    assert_learned_promptly(reports, [2])


def test_more_than_r_failures_fall_back_to_the_checkpoint(tmp_path):
    _states, reports = run_job(tmp_path, "many", 3, 2, 1, victims=[1, 2], crash="kill", fail_step=3, ckpt_every=2)
    for rep in reports.values():
        rec = rep["recoveries"][-1]
        assert rec["mode"] == "fallback-partial"
        assert "2 ranks failed at once" in rec["reason"]
        assert rec["step"] == 3


def test_an_inconsistent_parity_is_found_and_falls_back(tmp_path):
    _states, reports = run_job(tmp_path, "bad", 3, 2, 1, victims=[1], crash="kill", fail_step=3, corrupt_step=2,
                               ckpt_every=2, fallback="full")
    for rep in reports.values():
        rec = rep["recoveries"][-1]
        assert rec["mode"] == "fallback-full"
        assert "does not match the fingerprint" in rec["reason"]
        assert rec["step"] == 2


def test_recover_naming_a_rank_that_kept_its_state_is_refused(tmp_path, tmp_path_factory):
    """recover([1]) while rank 1 is alive with its ECRM state (not a replacement): InvalidArgument on every
    rank (none left waiting in a collective), and training goes on to the same end as without it."""
    ref, _ = reference(tmp_path_factory, 3, 2, 1)
    states, reports = run_job(tmp_path, "misnamed", 3, 2, 1, misnamed=[1], misnamed_step=3)
    for rep in reports.values():
        assert "named as failed but kept their ECRM state" in rep["misnamed"]
        assert "replacement=True" in rep["misnamed"]
    assert_bit_equal(states, ref)
