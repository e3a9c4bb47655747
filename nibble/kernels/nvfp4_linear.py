"""Dense linear with an NVFP4 weight and 16-bit activations (W4A16).

`nvfp4_linear` runs the weight-stationary tensor-core tiles of the NVFP4 MoE kernels (fp4_tiles.py,
`fp4_decode4`): a program owns BLOCK_N weight rows and SLOTS tokens, the weights are the MMA's M side,
decoded in registers at ~2.5 ops per weight, so a weight tile is read and decoded once for all tokens of
the block. Token layouts (tuning field `xmode`, see moe_w4.py): "quad" for 1-4 tokens, "split" (the
natural tile cut into K slices in registers) and "perm" (x pre-permuted into the slice order, prefill).
With few output tiles (a decode GEMV with a short N), K is split across programs whose fp32 partials a
second launch sums in a fixed order (deterministic). `nvfp4_linear_generic` keeps the first-generation
kernels (FP4 decoded by lookup, even/odd K halves), a separate code path the registry falls back to.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from nibble.formats.nvfp4 import NVFP4Tensor, dequantize
from nibble.kernels._triton import cdiv, dot_precision, sm_count, tl, triton
from nibble.kernels.fp4_tiles import (
    decode_mode,
    fp4_acc_scale,
    fp4_gemv_tile,
    fp4_tile_kn,
    fp4_units,
    tile_for_dec,
    x_even_odd,
)
from nibble.kernels.moe_w4 import PERM, QUAD, SPLIT, XMODES
from nibble.kernels.tuning_tables import lookup
from nibble.kernels.w4_stage import stage_x
from nibble.kernels.w4_steps import w4_finish, w4_k_step, w4_tile


def nvfp4_linear_ref(x: torch.Tensor, w: NVFP4Tensor) -> torch.Tensor:
    """x: [T, K]; w: NVFP4 [N, K] -> [T, N] in x's dtype.

    e2m1 x e4m3 products are exact in bf16, so dequantising them to x's dtype loses nothing; the per-row
    global scale is applied to the fp32 output.
    """
    w_blk = dequantize(w.packed, w.block_scale, 1.0, x.dtype)
    y = F.linear(x, w_blk).float() * w.global_scale
    return y.to(x.dtype)




@triton.jit(do_not_specialize=["n_tok"])
def _w4_linear_kernel(x_ptr, q_ptr, s_ptr, g_ptr, out_ptr, ws_ptr, n_tok, n_out, n_k, k_chunk, chunk_units,
                      chunk_groups, stride_xt, stride_qn, stride_sn, stride_ot, XMODE: tl.constexpr,
                      DEC: tl.constexpr, EVEN_K: tl.constexpr, SLOTS: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    """out[t, n] = (x[t] . W[n]) * g[n] for the SLOTS tokens of block program_id(0) and BLOCK_N features.
    q: W as int16 units [N, K/4]; s: e4m3 block scales as uint8 [N, K/16]; g: fp32 [N]; x: [T, K] (perm
    mode: rows permuted by `stage_x`). SPLIT_K: program (block, slice, z) covers K range
    [z * k_chunk, (z + 1) * k_chunk) (chunk_units = k_chunk / 4, chunk_groups = k_chunk / 16, passed as such
    so their alignment is known) and writes fp32 partials ws[z, t, n]."""
    REP: tl.constexpr = 4 if XMODE == 0 else 1
    tok = tl.program_id(0) * SLOTS + tl.arange(0, SLOTS * REP) // REP
    valid = tok < n_tok
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nc = tl.minimum(n, n_out - 1).to(tl.int64)  # clamped rows: results not stored
    # this split's K range as offset base pointers: a K loop that starts at 0 keeps Triton's asynchronous
    # copies for the activation tiles (a run-time loop start turns them into plain loads)
    z = tl.program_id(2)
    q_rows = q_ptr + nc * stride_qn + z * chunk_units
    s_rows = s_ptr + nc * stride_sn + z * chunk_groups
    if XMODE == 1:
        b_ptr = x_ptr + tl.minimum(tok, n_tok - 1).to(tl.int64) * stride_xt + z * chunk_units
    else:
        b_ptr = x_ptr + tl.minimum(tok, n_tok - 1).to(tl.int64) * stride_xt + z * k_chunk
    n_kz = n_k - z * k_chunk
    acc0 = tl.zeros([BLOCK_N, SLOTS * REP], tl.float32)
    acc1 = tl.zeros([BLOCK_N, SLOTS * REP if XMODE == 0 else 16], tl.float32)
    acc2 = tl.zeros([BLOCK_N, SLOTS * REP if XMODE == 0 else 16], tl.float32)
    acc3 = tl.zeros([BLOCK_N, SLOTS * REP if XMODE == 0 else 16], tl.float32)
    for k0 in range(0, tl.minimum(n_kz, k_chunk), BLOCK_K):
        q, s = w4_tile(q_rows, s_rows, k0, n_kz, BLOCK_K, EVEN_K)
        acc0, acc1, acc2, acc3 = w4_k_step(q, s, b_ptr, valid, k0, n_kz, acc0, acc1, acc2, acc3, n_k // 4, XMODE,
                                           DEC, BLOCK_K, EVEN_K)
    acc = w4_finish(acc0, acc1, acc2, acc3, XMODE) * (tl.load(g_ptr + nc) * fp4_acc_scale(DEC, 0))[:, None]
    t = tl.program_id(0) * SLOTS + tl.arange(0, SLOTS)
    mask = (n < n_out)[:, None] & (t < n_tok)[None, :]
    if SPLIT_K > 1:
        tl.store(ws_ptr + (z * n_tok + t.to(tl.int64))[None, :] * n_out + n[:, None], acc, mask=mask)
    else:
        tl.store(out_ptr + t.to(tl.int64)[None, :] * stride_ot + n[:, None], acc.to(out_ptr.dtype.element_ty),
                 mask=mask)


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


@triton.jit(do_not_specialize=["n_tok"])
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


@triton.jit(do_not_specialize=["n_elem"])
def _split_sum_kernel(ws_ptr, out_ptr, n_elem, n_out, stride_ot, n_split, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elem
    acc = tl.zeros([BLOCK], tl.float32)
    for s in range(0, n_split):
        acc += tl.load(ws_ptr + s * n_elem + offs, mask=mask, other=0.0)
    row = offs // n_out
    tl.store(out_ptr + row * stride_ot + offs % n_out, acc.to(out_ptr.dtype.element_ty), mask=mask)


def nvfp4_linear(x: torch.Tensor, w: NVFP4Tensor) -> torch.Tensor:
    """Triton `nvfp4_linear_ref` through the weight-stationary tensor-core kernel."""
    return nvfp4_linear_launch(x, w)


def nvfp4_linear_generic(x: torch.Tensor, w: NVFP4Tensor) -> torch.Tensor:
    """The first-generation kernels (a CUDA-core GEMV for one token, even/odd tensor-core tiles otherwise):
    slower than `nvfp4_linear`, kept as a separate code path the registry can fall back to."""
    return nvfp4_linear_launch(x, w, path="generic_auto")


def _check(x: torch.Tensor, w: NVFP4Tensor) -> None:
    if x.dim() != 2 or x.stride(1) != 1 or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"nvfp4_linear: x must be [T, K] bf16/fp16/fp32 with contiguous K, got {x.dtype} "
                         f"{tuple(x.shape)}")
    k = x.shape[1]
    q, s, g = w.packed, w.block_scale, w.global_scale
    if q.dim() != 2 or q.shape[1] * 2 != k or s.shape != (q.shape[0], k // 16) or g.shape != (q.shape[0],):
        raise ValueError(f"nvfp4_linear: weight {tuple(q.shape)}/{tuple(s.shape)}/{tuple(g.shape)} for K={k}")
    if q.dtype != torch.uint8 or s.dtype != torch.float8_e4m3fn or g.dtype != torch.float32:
        raise ValueError(f"nvfp4_linear: weight dtypes {q.dtype}/{s.dtype}/{g.dtype}")
    if q.stride(1) != 1 or s.stride(1) != 1 or not g.is_contiguous() or k % 16:
        raise ValueError("nvfp4_linear: weight tensors must be contiguous along K (K a multiple of 16)")
    if len({x.device, q.device, s.device, g.device}) != 1:
        raise ValueError("nvfp4_linear: tensors on different devices")


def nvfp4_linear_launch(x: torch.Tensor, w: NVFP4Tensor, *, path: str = "auto",
                        config: dict[str, Any] | None = None) -> torch.Tensor:
    """`nvfp4_linear` ('auto': the tensor-core kernel) or, with path 'generic_auto' / 'generic_gemv' /
    'generic_gemm', the first-generation kernels; tuning fields (tables `nvfp4_linear`,
    `nvfp4_linear_generic`) overridable."""
    _check(x, w)
    t, k = x.shape
    n = w.packed.shape[0]
    out = torch.empty((t, n), dtype=x.dtype, device=x.device)
    if t == 0 or n == 0:
        return out
    if path.startswith("generic_"):
        cfg = lookup("nvfp4_linear_generic", x.device, {"tokens": t, "n": n, "k": k})
        cfg.update(config or {})
        _generic(x, w, out, path.removeprefix("generic_"), cfg)
        return out
    if path != "auto":
        raise ValueError(f"nvfp4_linear: unknown path {path!r}")
    cfg = lookup("nvfp4_linear", x.device, {"tokens": t, "n": n, "k": k})
    cfg.update(config or {})
    _w4(x, w, out, cfg)
    return out


def _w4(x: torch.Tensor, w: NVFP4Tensor, out: torch.Tensor, cfg: dict[str, Any]) -> None:
    t, k = x.shape
    n = w.packed.shape[0]
    q = fp4_units(w.packed)
    s8 = w.block_scale.view(torch.uint8)
    if cfg["xmode"] not in ("quad", "perm", "split"):
        raise ValueError(f"nvfp4_linear: tuning field xmode {cfg['xmode']!r} is not one of 'quad', 'perm', 'split'")
    xmode = XMODES[cfg["xmode"]]
    if xmode == PERM and k % 4:
        xmode = SPLIT
    # the MMA's token side is at least 16 columns: 4 token slots in quad mode, 16 tokens otherwise
    slots = max(cfg["slots"], 4 if xmode == QUAD else 16)
    bn, table_bk = cfg["block_n"], cfg["block_k"]
    tiles = cdiv(t, slots) * cdiv(n, bn)
    want = cfg.get("split_k", 0)
    if not want:
        # automatic: split K only when the output tiles alone leave SMs idle (measured on H200: 6 splits
        # take the 3072 x 8192 decode GEMV from 22.4 to 15.5 us; 2 splits slow 16384 x 3072 down by 19%)
        sms = sm_count(x.device)
        want = 1 if tiles >= sms else max(1, min(cdiv(4 * sms, tiles), k // (2 * table_bk), 16))
    dec = decode_mode(x.dtype)
    warps = cfg["warps"]
    bk, stages = tile_for_dec(dec, table_bk, cfg["stages"])
    split, chunk = _split_k(k, bk, want)
    xs = x
    if xmode == PERM:
        xs = stage_x(x, x.dtype, 0, permute=True)
    ws = torch.empty((split, t, n), dtype=torch.float32, device=x.device) if split > 1 else out
    _w4_linear_kernel[(cdiv(t, slots), cdiv(n, bn), split)](
        xs, q, s8, w.global_scale, out, ws, t, n, k, chunk, chunk // 4, chunk // 16, xs.stride(0), q.stride(0),
        s8.stride(0), out.stride(0), XMODE=xmode, DEC=dec, EVEN_K=k % bk == 0, SLOTS=slots, BLOCK_N=bn, BLOCK_K=bk,
        SPLIT_K=split, num_warps=warps, num_stages=stages)
    if split > 1:
        block = 1024
        _split_sum_kernel[(cdiv(t * n, block),)](ws, out, t * n, n, out.stride(0), split, BLOCK=block,
                                                 num_warps=4)


def _split_k(n_k: int, block_k: int, want: int) -> tuple[int, int]:
    """(splits, K elements per split): at most `want` splits of whole BLOCK_K steps, none of them empty.
    Where K allows, chunks are multiples of 256 elements, so that a split's offset into the scale rows
    (chunk / 16 bytes) keeps the 16-byte alignment the asynchronous copies need."""
    want = max(1, want)
    step = max(block_k, 256) if n_k >= 256 * want else block_k
    chunk = cdiv(cdiv(n_k, want), step) * step
    return cdiv(n_k, chunk), chunk


def _generic(x: torch.Tensor, w: NVFP4Tensor, out: torch.Tensor, path: str, cfg: dict[str, Any]) -> None:
    t, k = x.shape
    q, s, g = w.packed, w.block_scale, w.global_scale
    n = q.shape[0]
    s8 = s.view(torch.uint8)
    if path == "auto":
        path = cfg["path"]
    if path == "gemv":
        bn, bk = cfg["gemv_block_n"], min(cfg["gemv_block_k"], triton.next_power_of_2(k))
        _nvfp4_gemv_kernel[(cdiv(n, bn), t)](x, q, s8, g, out, n, k, x.stride(0), q.stride(0), s8.stride(0),
                                             out.stride(0), BLOCK_N=bn, BLOCK_K=bk, num_warps=cfg["gemv_warps"])
        return
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
