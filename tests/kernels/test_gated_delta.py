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



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_with_fused_gating(dtype: torch.dtype) -> None:
    """gated_delta_rule_decode: a and b as strided columns of the fused projection, softplus past its
    threshold and deep in its tail; equal to gdn_gating then the recurrent kernel, and to the reference."""
    from nibble.kernels.gated_delta import gated_delta_rule_decode, gated_delta_rule_decode_ref
    from nibble.kernels.gdn_gating import gdn_gating

    b = 3
    q, k, v = (x.to(dtype) for x in (torch.randn(b, HK, DK), torch.randn(b, HK, DK), torch.randn(b, HV, DV)))
    proj = (torch.randn(b, 2 * HV + 3) * 12).to(dtype)
    bb, a = proj[:, :HV], proj[:, HV + 3:]
    neg_a, dt_bias = -torch.empty(HV).uniform_(1.0, 16.0), torch.randn(HV)
    state = torch.randn(7, HV, DK, DV) * 0.1
    s_ref, s_out, s_two = state.clone(), state.clone(), state.clone()
    slots = torch.tensor([5, 0, 3], dtype=torch.int32)
    ref = gated_delta_rule_decode_ref(q, k, v, a, bb, neg_a, dt_bias, s_ref, slots)
    out = poisoned(gated_delta_rule_decode, [(tuple(v.shape), dtype)], q, k, v, a, bb, neg_a, dt_bias, s_out, slots)
    g, beta = gdn_gating(a, bb, neg_a, dt_bias)
    two = gated_delta_rule_recurrent(q, k, v, g, beta, s_two, cu([1, 1, 1]), slots)
    assert torch.equal(out, two) and torch.equal(s_out, s_two)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert rel_err(out, ref) < tol and rel_err(s_out, s_ref) < tol
    assert torch.equal(s_out[[1, 2, 4, 6]], state[[1, 2, 4, 6]])


def test_decode_with_fused_gating_refuses_prefill_shapes() -> None:
    from nibble.kernels.gated_delta import gated_delta_rule_decode

    q, k, v, g, beta = _inputs(4)
    with pytest.raises(ValueError, match="one token per sequence"):
        gated_delta_rule_decode(q, k, v, g, beta, -torch.ones(HV), torch.zeros(HV), torch.zeros(7, HV, DK, DV),
                                torch.tensor([1, 2, 3], dtype=torch.int32))
