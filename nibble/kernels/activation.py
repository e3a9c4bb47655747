"""Gated elementwise ops, each one launch instead of the 2-4 of its torch expression: SiLU-and-multiply of
the shared expert, the sigmoid output gate of attention, and the MoE block's combination of routed and gated
shared expert. Inputs may be strided views of fused projections (rows at any stride, columns contiguous);
math in fp32, one rounding to the output dtype."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nibble.kernels._triton import as_rows, next_pow2, tl, triton
from nibble.kernels.pdl import pdl_handoff, pdl_supported


def silu_and_mul_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up: [T, I] (e.g. the two halves of a fused gate_up projection) -> silu(gate) * up [T, I] in
    gate's dtype."""
    return (F.silu(gate.float()) * up.float()).to(gate.dtype)


def sigmoid_mul_ref(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x, gate: [..., D] of one shape -> x * sigmoid(gate) [..., D] in x's dtype."""
    return (x.float() * torch.sigmoid(gate.float())).to(x.dtype)


def moe_combine_ref(routed: torch.Tensor, shared: torch.Tensor, gate_logit: torch.Tensor) -> torch.Tensor:
    """routed, shared: [T, H]; gate_logit: [T, 1] (the shared expert gate's logit per token) ->
    routed + sigmoid(gate_logit) * shared [T, H] in routed's dtype."""
    return (routed.float() + torch.sigmoid(gate_logit.float()) * shared.float()).to(routed.dtype)


@triton.jit(do_not_specialize=["n_rows"])
def _gated_mul_kernel(x_ptr, g_ptr, out_ptr, n_rows, n_cols, stride_x, stride_g, stride_o, SILU: tl.constexpr,
                      ROWS: tl.constexpr, BLOCK: tl.constexpr, PDL_TRIGGER: tl.constexpr = False):
    # PDL_TRIGGER: the projection after the gate (o_proj, the shared expert's down) may start (dense_gemv.py)
    pdl_handoff(PDL_TRIGGER, False)
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + rows[:, None] * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    gate = g * tl.sigmoid(g) if SILU else tl.sigmoid(g)
    tl.store(out_ptr + rows[:, None] * stride_o + cols[None, :], (x * gate).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["n_rows"])
def _moe_combine_kernel(r_ptr, s_ptr, gl_ptr, out_ptr, n_rows, n_cols, stride_r, stride_s, stride_gl, stride_o,
                        ROWS: tl.constexpr, BLOCK: tl.constexpr):
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    rmask = rows < n_rows
    mask = rmask[:, None] & (cols[None, :] < n_cols)
    r = tl.load(r_ptr + rows[:, None] * stride_r + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    s = tl.load(s_ptr + rows[:, None] * stride_s + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    gl = tl.load(gl_ptr + rows * stride_gl, mask=rmask, other=0.0).to(tl.float32)
    out = r + tl.sigmoid(gl)[:, None] * s
    tl.store(out_ptr + rows[:, None] * stride_o + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


def _grid(n_rows: int, n_cols: int) -> tuple[tuple[int, int], int, int]:
    """(grid, ROWS, BLOCK): column blocks of up to 1024 so that a single decode row still spreads over a few
    programs, and about 2048 elements per program."""
    block = min(next_pow2(n_cols), 1024)
    rows = max(1, min(64, 2048 // block))
    return (triton.cdiv(n_rows, rows), triton.cdiv(n_cols, block)), rows, block


def _gated_mul(name: str, x: torch.Tensor, g: torch.Tensor, silu: bool) -> torch.Tensor:
    if g.shape != x.shape or x.dim() < 1:
        raise ValueError(f"{name}: shapes {tuple(x.shape)} and {tuple(g.shape)} differ")
    if not (x.is_floating_point() and g.is_floating_point()):
        raise ValueError(f"{name}: floating-point inputs expected, got {x.dtype} / {g.dtype}")
    if x.device != g.device:
        raise ValueError(f"{name}: tensors on different devices")
    x2, g2 = as_rows(x), as_rows(g)
    n, d = x2.shape
    out = torch.empty((n, d), dtype=x.dtype, device=x.device)
    if n and d:
        grid, rows, block = _grid(n, d)
        _gated_mul_kernel[grid](x2, g2, out, n, d, x2.stride(0), g2.stride(0), out.stride(0), SILU=silu,
                                ROWS=rows, BLOCK=block, PDL_TRIGGER=pdl_supported(x.device), num_warps=4)
    return out.view(x.shape)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Triton `silu_and_mul_ref`: one launch; gate and up may be strided column slices of one projection."""
    if gate.dim() != 2:
        raise ValueError(f"silu_and_mul: gate must be [T, I], got {tuple(gate.shape)}")
    if gate.dtype != up.dtype:
        raise ValueError(f"silu_and_mul: gate {gate.dtype} and up {up.dtype} differ")
    return _gated_mul("silu_and_mul", up, gate, silu=True)


def sigmoid_mul(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Triton `sigmoid_mul_ref`: one launch; returns a fresh contiguous tensor of x's shape."""
    return _gated_mul("sigmoid_mul", x, gate, silu=False)


def moe_combine(routed: torch.Tensor, shared: torch.Tensor, gate_logit: torch.Tensor) -> torch.Tensor:
    """Triton `moe_combine_ref`: one launch; gate_logit may be a strided column of a fused projection."""
    if routed.dim() != 2 or shared.shape != routed.shape:
        raise ValueError(f"moe_combine: routed {tuple(routed.shape)} / shared {tuple(shared.shape)} must be [T, H]")
    if gate_logit.shape != (routed.shape[0], 1):
        raise ValueError(f"moe_combine: gate_logit {tuple(gate_logit.shape)} != [{routed.shape[0]}, 1]")
    if routed.dtype != shared.dtype or not (routed.is_floating_point() and gate_logit.is_floating_point()):
        raise ValueError(f"moe_combine: routed {routed.dtype}, shared {shared.dtype}, gate_logit {gate_logit.dtype}")
    if len({routed.device, shared.device, gate_logit.device}) != 1:
        raise ValueError("moe_combine: tensors on different devices")
    r = routed if routed.stride(1) == 1 else routed.contiguous()
    s = shared if shared.stride(1) == 1 else shared.contiguous()
    t, h = r.shape
    out = torch.empty((t, h), dtype=routed.dtype, device=routed.device)
    if t and h:
        grid, rows, block = _grid(t, h)
        _moe_combine_kernel[grid](r, s, gate_logit, out, t, h, r.stride(0), s.stride(0), gate_logit.stride(0),
                                  out.stride(0), ROWS=rows, BLOCK=block, num_warps=4)
    return out
