"""Time to first token with prefix caching, through LLMEngine itself (no HTTP). For each shared-prefix
length S, requests of S shared tokens plus a short unique tail are sent one at a time: the first computes
everything (nobody to share with), the second discovers the shared prefix (its prefill is cut at the prefix's
last full block and the state copied there), the later ones start from the cached prefix. The baseline is the
same lengths with a fresh prefix every time (no sharing, so nothing is cached). Then a burst of concurrent
requests sharing one cached prefix, against the same burst without sharing. Also checks that a request
served from the cache produces the same greedy tokens as the same prompt computed in full (the first
divergence, if any, is reported: bf16 chunking differences can flip a near-tie late).

Usage: python benchmarks/prefix_cache_bench.py --model DIR [--load-format dummy] [--shared 1024,4096,16384]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from ttft_probe import CompileTrace

from nibble.engine.config import EngineConfig
from nibble.engine.llm_engine import LLMEngine
from nibble.engine.sampling_params import SamplingParams


def _ids(gen: torch.Generator, vocab: int, n: int) -> list[int]:
    return torch.randint(0, min(vocab, 150000), (n,), generator=gen).tolist()


TRACE: CompileTrace | None = None


def _run(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, tag: str, logprobs: int | None = None
         ) -> list[dict]:
    """Send the prompts at once; per request: TTFT (ms), cached tokens, output tokens (and the top
    log-probs of the first one); with them the steps taken and the Triton compilations seen."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)
    if TRACE is not None:
        TRACE.take()
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", p, params)
    first: dict[str, float] = {}
    final: dict[str, tuple[int, list[int], dict]] = {}
    steps = []
    while engine.has_unfinished_requests():
        s0 = time.perf_counter()
        outs = engine.step()
        steps.append(round(1e3 * (time.perf_counter() - s0), 1))
        for o in outs:
            first.setdefault(o.request_id, time.perf_counter() - t0)
            if o.finished:
                lp = o.outputs[0].logprobs
                final[o.request_id] = (o.num_cached_tokens, list(o.outputs[0].token_ids), lp[0].top if lp else {})
    torch.cuda.synchronize()
    compiles = [e["name"] for e in TRACE.take()] if TRACE is not None else []
    return [{"ttft_ms": round(1e3 * first[f"{tag}-{i}"], 1), "cached": final[f"{tag}-{i}"][0],
             "tokens": final[f"{tag}-{i}"][1], "top": final[f"{tag}-{i}"][2], "steps_ms": steps[:6],
             "compiles": compiles} for i in range(len(prompts))]


def _compare(a: dict, b: dict) -> dict:
    """Greedy tokens and first-token top-5 log-probs of two runs of one prompt."""
    common = set(a["top"]) & set(b["top"])
    top = sorted(b["top"].values(), reverse=True)
    return {"first_divergence": next((i for i, (x, y) in enumerate(zip(a["tokens"], b["tokens"])) if x != y), None),
            "top5_common": len(common),
            "max_logprob_diff": max((abs(a["top"][t] - b["top"][t]) for t in common), default=None),
            "top1_top2_margin": top[0] - top[1] if len(top) > 1 else None}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--shared", default="1024,4096,16384")
    ap.add_argument("--tail", type=int, default=64)
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--burst", type=int, default=16)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    global TRACE
    TRACE = CompileTrace()
    engine = LLMEngine(EngineConfig(model=args.model, load_format=args.load_format, max_model_len=32768))
    vocab = engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(0)
    results: dict = {"sequential": [], "burst": [], "same_tokens": []}
    for shared in (int(s) for s in args.shared.split(",")):
        prefix = _ids(gen, vocab, shared)
        tails = [_ids(gen, vocab, args.tail) for _ in range(args.requests)]
        cached = [_run(engine, [prefix + t], 1, f"s{shared}-{i}")[0] for i, t in enumerate(tails)]
        fresh = [_run(engine, [_ids(gen, vocab, shared) + t], 1, f"f{shared}-{i}")[0] for i, t in enumerate(tails)]
        row = {"shared": shared, "tail": args.tail,
               "ttft_ms_sharing": [c["ttft_ms"] for c in cached], "cached_tokens": [c["cached"] for c in cached],
               "ttft_ms_fresh": [c["ttft_ms"] for c in fresh],
               "steps_ms_sharing": [c["steps_ms"] for c in cached], "steps_ms_fresh": [c["steps_ms"] for c in fresh],
               "compiles": [c["compiles"] for c in cached + fresh],
               "median_hit_ms": statistics.median(c["ttft_ms"] for c in cached[2:]),
               "median_fresh_ms": statistics.median(c["ttft_ms"] for c in fresh)}
        results["sequential"].append(row)
        print(json.dumps(row), flush=True)
        # a cache hit against the same prompt computed in full on an emptied cache, in one chunk and cut
        # where the cache cuts it (so that the chunk partition, which moves bf16 results, is the same)
        prompt = prefix + _ids(gen, vocab, args.tail)
        hit = _run(engine, [prompt], 32, f"h{shared}", logprobs=5)[0]
        engine.blocks.clear_prefix_cache()
        full = _run(engine, [prompt], 32, f"u{shared}", logprobs=5)[0]
        engine.blocks.clear_prefix_cache()
        budget = engine.scheduler.max_num_batched_tokens
        engine.scheduler.max_num_batched_tokens = min(shared, budget)
        cut = _run(engine, [prompt], 32, f"c{shared}", logprobs=5)[0]
        engine.scheduler.max_num_batched_tokens = budget
        engine.blocks.clear_prefix_cache()
        check = {"shared": shared, "hit_cached": hit["cached"], "full_cached": full["cached"],
                 "hit_vs_full": _compare(hit, full), "hit_vs_cut": _compare(hit, cut),
                 "full_vs_cut": _compare(full, cut)}
        results["same_tokens"].append(check)
        print(json.dumps(check), flush=True)
    shared = int(args.shared.split(",")[1] if "," in args.shared else args.shared)
    prefix = _ids(gen, vocab, shared)
    _run(engine, [prefix + _ids(gen, vocab, args.tail)] * 2, 1, "prime")
    for sharing in (True, False):
        prompts = [(prefix if sharing else _ids(gen, vocab, shared)) + _ids(gen, vocab, args.tail)
                   for _ in range(args.burst)]
        out = _run(engine, prompts, 16, f"b{int(sharing)}")
        ttft = sorted(o["ttft_ms"] for o in out)
        row = {"burst": args.burst, "shared": shared, "sharing": sharing, "ttft_med_ms": ttft[len(ttft) // 2],
               "ttft_max_ms": ttft[-1], "cached_tokens": sum(o["cached"] for o in out)}
        results["burst"].append(row)
        print(json.dumps(row), flush=True)
    print(json.dumps({"stats": engine.stats()}))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
