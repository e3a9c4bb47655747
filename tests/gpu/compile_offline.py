"""Compile every Triton kernel variant the wrappers launch (tuning-table configurations, bf16, NVFP4 and
dense experts, FP8 native and software paths) for a CUDA target WITHOUT a GPU, and report shared memory
per kernel. Catches GPU-only compile errors and shared-memory overflows before spending device time.

    python tests/gpu/compile_offline.py 90 80 100     # compute capabilities (default 90)
    python tests/gpu/compile_offline.py 90 --ptxas    # also list the kernels whose wgmma ptxas serialises
    python tests/gpu/compile_offline.py 90 --sass     # also list GPU-scope barriers and local-memory spills

`--ptxas` (sm_90 only) runs Triton's ptxas with -v on each distinct kernel and lists those it reports as
serialising their wgmma (advisory C7515: every Hopper MMA waited for; the MoE down kernel had it once).
`--sass` reads each distinct kernel's SASS (nvdisasm) and lists those with GPU-scope barriers (Triton's atomics
default to acq_rel and fence every one: the MoE alignment's counting atomics ran one after another so) or
local-memory spills (LDL/STL), with the launch that first compiled them.

Relies on Triton internals (a stand-in driver and `JITFunction.run(warmup=True)`), checked with Triton
3.7; TRITON_INTERPRET must be unset.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
# device tables and the compute capability they are selected on
TABLE_CC = {"nvidia_h200": 90, "nvidia_h100_80gb_hbm3": 90}
SMEM_LIMIT_KB = {80: 163, 86: 99, 89: 99, 90: 227, 100: 227, 120: 99}


class StandInDriver:
    """Triton's active driver without a GPU: compiles for CUDA compute capability `cc` (settable between
    compilations), on the current "device" 0 and stream 0."""

    def __init__(self, cc: int) -> None:
        self.cc = cc

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", self.cc, 32)

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")

    def get_device_interface(self):
        return torch.cuda


def compile_without_launch(on_compiled: Callable[..., None], with_grid: bool = False) -> None:
    """From now on every Triton launch compiles its kernel (as a warm-up) instead of running it, and hands the
    kernel's name and the compiled kernel to `on_compiled` (with_grid: and the launch's grid, a third argument).
    Set the stand-in driver first."""
    from triton.runtime.jit import JITFunction

    run = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        on_compiled(self.fn.__name__, kernel, *((grid,) if with_grid else ()))
        return kernel

    JITFunction.run = compile_only


def zero_nvfp4(*shape: int):
    """An all-zero NVFP4Tensor of logical shape [..., N, K] on the CPU (compile-only launches read nothing)."""
    from nibble.formats.nvfp4 import NVFP4Tensor

    *lead, n, k = shape
    return NVFP4Tensor(torch.zeros(*lead, n, k // 2, dtype=torch.uint8),
                       torch.zeros(*lead, n, k // 16, dtype=torch.float8_e4m3fn), torch.ones(*lead, n))


def main() -> int:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("unset TRITON_INTERPRET")
    from triton.runtime import driver

    scan_ptxas = "--ptxas" in sys.argv[1:]
    scan_sass = "--sass" in sys.argv[1:]
    ccs = [int(a) for a in sys.argv[1:] if a not in ("--ptxas", "--sass")] or [90]
    target = StandInDriver(ccs[0])
    driver.set_active(target)
    compiled: list[tuple[str, object, str]] = []  # (kernel name, compiled kernel, the `attempt` that launched it)
    current = {"attempt": ""}
    compile_without_launch(lambda name, kernel: compiled.append((name, kernel, current["attempt"])))

    import nibble.kernels._triton as tri
    from nibble.kernels import activation, attention, conv1d, gated_delta, gdn_gating, moe_align, moe_route, norm, rope
    from nibble.kernels import dense_gemv as dl
    from nibble.kernels import fused_moe as fm
    from nibble.kernels import nvfp4_linear as nl
    from nibble.kernels import paged_attention as pa
    from nibble.kernels.moe import MoEWeights, topk_counters
    from nibble.kernels.tuning_tables import TUNING_DIR, table_names

    bf = torch.bfloat16
    # default.json first (it applies everywhere); a device's table only for that device's compute capability
    paths = [TUNING_DIR / f"{name}.json" for name in table_names()]
    table_cc = {p.stem: TABLE_CC.get(p.stem) for p in paths}
    all_tables = [(p.stem, json.loads(p.read_text())) for p in paths]
    errors: list[tuple[str, str]] = []

    def attempt(name: str, fn: Callable[..., object], *args, **kwargs) -> None:
        current["attempt"] = name
        try:
            fn(*args, **kwargs)
        except Exception as e:
            errors.append((name, f"{type(e).__name__}: {str(e)[-400:]}"))
            traceback.print_exc()

    def configs(op: str) -> list[dict]:
        tables = [t for stem, t in all_tables if table_cc[stem] in (None, target.cc)]
        base = [e["config"] for e in tables[0].get(op, [])] if tables else []
        out = []
        for t in tables:
            for e in t.get(op, []):
                out += [{**b, **e["config"]} for b in base]
        return out

    ch, h, e, k, inter = 12288, 3072, 256, 8, 1024
    cu3, sl3 = torch.tensor([0, 1, 2, 3], dtype=torch.int32), torch.tensor([0, 1, 2], dtype=torch.int32)
    cuv = torch.tensor([0, 1, 5, 9], dtype=torch.int32)
    w4 = MoEWeights(zero_nvfp4(e, 2 * inter, h), zero_nvfp4(e, h, inter), topk_counters(h, "cpu"))
    dense = MoEWeights(torch.zeros(e, 2 * inter, h, dtype=bf), torch.zeros(e, h, inter, dtype=bf))
    # a tensor-parallel rank's share (397B at tp 8: I = 128, below the tables' down K blocks)
    tp8 = MoEWeights(zero_nvfp4(512, 256, 4096), zero_nvfp4(512, 4096, 128), topk_counters(4096, "cpu"))
    for cc in ccs:
        target.cc = cc
        start = len(compiled)
        attempt("rms_norm", norm.rms_norm, torch.randn(4, h, dtype=bf), torch.ones(h), 1e-6,
                torch.randn(4, h, dtype=bf))
        attempt("gated_rms_norm", norm.gated_rms_norm, torch.randn(64, 128, dtype=bf), torch.randn(64, 128, dtype=bf),
                torch.ones(128, dtype=bf), 1e-6)
        attempt("qk_rms_norm", norm.qk_rms_norm, torch.randn(4, 32, 512, dtype=bf)[..., :256],
                torch.randn(4, 2, 256, dtype=bf), torch.ones(256), torch.ones(256), 1e-6)
        attempt("rope", rope.rope, torch.randn(4, 32, 256, dtype=bf), torch.randn(4, 2, 256, dtype=bf),
                torch.zeros(4, dtype=torch.long), torch.randn(100, 64))
        attempt("sigmoid_mul", activation.sigmoid_mul, torch.randn(4, 32, 256, dtype=bf),
                torch.randn(4, 32, 512, dtype=bf)[..., 256:])
        proj = torch.randn(4, e + 2 * inter + 1, dtype=bf)
        attempt("silu_and_mul", activation.silu_and_mul, proj[:, e:e + inter], proj[:, e + inter:e + 2 * inter])
        attempt("moe_combine", activation.moe_combine, torch.randn(4, h, dtype=bf), torch.randn(4, h, dtype=bf),
                proj[:, -1:])
        gdn_proj = torch.randn(4, 128, dtype=bf)
        attempt("gdn_gating", gdn_gating.gdn_gating, gdn_proj[:, 64:], gdn_proj[:, :64], -torch.ones(64),
                torch.zeros(64))
        for cu in (cu3, cuv):
            attempt("conv1d", conv1d.causal_conv1d, torch.randn(int(cu[-1]), ch, dtype=bf),
                    torch.randn(ch, 4, dtype=bf), torch.randn(4, 3, ch, dtype=bf), cu, sl3)
        attempt("gdn", gated_delta.gated_delta_rule_recurrent, torch.randn(3, 16, 128, dtype=bf),
                torch.randn(3, 16, 128, dtype=bf), torch.randn(3, 64, 128, dtype=bf), torch.randn(3, 64),
                torch.rand(3, 64, dtype=bf), torch.randn(4, 64, 128, 128), cu3, sl3)
        natives = (False, True) if cc >= 89 else (False,)
        for native in natives:
            attention.fp8_native = pa.fp8_native = lambda _d, n=native: n
            for kvd in (bf, torch.float8_e4m3fn):
                kc = torch.zeros(10, 16, 2, 256, dtype=kvd)
                vc = kc.clone()
                attempt("store_kv", attention.store_kv, torch.randn(3, 2, 256, dtype=bf),
                        torch.randn(3, 2, 256, dtype=bf), kc, vc, torch.arange(3), 0.5, 0.5)
                bt = torch.zeros(3, 4, dtype=torch.int32)
                lens = torch.tensor([10, 20, 30], dtype=torch.int32)
                for cfg in configs("paged_attention"):
                    for cu, mq, splits in ((cu3, 1, None), (cu3, 1, 4), (cuv, 4, None)):
                        attempt(f"paged_attention {cfg}", pa.paged_attention_launch,
                                torch.randn(int(cu[-1]), 32, 256, dtype=bf), kc, vc, cu, lens, bt, 0.1, 1.0, 1.0,
                                mq, 30, config=cfg, num_splits=splits)
        attention.fp8_native = pa.fp8_native = tri.fp8_native
        attempt("route", moe_route.route, torch.randn(5, 512, dtype=bf), 10)
        route_pdl = moe_route.pdl_supported, moe_route.lookup
        moe_route.pdl_supported, moe_route.lookup = (lambda _d, c=cc: c >= 90), (lambda *_a: {"pdl": True})
        attempt("route pdl", moe_route.route, torch.randn(5, 512, dtype=bf), 10)
        moe_route.pdl_supported, moe_route.lookup = route_pdl
        attempt("align", moe_align.moe_align, torch.zeros(5, 8, dtype=torch.int32), 256, 16)
        attempt("align", moe_align.moe_align, torch.zeros(1000, 8, dtype=torch.int32), 256, 64)
        # every table entry on both paths, plus the activation modes the tables may select per device
        modes = [{}, {"xmode": "quad", "block_t": 4, "dn_mode": "fused"}, {"xmode": "quad", "dn_mode": "token"},
                 {"xmode": "perm", "block_t": 64}, {"pdl_entry": True},
                 {"xmode": "quad", "block_t": 2, "dn_mode": "fused", "pdl_entry": True}]
        fm.pdl_supported = lambda _d, c=cc: c >= 90  # PDL + L2 prefetch variants where a GPU would pick them
        fm.tma_supported = lambda _d, c=cc: c >= 90  # and the TMA weight loads
        for name, experts, ek, op, dtypes, op_modes in (
                ("", w4, k, "fused_moe", (bf, torch.float16), modes), ("", dense, k, "fused_moe_dense", (bf,), [{}]),
                ("397B/tp8 ", tp8, 10, "fused_moe", (bf,), [{}])):
            eh = experts.hidden_size
            for cfg in configs(op):
                for mode in op_modes:
                    # the e4m3-converter decode (DEC 3) is what sm_89+ GPUs pick; a CPU tensor here gets DEC 1/2
                    decs = [{}, {"dec": 3}] if experts.is_nvfp4 and cc >= 89 else [{}]
                    for dt, dec in ((dt, dec) for dt in dtypes for dec in decs):
                        for path, t in (("gemv", 2), ("sorted", 40)):
                            if path == "sorted" and cfg["path"] == "gemv" and (mode.get("block_t", 0) > 16
                                                                              or experts is tp8):
                                # a small-batch entry's tile in 64-slot blocks (in sorted blocks at all for the
                                # shard): no table selects that
                                continue
                            attempt(f"{op} {name}{path} {cfg} {mode} {dec} {dt}", fm.fused_moe_launch,
                                    torch.randn(t, eh, dtype=dt), torch.rand(t, ek),
                                    torch.zeros(t, ek, dtype=torch.int32), experts, path=path,
                                    config={**cfg, **mode, **dec})
        w = zero_nvfp4(4096, 3072)
        for cfg in configs("nvfp4_linear"):
            for t, extra in ((1, {}), (1, {"split_k": 3}), (100, {}), (2048, {})):
                for dt in (bf, torch.float16):
                    attempt(f"nvfp4_linear {cfg} {dt}", nl.nvfp4_linear_launch, torch.randn(t, 3072, dtype=dt), w,
                            config={**cfg, **extra})
        for cfg in configs("nvfp4_linear_generic"):
            for t, path, extra in ((1, "generic_gemv", {}), (100, "generic_gemm", {}),
                                   (100, "generic_gemm", {"split_k": 3})):
                attempt(f"nvfp4_linear_generic {cfg}", nl.nvfp4_linear_launch, torch.randn(t, 3072, dtype=bf), w,
                        path=path, config={**cfg, **extra})
        for stem, table in all_tables:
            if table_cc[stem] not in (None, cc):
                continue
            for entry in table.get("dense_linear", []):
                cfg = {**all_tables[0][1]["dense_linear"][-1]["config"], **entry["config"]}
                tok, rows, cols = (entry["when"].get(f) for f in ("max_tokens", "n", "k"))
                if cfg["path"] != "torch":
                    attempt(f"dense_linear {stem} {entry['when']}", dl.dense_linear_launch,
                            torch.randn(tok or 1, cols or 3072, dtype=bf),
                            torch.randn(rows or 3072, cols or 3072, dtype=bf), config=cfg)
        seen = set()
        limit = SMEM_LIMIT_KB.get(cc, 99)
        print(f"\nsm_{cc}: {len(compiled) - start} launches compiled")
        for name, kernel, _ in compiled[start:]:
            md = kernel.metadata
            key = (name, md.shared, md.num_warps, md.num_stages)
            if key in seen:
                continue
            seen.add(key)
            over = md.shared > limit * 1024
            if over:
                errors.append((name, f"sm_{cc}: {md.shared / 1024:.1f} KB shared > {limit} KB"))
            print(f"  {name:28} warps={md.num_warps} stages={md.num_stages} shared={md.shared / 1024:6.1f} KB"
                  + ("  OVER LIMIT" if over else ""))
        if scan_ptxas and cc == 90:
            _scan_ptxas(compiled[start:])
        if scan_sass:
            _scan_sass(compiled[start:])
    print(f"\n{len(errors)} errors")
    for name, err in errors:
        print(f"  {name}: {err}")
    return 1 if errors else 0


def _scan_ptxas(kernels: list[tuple[str, object, str]]) -> None:
    """Print the distinct sm_90 kernels for which ptxas reports serialised wgmma (advisory C7515)."""
    import subprocess
    import tempfile

    import triton

    ptxas = Path(triton.__file__).parent / "backends/nvidia/bin/ptxas"
    seen: set[str] = set()
    hits: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, kernel, label in kernels:
            ptx = kernel.asm.get("ptx", "")
            if "wgmma" not in ptx or ptx in seen:
                continue
            seen.add(ptx)
            src = Path(tmp) / "k.ptx"
            src.write_text(ptx)
            res = subprocess.run([str(ptxas), "-v", "--gpu-name", "sm_90a", str(src), "-o", str(Path(tmp) / "k.o")],
                                 capture_output=True, text=True)
            if "C7515" in res.stdout + res.stderr:
                hits.append(f"  {name}  (first compiled by: {label})")
    print(f"\nptxas: {len(seen)} distinct wgmma kernels, {len(hits)} with serialised wgmma (C7515)")
    print("\n".join(hits))


def _cubin_tool(kernel, tool: str, *args: str) -> str:
    """Output of Triton's bundled CUDA tool `tool` run with `args` on a compiled kernel's cubin."""
    import subprocess
    import tempfile

    import triton

    exe = Path(triton.__file__).parent / "backends/nvidia/bin" / tool
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        return subprocess.run([str(exe), *args, str(cubin)], capture_output=True, text=True).stdout


def disassemble(kernel) -> str:
    """SASS text of a compiled Triton kernel (its cubin through nvdisasm)."""
    return _cubin_tool(kernel, "nvdisasm", "-c")


def resource_usage(kernel) -> dict[str, int]:
    """ptxas's resource use of a compiled Triton kernel ("REG", "STACK", "SHARED", ... per `cuobjdump
    -res-usage`)."""
    out = _cubin_tool(kernel, "cuobjdump", "-res-usage")
    found = {w.split(":")[0]: int(w.split(":")[1]) for w in out.split() if ":" in w and w.split(":")[1].isdigit()}
    if "REG" not in found:
        raise RuntimeError(f"no register count in cuobjdump's output: {out[:200]}")
    return found


def _scan_sass(kernels: list[tuple[str, object, str]]) -> None:
    """Print each distinct kernel whose SASS holds GPU- or system-scope memory barriers (MEMBAR.*GPU / SYS; the
    CTA-scope ones that order shared memory for wgmma and TMA are left out) or local-memory spills (LDL, STL),
    with the counts, the first launch that compiled it and how many launches did."""
    import re

    found: dict[int, list] = {}
    for name, kernel, label in kernels:
        if id(kernel) not in found:
            sass = disassemble(kernel)
            counts = (len(re.findall(r"MEMBAR\.\S*(?:GPU|SYS)", sass)), sass.count("LDL"), sass.count("STL"))
            found[id(kernel)] = [name, counts, label, 0]
        found[id(kernel)][3] += 1
    hits = [f"  {name}: MEMBAR.GPU/SYS {m} LDL {ldl} STL {stl}, {n} launches, first: {label}"
            for name, (m, ldl, stl), label, n in found.values() if m or ldl or stl]
    print(f"\nSASS: {len(found)} distinct kernels, {len(hits)} with GPU-scope barriers or spills")
    print("\n".join(hits))


if __name__ == "__main__":
    sys.exit(main())
