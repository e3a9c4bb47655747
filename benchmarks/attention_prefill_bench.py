"""Paged-attention prefill on one GPU at the Qwen3.5 full-attention shapes (head_dim 256, 2 KV heads; 32 query
heads for the 122B/397B, 16 for the 35B): a chunk of query tokens after a cached context, BF16 and FP8 caches.

For each case: the tuning table's tile, with --fp8-gather for FP8 caches that tile through the 16-bit scratch
cache and with the conversion in the kernel (`kv_gather.py`), every tile of --sweep (optionally without the
unmasked loop over the tiles below the diagonal, `causal_split` 0), and with --baseline FILE the same kernel from an
older copy of nibble/kernels/paged_attention.py (an A/B within one run). Each output is compared with the
table's tile (and, for the smallest case, with `paged_attention_ref`); a mismatch is printed BAD and its time is
not kept. Rates count the causal attention FLOPs: 4 * heads * head_dim * q_len * (ctx + q_len / 2).

    python benchmarks/attention_prefill_bench.py --out out/attn.json       # gpu_session.sh attnprefill
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import statistics
from types import ModuleType
from typing import Any

import torch

from nibble.bench.gpu_timing import capture_graph, replay_us
from nibble.kernels import paged_attention as pa
from nibble.kernels.attention import paged_attention_ref

SHAPES = {"122B": 32, "35B": 16}
CASES = ((2048, 0), (8192, 0), (8192, 57344))


def _load(path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location("paged_attention_baseline", path)
    mod = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(mod)
    return mod


def _time_ms(fn: Any, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def _inputs(hq: int, q_len: int, ctx: int, kv_dtype: torch.dtype, page: int = 16) -> tuple:
    hk, d = 2, 256
    total = ctx + q_len
    nb = -(-total // page)
    gen = torch.Generator(device="cuda").manual_seed(0)
    kc = torch.randn(nb + 1, page, hk, d, device="cuda", generator=gen).to(kv_dtype)
    vc = torch.randn(nb + 1, page, hk, d, device="cuda", generator=gen).to(kv_dtype)
    table = torch.randperm(nb, device="cuda").to(torch.int32).view(1, nb)
    q = torch.randn(q_len, hq, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    cu = torch.tensor([0, q_len], dtype=torch.int32, device="cuda")
    lens = torch.tensor([total], dtype=torch.int32, device="cuda")
    return q, kc, vc, cu, lens, table


def _graph_us(fn: Any, launches: int = 20) -> Any:
    """A CUDA graph of `launches` calls of fn, and a function timing one replay per call (µs per launch)."""
    graph = capture_graph(lambda: [fn() for _ in range(launches)])
    return lambda: replay_us(graph, launches)


def _decode_cases(args: argparse.Namespace, base: ModuleType | None) -> list[dict]:
    """Decode and verify steps (1 or 4 query tokens per sequence, split-KV) through the same kernel: the
    table's tile with and without the unmasked loop, and the baseline, so that a prefill gain is not paid for
    in decode. Each variant is a CUDA graph of 20 launches, replayed 5 times back to back, then in 4 rounds over
    all variants (best of the 9 replays kept), so clock ramps and launch overhead do not favour one."""
    rows = []
    page, hk, d = 16, 2, 256
    for model, kv_dtype, (batch, n, ctx) in itertools.product(
            args.models.split(",")[:1], (torch.bfloat16, torch.float8_e4m3fn),
            ((1, 1, 32768), (64, 1, 4096), (256, 1, 2048), (8, 4, 4096), (32, 4, 2048))):
        hq = SHAPES[model]
        nb = batch * ctx // page
        kc = torch.randn(nb + 1, page, hk, d, device="cuda").to(kv_dtype)
        vc = torch.randn(nb + 1, page, hk, d, device="cuda").to(kv_dtype)
        table = torch.randperm(nb, device="cuda").to(torch.int32).view(batch, ctx // page)
        q = torch.randn(batch * n, hq, d, device="cuda", dtype=torch.bfloat16)
        cu = torch.arange(batch + 1, dtype=torch.int32, device="cuda") * n
        lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
        call = (q, kc, vc, cu, lens, table, d ** -0.5, 1.0, 1.0, n, ctx)
        ref_out = pa.paged_attention_launch(*call)
        tag = "fp8" if kv_dtype == torch.float8_e4m3fn else "bf16"
        variants: list[tuple[str, Any, dict]] = [
            ("table", pa.paged_attention_launch, {}),
            ("no-split", pa.paged_attention_launch, {"causal_split": 0}),
            ("split", pa.paged_attention_launch, {"causal_split": 1})]
        if base is not None:
            variants.append(("baseline", base.paged_attention_launch, {}))
        timers, errs = [], []
        for _, fn, cfg in variants:
            out = fn(*call, config=cfg or None)
            errs.append((out.float() - ref_out.float()).abs().max().item())
            timers.append(_graph_us(lambda fn=fn, cfg=cfg, call=call: fn(*call, config=cfg or None)))
        best = [min(t() for _ in range(5)) for t in timers]  # 5 back to back each, then 4 rounds over all
        for _ in range(4):
            best = [min(b, t()) for b, t in zip(best, timers)]
        for (name, _, cfg), us, err in zip(variants, best, errs):
            tbs = 2 * batch * ctx * hk * d * kc.element_size() / us / 1e6
            rows.append({"model": model, "kv": tag, "decode_batch": batch, "query_len": n, "ctx": ctx,
                         "variant": name, "config": cfg, "us": us, "tb_s": tbs, "err": err})
            print(f"{model} {tag:4} {'decode' if n == 1 else 'verify'} B={batch:3} n={n} ctx={ctx:6} {name:8} "
                  f"{us:9.1f} us {tbs:5.2f} TB/s err {err:.1e}", flush=True)
        del kc, vc, timers
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="122B,35B")
    ap.add_argument("--sweep", default="64:64:8:2:0,64:32:8:2,64:64:8:2,128:32:8:2,128:64:8:2,64:32:4:2,64:32:8:3,"
                                       "128:32:8:3",
                    help="rows:block_n:num_warps:num_stages[:causal_split 0/1] tiles, comma-separated ('' = none)")
    ap.add_argument("--baseline", default=None, help="an older paged_attention.py to time beside the current one")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-prefill", action="store_true", help="decode and verify cases only")
    ap.add_argument("--no-decode", action="store_true", help="prefill cases only")
    ap.add_argument("--cases", default=None, help="prefill cases as q_len:ctx, comma-separated (default: "
                    + ",".join(f"{a}:{b}" for a, b in CASES) + ")")
    ap.add_argument("--fp8-gather", action="store_true",
                    help="FP8 cases also with the table's tile through the 16-bit scratch cache (fp8_gather on) "
                         "and converting in the kernel (off)")
    args = ap.parse_args()
    base = _load(args.baseline) if args.baseline else None
    tiles = []
    for spec in filter(None, args.sweep.split(",")):
        tile = dict(zip(("rows", "block_n", "num_warps", "num_stages", "causal_split"), map(int, spec.split(":"))))
        tile.setdefault("causal_split", 1)
        tiles.append(tile)
    rows = []
    cases = CASES if args.cases is None else [tuple(map(int, c.split(":"))) for c in args.cases.split(",")]
    cases = () if args.no_prefill else cases
    for model, kv_dtype, (q_len, ctx) in itertools.product(args.models.split(","),
                                                            (torch.bfloat16, torch.float8_e4m3fn), cases):
        hq = SHAPES[model]
        q, kc, vc, cu, lens, table = _inputs(hq, q_len, ctx, kv_dtype)
        call = (q, kc, vc, cu, lens, table, 256 ** -0.5, 1.0, 1.0, q_len, ctx + q_len)
        flops = 4 * hq * 256 * q_len * (ctx + q_len / 2)
        ref_out = pa.paged_attention_launch(*call)
        if ctx == 0 and q_len <= 2048:
            exact = paged_attention_ref(*call[:9])
            err = (ref_out.float() - exact.float()).abs().max().item()
            print(f"{model} {kv_dtype} T={q_len} ctx={ctx}: table tile vs reference max err {err:.1e}", flush=True)
        variants: list[tuple[str, Any, dict]] = [("table", pa.paged_attention_launch, {})]
        if base is not None:
            variants.append(("baseline", base.paged_attention_launch, {}))
        if args.fp8_gather and kv_dtype == torch.float8_e4m3fn:
            variants += [("gather", pa.paged_attention_launch, {"fp8_gather": True, "fp8_gather_min_seq_len": 0}),
                         ("direct", pa.paged_attention_launch, {"fp8_gather": False})]
        variants += [("sweep", pa.paged_attention_launch, t) for t in tiles]
        tag = "fp8" if kv_dtype == torch.float8_e4m3fn else "bf16"
        for name, fn, cfg in variants:
            try:
                out = fn(*call, config=cfg or None)
                err = (out.float() - ref_out.float()).abs().max().item()
                ms = _time_ms(lambda fn=fn, cfg=cfg, call=call: fn(*call, config=cfg or None), args.reps)
            except Exception as e:  # a tile that does not fit this GPU's shared memory
                print(f"{model} {tag} T={q_len} ctx={ctx} {name} {cfg}: failed {type(e).__name__}", flush=True)
                continue
            bad = not err < 2e-2
            row = {"model": model, "kv": tag, "q_len": q_len, "ctx": ctx, "variant": name, "config": cfg,
                   "ms": ms, "tflops": flops / ms / 1e9, "err": err, "bad": bad}
            rows.append(row)
            print(f"{model} {tag:4} T={q_len:5} ctx={ctx:6} {name:8} {json.dumps(cfg):70} {ms:8.3f} ms "
                  f"{row['tflops']:6.1f} TFLOP/s err {err:.1e}{' BAD' if bad else ''}", flush=True)
        del q, kc, vc
        torch.cuda.empty_cache()
    if not args.no_decode:
        rows += _decode_cases(args, base)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
