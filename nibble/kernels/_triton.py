"""Triton import and helpers shared by the kernels.

Triton is optional: the torch references (and so the whole model on a CPU) must import without it, so a
missing triton leaves a stand-in whose `jit` keeps the kernel functions undecorated (they are never
launched then; the registry reports the triton backends unsupported).

Device helpers: FP4 (E2M1) and FP8 (E4M3) decoding with integer ops only, so that Ampere (no native FP8
conversions) and the CPU interpreter run the same code. Host helpers: launch-shape arithmetic and device
facts.
"""

from __future__ import annotations

import functools
import os
import re

import torch

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - exercised only on machines without triton
    HAVE_TRITON = False

    class _MissingTriton:
        @staticmethod
        def jit(fn=None, **_kwargs):
            return fn if fn is not None else (lambda f: f)

    triton = _MissingTriton()  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]


def interpreting() -> bool:
    """Whether Triton kernels run under the interpreter (numpy on the CPU)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def aligned16(*tensors: torch.Tensor) -> bool:
    """Whether every tensor has a 16-byte aligned base and 16-byte multiples as the byte strides of all but
    its last dimension (what the bulk copies and prefetches of sm_90+ need to address its rows)."""
    return all(t.data_ptr() % 16 == 0 and all((s * t.element_size()) % 16 == 0 for s in t.stride()[:-1])
               for t in tensors)


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """[..., D] -> [N, D] with contiguous columns for a row-strided kernel: a view where the strides allow
    (e.g. a column slice of a fused projection), else a copy."""
    t = t.reshape(-1, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


def device_key(device: torch.device | str) -> str:
    """Normalised device name for tuning tables: 'NVIDIA H200' -> 'nvidia_h200'; 'cpu' on the CPU."""
    device = torch.device(device)
    if device.type != "cuda":
        return device.type
    name = torch.cuda.get_device_name(device)
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


@functools.lru_cache(maxsize=16)
def _cuda_props(index: int) -> tuple[int, tuple[int, int]]:
    p = torch.cuda.get_device_properties(index)
    return int(p.multi_processor_count), (int(p.major), int(p.minor))


def sm_count(device: torch.device | str) -> int:
    """Streaming multiprocessors of a CUDA device (a nominal 8 elsewhere, to size grids in tests)."""
    device = torch.device(device)
    if device.type != "cuda":
        return 8
    return _cuda_props(device.index if device.index is not None else torch.cuda.current_device())[0]


def capability(device: torch.device | str) -> tuple[int, int] | None:
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return _cuda_props(device.index if device.index is not None else torch.cuda.current_device())[1]


def fp8_native(device: torch.device | str) -> bool:
    """Whether Triton converts float8_e4m3fn natively: sm_89+. Elsewhere the kernels use their integer
    decode/encode (the interpreter's own fp32->fp8 conversion drops the carry of a rounded-up mantissa)."""
    cc = capability(device)
    return cc is not None and cc >= (8, 9)


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot input precision: fp32 inputs in true fp32 (tests, fp32 models), 16-bit types as they are."""
    return "ieee" if dtype == torch.float32 else "tf32"


def tl_dtype(dtype: torch.dtype):
    return {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[dtype]


@triton.jit
def fp4_unpack(b):
    """Packed FP4 bytes (uint8 tensor) -> (low, high) nibble values as float16 holding e2m1 * 2^-14.

    Placing the 3 magnitude bits of a nibble at the top of the fp16 exponent/mantissa boundary makes the
    fp16 pattern equal e2m1 * 2^-14 for normal and subnormal codes alike (both formats keep a 0.m
    subnormal), so the decode is shifts and masks; callers fold 2^14 into the block scale.
    """
    w = b.to(tl.uint16)
    lo = (((w & 0x7) << 9) | ((w & 0x8) << 12)).to(tl.uint16)
    hi = (((w & 0x70) << 5) | ((w & 0x80) << 8)).to(tl.uint16)
    return lo.to(tl.float16, bitcast=True), hi.to(tl.float16, bitcast=True)


@triton.jit
def e4m3_to_f32(u):
    """float8_e4m3fn bytes (uint8 tensor) -> float32, exact. The fp16 pattern with the e4m3 bits under
    the sign equals value * 2^-8, subnormals included."""
    w = u.to(tl.uint16)
    h = (((w & 0x7F) << 7) | ((w & 0x80) << 8)).to(tl.uint16)
    return h.to(tl.float16, bitcast=True).to(tl.float32) * 256.0


@triton.jit
def f32_to_e4m3(x):
    """float32 -> float8_e4m3fn bytes (uint8), round to nearest even, saturating at +-448."""
    a = tl.minimum(tl.abs(x), 448.0)
    bits = a.to(tl.uint32, bitcast=True)
    r = bits + 0x7FFFF + ((bits >> 20) & 1)
    normal = ((r >> 20) - 960).to(tl.int32)
    # below 2^-6 the e4m3 grid is uniform (2^-9 steps): round a * 2^9 to an integer with the 2^23 trick
    sub = ((a * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
    code = tl.where(a < 0.015625, sub, normal)
    sign = ((x.to(tl.uint32, bitcast=True) >> 24) & 0x80).to(tl.int32)
    return (code | sign).to(tl.uint8)
