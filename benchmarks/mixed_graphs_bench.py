"""Short prefills and mixed prefill+decode steps from CUDA graphs (nibble/engine/mixed_graphs.py) against the same
steps run eagerly, on one engine (GPU; eager by setting `runner.mixed_graphs` to None between passes):

- TTFT of one request alone, prompt lengths 16..1024 (fresh random prompts, so no prefix-cache hit), best of
  --repeats;
- a request arriving while --decoders others decode: its TTFT and the durations of the steps until its first
  token, against the decode steps before it.

Prints one line per measurement and writes them as JSON (--out)."""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from nibble.engine.config import EngineConfig
from nibble.engine.llm_engine import LLMEngine
from nibble.engine.sampling_params import SamplingParams


class Prompts:
    def __init__(self, vocab: int) -> None:
        self.vocab = vocab
        self.gen = torch.Generator().manual_seed(0)
        self.count = 0

    def take(self, length: int) -> list[int]:
        return torch.randint(0, self.vocab, (length,), generator=self.gen).tolist()

    def name(self) -> str:
        self.count += 1
        return f"q{self.count}"


def _until_first(engine: LLMEngine, rid: str, t0: float) -> tuple[float, list[float]]:
    """Step until `rid` has an output: (its TTFT in ms, each step's duration in ms)."""
    steps: list[float] = []
    while True:
        s0 = time.perf_counter()
        outs = engine.step()
        steps.append(1e3 * (time.perf_counter() - s0))
        if any(o.request_id == rid for o in outs):
            return 1e3 * (time.perf_counter() - t0), steps
        if len(steps) > 10000:
            raise RuntimeError(f"{rid} produced nothing")


def alone(engine: LLMEngine, prompts: Prompts, length: int) -> float:
    rid = prompts.name()
    t0 = time.perf_counter()
    engine.add_request(rid, prompts.take(length), SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    ttft, _ = _until_first(engine, rid, t0)
    while engine.has_unfinished_requests():
        engine.step()
    return ttft


def arriving(engine: LLMEngine, prompts: Prompts, decoders: int, length: int) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=2048, ignore_eos=True)
    ids = [prompts.name() for _ in range(decoders)]
    for rid in ids:
        engine.add_request(rid, prompts.take(128), params)
    for _ in range(8):  # their prefills, then decode steps
        engine.step()
    decode = []
    for _ in range(10):
        s0 = time.perf_counter()
        engine.step()
        decode.append(1e3 * (time.perf_counter() - s0))
    rid = prompts.name()
    t0 = time.perf_counter()
    engine.add_request(rid, prompts.take(length), SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    ttft, steps = _until_first(engine, rid, t0)
    for r in ids:
        engine.abort_request(r)
    while engine.has_unfinished_requests():
        engine.step()
    return {"decode_step_ms": statistics.median(decode), "ttft_ms": ttft, "steps_ms": [round(s, 2) for s in steps]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--lengths", default="16,64,128,256,512,1024")
    ap.add_argument("--decoders", type=int, default=32)
    ap.add_argument("--arrival-lengths", default="16,64,256")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--modes", default="graph,eager,graph")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    t_start = time.perf_counter()
    engine = LLMEngine(EngineConfig(model=args.model, load_format=args.load_format, max_model_len=4096,
                                    max_num_seqs=64))
    print(f"engine start {time.perf_counter() - t_start:.1f} s", flush=True)
    graphs = engine.runner.mixed_graphs
    print(f"mixed graphs: {graphs.sizes if graphs is not None else None}", flush=True)
    prompts = Prompts(engine.model_config.vocab_size)
    alone(engine, prompts, 64)
    rows = []
    for mode in args.modes.split(","):
        engine.runner.mixed_graphs = graphs if mode == "graph" else None
        for length in (int(x) for x in args.lengths.split(",")):
            ttft = min(alone(engine, prompts, length) for _ in range(args.repeats))
            rows.append({"mode": mode, "test": "alone", "length": length, "ttft_ms": ttft})
            print(f"{mode:>5} alone   L={length:>5}  TTFT {ttft:8.2f} ms", flush=True)
        for length in (int(x) for x in args.arrival_lengths.split(",")):
            r = arriving(engine, prompts, args.decoders, length)
            r.update({"mode": mode, "test": "arriving", "length": length, "decoders": args.decoders})
            rows.append(r)
            print(f"{mode:>5} arrival L={length:>5} with {args.decoders} decoding: TTFT {r['ttft_ms']:8.2f} ms, "
                  f"decode step {r['decode_step_ms']:.2f} ms, steps until the first token {r['steps_ms']}", flush=True)
    engine.runner.mixed_graphs = graphs
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
