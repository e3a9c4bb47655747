"""NVFP4 expert MLP in one launch for the smallest decode batches: gate_up and down of a feature slice per program.

On the pairs path (`fused_moe`, 1-7 tokens) gate_up and down are two launches, and down's arithmetic waits for
every gate_up program: at one token the layer costs the latency of two short, dependent kernels rather than its
bytes. Here (tuning field `dn_mode` "slice") a program owns one (token, expert) pair and one slice of BLOCK_I
intermediate features. It computes the slice's silu(gate) * up (`moe_w4.gate_up_slice`), keeps it in registers
as the MMA's B operand (each of `fp4_decode4`'s four K slices in column 0 of its own 8-column tile, so the four
MMAs of a down step chain into one accumulator), and multiplies it by the same BLOCK_I columns of w2 for all H
rows: the down product restricted to K = its slice. No program waits for another. `moe_slice_reduce_kernel`
then sums the k * I / BLOCK_I partial rows of each token in a fixed order (deterministic) and applies w2's
global scales and the routing weights. The price: fp32 partials of pairs * I / BLOCK_I * H * 4 bytes (1.5 MB
for one token of the 122B-A10B layer, written and read in L2), and w2 read in rows of BLOCK_I / 2 bytes.
BLOCK_I is at least 16 on the GPU (the MMA's K); below 64 a K slice is too short for an MMA of its own, so the
four are joined into one operand (its layout conversion costs shared-memory traffic: 4.0 instructions per w2
weight at BLOCK_I 32 against 2.8 at 64, offline sm_90 SASS), for twice the programs per token.
"""

from __future__ import annotations

from nibble.kernels._triton import tl, triton
from nibble.kernels.fp4_tiles import fp4_acc_scale, fp4_decode4
from nibble.kernels.moe_w4 import _block, _prefetch_expert_rows, gate_up_slice, prefetch_gate_up_rows
from nibble.kernels.pdl import pdl_handoff
from nibble.kernels.w4_steps import w4_dot, w4_tile, x_split4


@triton.jit
def moe_w4_slice_kernel(x_ptr, q13_ptr, s13_ptr, g13_ptr, q2_ptr, s2_ptr, part_ptr, ids_ptr, top_k, hidden, inter,
                        stride_xt, stride_q13e, stride_q13n, stride_s13e, stride_s13n, stride_q2e, stride_q2n,
                        stride_s2e, stride_s2n, stride_pt, ACT_PAIRS: tl.constexpr, DEC: tl.constexpr,
                        EVEN_H: tl.constexpr, EVEN_I: tl.constexpr, SLOTS: tl.constexpr, BLOCK_I: tl.constexpr,
                        BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr, DN_STAGES: tl.constexpr,
                        X_SHIFT: tl.constexpr = 0, GU_PREFETCH: tl.constexpr = False,
                        DN_PREFETCH: tl.constexpr = False, PDL_WAIT: tl.constexpr = False,
                        PDL_TRIGGER: tl.constexpr = False):
    """part[p * S + s, n] = sum_{i in slice s} w2[e, n, i] * act[p, i] for pair p = program_id(0), slice
    s = program_id(1) of S, e = ids[p] (nothing written for e < 0), w2 with its block scales but without its
    global scale and the decode's factor (`fp4_acc_scale`), which the reduce applies with the routing weight.
    x: [T, H] as `moe_w4_gate_up_kernel` reads it (x_ptr's dtype is the MMA's: fp16 staged * 2^-X_SHIFT for
    DEC 3/4); w13 as units, e4m3 scale bytes and fp32 global scales, w2 as units and scale bytes
    (`moe_w4_gate_up_kernel`, `moe_w4_down_kernel`); part: fp32 [pairs * S, H].
    EVEN_H: H % BLOCK_K == 0; EVEN_I: I % BLOCK_I == 0. GU_PREFETCH / DN_PREFETCH: first ask for the slice's
    gate and up rows / this program's 1/S share of the expert's w2 rows (all S share it) in L2. PDL_WAIT:
    launched with PDL after `stage_x`; PDL_TRIGGER: the reduce is."""
    e, pair, valid = _block(ids_ptr, ids_ptr, ids_ptr, False, SLOTS, 4)
    s_idx = tl.program_id(1)
    if e >= 0:
        if GU_PREFETCH:
            prefetch_gate_up_rows(q13_ptr, s13_ptr, e, inter, hidden, stride_q13e, stride_q13n, stride_s13e,
                                  stride_s13n, BLOCK_I)
        if DN_PREFETCH:
            share = tl.cdiv(hidden, tl.num_programs(1))
            num = tl.minimum(hidden - s_idx * share, share)
            if num > 0:
                _prefetch_expert_rows(q2_ptr, s2_ptr, e, s_idx * share, num, stride_q2e, stride_q2n, stride_s2e,
                                      stride_s2n, inter)
    pdl_handoff(PDL_TRIGGER, PDL_WAIT)
    if e < 0:
        return
    act, _, _ = gate_up_slice(x_ptr, q13_ptr, s13_ptr, g13_ptr, ids_ptr, e, pair, valid, top_k, hidden, inter,
                              stride_xt, stride_q13e, stride_q13n, stride_s13e, stride_s13n, False, 0, ACT_PAIRS, DEC,
                              EVEN_H, SLOTS, BLOCK_I, BLOCK_K, X_SHIFT, None, None, 0)
    k0 = s_idx * BLOCK_I
    JOIN: tl.constexpr = BLOCK_I < 64
    # token slot 0 (one pair per program); rows past I were computed from clamped weight rows (with ACT_PAIRS
    # row i holds feature pairs_col(k0 + i), which is past I exactly when k0 + i is: I is a multiple of 8)
    act0 = tl.sum(tl.where((tl.arange(0, SLOTS) == 0)[None, :], act, 0.0), axis=1)
    act0 = tl.where(k0 + tl.arange(0, BLOCK_I) < inter, act0, 0.0).to(x_ptr.dtype.element_ty)
    # down's B operands: K slice t of the activations (`fp4_decode4`'s order) in column 0 of an 8-column tile,
    # so the 4 slices' MMAs chain into one accumulator whose column 0 is the result (no per-step selection)
    col = tl.arange(0, 8)[None, :]
    if JOIN:
        # one MMA over the slice's whole K: the decode's four slices joined, column 4u + 2j + i holding slice
        # 2i + j, so B is the activations with bits 0 and 1 of the K index swapped
        bj = tl.reshape(tl.permute(tl.reshape(act0, [BLOCK_I // 4, 2, 2]), 0, 2, 1), [BLOCK_I, 1])
        bj = tl.where(col == 0, bj, 0.0)
    else:
        a0, a1, a2, a3 = x_split4(tl.reshape(act0, [1, BLOCK_I]))
        b0 = tl.where(col == 0, tl.trans(a0), 0.0)
        b1 = tl.where(col == 0, tl.trans(a1), 0.0)
        b2 = tl.where(col == 0, tl.trans(a2), 0.0)
        b3 = tl.where(col == 0, tl.trans(a3), 0.0)
    p = tl.program_id(0).to(tl.int64)
    e64 = e.to(tl.int64)
    q_base = q2_ptr + e64 * stride_q2e
    s_base = s2_ptr + e64 * stride_s2e
    out_row = part_ptr + (p * tl.num_programs(1) + s_idx) * stride_pt
    for h0 in tl.range(0, hidden, BLOCK_H, num_stages=DN_STAGES):
        n = h0 + tl.arange(0, BLOCK_H)
        nc = tl.minimum(n, hidden - 1).to(tl.int64)
        q, s = w4_tile(q_base + nc * stride_q2n, s_base + nc * stride_s2n, k0, inter, BLOCK_I, EVEN_I)
        w0, w1, w2, w3 = fp4_decode4(q, s, DEC)
        if JOIN:
            wj = tl.reshape(tl.join(tl.join(w0, w1), tl.join(w2, w3)), [BLOCK_H, BLOCK_I])
            acc = w4_dot(wj, bj, tl.zeros([BLOCK_H, 8], tl.float32), DEC)
        else:
            acc = w4_dot(w0, b0, tl.zeros([BLOCK_H, 8], tl.float32), DEC)
            acc = w4_dot(w1, b1, acc, DEC)
            acc = w4_dot(w2, b2, acc, DEC)
            acc = w4_dot(w3, b3, acc, DEC)
        # column 0 straight from the accumulator's layout: no shuffle or shared-memory round trip per step
        tl.store(out_row + n[:, None] + col * 0, acc, mask=(n < hidden)[:, None] & (col == 0))


@triton.jit
def moe_slice_reduce_kernel(part_ptr, g2_ptr, topk_w_ptr, ids_ptr, out_ptr, hidden, stride_pt, stride_ot,
                            TOP_K: tl.constexpr, NUM_SLICES: tl.constexpr, SLICES_P2: tl.constexpr,
                            DEC: tl.constexpr, X_SHIFT: tl.constexpr, BLOCK: tl.constexpr,
                            PDL_WAIT: tl.constexpr = False):
    """out[t, n] = sum_j topk_w[t, j] * g2[e_j, n] * (sum_s part[(t * TOP_K + j) * NUM_SLICES + s, n]) times
    `fp4_acc_scale`, over the pairs j whose expert id e_j is >= 0 (the others' rows are never written), in fp32
    and in one fixed order (`moe_w4_slice_kernel`). g2: fp32 [E, H]; SLICES_P2: NUM_SLICES rounded up to a
    power of two. PDL_WAIT: launched with PDL after the slice kernel."""
    pdl_handoff(False, PDL_WAIT)
    t = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    nmask = n < hidden
    sl = tl.arange(0, SLICES_P2)
    acc = tl.zeros([BLOCK], tl.float32)
    for j in tl.static_range(TOP_K):
        pair = t * TOP_K + j
        e = tl.load(ids_ptr + pair)
        if e >= 0:
            rows = pair * NUM_SLICES + sl
            v = tl.load(part_ptr + rows[:, None] * stride_pt + n[None, :],
                        mask=(sl < NUM_SLICES)[:, None] & nmask[None, :], other=0.0)
            g = tl.load(g2_ptr + e.to(tl.int64) * hidden + n, mask=nmask, other=0.0)
            acc += tl.sum(v, axis=0) * g * tl.load(topk_w_ptr + pair)
    out = acc * fp4_acc_scale(DEC, X_SHIFT)
    tl.store(out_ptr + t * stride_ot + n, out.to(out_ptr.dtype.element_ty), mask=nmask)
