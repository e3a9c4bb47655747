"""Focused NVFP4 `fused_moe` benchmark on one CUDA GPU: real Qwen3.5 layer shapes, decode and prefill token
counts, several tile configurations per size, each checked against `fused_moe_ref`, and a compact table last.

    python benchmarks/moe_bench.py --out out/moe.json [--models 122B,35B] [--tokens 1,8,32,128,2048] [--sweep]

A model may also be one rank's share of a tensor- or expert-parallel layer, e.g. `--models 122B/tp2,397B/ep8`
(`spec`): the kernels a rank runs, timed on one GPU.

Per (model, T, variant) it reports two times:
- `cold`: median over CUDA-graph replays of the op alone, L2 flushed (256 MiB write) before each replay;
  comparable to benchmarks/kernels.py (the graph launch itself is inside the measured interval).
- `stream`: one graph of the op on LAYERS different expert stacks in a row, repeated (like consecutive
  layers of a decode step: weights cold in L2, back-to-back launches, no per-op graph launch); time / op.
Bandwidth counts the bytes that must be read (distinct experts hit x bytes per expert incl. scales, plus
x and out); % is of the copy ceiling measured at start (read + write). Prefill also reports TFLOP/s
(2 * pairs * 3 * I * H, the pairs of the experts held) and % of `--gemm-tflops`. `err` is
||out - ref|| / ||ref|| against the fp32 reference on the same weights (bf16 activations: expect ~3e-3;
> 2e-2 is flagged).
Kernel compilation is done first, in parallel worker processes sharing Triton's cache.
A variant's field `"with_route": true` (`--variant rt='{"with_route": true}'`) is the benchmark's, not a tuning
field: the timed op is then the whole routed MoE as the model runs it, the router's top-k (`route`, on the same
logits) and the experts, so that gate_up follows the router instead of the previous layer's down.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import re
import sys
import time
import traceback
from functools import partial
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nibble.bench.gpu_timing import capture_graph, cold_ms, stream_us
from nibble.bench.latency import measure_copy_bandwidth
from nibble.formats.nvfp4 import NVFP4Tensor
from nibble.kernels.fused_moe import fused_moe_launch
from nibble.kernels.moe import MoEWeights, fused_moe_ref, topk_counters
from nibble.kernels.moe_route import route

MAX_ERR = 2e-2  # relative error against the fp32 reference above which a variant is flagged BAD
MODELS = {
    "122B": {"hidden": 3072, "experts": 256, "top_k": 8, "inter": 1024},
    "35B": {"hidden": 2048, "experts": 256, "top_k": 8, "inter": 512},
    "397B": {"hidden": 4096, "experts": 512, "top_k": 10, "inter": 1024},
}


def spec(model: str) -> dict[str, int]:
    """Layer shapes of `model`: a MODELS name, or one rank's share of it, "122B/tp4" (tensor parallel: every
    expert, I / 4 of its features) or "397B/ep8" (expert parallel: 1/8 of the experts, whole; the router still
    chooses among all, and slots routed elsewhere come as id -1). "routed": the router's expert count."""
    name, _, shard = model.partition("/")
    if name not in MODELS:
        raise ValueError(f"unknown model {model!r}: one of {sorted(MODELS)}, optionally /tpN or /epN")
    m = {**MODELS[name], "routed": MODELS[name]["experts"]}
    if not shard:
        return m
    kind, n = shard[:2], int(shard[2:]) if shard[2:].isdigit() else 0
    if kind == "tp" and n > 0 and m["inter"] % (16 * n) == 0:
        return {**m, "inter": m["inter"] // n}
    if kind == "ep" and n > 0 and m["experts"] % n == 0:
        return {**m, "experts": m["experts"] // n}
    raise ValueError(f"bad shard {shard!r} of {name}: tpN with I / N a multiple of 16, or epN dividing the experts")
PREFILL_T = 512  # T above this counts as prefill (TFLOP/s reported)
LAYERS = 4

# Variants: (name, path, config overrides); "auto" = the tuning table's choice, "before:generic" = the
# pre-moe_w4 kernels with their tuning (the baseline of this work).
def _t(bn: int, bk: int, w: int, st: int, pre: str) -> dict:
    return {f"{pre}_block_n": bn, f"{pre}_block_k": bk, f"{pre}_warps": w, f"{pre}_stages": st}


# pairs mode, quad: gate_up variants with the reference down, then down variants with the reference gate_up
GU_REF, DN_REF = {"xmode": "quad", **_t(16, 256, 2, 4, "gu")}, {"dn_mode": "fused", **_t(32, 256, 2, 4, "dn")}
GU_PAIRS = [(f"gu:{bn}x{bk}w{w}s{st}", _t(bn, bk, w, st, "gu")) for bn, bk, w, st in
            ((16, 256, 2, 4), (16, 512, 2, 3), (16, 128, 2, 6), (32, 256, 4, 4), (32, 512, 4, 3), (64, 256, 4, 4),
             (32, 256, 4, 6), (64, 256, 8, 4), (32, 128, 4, 6), (32, 128, 4, 8))]
DN_PAIRS = [(f"dn:{mode}/{bn}x{bk}w{w}s{st}", {"dn_mode": mode, **_t(bn, bk, w, st, "dn")}) for mode, bn, bk, w, st in
            (("fused", 16, 256, 1, 4), ("fused", 64, 256, 4, 4), ("fused", 32, 512, 2, 3), ("fused", 32, 128, 2, 6),
             ("reduce", 32, 256, 2, 4), ("token", 16, 256, 1, 4), ("token", 32, 256, 2, 4), ("fused", 64, 512, 4, 3),
             ("reduce", 64, 256, 4, 4), ("fused", 128, 256, 8, 4), ("fused", 64, 128, 4, 6), ("reduce", 64, 128, 4, 8))]

def _srt(xmode: str, bt: int, g: tuple, d: tuple) -> tuple[str, dict]:
    name = f"srt:{xmode}{bt}/gu{g[0]}x{g[1]}w{g[2]}s{g[3]}/dn{d[0]}x{d[1]}w{d[2]}s{d[3]}"
    return name, {"xmode": xmode, "block_t": bt, **_t(*g, "gu"), **_t(*d, "dn")}


SORTED = [
    _srt("quad", 4, (32, 256, 2, 4), (32, 256, 2, 4)),
    _srt("quad", 4, (32, 256, 4, 4), (64, 256, 4, 4)),
    _srt("quad", 4, (64, 128, 4, 4), (64, 128, 4, 4)),
    _srt("quad", 4, (16, 256, 2, 4), (32, 512, 2, 3)),
    _srt("quad", 8, (32, 256, 4, 4), (64, 256, 4, 4)),
    _srt("quad", 4, (32, 512, 4, 3), (64, 512, 4, 3)),
    _srt("quad", 4, (32, 256, 4, 6), (64, 256, 4, 6)),
    _srt("quad", 4, (64, 256, 8, 4), (128, 256, 8, 4)),
    _srt("quad", 8, (64, 256, 8, 4), (128, 256, 8, 4)),
    _srt("quad", 4, (32, 128, 4, 6), (64, 128, 4, 6)),
    _srt("quad", 4, (32, 128, 4, 8), (64, 128, 4, 8)),
    _srt("quad", 4, (32, 256, 4, 4), (64, 128, 4, 6)),
    _srt("quad", 4, (32, 256, 4, 4), (128, 256, 8, 4)),
    _srt("quad", 4, (64, 256, 4, 4), (64, 256, 4, 4)),
    _srt("quad", 4, (64, 256, 4, 4), (128, 256, 8, 4)),
    _srt("split", 16, (64, 128, 4, 4), (64, 128, 4, 4)),
    _srt("perm", 16, (64, 128, 4, 4), (64, 128, 4, 4)),
    _srt("split", 16, (32, 256, 4, 4), (64, 256, 4, 4)),
    _srt("perm", 16, (32, 256, 4, 4), (64, 256, 4, 4)),
    _srt("perm", 16, (64, 256, 8, 4), (128, 256, 8, 4)),
    _srt("split", 16, (64, 256, 8, 4), (64, 256, 4, 4)),
    _srt("perm", 32, (64, 128, 4, 4), (64, 128, 4, 4)),
    _srt("split", 32, (64, 128, 8, 3), (64, 128, 8, 3)),
]
def _mixed(split: int, q: tuple, lg: tuple) -> tuple[str, dict]:
    """Quad-4 blocks for experts with up to `split` pairs, split-16 blocks (one decode for all their tokens)
    for the others."""
    name = f"mix{split}:quad4/gu{q[0][0]}x{q[0][1]}w{q[0][2]}/dn{q[1][0]}x{q[1][1]}w{q[1][2]}" \
           f"+split16/gu{lg[0][0]}x{lg[0][1]}w{lg[0][2]}/dn{lg[1][0]}x{lg[1][1]}w{lg[1][2]}"
    cfg = {"xmode": "quad", "block_t": 4, **_t(*q[0], "gu"), **_t(*q[1], "dn"), "mixed_max_pairs": split,
           "lg_xmode": "split", "lg_block_t": 16}
    cfg.update({f"lg_{k}": v for k, v in {**_t(*lg[0], "gu"), **_t(*lg[1], "dn")}.items()})
    return name, cfg


_Q4, _S16 = ((32, 256, 4, 4), (64, 256, 4, 4)), ((64, 256, 8, 4), (64, 256, 4, 4))
# wider split-16 tiles: each program re-reads its block's activations from L2 once per BLOCK_N weight rows, as
# many bytes per program as its weights at 16 tokens
_WIDE = [((64, 256, 8, 4), (128, 256, 8, 4)), ((128, 128, 8, 4), (64, 256, 4, 4)), ((128, 128, 8, 4), (128, 128, 8, 4)),
         ((64, 256, 8, 4), (128, 128, 8, 4)), ((128, 128, 8, 3), (128, 256, 8, 3))]
MIXED = [_mixed(4, _Q4, _S16), _mixed(3, _Q4, _S16), _mixed(6, _Q4, _S16), _mixed(8, _Q4, _S16),
         _mixed(4, _Q4, ((32, 256, 4, 4), (64, 256, 4, 4))), *(_mixed(4, _Q4, w) for w in _WIDE),
         _mixed(4, ((32, 256, 4, 4), (128, 256, 8, 4)), _WIDE[0]),
         _mixed(4, ((64, 256, 4, 4), (128, 256, 8, 4)), _WIDE[0])]
PREFILL = [
    _srt("perm", 64, (128, 64, 8, 4), (128, 64, 8, 4)),
    _srt("perm", 128, (128, 64, 8, 3), (128, 64, 8, 3)),
    _srt("perm", 64, (128, 128, 8, 3), (128, 128, 8, 3)),
    _srt("perm", 64, (64, 128, 4, 4), (64, 128, 4, 4)),
    _srt("split", 64, (128, 64, 8, 4), (128, 64, 8, 4)),
]


def variants(model: str, t: int, sweep: bool | str, only: str = "",
             extra: dict[str, dict] | None = None) -> list[tuple[str, str, dict]]:
    """sweep: False, True or a comma-separated list of the models to sweep; only: a regular expression the
    variant names must match (besides "auto"); extra: named overrides of the table's choice (`--variant`),
    timed as "auto:<name>" whatever `only` says."""
    out = _variants(model, t, sweep)
    out = [v for v in out if v[0] == "auto" or re.search(only, v[0])] if only else out
    return out + [(f"auto:{name}", "auto", cfg) for name, cfg in (extra or {}).items()]


def parse_variant(text: str) -> tuple[str, dict]:
    """`NAME=JSON` (a `--variant` argument) -> (name, tuning-field overrides)."""
    name, sep, cfg = text.partition("=")
    try:
        fields = json.loads(cfg) if sep else None
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"--variant {text!r}: {e}") from None
    if not name or not isinstance(fields, dict):
        raise argparse.ArgumentTypeError(f"--variant {text!r}: expected NAME={{json object of tuning fields}}")
    return name, fields


def _variants(model: str, t: int, sweep: bool | str) -> list[tuple[str, str, dict]]:
    out = [("auto", "auto", {}), ("auto:no-pdl", "auto", {"pdl": False}),
           ("auto:dn-prefetch", "auto", {"dn_prefetch": True}), ("auto:gu-prefetch", "auto", {"gu_prefetch": True}),
           ("auto:shift-decode", "auto", {"cvt_decode": False}), ("auto:byte-permute", "auto", {"pair_decode": False}),
           ("auto:no-mixed", "auto", {"mixed_max_pairs": 0}), ("auto:no-dn-prefetch", "auto", {"dn_prefetch": False}),
           ("auto:dn64w4", "auto", {"dn_block_n": 64, "dn_warps": 4}),
           ("auto:lg-dn128x256w8", "auto", {"lg_dn_block_n": 128, "lg_dn_warps": 8}),
           ("auto:lg-dn128x128w8", "auto", {"lg_dn_block_n": 128, "lg_dn_block_k": 128, "lg_dn_warps": 8}),
           ("auto:lg-s3", "auto", {"lg_gu_stages": 3, "lg_dn_stages": 3}),
           # pipeline depths (the eleventh session's table change; gs4ds6 is the 1-token entry before it)
           *((f"auto:gs{g}ds{d}", "auto", {"gu_stages": g, "dn_stages": d}) for g in (2, 3, 4) for d in (2, 3, 4)),
           ("auto:gs4ds6", "auto", {"gu_stages": 4, "dn_stages": 6})]
    out.append(("before:generic", "generic_gemv" if t <= 4 else "generic_sorted", {}))
    if 32 <= t <= 512:
        out += [(name, "sorted", cfg) for name, cfg in MIXED]
    if not sweep or (isinstance(sweep, str) and model not in sweep.split(",")):
        return out
    if t <= 8:
        out.append(("gemv:split/gu32x256w2s4/dn:reduce/64x256w4s3", "gemv",
                     {"xmode": "split", **_t(32, 256, 2, 4, "gu"), "dn_mode": "reduce", **_t(64, 256, 4, 3, "dn")}))
        out += [(name, "gemv", {"xmode": "quad", **cfg, **DN_REF}) for name, cfg in GU_PAIRS]
        out += [(name, "gemv", {**GU_REF, **cfg}) for name, cfg in DN_PAIRS]
    if t <= 8:  # the sorted quad-4 tiles (with the L2 prefetch of down's weights) against the per-pair path
        name, cfg = _srt("quad", 4, (32, 256, 4, 4), (64, 256, 4, 4))
        out += [(name, "sorted", cfg), (f"{name}/pf", "sorted", {**cfg, "dn_prefetch": True})]
    if 8 <= t <= 256:
        out += [(name, "sorted", cfg) for name, cfg in SORTED]
        out += [(name, "sorted", cfg) for name, cfg in (_srt("split", 16, *w) for w in _WIDE)]
    if t > 256:
        out += [(name, "sorted", cfg) for name, cfg in PREFILL]
    return out


def random_experts(model: str, dev: torch.device, gen: torch.Generator, empty: bool = False) -> MoEWeights:
    m = spec(model)
    e, h, inter = m["experts"], m["hidden"], m["inter"]

    def w(n: int, k: int) -> NVFP4Tensor:
        if empty:
            return NVFP4Tensor(torch.empty(e, n, k // 2, dtype=torch.uint8, device=dev),
                               torch.empty(e, n, k // 16, dtype=torch.uint8, device=dev).view(torch.float8_e4m3fn),
                               torch.empty(e, n, device=dev))
        packed = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, device=dev, generator=gen)
        scale = torch.rand(e, n, k // 16, device=dev, generator=gen) * 2 + 0.05
        scale[..., ::7] *= 0.01  # some e4m3 subnormal block scales
        return NVFP4Tensor(packed, scale.to(torch.float8_e4m3fn),
                           (torch.rand(e, n, device=dev, generator=gen) + 0.5) * (0.5 / k ** 0.5))

    return MoEWeights(w(2 * inter, h), w(h, inter), topk_counters(h, dev), num_routed_experts=m["routed"])


def _compile_worker(job: tuple[str, int, str, dict]) -> tuple[str, float, str]:
    model, t, path, cfg = job
    t0 = time.perf_counter()
    try:
        dev = torch.device("cuda")
        m = spec(model)
        experts = random_experts(model, dev, torch.Generator(dev), empty=True)
        x = torch.zeros(t, m["hidden"], device=dev, dtype=torch.bfloat16)
        ids = torch.randint(0, m["experts"], (t, m["top_k"]), dtype=torch.int32, device=dev)
        fused_moe_launch(x, torch.rand(t, m["top_k"], device=dev), ids, experts, path=path,
                         config=moe_fields(cfg)[0])
        torch.cuda.synchronize()
        return f"{model} T={t} {path} {cfg}", time.perf_counter() - t0, ""
    except Exception as ex:  # reported, the main loop records the failure again
        return f"{model} T={t} {path} {cfg}", time.perf_counter() - t0, f"{type(ex).__name__}: {str(ex)[:300]}"


def precompile(jobs: list[tuple[str, int, str, dict]], workers: int) -> None:
    t0 = time.perf_counter()
    ctx = mp.get_context("spawn")
    with ctx.Pool(workers) as pool:
        for name, _secs, err in pool.imap_unordered(_compile_worker, jobs):
            if err:
                print(f"  compile FAILED {name}: {err}", flush=True)
    print(f"precompiled {len(jobs)} launches in {time.perf_counter() - t0:.1f} s with {workers} workers",
          flush=True)


class Timer:
    def __init__(self, reps: int) -> None:
        self.reps = reps
        self.flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")

    def cold_us(self, fn) -> float:
        return 1e3 * cold_ms(capture_graph(fn).replay, self.reps, self.flush)

    def stream_us(self, fns: list, rounds: int = 5, flush: bool = True) -> float:
        """Microseconds per op of one graph replaying `fns` `rounds` times in a row (median of 5 replays);
        flush: zero the L2-sized buffer before each replay."""
        return stream_us(fns, rounds, 5, self.flush if flush else None)


def run(args: argparse.Namespace) -> dict[str, Any]:
    dev = torch.device("cuda")
    models = args.models.split(",")
    tokens = [int(t) for t in args.tokens.split(",")]
    jobs, seen = [], set()
    for model in models:
        for t in tokens:
            for _name, path, cfg in variants(model, t, args.sweep, args.only, dict(args.variant)):
                key = (model, path, json.dumps(cfg, sort_keys=True), t if path == "auto" else t > 8)
                if key not in seen:
                    seen.add(key)
                    jobs.append((model, t, path, cfg))
    if args.workers > 0:
        precompile(jobs, args.workers)
    ceil = measure_copy_bandwidth(dev, 1 << 30) / 1e12
    print(f"copy ceiling {ceil:.2f} TB/s (read+write); GEMM ceiling (given) {args.gemm_tflops:.0f} TFLOP/s",
          flush=True)
    timer = Timer(args.reps)
    records: list[dict[str, Any]] = []
    gen = torch.Generator(dev)
    gen.manual_seed(0)
    stacks = {model: [random_experts(model, dev, gen) for _ in range(LAYERS)] for model in models}
    log = args.out.with_suffix(".jsonl").open("w") if args.out else None
    t_start = time.perf_counter()
    for t in tokens:
        for model in models:
            m = spec(model)
            h, e, k, inter = m["hidden"], m["experts"], m["top_k"], m["inter"]
            layers = stacks[model]
            per_expert = (layers[0].w13.nbytes() + layers[0].w2.nbytes()) / e
            x = torch.randn(t, h, device=dev, dtype=torch.bfloat16, generator=gen)
            logits = torch.randn(t, m["routed"], device=dev, generator=gen)
            w, ids = route(logits, k)
            ids = torch.where(ids < e, ids, -1).to(torch.int32)  # expert parallel: this rank holds experts 0..e-1
            hit = int(torch.unique(ids[ids >= 0]).numel())
            nbytes = hit * per_expert + 2 * t * h * 2
            flops = 2 * int((ids >= 0).sum()) * 3 * inter * h
            ref = fused_moe_ref(x.float(), w, ids, layers[0])
            for name, path, cfg in variants(model, t, args.sweep, args.only, dict(args.variant)):
                if time.perf_counter() - t_start > args.budget_s:
                    print(f"{model} T={t} {name}: skipped (budget)", flush=True)
                    continue
                rec: dict[str, Any] = {"model": model, "T": t, "variant": name, "path": path, "config": cfg,
                                       "experts_hit": hit}
                try:
                    fields, with_route = moe_fields(cfg)
                    if with_route and m["routed"] != e:
                        raise ValueError("with_route: this rank holds only some of the router's experts")
                    if with_route:
                        fns = [partial(routed_moe, x, logits, k, lw, path=path, config=fields) for lw in layers]
                    else:
                        fns = [partial(fused_moe_launch, x, w, ids, lw, path=path, config=fields) for lw in layers]
                    out = fns[0]()
                    torch.cuda.synchronize()
                    diff, den = (out.float() - ref).norm(), ref.norm()
                    # an expert-parallel rank may hold none of a small batch's experts: then out must be 0 too
                    rec["err"] = float(diff / den) if den > 0 else float(diff)
                    rec["cold_us"] = timer.cold_us(fns[0])
                    rec["stream_us"] = timer.stream_us(fns)
                    best = min(rec["cold_us"], rec["stream_us"])
                    rec["tbps"] = nbytes / (best * 1e-6) / 1e12
                    rec["pct_copy"] = 100 * rec["tbps"] / ceil
                    rec["tflops"] = flops / (best * 1e-6) / 1e12
                    rec["pct_gemm"] = 100 * rec["tflops"] / args.gemm_tflops
                    if args.profile:
                        rec["kernels_us"] = kernel_times(fns[0])
                except Exception as ex:
                    rec["error"] = f"{type(ex).__name__}: {str(ex).splitlines()[0][:200] if str(ex) else ''}"
                    traceback.print_exc()
                    torch.cuda.synchronize()
                records.append(rec)
                print(line(rec), flush=True)
                if log:
                    log.write(json.dumps(rec) + "\n")
                    log.flush()
    return {"device": torch.cuda.get_device_name(), "copy_tbps": ceil, "gemm_tflops": args.gemm_tflops,
            "records": records}


def moe_fields(cfg: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """A variant's tuning fields for `fused_moe_launch`, and its benchmark field `with_route`."""
    fields = dict(cfg)
    return fields, bool(fields.pop("with_route", False))


def routed_moe(x: torch.Tensor, logits: torch.Tensor, top_k: int, experts: MoEWeights, **launch: Any
               ) -> torch.Tensor:
    """The model's MoE chain: x [T, H], router logits fp32 [T, E] -> the router's top-k, then the experts."""
    w, ids = route(logits, top_k)
    return fused_moe_launch(x, w, ids, experts, **launch)


def kernel_times(fn, reps: int = 10) -> dict[str, float]:
    """Mean device microseconds per call of each kernel `fn` launches (torch profiler)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for ev in prof.key_averages():
        if ev.device_type.name == "CUDA" and ev.device_time_total > 0:
            out[ev.key[:60]] = ev.device_time_total / reps
    return out


def line(r: dict[str, Any]) -> str:
    head = f"{r['model']:5} T={r['T']:<5} {r['variant']:38}"
    if "error" in r:
        return f"{head} ERROR {r['error']}"
    flag = " BAD" if r["err"] > MAX_ERR or r["err"] != r["err"] else ""
    rate = (f"{r['tflops']:6.0f} TF/s {r['pct_gemm']:4.0f}%" if r["T"] > PREFILL_T
            else f"{r['tbps']:5.2f} TB/s {r['pct_copy']:4.0f}%")
    ks = "".join(f"\n      {v:9.1f} us  {n}" for n, v in r.get("kernels_us", {}).items())
    return (f"{head} cold {r['cold_us']:9.1f} us  stream {r['stream_us']:9.1f} us  {rate}  err {r['err']:.1e}"
            f"{flag}{ks}")


def summary(res: dict[str, Any]) -> str:
    lines = ["", f"== best per size ({res['device']}, copy {res['copy_tbps']:.2f} TB/s)"]
    by: dict[tuple[str, int], list[dict]] = {}
    for r in res["records"]:
        by.setdefault((r["model"], r["T"]), []).append(r)
    for (model, t), rs in by.items():
        ok = [r for r in rs if "error" not in r and r["err"] < MAX_ERR]
        auto = next((r for r in ok if r["variant"] == "auto"), None)
        before = next((r for r in ok if r["variant"] == "before:generic"), None)
        best = min(ok, key=lambda r: r["stream_us"], default=None)
        if best is None:
            lines.append(f"{model} T={t}: no valid variant")
            continue
        lines.append(f"{line({**best, 'kernels_us': {}})}  <- best"
                     + (f" | auto {auto['stream_us']:.1f} us" if auto else "")
                     + (f" | before {before['stream_us']:.1f} us" if before else ""))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="122B,35B")
    ap.add_argument("--tokens", default="1,4,8,32,128,256,1024,2048")
    ap.add_argument("--sweep", nargs="?", const=True, default=False,
                    help="time the tile-configuration variants too (optionally only for these models, e.g. 122B,35B)")
    ap.add_argument("--only", default="", help="regular expression: time only the variants it matches (and auto)")
    ap.add_argument("--variant", type=parse_variant, action="append", default=[], metavar="NAME=JSON",
                    help='also time the table\'s choice with these tuning fields, e.g. gs3=\'{"gu_stages": 3}\'')
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--workers", type=int, default=min(12, os.cpu_count() or 1))
    ap.add_argument("--gemm-tflops", type=float, default=801.0, help="bf16 GEMM ceiling (measured 801 on H200)")
    ap.add_argument("--budget-s", type=float, default=1e9, help="skip variants after this many seconds")
    ap.add_argument("--profile", action="store_true", help="per-kernel times of every variant timed")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/moe_bench.py needs a CUDA GPU")
    res = run(args)
    text = summary(res)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
