"""Gated delta rule recurrent kernel (Triton, interpreter, fp32): in-place slot states, varlen, GVA."""

from __future__ import annotations

import pytest
import torch
from kernel_testing import cu, poisoned, rel_err

from nibble.kernels.gated_delta import gated_delta_rule_fla, gated_delta_rule_recurrent, gated_delta_rule_ref

HK, HV, DK, DV = 2, 4, 16, 24


def _inputs(t: int) -> tuple[torch.Tensor, ...]:
    return (torch.randn(t, HK, DK), torch.randn(t, HK, DK), torch.randn(t, HV, DV), -torch.rand(t, HV),
            torch.rand(t, HV))


def _case(lens: list[int], slots: list[int]) -> None:
    q, k, v, g, beta = _inputs(sum(lens))
    state = torch.randn(7, HV, DK, DV) * 0.1
    s_ref, s_out = state.clone(), state.clone()
    sl = torch.tensor(slots, dtype=torch.int32)
    ref = gated_delta_rule_ref(q, k, v, g, beta, s_ref, cu(lens), sl)
    out = poisoned(gated_delta_rule_recurrent, [(tuple(v.shape), v.dtype)], q, k, v, g, beta, s_out, cu(lens), sl)
    assert rel_err(out, ref) < 1e-5
    assert rel_err(s_out, s_ref) < 1e-5
    untouched = [i for i in range(7) if i not in slots]
    assert torch.equal(s_out[untouched], state[untouched])


def test_decode_in_place_noncontiguous_slots() -> None:
    _case([1, 1, 1], [5, 0, 3])


def test_varlen() -> None:
    _case([3, 1, 6], [2, 6, 4])


def test_strided_inputs_from_fused_projection() -> None:
    t = 3
    mixed = torch.randn(t, 2 * HK * DK + HV * DV)
    q = mixed[:, :HK * DK].view(t, HK, DK)
    k = mixed[:, HK * DK:2 * HK * DK].view(t, HK, DK)
    v = mixed[:, 2 * HK * DK:].view(t, HV, DV)
    g, beta = -torch.rand(t, HV), torch.rand(t, HV)
    state = torch.randn(4, HV, DK, DV) * 0.1
    s_ref = state.clone()
    sl = torch.tensor([3, 1, 0], dtype=torch.int32)
    ref = gated_delta_rule_ref(q, k, v, g, beta, s_ref, cu([1, 1, 1]), sl)
    out = gated_delta_rule_recurrent(q, k, v, g, beta, state, cu([1, 1, 1]), sl)
    assert rel_err(out, ref) < 1e-5 and rel_err(state, s_ref) < 1e-5


def test_host_offsets_that_disagree_with_the_batch_are_refused() -> None:
    """The fla backend plans its chunks from the host offsets it is given; offsets that do not describe the
    batch are an error naming both, before any kernel runs (so CPU-only is enough to check it)."""
    q, k, v, g, beta = _inputs(10)
    state = torch.zeros(7, HV, DK, DV)
    sl = torch.tensor([2, 6, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seqlens_cpu has 4 offsets ending at 9, expected 4 ending at 10"):
        gated_delta_rule_fla(q, k, v, g, beta, state, cu([3, 1, 6]), sl, cu_seqlens_cpu=[0, 3, 4, 9])


def test_reference_takes_the_host_offsets() -> None:
    q, k, v, g, beta = _inputs(10)
    state = torch.randn(7, HV, DK, DV) * 0.1
    s1, s2 = state.clone(), state.clone()
    sl = torch.tensor([2, 6, 4], dtype=torch.int32)
    a = gated_delta_rule_ref(q, k, v, g, beta, s1, cu([3, 1, 6]), sl)
    b = gated_delta_rule_ref(q, k, v, g, beta, s2, cu([3, 1, 6]), sl, cu_seqlens_cpu=[0, 3, 4, 10])
    assert torch.equal(a, b) and torch.equal(s1, s2)

