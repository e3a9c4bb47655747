"""Activations staged for the NVFP4 tensor-core kernels (moe_w4.py, nvfp4_linear.py): converted to the MMA's
dtype (bf16 as fp16 * 2^-X_SHIFT for the e4m3-converter decode, fp4_tiles.py) and laid out in the K order the
weight decode yields (`fp4_decode4`'s four stride-4 slices for PERM mode, DEC 4's `pairs_col` order)."""

from __future__ import annotations

import torch

from nibble.kernels._triton import cdiv, tl, triton
from nibble.kernels.pdl import gdc_launch_dependents, gdc_wait, pdl_launch


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
                   BLOCK: tl.constexpr, PDL_TRIGGER: tl.constexpr = False, PAIRS: tl.constexpr = False,
                   PDL_WAIT: tl.constexpr = False):
    """out[m, c(k)] = x[m, k] * 2^-X_SHIFT in out's dtype, c(4u + t) = t * K/4 + u with PERMUTE (the slice
    order of `fp4_decode4`, PERM mode), c(k) = `pairs_col`(k) with PAIRS (DEC 4), else c(k) = k.
    PDL_TRIGGER: gate_up is launched with PDL. PDL_WAIT: this kernel is, behind any kernel; it waits before it
    triggers, so that gate_up, which reads the routing ids before its own wait, starts only once the kernel
    ahead of this one (the router, which writes them) is done."""
    if PDL_WAIT:
        gdc_wait()
    if PDL_TRIGGER:
        gdc_launch_dependents()
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
            out: torch.Tensor | None = None, pdl_trigger: bool = False, pairs: bool = False,
            pdl_wait: bool = False) -> torch.Tensor:
    """x [T, K] -> [T, K] of `dtype` (`out` if given, else new) holding x * 2^-x_shift, columns in
    `fp4_decode4`'s slice order if permute (K a multiple of 4), or in DEC 4's order if pairs (K a multiple
    of 8). pdl_trigger: the next kernel is launched with PDL; pdl_wait: launch this one with PDL, behind
    whatever kernel is ahead (sm_90+ only, `pdl.pdl_supported`)."""
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
                                                 num_warps=4, **pdl_launch(pdl_wait))
    return out
