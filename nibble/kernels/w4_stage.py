"""Activations staged for the NVFP4 tensor-core kernels (moe_w4.py, nvfp4_linear.py): converted to the MMA's
dtype (bf16 as fp16 * 2^-X_SHIFT for the e4m3-converter decode, fp4_tiles.py) and laid out in the K order the
weight decode yields (`fp4_decode4`'s four stride-4 slices for PERM mode, DEC 4's `pairs_col` order), or as
the block-diagonal operand of the "diag" layout (`stage_x_diag`)."""

from __future__ import annotations

import torch

from nibble.kernels._triton import cdiv, tl, triton
from nibble.kernels.pdl import pdl_handoff


@triton.jit
def pairs_col(k):
    """Column of element k in an activation row staged for DEC 4 (fp4_tiles.py): bits 1 and 2 swapped."""
    return (k & ~6) | ((k & 2) << 1) | ((k & 4) >> 1)


@triton.jit
def f16_range(v):
    """Clamp to the finite fp16 range (staged activations saturate instead of turning into inf)."""
    return tl.minimum(tl.maximum(v, -65504.0), 65504.0)


@triton.jit
def stage_x_kernel(x_ptr, out_ptr, n_k, stride_xt, stride_ot, X_SHIFT: tl.constexpr, PERMUTE: tl.constexpr,
                   BLOCK: tl.constexpr, PDL_TRIGGER: tl.constexpr = False, PAIRS: tl.constexpr = False):
    """out[m, c(k)] = x[m, k] * 2^-X_SHIFT in out's dtype, c(4u + t) = t * K/4 + u with PERMUTE (the slice
    order of `fp4_decode4`, PERM mode), c(k) = `pairs_col`(k) with PAIRS (DEC 4), else c(k) = k.
    PDL_TRIGGER: gate_up is launched with PDL."""
    pdl_handoff(PDL_TRIGGER, False)
    m = tl.program_id(0).to(tl.int64)
    u = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    t = tl.arange(0, 4)
    mask = (u < n_k // 4)[:, None]
    v = tl.load(x_ptr + m * stride_xt + 4 * u[:, None] + t[None, :], mask=mask)
    if X_SHIFT != 0:
        v = f16_range(v.to(tl.float32) * (1.0 / (1 << X_SHIFT)))
    if PERMUTE:
        col = t[None, :] * (n_k // 4) + u[:, None]
    elif PAIRS:
        col = pairs_col(4 * u[:, None] + t[None, :])
    else:
        col = 4 * u[:, None] + t[None, :]
    tl.store(out_ptr + m * stride_ot + col, v.to(out_ptr.dtype.element_ty), mask=mask)


def stage_x(x: torch.Tensor, dtype: torch.dtype, x_shift: int, permute: bool,
            out: torch.Tensor | None = None, pdl_trigger: bool = False, pairs: bool = False) -> torch.Tensor:
    """x [T, K] -> [T, K] of `dtype` (`out` if given, else new) holding x * 2^-x_shift, columns in
    `fp4_decode4`'s slice order if permute (K a multiple of 4), or in DEC 4's order if pairs (K a multiple
    of 8). pdl_trigger: the next kernel is launched with PDL (sm_90+ only)."""
    t, k = x.shape
    if k % 4 or (pairs and k % 8):
        raise ValueError(f"stage_x: K = {k} is not a multiple of {8 if pairs else 4}")
    if permute and pairs:
        raise ValueError("stage_x: permute and pairs are two different orders")
    if out is None:
        out = torch.empty((t, k), dtype=dtype, device=x.device)
    elif out.shape != (t, k) or out.dtype != dtype or out.stride(1) != 1:
        raise ValueError(f"stage_x: out must be {dtype} [{t}, {k}] with contiguous rows, got {out.dtype} "
                         f"{tuple(out.shape)}")
    if t:
        block = 256
        stage_x_kernel[(t, cdiv(k // 4, block))](x, out, k, x.stride(0), out.stride(0), X_SHIFT=x_shift,
                                                 PERMUTE=permute, BLOCK=block, PDL_TRIGGER=pdl_trigger, PAIRS=pairs,
                                                 num_warps=4)
    return out


@triton.jit
def diag_cols(p, n_k, NG: tl.constexpr):
    """Offsets [A, B, NG] in a "diag"-staged row (`stage_x_diag`) of the NG columns of staged positions p
    [A, B] (broadcastable)."""
    return ((p % 4) * (n_k // 4) * NG + (p // 4) * NG)[:, :, None] + tl.arange(0, NG)[None, None, :]


@triton.jit
def diag_values(v, p, NG: tl.constexpr):
    """The values [A, B, NG] a "diag"-staged row holds for values v [A, B] at staged positions p [A, B]
    (broadcastable): v in the column of p's scale group within its K step (p // 16 mod NG), zeros elsewhere."""
    hit = ((p // 16) % NG)[:, :, None] == tl.arange(0, NG)[None, None, :]
    return tl.where(hit, v[:, :, None], 0.0).to(v.dtype)


@triton.jit
def stage_x_diag_kernel(x_ptr, out_ptr, n_k, stride_xt, stride_ot, X_SHIFT: tl.constexpr, NG: tl.constexpr,
                        BLOCK: tl.constexpr, PDL_TRIGGER: tl.constexpr = False, PAIRS: tl.constexpr = False):
    """One row of `stage_x_diag` per program_id(0), BLOCK units of 4 positions per program_id(1)."""
    pdl_handoff(PDL_TRIGGER, False)
    m = tl.program_id(0).to(tl.int64)
    u = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    p = 4 * u[:, None] + tl.arange(0, 4)[None, :]
    mask = (u < n_k // 4)[:, None]
    v = tl.load(x_ptr + m * stride_xt + (pairs_col(p) if PAIRS else p), mask=mask)
    if X_SHIFT != 0:
        v = f16_range(v.to(tl.float32) * (1.0 / (1 << X_SHIFT)))
    v = diag_values(v.to(out_ptr.dtype.element_ty), p, NG)
    tl.store(out_ptr + m * stride_ot + diag_cols(p, n_k, NG), v, mask=mask[:, :, None])


def stage_x_diag(x: torch.Tensor, dtype: torch.dtype, x_shift: int, num_groups: int, pairs: bool = False,
                 pdl_trigger: bool = False) -> torch.Tensor:
    """x [T, K] -> [T, 4 * (K/4) * num_groups] of `dtype`: the "diag" layout's operand (fp4_tiles.py), for K
    steps of 16 * num_groups. Staged position p (p = k, or DEC 4's order with pairs) holds x[k] * 2^-x_shift;
    row m, slice p % 4, unit p // 4 is num_groups columns, x's value in column (p // 16) mod num_groups (its
    scale group within the step), zeros in the others."""
    t, k = x.shape
    if k % 16:
        raise ValueError(f"stage_x_diag: K = {k} is not a multiple of 16")
    out = torch.empty((t, k * num_groups), dtype=dtype, device=x.device)
    if t:
        block = 64
        stage_x_diag_kernel[(t, cdiv(k // 4, block))](x, out, k, x.stride(0), out.stride(0), X_SHIFT=x_shift,
                                                      NG=num_groups, BLOCK=block, PDL_TRIGGER=pdl_trigger,
                                                      PAIRS=pairs, num_warps=4)
    return out
