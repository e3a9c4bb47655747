"""Paged attention for the full-attention layers: K/V writes by slot_mapping and causal attention of
each sequence's new queries over its cached context through block_table."""

from __future__ import annotations

import torch


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
    num_tokens, num_heads, head_dim = q.shape
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
