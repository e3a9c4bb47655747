"""Partial rotary embedding of Qwen3.5 (rotate-half on the first rotary_dim channels of each head)."""

from __future__ import annotations

import torch
from torch import nn

from nibble.kernels.kernel_set import KernelSet
from nibble.kernels.rope import build_cos_sin_cache
from nibble.models.rope_scaling import RopeScaling


class RotaryEmbedding(nn.Module):
    """Holds the fp32 cos/sin table [max_positions, rotary_dim] (frequencies scaled as `scaling` says, e.g.
    YaRN) and applies it to q [T, Hq, D], k [T, Hk, D]."""

    def __init__(self, rotary_dim: int, max_positions: int, theta: float, kernels: KernelSet,
                 device: torch.device | str, scaling: RopeScaling | None = None) -> None:
        super().__init__()
        self.kernels = kernels
        self.register_buffer("cos_sin_cache",
                             build_cos_sin_cache(rotary_dim, max_positions, theta, device, scaling=scaling),
                             persistent=False)

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                table: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """table: fp32 [rows, rotary_dim] to read at `positions` instead of the 1-D cache (a step's per-token
        M-RoPE rows, read at arange(T))."""
        return self.kernels.rope(q, k, positions, self.cos_sin_cache if table is None else table)
