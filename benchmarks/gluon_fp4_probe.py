"""The NVFP4 version of gluon_probe.py's `rega_gemm_kernel`: W4A16 GEMM with the FP4 weights decoded in
registers into the wgmma's A operand, the activations by TMA, timed against nibble's Triton `nvfp4_linear`
(the same weight-stationary decode, which Triton waits on at every wgmma) and cuBLAS on bf16 weights.

    python benchmarks/gluon_fp4_probe.py [--m 2048 --n 4096 --k 4096] [--only REGEX]

The grouped mode's lead (a third faster than the Triton MoE gate_up, every expert with exactly 128 rows) did not
carry over to real routing: put into fused_moe's prefill path with the activations gathered in pair order, the
kernel was at best even with the Triton tiles and the layers 4-43% slower (docs/benchmarks.md, thirty-eighth
session; the code is in commit d5dfb5e).

Decode, exact: code c -> the bf16 bits ((c & 7) << 6) | ((c & 8) << 12) are the e2m1 value times 2^-126 (its
exponent and mantissa bits land in bf16's, subnormal for c & 6 == 0), so one bf16 multiply by the block scale
times 2^63 (an e4m3 value, exact in bf16) gives the weight times 2^-63; the per-row global scale times 2^63
multiplies the fp32 accumulator at the end. Each thread's A registers hold K pairs (2j, 2j + 1), the two
nibbles of packed byte j.
"""

from __future__ import annotations

import argparse
import re
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# gluon_probe exits with a message on a Triton without a Hopper Gluon
from gluon_probe import (
    TensorDescriptor,
    gl,
    gluon,
    mbarrier,
    report,
    report_tile,
    store_transposed,
    tma_ring_refill,
    tma_ring_start,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from nibble.kernels.fp4_tiles import DECODE_F16_CVT, F16_X_SHIFT

# the decoded bits are the e2m1 value times 2^-126; the block scales carry 2^63 of that back and the global scale
# the other 2^63 (a block scale up to 448 times 2^126 would overflow), so the MMA sees weights times 2^-63
SCALE_BIAS = 2.0 ** 63
CVT_ACC_SCALE = 2.0 ** (6 + F16_X_SHIFT)  # the converter decode's 2^-6 and the fp16 staging's 2^-F16_X_SHIFT


@gluon.jit
def rega_fp4_gemm_kernel(a_desc, q_ptr, sc_ptr, g_ptr, c_ptr, M, N, K, BM: gl.constexpr, BN: gl.constexpr,
                         BK: gl.constexpr, STAGES: gl.constexpr, WARPS: gl.constexpr):
    """c[M, N] = a[M, K] @ W^T for W [N, K] in NVFP4: q uint8 [N, K/2], sc fp32 [N, K/16] (block scale times
    2^63), g fp32 [N] (global scale times 2^63); each program computes the tile c^T[BN, BM]; M, N, K
    multiples of the blocks. The next step's weights load while this step's wgmma runs."""
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, BM, 16])
    w_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_l, k_width=2)
    a_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BM, BK], a_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    off_m = gl.program_id(0) * BM
    off_n = gl.program_id(1) * BN
    n_k = K // BK
    tma_ring_start(a_desc, a_s, bars, off_m, BM, BK, STAGES)
    rn = off_n + gl.arange(0, BN, layout=gl.SliceLayout(1, w_l))
    rk = gl.arange(0, BK, layout=gl.SliceLayout(0, w_l))
    q_rows = q_ptr + rn.to(gl.int64)[:, None] * (K // 2) + (rk // 2)[None, :]
    s_rows = sc_ptr + rn.to(gl.int64)[:, None] * (K // 16) + (rk // 16)[None, :]
    shift = ((rk & 1) * 4)[None, :]
    q = gl.load(q_rows)
    sc = gl.load(s_rows)
    acc = gl.zeros([BN, BM], gl.float32, acc_l)
    for i in range(n_k):
        st = i % STAGES
        code = (q.to(gl.int32) >> shift) & 15
        bits = ((code & 7) << 6) | ((code & 8) << 12)
        w = bits.to(gl.int16).to(gl.bfloat16, bitcast=True) * sc.to(gl.bfloat16)
        mbarrier.wait(bars.index(st), (i // STAGES) & 1)
        acc = warpgroup_mma(w, a_s.index(st).permute((1, 0)), acc, is_async=True)
        more = (rk < K - (i + 1) * BK)[None, :]
        q = gl.load(q_rows + (i + 1) * (BK // 2), mask=more, other=0)
        sc = gl.load(s_rows + (i + 1) * (BK // 16), mask=more, other=0.0)
        # all of it: the next step's A fragments are written into the registers this wgmma reads (thirty-seventh
        # session, `rega_cvt_gemm_kernel`; waiting for one step less was a race)
        acc = warpgroup_mma_wait(0, deps=[acc])
        tma_ring_refill(a_desc, a_s, bars, off_m, i, n_k, BM, BK, STAGES)
    acc = warpgroup_mma_wait(0, deps=[acc])
    store_transposed(acc, g_ptr, c_ptr, off_m, off_n, N, BM, BN, acc_l)


def fp4_gemm(a: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, gscale: torch.Tensor, bm: int = 256,
             bn: int = 64, bk: int = 64, warps: int = 4, stages: int = 3):
    """a [M, K] bf16, packed uint8 [N, K/2], scales fp32 [N, K/16] (block scale * 2^63), gscale fp32 [N]
    (global scale * 2^63) -> ([M, N] bf16, the compiled kernel)."""
    m, k = a.shape
    n = packed.shape[0]
    if m % bm or n % bn or k % bk:
        raise ValueError(f"gluon_fp4_probe: M, N, K = {m}, {n}, {k} must be multiples of {bm}, {bn}, {bk}")
    c = torch.empty(m, n, dtype=torch.bfloat16, device=a.device)
    desc = TensorDescriptor.from_tensor(a, [bm, bk], gl.NVMMASharedLayout.get_default_for([bm, bk], gl.bfloat16))
    kernel = rega_fp4_gemm_kernel[(m // bm, n // bn)](desc, packed, scales, gscale, c, m, n, k, BM=bm, BN=bn, BK=bk,
                                                      STAGES=stages, WARPS=warps, num_warps=warps)
    return c, kernel


@gluon.jit
def _cvt_mma_step(q, s, acc, a_s, bars, i, U: gl.constexpr, STAGES: gl.constexpr, DECODE: gl.constexpr):
    """One K step of `rega_cvt_gemm_kernel`: decode q / s into four A fragments, wait for the step's activation
    stage, issue its four async wgmma."""
    st = i % STAGES
    sc = s.to(gl.float8e4nv, bitcast=True).to(gl.float16)
    w0, w1, w2, w3 = gl.inline_asm_elementwise(DECODE, "=r,=r,=r,=r,r,r", [q, sc],
                                               dtype=(gl.float16, gl.float16, gl.float16, gl.float16),
                                               is_pure=True, pack=2)
    mbarrier.wait(bars.index(st), (i // STAGES) & 1)
    a_t = a_s.index(st)
    acc = warpgroup_mma(w0, a_t.slice(0, U, 1).permute((1, 0)), acc, is_async=True)
    acc = warpgroup_mma(w1, a_t.slice(U, U, 1).permute((1, 0)), acc, is_async=True)
    acc = warpgroup_mma(w2, a_t.slice(2 * U, U, 1).permute((1, 0)), acc, is_async=True)
    return warpgroup_mma(w3, a_t.slice(3 * U, U, 1).permute((1, 0)), acc, is_async=True)


@gluon.jit
def rega_cvt_gemm_kernel(a_desc, q_ptr, s_ptr, g_ptr, c_ptr, M_PER, N, K, BM: gl.constexpr, BN: gl.constexpr,
                         BK: gl.constexpr, STAGES: gl.constexpr, WARPS: gl.constexpr, DECODE: gl.constexpr,
                         SYNC: gl.constexpr = 2, AHEAD: gl.constexpr = 1):
    """`rega_fp4_gemm_kernel` with nibble's e4m3-converter decode (fp4_tiles DEC 3, inline PTX: one word of 8
    codes -> 4 fp16 pairs) and fp16 MMAs: q int16 [N, K/4] (units of 4 codes), s uint8 e4m3 [N, K/16], g fp32
    [N] (global scale times 2^6 * 2^F16_X_SHIFT); a fp16 [M, K] staged by `stage_slices`, each BK chunk as 4
    slices of BK/4 (slice t holds the K positions 4u + t), so decode output t is the A operand of slice t's
    wgmma: four async wgmma per step. Grouped like an MoE layer's experts after sorting: program_id(2) is the
    expert, whose M_PER rows of a and c follow the previous expert's, and q, s, g hold [E, N, ...].

    SYNC is how the decode of step i + 1 is kept off the A registers of step i's wgmma: 0 not at all
    (the first version: with one step per iteration the PTX rewrites registers that running wgmma read, and
    tiles of 128 activation rows gave wrong results), 2 (default) every step's wgmma waited for before the next
    decode (as fast: other programs on the SM fill the wait), 16 two steps per loop iteration in different
    registers (benchmarks.md, thirty-seventh session, has the suspects `--check` ruled out).

    AHEAD: how many K steps ahead the weight and scale loads run (1 or 2; two were no faster at decode
    sizes)."""
    U: gl.constexpr = BK // 4
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, BM, 16])
    w_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_l, k_width=2)
    a_s = gl.allocate_shared_memory(gl.float16, [STAGES, BM, BK], a_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ex = gl.program_id(2)
    off_m = ex * M_PER + gl.program_id(0) * BM
    off_n = gl.program_id(1) * BN
    n_k = K // BK
    tma_ring_start(a_desc, a_s, bars, off_m, BM, BK, STAGES)
    rn = ex.to(gl.int64) * N + off_n + gl.arange(0, BN, layout=gl.SliceLayout(1, w_l))
    ru = gl.arange(0, U, layout=gl.SliceLayout(0, w_l))
    q_rows = q_ptr + rn.to(gl.int64)[:, None] * (K // 4) + ru[None, :]
    s_rows = s_ptr + rn.to(gl.int64)[:, None] * (K // 16) + (ru // 4)[None, :]
    q = gl.load(q_rows)
    s = gl.load(s_rows)
    if AHEAD == 2:
        more = (ru < (K - BK) // 4)[None, :]
        q1 = gl.load(q_rows + U, mask=more, other=0)
        s1 = gl.load(s_rows + U // 4, mask=more, other=0)
    acc = gl.zeros([BN, BM], gl.float32, acc_l)
    if SYNC & 16:
        # two K steps per iteration, so that the A fragments of consecutive steps are different registers: the
        # decode of step i + 1 must not write the registers step i's wgmma, still running, read (n_k even)
        for i in range(0, n_k, 2):
            acc = _cvt_mma_step(q, s, acc, a_s, bars, i, U, STAGES, DECODE)
            more = (ru < (K - (i + 1) * BK) // 4)[None, :]
            q = gl.load(q_rows + (i + 1) * U, mask=more, other=0)
            s = gl.load(s_rows + (i + 1) * (U // 4), mask=more, other=0)
            acc = warpgroup_mma_wait(4, deps=[acc])
            tma_ring_refill(a_desc, a_s, bars, off_m, i, n_k, BM, BK, STAGES)
            acc = _cvt_mma_step(q, s, acc, a_s, bars, i + 1, U, STAGES, DECODE)
            more = (ru < (K - (i + 2) * BK) // 4)[None, :]
            q = gl.load(q_rows + (i + 2) * U, mask=more, other=0)
            s = gl.load(s_rows + (i + 2) * (U // 4), mask=more, other=0)
            acc = warpgroup_mma_wait(4, deps=[acc])
            tma_ring_refill(a_desc, a_s, bars, off_m, i + 1, n_k, BM, BK, STAGES)
    for i in range(n_k if SYNC & 16 else 0, n_k):
        acc = _cvt_mma_step(q, s, acc, a_s, bars, i, U, STAGES, DECODE)
        more = (ru < (K - (i + AHEAD) * BK) // 4)[None, :]
        if AHEAD == 2:
            q = q1
            s = s1
            q1 = gl.load(q_rows + (i + 2) * U, mask=more, other=0)
            s1 = gl.load(s_rows + (i + 2) * (U // 4), mask=more, other=0)
        else:
            q = gl.load(q_rows + (i + 1) * U, mask=more, other=0)
            s = gl.load(s_rows + (i + 1) * (U // 4), mask=more, other=0)
        # SYNC 0 lets the four just issued run on (step i - 1's are done, so its stage takes step i + STAGES - 1)
        if SYNC & 2:
            acc = warpgroup_mma_wait(0, deps=[acc])
        else:
            acc = warpgroup_mma_wait(4, deps=[acc])
        tma_ring_refill(a_desc, a_s, bars, off_m, i, n_k, BM, BK, STAGES)
    acc = warpgroup_mma_wait(0, deps=[acc])
    store_transposed(acc, g_ptr + ex.to(gl.int64) * N, c_ptr, off_m, off_n, N, BM, BN, acc_l)


def stage_slices(a: torch.Tensor, bk: int) -> torch.Tensor:
    """a [M, K] -> fp16 [M, K] times 2^-F16_X_SHIFT, each BK chunk reordered into 4 slices: slice t, column u
    = a's column 4u + t of the chunk (the order of `rega_cvt_gemm_kernel`'s decode outputs)."""
    m, k = a.shape
    staged = a.view(m, k // bk, bk // 4, 4).transpose(2, 3).reshape(m, k)
    return (staged.float() * 2.0 ** -F16_X_SHIFT).to(torch.float16).contiguous()


def cvt_gemm(a16: torch.Tensor, q: torch.Tensor, s: torch.Tensor, g: torch.Tensor, bm: int = 256, bn: int = 64,
             bk: int = 64, warps: int = 4, stages: int = 3, sync: int = 2, poison: bool = False, ahead: int = 1):
    """a16 from `stage_slices(a, bk)` [E * M_PER, K], q int16 [E, N, K/4], s uint8 [E, N, K/16], g fp32 [E, N]
    (global scale * 2^6 * 2^F16_X_SHIFT; E = 1 for a dense layer) -> ([E * M_PER, N] bf16, the compiled
    kernel). poison: the output starts as NaN, so that an element no program writes shows."""
    m, k = a16.shape
    e, n = q.shape[0], q.shape[1]
    m_per = m // e
    if m % e or m_per % bm or n % bn or k % bk or bk % 64 or (sync & 16 and k // bk % 2):
        raise ValueError(f"gluon_fp4_probe: M / E, N, K = {m_per}, {n}, {k} must be multiples of {bm}, {bn}, {bk} "
                         f"(BK of 64)")
    if poison:
        c = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=a16.device)
    else:
        c = torch.empty(m, n, dtype=torch.bfloat16, device=a16.device)
    desc = TensorDescriptor.from_tensor(a16, [bm, bk], gl.NVMMASharedLayout.get_default_for([bm, bk], gl.float16))
    kernel = rega_cvt_gemm_kernel[(m_per // bm, n // bn, e)](desc, q, s, g, c, m_per, n, k, BM=bm, BN=bn, BK=bk,
                                                             STAGES=stages, WARPS=warps, DECODE=DECODE_F16_CVT.value,
                                                             SYNC=sync, AHEAD=ahead, num_warps=warps)
    return c, kernel


def check(args: argparse.Namespace) -> None:
    """Two converter-decode tiles that gave wrong results (V1 of the thirty-seventh session: every one with 128
    activation rows per tile but one) and two that did not, each three times on NaN-poisoned outputs with SYNC
    0, 2 and 16: relative error and NaN count per run, no timing."""
    from nibble.formats.nvfp4 import quantize_to_compute_form

    dev = torch.device("cuda")
    g = torch.Generator(dev).manual_seed(0)
    for e, m, n, k, tiles in ((1, 2048, 4096, 4096, ((64, 128, 128), (64, 256, 64))),
                              (256, 128, 2048, 3072, ((64, 128, 64), (64, 64, 64)))):
        a = torch.randn(e * m, k, device=dev, dtype=torch.bfloat16, generator=g)
        w = quantize_to_compute_form(torch.randn(e, n, k, device=dev, generator=g) * k ** -0.5)
        ref = torch.bmm(a.float().view(e, m, k), w.dequantize().transpose(1, 2)).reshape(e * m, n)
        q16, s8, g_cvt = w.packed.view(torch.int16), w.block_scale.view(torch.uint8), w.global_scale * CVT_ACC_SCALE
        for bn, bm, bk in tiles:
            a16 = stage_slices(a, bk)
            for sync in (0, 2, 16):
                runs = []
                for _ in range(3):
                    out, _kernel = cvt_gemm(a16, q16, s8, g_cvt, bm=bm, bn=bn, bk=bk, sync=sync, poison=True)
                    torch.cuda.synchronize()
                    nan = int(out.isnan().sum())
                    err = float((out.float().nan_to_num() - ref).norm() / ref.norm())
                    runs.append(f"err {err:.1e} nan {nan}")
                print(f"check {e} x {m}x{n}x{k} tile {bn}x{bm}x{bk} sync {sync}: {' | '.join(runs)}", flush=True)
        del w, ref


def grouped(args: argparse.Namespace) -> None:
    """The converter-decode kernel on E experts' weights [E, N, K], --m rows of activations each (balanced
    routing after sorting: 122B-A10B gate_up at 4096 tokens is E 256, M 128, N 2048, K 3072; at 256 tokens
    M 8)."""
    from nibble.formats.nvfp4 import quantize_to_compute_form

    dev = torch.device("cuda")
    g = torch.Generator(dev).manual_seed(0)
    e, m, n, k = args.experts, args.m, args.n, args.k
    a = torch.randn(e * m, k, device=dev, dtype=torch.bfloat16, generator=g)
    w = quantize_to_compute_form(torch.randn(e, n, k, device=dev, generator=g) * k ** -0.5)
    ref = torch.bmm(a.float().view(e, m, k), w.dequantize().transpose(1, 2)).reshape(e * m, n)
    q16, s8, g_cvt = w.packed.view(torch.int16), w.block_scale.view(torch.uint8), w.global_scale * CVT_ACC_SCALE
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    flops = 2 * e * m * n * k
    print(f"grouped {e} x {m}x{n}x{k}: {e * n * k * 9 // 16 / 1e6:.0f} MB of FP4 weights and block scales", flush=True)
    if m < 64:
        # decode sizes (--m pairs per expert): the tokens are the wgmma's N, as narrow as 8; the weights loaded
        # one or two K steps ahead
        tiles = [(bn, m, bk, wp, st, ahead) for ahead in (1, 2)
                 for bn, bk, wp, st in ((64, 64, 4, 4), (128, 64, 4, 4), (64, 128, 4, 3), (128, 128, 4, 3),
                                        (256, 64, 8, 4))]
    else:
        tiles = [(64, 128, 64, 4, 3, 1), (128, 128, 64, 4, 3, 1), (64, 128, 128, 4, 3, 1), (64, 64, 64, 4, 3, 1)]
    for bn, bm, bk, wp, st, ahead in tiles:
        kw = dict(bm=bm, bn=bn, bk=bk, warps=wp, stages=st, ahead=ahead, sync=args.sync)
        report_tile(f"grouped {e} x {m}x{n}x{k}, converter decode {bn}x{bm}x{bk} w{wp} s{st} ahead {ahead} "
                    f"sync {args.sync}",
                    lambda kw=kw: partial(cvt_gemm, stage_slices(a, kw["bk"]), q16, s8, g_cvt, **kw), ref, flops, flush)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, default=2048)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--only", default="", help="regular expression: time only the kernels whose names match")
    ap.add_argument("--experts", type=int, default=0,
                    help="instead: E grouped GEMMs of --m rows each, like an MoE layer's gate_up after sorting")
    ap.add_argument("--sync", type=int, default=2,
                    help="the converter-decode kernel's SYNC bits for the timed tiles (0: the racy original)")
    ap.add_argument("--check", action="store_true",
                    help="instead: the wrong tiles' results again, three runs each, with each synchronisation suspect")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gluon_fp4_probe: needs a CUDA GPU")
    if args.check:
        return check(args)
    if args.experts:
        return grouped(args)
    from nibble.formats.nvfp4 import quantize_to_compute_form
    from nibble.kernels.nvfp4_linear import nvfp4_linear_launch

    dev = torch.device("cuda")
    g = torch.Generator(dev).manual_seed(0)
    a = torch.randn(args.m, args.k, device=dev, dtype=torch.bfloat16, generator=g)
    w = quantize_to_compute_form(torch.randn(args.n, args.k, device=dev, generator=g) * args.k ** -0.5)
    scales = w.block_scale.float() * SCALE_BIAS
    gscale = w.global_scale * SCALE_BIAS
    w_bf16 = w.dequantize(torch.bfloat16)
    ref = a.float() @ w.dequantize().T
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    flops = 2 * args.m * args.n * args.k

    tiles = [(f"NVFP4 weights from registers {bn}x{bm}x{bk} w{wp} s{st}",
              dict(bm=bm, bn=bn, bk=bk, warps=wp, stages=st))
             for bn, bm, bk, wp, st in ((64, 256, 64, 4, 2), (64, 256, 64, 4, 3), (128, 256, 64, 8, 3),
                                        (128, 128, 64, 4, 3), (64, 128, 64, 4, 3), (64, 256, 32, 4, 4))]
    for name, kw in [t for t in tiles if re.search(args.only, t[0])]:
        report_tile(name, lambda kw=kw: partial(fp4_gemm, a, w.packed, scales, gscale, **kw), ref, flops, flush)
    q16, s8 = w.packed.view(torch.int16)[None], w.block_scale.view(torch.uint8)[None]
    g_cvt = (w.global_scale * CVT_ACC_SCALE)[None]
    cvt_tiles = [(f"NVFP4 weights from registers, converter decode {bn}x{bm}x{bk} w{wp} s{st} sync {args.sync}",
                  dict(bm=bm, bn=bn, bk=bk, warps=wp, stages=st, sync=args.sync))
                 for bn, bm, bk, wp, st in ((64, 256, 64, 4, 2), (64, 256, 64, 4, 3), (128, 256, 64, 8, 3),
                                            (64, 256, 128, 4, 2), (128, 128, 64, 4, 3), (64, 128, 128, 4, 3))]
    for name, kw in [t for t in cvt_tiles if re.search(args.only, t[0])]:
        report_tile(name, lambda kw=kw: partial(cvt_gemm, stage_slices(a, kw["bk"]), q16, s8, g_cvt, **kw), ref, flops,
                    flush)
    report("Triton nvfp4_linear (the table's tile)", lambda: nvfp4_linear_launch(a, w), ref, flops, flush)
    report("cuBLAS bf16 (weights prestored)", lambda: torch.matmul(a, w_bf16.T), ref, flops, flush)


if __name__ == "__main__":
    main()
