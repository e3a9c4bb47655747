"""silu_and_mul, sigmoid_mul and moe_combine (Triton, interpreter) against the references: odd sizes, inputs
that are strided views of a fused projection, fp32 exactly and 16-bit types to one rounding."""

from __future__ import annotations

import pytest
import torch
from kernel_testing import poisoned, rel_err

from nibble.kernels.activation import (
    moe_combine,
    moe_combine_ref,
    sigmoid_mul,
    sigmoid_mul_ref,
    silu_and_mul,
    silu_and_mul_ref,
)

# the interpreter rounds to bf16 by truncation, so bf16 results may be off by one ulp
TOL = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 1e-2}
DTYPES = list(TOL)


def _assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert rel_err(out, ref) < TOL[ref.dtype]
    ulp = 2.0 ** -7 if ref.dtype == torch.bfloat16 else 2.0 ** -10 if ref.dtype == torch.float16 else 1e-6
    assert torch.allclose(out.float(), ref.float(), rtol=2 * ulp, atol=1e-6)


def _fused(t: int, e: int, i: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """A fused MoE projection [T, E + 2I + 1] and its views: router, gate, up, shared expert gate logit."""
    y = (torch.randn(t, e + 2 * i + 1) * 3).to(dtype)
    return y, y[:, :e], y[:, e:e + i], y[:, e + i:e + 2 * i], y[:, e + 2 * i:]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,i", [(1, 80), (7, 1000), (70, 33)])
def test_silu_and_mul_strided_halves(dtype: torch.dtype, t: int, i: int) -> None:
    y, _, gate, up, _ = _fused(t, 13, i, dtype)
    before = y.clone()
    out = poisoned(silu_and_mul, [((t, i), dtype)], gate, up)
    assert out.shape == (t, i) and out.is_contiguous()
    _assert_close(out, silu_and_mul_ref(gate, up))
    assert torch.equal(y, before)


def test_silu_and_mul_separate_tensors_and_empty() -> None:
    gate, up = torch.randn(5, 2100), torch.randn(5, 2100)
    _assert_close(silu_and_mul(gate, up), silu_and_mul_ref(gate, up))
    assert silu_and_mul(torch.empty(0, 8), torch.empty(0, 8)).shape == (0, 8)
    with pytest.raises(ValueError, match="differ"):
        silu_and_mul(gate, up[:, 1:])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,h,d", [(1, 5, 24), (9, 3, 100)])
def test_sigmoid_mul_gate_half_of_heads(dtype: torch.dtype, t: int, h: int, d: int) -> None:
    """The attention output gate: x [T, H, D] times sigmoid of the second half of each [query | gate] head."""
    qg = (torch.randn(t, h, 2 * d) * 4).to(dtype)
    x = torch.randn(t, h, d).to(dtype)
    gate = qg[..., d:]
    out = poisoned(sigmoid_mul, [((t * h, d), dtype)], x, gate)
    assert out.shape == x.shape and out.is_contiguous()
    _assert_close(out, sigmoid_mul_ref(x, gate))


def test_sigmoid_mul_unviewable_rows_are_copied() -> None:
    x = torch.randn(4, 6, 10)
    gate = torch.randn(6, 4, 10).transpose(0, 1)
    _assert_close(sigmoid_mul(x, gate), sigmoid_mul_ref(x, gate))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,h", [(1, 3000), (11, 96), (130, 40)])
def test_moe_combine_strided_gate_logit(dtype: torch.dtype, t: int, h: int) -> None:
    gate_logit = _fused(t, 9, 17, dtype)[-1]
    routed, shared = torch.randn(t, h).to(dtype), torch.randn(t, h).to(dtype)
    out = poisoned(moe_combine, [((t, h), dtype)], routed, shared, gate_logit)
    _assert_close(out, moe_combine_ref(routed, shared, gate_logit))


def test_moe_combine_checks_shapes() -> None:
    r = torch.randn(3, 8)
    with pytest.raises(ValueError, match="gate_logit"):
        moe_combine(r, r, torch.randn(3))
    with pytest.raises(ValueError, match="routed"):
        moe_combine(r, r.double(), torch.randn(3, 1))
