"""Per-pair expert GEMVs (CUDA-core FMAs, no sorting): the small-batch decode path of `fused_moe`.

With a handful of tokens almost every (token, expert) pair hits a different expert, so sorting buys
nothing and costs launches. gate_up runs one program per (pair, BLOCK_N feature slice) and writes
silu(gate) * up; down either runs one program per (token, BLOCK_N hidden slice) that loops over the
token's k experts and sums their weighted outputs in registers, writing the final output directly (two
launches in all), or, with more parallelism for a single token, one program per (pair, slice) followed by
the fixed-order top-k sum. Both are deterministic.
"""

from __future__ import annotations

from nibble.kernels._triton import tl, triton
from nibble.kernels.fp4_tiles import dense_gemv_tile, fp4_gemv_tile


@triton.jit
def _row_dot(q_ptr, s_ptr, rows, nmask, x_ptr, n_k, stride_qn, stride_sn, W_FP4: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """fp32 [BLOCK_N]: W[rows, :] . x over the whole K (block scales applied, not the global one)."""
    if W_FP4:
        acc = tl.zeros([BLOCK_N, BLOCK_K // 16], tl.float32)
        for k0 in range(0, n_k, BLOCK_K):
            acc += fp4_gemv_tile(q_ptr, s_ptr, rows, nmask, x_ptr, k0, n_k, stride_qn, stride_sn, BLOCK_K // 16)
    else:
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        for k0 in range(0, n_k, BLOCK_K):
            acc += dense_gemv_tile(q_ptr, rows, nmask, x_ptr, k0, n_k, stride_qn, BLOCK_K)
    return tl.sum(acc, axis=1)


@triton.jit
def moe_gate_up_gemv_kernel(x_ptr, wq_ptr, ws_ptr, wg_ptr, act_ptr, ids_ptr, top_k, hidden, inter, stride_xt,
                            stride_qe, stride_qn, stride_se, stride_sn, stride_at, W_FP4: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """act[pair, n] = silu(x[tok] . w13[e, n]) * (x[tok] . w13[e, n + I]), e = ids[pair]."""
    pair = tl.program_id(0).to(tl.int64)
    e = tl.load(ids_ptr + pair).to(tl.int64)
    if e < 0:  # another expert-parallel rank's slot
        return
    n = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    nmask = n < inter
    x_row = x_ptr + (pair // top_k) * stride_xt
    q_base = wq_ptr + e * stride_qe
    s_base = ws_ptr + e * stride_se
    g = _row_dot(q_base, s_base, n, nmask, x_row, hidden, stride_qn, stride_sn, W_FP4, BLOCK_N, BLOCK_K)
    u = _row_dot(q_base, s_base, n + inter, nmask, x_row, hidden, stride_qn, stride_sn, W_FP4, BLOCK_N, BLOCK_K)
    if W_FP4:
        g *= tl.load(wg_ptr + e * 2 * inter + n, mask=nmask, other=0.0)
        u *= tl.load(wg_ptr + e * 2 * inter + inter + n, mask=nmask, other=0.0)
    act = g * tl.sigmoid(g) * u
    tl.store(act_ptr + pair * stride_at + n, act.to(act_ptr.dtype.element_ty), mask=nmask)


@triton.jit
def moe_down_gemv_kernel(act_ptr, wq_ptr, ws_ptr, wg_ptr, out_ptr, ids_ptr, topk_w_ptr, hidden, inter,
                         stride_at, stride_qe, stride_qn, stride_se, stride_sn, stride_ot, TOP_K: tl.constexpr,
                         W_FP4: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[t, n] = sum_j topk_w[t, j] * (act[t*k + j] . w2[ids[t, j], n]), j in order."""
    t = tl.program_id(0).to(tl.int64)
    n = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    nmask = n < hidden
    total = tl.zeros([BLOCK_N], tl.float32)
    for j in tl.static_range(TOP_K):
        pair = t * TOP_K + j
        e = tl.load(ids_ptr + pair).to(tl.int64)
        if e >= 0:
            y = _row_dot(wq_ptr + e * stride_qe, ws_ptr + e * stride_se, n, nmask, act_ptr + pair * stride_at,
                         inter, stride_qn, stride_sn, W_FP4, BLOCK_N, BLOCK_K)
            if W_FP4:
                y *= tl.load(wg_ptr + e * hidden + n, mask=nmask, other=0.0)
            total += y * tl.load(topk_w_ptr + pair)
    tl.store(out_ptr + t * stride_ot + n, total.to(out_ptr.dtype.element_ty), mask=nmask)


@triton.jit
def moe_down_pair_gemv_kernel(act_ptr, wq_ptr, ws_ptr, wg_ptr, y_ptr, ids_ptr, topk_w_ptr, hidden, inter,
                              stride_at, stride_qe, stride_qn, stride_se, stride_sn, stride_yt,
                              W_FP4: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """y[pair, n] = topk_w[pair] * (act[pair] . w2[ids[pair], n]): one program per (pair, slice), k times
    the parallelism of `moe_down_gemv_kernel` for a single token; `moe_reduce_kernel` sums the pairs."""
    pair = tl.program_id(0).to(tl.int64)
    n = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    nmask = n < hidden
    e = tl.load(ids_ptr + pair).to(tl.int64)
    if e < 0:
        return
    y = _row_dot(wq_ptr + e * stride_qe, ws_ptr + e * stride_se, n, nmask, act_ptr + pair * stride_at, inter,
                 stride_qn, stride_sn, W_FP4, BLOCK_N, BLOCK_K)
    if W_FP4:
        y *= tl.load(wg_ptr + e * hidden + n, mask=nmask, other=0.0)
    y *= tl.load(topk_w_ptr + pair)
    tl.store(y_ptr + pair * stride_yt + n, y, mask=nmask)
