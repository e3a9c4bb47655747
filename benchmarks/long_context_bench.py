"""Long context past the pretraining length (YaRN, as the README's long-context recipe): one request whose prompt is
--length random tokens, run twice with different prefill chunk sizes (--max-num-batched-tokens), each run in its own
process so that each gets the whole GPU.

Per run: the prefill time (TTFT), the median decode step at that context (split-KV attention over the whole
prompt), the KV-cache capacity and peak GPU memory. Checks: every log-probability is finite, and the two runs agree
on the first generated token and its log-probability, up to --tolerance (a different chunking only changes the
order in which attention and the Gated DeltaNet recurrence sum, so the two logits may differ only by rounding).

    python benchmarks/long_context_bench.py --model benchmarks/models/Qwen3.5-35B-A3B-NVFP4 --length 300000

Prints one line per run and a verdict, writes the runs as JSON (--out); exits 1 when a check fails."""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

QWEN_YARN = {"mrope_interleaved": True, "mrope_section": [11, 11, 10], "rope_type": "yarn", "rope_theta": 10000000,
             "partial_rotary_factor": 0.25}


def yarn_overrides(model_dir: str, factor: float) -> dict[str, Any]:
    """--hf-overrides turning on YaRN with `factor` over the checkpoint's max_position_embeddings."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    text = config.get("text_config", config)
    rope = {**text.get("rope_parameters", QWEN_YARN), "rope_type": "yarn", "factor": factor,
            "original_max_position_embeddings": text["max_position_embeddings"]}
    return {"text_config": {"rope_parameters": rope}} if "text_config" in config else {"rope_parameters": rope}


def run_once(args: argparse.Namespace, chunk: int) -> dict[str, Any]:
    import torch

    from nibble.engine.config import EngineConfig
    from nibble.engine.llm_engine import LLMEngine
    from nibble.engine.sampling_params import SamplingParams

    t0 = time.perf_counter()
    config = EngineConfig(model=args.model, load_format=args.load_format, max_model_len=args.max_model_len,
                          max_num_batched_tokens=chunk, max_num_seqs=4, enable_prefix_caching=False,
                          hf_overrides=yarn_overrides(args.model, args.yarn_factor), device=args.device,
                          kv_cache_dtype=args.kv_cache_dtype)
    engine = LLMEngine(config)
    start_s = time.perf_counter() - t0
    vocab = engine.model_config.vocab_size
    prompt = torch.randint(0, vocab, (args.length,), generator=torch.Generator().manual_seed(args.seed)).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=args.decode_steps + 1, ignore_eos=True, logprobs=5)
    t1 = time.perf_counter()
    engine.add_request("long", prompt, params)
    first_ms, steps, final = None, [], None
    while engine.has_unfinished_requests():
        s0 = time.perf_counter()
        outs = engine.step()
        now = time.perf_counter()
        if first_ms is not None:
            steps.append(1e3 * (now - s0))
        for out in outs:
            if out.error:
                raise RuntimeError(f"request failed: {out.error}")
            if first_ms is None and out.outputs[0].token_ids:
                first_ms = 1e3 * (now - t1)
            if out.finished:
                final = out
    if final is None or first_ms is None:
        raise RuntimeError("no output")
    completion = final.outputs[0]
    logprobs = completion.logprobs or []
    finite = all(math.isfinite(lp.logprob) and all(math.isfinite(v) for v in lp.top.values()) for lp in logprobs)
    steps.sort()
    on_gpu = torch.cuda.is_available() and engine.runner.device.type == "cuda"
    return {"chunk": chunk, "length": args.length, "start_s": round(start_s, 1), "ttft_ms": round(first_ms, 1),
            "prefill_tok_s": round(args.length / first_ms * 1e3, 1),
            "decode_step_ms": round(steps[len(steps) // 2], 3) if steps else None,
            "token_ids": completion.token_ids, "first_logprob": logprobs[0].logprob if logprobs else None,
            "first_top": {str(k): v for k, v in logprobs[0].top.items()} if logprobs else {},
            "all_finite": finite, "kv_cache_tokens": engine.runner.num_blocks * engine.config.block_size,
            "peak_gpu_gb": round(torch.cuda.max_memory_allocated() / 2**30, 1) if on_gpu else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--length", type=int, default=300000)
    ap.add_argument("--yarn-factor", type=float, default=4.0)
    ap.add_argument("--max-model-len", type=int, default=None, help="default: length + decode steps + 16")
    ap.add_argument("--chunks", default="8192,16384", help="the runs' --max-num-batched-tokens")
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--tolerance", type=float, default=0.05, help="largest |difference| of first-token logprobs")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--worker-chunk", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.max_model_len is None:
        args.max_model_len = args.length + args.decode_steps + 16
    if args.worker_chunk is not None:
        Path(args.worker_out).write_text(json.dumps(run_once(args, args.worker_chunk)))
        return
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for chunk in (int(c) for c in args.chunks.split(",")):
            out = Path(tmp) / f"run{chunk}.json"
            cmd = [sys.executable, __file__, *sys.argv[1:], "--worker-chunk", str(chunk), "--worker-out", str(out)]
            proc = subprocess.run(cmd)
            if proc.returncode != 0 or not out.exists():
                print(f"chunk {chunk}: the run failed (exit {proc.returncode})", flush=True)
                sys.exit(1)
            run = json.loads(out.read_text())
            runs.append(run)
            print(f"chunk {chunk:>6}: prompt {run['length']} tokens, TTFT {run['ttft_ms'] / 1e3:.2f} s "
                  f"({run['prefill_tok_s']:.0f} tok/s), decode step {run['decode_step_ms']} ms, KV cache "
                  f"{run['kv_cache_tokens']} tokens, peak {run['peak_gpu_gb']} GB, start {run['start_s']} s, "
                  f"finite {run['all_finite']}, tokens {run['token_ids'][:8]}", flush=True)
    ok = all(r["all_finite"] for r in runs)
    ref = runs[0]
    verdict = {"all_finite": ok, "same_first_token": True, "max_first_logprob_diff": 0.0}
    for run in runs[1:]:
        verdict["same_first_token"] &= run["token_ids"][0] == ref["token_ids"][0]
        diff = abs(run["first_logprob"] - ref["first_logprob"])
        verdict["max_first_logprob_diff"] = max(verdict["max_first_logprob_diff"], diff)
        verdict["same_tokens"] = sum(a == b for a, b in zip(run["token_ids"], ref["token_ids"]))
    ok = ok and verdict["same_first_token"] and verdict["max_first_logprob_diff"] <= args.tolerance
    verdict["pass"] = ok
    print(f"verdict: {verdict}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"runs": runs, "verdict": verdict}, indent=1))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
