"""Decode throughput with speculative decoding (the MTP head's drafts, or n-gram prompt lookup with
`--method ngram`), through LLMEngine itself (no HTTP), on one GPU.

With generated (dummy) weights the MTP head's drafts are random and almost never accepted; and greedy
tokens of a random model are near-ties that any change of batch row flips, so even the engine's own
earlier tokens are not accepted as drafts. So besides the head's own drafts, each configuration runs with
forced acceptance at rate alpha: before acceptance, each draft is replaced, with probability alpha, by the
target's own arg-max at its position, and the engine accepts drafts up to the first one that was not. The
work timed (verify step, acceptance, the head's drafting pass, all from CUDA graphs as in serving) is that
of a head whose per-draft acceptance is alpha; the tokens themselves are not meaningful. Under n-gram
speculation the timed work is the verify step, acceptance and the engine's prompt lookup (no drafting pass).

Per configuration: median wall ms per decode step, tokens per step, output tok/s over the decode phase, and
the acceptance seen.

Usage: python benchmarks/spec_decode_bench.py --model DIR [--load-format dummy] [--method mtp|ngram] [--ks 1,3]
       [--batches 1,8]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import torch

import nibble.engine.spec_steps as spec_steps
from nibble.engine.config import EngineConfig
from nibble.engine.llm_engine import LLMEngine
from nibble.engine.sampling_params import SamplingParams
from nibble.engine.spec_sampler import accept_drafts


def _prompts(vocab: int, batch: int, length: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(batch)
    return [torch.randint(0, min(vocab, 150000), (length,), generator=gen).tolist() for _ in range(batch)]


def _decode(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, alpha: float | None) -> dict:
    """Run the prompts to max_tokens; time the steps after every prefill is done."""
    gen = torch.Generator(device=engine.device).manual_seed(7)

    def forced(logits, drafts, *args):  # type: ignore[no-untyped-def]
        target = logits.argmax(dim=-1)[:, :-1]
        keep = torch.rand(drafts.shape, generator=gen, device=drafts.device) < alpha
        return accept_drafts(logits, torch.where(keep, target, drafts), *args)

    if alpha is not None:
        spec_steps.accept_drafts = forced
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    times, tokens = [], []
    draft0, acc0 = engine.num_draft_tokens, engine.num_accepted_tokens
    while engine.has_unfinished_requests():
        prefilling = any(r.num_tokens - r.num_computed_tokens > 1 for r in engine.scheduler.running) \
            or bool(engine.scheduler.waiting)
        before = engine.num_generated_tokens
        t0 = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        if not prefilling:
            times.append(dt)
            tokens.append(engine.num_generated_tokens - before)
    spec_steps.accept_drafts = accept_drafts
    drafted = engine.num_draft_tokens - draft0
    return {"step_ms": round(1e3 * statistics.median(times), 3), "tokens_per_step": round(sum(tokens) / len(times), 3),
            "tok_s": round(sum(tokens) / sum(times), 1), "steps": len(times),
            "acceptance": round((engine.num_accepted_tokens - acc0) / drafted, 4) if drafted else None}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--method", default="mtp", choices=("mtp", "ngram"))
    ap.add_argument("--ks", default="0,1,3", help="draft counts to run (0: plain decoding)")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--alphas", default="1.0,0.8,0.6")
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=96)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    results: list[dict] = []
    for k in (int(x) for x in args.ks.split(",")):
        t0 = time.perf_counter()
        # no start-up warm-up: the timed steps are graph replays (compiled at capture) and prefills are not timed
        engine = LLMEngine(EngineConfig(model=args.model, load_format=args.load_format, max_model_len=4096,
                                        max_num_seqs=max(batches), num_speculative_tokens=k, warmup=False,
                                        speculative_method=args.method))
        print(f"k={k}: engine ready in {time.perf_counter() - t0:.0f} s", flush=True)
        for batch in batches:
            prompts = _prompts(engine.model_config.vocab_size, batch, args.input_len)
            runs = [("own", None), *((f"forced{a}", float(a)) for a in args.alphas.split(","))] if k \
                else [("plain", None)]
            for name, alpha in runs:
                row = {"method": args.method if k else "none", "k": k, "batch": batch, "drafts": name,
                        **_decode(engine, prompts, args.output_len, alpha)}
                print(json.dumps(row), flush=True)
                results.append(row)
        del engine
        gc.collect()
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
