"""RMSNorm modules. Qwen3.5 stores zero-centred weights (the multiplier is 1 + w); the +1 is folded in
once after loading so the kernel sees a plain multiplier."""

from __future__ import annotations

import torch
from torch import nn

from nibble.kernels.kernel_set import KernelSet


class RMSNorm(nn.Module):
    """x [T, H] -> rmsnorm(x) * (1 + w), optionally fused with the residual add (see kernels.norm)."""

    def __init__(self, hidden_size: int, eps: float, kernels: KernelSet, device: torch.device | str,
                 zero_centered: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.kernels = kernels
        self.zero_centered = zero_centered
        self.weight = nn.Parameter(torch.zeros(hidden_size, dtype=torch.float32, device=device),
                                   requires_grad=False)
        self.multiplier: torch.Tensor | None = None

    def finalize(self) -> None:
        """Fold the zero-centring into an fp32 multiplier; call once after the weights are loaded."""
        w = self.weight.data.float()
        self.multiplier = (1.0 + w) if self.zero_centered else w

    def loaded_multiplier(self) -> torch.Tensor:
        """The fp32 multiplier [H]; for layers that pass it to a fused kernel themselves."""
        if self.multiplier is None:
            raise RuntimeError("RMSNorm.finalize() was not called after loading weights")
        return self.multiplier

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.kernels.rms_norm(x, self.loaded_multiplier(), self.eps, residual)
