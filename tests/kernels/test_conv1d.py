"""Causal conv1d (Triton, interpreter, fp32): varlen prefill, decode, and state continuity."""

from __future__ import annotations

import torch
from kernel_testing import cu, poisoned, rel_err

from nibble.kernels.conv1d import causal_conv1d, causal_conv1d_ref

C, W = 19, 4


def _case(lens: list[int], slots: list[int]) -> None:
    x = torch.randn(sum(lens), C)
    w = torch.randn(C, W)
    state = torch.randn(8, W - 1, C)
    s_ref, s_out = state.clone(), state.clone()
    sl = torch.tensor(slots, dtype=torch.int32)
    ref = causal_conv1d_ref(x, w, s_ref, cu(lens), sl)
    out = poisoned(causal_conv1d, [(tuple(x.shape), x.dtype)], x, w, s_out, cu(lens), sl)
    assert rel_err(out, ref) < 1e-6
    assert torch.equal(s_out, s_ref)


def test_varlen_prefill() -> None:
    _case([1, 5, 2, 17], [6, 0, 3, 1])


def test_decode_noncontiguous_slots() -> None:
    _case([1, 1, 1], [7, 2, 4])


def test_two_calls_equal_one() -> None:
    x = torch.randn(13, C)
    w = torch.randn(C, W)
    slot = torch.tensor([2], dtype=torch.int32)
    s1 = torch.zeros(3, W - 1, C)
    whole = causal_conv1d(x, w, s1, cu([13]), slot)
    s2 = torch.zeros(3, W - 1, C)
    first = causal_conv1d(x[:2], w, s2, cu([2]), slot)
    second = causal_conv1d(x[2:12], w, s2, cu([10]), slot)
    third = causal_conv1d(x[12:], w, s2, cu([1]), slot)
    assert rel_err(torch.cat((first, second, third)), whole) < 1e-6
    assert torch.allclose(s1, s2)
