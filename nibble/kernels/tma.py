"""Tensor-memory-accelerator (TMA, sm_90+) descriptors of NVFP4 expert weights for the moe_w4 kernels.

With descriptors a K step's weight tile is one bulk copy issued by one thread into shared memory (Triton's
`desc.load`, pipelined like its asynchronous copies) instead of per-thread 16-byte copies with a 64-bit
address each: fewer instructions and registers per step in kernels that are bound by their instruction
latency at small batches. Rows past an expert's end read as zeros (the descriptor's bounds), so no clamping.

Host-side descriptors (`triton.tools.tensor_descriptor.TensorDescriptor`): passed by value at launch and
so captured in CUDA graphs, no device allocator needed. The interpreter runs them too (CPU tests).
"""

from __future__ import annotations

import torch

from nibble.kernels._triton import HAVE_TRITON, aligned16, capability, interpreting

MIN_INNER_BYTES = 16  # a TMA box's innermost extent must be a multiple of 16 bytes
MAX_BOX_DIM = 256  # and no extent of it over 256 elements


def tma_supported(device: torch.device) -> bool:
    """Whether the moe_w4 kernels may load weight tiles through descriptors on `device`: a Hopper or newer
    GPU, or the interpreter, and a Triton with host-side tensor descriptors."""
    if not HAVE_TRITON:
        return False
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
    except ImportError:
        return False
    if interpreting():
        return True
    cc = capability(device)
    return cc is not None and cc >= (9, 0)


def _aligned(t: torch.Tensor) -> bool:
    return t.stride(-1) == 1 and aligned16(t)


def w4_descriptors(units: torch.Tensor, scales: torch.Tensor, block_rows: int, block_k: int,
                   stacked: bool) -> tuple | None:
    """(units descriptor, scales descriptor or None) of one expert weight for `block_rows` x `block_k` tiles;
    None where TMA cannot address the units (unaligned base or strides, a box over 256 rows or 1024 K), the
    scales' None where it cannot address those (also when a tile's block_k / 16 scale bytes per row are under
    the 16-byte minimum): the kernels then load them by pointer.

    units: int16 [E, R, K/4] (`fp4_units`); scales: uint8 e4m3 [E, R, K/16]. stacked (gate_up, R = 2I): the
    descriptors are 4-D, [E, 2, I, K/4] and [E, 2, I, K/16], so one tile holds gate rows n0.. and up rows
    I + n0.. stacked ([1, 2, block_rows, ...] boxes); else 3-D with [1, block_rows, ...] boxes."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    if units.dim() != 3 or scales.dim() != 3 or units.dtype != torch.int16 or scales.dtype != torch.uint8:
        raise ValueError(f"w4_descriptors: expected int16 units and uint8 scales [E, R, K], got {units.dtype} "
                         f"{tuple(units.shape)} and {scales.dtype} {tuple(scales.shape)}")
    if (block_k % 64 or block_k // 4 > MAX_BOX_DIM or block_rows > MAX_BOX_DIM or not _aligned(units)
            or (stacked and units.shape[1] % 2)):
        return None

    def desc(t: torch.Tensor, inner: int) -> TensorDescriptor:
        e, r, k = t.shape
        if stacked:
            half = r // 2
            return TensorDescriptor(t, [e, 2, half, k], [t.stride(0), half * t.stride(1), t.stride(1), 1],
                                    [1, 2, block_rows, inner])
        return TensorDescriptor(t, [e, r, k], list(t.stride()), [1, block_rows, inner])

    s_ok = block_k // 16 >= MIN_INNER_BYTES and _aligned(scales)
    return desc(units, block_k // 4), desc(scales, block_k // 16) if s_ok else None
