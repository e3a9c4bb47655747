"""NVFP4 (W4A16) expert kernels of `fused_moe`: weight-stationary tensor-core tiles ("swap AB").

A program owns BLOCK_N weight rows of one expert and a block of that expert's (token, expert) pairs, and
computes acc[rows, tokens] = W[rows, :] @ A[pairs, :]^T: the weights are the wide M side of the MMA,
dequantised in registers straight into its A operand (`fp4_decode4`: ~2 ops per weight on sm_89+, ~2.5
before), the few tokens are the narrow N side. A weight tile is read and dequantised once for all tokens of
the block, tensor cores do the multiply at any batch size (the MMA has throughput to spare and the CUDA cores
stay free for the decode), and the K loop is a dot loop that Triton software-pipelines with asynchronous
copies (or, with the TMA flag, bulk tensor copies through descriptors of the weights: tma.py).

`fp4_decode4` yields the weights as four stride-4 slices of K (W_t[:, u] = W[:, 4u + t]), so the
activations must be sliced the same way. How (constexpr XMODE):
- 0, "quad" (decode): B[u, 4j + c] = A[pair_j, k0 + 4u + c], i.e. each token slot j spans 4 columns
  holding the 4 slices; the 4 dots W_t @ B land slice t of token j in column 4j + t of accumulator t, the
  epilogue picks those columns. B is one plain tile (8 contiguous bytes per (u, j)) that goes to shared
  memory by asynchronous copy and into the MMA as is, and 4 slots fill the MMA's minimal 16 columns, so a
  single token pads 16 columns with zeros that are never loaded. Best while tokens per block are few.
- 1, "perm" (prefill): the activations are stored pre-permuted, A'[m, t * K/4 + u] = A[m, 4u + t]
  (`stage_x` for x; gate_up writes its output that way for down), so each slice is a contiguous
  [BLOCK_K/4, tokens] tile: no wasted MMA columns.
- 2, "split": the natural activation tile is split into the 4 slices in registers (`x_split4`).

Rows of a program ("blocks"):
- pairs mode (SORTED = False, small decode batches): block p is pair p alone, no sorting launch;
- sorted mode: the blocks of `moe_align` (pairs of one expert; -1 blocks past the end exit at once).
Expert id -1 (a slot routed to another expert-parallel rank) is skipped: no program loads its weights.

Kernels: `moe_w4_gate_up_kernel` (act = silu(x W_gate^T) * (x W_up^T); gate and up rows of a slice form
one tile), `moe_w4_down_kernel` (y[pair] = topk_w * act W_down^T; the top-k sum is `moe_reduce_kernel`,
or, in pairs mode with FUSED_SUM, done by the last program of each (token, slice) to finish, in fixed j
order: deterministic and one launch fewer), `moe_w4_down_token_kernel` (one program per (token, slice)
looping over the token's k experts in one flattened, pipelined loop, writing the final sum).
"""

from __future__ import annotations

from nibble.kernels._triton import tl, triton
from nibble.kernels.fp4_tiles import fp4_acc_scale
from nibble.kernels.pdl import gdc_wait, pdl_handoff, prefetch_rows
from nibble.kernels.w4_stage import f16_range, pairs_col
from nibble.kernels.w4_steps import w4_finish, w4_k_step, w4_scale_tile, w4_tile

QUAD, PERM, SPLIT = 0, 1, 2
XMODES = {"quad": QUAD, "perm": PERM, "split": SPLIT}


@triton.jit
def _block(ids_ptr, sorted_ptr, block_expert_ptr, SORTED: tl.constexpr, SLOTS: tl.constexpr, REP: tl.constexpr):
    """(expert, pair [SLOTS * REP], valid [SLOTS * REP]) of this program's block; entry i is token slot
    i // REP. Expert < 0: nothing to do. Sorted mode reads the block's expert and its sorted_ids entries side
    by side, padding entries holding -1 (`moe_align`): one memory round trip before the first tile can be
    asked for, where bounding the block by its expert's start + count took two more (0.8-2% of the layer's
    time at 8-256 tokens, docs/benchmarks.md)."""
    pid = tl.program_id(0)
    slot = tl.arange(0, SLOTS * REP) // REP
    if SORTED:
        e = tl.load(block_expert_ptr + pid)
        pair = tl.load(sorted_ptr + pid * SLOTS + slot)
        valid = (pair >= 0) & (e >= 0)
        pair = tl.where(valid, pair, 0)
    else:
        e = tl.load(ids_ptr + pid)
        valid = slot == 0
        pair = pid + slot * 0
    return e, pair, valid


@triton.jit
def _out_pairs(sorted_ptr, SORTED: tl.constexpr, SLOTS: tl.constexpr):
    """(pair [SLOTS], ok [SLOTS]) the epilogue writes: the block's sorted pairs that exist (-1 padding
    excluded), or pair = program 0 in slot 0 alone (pairs mode)."""
    sl = tl.arange(0, SLOTS)
    if SORTED:
        pr = tl.load(sorted_ptr + tl.program_id(0) * SLOTS + sl)
        ok = pr >= 0
        pr = tl.where(ok, pr, 0)
    else:
        ok = sl == 0
        pr = tl.program_id(0) + sl * 0
    return pr, ok


@triton.jit
def _prefetch_expert_rows(q_ptr, s_ptr, e, first_row, num_rows, stride_qe, stride_qn, stride_se, stride_sn, n_k):
    """Ask for num_rows weight rows of expert e from first_row on, units and block scales, in L2."""
    prefetch_rows(q_ptr + e.to(tl.int64) * stride_qe, first_row, num_rows, stride_qn, n_k // 4)
    prefetch_rows(s_ptr + e.to(tl.int64) * stride_se, first_row, num_rows, stride_sn, n_k // 16)


@triton.jit
def _weight_tile(q_rows, s_rows, q_desc, s_desc, e, n0, k0, n_k, ROWS: tl.constexpr, BLOCK_K: tl.constexpr,
                 EVEN_K: tl.constexpr, TMA: tl.constexpr, STACKED: tl.constexpr):
    """A K step's weight tile: units [ROWS, BLOCK_K/4] and scales [ROWS, BLOCK_K/16] (`w4_tile`), by pointers
    (TMA 0), the units (TMA 1) or both (TMA 2) through descriptors of expert e from row n0 on: the 4-D stacked
    gate_up descriptors (STACKED; ROWS = 2 x the box's rows) or the 3-D down ones, `tma.w4_descriptors`."""
    if TMA:
        if STACKED:
            q = q_desc.load([e, 0, n0, k0 // 4])
        else:
            q = q_desc.load([e, n0, k0 // 4])
        q = tl.reshape(q, [ROWS, BLOCK_K // 4])
        if TMA == 2:
            if STACKED:
                s = s_desc.load([e, 0, n0, k0 // 16])
            else:
                s = s_desc.load([e, n0, k0 // 16])
            s = tl.reshape(s, [ROWS, BLOCK_K // 16])
        else:
            s = w4_scale_tile(s_rows, k0, n_k, BLOCK_K, EVEN_K)
        return q, s
    else:
        return w4_tile(q_rows, s_rows, k0, n_k, BLOCK_K, EVEN_K)


@triton.jit
def _act_col(n, inter, ACT_PERM: tl.constexpr):
    """Column of feature n in the activation buffer: natural, or permuted for a PERM-mode consumer."""
    if ACT_PERM:
        return (n % 4) * (inter // 4) + n // 4
    else:
        return n


@triton.jit
def moe_w4_gate_up_kernel(x_ptr, q_ptr, s_ptr, g_ptr, act_ptr, ids_ptr, sorted_ptr, block_expert_ptr, top_k, hidden,
                          inter, stride_xt, stride_qe, stride_qn, stride_se, stride_sn, stride_at,
                          SORTED: tl.constexpr, XMODE: tl.constexpr, ACT_PERM: tl.constexpr, ACT_PAIRS: tl.constexpr,
                          DEC: tl.constexpr, EVEN_K: tl.constexpr, SLOTS: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, X_SHIFT: tl.constexpr = 0, PREFETCH: tl.constexpr = False,
                          PDL_WAIT: tl.constexpr = False, PDL_TRIGGER: tl.constexpr = False, q_desc=None,
                          s_desc=None, TMA: tl.constexpr = 0, PDL_WAIT_FIRST: tl.constexpr = False):
    """act[pair, n] = silu(x[tok] . w13[e, n]) * (x[tok] . w13[e, I + n]) for the block's pairs (SLOTS token
    slots) and BLOCK_N features. q_ptr: w13 as int16 units [E, 2I, H/4] (strides in units); s_ptr: e4m3
    scales as uint8 [E, 2I, H/16]; g_ptr: fp32 global scales [E, 2I]; x: [T, H] (PERM: permuted rows);
    act: [pairs, I] (ACT_PERM: permuted rows; ACT_PAIRS: in DEC 4's order, BLOCK_N and I multiples of 8).
    X_SHIFT: x holds activations * 2^-X_SHIFT, and act is written the same way (fp16 staging of bf16
    activations, see `stage_x`). PREFETCH: first ask for the program's weight rows in L2 (pdl.py); PDL_WAIT:
    launched with PDL right after `stage_x` (ids and the sorted blocks are older, so they are read before the
    wait); PDL_WAIT_FIRST: launched with PDL behind any kernel (the router, which writes the ids), so it waits
    before reading anything; PDL_TRIGGER: the down kernel is. TMA 1: the weight units come through q_desc, a
    stacked descriptor of the same tensor (`tma.w4_descriptors`); TMA 2: the block scales too, through s_desc."""
    REP: tl.constexpr = 4 if XMODE == 0 else 1
    if PDL_WAIT_FIRST:
        gdc_wait()
    e, pair, valid = _block(ids_ptr, sorted_ptr, block_expert_ptr, SORTED, SLOTS, REP)
    if PREFETCH:
        if e >= 0:
            n0 = tl.program_id(1) * BLOCK_N
            num = tl.minimum(inter - n0, BLOCK_N)
            _prefetch_expert_rows(q_ptr, s_ptr, e, n0, num, stride_qe, stride_qn, stride_se, stride_sn, hidden)
            _prefetch_expert_rows(q_ptr, s_ptr, e, n0 + inter, num, stride_qe, stride_qn, stride_se, stride_sn,
                                  hidden)
    pdl_handoff(PDL_TRIGGER, PDL_WAIT and not PDL_WAIT_FIRST)
    if e < 0:
        return
    act, pr, ok = gate_up_slice(x_ptr, q_ptr, s_ptr, g_ptr, sorted_ptr, e, pair, valid, top_k, hidden, inter,
                                stride_xt, stride_qe, stride_qn, stride_se, stride_sn, SORTED, XMODE, ACT_PAIRS, DEC,
                                EVEN_K, SLOTS, BLOCK_N, BLOCK_K, X_SHIFT, q_desc, s_desc, TMA)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    if ACT_PAIRS and TMA:
        n = pairs_col(n)
    tl.store(act_ptr + pr.to(tl.int64)[None, :] * stride_at + _act_col(n, inter, ACT_PERM)[:, None],
             act.to(act_ptr.dtype.element_ty), mask=(n < inter)[:, None] & ok[None, :])


@triton.jit
def gate_up_slice(x_ptr, q_ptr, s_ptr, g_ptr, sorted_ptr, e, pair, valid, top_k, hidden, inter, stride_xt,
                  stride_qe, stride_qn, stride_se, stride_sn, SORTED: tl.constexpr, XMODE: tl.constexpr,
                  ACT_PAIRS: tl.constexpr, DEC: tl.constexpr, EVEN_K: tl.constexpr, SLOTS: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, X_SHIFT: tl.constexpr, q_desc, s_desc,
                  TMA: tl.constexpr):
    """(act fp32 [BLOCK_N, SLOTS], pr [SLOTS], ok [SLOTS]): silu(gate) * up of feature slice program_id(1)
    for the block (e >= 0, pair, valid from `_block`), times 2^-X_SHIFT and clamped to the fp16 range when
    X_SHIFT; the epilogue's pairs from `_out_pairs`. With ACT_PAIRS and no TMA, row i holds feature
    pairs_col(n0 + i), so stored in column n0 + i it lands where DEC 4 wants it (`moe_w4_gate_up_kernel`)."""
    REP: tl.constexpr = 4 if XMODE == 0 else 1
    NCOL: tl.constexpr = SLOTS * REP
    e64 = e.to(tl.int64)
    # gate rows n and up rows I + n of this feature slice, stacked: one [2 * BLOCK_N] weight tile
    r = tl.arange(0, 2 * BLOCK_N)
    n0 = tl.program_id(1) * BLOCK_N
    n_r = n0 + r % BLOCK_N
    if ACT_PAIRS and not TMA:
        # tile row r computes feature pairs_col(n): stored in column n, it lands where DEC 4 wants it
        # (pairs_col is an involution within groups of 8), and the epilogue keeps its natural addresses;
        # a TMA tile holds the natural rows, so there the epilogue stores feature n in column pairs_col(n)
        n_r = pairs_col(n_r)
    n_r = tl.minimum(n_r, inter - 1)  # clamped rows: results not stored
    rows = (n_r + (r // BLOCK_N) * inter).to(tl.int64)
    q_rows = q_ptr + e64 * stride_qe + rows * stride_qn
    s_rows = s_ptr + e64 * stride_se + rows * stride_sn
    b_ptr = x_ptr + (pair // top_k).to(tl.int64) * stride_xt
    # before the K loop, as in down
    pr, ok = _out_pairs(sorted_ptr, SORTED, SLOTS)
    acc0 = tl.zeros([2 * BLOCK_N, NCOL], tl.float32)
    acc1 = tl.zeros([2 * BLOCK_N, NCOL if XMODE == 0 else 16], tl.float32)
    acc2 = tl.zeros([2 * BLOCK_N, NCOL if XMODE == 0 else 16], tl.float32)
    acc3 = tl.zeros([2 * BLOCK_N, NCOL if XMODE == 0 else 16], tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        q, s = _weight_tile(q_rows, s_rows, q_desc, s_desc, e, n0, k0, hidden, 2 * BLOCK_N, BLOCK_K, EVEN_K, TMA,
                            True)
        acc0, acc1, acc2, acc3 = w4_k_step(q, s, b_ptr, valid, k0, hidden, acc0, acc1, acc2, acc3, hidden // 4,
                                         XMODE, DEC, BLOCK_K, EVEN_K)
    acc_scale = fp4_acc_scale(DEC, X_SHIFT)
    h = w4_finish(acc0, acc1, acc2, acc3, XMODE) * (tl.load(g_ptr + e64 * 2 * inter + rows) * acc_scale)[:, None]
    hg, hu = tl.split(tl.permute(tl.reshape(h, [2, BLOCK_N, SLOTS]), 1, 2, 0))
    act = hg * tl.sigmoid(hg) * hu
    if X_SHIFT != 0:
        act = f16_range(act * (1.0 / (1 << X_SHIFT)))
    return act, pr, ok


@triton.jit
def moe_w4_down_kernel(act_ptr, q_ptr, s_ptr, g_ptr, y_ptr, out_ptr, sem_ptr, topk_w_ptr, ids_ptr, sorted_ptr,
                       block_expert_ptr, hidden, inter, stride_at, stride_qe, stride_qn, stride_se, stride_sn,
                       stride_yt, stride_ot, TOP_K: tl.constexpr, SORTED: tl.constexpr,
                       XMODE: tl.constexpr, FUSED_SUM: tl.constexpr, DEC: tl.constexpr, EVEN_K: tl.constexpr,
                       SLOTS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       X_SHIFT: tl.constexpr = 0, PREFETCH: tl.constexpr = False, PDL_WAIT: tl.constexpr = False,
                       PDL_TRIGGER: tl.constexpr = False, q_desc=None, s_desc=None, TMA: tl.constexpr = 0):
    """y[pair, n] = topk_w[pair] * (act[pair] . w2[e, n]) for the block's pairs and BLOCK_N hidden features
    (w2 as units [E, H, I/4], scales [E, H, I/16], global [E, H]); y: fp32 or activation dtype [pairs, H].
    PREFETCH / PDL_WAIT / PDL_TRIGGER as in `moe_w4_gate_up_kernel` (launched with PDL after gate_up: the
    weights stream into L2 while gate_up finishes; the trigger is for the reduce launch). TMA as in
    `moe_w4_gate_up_kernel` (3-D descriptors).

    FUSED_SUM (pairs mode): after writing y, each program counts itself in sem[token, slice]; the one that
    completes the token's live pairs sums its k rows of y in order j = 0..k-1 into out and re-arms the
    counter to 0 (so it is zero again for the next call). A token without live pairs gets zeros."""
    REP: tl.constexpr = 4 if XMODE == 0 else 1
    NCOL: tl.constexpr = SLOTS * REP
    e, pair, valid = _block(ids_ptr, sorted_ptr, block_expert_ptr, SORTED, SLOTS, REP)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    if PREFETCH:
        if e >= 0:
            n0 = tl.program_id(1) * BLOCK_N
            _prefetch_expert_rows(q_ptr, s_ptr, e, n0, tl.minimum(hidden - n0, BLOCK_N), stride_qe, stride_qn,
                                  stride_se, stride_sn, inter)
    pdl_handoff(PDL_TRIGGER, PDL_WAIT)
    if FUSED_SUM:
        p0 = tl.program_id(0)
        t = p0 // TOP_K
        n_live = 0
        for j in tl.static_range(TOP_K):
            n_live += (tl.load(ids_ptr + t * TOP_K + j) >= 0).to(tl.int32)
        if e < 0:
            if (n_live == 0) & (p0 % TOP_K == 0):
                tl.store(out_ptr + t.to(tl.int64) * stride_ot + n, tl.zeros([BLOCK_N], tl.float32).to(
                    out_ptr.dtype.element_ty), mask=n < hidden)
            return
    if e < 0:
        return
    e64 = e.to(tl.int64)
    nc = tl.minimum(n, hidden - 1).to(tl.int64)
    q_rows = q_ptr + e64 * stride_qe + nc * stride_qn
    s_rows = s_ptr + e64 * stride_se + nc * stride_sn
    b_ptr = act_ptr + pair.to(tl.int64) * stride_at
    # the output pairs and routing weights are read before the K loop: read after it, ptxas serialised every
    # wgmma of the Hopper quad-mode loop (its advisory C7515)
    pr, ok = _out_pairs(sorted_ptr, SORTED, SLOTS)
    tw = tl.load(topk_w_ptr + pr, mask=ok, other=0.0)
    acc0 = tl.zeros([BLOCK_N, NCOL], tl.float32)
    acc1 = tl.zeros([BLOCK_N, NCOL if XMODE == 0 else 16], tl.float32)
    acc2 = tl.zeros([BLOCK_N, NCOL if XMODE == 0 else 16], tl.float32)
    acc3 = tl.zeros([BLOCK_N, NCOL if XMODE == 0 else 16], tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        q, s = _weight_tile(q_rows, s_rows, q_desc, s_desc, e, tl.program_id(1) * BLOCK_N, k0, inter, BLOCK_N,
                            BLOCK_K, EVEN_K, TMA, False)
        acc0, acc1, acc2, acc3 = w4_k_step(q, s, b_ptr, valid, k0, inter, acc0, acc1, acc2, acc3, inter // 4,
                                         XMODE, DEC, BLOCK_K, EVEN_K)
    acc_scale = fp4_acc_scale(DEC, X_SHIFT)
    acc = w4_finish(acc0, acc1, acc2, acc3, XMODE) * (tl.load(g_ptr + e64 * hidden + nc) * acc_scale)[:, None]
    acc *= tw[None, :]
    tl.store(y_ptr + pr.to(tl.int64)[None, :] * stride_yt + n[:, None], acc.to(y_ptr.dtype.element_ty),
             mask=(n < hidden)[:, None] & ok[None, :])
    if FUSED_SUM:
        # the barrier orders every thread's y stores before the one counter update, whose release at GPU scope
        # is cumulative (the pattern of cooperative groups' grid sync: a block barrier, then one thread's
        # release), so no thread fences on its own; the winner reads the other rows after its acquire, past L1
        tl.debug_barrier()
        sem = sem_ptr + t * tl.num_programs(1) + tl.program_id(1)
        done = tl.atomic_add(sem, 1, sem="acq_rel", scope="gpu")
        if done == n_live - 1:
            tl.debug_barrier()
            total = tl.zeros([BLOCK_N], tl.float32)
            for j in tl.static_range(TOP_K):
                live = tl.load(ids_ptr + t * TOP_K + j) >= 0
                total += tl.load(y_ptr + (t * TOP_K + j).to(tl.int64) * stride_yt + n, mask=(n < hidden) & live,
                                 other=0.0, cache_modifier=".cg").to(tl.float32)
            tl.store(out_ptr + t.to(tl.int64) * stride_ot + n, total.to(out_ptr.dtype.element_ty), mask=n < hidden)
            tl.atomic_xchg(sem, 0, sem="relaxed", scope="gpu")


@triton.jit
def moe_w4_down_token_kernel(act_ptr, q_ptr, s_ptr, g_ptr, out_ptr, ids_ptr, topk_w_ptr, hidden, inter, stride_at,
                             stride_qe, stride_qn, stride_se, stride_sn, stride_ot, TOP_K: tl.constexpr,
                             DEC: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr, X_SHIFT: tl.constexpr = 0):
    """out[t, n] = sum_j topk_w[t, j] * (act[t*k + j] . w2[ids[t, j], n]), j in order (deterministic), for
    BLOCK_N hidden features, quad mode. One loop over (j, K slice) so the copies stay pipelined across
    experts; the expert's scales are folded into a running total at the end of its K range."""
    t = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nc = tl.minimum(n, hidden - 1).to(tl.int64)
    col0 = tl.arange(0, 16) < 4  # one token slot: columns 0..3
    n_iter = tl.cdiv(inter, BLOCK_K)
    acc_scale = fp4_acc_scale(DEC, X_SHIFT)
    acc0 = tl.zeros([BLOCK_N, 16], tl.float32)
    acc1 = tl.zeros([BLOCK_N, 16], tl.float32)
    acc2 = tl.zeros([BLOCK_N, 16], tl.float32)
    acc3 = tl.zeros([BLOCK_N, 16], tl.float32)
    total = tl.zeros([BLOCK_N, 16], tl.float32)
    for it in range(0, TOP_K * n_iter):
        j = it // n_iter
        k0 = (it - j * n_iter) * BLOCK_K
        pair = t * TOP_K + j
        e = tl.load(ids_ptr + pair)
        live = e >= 0
        e64 = tl.maximum(e, 0).to(tl.int64)
        q, s = w4_tile(q_ptr + e64 * stride_qe + nc * stride_qn, s_ptr + e64 * stride_se + nc * stride_sn, k0,
                       inter, BLOCK_K, EVEN_K)
        b_ptr = act_ptr + pair * stride_at + tl.zeros([16], tl.int64)
        acc0, acc1, acc2, acc3 = w4_k_step(q, s, b_ptr, col0 & live, k0, inter, acc0, acc1, acc2, acc3, 0, 0, DEC,
                                         BLOCK_K, EVEN_K)
        # end of this expert's K: fold its global scale and routing weight in, restart the accumulators
        last = k0 + BLOCK_K >= inter
        coef = tl.load(g_ptr + e64 * hidden + nc) * (tl.load(topk_w_ptr + pair) * acc_scale)
        coef = tl.where(live & last, coef, 0.0)
        c = (tl.arange(0, 16) % 4)[None, :]
        sel = tl.where(c == 0, acc0, 0.0) + tl.where(c == 1, acc1, 0.0)
        sel += tl.where(c == 2, acc2, 0.0) + tl.where(c == 3, acc3, 0.0)
        total += sel * coef[:, None]
        acc0 = tl.where(last, 0.0, acc0)
        acc1 = tl.where(last, 0.0, acc1)
        acc2 = tl.where(last, 0.0, acc2)
        acc3 = tl.where(last, 0.0, acc3)
    out = tl.sum(total, axis=1)  # only columns 0..3 (token slot 0) are non-zero
    tl.store(out_ptr + t * stride_ot + n, out.to(out_ptr.dtype.element_ty), mask=n < hidden)
