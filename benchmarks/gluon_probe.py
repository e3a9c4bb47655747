"""Probe of Triton's Gluon dialect on this GPU (Hopper): can the installed Triton run a GEMM whose weights are
converted in registers, stored to shared memory and multiplied by asynchronous wgmma that overlaps the next
step's conversion, and how fast is it against cuBLAS on the same bf16 weights?

    python benchmarks/gluon_probe.py [--m 2048 --n 4096 --k 4096]

The MoE prefill kernels (moe_w4.py) reach about a third of the bf16 GEMM rate: Triton waits for every wgmma,
so the FP4 decode never overlaps the tensor cores (docs/benchmarks.md, sixth and thirty-fifth sessions). Gluon
schedules by hand. Two kernels convert int8 weights (a stand-in for the FP4 decode) into shared memory:
- `dq_gemm_kernel`, one partition: each step stores its tiles into one of two buffers, then issues an async
  wgmma and waits for the one before (`warpgroup_mma_wait(1)`). Offline (Triton 3.7.1, sm_90a), ptxas still
  serialises its wgmma (advisory C7515), as soon as the loop stores to shared memory;
- `ws_dq_gemm_kernel`, warp-specialised: a 4-warp producer partition loads, converts and stores the tiles of a
  STAGES-deep ring and signals an mbarrier; the 4-warp consumer partition only waits on it and issues the
  async wgmma. Offline, ptxas does not serialise it.
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
        warpgroup_mma,
        warpgroup_mma_wait,
    )
except ImportError as e:  # the probe's first answer: this Triton's Gluon lacks what a Hopper kernel needs
    sys.exit(f"gluon_probe: Triton {triton.__version__} has no usable Gluon for Hopper: {e}")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def available() -> dict[str, bool]:
    """The Gluon names the probe and a Gluon MoE kernel would use, present or not in this Triton."""
    names = {}
    for mod, attrs in ((gl, ("BlockedLayout", "NVMMADistributedLayout", "NVMMASharedLayout", "SliceLayout",
                             "allocate_shared_memory", "warp_specialize", "barrier", "convert_layout")),
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
        gl.barrier()
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
def ws_dq_gemm_kernel(a_ptr, w_ptr, s_ptr, c_ptr, M, N, K, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
                      STAGES: gl.constexpr):
    """`dq_gemm_kernel`'s product, warp-specialised: a 4-warp producer fills a STAGES-deep ring of converted
    tiles, the 4-warp consumer (launched with num_warps=4) runs the wgmma. Gluon's mbarrier.arrive is one
    arrival per partition (one elected thread after a partition barrier), hence the counts of 1."""
    a_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BM, BK],
                                    gl.NVMMASharedLayout.get_default_for([BM, BK], gl.bfloat16))
    b_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BN, BK],
                                    gl.NVMMASharedLayout.get_default_for([BN, BK], gl.bfloat16))
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for st in gl.static_range(STAGES):
        mbarrier.init(ready.index(st), count=1)
        mbarrier.init(empty.index(st), count=1)
    gl.warp_specialize([(_ws_consumer, (a_s, b_s, ready, empty, s_ptr, c_ptr, N, K, BM, BN, BK, STAGES)),
                        (_ws_producer, (a_ptr, w_ptr, a_s, b_s, ready, empty, K, BM, BN, BK, STAGES))], [4], [232])


def probe_gemm(a: torch.Tensor, w: torch.Tensor, s: torch.Tensor, bm: int = 128, bn: int = 128, bk: int = 64,
               warps: int = 4, ws: bool = False, stages: int = 3):
    """a [M, K] bf16, w [N, K] int8, s [N] fp32 -> ([M, N] bf16, the compiled kernel) through a probe kernel
    (ws: the warp-specialised one, whose consumer has 4 warps)."""
    m, k = a.shape
    n = w.shape[0]
    if m % bm or n % bn or k % bk:
        raise ValueError(f"gluon_probe: M, N, K = {m}, {n}, {k} must be multiples of {bm}, {bn}, {bk}")
    c = torch.empty(m, n, dtype=torch.bfloat16, device=a.device)
    grid = (m // bm, n // bn)
    if ws:
        kernel = ws_dq_gemm_kernel[grid](a, w, s, c, m, n, k, BM=bm, BN=bn, BK=bk, STAGES=stages, num_warps=4)
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, default=2048)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--k", type=int, default=4096)
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
    for name, kw in tiles:
        try:
            out, kernel = probe_gemm(a, w, s, **kw)
            torch.cuda.synchronize()
            err = float((out.float() - ref).norm() / ref.norm())
            ms = cold_ms(partial(probe_gemm, a, w, s, **kw), 20, flush)
            print(f"{name}: {ms * 1e3:8.1f} us  {flops / ms / 1e9:6.0f} TFLOP/s  err {err:.1e}  wgmma "
                  f"{serialised(kernel)}", flush=True)
        except Exception as ex:  # a tile this Triton rejects is the probe's answer, not a reason to stop
            print(f"{name}: FAILED {type(ex).__name__}: {str(ex)[-400:]}", flush=True)
    ms = cold_ms(lambda: torch.matmul(a, w_bf16.T), 20, flush)
    print(f"cuBLAS bf16 (weights prestored): {ms * 1e3:8.1f} us  {flops / ms / 1e9:6.0f} TFLOP/s")


if __name__ == "__main__":
    main()
