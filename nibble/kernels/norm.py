"""RMSNorm (optionally fused with the residual add, or with the MoE block's combination of its routed and
shared experts before it), the per-head q/k RMSNorm of attention and the gated RMSNorm of Gated DeltaNet."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nibble.kernels._triton import as_rows, next_pow2, tl, triton
from nibble.kernels.activation import moe_combine_ref
from nibble.kernels.pdl import pdl_handoff, pdl_supported


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x: [T, H] (or [..., H]); weight: fp32 [H], the full multiplier (Qwen's zero-centred `1 + w` is
    folded in at load time); residual: like x or None.

    With a residual, s = x + residual (in x's dtype) is returned as the new residual and normalised;
    without, x is normalised and None returned. Normalisation is in fp32, output in x's dtype.
    """
    if residual is not None:
        x = x + residual
        residual = x
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return out.to(x.dtype), residual


def qk_rms_norm_ref(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                    eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, Hq, D]; k: [T, Hk, D] (e.g. strided views of a fused qkv projection); q_weight, k_weight:
    fp32 [D] multipliers. Each head of q and of k normalised as `rms_norm_ref` does; fresh tensors in q's
    and k's dtypes."""
    return rms_norm_ref(q, q_weight, eps)[0], rms_norm_ref(k, k_weight, eps)[0]


def gated_rms_norm_ref(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x, gate: [N, D]; weight: [D] (plain multiplier). Returns weight * rmsnorm(x) * silu(gate) in x's
    dtype (fp32 inside)."""
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    out = weight.to(x.dtype) * normed
    return (out.float() * F.silu(gate.float())).to(x.dtype)


def rms_norm_moe_ref(routed: torch.Tensor, shared: torch.Tensor, gate_logit: torch.Tensor, weight: torch.Tensor,
                     eps: float, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`moe_combine_ref(routed, shared, gate_logit)` (routed, shared: [T, H]; gate_logit: [T, 1]) then
    `rms_norm_ref` of it with residual [T, H]: the next layer's input norm taking the MoE block's output
    before its combination. Returns (out, new residual)."""
    out, res = rms_norm_ref(moe_combine_ref(routed, shared, gate_logit), weight, eps, residual)
    assert res is not None
    return out, res


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, s_ptr, gl_ptr, n_cols, stride_x, stride_r,
                     stride_o, stride_ro, stride_s, stride_gl, eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr,
                     COMBINE: tl.constexpr = False, PDL_TRIGGER: tl.constexpr = False):
    # COMBINE: x is the MoE block's routed output, combined first with its shared expert output (s) and
    # gate logit (gl) as _moe_combine_kernel does, rounded to x's dtype as that kernel stores it.
    # PDL_TRIGGER: the projection after the norm may start (dense_gemv.py)
    pdl_handoff(PDL_TRIGGER, False)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if COMBINE:
        s = tl.load(s_ptr + row * stride_s + cols, mask=mask, other=0.0).to(tl.float32)
        gl = tl.load(gl_ptr + row * stride_gl).to(tl.float32)
        x = (x.to(tl.float32) + tl.sigmoid(gl) * s).to(x.dtype)
    if HAS_RES:
        # the sum is rounded to the activation dtype first: that rounded value is the new residual
        x = x + tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        tl.store(res_out_ptr + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (xf * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)


def _num_warps(block: int) -> int:
    return 1 if block <= 256 else 4 if block <= 2048 else 8


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Triton `rms_norm_ref`: one program per row; returns fresh tensors (inputs are not modified)."""
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"rms_norm: weight {tuple(weight.shape)} does not match hidden size {hidden}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"rms_norm: residual {tuple(residual.shape)}/{residual.dtype} vs x "
                         f"{tuple(x.shape)}/{x.dtype}")
    if weight.device != x.device or (residual is not None and residual.device != x.device):
        raise ValueError("rms_norm: tensors on different devices")
    x2 = as_rows(x)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    n = x2.shape[0]
    if residual is not None:
        r2 = as_rows(residual)
        res_out = torch.empty_like(out)
    else:
        r2, res_out = x2, out
    if n:
        block = next_pow2(hidden)
        _rms_norm_kernel[(n,)](x2, r2, weight, out, res_out, x2, x2, hidden, x2.stride(0), r2.stride(0),
                               out.stride(0), res_out.stride(0), 0, 0, float(eps), HAS_RES=residual is not None,
                               BLOCK=block, PDL_TRIGGER=pdl_supported(x.device), num_warps=_num_warps(block))
    new_res = res_out.view(x.shape) if residual is not None else None
    return out.view(x.shape), new_res


def rms_norm_moe(routed: torch.Tensor, shared: torch.Tensor, gate_logit: torch.Tensor, weight: torch.Tensor,
                 eps: float, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton `rms_norm_moe_ref`: the MoE combination and the residual-add RMSNorm in one launch (one program
    per row); gate_logit may be a strided column of a fused projection."""
    if routed.dim() != 2 or shared.shape != routed.shape or residual.shape != routed.shape:
        raise ValueError(f"rms_norm_moe: routed {tuple(routed.shape)}, shared {tuple(shared.shape)} and residual "
                         f"{tuple(residual.shape)} must all be [T, H]")
    t, hidden = routed.shape
    if gate_logit.shape != (t, 1) or weight.shape != (hidden,):
        raise ValueError(f"rms_norm_moe: gate_logit {tuple(gate_logit.shape)} != [{t}, 1] or weight "
                         f"{tuple(weight.shape)} != [{hidden}]")
    if shared.dtype != routed.dtype or residual.dtype != routed.dtype:
        raise ValueError(f"rms_norm_moe: routed {routed.dtype}, shared {shared.dtype}, residual {residual.dtype} "
                         "must share a dtype")
    if len({routed.device, shared.device, gate_logit.device, weight.device, residual.device}) != 1:
        raise ValueError("rms_norm_moe: tensors on different devices")
    r2, s2, res2 = (x if x.stride(1) == 1 else x.contiguous() for x in (routed, shared, residual))
    out = torch.empty((t, hidden), dtype=routed.dtype, device=routed.device)
    res_out = torch.empty_like(out)
    if t:
        block = next_pow2(hidden)
        _rms_norm_kernel[(t,)](r2, res2, weight, out, res_out, s2, gate_logit, hidden, r2.stride(0), res2.stride(0),
                               out.stride(0), res_out.stride(0), s2.stride(0), gate_logit.stride(0), float(eps),
                               HAS_RES=True, BLOCK=block, COMBINE=True, PDL_TRIGGER=pdl_supported(routed.device),
                               num_warps=_num_warps(block))
    return out, res_out


@triton.jit
def _norm_heads(x_ptr, w_ptr, out_ptr, block, n_rows, n_heads, dim, stride_t, stride_h, eps, ROWS: tl.constexpr,
                BLOCK: tl.constexpr):
    rows = (block * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < dim)
    src = (rows // n_heads) * stride_t + (rows % n_heads) * stride_h
    x = tl.load(x_ptr + src[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / dim + eps)
    w = tl.load(w_ptr + cols, mask=cols < dim, other=0.0).to(tl.float32)
    y = x * rstd[:, None] * w[None, :]
    tl.store(out_ptr + rows[:, None] * dim + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["n_q_rows", "n_k_rows"])
def _qk_rms_norm_kernel(q_ptr, k_ptr, qw_ptr, kw_ptr, qo_ptr, ko_ptr, n_q_rows, n_k_rows, n_q_heads, n_k_heads,
                        dim, stride_qt, stride_qh, stride_kt, stride_kh, eps, ROWS: tl.constexpr,
                        BLOCK: tl.constexpr):
    # the first programs take q's heads, the rest k's: one launch for both
    pid = tl.program_id(0)
    q_blocks = tl.cdiv(n_q_rows, ROWS)
    if pid < q_blocks:
        _norm_heads(q_ptr, qw_ptr, qo_ptr, pid, n_q_rows, n_q_heads, dim, stride_qt, stride_qh, eps, ROWS, BLOCK)
    else:
        _norm_heads(k_ptr, kw_ptr, ko_ptr, pid - q_blocks, n_k_rows, n_k_heads, dim, stride_kt, stride_kh, eps,
                    ROWS, BLOCK)


def qk_rms_norm(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton `qk_rms_norm_ref`: one launch for both; q and k are read through their token and head
    strides (no copy of a strided view), the outputs are contiguous."""
    if q.dim() != 3 or k.dim() != 3 or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        raise ValueError(f"qk_rms_norm: q {tuple(q.shape)} / k {tuple(k.shape)} must be [T, H, D] alike")
    t, hq, dim = q.shape
    hk = k.shape[1]
    if q_weight.shape != (dim,) or k_weight.shape != (dim,):
        raise ValueError(f"qk_rms_norm: weights {tuple(q_weight.shape)} / {tuple(k_weight.shape)} != [{dim}]")
    if len({q.device, k.device, q_weight.device, k_weight.device}) != 1:
        raise ValueError("qk_rms_norm: tensors on different devices")
    q = q if q.stride(2) == 1 else q.contiguous()
    k = k if k.stride(2) == 1 else k.contiguous()
    q_out = torch.empty((t, hq, dim), dtype=q.dtype, device=q.device)
    k_out = torch.empty((t, hk, dim), dtype=k.dtype, device=k.device)
    if t and dim:
        block = next_pow2(dim)
        rows = max(1, min(16, 2048 // block))
        grid = (triton.cdiv(t * hq, rows) + triton.cdiv(t * hk, rows),)
        _qk_rms_norm_kernel[grid](q, k, q_weight, k_weight, q_out, k_out, t * hq, t * hk, hq, hk, dim, q.stride(0),
                                  q.stride(1), k.stride(0), k.stride(1), float(eps), ROWS=rows, BLOCK=block,
                                  num_warps=4)
    return q_out, k_out


@triton.jit(do_not_specialize=["n_rows"])
def _gated_rms_norm_kernel(x_ptr, g_ptr, w_ptr, out_ptr, n_rows, n_cols, stride_x, stride_g, stride_o, eps,
                           ROWS: tl.constexpr, BLOCK: tl.constexpr, PDL_TRIGGER: tl.constexpr = False):
    pdl_handoff(PDL_TRIGGER, False)
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=1) / n_cols + eps)
    # rounding points follow the reference: normed and weight*normed in the activation dtype
    normed = (xf * rstd[:, None]).to(x.dtype)
    w = tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0).to(x.dtype)
    y = (w[None, :] * normed).to(tl.float32)
    g = tl.load(g_ptr + rows[:, None] * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    y = y * g * tl.sigmoid(g)
    tl.store(out_ptr + rows[:, None] * stride_o + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton `gated_rms_norm_ref`: several short rows (head_dim wide) per program."""
    dim = x.shape[-1]
    if gate.shape != x.shape:
        raise ValueError(f"gated_rms_norm: gate {tuple(gate.shape)} != x {tuple(x.shape)}")
    if weight.shape != (dim,):
        raise ValueError(f"gated_rms_norm: weight {tuple(weight.shape)} does not match {dim}")
    if gate.device != x.device or weight.device != x.device:
        raise ValueError("gated_rms_norm: tensors on different devices")
    x2, g2 = as_rows(x), as_rows(gate)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    n = x2.shape[0]
    if n:
        block = next_pow2(dim)
        rows = max(1, min(16, 2048 // block))
        _gated_rms_norm_kernel[(triton.cdiv(n, rows),)](
            x2, g2, weight, out, n, dim, x2.stride(0), g2.stride(0), out.stride(0), float(eps),
            ROWS=rows, BLOCK=block, PDL_TRIGGER=pdl_supported(x.device), num_warps=4)
    return out.view(x.shape)
