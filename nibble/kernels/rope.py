"""Rotary position embedding on the first `rotary_dim` channels of each head (rotate-half/NeoX style),
as Qwen3.5's partial RoPE; text-only mRoPE positions reduce to this."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from nibble.kernels._triton import next_pow2, tl, triton

if TYPE_CHECKING:
    # annotations only: kernels do not depend on the model package at run time
    from nibble.models.rope_scaling import RopeScaling


def rope_inv_freq(rotary_dim: int, theta: float, scaling: RopeScaling | None = None) -> torch.Tensor:
    """fp32 [rotary_dim / 2] inverse frequencies, scaled as `scaling` says (None: plain RoPE).

    The same fp32 operations, in the same order, as transformers' default, linear and YaRN rope init
    functions, so that the tables agree bit for bit."""
    if scaling is None:
        return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
    pos_freqs = theta ** (torch.arange(0, rotary_dim, 2).to(dtype=torch.float32) / rotary_dim)
    if scaling.rope_type == "linear":
        return 1.0 / pos_freqs / scaling.factor
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (scaling.factor * pos_freqs)
    low, high = scaling.correction_range(rotary_dim, theta)
    if low == high:
        high += 0.001  # a one-index ramp would divide by zero
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: the frequency as pretrained (short wavelengths), 0: divided by factor
    return interpolation * (1 - keep) + extrapolation * keep


def build_cos_sin_cache(rotary_dim: int, max_positions: int, theta: float,
                        device: torch.device | str = "cpu", scaling: RopeScaling | None = None) -> torch.Tensor:
    """fp32 [max_positions, rotary_dim]: cos of the rotary_dim/2 frequencies, then their sin; with `scaling`,
    the frequencies of `rope_inv_freq` and both halves times its attention_scaling."""
    inv_freq = rope_inv_freq(rotary_dim, theta, scaling)
    t = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)
    table = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    if scaling is not None and scaling.rope_type == "yarn":
        table = table * scaling.attention_scaling
    return table.to(device)


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


@triton.jit
def _rotate(x_ptr, stride_t, stride_h, tok, n_heads, cos, sin, half,
            HEADS: tl.constexpr, HALF: tl.constexpr):
    heads = tl.arange(0, HEADS)
    cols = tl.arange(0, HALF)
    for h0 in range(0, n_heads, HEADS):
        hh = h0 + heads
        mask = (hh[:, None] < n_heads) & (cols[None, :] < half)
        p1 = x_ptr + tok * stride_t + hh[:, None].to(tl.int64) * stride_h + cols[None, :]
        x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(p1 + half, mask=mask, other=0.0).to(tl.float32)
        tl.store(p1, (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty), mask=mask)
        tl.store(p1 + half, (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(q_ptr, k_ptr, pos_ptr, cs_ptr, n_q_heads, n_k_heads, half, stride_qt, stride_qh,
                 stride_kt, stride_kh, stride_cs, HEADS: tl.constexpr, HALF: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    cols = tl.arange(0, HALF)
    cmask = cols < half
    cos = tl.load(cs_ptr + pos * stride_cs + cols, mask=cmask, other=0.0)[None, :]
    sin = tl.load(cs_ptr + pos * stride_cs + half + cols, mask=cmask, other=0.0)[None, :]
    _rotate(q_ptr, stride_qt, stride_qh, tok, n_q_heads, cos, sin, half, HEADS, HALF)
    _rotate(k_ptr, stride_kt, stride_kh, tok, n_k_heads, cos, sin, half, HEADS, HALF)


def rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
         cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton `rope_ref`, IN PLACE on the first rotary_dim channels of q and k (which it returns).

    q and k may be strided views (e.g. slices of a fused projection) as long as the head dim is
    contiguous. One program per token covers all heads of q and k.
    """
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"rope: q {tuple(q.shape)} / k {tuple(k.shape)} must be [T, H, D] alike")
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("rope: the head dim of q and k must be contiguous")
    if positions.shape != (q.shape[0],):
        raise ValueError(f"rope: positions {tuple(positions.shape)} for {q.shape[0]} tokens")
    rot = cos_sin_cache.shape[-1]
    if rot % 2 or rot > q.shape[2] or cos_sin_cache.dtype != torch.float32:
        raise ValueError(f"rope: cos_sin_cache {tuple(cos_sin_cache.shape)}/{cos_sin_cache.dtype} "
                         f"for head dim {q.shape[2]}")
    if not (q.device == k.device == positions.device == cos_sin_cache.device):
        raise ValueError("rope: tensors on different devices")
    cs = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    n = q.shape[0]
    if n:
        half = rot // 2
        block = next_pow2(half)
        heads = max(1, min(next_pow2(max(q.shape[1], k.shape[1])), 4096 // block))
        _rope_kernel[(n,)](q, k, positions, cs, q.shape[1], k.shape[1], half, q.stride(0), q.stride(1),
                           k.stride(0), k.stride(1), cs.stride(0), HEADS=heads, HALF=block, num_warps=4)
    return q, k
