"""NVFP4 (W4A16) expert kernels of `fused_moe`: weight-stationary tensor-core tiles ("swap AB").

Every program owns BLOCK_N weight rows of one expert and up to BLOCK_T (token, expert) pairs of that
expert, and computes acc[BLOCK_N, BLOCK_T] = W[rows, :] @ A[pairs, :]^T: the weights are the wide M side
of the MMA, dequantised in registers straight into its A operand (`fp4_decode4`, ~2.5 ops per weight),
and the few tokens are the narrow N side (padded to 16). So a weight tile is read from memory and
dequantised once for all the expert's tokens of the block, tensor cores do the multiply at any batch
size (even 1 token: the MMA has throughput to spare and the CUDA cores stay free for the decode), and the
K loop is a dot loop that Triton software-pipelines with asynchronous copies (several weight tiles in
flight per program, which is what decode bandwidth needs).

Rows of a program ("blocks"):
- pairs mode (SORTED = False, small decode batches): block p is pair p alone (no sorting launch);
- sorted mode: blocks of `moe_align` (BLOCK_T pairs of one expert; -1 blocks past the end exit).
Expert id -1 (a slot routed to another expert-parallel rank) is skipped: no program loads its weights.

Kernels: `moe_w4_gate_up_kernel` (act = silu(x W_gate^T) * (x W_up^T)), `moe_w4_down_kernel` (y[pair] =
topk_w * act W_down^T, summed over the top-k by `moe_gemm.moe_reduce_kernel`), and
`moe_w4_down_token_kernel` (one program per (token, hidden slice) looping over the token's k experts in one
flattened, pipelined loop and writing the final sum: no reduce launch, for small batches).
"""

from __future__ import annotations

from nibble.kernels._triton import tl, triton
from nibble.kernels.fp4_tiles import FP4_SCALE_SHIFT, fp4_decode4, x_split4

_GSCALE = tl.constexpr(float(2 ** FP4_SCALE_SHIFT)) if tl is not None else None


@triton.jit
def _rows(ids_ptr, sorted_ptr, block_expert_ptr, start_ptr, count_ptr, SORTED: tl.constexpr,
          BLOCK_T: tl.constexpr):
    """(expert, pair ids [BLOCK_T], valid [BLOCK_T]) of this program's block; expert < 0: nothing to do."""
    pid = tl.program_id(0)
    tt = tl.arange(0, BLOCK_T)
    if SORTED:
        e = tl.load(block_expert_ptr + pid)
        ec = tl.maximum(e, 0)
        end = tl.load(start_ptr + ec) + tl.load(count_ptr + ec)
        rows = pid * BLOCK_T + tt
        valid = (rows < end) & (e >= 0)
        pair = tl.load(sorted_ptr + rows, mask=valid, other=0)
    else:
        e = tl.load(ids_ptr + pid)
        valid = tt == 0
        pair = pid + tt * 0
    return e, pair, valid


@triton.jit
def _tr(a):
    """Swap the last two dims (2-D or batched 3-D)."""
    if len(a.shape) == 3:
        return tl.permute(a, 0, 2, 1)
    else:
        return tl.trans(a)


@triton.jit
def _dot(w, a, acc, DEC: tl.constexpr):
    if DEC == 0:
        # fp32 activations (tests, fp32 models): exact fp32 products
        return tl.dot(w, _tr(a), acc, input_precision="ieee")
    else:
        return tl.dot(w, _tr(a), acc)


@triton.jit
def _mma4(w0, w1, w2, w3, a, acc, DEC: tl.constexpr):
    """acc[.., N, T] += W @ a^T for a decoded weight tile (4 stride-4 K slices) and an activation tile
    a [.., T, K]."""
    if DEC == 0:
        a = a.to(tl.float32)
    a0, a1, a2, a3 = x_split4(a)
    acc = _dot(w0, a0, acc, DEC)
    acc = _dot(w1, a1, acc, DEC)
    acc = _dot(w2, a2, acc, DEC)
    acc = _dot(w3, a3, acc, DEC)
    return acc


@triton.jit
def _mma4x4(w0, w1, w2, w3, a, acc0, acc1, acc2, acc3, DEC: tl.constexpr):
    """`_mma4` into four accumulators: four independent MMA chains instead of one, so that the short
    per-warp tiles of the split kernels are not bound by the MMA latency."""
    if DEC == 0:
        a = a.to(tl.float32)
    a0, a1, a2, a3 = x_split4(a)
    return _dot(w0, a0, acc0, DEC), _dot(w1, a1, acc1, DEC), _dot(w2, a2, acc2, DEC), _dot(w3, a3, acc3, DEC)


@triton.jit
def moe_w4_gate_up_kernel(x_ptr, q_ptr, s_ptr, g_ptr, act_ptr, ids_ptr, sorted_ptr, block_expert_ptr, start_ptr,
                          count_ptr, top_k, hidden, inter, stride_xt, stride_qe, stride_qn, stride_se, stride_sn,
                          stride_at, SORTED: tl.constexpr, DEC: tl.constexpr, EVEN_K: tl.constexpr,
                          BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """act[pair, n] = silu(x[tok] . w13[e, n]) * (x[tok] . w13[e, I + n]) for the block's pairs and BLOCK_N
    features. q_ptr: w13 packed as int16 units [E, 2I, H/4] (strides in units); s_ptr: e4m3 scales as uint8
    [E, 2I, H/16]; g_ptr: fp32 global scales [E, 2I]; act: [pairs, I]."""
    e, pair, valid = _rows(ids_ptr, sorted_ptr, block_expert_ptr, start_ptr, count_ptr, SORTED, BLOCK_T)
    if e < 0:
        return
    e64 = e.to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nc = tl.minimum(n, inter - 1).to(tl.int64)  # clamped rows load real memory; their results are not stored
    u = tl.arange(0, BLOCK_K // 4)
    gi = tl.arange(0, BLOCK_K // 16)
    kk = tl.arange(0, BLOCK_K)
    qg = q_ptr + e64 * stride_qe + nc[:, None] * stride_qn + u[None, :]
    qu = qg + inter * stride_qn
    sg = s_ptr + e64 * stride_se + nc[:, None] * stride_sn + gi[None, :]
    su = sg + inter * stride_sn
    xr = x_ptr + (pair // top_k).to(tl.int64)[:, None] * stride_xt + kk[None, :]
    acc_g = tl.zeros([BLOCK_N, BLOCK_T], tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_T], tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        if EVEN_K:
            a = tl.load(xr + k0, mask=valid[:, None], other=0.0)
            wq_g, ws_g = tl.load(qg + k0 // 4), tl.load(sg + k0 // 16)
            wq_u, ws_u = tl.load(qu + k0 // 4), tl.load(su + k0 // 16)
        else:
            km = (k0 + kk < hidden)[None, :]
            qm = (k0 // 4 + u < hidden // 4)[None, :]
            sm = (k0 // 16 + gi < hidden // 16)[None, :]
            a = tl.load(xr + k0, mask=valid[:, None] & km, other=0.0)
            wq_g, ws_g = tl.load(qg + k0 // 4, mask=qm, other=0), tl.load(sg + k0 // 16, mask=sm, other=0)
            wq_u, ws_u = tl.load(qu + k0 // 4, mask=qm, other=0), tl.load(su + k0 // 16, mask=sm, other=0)
        w0, w1, w2, w3 = fp4_decode4(wq_g, ws_g, DEC)
        acc_g = _mma4(w0, w1, w2, w3, a, acc_g, DEC)
        w0, w1, w2, w3 = fp4_decode4(wq_u, ws_u, DEC)
        acc_u = _mma4(w0, w1, w2, w3, a, acc_u, DEC)
    g_row = g_ptr + e64 * 2 * inter + nc
    hg = acc_g * (tl.load(g_row) * _GSCALE)[:, None]
    hu = acc_u * (tl.load(g_row + inter) * _GSCALE)[:, None]
    act = hg * tl.sigmoid(hg) * hu
    tl.store(act_ptr + pair.to(tl.int64)[None, :] * stride_at + n[:, None], act.to(act_ptr.dtype.element_ty),
             mask=(n < inter)[:, None] & valid[None, :])


@triton.jit
def moe_w4_down_kernel(act_ptr, q_ptr, s_ptr, g_ptr, y_ptr, topk_w_ptr, ids_ptr, sorted_ptr, block_expert_ptr,
                       start_ptr, count_ptr, hidden, inter, stride_at, stride_qe, stride_qn, stride_se, stride_sn,
                       stride_yt, SORTED: tl.constexpr, DEC: tl.constexpr, EVEN_K: tl.constexpr,
                       BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """y[pair, n] = topk_w[pair] * (act[pair] . w2[e, n]) for the block's pairs and BLOCK_N hidden features
    (w2 packed [E, H, I/4] units, scales [E, H, I/16], global [E, H]); y: [pairs, H]."""
    e, pair, valid = _rows(ids_ptr, sorted_ptr, block_expert_ptr, start_ptr, count_ptr, SORTED, BLOCK_T)
    if e < 0:
        return
    e64 = e.to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nc = tl.minimum(n, hidden - 1).to(tl.int64)
    u = tl.arange(0, BLOCK_K // 4)
    gi = tl.arange(0, BLOCK_K // 16)
    kk = tl.arange(0, BLOCK_K)
    qp = q_ptr + e64 * stride_qe + nc[:, None] * stride_qn + u[None, :]
    sp = s_ptr + e64 * stride_se + nc[:, None] * stride_sn + gi[None, :]
    ar = act_ptr + pair.to(tl.int64)[:, None] * stride_at + kk[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_T], tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        if EVEN_K:
            a = tl.load(ar + k0, mask=valid[:, None], other=0.0)
            wq, ws = tl.load(qp + k0 // 4), tl.load(sp + k0 // 16)
        else:
            a = tl.load(ar + k0, mask=valid[:, None] & (k0 + kk < inter)[None, :], other=0.0)
            wq = tl.load(qp + k0 // 4, mask=(k0 // 4 + u < inter // 4)[None, :], other=0)
            ws = tl.load(sp + k0 // 16, mask=(k0 // 16 + gi < inter // 16)[None, :], other=0)
        w0, w1, w2, w3 = fp4_decode4(wq, ws, DEC)
        acc = _mma4(w0, w1, w2, w3, a, acc, DEC)
    acc *= (tl.load(g_ptr + e64 * hidden + nc) * _GSCALE)[:, None]
    acc *= tl.load(topk_w_ptr + pair, mask=valid, other=0.0)[None, :]
    tl.store(y_ptr + pair.to(tl.int64)[None, :] * stride_yt + n[:, None], acc.to(y_ptr.dtype.element_ty),
             mask=(n < hidden)[:, None] & valid[None, :])


@triton.jit
def moe_w4_down_token_kernel(act_ptr, q_ptr, s_ptr, g_ptr, out_ptr, ids_ptr, topk_w_ptr, hidden, inter, stride_at,
                             stride_qe, stride_qn, stride_se, stride_sn, stride_ot, TOP_K: tl.constexpr,
                             DEC: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_T: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[t, n] = sum_j topk_w[t, j] * (act[t*k + j] . w2[ids[t, j], n]), j in order (deterministic), for
    BLOCK_N hidden features. One loop over (j, K slice) so the copies stay pipelined across experts; the
    pair's activation row is column 0 of the MMA's token side (the other columns are zero)."""
    t = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nc = tl.minimum(n, hidden - 1).to(tl.int64)
    u = tl.arange(0, BLOCK_K // 4)
    gi = tl.arange(0, BLOCK_K // 16)
    kk = tl.arange(0, BLOCK_K)
    row0 = (tl.arange(0, BLOCK_T) == 0)[:, None]
    n_iter = tl.cdiv(inter, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_T], tl.float32)
    total = tl.zeros([BLOCK_N, BLOCK_T], tl.float32)
    for it in range(0, TOP_K * n_iter):
        j = it // n_iter
        k0 = (it - j * n_iter) * BLOCK_K
        pair = t * TOP_K + j
        e = tl.load(ids_ptr + pair)
        live = e >= 0
        e64 = tl.maximum(e, 0).to(tl.int64)
        qp = q_ptr + e64 * stride_qe + nc[:, None] * stride_qn + (k0 // 4 + u)[None, :]
        sp = s_ptr + e64 * stride_se + nc[:, None] * stride_sn + (k0 // 16 + gi)[None, :]
        ap = act_ptr + pair * stride_at + k0 + kk[None, :] + row0 * 0
        if EVEN_K:
            a = tl.load(ap, mask=row0 & live, other=0.0)
            wq = tl.load(qp, mask=live, other=0)
            ws = tl.load(sp, mask=live, other=0)
        else:
            a = tl.load(ap, mask=row0 & live & (k0 + kk < inter)[None, :], other=0.0)
            wq = tl.load(qp, mask=live & (k0 // 4 + u < inter // 4)[None, :], other=0)
            ws = tl.load(sp, mask=live & (k0 // 16 + gi < inter // 16)[None, :], other=0)
        w0, w1, w2, w3 = fp4_decode4(wq, ws, DEC)
        acc = _mma4(w0, w1, w2, w3, a, acc, DEC)
        # end of this expert's K: fold its global scale and routing weight in, restart the accumulator
        last = k0 + BLOCK_K >= inter
        coef = tl.load(g_ptr + e64 * hidden + nc) * (tl.load(topk_w_ptr + pair) * _GSCALE)
        coef = tl.where(live & last, coef, 0.0)
        total += acc * coef[:, None]
        acc = tl.where(last, 0.0, acc)
    out = tl.sum(total, axis=1)
    tl.store(out_ptr + t * stride_ot + n, out.to(out_ptr.dtype.element_ty), mask=n < hidden)


# --- split kernels: tiny batches ------------------------------------------------------------------------
# With one token per block, a program's weight rows are its only parallelism (16 rows per warp, the MMA's
# M), too few warps for the GPU at batch 1. These kernels also split K across the warps of a program: the
# tiles are 3-D [SPLIT, rows, K / SPLIT] and the MMA is batched over SPLIT (one batch per warp group), and
# the SPLIT partial sums are added once at the end (a cross-warp reduction in shared memory).


@triton.jit
def moe_w4_gate_up_split_kernel(x_ptr, q_ptr, s_ptr, g_ptr, act_ptr, ids_ptr, top_k, hidden, inter, stride_xt,
                                stride_qe, stride_qn, stride_se, stride_sn, stride_at, DEC: tl.constexpr,
                                EVEN_K: tl.constexpr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr,
                                BLOCK_K: tl.constexpr):
    """Pairs mode gate_up: program (pair, slice) computes act[pair, n] for BLOCK_N features; the gate and
    the up rows of the slice form one [2 * BLOCK_N] row tile; each K step covers SPLIT * BLOCK_K."""
    BT: tl.constexpr = 16
    pair = tl.program_id(0)
    e = tl.load(ids_ptr + pair)
    if e < 0:
        return
    e64 = e.to(tl.int64)
    r = tl.arange(0, 2 * BLOCK_N)
    n_r = tl.minimum(tl.program_id(1) * BLOCK_N + r % BLOCK_N, inter - 1)
    rows = (n_r + (r // BLOCK_N) * inter).to(tl.int64)
    sp = tl.arange(0, SPLIT)
    u = tl.arange(0, BLOCK_K // 4)
    gi = tl.arange(0, BLOCK_K // 16)
    kk = tl.arange(0, BLOCK_K)
    m = tl.arange(0, BT)
    u_abs = (sp * (BLOCK_K // 4))[:, None, None] + u[None, None, :]
    g_abs = (sp * (BLOCK_K // 16))[:, None, None] + gi[None, None, :]
    k_abs = (sp * BLOCK_K)[:, None, None] + kk[None, None, :]
    qp = q_ptr + e64 * stride_qe + rows[None, :, None] * stride_qn + u_abs
    spp = s_ptr + e64 * stride_se + rows[None, :, None] * stride_sn + g_abs
    xp = x_ptr + (pair // top_k).to(tl.int64) * stride_xt + k_abs + m[None, :, None] * 0
    row0 = (m == 0)[None, :, None]
    acc0 = tl.zeros([SPLIT, 2 * BLOCK_N, BT], tl.float32)
    acc1 = tl.zeros([SPLIT, 2 * BLOCK_N, BT], tl.float32)
    acc2 = tl.zeros([SPLIT, 2 * BLOCK_N, BT], tl.float32)
    acc3 = tl.zeros([SPLIT, 2 * BLOCK_N, BT], tl.float32)
    for k0 in range(0, hidden, SPLIT * BLOCK_K):
        if EVEN_K:
            a = tl.load(xp + k0, mask=row0, other=0.0)
            wq = tl.load(qp + k0 // 4)
            ws = tl.load(spp + k0 // 16)
        else:
            a = tl.load(xp + k0, mask=row0 & (k0 + k_abs < hidden), other=0.0)
            wq = tl.load(qp + k0 // 4, mask=k0 // 4 + u_abs < hidden // 4, other=0)
            ws = tl.load(spp + k0 // 16, mask=k0 // 16 + g_abs < hidden // 16, other=0)
        w0, w1, w2, w3 = fp4_decode4(wq, ws, DEC)
        acc0, acc1, acc2, acc3 = _mma4x4(w0, w1, w2, w3, a, acc0, acc1, acc2, acc3, DEC)
    acc = tl.sum(acc0 + acc1 + acc2 + acc3, axis=0)
    h = tl.sum(tl.where((m == 0)[None, :], acc, 0.0), axis=1)  # the pair is token column 0
    h = h * tl.load(g_ptr + e64 * 2 * inter + rows) * _GSCALE
    hg, hu = tl.split(tl.permute(tl.reshape(h, [2, BLOCK_N]), 1, 0))
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    act = hg * tl.sigmoid(hg) * hu
    tl.store(act_ptr + pair.to(tl.int64) * stride_at + n, act.to(act_ptr.dtype.element_ty), mask=n < inter)


@triton.jit
def moe_w4_down_token_split_kernel(act_ptr, q_ptr, s_ptr, g_ptr, out_ptr, ids_ptr, topk_w_ptr, hidden, inter,
                                   stride_at, stride_qe, stride_qn, stride_se, stride_sn, stride_ot,
                                   TOP_K: tl.constexpr, DEC: tl.constexpr, EVEN_K: tl.constexpr,
                                   SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """`moe_w4_down_token_kernel` with K split across warps: out[t, n] = sum_j topk_w[t, j] *
    (act[t*k + j] . w2[ids[t, j], n]), j in order, each step covering SPLIT * BLOCK_K of one expert."""
    BT: tl.constexpr = 16
    t = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nc = tl.minimum(n, hidden - 1).to(tl.int64)
    sp = tl.arange(0, SPLIT)
    u = tl.arange(0, BLOCK_K // 4)
    gi = tl.arange(0, BLOCK_K // 16)
    kk = tl.arange(0, BLOCK_K)
    m = tl.arange(0, BT)
    u_abs = (sp * (BLOCK_K // 4))[:, None, None] + u[None, None, :]
    g_abs = (sp * (BLOCK_K // 16))[:, None, None] + gi[None, None, :]
    k_abs = (sp * BLOCK_K)[:, None, None] + kk[None, None, :]
    qrow = q_ptr + nc[None, :, None] * stride_qn + u_abs
    srow = s_ptr + nc[None, :, None] * stride_sn + g_abs
    arow = act_ptr + k_abs + m[None, :, None] * 0
    row0 = (m == 0)[None, :, None]
    n_iter = tl.cdiv(inter, SPLIT * BLOCK_K)
    acc0 = tl.zeros([SPLIT, BLOCK_N, BT], tl.float32)
    acc1 = tl.zeros([SPLIT, BLOCK_N, BT], tl.float32)
    acc2 = tl.zeros([SPLIT, BLOCK_N, BT], tl.float32)
    acc3 = tl.zeros([SPLIT, BLOCK_N, BT], tl.float32)
    total = tl.zeros([SPLIT, BLOCK_N, BT], tl.float32)
    for it in range(0, TOP_K * n_iter):
        j = it // n_iter
        k0 = (it - j * n_iter) * (SPLIT * BLOCK_K)
        pair = t * TOP_K + j
        e = tl.load(ids_ptr + pair)
        live = e >= 0
        e64 = tl.maximum(e, 0).to(tl.int64)
        qp = qrow + e64 * stride_qe + k0 // 4
        spp = srow + e64 * stride_se + k0 // 16
        ap = arow + pair * stride_at + k0
        if EVEN_K:
            a = tl.load(ap, mask=row0 & live, other=0.0)
            wq = tl.load(qp, mask=live, other=0)
            ws = tl.load(spp, mask=live, other=0)
        else:
            a = tl.load(ap, mask=row0 & live & (k0 + k_abs < inter), other=0.0)
            wq = tl.load(qp, mask=live & (k0 // 4 + u_abs < inter // 4), other=0)
            ws = tl.load(spp, mask=live & (k0 // 16 + g_abs < inter // 16), other=0)
        w0, w1, w2, w3 = fp4_decode4(wq, ws, DEC)
        acc0, acc1, acc2, acc3 = _mma4x4(w0, w1, w2, w3, a, acc0, acc1, acc2, acc3, DEC)
        # end of this expert's K: fold its global scale and routing weight in, restart the accumulators
        last = k0 + SPLIT * BLOCK_K >= inter
        coef = tl.load(g_ptr + e64 * hidden + nc) * (tl.load(topk_w_ptr + pair) * _GSCALE)
        coef = tl.where(live & last, coef, 0.0)
        total += (acc0 + acc1 + acc2 + acc3) * coef[None, :, None]
        acc0 = tl.where(last, 0.0, acc0)
        acc1 = tl.where(last, 0.0, acc1)
        acc2 = tl.where(last, 0.0, acc2)
        acc3 = tl.where(last, 0.0, acc3)
    out = tl.sum(tl.sum(total, axis=0), axis=1)  # only token column 0 is non-zero
    tl.store(out_ptr + t * stride_ot + n, out.to(out_ptr.dtype.element_ty), mask=n < hidden)
