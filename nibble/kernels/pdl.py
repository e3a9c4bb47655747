"""Programmatic dependent launch (sm_90+) and bulk L2 prefetch, for chains of dependent kernels.

A kernel launched with `launch_pdl=True` may start before the kernel ahead of it in the stream has finished:
as soon as every program of that one has called `gdc_launch_dependents` (or exited). It must call `gdc_wait`
before it touches anything the kernel ahead writes or reads; what it does before the wait overlaps that
kernel's tail: address arithmetic, reading inputs written before the last normally launched kernel started,
and prefetching weights, which no kernel writes, into L2. The MoE expert kernels use this to stream the
down projection's weights into L2 while gate_up still runs, and gate_up's while the activations are staged.
The wait cannot deadlock: dependents launch only once every program ahead of them has started.

On other GPUs, under the interpreter and with a Triton without the launch option the wrappers launch as
usual and the kernels are compiled without these instructions (constexpr flags).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from nibble.kernels._triton import HAVE_TRITON, aligned16, capability, interpreting, tl, triton


@functools.lru_cache(maxsize=1)
def _triton_has_pdl() -> bool:
    if not HAVE_TRITON:
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


def pdl_supported(device: torch.device) -> bool:
    """Whether kernels on `device` can be launched with programmatic dependent launch (sm_90+, Triton
    with the `launch_pdl` option, not the interpreter)."""
    cc = capability(device)
    return cc is not None and cc >= (9, 0) and not interpreting() and _triton_has_pdl()


def pdl_launch(on: bool, wait_flag: str = "PDL_WAIT") -> dict[str, Any]:
    """Launch keywords of a kernel launched with PDL whose constexpr `wait_flag` makes it wait (`gdc_wait`)
    for the kernel ahead; nothing if not `on`. Whatever the kernel reads before that wait must be older than
    the kernel ahead (see above)."""
    return {wait_flag: True, "launch_pdl": True} if on else {}


def prefetch_ok(*tensors: torch.Tensor) -> bool:
    """Whether `prefetch_l2` may be used on slabs of these tensors: 16-byte aligned bases and byte strides
    (the bulk prefetch needs 16-byte aligned addresses and sizes; callers check their row lengths)."""
    return aligned16(*tensors)


@triton.jit
def gdc_wait():
    """Block until the kernel ahead in the stream has completed and its writes are visible."""
    tl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def gdc_launch_dependents():
    """Let the next kernel (if launched with PDL) start once every program of this one has called this."""
    tl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=tl.int32, is_pure=False,
                              pack=1)


@triton.jit
def pdl_handoff(TRIGGER: tl.constexpr, WAIT: tl.constexpr):
    """A kernel's PDL point: let the next kernel start (TRIGGER: it is launched with PDL), then wait for the
    kernel ahead (WAIT: this one is). Neither flag: nothing."""
    if TRIGGER:
        gdc_launch_dependents()
    if WAIT:
        gdc_wait()


@triton.jit
def prefetch_l2(ptr, nbytes):
    """Thread 0 of the program asks for nbytes (a multiple of 16, > 0) at ptr (16-byte aligned) to be
    brought into L2: one bulk request, nothing waits for it."""
    tl.inline_asm_elementwise(
        "{\n.reg .pred p;\n.reg .b32 t;\nmov.u32 t, %tid.x;\nsetp.eq.u32 p, t, 0;\n"
        "@p cp.async.bulk.prefetch.L2.global [$1], $2;\nmov.b32 $0, 0;\n}",
        "=r,l,r", [ptr.to(tl.int64, bitcast=True), nbytes.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def prefetch_rows(ptr, first_row, num_rows, stride_row, row_len):
    """Prefetch rows first_row .. first_row + num_rows - 1 (num_rows > 0) of a row-major slab to L2; ptr:
    the slab's base pointer, stride_row / row_len in elements of ptr's type. The bytes run from the first
    row's start to the last row's end, rounded up to 16 (the row stride and row_len * element size are
    multiples of 16 by the caller's check)."""
    elt: tl.constexpr = ptr.dtype.element_ty.primitive_bitwidth // 8
    nbytes = ((num_rows - 1) * stride_row + row_len) * elt
    prefetch_l2(ptr + first_row.to(tl.int64) * stride_row, nbytes)
