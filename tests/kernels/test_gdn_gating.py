"""gdn_gating (Triton, interpreter) against the reference: a and b as strided columns of the fused in_proj
output, softplus around its threshold and deep in its exponential tail, beta in b's dtype."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_testing import poisoned, rel_err

from nibble.kernels.gdn_gating import gdn_gating, gdn_gating_ref


def _params(hv: int) -> tuple[torch.Tensor, torch.Tensor]:
    neg_a = -torch.empty(hv).uniform_(1.0, 16.0)
    return neg_a, torch.randn(hv)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("t,hv", [(1, 6), (5, 64), (130, 12)])
def test_strided_columns_of_projection(dtype: torch.dtype, t: int, hv: int) -> None:
    width = 3 * hv + 7
    proj = (torch.randn(t, width) * 12).to(dtype)
    b, a = proj[:, width - 2 * hv:width - hv], proj[:, width - hv:]
    neg_a, dt_bias = _params(hv)
    before = proj.clone()
    g, beta = poisoned(gdn_gating, [((t, hv), torch.float32), ((t, hv), dtype)], a, b, neg_a, dt_bias)
    g_ref, beta_ref = gdn_gating_ref(a, b, neg_a, dt_bias)
    assert g.dtype == torch.float32 and beta.dtype == dtype
    assert torch.allclose(g, g_ref, rtol=1e-5, atol=0)
    ulp = {torch.float32: 1e-6, torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}[dtype]
    assert torch.allclose(beta.float(), beta_ref.float(), rtol=2 * ulp, atol=1e-6)
    assert rel_err(g, g_ref) < 1e-6
    assert torch.equal(proj, before)


def test_softplus_threshold_and_tail_match_torch() -> None:
    """Around softplus's threshold 20 (x itself above it) and far below 0, where log(1 + exp(x)) in fp32
    would give exactly 0: the kernel keeps the relative precision of torch's log1p."""
    x = torch.tensor([-200.0, -100.0, -80.0, -40.0, -17.0, -1e-3, 0.0, 1e-3, 3.0, 19.99, 20.0, 20.01, 35.0, 1e4])
    hv = x.numel()
    neg_a, dt_bias = -torch.ones(hv), torch.full((hv,), 0.25)
    a = (x - 0.25).reshape(1, hv)
    g, _ = gdn_gating(a, torch.zeros(1, hv), neg_a, dt_bias)
    expected = -F.softplus(a + dt_bias)
    assert torch.allclose(g, expected, rtol=1e-5, atol=0), (g, expected)
    assert float(g[0, 0]) == 0.0 and float(g[0, 2]) < 0.0


def test_non_finite_inputs_propagate() -> None:
    a = torch.tensor([[float("nan"), float("inf"), -float("inf"), 1.0]])
    g, _ = gdn_gating(a, a, -torch.ones(4), torch.zeros(4))
    g_ref, _ = gdn_gating_ref(a, a, -torch.ones(4), torch.zeros(4))
    assert torch.allclose(g, g_ref, rtol=1e-6, atol=0, equal_nan=True)


def test_checks() -> None:
    a = torch.randn(3, 4)
    with pytest.raises(ValueError, match="fp32"):
        gdn_gating(a, a, -torch.ones(4, dtype=torch.float64), torch.zeros(4))
    with pytest.raises(ValueError, match=r"\[T, Hv\]"):
        gdn_gating(a, a[:, :3], -torch.ones(4), torch.zeros(4))
    g, beta = gdn_gating(torch.empty(0, 4), torch.empty(0, 4), -torch.ones(4), torch.zeros(4))
    assert g.shape == beta.shape == (0, 4)
