"""Paged attention for the full-attention layers: K/V writes by slot_mapping and causal attention of
each sequence's new queries over its cached context through block_table."""

from __future__ import annotations

import torch

from nibble.kernels._triton import f32_to_e4m3, fp8_native, next_pow2, tl, triton


def store_kv_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """k, v: [T, Hk, D]; caches: [num_blocks, block_size, Hk, D]; slot_mapping: int64 [T] (-1 = skip).

    An FP8 cache stores value / scale.
    """
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    kc = k_cache.view(-1, *k_cache.shape[2:])
    vc = v_cache.view(-1, *v_cache.shape[2:])
    kk, vv = k[valid], v[valid]
    if k_cache.dtype != k.dtype:
        kk = (kk.float() / k_scale).to(k_cache.dtype)
        vv = (vv.float() / v_scale).to(v_cache.dtype)
    kc[slots] = kk
    vc[slots] = vv


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                        scale: float, k_scale: float = 1.0, v_scale: float = 1.0,
                        max_query_len: int = 0, max_seq_len: int = 0) -> torch.Tensor:
    """q: [T, Hq, D]; caches: [num_blocks, block_size, Hk, D]; cu_seqlens_q: int32 [B+1];
    seq_lens: int32 [B] (context incl. the new tokens, already stored); block_table: int32 [B, max_blocks].

    Query j of sequence i sits at position seq_len - q_len + j and attends keys 0..that position.
    Returns [T, Hq, D] in q's dtype; softmax in fp32.
    """
    _, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    block_size = k_cache.shape[1]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    kc = k_cache.view(-1, num_kv_heads, head_dim)
    vc = v_cache.view(-1, num_kv_heads, head_dim)
    for i, seq_len in enumerate(lens):
        start, end = cu[i], cu[i + 1]
        q_len = end - start
        if q_len == 0:
            continue
        pos = torch.arange(seq_len, device=q.device)
        slots = block_table[i, pos // block_size].long() * block_size + pos % block_size
        k = kc[slots].float() * k_scale
        v = vc[slots].float() * v_scale
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        qi = q[start:end].float()
        scores = torch.einsum("qhd,khd->hqk", qi, k) * scale
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        mask = pos[None, :] > q_pos[:, None]
        scores = scores.masked_fill(mask[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
    return out


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, n_heads, head_dim, block_size, inv_k_scale,
                     inv_v_scale, stride_kt, stride_kh, stride_vt, stride_vh, stride_cb, stride_cs, stride_ch,
                     stride_vb, stride_vs, stride_vch, TO_FP8: tl.constexpr, FP8_NATIVE: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok)
    if slot < 0:
        return
    blk = slot // block_size
    off = slot % block_size
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h[:, None] < n_heads) & (d[None, :] < head_dim)
    k = tl.load(k_ptr + tok * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask, other=0.0)
    v = tl.load(v_ptr + tok * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask, other=0.0)
    kc = kc_ptr + blk * stride_cb + off * stride_cs + h[:, None] * stride_ch + d[None, :]
    vc = vc_ptr + blk * stride_vb + off * stride_vs + h[:, None] * stride_vch + d[None, :]
    if TO_FP8:
        k = k.to(tl.float32) * inv_k_scale
        v = v.to(tl.float32) * inv_v_scale
        if FP8_NATIVE:
            k = tl.minimum(tl.maximum(k, -448.0), 448.0).to(kc_ptr.dtype.element_ty)
            v = tl.minimum(tl.maximum(v, -448.0), 448.0).to(vc_ptr.dtype.element_ty)
        else:
            k = f32_to_e4m3(k)
            v = f32_to_e4m3(v)
    tl.store(kc, k.to(kc_ptr.dtype.element_ty), mask=mask)
    tl.store(vc, v.to(vc_ptr.dtype.element_ty), mask=mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Triton `store_kv_ref`: one program per token writes all its K/V heads; slots < 0 are skipped. An FP8
    cache gets round-to-nearest-even e4m3 of value / scale, saturated at +-448 (never NaN)."""
    if k.dim() != 3 or v.shape != k.shape or k.stride(2) != 1 or v.stride(2) != 1:
        raise ValueError(f"store_kv: k {tuple(k.shape)} / v {tuple(v.shape)} must be [T, Hk, D] alike")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape or k_cache.shape[2:] != k.shape[1:]:
        raise ValueError(f"store_kv: caches {tuple(k_cache.shape)} do not hold heads {tuple(k.shape[1:])}")
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1 or k_cache.dtype != v_cache.dtype:
        raise ValueError("store_kv: caches must share a dtype and have a contiguous head dim")
    if slot_mapping.shape != (k.shape[0],) or slot_mapping.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"store_kv: slot_mapping {tuple(slot_mapping.shape)}/{slot_mapping.dtype}")
    if not (k.device == v.device == k_cache.device == v_cache.device == slot_mapping.device):
        raise ValueError("store_kv: tensors on different devices")
    to_fp8 = k_cache.dtype == torch.float8_e4m3fn
    if not to_fp8 and k_cache.dtype != k.dtype:
        raise ValueError(f"store_kv: cache dtype {k_cache.dtype} for {k.dtype} values")
    t, hk, d = k.shape
    if t == 0:
        return
    native = fp8_native(k.device)
    kc = k_cache if native or not to_fp8 else k_cache.view(torch.uint8)
    vc = v_cache if native or not to_fp8 else v_cache.view(torch.uint8)
    _store_kv_kernel[(t,)](
        k, v, kc, vc, slot_mapping, hk, d, k_cache.shape[1], 1.0 / k_scale, 1.0 / v_scale, k.stride(0),
        k.stride(1), v.stride(0), v.stride(1), kc.stride(0), kc.stride(1), kc.stride(2), vc.stride(0),
        vc.stride(1), vc.stride(2), TO_FP8=to_fp8, FP8_NATIVE=native, BLOCK_H=next_pow2(hk),
        BLOCK_D=next_pow2(d), num_warps=4)
