"""Dense linear with an NVFP4 weight and 16-bit activations (W4A16)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from nibble.formats.nvfp4 import NVFP4Tensor, dequantize
from nibble.kernels._triton import cdiv, dot_precision, sm_count, tl, triton
from nibble.kernels.fp4_tiles import fp4_gemv_tile, fp4_tile_kn, x_even_odd
from nibble.kernels.tuning_tables import lookup


def nvfp4_linear_ref(x: torch.Tensor, w: NVFP4Tensor) -> torch.Tensor:
    """x: [T, K]; w: NVFP4 [N, K] -> [T, N] in x's dtype.

    e2m1 x e4m3 products are exact in bf16, so dequantising them to x's dtype loses nothing; the per-row
    global scale is applied to the fp32 output.
    """
    w_blk = dequantize(w.packed, w.block_scale, 1.0, x.dtype)
    y = F.linear(x, w_blk).float() * w.global_scale
    return y.to(x.dtype)


@triton.jit
def _nvfp4_gemv_kernel(x_ptr, q_ptr, s_ptr, g_ptr, out_ptr, n_out, n_k, stride_xt, stride_qn, stride_sn,
                       stride_ot, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    n = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    t = tl.program_id(1).to(tl.int64)
    nmask = n < n_out
    acc = tl.zeros([BLOCK_N, BLOCK_K // 16], tl.float32)
    for k0 in range(0, n_k, BLOCK_K):
        acc += fp4_gemv_tile(q_ptr, s_ptr, n, nmask, x_ptr + t * stride_xt, k0, n_k, stride_qn, stride_sn,
                             BLOCK_K // 16)
    y = tl.sum(acc, axis=1) * tl.load(g_ptr + n, mask=nmask, other=0.0)
    tl.store(out_ptr + t * stride_ot + n, y.to(out_ptr.dtype.element_ty), mask=nmask)


@triton.jit
def _nvfp4_gemm_kernel(x_ptr, q_ptr, s_ptr, g_ptr, out_ptr, ws_ptr, n_tok, n_out, n_k, k_per_split, stride_xt,
                       stride_qn, stride_sn, stride_ot, SPLIT: tl.constexpr, GROUP_M: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       DOT_PREC: tl.constexpr):
    # grouped ordering: GROUP_M row blocks sweep the N blocks together so x and W tiles are L2 hits
    pid = tl.program_id(0)
    grid_m = tl.cdiv(n_tok, BLOCK_M)
    grid_n = tl.cdiv(n_out, BLOCK_N)
    per_group = GROUP_M * grid_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m
    split = tl.program_id(1)

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < n_tok
    n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    nmask = n < n_out
    x_rows = x_ptr + rows.to(tl.int64) * stride_xt
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, n_k)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        xe, xo = x_even_odd(x_rows, rmask, k0, k_hi, BLOCK_K // 2)
        we, wo = fp4_tile_kn(q_ptr, s_ptr, n, nmask, k0, k_hi, stride_qn, stride_sn, BLOCK_K // 16, BLOCK_N,
                             xe.dtype)
        acc = tl.dot(xe, we, acc, input_precision=DOT_PREC)
        acc = tl.dot(xo, wo, acc, input_precision=DOT_PREC)
    acc *= tl.load(g_ptr + n, mask=nmask, other=0.0)[None, :]
    omask = rmask[:, None] & nmask[None, :]
    if SPLIT:
        tl.store(ws_ptr + (split * n_tok + rows.to(tl.int64))[:, None] * n_out + n[None, :], acc, mask=omask)
    else:
        tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_ot + n[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=omask)


@triton.jit
def _split_sum_kernel(ws_ptr, out_ptr, n_elem, n_out, stride_ot, n_split, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elem
    acc = tl.zeros([BLOCK], tl.float32)
    for s in range(0, n_split):
        acc += tl.load(ws_ptr + s * n_elem + offs, mask=mask, other=0.0)
    row = offs // n_out
    tl.store(out_ptr + row * stride_ot + offs % n_out, acc.to(out_ptr.dtype.element_ty), mask=mask)


def nvfp4_linear(x: torch.Tensor, w: NVFP4Tensor) -> torch.Tensor:
    """Triton `nvfp4_linear_ref`: a GEMV kernel for a single token, tensor-core tiles otherwise (split-K
    when the output tiles alone cannot fill the GPU)."""
    return nvfp4_linear_launch(x, w)


def nvfp4_linear_launch(x: torch.Tensor, w: NVFP4Tensor, *, path: str = "auto",
                        config: dict[str, Any] | None = None) -> torch.Tensor:
    """`nvfp4_linear` with the path ('auto', 'gemv', 'gemm') and tuning fields (incl. `split_k`)
    overridable."""
    if x.dim() != 2 or x.stride(1) != 1 or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"nvfp4_linear: x must be [T, K] bf16/fp16/fp32 with contiguous K, got {x.dtype} "
                         f"{tuple(x.shape)}")
    t, k = x.shape
    q, s, g = w.packed, w.block_scale, w.global_scale
    if q.dim() != 2 or q.shape[1] * 2 != k or s.shape != (q.shape[0], k // 16) or g.shape != (q.shape[0],):
        raise ValueError(f"nvfp4_linear: weight {tuple(q.shape)}/{tuple(s.shape)}/{tuple(g.shape)} for K={k}")
    if q.dtype != torch.uint8 or s.dtype != torch.float8_e4m3fn or g.dtype != torch.float32:
        raise ValueError(f"nvfp4_linear: weight dtypes {q.dtype}/{s.dtype}/{g.dtype}")
    if q.stride(1) != 1 or s.stride(1) != 1 or not g.is_contiguous() or k % 16:
        raise ValueError("nvfp4_linear: weight tensors must be contiguous along K (K a multiple of 16)")
    if len({x.device, q.device, s.device, g.device}) != 1:
        raise ValueError("nvfp4_linear: tensors on different devices")
    n = q.shape[0]
    out = torch.empty((t, n), dtype=x.dtype, device=x.device)
    if t == 0 or n == 0:
        return out
    s8 = s.view(torch.uint8)
    cfg = lookup("nvfp4_linear", x.device, {"tokens": t, "n": n, "k": k})
    cfg.update(config or {})
    if path == "auto":
        path = cfg["path"]
    if path == "gemv":
        bn, bk = cfg["gemv_block_n"], min(cfg["gemv_block_k"], triton.next_power_of_2(k))
        _nvfp4_gemv_kernel[(cdiv(n, bn), t)](x, q, s8, g, out, n, k, x.stride(0), q.stride(0), s8.stride(0),
                                             out.stride(0), BLOCK_N=bn, BLOCK_K=bk, num_warps=cfg["gemv_warps"])
        return out
    if path != "gemm":
        raise ValueError(f"nvfp4_linear: unknown path {path!r}")
    bm, bn, bk = cfg["block_m"], cfg["block_n"], cfg["block_k"]
    tiles = cdiv(t, bm) * cdiv(n, bn)
    split = cfg.get("split_k") or 1
    if "split_k" not in cfg and tiles < sm_count(x.device):
        split = max(1, min(cdiv(sm_count(x.device), tiles), k // (4 * bk), 16))
    k_per_split = cdiv(cdiv(k, split), bk) * bk
    split = cdiv(k, k_per_split)
    ws = torch.empty((split, t, n), dtype=torch.float32, device=x.device) if split > 1 else out
    _nvfp4_gemm_kernel[(tiles, split)](
        x, q, s8, g, out, ws, t, n, k, k_per_split, x.stride(0), q.stride(0), s8.stride(0), out.stride(0),
        SPLIT=split > 1, GROUP_M=8, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, DOT_PREC=dot_precision(x.dtype),
        num_warps=cfg["warps"], num_stages=cfg["stages"])
    if split > 1:
        block = 1024
        _split_sum_kernel[(cdiv(t * n, block),)](ws, out, t * n, n, out.stride(0), split, BLOCK=block,
                                                 num_warps=4)
    return out
