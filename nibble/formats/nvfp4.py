"""NVFP4 (ModelOpt layout): E2M1 codes packed two per byte, one e4m3 scale per 16 inputs, one fp32
global scale.

Checkpoint form of one linear [N, K]: `weight` uint8 [N, K/2] (low nibble = even element),
`weight_scale` float8_e4m3fn [N, K/16], `weight_scale_2` fp32 scalar.
Compute form (`NVFP4Tensor`): the same two tensors plus the global scale expanded to one fp32 value per
output row, so that fused or stacked weights (gate|up, per-expert stacks) with different checkpoint
global scales share one representation.
`quantize` reproduces NVIDIA ModelOpt's NVFP4 quantization bit for bit (without importing it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

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


# Rounding thresholds on |x| between neighbouring E2M1 magnitudes. A tie goes to the even code (the value
# with an even mantissa): 0.25 -> 0, 0.75 -> 1.0, 1.25 -> 1.0, 1.75 -> 2.0, 2.5 -> 2.0, 3.5 -> 4.0, 5 -> 4.0.
_TIES_ROUND_DOWN = (0.25, 1.25, 2.5, 5.0)
_TIES_ROUND_UP = (0.75, 1.75, 3.5)
# Smallest positive e4m3 (a subnormal): block scales are clamped up to it so none rounds to zero.
E4M3_MIN_SUBNORMAL = 2.0**-9
_QUANTIZABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Round x (any shape, already divided by its scales) to the nearest E2M1 value, ties to even,
    saturating at 6; returns uint8 codes of the same shape. Negative inputs keep the sign bit even when
    they round to zero (code 8), as ModelOpt does.

    The comparisons are written as `not (|x| <= t)` so that a NaN lands on the largest magnitude, which is
    what ModelOpt's searchsorted-based cast gives; NaN only arises from degenerate scales.
    """
    mag = x.abs()
    code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for t in _TIES_ROUND_DOWN:
        code += ~(mag <= t)
    for t in _TIES_ROUND_UP:
        code += ~(mag < t)
    return code | ((x < 0).to(torch.uint8) << 3)


def compute_weight_scale_2(*weights: torch.Tensor) -> torch.Tensor:
    """The fp32 0-dim global scale for one or several weights that share it: max |w| over all of them
    divided by 6 * 448, so that the largest block scale lands on the top of the e4m3 range.

    ModelOpt gives linears that read the same input (gate and up of one expert, q/k/v, ...) the largest of
    their amaxes, because inference engines fuse them into one GEMM with a single global scale.
    """
    if not weights:
        raise ValueError("compute_weight_scale_2 needs at least one tensor")
    amaxes = []
    for w in weights:
        lo, hi = torch.aminmax(w)
        amaxes.append(torch.maximum(lo.abs(), hi.abs()).float())
    amax = amaxes[0] if len(amaxes) == 1 else torch.stack(amaxes).max()
    return amax / (E2M1_MAX * E4M3_MAX)


def quantize(w: torch.Tensor, weight_scale_2: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize w [..., N, K] (fp32, bf16 or fp16) to NVFP4 with one global scale for the whole tensor.

    Returns (packed uint8 [..., N, Kp/2], block_scale float8_e4m3fn [..., N, Kp/16], weight_scale_2 fp32
    0-dim), where Kp is K rounded up to a multiple of 16: like ModelOpt, a K that is not a multiple of 16 is
    padded with zeros. The result is bit-identical to ModelOpt's `NVFP4QTensor.quantize(w, 16)` (or, with
    `weight_scale_2` given, to `NVFP4QTensor.quantize(w, 16, weights_scaling_factor_2=weight_scale_2)`):
    the block amax is taken in w's dtype, scale arithmetic is fp32 in the same order, block scales are
    clamped to [2^-9, 448] before the e4m3 cast, all-zero blocks get scale 1.0, and codes round to nearest
    with ties to even.

    One deliberate difference: for a tensor whose weight_scale_2 is 0 (all zeros) ModelOpt divides 0 by 0
    and writes NaN block scales and code 6.0 everywhere; here the codes are 0, the block scales 1.0 and
    weight_scale_2 0, which dequantizes to the zeros that went in.
    """
    if w.dtype not in _QUANTIZABLE_DTYPES:
        raise TypeError(f"NVFP4 quantize expects a float32, bfloat16 or float16 tensor, got {w.dtype}")
    if w.ndim < 2:
        raise ValueError(f"NVFP4 quantize expects a weight of shape [..., N, K], got shape {tuple(w.shape)}")
    if not bool(torch.isfinite(w).all()):
        raise ValueError(f"cannot quantize a tensor of shape {tuple(w.shape)} that contains inf or NaN")
    pad = -w.shape[-1] % GROUP_SIZE
    if pad:
        w = F.pad(w, (0, pad))
    if weight_scale_2 is None:
        weight_scale_2 = compute_weight_scale_2(w)
    elif weight_scale_2.dtype != torch.float32 or weight_scale_2.numel() != 1:
        raise ValueError(f"weight_scale_2 must be one float32 value, got {weight_scale_2.dtype} "
                         f"of shape {tuple(weight_scale_2.shape)}")
    weight_scale_2 = weight_scale_2.reshape(()).to(w.device)
    blocks = w.unflatten(-1, (-1, GROUP_SIZE))
    if float(weight_scale_2) == 0.0:
        if bool(w.any()):
            raise ValueError("weight_scale_2 is 0 but the tensor has non-zero values")
        packed = torch.zeros((*w.shape[:-1], w.shape[-1] // 2), dtype=torch.uint8, device=w.device)
        ones = torch.ones(blocks.shape[:-1], dtype=torch.float32, device=w.device)
        return packed, ones.to(torch.float8_e4m3fn), weight_scale_2
    block_amax = blocks.abs().amax(dim=-1).float()
    block_scale = block_amax / (E2M1_MAX * weight_scale_2)
    block_scale = torch.where(block_scale == 0, torch.ones_like(block_scale), block_scale)
    block_scale = block_scale.clamp(min=E4M3_MIN_SUBNORMAL, max=E4M3_MAX).to(torch.float8_e4m3fn)
    scaled = blocks / (block_scale.to(torch.float32) * weight_scale_2).unsqueeze(-1)
    return pack_fp4(e2m1_codes(scaled.flatten(-2))), block_scale, weight_scale_2


def quantize_to_compute_form(w: torch.Tensor) -> NVFP4Tensor:
    """Quantize w [..., N, K] (K a multiple of 16) to an `NVFP4Tensor`. Every [N, K] matrix gets its own
    global scale, as each expert of a stacked [E, N, K] tensor has in a ModelOpt checkpoint."""
    if w.ndim < 2 or w.shape[-1] % GROUP_SIZE:
        raise ValueError(f"expected a weight [..., N, K] with K a multiple of {GROUP_SIZE}, "
                         f"got shape {tuple(w.shape)}")
    mats = w.reshape(-1, *w.shape[-2:])
    parts = [quantize(m) for m in mats]
    lead = w.shape[:-2]
    n = w.shape[-2]
    packed = torch.stack([p for p, _, _ in parts]).reshape(*lead, n, -1)
    block_scale = torch.stack([s for _, s, _ in parts]).reshape(*lead, n, -1)
    global_scale = torch.stack([g.expand(n) for _, _, g in parts]).reshape(*lead, n)
    return NVFP4Tensor(packed, block_scale, global_scale.contiguous())


def from_checkpoint(weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor,
                    name: str = "weight") -> NVFP4Tensor:
    """Build the compute form from ModelOpt checkpoint tensors of one linear (or a stack of them).

    weight: uint8 [..., N, K/2]; weight_scale: float8_e4m3fn [..., N, K/16]; weight_scale_2: float32, one
    value (0-dim or [1]) or one per leading index ([...] or [..., 1]). `name` (the module name) prefixes
    every error message. Returns global_scale fp32 [..., N].
    """
    if weight.dtype != torch.uint8:
        raise ValueError(f"{name}.weight: expected dtype uint8 (packed FP4), found {weight.dtype}")
    if weight.ndim < 2:
        raise ValueError(f"{name}.weight: expected shape [..., N, K/2], found {tuple(weight.shape)}")
    if weight_scale.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{name}.weight_scale: expected dtype float8_e4m3fn, found {weight_scale.dtype}")
    k = weight.shape[-1] * 2
    expected = (*weight.shape[:-1], k // GROUP_SIZE)
    if k % GROUP_SIZE or tuple(weight_scale.shape) != expected:
        raise ValueError(f"{name}.weight_scale: expected shape {expected} (one scale per {GROUP_SIZE} of "
                         f"K={k}), found {tuple(weight_scale.shape)}")
    if weight_scale_2.dtype != torch.float32:
        raise ValueError(f"{name}.weight_scale_2: expected dtype float32, found {weight_scale_2.dtype}")
    lead = tuple(weight.shape[:-2])
    n = weight.shape[-2]
    shape_2 = tuple(weight_scale_2.shape)
    if weight_scale_2.numel() == 1:
        per_matrix = weight_scale_2.reshape((1,) * len(lead)).expand(lead)
    elif lead and shape_2 in (lead, (*lead, 1)):
        per_matrix = weight_scale_2.reshape(lead)
    else:
        raise ValueError(f"{name}.weight_scale_2: expected one value or shape {lead} (one per leading "
                         f"index), found {shape_2}")
    if not bool(torch.isfinite(per_matrix).all()) or bool((per_matrix < 0).any()):
        raise ValueError(f"{name}.weight_scale_2: expected finite non-negative values, found "
                         f"{per_matrix.flatten()[:8].tolist()}")
    global_scale = per_matrix.unsqueeze(-1).expand((*lead, n)).contiguous()
    return NVFP4Tensor(weight, weight_scale, global_scale)


def stack(tensors: Sequence[NVFP4Tensor]) -> NVFP4Tensor:
    """Stack NVFP4 weights of equal shape [N, K] along a new leading (expert) dim -> [E, N, K]."""
    if not tensors:
        raise ValueError("stack needs at least one NVFP4Tensor")
    shapes = {t.shape for t in tensors}
    if len(shapes) != 1:
        raise ValueError(f"cannot stack NVFP4 weights of different shapes {sorted(shapes)}")
    return NVFP4Tensor(torch.stack([t.packed for t in tensors]), torch.stack([t.block_scale for t in tensors]),
                       torch.stack([t.global_scale for t in tensors]))


def cat_rows(tensors: Sequence[NVFP4Tensor]) -> NVFP4Tensor:
    """Concatenate NVFP4 weights [..., N_i, K] along the output rows -> [..., sum N_i, K] (e.g. gate|up);
    each row keeps its own global scale."""
    if not tensors:
        raise ValueError("cat_rows needs at least one NVFP4Tensor")
    ks = {(t.shape[:-2], t.shape[-1]) for t in tensors}
    if len(ks) != 1:
        raise ValueError(f"cannot concatenate NVFP4 weights with different leading dims or K: "
                         f"{[t.shape for t in tensors]}")
    return NVFP4Tensor(torch.cat([t.packed for t in tensors], dim=-2),
                       torch.cat([t.block_scale for t in tensors], dim=-2),
                       torch.cat([t.global_scale for t in tensors], dim=-1))
