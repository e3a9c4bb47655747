"""Probe of Triton's Gluon dialect on this GPU (Hopper): does the installed Triton take a GEMM whose weights are
converted in registers, stored to shared memory and multiplied by an asynchronous wgmma that overlaps the next
step's conversion, and how fast is it against cuBLAS on the same bf16 weights?

    python benchmarks/gluon_probe.py [--m 2048 --n 4096 --k 4096]

The MoE prefill kernels (moe_w4.py) reach about a third of the bf16 GEMM rate: Triton waits for every wgmma,
whose A operand comes from registers, so the FP4 decode never overlaps the tensor cores (docs/benchmarks.md,
sixth and thirty-fifth sessions). Gluon schedules by hand: this probe's K loop converts int8 weights (a stand-in
for the FP4 decode) into one of two shared-memory buffers while the wgmma of the step before runs on the other
(`warpgroup_mma(is_async=True)`, then `warpgroup_mma_wait(1)`). It prints which Gluon names the installed Triton
has, the probe's error against torch, and its time against `torch.matmul` on prestored bf16 weights.
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def available() -> dict[str, bool]:
    """The Gluon names the probe and a Gluon MoE kernel would use, present or not in this Triton."""
    names = {}
    try:
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon.language.nvidia import hopper
    except ImportError:
        return {"triton.experimental.gluon": False}
    for mod, attrs in ((gl, ("BlockedLayout", "NVMMADistributedLayout", "NVMMASharedLayout", "SliceLayout",
                             "allocate_shared_memory", "warp_specialize", "barrier", "convert_layout")),
                       (hopper, ("warpgroup_mma", "warpgroup_mma_wait", "fence_async_shared", "tma", "mbarrier"))):
        for a in attrs:
            names[f"{mod.__name__.rsplit('.', 1)[-1]}.{a}"] = hasattr(mod, a)
    return names


def build():
    """The probe kernel (imported lazily: Gluon needs a GPU build of Triton)."""
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

    @gluon.jit
    def dq_gemm_kernel(a_ptr, w_ptr, s_ptr, c_ptr, M, N, K, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
                       WARPS: gl.constexpr):
        """c[M, N] = a[M, K] @ (w[N, K] * s[N, None])^T; a bf16, w int8, s fp32, c bf16; M, N, K multiples of
        the blocks."""
        ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [WARPS, 1], [1, 0])
        acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                        instr_shape=[16, BN, 16])
        a_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, BK], gl.bfloat16)
        b_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, BK], gl.bfloat16)
        a_s = gl.allocate_shared_memory(gl.bfloat16, [2, BM, BK], a_sl)
        b_s = gl.allocate_shared_memory(gl.bfloat16, [2, BN, BK], b_sl)
        rm = gl.program_id(0) * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, ld))
        rn = gl.program_id(1) * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, ld))
        rk = gl.arange(0, BK, layout=gl.SliceLayout(0, ld))
        acc = gl.zeros([BM, BN], gl.float32, acc_l)
        for k in range(0, K, BK):
            buf = (k // BK) % 2
            a = gl.load(a_ptr + rm.to(gl.int64)[:, None] * K + (k + rk)[None, :])
            w = gl.load(w_ptr + rn.to(gl.int64)[:, None] * K + (k + rk)[None, :])
            # the wgmma that read this buffer two steps ago is done: at most one is in flight here
            a_s.index(buf).store(a)
            b_s.index(buf).store(w.to(gl.bfloat16))
            fence_async_shared()
            gl.barrier()
            acc = warpgroup_mma(a_s.index(buf), b_s.index(buf).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(1, deps=[acc])
        acc = warpgroup_mma_wait(0, deps=[acc])
        cn = gl.program_id(1) * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, acc_l))
        cm = gl.program_id(0) * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, acc_l))
        out = acc * gl.load(s_ptr + cn)[None, :]
        gl.store(c_ptr + cm.to(gl.int64)[:, None] * N + cn[None, :], out.to(gl.bfloat16))

    return dq_gemm_kernel


def probe_gemm(a: torch.Tensor, w: torch.Tensor, s: torch.Tensor, bm: int = 128, bn: int = 128, bk: int = 64,
               warps: int = 4) -> torch.Tensor:
    """a [M, K] bf16, w [N, K] int8, s [N] fp32 -> [M, N] bf16 through the probe kernel."""
    m, k = a.shape
    n = w.shape[0]
    if m % bm or n % bn or k % bk:
        raise ValueError(f"gluon_probe: M, N, K = {m}, {n}, {k} must be multiples of {bm}, {bn}, {bk}")
    c = torch.empty(m, n, dtype=torch.bfloat16, device=a.device)
    build()[(m // bm, n // bn)](a, w, s, c, m, n, k, BM=bm, BN=bn, BK=bk, WARPS=warps, num_warps=warps)
    return c


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, default=2048)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--k", type=int, default=4096)
    args = ap.parse_args()
    import triton

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
    for bm, bn, bk, warps in ((128, 128, 64, 4), (64, 128, 64, 4), (128, 256, 64, 8), (128, 128, 64, 8)):
        try:
            out = probe_gemm(a, w, s, bm, bn, bk, warps)
            torch.cuda.synchronize()
            err = float((out.float() - ref).norm() / ref.norm())
            ms = cold_ms(partial(probe_gemm, a, w, s, bm, bn, bk, warps), 20, flush)
            print(f"probe {bm}x{bn}x{bk} w{warps}: {ms * 1e3:8.1f} us  {flops / ms / 1e9:6.0f} TFLOP/s  err {err:.1e}")
        except Exception as ex:  # a tile this Triton rejects is the probe's answer, not a reason to stop
            print(f"probe {bm}x{bn}x{bk} w{warps}: FAILED {type(ex).__name__}: {str(ex)[-400:]}")
    ms = cold_ms(lambda: torch.matmul(a, w_bf16.T), 20, flush)
    print(f"cuBLAS bf16 (weights prestored): {ms * 1e3:8.1f} us  {flops / ms / 1e9:6.0f} TFLOP/s")


if __name__ == "__main__":
    main()
