"""Gated DeltaNet (Qwen3.5's linear attention): projections, depthwise causal conv with state, the gated
delta rule with a per-sequence recurrent state, gated RMSNorm and the output projection.

Under tensor parallelism each rank holds num_k_heads / tp key heads and num_v_heads / tp value heads (the
value heads its key heads serve, so the recurrence is rank-local). in_proj_qkv's output is
[q (all key heads) | k (all key heads) | v (all value heads)]: a rank takes its heads' slice of each part,
and the conv1d channels the same way; z, b, a, A_log and dt_bias go by value head; out_proj is
row-parallel. The state pool of a rank holds its heads only.

In a speculative verify step (`ForwardBatch.spec_slots`) the conv and delta-rule kernels leave the state
after each of a sequence's tokens in its own slot instead of updating the sequence's slot in place.
"""

from __future__ import annotations

import torch
from torch import nn

from nibble.kernels.kernel_set import KernelSet
from nibble.layers.forward_batch import ForwardBatch, GDNState
from nibble.layers.linear import FusedProjections, RowParallelLinear
from nibble.layers.parallel import SINGLE, ParallelContext, Partition
from nibble.models.config import ModelConfig


class GatedDeltaNet(nn.Module):
    """hidden [T, hidden_size] -> [T, hidden_size] for one linear-attention layer (this rank's heads)."""

    def __init__(self, config: ModelConfig, prefix: str, kernels: KernelSet, dtype: torch.dtype,
                 device: torch.device | str, parallel: ParallelContext = SINGLE) -> None:
        super().__init__()
        self.kernels = kernels
        parallel.split(config.linear_num_key_heads, "linear_num_key_heads")
        # A_log, dt_bias and the rows of in_proj_b / in_proj_a go by value head.
        self.head_partition = parallel.split(config.linear_num_value_heads, "linear_num_value_heads")
        key_part = parallel.split(config.linear_key_dim, "GDN key dim")
        value_part = parallel.split(config.linear_value_dim, "GDN value dim")
        # Rows of in_proj_qkv and channels of conv1d this rank keeps.
        self.conv_partition = Partition.concat([key_part, key_part, value_part])
        self.num_k_heads = config.linear_num_key_heads // parallel.tp_size
        self.num_v_heads = config.linear_num_value_heads // parallel.tp_size
        self.key_head_dim = config.linear_key_head_dim
        self.value_head_dim = config.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.key_head_dim
        self.value_dim = self.num_v_heads * self.value_head_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.eps = config.rms_norm_eps

        def quantized(name: str) -> bool:
            return config.quant is not None and config.quant.is_quantized(f"{prefix}.{name}")

        self.in_proj = FusedProjections(
            config.hidden_size,
            [("in_proj_qkv", self.conv_partition, quantized("in_proj_qkv")),
             ("in_proj_z", value_part, quantized("in_proj_z")),
             ("in_proj_b", self.head_partition, quantized("in_proj_b")),
             ("in_proj_a", self.head_partition, quantized("in_proj_a"))],
            kernels=kernels, dtype=dtype, device=device)
        self.out_proj = RowParallelLinear(config.linear_value_dim, config.hidden_size,
                                          quantized=quantized("out_proj"), kernels=kernels, dtype=dtype,
                                          device=device, parallel=parallel)
        self.conv_weight = nn.Parameter(
            torch.empty(self.conv_dim, config.linear_conv_kernel_dim, dtype=dtype, device=device),
            requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads, dtype=torch.float32, device=device),
                                  requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads, dtype=torch.float32, device=device),
                                    requires_grad=False)
        self.norm_weight = nn.Parameter(torch.empty(self.value_head_dim, dtype=dtype, device=device),
                                        requires_grad=False)
        self.neg_A: torch.Tensor | None = None

    def finalize(self) -> None:
        self.neg_A = -self.A_log.data.float().exp()

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch, state: GDNState) -> torch.Tensor:
        assert self.neg_A is not None, "GatedDeltaNet.finalize() was not called after loading weights"
        num_tokens = hidden.shape[0]
        qkv, z, b, a = self.in_proj(hidden)
        spec = batch.spec_slots
        if spec is not None:
            qkv = self.kernels.causal_conv1d_spec(qkv, self.conv_weight, state.conv, batch.state_slots, spec)
        else:
            qkv = self.kernels.causal_conv1d(qkv, self.conv_weight, state.conv, batch.cu_seqlens_q,
                                             batch.state_slots)
        q, k, v = torch.split(qkv, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(num_tokens, self.num_k_heads, self.key_head_dim)
        k = k.reshape(num_tokens, self.num_k_heads, self.key_head_dim)
        v = v.reshape(num_tokens, self.num_v_heads, self.value_head_dim)
        if spec is not None:
            o = self.kernels.gated_delta_rule_spec(q, k, v, a, b, self.neg_A, self.dt_bias, state.ssm,
                                                   batch.state_slots, spec)
        elif batch.is_decode:
            o = self.kernels.gated_delta_rule_decode(q, k, v, a, b, self.neg_A, self.dt_bias, state.ssm,
                                                     batch.state_slots)
        else:
            g, beta = self.kernels.gdn_gating(a, b, self.neg_A, self.dt_bias)
            o = self.kernels.gated_delta_rule(q, k, v, g, beta, state.ssm, batch.cu_seqlens_q, batch.state_slots,
                                              cu_seqlens_cpu=batch.cu_seqlens_q_cpu or None)
        o = self.kernels.gated_rms_norm(o.reshape(-1, self.value_head_dim),
                                        z.reshape(-1, self.value_head_dim), self.norm_weight, self.eps)
        return self.out_proj(o.reshape(num_tokens, self.value_dim))
