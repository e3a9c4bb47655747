"""Gated full attention of Qwen3.5: q_proj yields [query | gate] per head, per-head q/k RMSNorm (one
launch for both, reading the heads in place from the fused projection), partial RoPE, paged KV cache, GQA,
and the output gated by sigmoid(gate) before o_proj.

Under tensor parallelism each rank holds num_heads / tp query heads (with their gate halves: q_proj's rows
are [query | gate] per head, so a rank's heads are one contiguous block of rows) and o_proj is
row-parallel. KV heads are split when num_kv_heads % tp == 0; otherwise (more ranks than KV heads, e.g.
Qwen3.5's 2 KV heads at tp 4 or 8) each rank keeps the one KV head its query heads read, duplicated across
the ranks that share it.
"""

from __future__ import annotations

import torch
from torch import nn

from nibble.kernels.kernel_set import KernelSet
from nibble.layers.forward_batch import ForwardBatch, KVCache
from nibble.layers.linear import FusedProjections, RowParallelLinear
from nibble.layers.norm import RMSNorm
from nibble.layers.parallel import SINGLE, ParallelContext, ParallelError, Partition
from nibble.layers.rotary import RotaryEmbedding
from nibble.models.config import ModelConfig


class GatedAttention(nn.Module):
    """hidden [T, hidden_size] -> [T, hidden_size] for one full-attention layer (this rank's heads)."""

    def __init__(self, config: ModelConfig, prefix: str, kernels: KernelSet, rotary: RotaryEmbedding,
                 dtype: torch.dtype, device: torch.device | str, parallel: ParallelContext = SINGLE) -> None:
        super().__init__()
        self.kernels = kernels
        self.rotary = rotary
        self.head_dim = config.head_dim
        self.gated = config.attn_output_gate
        self.scale = self.head_dim ** -0.5
        parallel.split(config.num_attention_heads, "num_attention_heads")
        q_part = parallel.split(config.q_proj_size, "q_proj rows")
        kv_part = kv_head_partition(config.num_key_value_heads, config.head_dim, parallel)
        self.num_heads = config.num_attention_heads // parallel.tp_size
        self.num_kv_heads = kv_part.size // self.head_dim

        def quantized(name: str) -> bool:
            return config.quant is not None and config.quant.is_quantized(f"{prefix}.{name}")

        self.qkv = FusedProjections(
            config.hidden_size,
            [("q_proj", q_part, quantized("q_proj")), ("k_proj", kv_part, quantized("k_proj")),
             ("v_proj", kv_part, quantized("v_proj"))],
            kernels=kernels, dtype=dtype, device=device)
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size,
                                        quantized=quantized("o_proj"), kernels=kernels, dtype=dtype, device=device,
                                        parallel=parallel)
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
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = self.kernels.qk_rms_norm(q, k, self.q_norm.loaded_multiplier(), self.k_norm.loaded_multiplier(),
                                        self.q_norm.eps)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(q, k, batch.positions, batch.rope_cos_sin)
        self.kernels.store_kv(k, v, cache.k, cache.v, batch.slot_mapping, cache.k_scale, cache.v_scale)
        out = self.kernels.paged_attention(
            q, cache.k, cache.v, batch.cu_seqlens_q, batch.seq_lens, batch.block_table, self.scale,
            cache.k_scale, cache.v_scale, batch.max_query_len, batch.max_seq_len)
        if gate is not None:
            out = self.kernels.sigmoid_mul(out, gate)
        return self.o_proj(out.reshape(num_tokens, -1))


def kv_head_partition(num_kv_heads: int, head_dim: int, parallel: ParallelContext) -> Partition:
    """Rows of k_proj/v_proj ([num_kv_heads * head_dim]) this rank keeps: its share of the KV heads, or the
    single KV head its query heads use when there are fewer KV heads than ranks."""
    tp = parallel.tp_size
    if num_kv_heads % tp == 0:
        return parallel.split(num_kv_heads * head_dim, "num_key_value_heads")
    if tp % num_kv_heads:
        raise ParallelError(f"num_key_value_heads ({num_kv_heads}) and --tensor-parallel-size {tp}: one must "
                            "divide the other")
    head = parallel.tp_rank // (tp // num_kv_heads)
    return Partition(num_kv_heads * head_dim, ((head * head_dim, (head + 1) * head_dim),))
