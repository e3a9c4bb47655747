"""TTFT and step times of a burst of requests through LLMEngine itself (no HTTP), with and without
overlapped scheduling, on one engine (the synchronous mode by patching `_can_overlap`): separates engine
behaviour from the server's threads. GPU only; prints one line per (mode, burst) and a per-step trace.
--trace-compiles lists, per burst, every Triton kernel compiled (or loaded from the disk cache) in it, with
its specialisation and the seconds it took: the first-use cost of new shapes."""

from __future__ import annotations

import argparse
import json
import time

import torch
import triton

from nibble.engine.config import EngineConfig
from nibble.engine.llm_engine import LLMEngine
from nibble.engine.sampling_params import SamplingParams


class CompileTrace:
    """Records Triton JIT compilations through triton.knobs' pre/post compile hooks."""

    def __init__(self) -> None:
        self.events: list[dict] = []
        self._start: dict[int, float] = {}
        triton.knobs.runtime.jit_cache_hook = self._pre
        triton.knobs.runtime.jit_post_compile_hook = self._post

    def _pre(self, *, key, repr, fn, compile, is_manual_warmup, already_compiled) -> bool:
        self._start[id(fn.jit_function)] = time.perf_counter()
        return False

    def _post(self, *, key, repr, fn, compile, is_manual_warmup, already_compiled) -> None:
        t = time.perf_counter() - self._start.pop(id(fn.jit_function), time.perf_counter())
        self.events.append({"name": fn.name, "s": round(t, 3), "repr": repr})

    def take(self) -> list[dict]:
        out, self.events = self.events, []
        return out


def burst(engine: LLMEngine, n: int, input_len: int, output_len: int, tag: str, random_lens: bool = False) -> dict:
    gen = torch.Generator().manual_seed(n)
    vocab = engine.model_config.vocab_size
    t0 = time.perf_counter()
    for i in range(n):
        length = int(torch.randint(16, 2 * input_len, (1,), generator=gen)) if random_lens else input_len
        engine.add_request(f"{tag}-{i}", torch.randint(0, vocab, (length,), generator=gen).tolist(),
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
    ap.add_argument("--modes", default="on,off,on", help="overlapped scheduling per pass over the bursts")
    ap.add_argument("--random-lens", action="store_true", help="prompt lengths drawn from 16..2047")
    ap.add_argument("--no-warm-burst", action="store_true", help="skip the 8-request burst before timing")
    ap.add_argument("--trace-compiles", action="store_true")
    ap.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=None,
                    help="EngineConfig.warmup (default: the engine's default)")
    args = ap.parse_args()
    trace = CompileTrace() if args.trace_compiles else None
    extra = {} if args.warmup is None else {"warmup": args.warmup}
    t_start = time.perf_counter()
    engine = LLMEngine(EngineConfig(model=args.model, load_format="dummy", max_model_len=4096, max_num_seqs=128,
                                    **extra))
    print(f"engine start {time.perf_counter() - t_start:.1f} s", flush=True)
    if trace is not None:
        ev = trace.take()
        print(f"start-up: {len(ev)} compiles, {sum(e['s'] for e in ev):.1f} s", flush=True)
    overlap = engine._can_overlap
    if not args.no_warm_burst:
        burst(engine, 8, 1024, 4, "warm")
    rows = []
    for mode in args.modes.split(","):
        engine._can_overlap = overlap if mode == "on" else (lambda: False)  # type: ignore[method-assign]
        for n in (int(x) for x in args.bursts.split(",")):
            r = burst(engine, n, 1024, args.output_len, f"{mode}{n}{len(rows)}", args.random_lens)
            r["mode"] = mode
            rows.append(r)
            print(f"{mode:>3} n={n:>3} TTFT med {r['ttft_med_ms']:8.1f} ms max {r['ttft_max_ms']:8.1f} ms "
                  f"total {r['total_s']:.3f} s  steps (start ms, dur ms, outputs) {r['steps']}", flush=True)
            if trace is not None:
                ev = trace.take()
                r["compiles"] = ev
                print(f"    {len(ev)} compiles, {sum(e['s'] for e in ev):.2f} s", flush=True)
                for e in ev:
                    print(f"      {e['s']:6.3f} s  {e['repr'][:400]}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
