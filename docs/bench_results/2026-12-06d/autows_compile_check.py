"""Offline sm_90 compile of the MoE kernels with `warp_specialize` on their K loops (thirty-fourth session).

Needs `autows_experiment.diff` applied (tuning fields gu_ws / dn_ws), Triton without a GPU, TRITON_INTERPRET
unset; uses `StandInDriver`, `compile_without_launch` and `zero_nvfp4` of tests/gpu/compile_offline.py. Prints,
per tile and flag, what compiled (shared memory, warps) or the compiler's failure.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from triton.runtime import driver

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT), str(ROOT / "tests/gpu")]

from compile_offline import StandInDriver, compile_without_launch, zero_nvfp4  # noqa: E402

from nibble.kernels import fused_moe as fm  # noqa: E402
from nibble.kernels.moe import MoEWeights  # noqa: E402


def main() -> None:
    driver.set_active(StandInDriver(90))

    def report(name: str, kernel) -> None:
        ptx = kernel.asm["ptx"]
        print(f"  compiled {name}: smem {kernel.metadata.shared}, warps {kernel.metadata.num_warps}, "
              f"cp.async {ptx.count('cp.async')}, mbarrier {ptx.count('mbarrier')}")

    compile_without_launch(report)
    fm.pdl_supported = lambda _d: True
    fm.tma_supported = lambda _d: True
    h, inter, e, k = 3072, 1024, 256, 8
    experts = MoEWeights(zero_nvfp4(e, 2 * inter, h), zero_nvfp4(e, h, inter))
    small = {"path": "gemv", "xmode": "quad", "block_t": 2, "gu_block_n": 16, "gu_block_k": 256, "gu_warps": 2,
             "gu_stages": 4, "dn_mode": "fused", "dn_block_n": 32, "dn_block_k": 256, "dn_warps": 2, "dn_stages": 3,
             "chunk_pairs": 65536, "dec": 3}
    big = {"path": "sorted", "xmode": "split", "block_t": 16, "gu_block_n": 64, "gu_block_k": 256, "gu_warps": 8,
           "gu_stages": 3, "dn_mode": "reduce", "dn_block_n": 128, "dn_block_k": 256, "dn_warps": 8, "dn_stages": 3,
           "chunk_pairs": 65536, "gu_tma": 2, "dec": 3}
    four = {"gu_warps": 4, "dn_warps": 4}
    cases = [("pairs", small, 1), ("pairs, 4 warps", {**small, **four}, 1), ("sorted", big, 256),
             ("sorted, 4 warps, pointers", {**big, **four, "gu_tma": 0}, 256),
             ("sorted, 4 warps, TMA", {**big, **four, "dn_tma": 2}, 256)]
    for name, cfg, t in cases:
        for ws in ({"gu_ws": True}, {"dn_ws": True}):
            print(f"== {name} {ws}")
            try:
                fm.fused_moe_launch(torch.randn(t, h, dtype=torch.bfloat16), torch.rand(t, k),
                                    torch.zeros(t, k, dtype=torch.int32), experts, path=cfg["path"],
                                    config={**cfg, **ws})
            except Exception as ex:
                print(f"  FAILED {type(ex).__name__}: {str(ex)[-200:]}")


if __name__ == "__main__":
    main()
