"""RMSNorm, q/k RMSNorm, gated RMSNorm and partial RoPE (Triton, interpreter, fp32) against the references."""

from __future__ import annotations

import pytest
import torch
from kernel_testing import poisoned, rel_err

from nibble.kernels.norm import gated_rms_norm, gated_rms_norm_ref, qk_rms_norm, qk_rms_norm_ref, rms_norm, rms_norm_ref
from nibble.kernels.rope import build_cos_sin_cache, rope, rope_ref


@pytest.mark.parametrize("t,h", [(1, 37), (5, 300)])
def test_rms_norm(t: int, h: int) -> None:
    x, res = torch.randn(t, h), torch.randn(t, h) * 3
    w = 1 + 0.1 * torch.randn(h)
    x0, r0 = x.clone(), res.clone()
    out, new_res = poisoned(rms_norm, [((t, h), torch.float32)] * 2, x, w, 1e-6, res)
    ref, ref_res = rms_norm_ref(x, w, 1e-6, res)
    assert rel_err(out, ref) < 1e-6 and rel_err(new_res, ref_res) == 0
    assert torch.equal(x, x0) and torch.equal(res, r0)
    out, none = poisoned(rms_norm, [((t, h), torch.float32)], x, w, 1e-6)
    assert none is None and rel_err(out, rms_norm_ref(x, w, 1e-6)[0]) < 1e-6


def test_rms_norm_3d_input() -> None:
    x = torch.randn(2, 3, 24)
    w = torch.rand(24)
    out, _ = rms_norm(x, w, 1e-5)
    assert rel_err(out, rms_norm_ref(x, w, 1e-5)[0]) < 1e-6


def test_gated_rms_norm() -> None:
    x, g = torch.randn(37, 24), torch.randn(37, 24)
    w = torch.rand(24)
    out = poisoned(gated_rms_norm, [((37, 24), torch.float32)], x, g, w, 1e-6)
    assert rel_err(out, gated_rms_norm_ref(x, g, w, 1e-6)) < 1e-6


@pytest.mark.parametrize("rot", [8, 12])
def test_rope_strided_in_place(rot: int) -> None:
    t, hq, hk, d = 7, 5, 3, 24
    cache = build_cos_sin_cache(rot, 64, 1e4)
    pos = torch.randint(0, 64, (t,))
    q_full = torch.randn(t, hq, 2 * d)
    k = torch.randn(t, hk, d)
    q_ref, k_ref = rope_ref(q_full[..., :d], k, pos, cache)
    gate = q_full[..., d:].clone()
    q_out, k_out = rope(q_full[..., :d], k, pos, cache)
    assert rel_err(q_out, q_ref) < 1e-6 and rel_err(k_out, k_ref) < 1e-6
    assert q_out.data_ptr() == q_full.data_ptr() and k_out.data_ptr() == k.data_ptr()
    assert torch.equal(q_full[..., d:], gate)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,hq,hk,d", [(1, 6, 2, 24), (9, 5, 1, 40)])
def test_qk_rms_norm_heads_of_fused_projection(dtype: torch.dtype, t: int, hq: int, hk: int, d: int) -> None:
    """q: the query half of each [query | gate] head, k: its columns of the fused qkv output (neither can be
    flattened to rows without a copy when T > 1): read in place, one launch for both."""
    qkv = (torch.randn(t, hq * 2 * d + 2 * hk * d) * 3).to(dtype)
    q = qkv[:, :hq * 2 * d].view(t, hq, 2 * d)[..., :d]
    k = qkv[:, hq * 2 * d:hq * 2 * d + hk * d].view(t, hk, d)
    qw, kw = 1 + 0.1 * torch.randn(d), 1 + 0.1 * torch.randn(d)
    before = qkv.clone()
    q_out, k_out = poisoned(qk_rms_norm, [((t, hq, d), dtype), ((t, hk, d), dtype)], q, k, qw, kw, 1e-6)
    q_ref, k_ref = qk_rms_norm_ref(q, k, qw, kw, 1e-6)
    assert q_out.is_contiguous() and k_out.is_contiguous()
    # bf16: the interpreter rounds by truncation, one ulp off the reference at most
    tol = 1e-6 if dtype == torch.float32 else 2.0 ** -6
    assert torch.allclose(q_out.float(), q_ref.float(), rtol=tol, atol=1e-6)
    assert torch.allclose(k_out.float(), k_ref.float(), rtol=tol, atol=1e-6)
    assert torch.equal(qkv, before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])  # the interpreter's bf16 norms are NaN
@pytest.mark.parametrize("t,h", [(1, 64), (5, 100), (9, 1000)])
def test_rms_norm_moe_equals_combine_then_norm(dtype: torch.dtype, t: int, h: int) -> None:
    """rms_norm_moe: the gate logit a strided column of a fused projection; bitwise moe_combine then
    rms_norm (the launches it replaces), and the reference."""
    from nibble.kernels.activation import moe_combine
    from nibble.kernels.norm import rms_norm, rms_norm_moe, rms_norm_moe_ref

    routed, shared, res = ((torch.randn(t, h) * s).to(dtype) for s in (1.0, 2.0, 4.0))
    proj = (torch.randn(t, 7) * 3).to(dtype)
    gate_logit = proj[:, 5:6]
    w = 1.0 + 0.1 * torch.randn(h)
    out, new_res = poisoned(rms_norm_moe, [((t, h), dtype)] * 2, routed, shared, gate_logit, w, 1e-6, res)
    two, two_res = rms_norm(moe_combine(routed, shared, gate_logit), w, 1e-6, res)
    assert torch.equal(out, two) and torch.equal(new_res, two_res)
    ref, ref_res = rms_norm_moe_ref(routed, shared, gate_logit, w, 1e-6, res)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert rel_err(out, ref) < tol and rel_err(new_res, ref_res) < tol


def test_rms_norm_moe_checks_shapes() -> None:
    from nibble.kernels.norm import rms_norm_moe

    x = torch.randn(3, 8)
    with pytest.raises(ValueError, match="gate_logit"):
        rms_norm_moe(x, x, torch.randn(3), torch.ones(8), 1e-6, x)
    with pytest.raises(ValueError, match="must all be"):
        rms_norm_moe(x, x[:2], torch.randn(3, 1), torch.ones(8), 1e-6, x)
