"""NVFP4 (ModelOpt layout): E2M1 codes packed two per byte, one e4m3 scale per 16 inputs, one fp32
global scale.

Checkpoint form of one linear [N, K]: `weight` uint8 [N, K/2] (low nibble = even element),
`weight_scale` float8_e4m3fn [N, K/16], `weight_scale_2` fp32 scalar.
Compute form (`NVFP4Tensor`): the same two tensors plus the global scale expanded to one fp32 value per
output row, so that fused or stacked weights (gate|up, per-expert stacks) with different checkpoint
global scales share one representation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GROUP_SIZE = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def e2m1_table(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The 16 E2M1 values indexed by code (bit 3 is the sign)."""
    return torch.tensor(E2M1_VALUES, dtype=dtype, device=device)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] -> uint8 codes [..., K] (low nibble first)."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed FP4 must be uint8, got {packed.dtype}")
    lo = packed & 0x0F
    hi = packed >> 4
    return torch.stack((lo, hi), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., K] (K even) -> uint8 [..., K/2] (low nibble = even element)."""
    if codes.shape[-1] % 2:
        raise ValueError(f"last dim must be even to pack FP4, got {codes.shape[-1]}")
    codes = codes.to(torch.uint8)
    return (codes[..., 1::2] << 4) | codes[..., 0::2]


@dataclass
class NVFP4Tensor:
    """NVFP4 weight of logical shape [..., N, K] in compute form.

    packed: uint8 [..., N, K/2]; block_scale: float8_e4m3fn [..., N, K/16]; global_scale: fp32 [..., N].
    """

    packed: torch.Tensor
    block_scale: torch.Tensor
    global_scale: torch.Tensor

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.packed.shape[:-1], self.packed.shape[-1] * 2)

    @property
    def device(self) -> torch.device:
        return self.packed.device

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.block_scale, self.global_scale))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Exact dequantization: e2m1[code] * float(block_scale) * global_scale, then cast to dtype."""
        return dequantize(self.packed, self.block_scale, self.global_scale.unsqueeze(-1), dtype)

    def select(self, index: int | torch.Tensor) -> NVFP4Tensor:
        """Index the leading (expert) dimension."""
        return NVFP4Tensor(self.packed[index], self.block_scale[index], self.global_scale[index])


def dequantize(packed: torch.Tensor, block_scale: torch.Tensor, global_scale: torch.Tensor | float,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """packed uint8 [..., N, K/2], block_scale e4m3 [..., N, K/16], global_scale broadcastable to
    [..., N, 1] (or a scalar) -> [..., N, K] in `dtype`."""
    codes = unpack_fp4(packed).long()
    values = e2m1_table(packed.device)[codes]
    k = values.shape[-1]
    if block_scale.shape[-1] * GROUP_SIZE != k:
        raise ValueError(f"block_scale has {block_scale.shape[-1]} groups for K={k}; expected {k // GROUP_SIZE}")
    scale = block_scale.to(torch.float32).repeat_interleave(GROUP_SIZE, dim=-1)
    out = values * scale
    if isinstance(global_scale, torch.Tensor):
        out = out * global_scale.to(torch.float32)
    else:
        out = out * float(global_scale)
    return out.to(dtype)
