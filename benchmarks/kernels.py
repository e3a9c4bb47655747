"""Kernel benchmark on one CUDA GPU: ceilings first (copy bandwidth, bf16 GEMM), then each op at decode and
prefill sizes on the real Qwen3.5-122B-A10B / 397B-A17B layer shapes, with a torch baseline where one
exists. Prints a markdown table last.

    python benchmarks/kernels.py --out out/kernels.json --md out/kernels.md [--quick | --full]
        [--sweep-moe | --sweep-linear] [--ops linear --models 122B,397B --tokens 1,256,8192]

Times are medians over CUDA-graph replays (launch overhead excluded, as in the engine's decode graphs)
with the L2 cache flushed before each replay; ops that cannot be captured (fla's prefill syncs) are timed
as plain calls. Bandwidth counts the bytes an op must move (MoE: only the experts the routing hits);
"% ceil" is against the measured copy bandwidth (read + write) or bf16 GEMM rate. The MoE baseline is
`fused_moe_ref`-style grouped cuBLAS GEMMs on bf16 expert weights stored in advance (no dequantisation
time counted); the linear baseline is cuBLAS bf16 on the dense weight.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nibble.bench.gpu_timing import capture_graph, cold_ms
from nibble.formats.nvfp4 import NVFP4Tensor
from nibble.kernels.attention import store_kv
from nibble.kernels.conv1d import causal_conv1d
from nibble.kernels.fused_moe import fused_moe_launch
from nibble.kernels.gated_delta import gated_delta_rule_fla, gated_delta_rule_recurrent
from nibble.kernels.moe import MoEWeights, topk_counters
from nibble.kernels.moe_route import route
from nibble.kernels.norm import rms_norm
from nibble.kernels.nvfp4_linear import nvfp4_linear_launch, nvfp4_linear_ref
from nibble.kernels.paged_attention import paged_attention, paged_attention_launch

DEV = torch.device("cuda")
BF16 = torch.bfloat16
MODELS = {
    "122B": {"hidden": 3072, "experts": 256, "top_k": 8, "inter": 1024},
    "397B": {"hidden": 4096, "experts": 512, "top_k": 10, "inter": 1024},
}
ATTN = {"hq": 32, "hk": 2, "d": 256}
GDN = {"hk": 16, "hv": 64, "dk": 128, "dv": 128, "conv": 2 * 16 * 128 + 64 * 128, "width": 4}
DECODE = (1, 2, 4, 8, 16, 32, 64, 128, 256)
PREFILL = (2048, 8192)
OPS = ("moe", "linear", "attention", "verify", "gdn", "norm")
VERIFY = {"batch": (1, 8, 32), "ctx": (1024, 16384), "n": 3}  # speculative decoding: last token + 2 drafts


class Bench:
    def __init__(self, budget_s: float, reps: int) -> None:
        self.start = time.perf_counter()
        self.budget = budget_s
        self.reps = reps
        self.flush = torch.empty(256 << 20, dtype=torch.uint8, device=DEV)
        self.records: list[dict[str, Any]] = []
        self.ceil: dict[str, float] = {}

    def out_of_time(self) -> bool:
        return time.perf_counter() - self.start > self.budget

    def time_ms(self, fn: Callable[[], Any], graph: bool = True, reps: int | None = None) -> tuple[float, bool]:
        """Median milliseconds of fn (graph-replayed when possible), L2 flushed before each run."""
        reps = reps or self.reps
        fn()
        torch.cuda.synchronize()
        run = fn
        if graph:
            try:
                run = capture_graph(fn).replay
            except Exception:
                torch.cuda.synchronize()
                graph = False
                run = fn
        return cold_ms(run, reps, self.flush), graph

    def add(self, **rec: Any) -> None:
        self.records.append(rec)
        us = rec.get("us")
        rate = ""
        if rec.get("tbps") is not None:
            rate = f"{rec['tbps']:.2f} TB/s ({rec['pct']:.0f}%)"
        elif rec.get("tflops") is not None:
            rate = f"{rec['tflops']:.0f} TFLOP/s ({rec['pct']:.0f}%)"
        base = f" baseline {rec['baseline_us']:.1f} us" if rec.get("baseline_us") else ""
        err = f" ERROR {rec['error']}" if rec.get("error") else ""
        print(f"[{time.perf_counter() - self.start:6.1f}s] {rec['model']:5} {rec['op']:16} {rec['case']:22} "
              f"T={rec['tokens']:<5} {rec.get('variant', ''):8} "
              f"{'' if us is None else f'{us:9.1f} us'} {rate}{base}{err}", flush=True)

    def case(self, model: str, op: str, case: str, tokens: int, variant: str, fn: Callable[[], Any], *,
             nbytes: float | None = None, flops: float | None = None, baseline: Callable[[], Any] | None = None,
             graph: bool = True) -> None:
        if self.out_of_time():
            self.add(model=model, op=op, case=case, tokens=tokens, variant=variant, error="skipped (time budget)")
            return
        rec: dict[str, Any] = {"model": model, "op": op, "case": case, "tokens": tokens, "variant": variant}
        try:
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            rec["first_call_s"] = time.perf_counter() - t0
            ms, graphed = self.time_ms(fn, graph)
            rec.update(us=ms * 1e3, graph=graphed)
            if nbytes is not None:
                rec["tbps"] = nbytes / (ms * 1e-3) / 1e12
                rec["pct"] = 100 * rec["tbps"] / self.ceil["copy_tbps"]
            if flops is not None:
                rec["tflops"] = flops / (ms * 1e-3) / 1e12
                rec["pct"] = 100 * rec["tflops"] / self.ceil["gemm_tflops"]
            if baseline is not None:
                bms, _ = self.time_ms(baseline, graph)
                rec["baseline_us"] = bms * 1e3
                rec["speedup"] = bms / ms
        except Exception as e:
            rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            traceback.print_exc()
            torch.cuda.synchronize()
        self.add(**rec)


def ceilings(b: Bench) -> None:
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    ms, _ = b.time_ms(lambda: dst.copy_(src), graph=False, reps=20)
    b.ceil["copy_tbps"] = 2 * n / (ms * 1e-3) / 1e12
    a = torch.randn(8192, 8192, device=DEV, dtype=BF16)
    w = torch.randn(8192, 8192, device=DEV, dtype=BF16)
    ms, _ = b.time_ms(lambda: a @ w, graph=False, reps=20)
    b.ceil["gemm_tflops"] = 2 * 8192 ** 3 / (ms * 1e-3) / 1e12
    print(f"ceilings: copy {b.ceil['copy_tbps']:.2f} TB/s (read+write), bf16 GEMM {b.ceil['gemm_tflops']:.0f} TFLOP/s",
          flush=True)


def random_nvfp4(*shape: int) -> NVFP4Tensor:
    *lead, n, k = shape
    packed = torch.randint(0, 256, (*lead, n, k // 2), dtype=torch.uint8, device=DEV)
    scale = (torch.rand(*lead, n, k // 16, device=DEV) * 2 + 0.05).to(torch.float8_e4m3fn)
    return NVFP4Tensor(packed, scale, torch.full((*lead, n), 0.5 / k ** 0.5, device=DEV))


def moe_baseline(x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                 inter: int) -> Callable[[], torch.Tensor]:
    """fused_moe_ref-style per-expert cuBLAS on prestored bf16 weights; the grouping is precomputed."""
    flat = ids.long()
    groups = []
    for e in torch.unique(flat).tolist():
        tok, slot = torch.where(flat == e)
        groups.append((e, tok, w[tok, slot, None]))

    def run() -> torch.Tensor:
        out = torch.zeros(x.shape, dtype=torch.float32, device=DEV)
        for e, tok, tw in groups:
            h = F.linear(x[tok], w13[e])
            y = F.linear(F.silu(h[:, :inter]) * h[:, inter:], w2[e])
            out.index_add_(0, tok, y.float() * tw)
        return out.to(x.dtype)

    return run


def bench_moe(b: Bench, model: str, sizes: tuple[int, ...], paths: bool, with_baseline: bool) -> None:
    m = MODELS[model]
    h, e, k, inter = m["hidden"], m["experts"], m["top_k"], m["inter"]
    experts = MoEWeights(random_nvfp4(e, 2 * inter, h), random_nvfp4(e, h, inter), topk_counters(h, DEV))
    per_expert = experts.w13.nbytes() // e + experts.w2.nbytes() // e
    dense = None
    if with_baseline:
        dense = (torch.randn(e, 2 * inter, h, device=DEV, dtype=BF16) * h ** -0.5,
                 torch.randn(e, h, inter, device=DEV, dtype=BF16) * inter ** -0.5)
    for t in sizes:
        x = torch.randn(t, h, device=DEV, dtype=BF16)
        logits = torch.randn(t, e, device=DEV, dtype=BF16)
        w, ids = route(logits, k)
        hit = int(torch.unique(ids).numel())
        nbytes = hit * per_expert + 2 * t * h * 2
        flops = 2 * t * k * 3 * inter * h
        kind = "decode" if t <= 256 else "prefill"
        b.case(model, "route", kind, t, "triton", partial(route, logits, k), nbytes=t * e * 2)
        base = moe_baseline(x, w, ids, dense[0], dense[1], inter) if dense is not None else None
        b.case(model, "fused_moe", f"{kind} fp4 ({hit} exp)", t, "auto",
               partial(fused_moe_launch, x, w, ids, experts), nbytes=nbytes,
               flops=flops if kind == "prefill" else None, baseline=base)
        if paths and t <= 256:
            for p in ("gemv", "sorted"):
                b.case(model, "fused_moe", f"{kind} fp4 ({hit} exp)", t, p,
                       partial(fused_moe_launch, x, w, ids, experts, path=p), nbytes=nbytes)
    del experts, dense
    torch.cuda.empty_cache()


def linear_shapes(model: str) -> tuple[tuple[int, int, str], ...]:
    h = MODELS[model]["hidden"]
    return (h, 8192, "o_proj-like"), (16384, h, "q_proj-like")


def bench_linear(b: Bench, model: str, sizes: tuple[int, ...]) -> None:
    for n, k, name in linear_shapes(model):
        w = random_nvfp4(n, k)
        wd = torch.randn(n, k, device=DEV, dtype=BF16)
        for t in sizes:
            x = torch.randn(t, k, device=DEV, dtype=BF16)
            nbytes = w.nbytes() + t * (k + n) * 2
            big = t > 256
            for variant, path in (("auto", "auto"), ("generic", "generic_auto")):
                b.case(model, "nvfp4_linear", f"{name} {n}x{k}", t, variant,
                       partial(nvfp4_linear_launch, x, w, path=path), nbytes=None if big else nbytes,
                       flops=2 * t * n * k if big else None,
                       baseline=partial(F.linear, x, wd) if variant == "auto" else None)


def _lin(xmode: str, slots: int, bn: int, bk: int, w: int, st: int, split: int = 0) -> dict[str, Any]:
    return {"xmode": xmode, "slots": slots, "block_n": bn, "block_k": bk, "warps": w, "stages": st,
            "split_k": split}


SWEEP_LINEAR = [  # (min T, max T, config) of `nvfp4_linear` (tuning/default.json "nvfp4_linear")
    *[(1, 16, _lin("quad", 4, *c)) for c in ((16, 256, 2, 4), (32, 256, 2, 4), (32, 512, 2, 3), (64, 256, 4, 4),
                                              (32, 128, 2, 6), (32, 256, 2, 4, 1), (64, 256, 4, 4, 1))],
    *[(4, 256, _lin("split", 16, *c)) for c in ((64, 128, 4, 4), (32, 256, 2, 4), (128, 128, 8, 3))],
    *[(32, 8192, _lin("split", sl, *c)) for sl, c in ((32, (128, 64, 8, 3)), (64, (128, 64, 8, 3)),
                                                      (64, (128, 128, 8, 3)), (64, (64, 128, 4, 4)))],
    *[(128, 8192, _lin("perm", sl, *c)) for sl, c in ((64, (128, 64, 8, 4)), (64, (128, 128, 8, 3)),
                                                      (128, (128, 64, 8, 3)), (32, (128, 128, 8, 3)))],
]


def sweep_linear(b: Bench, model: str) -> dict[str, Any]:
    """Time `nvfp4_linear` configurations per shape and token count, each checked against the reference;
    returns the best per (shape, T) (for tuning/<device>.json)."""
    best: dict[str, Any] = {}
    for n, k, name in linear_shapes(model):
        w = random_nvfp4(n, k)
        for t in (1, 2, 4, 8, 16, 32, 64, 128, 256, 2048):
            x = torch.randn(t, k, device=DEV, dtype=BF16)
            ref = nvfp4_linear_ref(x.float(), w)
            for lo, hi, cfg in SWEEP_LINEAR:
                if not lo <= t <= hi or b.out_of_time():
                    continue
                try:
                    out = nvfp4_linear_launch(x, w, config=cfg)
                    err = float((out.float() - ref).norm() / ref.norm())
                    ms, _ = b.time_ms(partial(nvfp4_linear_launch, x, w, config=cfg), reps=15)
                except Exception as ex:
                    print(f"sweep {name} T={t} {cfg}: {type(ex).__name__}: {str(ex)[:120]}", flush=True)
                    continue
                bad = " BAD" if not err < 2e-2 else ""
                print(f"sweep linear {name} T={t:5} {ms * 1e3:9.1f} us err {err:.1e}{bad} {cfg}", flush=True)
                key = f"{name} T={t}"
                if not bad and (key not in best or ms < best[key]["ms"]):
                    best[key] = {"ms": ms, "config": cfg}
    print("sweep linear best:", json.dumps(best, indent=1), flush=True)
    return best


def bench_attention(b: Bench, model: str, full: bool) -> None:
    hq, hk, d = ATTN["hq"], ATTN["hk"], ATTN["d"]
    page = 16
    for kv_dtype in (BF16, torch.float8_e4m3fn):
        esize = 1 if kv_dtype == torch.float8_e4m3fn else 2
        tag = "fp8" if esize == 1 else "bf16"
        cases = [(bs, 4096) for bs in DECODE] + [(1, 32768)] + ([(8, 32768), (1, 131072)] if full else [])
        for bs, ctx in cases:
            nb = bs * ctx // page
            kc = torch.randn(nb + 1, page, hk, d, device=DEV).to(kv_dtype)
            vc = torch.randn(nb + 1, page, hk, d, device=DEV).to(kv_dtype)
            table = torch.randperm(nb, device=DEV).to(torch.int32).view(bs, ctx // page)
            q = torch.randn(bs, hq, d, device=DEV, dtype=BF16)
            cu = torch.arange(bs + 1, dtype=torch.int32, device=DEV)
            lens = torch.full((bs,), ctx, dtype=torch.int32, device=DEV)
            b.case(model, "paged_attention", f"decode {tag} ctx={ctx}", bs, "triton",
                   partial(paged_attention, q, kc, vc, cu, lens, table, d ** -0.5, 1.0, 1.0, 1, ctx),
                   nbytes=2 * bs * ctx * hk * d * esize)
            del kc, vc
        for t in PREFILL:
            nb = t // page
            kc = torch.randn(nb, page, hk, d, device=DEV).to(kv_dtype)
            vc = torch.randn(nb, page, hk, d, device=DEV).to(kv_dtype)
            table = torch.randperm(nb, device=DEV).to(torch.int32).view(1, nb)
            q = torch.randn(t, hq, d, device=DEV, dtype=BF16)
            kn = torch.randn(t, hk, d, device=DEV, dtype=BF16)
            slots = torch.arange(t, device=DEV)
            cu = torch.tensor([0, t], dtype=torch.int32, device=DEV)
            lens = torch.tensor([t], dtype=torch.int32, device=DEV)
            b.case(model, "store_kv", f"prefill {tag}", t, "triton",
                   partial(store_kv, kn, kn, kc, vc, slots, 1.0, 1.0), nbytes=2 * t * hk * d * (2 + esize))
            b.case(model, "paged_attention", f"prefill {tag} causal", t, "triton",
                   partial(paged_attention, q, kc, vc, cu, lens, table, d ** -0.5, 1.0, 1.0, t, t),
                   flops=2 * 2 * hq * d * t * t / 2)
            del kc, vc


def bench_verify(b: Bench, model: str) -> None:
    """Paged attention of a verify step: n query tokens per sequence over its cached context, split-KV;
    the baseline is the same launch with the KV range unsplit, as verify steps ran before."""
    hq, hk, d = ATTN["hq"], ATTN["hk"], ATTN["d"]
    page, n = 16, VERIFY["n"]
    for kv_dtype in (BF16, torch.float8_e4m3fn):
        esize = 1 if kv_dtype == torch.float8_e4m3fn else 2
        tag = "fp8" if esize == 1 else "bf16"
        for bs in VERIFY["batch"]:
            for ctx in VERIFY["ctx"]:
                nb = -(-(ctx + n) // page)
                kc = torch.randn(bs * nb, page, hk, d, device=DEV).to(kv_dtype)
                vc = torch.randn(bs * nb, page, hk, d, device=DEV).to(kv_dtype)
                table = torch.randperm(bs * nb, device=DEV).to(torch.int32).view(bs, nb)
                q = torch.randn(bs * n, hq, d, device=DEV, dtype=BF16)
                cu = torch.arange(0, bs * n + 1, n, dtype=torch.int32, device=DEV)
                lens = torch.full((bs,), ctx + n, dtype=torch.int32, device=DEV)
                args = (q, kc, vc, cu, lens, table, d ** -0.5, 1.0, 1.0, n, ctx + n)
                b.case(model, "paged_attention", f"verify n={n} {tag} ctx={ctx}", bs * n, "triton",
                       partial(paged_attention, *args), nbytes=2 * bs * (ctx + n) * hk * d * esize,
                       baseline=partial(paged_attention_launch, *args, num_splits=1))
                del kc, vc


def bench_gdn(b: Bench, model: str, full: bool) -> None:
    hk, hv, dk, dv = GDN["hk"], GDN["hv"], GDN["dk"], GDN["dv"]
    ch, width = GDN["conv"], GDN["width"]
    slots_n = 300
    ssm = torch.zeros(slots_n, hv, dk, dv, device=DEV)
    conv = torch.zeros(slots_n, width - 1, ch, device=DEV, dtype=BF16)
    for t in DECODE:
        q, k = (torch.randn(t, hk, dk, device=DEV, dtype=BF16) for _ in range(2))
        v = torch.randn(t, hv, dv, device=DEV, dtype=BF16)
        g = -torch.rand(t, hv, device=DEV)
        beta = torch.rand(t, hv, device=DEV, dtype=BF16)
        slots = torch.randperm(slots_n, device=DEV)[:t].to(torch.int32)
        cu = torch.arange(t + 1, dtype=torch.int32, device=DEV)
        b.case(model, "gated_delta_rule", "decode (in place)", t, "triton",
               partial(gated_delta_rule_recurrent, q, k, v, g, beta, ssm, cu, slots), nbytes=t * hv * dk * dv * 8)
        x = torch.randn(t, ch, device=DEV, dtype=BF16)
        wc = torch.randn(ch, width, device=DEV, dtype=BF16)
        b.case(model, "causal_conv1d", "decode", t, "triton", partial(causal_conv1d, x, wc, conv, cu, slots),
               nbytes=t * ch * 2 * (2 + 2 * (width - 1)))
    for t in PREFILL if full else PREFILL[:1]:
        q, k = (torch.randn(t, hk, dk, device=DEV, dtype=BF16) for _ in range(2))
        v = torch.randn(t, hv, dv, device=DEV, dtype=BF16)
        g = -torch.rand(t, hv, device=DEV) * 0.1
        beta = torch.rand(t, hv, device=DEV, dtype=BF16)
        slots = torch.tensor([3], dtype=torch.int32, device=DEV)
        cu = torch.tensor([0, t], dtype=torch.int32, device=DEV)
        b.case(model, "gated_delta_rule", "prefill (fla chunk)", t, "fla",
               partial(gated_delta_rule_fla, q, k, v, g, beta, ssm, cu, slots), graph=False)
        x = torch.randn(t, ch, device=DEV, dtype=BF16)
        wc = torch.randn(ch, width, device=DEV, dtype=BF16)
        b.case(model, "causal_conv1d", "prefill", t, "triton", partial(causal_conv1d, x, wc, conv, cu, slots),
               nbytes=t * ch * 4)


def bench_norm(b: Bench, model: str, sizes: tuple[int, ...]) -> None:
    h = MODELS[model]["hidden"]
    w = torch.ones(h, device=DEV)
    for t in sizes:
        x, r = torch.randn(t, h, device=DEV, dtype=BF16), torch.randn(t, h, device=DEV, dtype=BF16)
        b.case(model, "rms_norm", "fused residual", t, "triton", partial(rms_norm, x, w, 1e-6, r),
               nbytes=4 * t * h * 2)


def _tiles(bn: int, bk: int, w: int, st: int, pre: str) -> dict[str, int]:
    return {f"{pre}_block_n": bn, f"{pre}_block_k": bk, f"{pre}_warps": w, f"{pre}_stages": st}


# NVFP4 fused_moe tile configurations (fields of tuning/default.json "fused_moe"; benchmarks/moe_bench.py has
# a finer sweep with correctness checks)
SWEEP_GEMV = [dict(xmode=xm, dn_mode=dm, **_tiles(*g, "gu"), **_tiles(*d, "dn")) for xm, dm, g, d in (
    ("split", "reduce", (32, 256, 2, 4), (64, 256, 4, 3)), ("quad", "fused", (16, 256, 2, 4), (32, 256, 2, 4)),
    ("quad", "fused", (32, 256, 4, 4), (64, 256, 4, 4)), ("quad", "reduce", (16, 256, 2, 4), (32, 256, 2, 4)),
    ("quad", "token", (16, 256, 2, 4), (16, 256, 1, 4)), ("quad", "fused", (16, 512, 2, 3), (32, 512, 2, 3)))]
SWEEP_SORTED = [dict(xmode=xm, block_t=bt, **_tiles(*g, "gu"), **_tiles(*d, "dn")) for xm, bt, g, d in (
    ("split", 16, (64, 128, 4, 4), (64, 128, 4, 4)), ("quad", 4, (32, 256, 2, 4), (32, 256, 2, 4)),
    ("quad", 4, (64, 128, 4, 4), (64, 128, 4, 4)), ("quad", 8, (32, 256, 4, 4), (64, 256, 4, 4)),
    ("perm", 16, (64, 128, 4, 4), (64, 128, 4, 4)), ("split", 64, (128, 64, 8, 4), (128, 64, 8, 4)),
    ("perm", 64, (128, 64, 8, 4), (128, 64, 8, 4)), ("perm", 128, (128, 64, 8, 3), (128, 64, 8, 3)))]


def sweep_moe(b: Bench, model: str) -> dict[str, Any]:
    """Time tile configurations per token count; returns the best per size (for tuning/<device>.json)."""
    m = MODELS[model]
    h, e, k, inter = m["hidden"], m["experts"], m["top_k"], m["inter"]
    experts = MoEWeights(random_nvfp4(e, 2 * inter, h), random_nvfp4(e, h, inter), topk_counters(h, DEV))
    best: dict[str, Any] = {}
    for t in (1, 2, 4, 8, 16, 32, 64, 128, 256, 2048, 8192):
        x = torch.randn(t, h, device=DEV, dtype=BF16)
        w, ids = route(torch.randn(t, e, device=DEV), k)
        trials = [("gemv", c) for c in SWEEP_GEMV] if t <= 16 else []
        trials += [("sorted", c) for c in SWEEP_SORTED if (t > 256) == (c["block_t"] >= 64)]
        for path, cfg in trials:
            if b.out_of_time():
                break
            try:
                fused_moe_launch(x, w, ids, experts, path=path, config=cfg)
                ms, _ = b.time_ms(partial(fused_moe_launch, x, w, ids, experts, path=path, config=cfg), reps=15)
            except Exception as ex:
                print(f"sweep T={t} {path} {cfg}: {type(ex).__name__}: {str(ex)[:120]}", flush=True)
                continue
            print(f"sweep {model} T={t:5} {path:6} {ms * 1e3:9.1f} us {cfg}", flush=True)
            if str(t) not in best or ms < best[str(t)]["ms"]:
                best[str(t)] = {"ms": ms, "path": path, "config": cfg}
    print("sweep best:", json.dumps(best, indent=1), flush=True)
    return best


def markdown(b: Bench) -> str:
    lines = [f"Ceilings: copy {b.ceil['copy_tbps']:.2f} TB/s (read+write), bf16 GEMM "
             f"{b.ceil['gemm_tflops']:.0f} TFLOP/s on {torch.cuda.get_device_name()}", "",
             "| model | op | case | T | variant | us | rate | % ceil | baseline us | speedup |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in b.records:
        if r.get("error"):
            lines.append(f"| {r['model']} | {r['op']} | {r['case']} | {r['tokens']} | {r['variant']} | "
                         f"{r['error']} | | | | |")
            continue
        rate = f"{r['tbps']:.2f} TB/s" if "tbps" in r else f"{r['tflops']:.0f} TFLOP/s" if "tflops" in r else ""
        pct = f"{r['pct']:.0f}%" if "pct" in r else ""
        base = f"{r['baseline_us']:.1f}" if "baseline_us" in r else ""
        sp = f"{r['speedup']:.2f}x" if "speedup" in r else ""
        lines.append(f"| {r['model']} | {r['op']} | {r['case']} | {r['tokens']} | {r['variant']} | {r['us']:.1f} | "
                     f"{rate} | {pct} | {base} | {sp} |")
    moe = [r for r in b.records if r["op"] == "fused_moe" and r["variant"] == "auto" and "us" in r
           and r["tokens"] <= 256]
    if moe:
        lines += ["", "MoE decode targets (>= 70% of copy bandwidth on the bytes read; faster than bf16 cuBLAS):"]
        for r in moe:
            ok_bw = r["pct"] >= 70
            ok_base = r.get("speedup", 0) > 1
            lines.append(f"- {r['model']} T={r['tokens']}: {r['pct']:.0f}% {'OK' if ok_bw else 'MISS'}, "
                         f"{r.get('speedup', float('nan')):.2f}x vs baseline {'OK' if ok_base else 'MISS'}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="write all records as JSON here")
    ap.add_argument("--md", type=Path, help="write the markdown table here")
    ap.add_argument("--quick", action="store_true", help="122B only, few sizes")
    ap.add_argument("--full", action="store_true", help="every case (may exceed 6 minutes)")
    ap.add_argument("--sweep-moe", action="store_true", help="time MoE tile configurations (122B) instead")
    ap.add_argument("--sweep-linear", action="store_true", help="time nvfp4_linear configurations (122B) instead")
    ap.add_argument("--budget-s", type=float, default=330.0, help="skip remaining cases after this many seconds")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--ops", default=",".join(OPS), help=f"comma-separated subset of {','.join(OPS)} to time")
    ap.add_argument("--models", default="", help="comma-separated subset of 122B,397B (default: by --quick)")
    ap.add_argument("--tokens", default="", help="token counts for moe and linear (default: by --quick)")
    args = ap.parse_args()
    ops = set(args.ops.split(","))
    unknown = ops - set(OPS)
    if unknown:
        sys.exit(f"--ops: unknown {sorted(unknown)}; choose from {','.join(OPS)}")
    if not torch.cuda.is_available():
        sys.exit("benchmarks/kernels.py needs a CUDA GPU")
    b = Bench(float("inf") if args.full else args.budget_s, args.reps)
    ceilings(b)
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "ceilings": b.ceil}
    if args.sweep_moe or args.sweep_linear:
        result["sweep"] = {"122B": sweep_moe(b, "122B") if args.sweep_moe else sweep_linear(b, "122B")}
    else:
        models = tuple(args.models.split(",")) if args.models else ("122B",) if args.quick else tuple(MODELS)
        if set(models) - set(MODELS):
            sys.exit(f"--models: unknown {sorted(set(models) - set(MODELS))}; choose from {sorted(MODELS)}")
        sizes = (tuple(int(t) for t in args.tokens.split(",")) if args.tokens
                 else (1, 32, 2048) if args.quick else DECODE + PREFILL)
        for model in models:
            if "moe" in ops:
                bench_moe(b, model, sizes, paths=not args.quick, with_baseline=True)
            if "linear" in ops:
                bench_linear(b, model, sizes)
        if "attention" in ops:
            bench_attention(b, models[0], args.full)
        if "verify" in ops:
            bench_verify(b, models[0])
        if "gdn" in ops:
            bench_gdn(b, models[0], args.full)
        if "norm" in ops:
            bench_norm(b, models[0], (1, 256, 8192))
    result["records"] = b.records
    md = markdown(b)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    if args.md:
        args.md.parent.mkdir(parents=True, exist_ok=True)
        args.md.write_text(md + "\n")
    print(md)


if __name__ == "__main__":
    main()
