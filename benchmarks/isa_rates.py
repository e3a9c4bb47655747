"""Issue rates of the SASS instructions the NVFP4 decode is made of, on the GPU present: how many warp
instructions per SM and clock each sustains alone and in pairs, and how many weights per SM and clock the
decodes of `nibble.kernels.fp4_tiles` sustain with nothing else running. Tells which pipe bounds the MoE expert
kernels where they are instruction bound (docs/benchmarks.md: the H200 at 96-512 tokens).

    python benchmarks/isa_rates.py [--out rates.json] [--iters 2048]
    python benchmarks/isa_rates.py --sass-only      # offline: print each kernel's loop SASS mix (no GPU)

Each kernel keeps 4 independent dependency chains per thread and runs 16 4-warp programs per SM, so latency is
hidden and only throughput counts. Rates are the kernel's work per SM over its elapsed time in SM clocks, the
clock taken from the programs' own `%clock64` and `%globaltimer` spans, so they hold whatever the boost and however
many programs an SM holds at once (one program's span alone would count each wave of programs once). Per test:
the SASS opcodes (--sass-only shows them, so that a folded or split instruction is seen) and the rate.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nibble.kernels._triton import tl, triton
from nibble.kernels.fp4_tiles import _decode_asm, _decode_cvt_asm

REPS = 8  # ops per chain in one asm block


def _mix(op_a: str, op_b: str) -> str:
    """PTX: REPS applications of an op (R for the chain register, C / D for the two constants) to each of the 4
    chains $0..$3 (inputs $4..$7, constants $8, $9): op_a on chains 0 and 2, op_b on chains 1 and 3."""
    lines = ["{", ".reg .b16 l, h;"] + [f"mov.b32 ${i}, ${i + 4};" for i in range(4)]
    for _ in range(REPS):
        for i in range(4):
            op = op_a if i % 2 == 0 else op_b
            lines.append(op.replace("R", f"${i}").replace("C", "$8").replace("D", "$9"))
    return "\n".join([*lines, "}"])


F2FP = "mov.b32 {l, h}, R; cvt.rn.f16x2.e4m3x2 R, l;"
OPS = {
    "ffma": "fma.rn.f32 R, R, C, D;",
    "lop3": "lop3.b32 R, R, C, D, 0x96;",
    "shf": "shf.l.wrap.b32 R, R, R, C;",
    "imad": "mad.lo.u32 R, R, C, D;",
    "prmt": "prmt.b32 R, R, C, D;",
    "hmul2": "mul.rn.f16x2 R, R, C;",
    "hfma2": "fma.rn.f16x2 R, R, C, D;",
    "f2fp_e4m3": F2FP,
    "f2fp_bf16_pack": "cvt.rn.bf16x2.f32 R, R, C;",
}
MIXES = {
    "f2fp+lop3": (F2FP, OPS["lop3"]),
    "f2fp+hmul2": (F2FP, OPS["hmul2"]),
    "f2fp+imad": (F2FP, OPS["imad"]),
    "lop3+hmul2": (OPS["lop3"], OPS["hmul2"]),
    "lop3+imad": (OPS["lop3"], OPS["imad"]),
    "hmul2+imad": (OPS["hmul2"], OPS["imad"]),
    "lop3+shf": (OPS["lop3"], OPS["shf"]),
}


def _decode_block(dec_asm: str) -> str:
    """PTX: REPS rounds in which each chain word (8 codes) is decoded by `dec_asm` (4 packed outputs, scale
    pair $8) and the chain continues from the xor of the outputs (ptxas makes that 2 LOP3 per word, which the
    rate includes)."""
    body = dec_asm.replace("$5", "$8")
    lines = ["{", ".reg .b32 o0, o1, o2, o3;"] + [f"mov.b32 ${i}, ${i + 4};" for i in range(4)]
    for _ in range(REPS):
        for i in range(4):
            lines.append(body.replace("$0", "o0").replace("$1", "o1").replace("$2", "o2").replace("$3", "o3")
                         .replace("$4", f"${i}"))
            lines.append(f"xor.b32 o0, o0, o1; xor.b32 o2, o2, o3; xor.b32 ${i}, o0, o2;")
    return "\n".join([*lines, "}"])


DECODES = {
    "dec4_cvt_pairs": _decode_cvt_asm(permute=False),
    "dec3_cvt": _decode_cvt_asm(permute=True),
    "dec2_shift_f16": _decode_asm(9, 0x0E000E00, "f16x2"),
}


@triton.jit
def _rate_kernel(out_ptr, span_ptr, c, d, iters, ASM: tl.constexpr, BLOCK: tl.constexpr):
    """Runs `iters` asm blocks; span_ptr[2 * pid] / [2 * pid + 1]: the program's span in SM clocks (%clock64)
    and in ns (%globaltimer), whose ratio is the SM clock."""
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    r0 = offs * 747796405 + pid
    r1 = r0 ^ 0x5BD1E995
    r2 = r0 * 3 + 0x3C6EF372
    r3 = r0 ^ 0x7F4A7C15
    cc = r0 * 0 + c
    dd = r0 * 0 + d
    c0 = tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
    g0 = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
    for _ in range(iters):
        r0, r1, r2, r3 = tl.inline_asm_elementwise(ASM, "=r,=r,=r,=r,r,r,r,r,r,r", [r0, r1, r2, r3, cc, dd],
                                                   dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True,
                                                   pack=1)
    c1 = tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,r", [r0], dtype=tl.int64, is_pure=False, pack=1)
    g1 = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [r0], dtype=tl.int64, is_pure=False,
                                   pack=1)
    tl.store(out_ptr + pid * BLOCK + offs, r0 ^ r1 ^ r2 ^ r3)
    tl.store(span_ptr + 2 * pid, tl.max(c1 - c0, axis=0))
    tl.store(span_ptr + 2 * pid + 1, tl.max(g1 - g0, axis=0))


def _tests() -> dict[str, tuple[str, int]]:
    """name -> (asm, per warp and iteration: warp instructions of the tested kind; for decodes, weights)."""
    t = {name: (_mix(op, op), 4 * REPS) for name, op in OPS.items()}
    t.update({name: (_mix(a, b), 4 * REPS) for name, (a, b) in MIXES.items()})
    t.update({name: (_decode_block(asm), 4 * REPS * 8 * 32) for name, asm in DECODES.items()})
    return t


def run(iters: int, out: str | None) -> None:
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    block, per_sm = 128, 16
    programs = per_sm * sms
    res = {"device": torch.cuda.get_device_name(dev), "sms": sms, "warps_per_program": 4,
           "programs_per_sm": per_sm, "rates": {}}
    buf = torch.empty(programs * block, dtype=torch.int32, device=dev)
    span = torch.empty(2 * programs, dtype=torch.int64, device=dev)
    c, d = 0x3C003C00, 0x00010001  # fp16 pair 1.0 / tiny: the chains' values stay finite enough
    for name, (asm, per_iter) in _tests().items():
        for _ in range(2):  # compile, warm the clocks
            k = _rate_kernel[(programs,)](buf, span, c, d, iters, ASM=asm, BLOCK=block, num_warps=4)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        _rate_kernel[(programs,)](buf, span, c, d, iters, ASM=asm, BLOCK=block, num_warps=4)
        end.record()
        torch.cuda.synchronize()
        ms = start.elapsed_time(end)
        cycles, ns = (float(v) for v in span.view(-1, 2).double().median(dim=0).values)
        ghz = cycles / ns
        # whatever number of programs an SM holds at once, it runs per_sm of them in the kernel's time: the rate
        # is their work over the kernel's time in SM clocks (the clock from the programs' own spans)
        per_sm_clk = per_sm * 4 * iters * per_iter / (ms * 1e6 * ghz)
        res["rates"][name] = {"per_sm_per_clk": round(per_sm_clk, 3), "ms": round(ms, 4), "clock_ghz": round(ghz, 3),
                              "program_waves": round(ms * 1e6 / ns, 2), "regs": k.n_regs}
        unit = "weights" if name in DECODES else "warp instr"
        print(f"{name:18s} {per_sm_clk:8.2f} {unit}/SM/clk   ({ms:.3f} ms at {ghz:.2f} GHz, "
              f"{ms * 1e6 / ns:.2f} program spans, {k.n_regs} regs)")
    if out:
        Path(out).write_text(json.dumps(res, indent=1))


def sass_only() -> None:
    """Compile every test for sm_90 without a GPU and print the loop's opcode counts (nvdisasm)."""
    import collections
    import re

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "gpu"))
    from compile_offline import StandInDriver, disassemble
    from triton.runtime import driver

    driver.set_active(StandInDriver(90))
    for name, (asm, per_iter) in _tests().items():
        k = _rate_kernel.warmup(torch.empty(1, dtype=torch.int32), torch.empty(2, dtype=torch.int64), 0x3C003C00,
                                0x10001, 2048, ASM=asm, BLOCK=128, num_warps=4, grid=(1,))
        sass = disassemble(k)
        seq, labels = [], {}
        for line in sass.splitlines():
            s = line.strip()
            m = re.match(r"(\.L_x_\d+):", s)
            if m:
                labels[m.group(1)] = len(seq)
                continue
            m = re.match(r"/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", s)
            if m:
                seq.append(m.group(1))
        best = None
        for i, ins in enumerate(seq):
            m = re.search(r"BRA\s.*?(\.L_x_\d+)", ins)
            if m and m.group(1) in labels and labels[m.group(1)] <= i:
                body = seq[labels[m.group(1)]:i + 1]
                if best is None or len(body) > len(best):
                    best = body
        mix = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", x).split()[0] for x in best or [])
        print(f"{name:18s} per iter {per_iter:4d}: {dict(mix.most_common(8))}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=2048)
    ap.add_argument("--out")
    ap.add_argument("--sass-only", action="store_true")
    a = ap.parse_args()
    if a.sass_only:
        sass_only()
    else:
        run(a.iters, a.out)


if __name__ == "__main__":
    main()
