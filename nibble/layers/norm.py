"""RMSNorm modules. Qwen3.5 stores zero-centred weights (the multiplier is 1 + w); the +1 is folded in
once after loading so the kernel sees a plain multiplier."""

from __future__ import annotations

import torch
from torch import nn

from nibble.kernels.kernel_set import KernelSet
from nibble.layers.moe import MoEOutput


class RMSNorm(nn.Module):
    """x [T, H] -> rmsnorm(x) * (1 + w), optionally fused with the residual add (see kernels.norm); x may
    also be a MoE block's uncombined output, combined in the same launch (it then needs the residual)."""

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

    def forward(self, x: torch.Tensor | MoEOutput, residual: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if isinstance(x, MoEOutput):
            if residual is None:
                raise ValueError("RMSNorm: a MoE block's output needs the residual stream")
            return self.kernels.rms_norm_moe(x.routed, x.shared, x.gate_logit, self.loaded_multiplier(), self.eps,
                                             residual)
        return self.kernels.rms_norm(x, self.loaded_multiplier(), self.eps, residual)
