"""TTFT and step times of a burst of requests through LLMEngine itself (no HTTP), with and without
overlapped scheduling, on one engine (the synchronous mode by patching `_can_overlap`): separates engine
behaviour from the server's threads. GPU only; prints one line per (mode, burst) and a per-step trace."""

from __future__ import annotations

import argparse
import json
import time

import torch

from nibble.engine.config import EngineConfig
from nibble.engine.llm_engine import LLMEngine
from nibble.engine.sampling_params import SamplingParams


def burst(engine: LLMEngine, n: int, input_len: int, output_len: int, tag: str) -> dict:
    gen = torch.Generator().manual_seed(n)
    vocab = engine.model_config.vocab_size
    t0 = time.perf_counter()
    for i in range(n):
        engine.add_request(f"{tag}-{i}", torch.randint(0, vocab, (input_len,), generator=gen).tolist(),
                           SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True))
    first: dict[str, float] = {}
    steps = []
    while engine.has_unfinished_requests():
        s0 = time.perf_counter()
        outs = engine.step()
        now = time.perf_counter()
        steps.append((round((s0 - t0) * 1e3, 1), round((now - s0) * 1e3, 1), len(outs)))
        for o in outs:
            first.setdefault(o.request_id, now - t0)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    ttft = sorted(first.values())
    return {"n": n, "ttft_med_ms": 1e3 * ttft[len(ttft) // 2], "ttft_max_ms": 1e3 * ttft[-1],
            "total_s": time.perf_counter() - t0, "steps": steps[:12]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--bursts", default="1,8,32")
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    engine = LLMEngine(EngineConfig(model=args.model, load_format="dummy", max_model_len=4096, max_num_seqs=128))
    overlap = engine._can_overlap
    burst(engine, 8, 1024, 4, "warm")
    rows = []
    for mode in ("on", "off", "on"):
        engine._can_overlap = overlap if mode == "on" else (lambda: False)  # type: ignore[method-assign]
        for n in (int(x) for x in args.bursts.split(",")):
            r = burst(engine, n, 1024, args.output_len, f"{mode}{n}{len(rows)}")
            r["mode"] = mode
            rows.append(r)
            print(f"{mode:>3} n={n:>3} TTFT med {r['ttft_med_ms']:8.1f} ms max {r['ttft_max_ms']:8.1f} ms "
                  f"total {r['total_s']:.3f} s  steps (start ms, dur ms, outputs) {r['steps']}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
