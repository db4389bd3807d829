"""Bit-exact comparison of a model's and an optimizer's state, for the tests of restores (test_torch_exact,
test_streamed_saves)."""

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
