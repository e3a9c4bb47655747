"""Offline occupancy and wave counts of the NVFP4 MoE expert launches, with no GPU: each (model, T) call of
`fused_moe` is compiled for sm_90 through Triton's stand-in driver (tests/gpu/compile_offline.py), with the
tuning table a named GPU would use, and every launch is reported with its grid, registers and stack bytes per
thread (ptxas, through `cuobjdump -res-usage`; a non-zero stack where a register cap makes ptxas spill), shared
memory, the programs an SM holds at once and what bounds them, the waves the grid needs on the GPU's SMs, and
`cap+1`: the register cap (`gu_maxnreg` / `dn_maxnreg`) at which one more program would fit, where registers alone
bound it (try it with `--variant`: the stack column then shows whether ptxas spills). A grid just past a whole
number of waves leaves its last programs to run nearly alone.

    python benchmarks/moe_waves.py [--gpu nvidia_h200] [--models 122B,397B] [--tokens 1,2,3,4,8] \\
        [--variant NAME=JSON ...] [--sms 132]

Per-SM limits are those of compute capability 9.0 (65536 registers, allocated per warp in units of 256; 228 KB of
shared memory, 1 KB of it reserved per program; 64 warps; 32 programs). On the sorted path the grid's first
dimension is the alignment's upper bound on blocks (blocks past the real ones exit at once), so its waves are an
upper bound. Needs TRITON_INTERPRET unset and Triton's bundled CUDA tools (cuobjdump, ptxas).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "gpu"))

REGS_PER_SM, REG_UNIT, SMEM_PER_SM, SMEM_RESERVED, WARPS_PER_SM, PROGRAMS_PER_SM = 65536, 256, 233472, 1024, 64, 32


def _limits(regs: int, shared: int, warps: int) -> dict[str, int]:
    """Programs an sm_90 SM could hold by each of its resources, for a kernel of `regs` registers per thread,
    `shared` bytes of shared memory and `warps` warps per program."""
    per_warp = math.ceil(regs * 32 / REG_UNIT) * REG_UNIT
    return {"registers": (REGS_PER_SM // per_warp) // warps, "shared memory": SMEM_PER_SM // (shared + SMEM_RESERVED),
            "warps": WARPS_PER_SM // warps, "programs": PROGRAMS_PER_SM}


def programs_per_sm(regs: int, shared: int, warps: int) -> tuple[int, str]:
    """(programs an sm_90 SM holds at once, the resource that bounds them); arguments as `_limits`."""
    limits = _limits(regs, shared, warps)
    bound = min(limits, key=limits.get)
    return limits[bound], bound


def cap_for_one_more(regs: int, shared: int, warps: int) -> int | None:
    """The largest `maxnreg` at which an SM holds one more program than at `regs` registers per thread, where
    registers alone stand in the way (shared memory, warps and the program limit already allow it); else None.
    The split-32 down's cap of 128 (forty-seventh session) is this value for its 166-register, 8-warp tile."""
    limits = _limits(regs, shared, warps)
    n = limits.pop("registers")
    if min(limits.values()) <= n:
        return None
    per_warp = REGS_PER_SM // ((n + 1) * warps) // REG_UNIT * REG_UNIT
    cap = per_warp // 32
    return cap if cap >= 24 else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpu", default="nvidia_h200", help="tuning table name (nibble/kernels/tuning/<gpu>.json)")
    p.add_argument("--models", default="122B,397B")
    p.add_argument("--tokens", default="1,2,3,4,5,6,8,12,16")
    p.add_argument("--variant", action="append", default=[], help="NAME=JSON tuning fields over the table's choice")
    p.add_argument("--sms", type=int, default=132)
    args = p.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("unset TRITON_INTERPRET")
    from compile_offline import StandInDriver, compile_without_launch, resource_usage, zero_nvfp4
    from moe_bench import spec
    from triton.runtime import driver

    driver.set_active(StandInDriver(90))
    launches: list[tuple[str, Any, Any]] = []
    compile_without_launch(lambda name, kernel, grid: launches.append((name, kernel, grid)), with_grid=True)
    from nibble.kernels import fused_moe as fm
    from nibble.kernels import tuning_tables as tt
    from nibble.kernels.moe import MoEWeights, topk_counters

    tables = tt.named_tables(args.gpu, (9, 0))  # what an sm_90 GPU of that name lays over default.json
    fm.lookup = lambda op, _device, key: tt.lookup_tables(op, tables, key)
    fm.pdl_supported = fm.tma_supported = lambda _d: True
    # an sm_90 GPU's decode choice: the e4m3 converter where the table leaves `cvt_decode` on
    fm.decode_mode = lambda dtype, device=None: 3 if device is not None else 1
    variants = [("table", {})] + [(v.split("=", 1)[0], json.loads(v.split("=", 1)[1])) for v in args.variant]
    regs_of: dict[int, tuple[int, int]] = {}
    print(f"{'layer':6} {'T':>4} {'variant':10} {'kernel':24} {'grid':>12} {'regs':>5} {'stack':>5} {'smem KB':>8} "
          f"{'warps':>5} {'per SM':>6} {'bound':14} {'waves':>6} {'cap+1':>5}")
    for model in args.models.split(","):
        m = spec(model)
        h, inter, e, k = m["hidden"], m["inter"], m["experts"], m["top_k"]
        experts = MoEWeights(zero_nvfp4(e, 2 * inter, h), zero_nvfp4(e, h, inter), topk_counters(h, "cpu"),
                             num_routed_experts=m["routed"])
        for t in (int(x) for x in args.tokens.split(",")):
            ids = torch.randperm(m["routed"])[:k].repeat(t, 1).to(torch.int32)  # ids only shape the launches here
            for name, extra in variants:
                launches.clear()
                fm.fused_moe_launch(torch.randn(t, h, dtype=torch.bfloat16), torch.rand(t, k), ids, experts,
                                    config=extra)
                for kname, kernel, grid in launches:
                    if id(kernel) not in regs_of:
                        use = resource_usage(kernel)
                        regs_of[id(kernel)] = use["REG"], use.get("STACK", 0)
                    (regs, stack), md = regs_of[id(kernel)], kernel.metadata
                    per_sm, bound = programs_per_sm(regs, md.shared, md.num_warps)
                    total = math.prod(grid) if isinstance(grid, tuple) else 0
                    waves = total / (per_sm * args.sms) if total and per_sm else float("nan")
                    cap = cap_for_one_more(regs, md.shared, md.num_warps)
                    print(f"{model:6} {t:>4} {name:10} {kname:24} {'x'.join(map(str, grid)):>12} {regs:>5} {stack:>5} "
                          f"{md.shared / 1024:>8.1f} {md.num_warps:>5} {per_sm:>6} {bound:14} {waves:>6.2f} "
                          f"{cap if cap else '-':>5}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
