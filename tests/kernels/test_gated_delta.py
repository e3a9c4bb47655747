"""Gated delta rule recurrent kernel (Triton, interpreter, fp32): in-place slot states, varlen, GVA."""

from __future__ import annotations

import torch
from kernel_testing import cu, poisoned, rel_err

from nibble.kernels.gated_delta import gated_delta_rule_recurrent, gated_delta_rule_ref

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
