"""Gated DeltaNet (Qwen3.5's linear attention): projections, depthwise causal conv with state, the gated
delta rule with a per-sequence recurrent state, gated RMSNorm and the output projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nibble.kernels.kernel_set import KernelSet
from nibble.layers.forward_batch import ForwardBatch, GDNState
from nibble.layers.linear import FusedProjections, Linear
from nibble.models.config import ModelConfig


class GatedDeltaNet(nn.Module):
    """hidden [T, hidden_size] -> [T, hidden_size] for one linear-attention layer.

    `num_k_heads`/`num_v_heads` default to the config's; a tensor-parallel rank passes its share.
    """

    def __init__(self, config: ModelConfig, prefix: str, kernels: KernelSet, dtype: torch.dtype,
                 device: torch.device | str, num_k_heads: int | None = None,
                 num_v_heads: int | None = None) -> None:
        super().__init__()
        self.kernels = kernels
        self.num_k_heads = num_k_heads or config.linear_num_key_heads
        self.num_v_heads = num_v_heads or config.linear_num_value_heads
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
            [("in_proj_qkv", self.conv_dim, quantized("in_proj_qkv")),
             ("in_proj_z", self.value_dim, quantized("in_proj_z")),
             ("in_proj_b", self.num_v_heads, quantized("in_proj_b")),
             ("in_proj_a", self.num_v_heads, quantized("in_proj_a"))],
            kernels=kernels, dtype=dtype, device=device)
        self.out_proj = Linear(self.value_dim, [config.hidden_size], quantized=quantized("out_proj"),
                               kernels=kernels, dtype=dtype, device=device)
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
        qkv = self.kernels.causal_conv1d(qkv, self.conv_weight, state.conv, batch.cu_seqlens_q,
                                         batch.state_slots)
        q, k, v = torch.split(qkv, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(num_tokens, self.num_k_heads, self.key_head_dim)
        k = k.reshape(num_tokens, self.num_k_heads, self.key_head_dim)
        v = v.reshape(num_tokens, self.num_v_heads, self.value_head_dim)
        g = self.neg_A * F.softplus(a.float() + self.dt_bias)
        beta = torch.sigmoid(b)
        o = self.kernels.gated_delta_rule(q, k, v, g, beta, state.ssm, batch.cu_seqlens_q, batch.state_slots)
        o = self.kernels.gated_rms_norm(o.reshape(-1, self.value_head_dim),
                                        z.reshape(-1, self.value_head_dim), self.norm_weight, self.eps)
        return self.out_proj(o.reshape(num_tokens, self.value_dim))
