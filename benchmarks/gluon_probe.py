"""Probe of Triton's Gluon dialect on this GPU (Hopper): can the installed Triton run a GEMM whose weights are
converted in registers and multiplied by asynchronous wgmma that overlaps the next step's conversion, and how
fast is it against cuBLAS on the same bf16 weights?

    python benchmarks/gluon_probe.py [--m 2048 --n 4096 --k 4096] [--only REGEX]

The MoE prefill kernels (moe_w4.py) reach about a third of the bf16 GEMM rate: Triton waits for every wgmma,
so the FP4 decode never overlaps the tensor cores (docs/benchmarks.md, sixth and thirty-fifth sessions). Gluon
schedules by hand. Three kernels convert int8 weights (a stand-in for the FP4 decode):
- `dq_gemm_kernel`, one partition: each step stores its converted tiles into one of two shared-memory buffers,
  then issues an async wgmma and waits for the one before (`warpgroup_mma_wait(1)`). ptxas serialises its
  wgmma (advisory C7515) as soon as the loop stores to shared memory;
- `ws_dq_gemm_kernel`, warp-specialised: a producer partition loads, converts and stores the tiles of a
  STAGES-deep ring and signals an mbarrier (optionally with the next step's loads in flight); the 4-warp
  consumer partition only waits on it and issues the async wgmma, which ptxas leaves asynchronous;
- `rega_gemm_kernel`, one partition turned around: the converted weights are the wgmma's A operand straight
  from registers, the activations arrive by TMA, so no thread stores to shared memory and the wgmma stays
  asynchronous. On an H100 (Triton 3.6) it reached 54% of cuBLAS, the other two about a third
  (docs/benchmarks.md, thirty-sixth session).
Per kernel and tile it prints whether ptxas serialises the wgmma here, the error against torch and the time
against `torch.matmul` on prestored bf16 weights, after the Gluon names the installed Triton has.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from functools import partial
from pathlib import Path

import torch
import triton

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia import hopper
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError as e:  # the probe's first answer: this Triton's Gluon lacks what a Hopper kernel needs
    sys.exit(f"gluon_probe: Triton {triton.__version__} has no usable Gluon for Hopper: {e}")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# the CTA-wide barrier: `barrier` from Triton 3.7, `thread_barrier` in 3.6
cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier


def available() -> dict[str, bool]:
    """The Gluon names the probe and a Gluon MoE kernel would use, present or not in this Triton."""
    names = {}
    for mod, attrs in ((gl, ("BlockedLayout", "NVMMADistributedLayout", "NVMMASharedLayout", "SliceLayout",
                             "allocate_shared_memory", "warp_specialize", "barrier", "thread_barrier",
                             "convert_layout")),
                       (hopper, ("warpgroup_mma", "warpgroup_mma_wait", "fence_async_shared", "tma", "mbarrier"))):
        for a in attrs:
            names[f"{mod.__name__.rsplit('.', 1)[-1]}.{a}"] = hasattr(mod, a)
    return names


@gluon.jit
def _store_out(acc, s_ptr, c_ptr, N, BM: gl.constexpr, BN: gl.constexpr, acc_l: gl.constexpr):
    cm = gl.program_id(0) * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, acc_l))
    cn = gl.program_id(1) * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, acc_l))
    out = acc * gl.load(s_ptr + cn)[None, :]
    gl.store(c_ptr + cm.to(gl.int64)[:, None] * N + cn[None, :], out.to(gl.bfloat16))


@gluon.jit
def dq_gemm_kernel(a_ptr, w_ptr, s_ptr, c_ptr, M, N, K, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
                   WARPS: gl.constexpr):
    """c[M, N] = a[M, K] @ (w[N, K] * s[N, None])^T; a bf16, w int8, s fp32, c bf16; M, N, K multiples of the
    blocks. One partition, two buffers, the next step's tiles loaded while this step's wgmma runs."""
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [WARPS, 1], [1, 0])
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, BN, 16])
    a_s = gl.allocate_shared_memory(gl.bfloat16, [2, BM, BK], gl.NVMMASharedLayout.get_default_for([BM, BK],
                                                                                                    gl.bfloat16))
    b_s = gl.allocate_shared_memory(gl.bfloat16, [2, BN, BK], gl.NVMMASharedLayout.get_default_for([BN, BK],
                                                                                                    gl.bfloat16))
    rm = gl.program_id(0) * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, ld))
    rn = gl.program_id(1) * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, ld))
    rk = gl.arange(0, BK, layout=gl.SliceLayout(0, ld))
    a_rows = a_ptr + rm.to(gl.int64)[:, None] * K + rk[None, :]
    w_rows = w_ptr + rn.to(gl.int64)[:, None] * K + rk[None, :]
    acc = gl.zeros([BM, BN], gl.float32, acc_l)
    a = gl.load(a_rows)
    w = gl.load(w_rows)
    for k in range(0, K, BK):
        buf = (k // BK) % 2
        # the wgmma that read this buffer two steps ago is done: at most one is in flight here
        a_s.index(buf).store(a)
        b_s.index(buf).store(w.to(gl.bfloat16))
        fence_async_shared()
        cta_barrier()
        acc = warpgroup_mma(a_s.index(buf), b_s.index(buf).permute((1, 0)), acc, is_async=True)
        more = (rk < K - k - BK)[None, :]
        a = gl.load(a_rows + k + BK, mask=more, other=0.0)
        w = gl.load(w_rows + k + BK, mask=more, other=0)
        acc = warpgroup_mma_wait(1, deps=[acc])
    acc = warpgroup_mma_wait(0, deps=[acc])
    _store_out(acc, s_ptr, c_ptr, N, BM, BN, acc_l)


@gluon.jit
def _ws_consumer(a_s, b_s, ready, empty, s_ptr, c_ptr, N, K, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
                 STAGES: gl.constexpr):
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
    acc = gl.zeros([BM, BN], gl.float32, acc_l)
    for i in range(K // BK):
        st = i % STAGES
        mbarrier.wait(ready.index(st), (i // STAGES) & 1)
        acc = warpgroup_mma(a_s.index(st), b_s.index(st).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(1, deps=[acc])
        # the previous step's wgmma is done: the producer may refill its stage
        mbarrier.arrive(empty.index((i + STAGES - 1) % STAGES), pred=i > 0)
    acc = warpgroup_mma_wait(0, deps=[acc])
    _store_out(acc, s_ptr, c_ptr, N, BM, BN, acc_l)


@gluon.jit
def _ws_producer(a_ptr, w_ptr, a_s, b_s, ready, empty, K, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
                 STAGES: gl.constexpr):
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    rm = gl.program_id(0) * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, ld))
    rn = gl.program_id(1) * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, ld))
    rk = gl.arange(0, BK, layout=gl.SliceLayout(0, ld))
    for i in range(K // BK):
        st = i % STAGES
        # a stage's first fill needs no wait; later fills wait for the consumer's release of its last use
        mbarrier.wait(empty.index(st), ((i // STAGES) & 1) ^ 1, pred=i >= STAGES)
        a = gl.load(a_ptr + rm.to(gl.int64)[:, None] * K + (i * BK + rk)[None, :])
        w = gl.load(w_ptr + rn.to(gl.int64)[:, None] * K + (i * BK + rk)[None, :])
        a_s.index(st).store(a)
        b_s.index(st).store(w.to(gl.bfloat16))
        fence_async_shared()
        mbarrier.arrive(ready.index(st))


@gluon.jit
def _ws_producer_pf(a_ptr, w_ptr, a_s, b_s, ready, empty, K, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
                    STAGES: gl.constexpr, PW: gl.constexpr):
    """`_ws_producer` with PW warps that issues step i + 1's loads before it waits for and fills step i's stage:
    the plain producer has one load in flight, so its loop runs at one global-memory latency a step."""
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [PW, 1], [1, 0])
    rm = gl.program_id(0) * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, ld))
    rn = gl.program_id(1) * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, ld))
    rk = gl.arange(0, BK, layout=gl.SliceLayout(0, ld))
    a_rows = a_ptr + rm.to(gl.int64)[:, None] * K + rk[None, :]
    w_rows = w_ptr + rn.to(gl.int64)[:, None] * K + rk[None, :]
    a = gl.load(a_rows)
    w = gl.load(w_rows)
    for i in range(K // BK):
        st = i % STAGES
        more = (rk < K - (i + 1) * BK)[None, :]
        a_next = gl.load(a_rows + (i + 1) * BK, mask=more, other=0.0)
        w_next = gl.load(w_rows + (i + 1) * BK, mask=more, other=0)
        mbarrier.wait(empty.index(st), ((i // STAGES) & 1) ^ 1, pred=i >= STAGES)
        a_s.index(st).store(a)
        b_s.index(st).store(w.to(gl.bfloat16))
        fence_async_shared()
        mbarrier.arrive(ready.index(st))
        a = a_next
        w = w_next


@gluon.jit
def ws_dq_gemm_kernel(a_ptr, w_ptr, s_ptr, c_ptr, M, N, K, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
                      STAGES: gl.constexpr, PREFETCH: gl.constexpr = False, PW: gl.constexpr = 4):
    """`dq_gemm_kernel`'s product, warp-specialised: a 4-warp producer fills a STAGES-deep ring of converted
    tiles, the 4-warp consumer (launched with num_warps=4) runs the wgmma. Gluon's mbarrier.arrive is one
    arrival per partition (one elected thread after a partition barrier), hence the counts of 1. PREFETCH: the
    producer `_ws_producer_pf` with PW warps instead."""
    a_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BM, BK],
                                    gl.NVMMASharedLayout.get_default_for([BM, BK], gl.bfloat16))
    b_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BN, BK],
                                    gl.NVMMASharedLayout.get_default_for([BN, BK], gl.bfloat16))
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for st in gl.static_range(STAGES):
        mbarrier.init(ready.index(st), count=1)
        mbarrier.init(empty.index(st), count=1)
    if PREFETCH:
        gl.warp_specialize([(_ws_consumer, (a_s, b_s, ready, empty, s_ptr, c_ptr, N, K, BM, BN, BK, STAGES)),
                            (_ws_producer_pf, (a_ptr, w_ptr, a_s, b_s, ready, empty, K, BM, BN, BK, STAGES, PW))],
                           [PW], [232 if PW == 4 else 152])
    else:
        gl.warp_specialize([(_ws_consumer, (a_s, b_s, ready, empty, s_ptr, c_ptr, N, K, BM, BN, BK, STAGES)),
                            (_ws_producer, (a_ptr, w_ptr, a_s, b_s, ready, empty, K, BM, BN, BK, STAGES))], [4], [232])


@gluon.jit
def tma_ring_start(a_desc, a_s, bars, off_m, BM: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr):
    """Arm the STAGES mbarriers of the activation ring a_s [STAGES, BM, BK] (16-bit) and ask TMA for the
    tiles of the first STAGES - 1 K steps of rows off_m.."""
    for j in gl.static_range(STAGES):
        mbarrier.init(bars.index(j), count=1)
    for j in gl.static_range(STAGES - 1):
        mbarrier.expect(bars.index(j), BM * BK * 2)
        tma.async_copy_global_to_shared(a_desc, [off_m, j * BK], bars.index(j), a_s.index(j))


@gluon.jit
def tma_ring_refill(a_desc, a_s, bars, off_m, i, n_k, BM: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr):
    """After step i's wait for the wgmma of step i - 1: its stage takes the tile of step i + STAGES - 1."""
    nxt = i + STAGES - 1
    if nxt < n_k:
        mbarrier.expect(bars.index(nxt % STAGES), BM * BK * 2)
        tma.async_copy_global_to_shared(a_desc, [off_m, nxt * BK], bars.index(nxt % STAGES), a_s.index(nxt % STAGES))


@gluon.jit
def store_transposed(acc, row_scale_ptr, c_ptr, off_m, off_n, N, BM: gl.constexpr, BN: gl.constexpr,
                     acc_l: gl.constexpr):
    """c[off_m + m, off_n + n] = acc[n, m] * row_scale[off_n + n] in bf16, for the weight-rows-by-tokens tiles."""
    cn = off_n + gl.arange(0, BN, layout=gl.SliceLayout(1, acc_l))
    cm = off_m + gl.arange(0, BM, layout=gl.SliceLayout(0, acc_l))
    out = acc * gl.load(row_scale_ptr + cn)[:, None]
    gl.store(c_ptr + cm.to(gl.int64)[None, :] * N + cn[:, None], out.to(gl.bfloat16))


@gluon.jit
def rega_gemm_kernel(a_desc, w_ptr, s_ptr, c_ptr, M, N, K, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
                     STAGES: gl.constexpr, WARPS: gl.constexpr):
    """The same product turned around, c^T[BN, BM] = (w * s) @ a^T per tile: the converted weights are the wgmma's
    A operand straight from registers and a's tiles arrive by TMA in a STAGES-deep ring, so no thread stores to
    shared memory; the next step's weights load while this step's wgmma runs."""
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
    w_rows = w_ptr + rn.to(gl.int64)[:, None] * K + rk[None, :]
    w = gl.load(w_rows)
    acc = gl.zeros([BN, BM], gl.float32, acc_l)
    for i in range(n_k):
        st = i % STAGES
        mbarrier.wait(bars.index(st), (i // STAGES) & 1)
        acc = warpgroup_mma(w.to(gl.bfloat16), a_s.index(st).permute((1, 0)), acc, is_async=True)
        w = gl.load(w_rows + (i + 1) * BK, mask=(rk < K - (i + 1) * BK)[None, :], other=0)
        # all of it: the next step's A fragments are written into the registers this wgmma reads (thirty-seventh
        # session, `rega_cvt_gemm_kernel`; waiting for one step less was a race)
        acc = warpgroup_mma_wait(0, deps=[acc])
        tma_ring_refill(a_desc, a_s, bars, off_m, i, n_k, BM, BK, STAGES)
    acc = warpgroup_mma_wait(0, deps=[acc])
    store_transposed(acc, s_ptr, c_ptr, off_m, off_n, N, BM, BN, acc_l)


def probe_gemm(a: torch.Tensor, w: torch.Tensor, s: torch.Tensor, bm: int = 128, bn: int = 128, bk: int = 64,
               warps: int = 4, ws: bool = False, stages: int = 3, prefetch: bool = False, pw: int = 4,
               rega: bool = False):
    """a [M, K] bf16, w [N, K] int8, s [N] fp32 -> ([M, N] bf16, the compiled kernel) through a probe kernel
    (ws: the warp-specialised one, whose consumer has 4 warps; prefetch: its producer with pw warps and the next
    step's loads in flight; rega: `rega_gemm_kernel`, bm tokens by bn weight rows per program)."""
    m, k = a.shape
    n = w.shape[0]
    if m % bm or n % bn or k % bk:
        raise ValueError(f"gluon_probe: M, N, K = {m}, {n}, {k} must be multiples of {bm}, {bn}, {bk}")
    c = torch.empty(m, n, dtype=torch.bfloat16, device=a.device)
    grid = (m // bm, n // bn)
    if rega:
        desc = TensorDescriptor.from_tensor(a, [bm, bk], gl.NVMMASharedLayout.get_default_for([bm, bk], gl.bfloat16))
        kernel = rega_gemm_kernel[grid](desc, w, s, c, m, n, k, BM=bm, BN=bn, BK=bk, STAGES=stages, WARPS=warps,
                                        num_warps=warps)
    elif ws:
        kernel = ws_dq_gemm_kernel[grid](a, w, s, c, m, n, k, BM=bm, BN=bn, BK=bk, STAGES=stages, PREFETCH=prefetch,
                                           PW=pw, num_warps=4)
    else:
        kernel = dq_gemm_kernel[grid](a, w, s, c, m, n, k, BM=bm, BN=bn, BK=bk, WARPS=warps, num_warps=warps)
    return c, kernel


def serialised(kernel) -> str:
    """What this Triton's ptxas says of the kernel's wgmma: 'serialised' (advisory C7515) or 'async'."""
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(kernel.asm["ptx"])
    ptxas = Path(triton.__file__).parent / "backends/nvidia/bin/ptxas"
    arch = re.search(r"\.target\s+(sm_\w+)", kernel.asm["ptx"])
    res = subprocess.run([str(ptxas), "-v", f"--gpu-name={arch.group(1) if arch else 'sm_90a'}", f.name, "-o",
                          f.name + ".o"], capture_output=True, text=True)
    return "serialised" if "C7515" in res.stdout + res.stderr else "async"


def report(name: str, run, ref: torch.Tensor, flops: int, flush: torch.Tensor) -> None:
    """Print run()'s median cold-L2 time, TFLOP/s and relative error against ref; run returns the output, or
    (output, compiled kernel) for a probe kernel, whose wgmma ptxas verdict is printed too."""
    from nibble.bench.gpu_timing import cold_ms

    res = run()
    out, kernel = res if isinstance(res, tuple) else (res, None)
    torch.cuda.synchronize()
    err = float((out.float() - ref).norm() / ref.norm())
    ms = cold_ms(run, 20, flush)
    verdict = f"  wgmma {serialised(kernel)}" if kernel is not None else ""
    print(f"{name}: {ms * 1e3:8.1f} us  {flops / ms / 1e9:6.0f} TFLOP/s  err {err:.1e}{verdict}", flush=True)


def report_tile(name: str, make_run, ref: torch.Tensor, flops: int, flush: torch.Tensor) -> None:
    """`report` of one probe tile, whose timed callable make_run() builds (set-up such as staging activations
    stays untimed); a tile this Triton rejects is the probe's answer, printed, not a reason to stop."""
    try:
        report(name, make_run(), ref, flops, flush)
    except Exception as ex:
        print(f"{name}: FAILED {type(ex).__name__}: {str(ex)[-400:]}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, default=2048)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--only", default="", help="regular expression: time only the kernels whose names match")
    args = ap.parse_args()
    print(f"triton {triton.__version__}")
    for name, ok in available().items():
        print(f"  {name}: {'yes' if ok else 'MISSING'}")
    if not torch.cuda.is_available():
        sys.exit("gluon_probe: the GEMM part needs a CUDA GPU")
    from nibble.bench.gpu_timing import cold_ms

    dev = torch.device("cuda")
    g = torch.Generator(dev).manual_seed(0)
    a = torch.randn(args.m, args.k, device=dev, dtype=torch.bfloat16, generator=g)
    w = torch.randint(-8, 8, (args.n, args.k), device=dev, dtype=torch.int8, generator=g)
    s = torch.rand(args.n, device=dev, generator=g) * 0.01 + 0.001
    w_bf16 = (w.float() * s[:, None]).to(torch.bfloat16)
    ref = a.float() @ (w.float() * s[:, None]).T
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    flops = 2 * args.m * args.n * args.k
    tiles = [(f"one partition {bm}x{bn}x{bk} w{wp}", dict(bm=bm, bn=bn, bk=bk, warps=wp))
             for bm, bn, bk, wp in ((128, 128, 64, 4), (64, 128, 64, 4), (128, 256, 64, 8), (128, 128, 64, 8))]
    tiles += [(f"warp-specialised {bm}x{bn}x{bk} s{st}", dict(bm=bm, bn=bn, bk=bk, ws=True, stages=st))
              for bm, bn, bk, st in ((64, 128, 64, 3), (64, 256, 64, 3), (128, 128, 64, 3), (64, 128, 64, 4))]
    tiles += [(f"warp-specialised, prefetching producer of {pw} warps {bm}x{bn}x{bk} s{st}",
               dict(bm=bm, bn=bn, bk=bk, ws=True, stages=st, prefetch=True, pw=pw))
              for bm, bn, bk, st, pw in ((128, 128, 64, 3, 4), (128, 128, 64, 4, 4), (64, 256, 64, 3, 4),
                                         (128, 128, 64, 3, 8), (64, 256, 64, 4, 8), (128, 128, 128, 2, 4))]
    tiles += [(f"weights from registers, tokens by TMA {bn}x{bm}x{bk} w{wp} s{st}",
               dict(bm=bm, bn=bn, bk=bk, warps=wp, stages=st, rega=True))
              for bn, bm, bk, wp, st in ((128, 128, 64, 4, 3), (128, 128, 64, 4, 4), (128, 256, 64, 8, 3),
                                         (64, 256, 64, 4, 3), (128, 128, 128, 4, 3), (256, 128, 64, 8, 3),
                                         (64, 256, 64, 4, 2), (64, 256, 64, 4, 4), (64, 128, 64, 4, 3),
                                         (128, 256, 64, 8, 4), (64, 256, 32, 4, 4))]
    for name, kw in [t for t in tiles if re.search(args.only, t[0])]:
        report_tile(name, lambda kw=kw: partial(probe_gemm, a, w, s, **kw), ref, flops, flush)
    ms = cold_ms(lambda: torch.matmul(a, w_bf16.T), 20, flush)
    print(f"cuBLAS bf16 (weights prestored): {ms * 1e3:8.1f} us  {flops / ms / 1e9:6.0f} TFLOP/s")


if __name__ == "__main__":
    main()
