"""Gated full attention of Qwen3.5: q_proj yields [query | gate] per head, per-head q/k RMSNorm, partial
RoPE, paged KV cache, GQA, and the output gated by sigmoid(gate) before o_proj."""

from __future__ import annotations

import torch
from torch import nn

from nibble.kernels.kernel_set import KernelSet
from nibble.layers.forward_batch import ForwardBatch, KVCache
from nibble.layers.linear import FusedProjections, Linear
from nibble.layers.norm import RMSNorm
from nibble.layers.rotary import RotaryEmbedding
from nibble.models.config import ModelConfig


class GatedAttention(nn.Module):
    """hidden [T, hidden_size] -> [T, hidden_size] for one full-attention layer."""

    def __init__(self, config: ModelConfig, prefix: str, kernels: KernelSet, rotary: RotaryEmbedding,
                 dtype: torch.dtype, device: torch.device | str, num_heads: int | None = None,
                 num_kv_heads: int | None = None) -> None:
        super().__init__()
        self.kernels = kernels
        self.rotary = rotary
        self.num_heads = num_heads or config.num_attention_heads
        self.num_kv_heads = num_kv_heads or config.num_key_value_heads
        self.head_dim = config.head_dim
        self.gated = config.attn_output_gate
        self.scale = self.head_dim ** -0.5
        q_size = self.num_heads * self.head_dim * (2 if self.gated else 1)
        kv_size = self.num_kv_heads * self.head_dim

        def quantized(name: str) -> bool:
            return config.quant is not None and config.quant.is_quantized(f"{prefix}.{name}")

        self.qkv = FusedProjections(
            config.hidden_size,
            [("q_proj", q_size, quantized("q_proj")), ("k_proj", kv_size, quantized("k_proj")),
             ("v_proj", kv_size, quantized("v_proj"))],
            kernels=kernels, dtype=dtype, device=device)
        self.o_proj = Linear(self.num_heads * self.head_dim, [config.hidden_size], quantized=quantized("o_proj"),
                             kernels=kernels, dtype=dtype, device=device)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, kernels, device)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, kernels, device)

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch, cache: KVCache) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv(hidden)
        if self.gated:
            qg = q.view(num_tokens, self.num_heads, 2 * self.head_dim)
            q, gate = qg[..., : self.head_dim], qg[..., self.head_dim:]
        else:
            q = q.view(num_tokens, self.num_heads, self.head_dim)
            gate = None
        q = self.q_norm(q.reshape(-1, self.head_dim))[0].view(num_tokens, self.num_heads, self.head_dim)
        k = self.k_norm(k.reshape(-1, self.head_dim))[0].view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(q, k, batch.positions)
        self.kernels.store_kv(k, v, cache.k, cache.v, batch.slot_mapping, cache.k_scale, cache.v_scale)
        out = self.kernels.paged_attention(
            q, cache.k, cache.v, batch.cu_seqlens_q, batch.seq_lens, batch.block_table, self.scale,
            cache.k_scale, cache.v_scale, batch.max_query_len, batch.max_seq_len)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out.reshape(num_tokens, -1))
