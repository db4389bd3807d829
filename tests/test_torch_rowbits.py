"""cnrstore.torch.rowbits: the one-bit-per-row set of the rows changed since a baseline, against a bool mask
as the model.

Both implementations run here: numpy's (CPU) and torch's (every other device; forced on CPU with
``numpy=False``), so the device path is checked on a machine without a GPU.
"""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cnrstore.torch.rowbits import RowBits

IMPLS = [None, False]  # numpy on CPU, torch's device path


@st.composite
def workloads(draw):
    n = draw(st.integers(1, 200))
    ids = st.lists(st.integers(0, n - 1), max_size=80)
    ops = draw(st.lists(st.one_of(
        st.tuples(st.just("set"), ids),
        st.tuples(st.just("or_mask"), st.lists(st.booleans(), min_size=n, max_size=n)),
        st.tuples(st.just("clear"), st.none())), max_size=12))
    return n, ops


@pytest.mark.parametrize("numpy", IMPLS)
@settings(max_examples=60, deadline=None)
@given(work=workloads())
def test_rowbits_equal_a_bool_mask_under_every_operation(numpy, work):
    n, ops = work
    bits, model = RowBits(n, "cpu", numpy=numpy), np.zeros(n, dtype=bool)
    for op, arg in ops:
        if op == "set":
            bits.set(torch.tensor(arg, dtype=torch.int64))
            model[arg] = True
        elif op == "or_mask":
            bits.or_mask(torch.tensor(arg, dtype=torch.bool))
            model |= np.asarray(arg, dtype=bool)
        else:
            bits.clear()
            model[:] = False
        np.testing.assert_array_equal(bits.rows().numpy(), np.flatnonzero(model))
        assert bits.count() == int(model.sum())


@pytest.mark.parametrize("numpy", IMPLS)
def test_ids_sharing_a_word_and_duplicates_all_land(numpy):
    """An OR scatter, not a plain one: ids of one word in one call (and repeated ids) each set their bit."""
    bits = RowBits(100, "cpu", numpy=numpy)
    bits.set(torch.tensor([[0, 1, 2, 31], [31, 1, 33, 64]]))  # 2-D input, as an nn.Embedding gets it
    bits.set(torch.tensor([99, 99], dtype=torch.int32))
    assert bits.rows().tolist() == [0, 1, 2, 31, 33, 64, 99]


def test_one_bit_per_row_and_nothing_until_set():
    bits = RowBits(1_000_001, "cpu")
    assert bits.nbytes == 0 and bits.count() == 0 and bits.rows().numel() == 0
    bits.set(torch.tensor([5]))
    assert bits.nbytes == 4 * ((1_000_001 + 31) // 32)  # 1 bit per row, rounded up to a 32-bit word


@pytest.mark.parametrize("numpy", IMPLS)
def test_an_id_the_lookup_rejects_never_yields_a_row_past_the_table(numpy):
    """-1 reaches the hook before the embedding raises: it raises IndexError too (torch's path, as the lookup
    would), or whatever bit it sets is no row of the table (numpy's)."""
    bits = RowBits(40, "cpu", numpy=numpy)
    try:
        bits.set(torch.tensor([3, -1]))
    except IndexError:
        assert numpy is False
    assert bits.rows().tolist() in ([3], []) and bits.count() == len(bits.rows())
