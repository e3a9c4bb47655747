"""Offline sm_90 compile of the MoE prefill tiles (thirty-fifth session): shared memory, registers and a few SASS
counts (HGMMA, wgmma waits, shared loads/stores, barriers) per kernel, for the 122B-A10B layer at 2048 tokens.

Needs Triton without a GPU and TRITON_INTERPRET unset; uses `StandInDriver`, `compile_without_launch` and
`zero_nvfp4` of tests/gpu/compile_offline.py.
`VARIANTS=<json of named tuning overrides>` (default: tok_variants.json beside this file, which needs
`tok_mode_experiment.diff` applied); arguments select variants by substring.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton
from triton.runtime import driver

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests/gpu")]

from compile_offline import StandInDriver, compile_without_launch, zero_nvfp4  # noqa: E402

from nibble.kernels import fused_moe as fm  # noqa: E402
from nibble.kernels.moe import MoEWeights  # noqa: E402

BIN = Path(triton.__file__).parent / "backends/nvidia/bin"
PREFILL = {"path": "sorted", "xmode": "perm", "block_t": 64, "gu_block_n": 128, "gu_block_k": 128, "gu_warps": 8,
           "gu_stages": 3, "dn_mode": "reduce", "dn_block_n": 128, "dn_block_k": 128, "dn_warps": 8, "dn_stages": 3,
           "chunk_pairs": 65536, "gu_tma": 1, "dn_tma": 1, "dec": 3}


def sass_stats(kernel) -> dict[str, str | int]:
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    sass = subprocess.run([BIN / "nvdisasm", "-c", f.name], capture_output=True, text=True).stdout
    res = subprocess.run([BIN / "cuobjdump", "-res-usage", f.name], capture_output=True, text=True).stdout
    os.unlink(f.name)
    m = re.search(r"REG:(\d+).*?STACK:(\d+)", res)
    count = {k: len(re.findall(p, sass)) for k, p in (("HGMMA", r"HGMMA"), ("wgmma waits", r"WARPGROUP\.DEPBAR"),
                                                      ("STS", r"\bSTS"), ("LDS", r"\bLDS"), ("BAR", r"\bBAR\."))}
    return {"regs": m.group(1) if m else "?", "stack": m.group(2) if m else "?", **count}


def main() -> None:
    driver.set_active(StandInDriver(90))

    def report(name: str, kernel) -> None:
        if "w4" in name:
            print(f"  {name}: smem {kernel.metadata.shared}, warps {kernel.metadata.num_warps}, {sass_stats(kernel)}")

    compile_without_launch(report)
    fm.pdl_supported = lambda _d: True
    fm.tma_supported = lambda _d: True
    h, inter, e, k, t = 3072, 1024, 256, 8, 2048
    experts = MoEWeights(zero_nvfp4(e, 2 * inter, h), zero_nvfp4(e, h, inter))
    variants = json.loads(Path(os.environ.get("VARIANTS", HERE / "tok_variants.json")).read_text())
    for name, cfg in [("table prefill tile", {}), *variants.items()]:
        if sys.argv[1:] and not any(s in name for s in sys.argv[1:]):
            continue
        print(f"== {name}")
        try:
            fm.fused_moe_launch(torch.randn(t, h, dtype=torch.bfloat16), torch.rand(t, k),
                                torch.zeros(t, k, dtype=torch.int32), experts, path="sorted",
                                config={**PREFILL, **cfg})
        except Exception as ex:  # a variant the compiler rejects is a result, not a reason to stop
            print(f"  FAILED {type(ex).__name__}: {str(ex)[-300:]}")


if __name__ == "__main__":
    main()
