"""The decode-sized BF16 projections of Qwen3.5 layers: torch's `F.linear` (cuBLAS) against the `dense_linear`
kernels (nibble/kernels/dense_gemv.py: "gemv" on the CUDA cores, "dot" on the tensor cores) in several tile
configurations, on one CUDA GPU.

    python benchmarks/dense_gemv_bench.py --out out/dense.json [--models 122B,397B,35B] [--tokens 1,2,4,8]
        [--tokens 1,2,4,8,16] [--write-table out/dense_table.json]

Shapes: `selftest.dense_linear_shapes` of each model's config.json (benchmarks/models/). Each variant is timed
as one CUDA graph running it on enough different weight copies (>= 4, >= 384 MiB in all) to keep them out of
L2, back to back like consecutive layers: microseconds per call, the weight bytes over that time in TB/s and
as % of the copy ceiling measured at start. `err` is ||out - ref|| / ||ref|| against an fp32 GEMM.
--write-table: `dense_linear` tuning entries, per shape and token count the fastest kernel configuration where
it beat torch by 3% or more (each measured T covers the token counts above the previous one), then torch for
every other case.
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nibble.bench.gpu_timing import stream_us
from nibble.bench.latency import measure_copy_bandwidth
from nibble.kernels.dense_gemv import GEMV_MAX_TOKENS, dense_linear_launch
from nibble.kernels.selftest import dense_linear_shapes
from nibble.models.config import ModelConfig

MODELS = {"122B": "Qwen3.5-122B-A10B-NVFP4", "397B": "Qwen3.5-397B-A17B-NVFP4", "35B": "Qwen3.5-35B-A3B"}
# (block_n, block_k, warps, stages)
GEMV = [(4, 512, 4, 4), (4, 1024, 4, 4), (8, 256, 4, 4), (8, 512, 4, 4), (8, 512, 4, 6), (8, 1024, 8, 4),
        (16, 256, 4, 4), (16, 512, 8, 4), (8, 256, 2, 6), (4, 512, 2, 4), (16, 256, 8, 6), (32, 256, 8, 4),
        (4, 256, 2, 8), (8, 128, 2, 8), (2, 1024, 2, 4), (2, 512, 2, 6), (4, 512, 2, 6), (4, 1024, 4, 3),
        (4, 2048, 8, 3), (2, 2048, 4, 3), (4, 1024, 2, 4), (2, 256, 1, 8), (4, 256, 1, 8)]
# the tensor-core kernel, for 4 tokens and more
DOT = [(16, 256, 1, 4), (16, 128, 1, 6), (32, 128, 2, 4), (32, 256, 2, 3), (64, 128, 4, 3), (16, 512, 1, 3)]
MAX_ACC_REGS = 128  # fp32 partial sums per thread; larger gemv tiles spill


def variants(t: int) -> list[tuple[str, dict[str, Any]]]:
    bt = 1 << max(0, t - 1).bit_length()
    out: list[tuple[str, dict[str, Any]]] = [("torch", {"path": "torch"}), ("auto", {})]
    for bn, bk, w, st in GEMV:
        if t <= GEMV_MAX_TOKENS and bt * bn * bk // (32 * w) <= MAX_ACC_REGS:
            out.append((f"gemv:{bn}x{bk}w{w}s{st}",
                        {"path": "gemv", "block_n": bn, "block_k": bk, "warps": w, "stages": st}))
    for bn, bk, w, st in DOT if t >= 4 else ():
        out.append((f"dot:{bn}x{bk}w{w}s{st}", {"path": "dot", "block_n": bn, "block_k": bk, "warps": w, "stages": st}))
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    dev = torch.device("cuda")
    ceil = measure_copy_bandwidth(dev, 1 << 30) / 1e12
    print(f"{torch.cuda.get_device_name()}: copy ceiling {ceil:.2f} TB/s", flush=True)
    gen = torch.Generator(dev)
    gen.manual_seed(0)
    tokens = [int(t) for t in args.tokens.split(",")]
    shapes: list[tuple[int, int]] = []
    for model in args.models.split(","):
        cfg = ModelConfig.from_pretrained(Path(__file__).parent / "models" / MODELS[model])
        shapes += [s for s in dense_linear_shapes(cfg) if s not in shapes]
    records = []
    for n, k in shapes:
        nbytes = n * k * 2
        copies = max(4, -(-(384 << 20) // nbytes))
        ws = [torch.randn(n, k, device=dev, generator=gen).mul_(k ** -0.5).to(torch.bfloat16) for _ in range(copies)]
        for t in tokens:
            x = torch.randn(t, k, device=dev, generator=gen).to(torch.bfloat16)
            ref = x.float() @ ws[0].float().T
            for name, cfg in variants(t):
                rec: dict[str, Any] = {"n": n, "k": k, "T": t, "variant": name, "config": cfg}
                try:
                    out = dense_linear_launch(x, ws[0], config=cfg)
                    torch.cuda.synchronize()
                    rec["err"] = float((out.float() - ref).norm() / ref.norm())
                    rec["us"] = stream_us([partial(dense_linear_launch, x, w, config=cfg) for w in ws], rounds=3,
                                          reps=7)
                    rec["tbps"] = nbytes / (rec["us"] * 1e-6) / 1e12
                    rec["pct_copy"] = 100 * rec["tbps"] / ceil
                except Exception as ex:
                    rec["error"] = f"{type(ex).__name__}: {str(ex).splitlines()[0][:200] if str(ex) else ''}"
                records.append(rec)
                print(f"N={n:6d} K={k:5d} T={t} {name:22s} " + (
                    f"{rec['us']:8.2f} us {rec['tbps']:5.2f} TB/s {rec['pct_copy']:5.1f}% err {rec['err']:.1e}"
                    if "us" in rec else rec["error"]), flush=True)
        del ws
        torch.cuda.empty_cache()
    return {"device": torch.cuda.get_device_name(), "copy_tbps": ceil, "records": records}


def table_entries(records: list[dict[str, Any]], min_gain: float = 0.03) -> list[dict[str, Any]]:
    """`dense_linear` entries: the fastest kernel configuration per (N, K, T) where it beat torch by min_gain or
    more."""
    entries = []
    shapes = sorted({(r["n"], r["k"]) for r in records})
    for n, k in shapes:
        ts = sorted({r["T"] for r in records if (r["n"], r["k"]) == (n, k)})
        for i, t in enumerate(ts):
            rows = [r for r in records if (r["n"], r["k"], r["T"]) == (n, k, t) and "us" in r]
            torch_us = next((r["us"] for r in rows if r["variant"] == "torch"), None)
            gemv = [r for r in rows if r["variant"].startswith(("gemv:", "dot:")) and r["err"] < 1e-2]
            if torch_us is None or not gemv:
                continue
            best = min(gemv, key=lambda r: r["us"])
            if best["us"] <= (1 - min_gain) * torch_us:
                when = {"min_tokens": ts[i - 1] + 1 if i else 1, "max_tokens": t, "n": n, "k": k}
                entries.append({"when": when, "config": best["config"]})
    # the rest stays with torch on this GPU, rather than taking what another GPU of its capability measured
    return [*entries, {"when": {}, "config": {"path": "torch"}}]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="122B,397B,35B")
    ap.add_argument("--tokens", default="1,2,4,8,16")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--write-table", type=Path)
    args = ap.parse_args()
    res = run(args)
    if args.out:
        args.out.write_text(json.dumps(res, indent=1))
    if args.write_table:
        entries = table_entries(res["records"])
        args.write_table.write_text(json.dumps(entries, indent=1))
        print(f"{len(entries)} table entries -> {args.write_table}")


if __name__ == "__main__":
    main()
