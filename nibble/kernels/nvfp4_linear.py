"""Dense linear with an NVFP4 weight and 16-bit activations (W4A16)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nibble.formats.nvfp4 import NVFP4Tensor, dequantize


def nvfp4_linear_ref(x: torch.Tensor, w: NVFP4Tensor) -> torch.Tensor:
    """x: [T, K]; w: NVFP4 [N, K] -> [T, N] in x's dtype.

    e2m1 x e4m3 products are exact in bf16, so dequantising them to x's dtype loses nothing; the per-row
    global scale is applied to the fp32 output.
    """
    w_blk = dequantize(w.packed, w.block_scale, 1.0, x.dtype)
    y = F.linear(x, w_blk).float() * w.global_scale
    return y.to(x.dtype)
