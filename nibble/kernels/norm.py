"""RMSNorm (optionally fused with the residual add) and the gated RMSNorm of Gated DeltaNet."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x: [T, H] (or [..., H]); weight: fp32 [H], the full multiplier (Qwen's zero-centred `1 + w` is
    folded in at load time); residual: like x or None.

    With a residual, s = x + residual (in x's dtype) is returned as the new residual and normalised;
    without, x is normalised and None returned. Normalisation is in fp32, output in x's dtype.
    """
    if residual is not None:
        x = x + residual
        residual = x
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return out.to(x.dtype), residual


def gated_rms_norm_ref(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x, gate: [N, D]; weight: [D] (plain multiplier). Returns weight * rmsnorm(x) * silu(gate) in x's
    dtype (fp32 inside)."""
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    out = weight.to(x.dtype) * normed
    return (out.float() * F.silu(gate.float())).to(x.dtype)
