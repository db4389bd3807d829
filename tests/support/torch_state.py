"""Bit-exact comparison of a model's and an optimizer's state, for the tests of restores (test_torch_exact,
test_streamed_saves); and the recursive equality of two state dicts (test_torch_checkpointer, test_torch_staging,
test_cuda)."""

from __future__ import annotations

import torch


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the CPU, float32 viewed as int32, so that ``torch.equal`` compares bits (-0.0, NaN)."""
    t = t.detach().cpu()
    return t.view(torch.int32) if t.dtype == torch.float32 else t


def assert_same_state(model, opt, saved_model: dict, saved_opt: dict) -> None:
    """``model``'s state dict and ``opt``'s state equal ``saved_model`` and ``saved_opt["state"]`` bit for
    bit (the same keys, every tensor's bits, every other value)."""
    for k, v in model.state_dict().items():
        assert torch.equal(bits(v), bits(saved_model[k])), k
    state, want = opt.state_dict()["state"], saved_opt["state"]
    assert state.keys() == want.keys()
    for idx in want:
        assert state[idx].keys() == want[idx].keys()
        for key, val in want[idx].items():
            got = state[idx][key]
            if torch.is_tensor(val):
                assert torch.equal(bits(got), bits(val)), (idx, key)
            else:
                assert got == val, (idx, key)


def assert_state_equal(a, b):
    """``a`` and ``b`` (state dicts, nested) are equal: the same keys and lengths, tensors of the same dtype,
    shape and values."""
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_state_equal(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_state_equal(x, y)
    else:
        assert a == b
