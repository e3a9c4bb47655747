"""Grouped expert GEMMs over expert-sorted pairs (tensor cores via tl.dot): the prefill / larger-batch
path of `fused_moe`.

Each program owns one BLOCK_M block of `MoEAlignment.sorted_ids` (all rows of one expert) and one
BLOCK_N slice of the output features. gate_up loads the gate rows n and the up rows n + I of w13 as two
tiles and writes silu(gate) * up; down multiplies by the routing weight and writes one row per pair, which
`moe_reduce` sums over the top-k in a fixed order (deterministic, no atomics). Weights are NVFP4
(dequantised in registers, global scale on the fp32 accumulator) or 16/32-bit (W_FP4 = False).
"""

from __future__ import annotations

from nibble.kernels._triton import tl, triton
from nibble.kernels.fp4_tiles import dense_tile_kn, fp4_tile_kn, x_even_odd
from nibble.kernels.pdl import pdl_handoff


@triton.jit
def _block_rows(sorted_ptr, block_expert_ptr, start_ptr, count_ptr, BLOCK_M: tl.constexpr):
    pid_m = tl.program_id(0)
    e = tl.load(block_expert_ptr + pid_m)
    end = tl.load(start_ptr + tl.maximum(e, 0)) + tl.load(count_ptr + tl.maximum(e, 0))
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = (rows < end) & (e >= 0)
    pair = tl.load(sorted_ptr + rows, mask=rmask, other=0)
    return e, pair, rmask


@triton.jit
def _acc_tile(a_rows, rmask, wq_ptr, ws_ptr, n, nmask, n_k, stride_qn, stride_sn, acc, W_FP4: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PREC: tl.constexpr):
    """acc [BLOCK_M, BLOCK_N] += A[rows, :] @ W[n, :]^T over the whole K (= n_k)."""
    if W_FP4:
        for k0 in range(0, n_k, BLOCK_K):
            xe, xo = x_even_odd(a_rows, rmask, k0, n_k, BLOCK_K // 2)
            we, wo = fp4_tile_kn(wq_ptr, ws_ptr, n, nmask, k0, n_k, stride_qn, stride_sn, BLOCK_K // 16,
                                 BLOCK_N, xe.dtype)
            acc = tl.dot(xe, we, acc, input_precision=DOT_PREC)
            acc = tl.dot(xo, wo, acc, input_precision=DOT_PREC)
    else:
        kk = tl.arange(0, BLOCK_K)
        for k0 in range(0, n_k, BLOCK_K):
            a = tl.load(a_rows[:, None] + (k0 + kk)[None, :], mask=rmask[:, None] & (k0 + kk < n_k)[None, :],
                        other=0.0)
            w = dense_tile_kn(wq_ptr, n, nmask, k0, n_k, stride_qn, BLOCK_K, a.dtype)
            acc = tl.dot(a, w, acc, input_precision=DOT_PREC)
    return acc


@triton.jit
def moe_gate_up_kernel(x_ptr, wq_ptr, ws_ptr, wg_ptr, act_ptr, sorted_ptr, block_expert_ptr, start_ptr,
                       count_ptr, top_k, hidden, inter, stride_xt, stride_qe, stride_qn, stride_se, stride_sn,
                       stride_at, W_FP4: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, DOT_PREC: tl.constexpr):
    """act[pair, n] = silu(x[tok] . w13[e, n]) * (x[tok] . w13[e, n + I]) for the block's pairs."""
    e, pair, rmask = _block_rows(sorted_ptr, block_expert_ptr, start_ptr, count_ptr, BLOCK_M)
    if e < 0:
        return
    e64 = e.to(tl.int64)
    n = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    nmask = n < inter
    x_rows = x_ptr + (pair // top_k).to(tl.int64) * stride_xt
    q_base = wq_ptr + e64 * stride_qe
    s_base = ws_ptr + e64 * stride_se
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    # one pass over K: each activation tile feeds the gate and the up tile
    if W_FP4:
        for k0 in range(0, hidden, BLOCK_K):
            xe, xo = x_even_odd(x_rows, rmask, k0, hidden, BLOCK_K // 2)
            we, wo = fp4_tile_kn(q_base, s_base, n, nmask, k0, hidden, stride_qn, stride_sn, BLOCK_K // 16,
                                 BLOCK_N, xe.dtype)
            acc_g = tl.dot(xe, we, acc_g, input_precision=DOT_PREC)
            acc_g = tl.dot(xo, wo, acc_g, input_precision=DOT_PREC)
            we, wo = fp4_tile_kn(q_base, s_base, n + inter, nmask, k0, hidden, stride_qn, stride_sn,
                                 BLOCK_K // 16, BLOCK_N, xe.dtype)
            acc_u = tl.dot(xe, we, acc_u, input_precision=DOT_PREC)
            acc_u = tl.dot(xo, wo, acc_u, input_precision=DOT_PREC)
    else:
        kk = tl.arange(0, BLOCK_K)
        for k0 in range(0, hidden, BLOCK_K):
            a = tl.load(x_rows[:, None] + (k0 + kk)[None, :],
                        mask=rmask[:, None] & (k0 + kk < hidden)[None, :], other=0.0)
            w = dense_tile_kn(q_base, n, nmask, k0, hidden, stride_qn, BLOCK_K, a.dtype)
            acc_g = tl.dot(a, w, acc_g, input_precision=DOT_PREC)
            w = dense_tile_kn(q_base, n + inter, nmask, k0, hidden, stride_qn, BLOCK_K, a.dtype)
            acc_u = tl.dot(a, w, acc_u, input_precision=DOT_PREC)
    if W_FP4:
        acc_g *= tl.load(wg_ptr + e64 * 2 * inter + n, mask=nmask, other=0.0)[None, :]
        acc_u *= tl.load(wg_ptr + e64 * 2 * inter + inter + n, mask=nmask, other=0.0)[None, :]
    act = acc_g * tl.sigmoid(acc_g) * acc_u
    tl.store(act_ptr + pair.to(tl.int64)[:, None] * stride_at + n[None, :], act.to(act_ptr.dtype.element_ty),
             mask=rmask[:, None] & nmask[None, :])


@triton.jit
def moe_down_kernel(act_ptr, wq_ptr, ws_ptr, wg_ptr, y_ptr, topk_w_ptr, sorted_ptr, block_expert_ptr,
                    start_ptr, count_ptr, hidden, inter, stride_at, stride_qe, stride_qn, stride_se, stride_sn,
                    stride_yt, W_FP4: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, DOT_PREC: tl.constexpr):
    """y[pair, n] = topk_w[pair] * (act[pair] . w2[e, n])."""
    e, pair, rmask = _block_rows(sorted_ptr, block_expert_ptr, start_ptr, count_ptr, BLOCK_M)
    if e < 0:
        return
    e64 = e.to(tl.int64)
    n = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    nmask = n < hidden
    a_rows = act_ptr + pair.to(tl.int64) * stride_at
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc = _acc_tile(a_rows, rmask, wq_ptr + e64 * stride_qe, ws_ptr + e64 * stride_se, n, nmask, inter,
                    stride_qn, stride_sn, acc, W_FP4, BLOCK_N, BLOCK_K, DOT_PREC)
    if W_FP4:
        acc *= tl.load(wg_ptr + e64 * hidden + n, mask=nmask, other=0.0)[None, :]
    acc *= tl.load(topk_w_ptr + pair, mask=rmask, other=0.0)[:, None]
    tl.store(y_ptr + pair.to(tl.int64)[:, None] * stride_yt + n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=rmask[:, None] & nmask[None, :])


@triton.jit
def moe_reduce_kernel(y_ptr, out_ptr, ids_ptr, hidden, stride_yt, stride_ot, TOP_K: tl.constexpr,
                      BLOCK: tl.constexpr, PDL_WAIT: tl.constexpr = False, PDL_TRIGGER: tl.constexpr = False):
    """out[t] = sum_j y[t * TOP_K + j] in fp32, j in order, skipping pairs of expert id -1 (their rows of
    y are never written). PDL_WAIT: launched with PDL after the down kernel (pdl.py); PDL_TRIGGER: the
    kernel after this one may start early (it waits before reading anything of this layer's)."""
    pdl_handoff(PDL_TRIGGER, PDL_WAIT)
    t = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    nmask = n < hidden
    acc = tl.zeros([BLOCK], tl.float32)
    for j in tl.static_range(TOP_K):
        live = tl.load(ids_ptr + t * TOP_K + j) >= 0
        acc += tl.load(y_ptr + (t * TOP_K + j) * stride_yt + n, mask=nmask & live, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_ot + n, acc.to(out_ptr.dtype.element_ty), mask=nmask)
