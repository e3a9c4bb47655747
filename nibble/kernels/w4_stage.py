"""Activations staged for the NVFP4 tensor-core kernels (moe_w4.py, nvfp4_linear.py): converted to the MMA's
dtype (bf16 as fp16 * 2^-X_SHIFT for the e4m3-converter decode, fp4_tiles.py) and laid out in the K order the
weight decode yields (`fp4_decode4`'s four stride-4 slices for PERM mode, DEC 4's `pairs_col` order), or
gathered in the sorted pair order of a `moe_align`ment for the Gluon gate_up (`gather_chunks`, moe_gluon.py)."""

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
def chunk_src(c, CHUNK: tl.constexpr):
    """Element of x that column c of a row staged for the Gluon tiles (moe_gluon.py) holds: inside each CHUNK of
    K, slice t, column u holds element 4u + t (the order of the e4m3-converter decode's four outputs)."""
    cc = c % CHUNK
    return c - cc + 4 * (cc % (CHUNK // 4)) + cc // (CHUNK // 4)


@triton.jit
def gather_chunks_kernel(x_ptr, sorted_ptr, block_expert_ptr, out_ptr, top_k, n_k, stride_xt, stride_ot,
                         BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, X_SHIFT: tl.constexpr, BLOCK: tl.constexpr):
    """Row r of out = x[sorted[r] // top_k] * 2^-X_SHIFT, each CHUNK of K columns in slice order (`chunk_src`);
    rows of padding (sorted[r] < 0) and of blocks past the end (block_expert < 0, whose sorted entries are
    unwritten) are left alone. Each program stores BLOCK contiguous columns and gathers their elements (within
    CHUNK-wide spans of the row, which L1 serves): scattering the stores instead made 2-byte writes 16 columns
    apart."""
    r = tl.program_id(0)
    if tl.load(block_expert_ptr + r // BLOCK_M) < 0:
        return
    pair = tl.load(sorted_ptr + r)
    if pair < 0:
        return
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = c < n_k
    v = tl.load(x_ptr + (pair // top_k).to(tl.int64) * stride_xt + chunk_src(c, CHUNK), mask=mask)
    if X_SHIFT != 0:
        v = f16_range(v.to(tl.float32) * (1.0 / (1 << X_SHIFT)))
    tl.store(out_ptr + r.to(tl.int64) * stride_ot + c, v.to(out_ptr.dtype.element_ty), mask=mask)


def gather_chunks(x: torch.Tensor, sorted_ids: torch.Tensor, block_expert: torch.Tensor, top_k: int, chunk: int,
                  dtype: torch.dtype, x_shift: int) -> torch.Tensor:
    """x [T, K]; sorted_ids int32 [R] and block_expert int32 [R / block_m] of a `moe_align`ment -> [R, K] of
    `dtype`: row r holds the token of pair sorted_ids[r] (pair // top_k), times 2^-x_shift, in `chunk_src`'s
    order (K a multiple of chunk, chunk of 4). Rows of padding and of unused blocks are not written (whatever
    they hold only reaches their own MMA columns, which no epilogue stores)."""
    k = x.shape[1]
    r = sorted_ids.shape[0]
    if k % chunk or chunk % 4:
        raise ValueError(f"gather_chunks: K = {k} is not a multiple of the chunk {chunk} (itself of 4)")
    if r % block_expert.shape[0] or x.stride(1) != 1:
        raise ValueError(f"gather_chunks: {r} sorted entries do not fill {block_expert.shape[0]} blocks, or x's "
                         f"columns are strided")
    out = torch.empty((r, k), dtype=dtype, device=x.device)
    if r:
        block = min(1024, 1 << (k - 1).bit_length())
        gather_chunks_kernel[(r, cdiv(k, block))](x, sorted_ids, block_expert, out, top_k, k, x.stride(0),
                                                  out.stride(0), BLOCK_M=r // block_expert.shape[0], CHUNK=chunk,
                                                  X_SHIFT=x_shift, BLOCK=block, num_warps=4)
    return out


def gather_chunks_ref(x: torch.Tensor, sorted_ids: torch.Tensor, block_expert: torch.Tensor, top_k: int, chunk: int,
                      dtype: torch.dtype, x_shift: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch version of `gather_chunks`: (out [R, K], written bool [R]); unwritten rows are zeros here."""
    r, k = sorted_ids.shape[0], x.shape[1]
    block_m = r // block_expert.shape[0]
    written = (block_expert.long().repeat_interleave(block_m) >= 0) & (sorted_ids.long() >= 0)
    rows = torch.where(written, sorted_ids.long(), 0) // top_k
    v = x[rows].float() * 2.0 ** -x_shift
    if x_shift:
        v = v.clamp(-65504.0, 65504.0)
    v = v.view(r, k // chunk, chunk // 4, 4).transpose(2, 3).reshape(r, k)
    return torch.where(written[:, None], v, 0.0).to(dtype), written
