"""Gating of Gated DeltaNet: the per-head log decay g = -exp(A_log) * softplus(a + dt_bias) and the write
strength beta = sigmoid(b), from the a and b columns of the layer's fused input projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nibble.kernels._triton import next_pow2, tl, triton


def gdn_gating_ref(a: torch.Tensor, b: torch.Tensor, neg_A: torch.Tensor, dt_bias: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """a, b: [T, Hv] (any row stride); neg_A = -exp(A_log), dt_bias: fp32 [Hv].

    Returns (g fp32 [T, Hv], beta [T, Hv] in b's dtype): g = neg_A * softplus(a + dt_bias) in fp32 (torch's
    softplus: x itself above 20), beta = sigmoid(b).
    """
    g = neg_A * F.softplus(a.float() + dt_bias)
    return g, torch.sigmoid(b)


@triton.jit
def _softplus(x):
    # torch's softplus (threshold 20) as max(x, 0) + log1p(exp(-|x|)), log1p(u) by Kahan's
    # u * log(1 + u) / ((1 + u) - 1): accurate where log(1 + u) would round u away, so a very negative x
    # keeps its tiny positive softplus as in torch
    u = tl.exp(-tl.abs(x))
    w = 1.0 + u
    rounds_to_one = w == 1.0
    log1p = tl.where(rounds_to_one, u, u * tl.log(w) / tl.where(rounds_to_one, 1.0, w - 1.0))
    return tl.where(x > 20.0, x, tl.maximum(x, 0.0) + log1p)


@triton.jit(do_not_specialize=["n_rows"])
def _gdn_gating_kernel(a_ptr, b_ptr, neg_a_ptr, dt_bias_ptr, g_ptr, beta_ptr, n_rows, n_heads, stride_a,
                       stride_b, stride_g, stride_beta, ROWS: tl.constexpr, BLOCK_H: tl.constexpr):
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    cmask = cols < n_heads
    mask = (rows[:, None] < n_rows) & cmask[None, :]
    a = tl.load(a_ptr + rows[:, None] * stride_a + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + rows[:, None] * stride_b + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    neg_a = tl.load(neg_a_ptr + cols, mask=cmask, other=0.0)
    dt_bias = tl.load(dt_bias_ptr + cols, mask=cmask, other=0.0)
    g = neg_a[None, :] * _softplus(a + dt_bias[None, :])
    tl.store(g_ptr + rows[:, None] * stride_g + cols[None, :], g, mask=mask)
    beta = tl.sigmoid(b)
    tl.store(beta_ptr + rows[:, None] * stride_beta + cols[None, :], beta.to(beta_ptr.dtype.element_ty), mask=mask)


def gdn_gating(a: torch.Tensor, b: torch.Tensor, neg_A: torch.Tensor, dt_bias: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton `gdn_gating_ref` in one launch; a and b are read in place through their row strides (the
    columns of one fused projection), the outputs are fresh contiguous tensors."""
    if a.dim() != 2 or b.shape != a.shape:
        raise ValueError(f"gdn_gating: a {tuple(a.shape)} and b {tuple(b.shape)} must both be [T, Hv]")
    t, hv = a.shape
    if neg_A.shape != (hv,) or dt_bias.shape != (hv,):
        raise ValueError(f"gdn_gating: neg_A {tuple(neg_A.shape)} / dt_bias {tuple(dt_bias.shape)} != [{hv}]")
    if neg_A.dtype != torch.float32 or dt_bias.dtype != torch.float32:
        raise ValueError(f"gdn_gating: neg_A and dt_bias must be fp32, got {neg_A.dtype} / {dt_bias.dtype}")
    if not (a.is_floating_point() and b.is_floating_point()):
        raise ValueError(f"gdn_gating: a and b must be floating point, got {a.dtype} / {b.dtype}")
    if len({a.device, b.device, neg_A.device, dt_bias.device}) != 1:
        raise ValueError("gdn_gating: tensors on different devices")
    a = a if a.stride(1) == 1 else a.contiguous()
    b = b if b.stride(1) == 1 else b.contiguous()
    neg_A, dt_bias = neg_A.contiguous(), dt_bias.contiguous()
    g = torch.empty((t, hv), dtype=torch.float32, device=a.device)
    beta = torch.empty((t, hv), dtype=b.dtype, device=a.device)
    if t and hv:
        block_h = next_pow2(hv)
        rows = max(1, min(64, 2048 // block_h))
        _gdn_gating_kernel[(triton.cdiv(t, rows),)](
            a, b, neg_A, dt_bias, g, beta, t, hv, a.stride(0), b.stride(0), g.stride(0), beta.stride(0),
            ROWS=rows, BLOCK_H=block_h, num_warps=4)
    return g, beta
