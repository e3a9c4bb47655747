"""Rotary position embedding on the first `rotary_dim` channels of each head (rotate-half/NeoX style),
as Qwen3.5's partial RoPE; text-only mRoPE positions reduce to this."""

from __future__ import annotations

import torch


def build_cos_sin_cache(rotary_dim: int, max_positions: int, theta: float,
                        device: torch.device | str = "cpu") -> torch.Tensor:
    """fp32 [max_positions, rotary_dim]: cos of the rotary_dim/2 frequencies, then their sin."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
    t = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(device)


def rope_ref(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
             cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, Hq, D]; k: [T, Hk, D]; positions: int64 [T]; cos_sin_cache: fp32 [max_pos, rotary_dim].

    Returns rotated (q, k) in their dtypes; channels past rotary_dim pass through.
    """
    rot = cos_sin_cache.shape[-1]
    half = rot // 2
    cs = cos_sin_cache[positions]
    cos = torch.cat((cs[:, :half], cs[:, :half]), dim=-1).unsqueeze(1)
    sin = torch.cat((cs[:, half:], cs[:, half:]), dim=-1).unsqueeze(1)

    def apply(x: torch.Tensor) -> torch.Tensor:
        xr = x[..., :rot].float()
        x1, x2 = xr[..., :half], xr[..., half:]
        rotated = torch.cat((-x2, x1), dim=-1)
        out = (xr * cos + rotated * sin).to(x.dtype)
        return torch.cat((out, x[..., rot:]), dim=-1)

    return apply(q), apply(k)
