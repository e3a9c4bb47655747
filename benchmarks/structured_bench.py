"""Cost of structured outputs in decode: batches of requests through LLMEngine itself (no HTTP), free
(overlapped scheduling on, then off) and under a JSON schema (which turns the overlap off: each step's
bitmask depends on the token sampled by the step before). Prints per mode the median decode step, the
host time spent filling bitmasks per step. GPU or CPU;
needs a tokenizer (--tokenizer) for the constraint."""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from nibble.engine.config import EngineConfig
from nibble.engine.llm_engine import LLMEngine
from nibble.engine.sampling_params import SamplingParams
from nibble.engine.structured_output import StructuredOutputsParams

# an object with one long string: every request decodes until max_tokens, the same number of steps as the
# free ones, with the bitmask of a JSON string (most of the vocabulary allowed) every step
SCHEMA = {"type": "object", "properties": {"text": {"type": "string", "minLength": 4096}}, "required": ["text"],
          "additionalProperties": False}


def run_batch(engine: LLMEngine, n: int, input_len: int, output_len: int, mode: str, tag: str,
              fill_times: list[float]) -> dict:
    gen = torch.Generator().manual_seed(n)
    vocab = engine.model_config.vocab_size
    so = StructuredOutputsParams(json=SCHEMA) if mode == "json" else None
    for i in range(n):
        engine.add_request(f"{tag}-{i}", torch.randint(0, vocab, (input_len,), generator=gen).tolist(),
                           SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True,
                                          structured_outputs=so))
    steps: list[float] = []
    texts: dict[str, str] = {}
    fill_times.clear()
    while engine.has_unfinished_requests():
        s0 = time.perf_counter()
        outs = engine.step()
        steps.append(time.perf_counter() - s0)
        for o in outs:
            if o.finished:
                texts[o.request_id] = o.outputs[0].text
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    decode = steps[3:] or steps  # past the prefill steps and the first decode steps
    parsed = 0
    for t in texts.values():
        try:
            json.loads(t)
            parsed += 1
        except json.JSONDecodeError:
            pass
    return {"mode": mode, "n": n, "steps": len(steps), "step_med_ms": 1e3 * statistics.median(decode),
            "fill_ms_per_step": 1e3 * sum(fill_times) / max(len(fill_times), 1), "parsed": parsed,
            "finished": len(texts)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    t0 = time.perf_counter()
    engine = LLMEngine(EngineConfig(model=args.model, tokenizer=args.tokenizer, load_format="dummy",
                                    max_model_len=4096, max_num_seqs=128))
    print(f"engine start {time.perf_counter() - t0:.1f} s", flush=True)
    backend = engine.structured_output_backend()
    t0 = time.perf_counter()
    backend.prepare()
    print(f"grammar tokenizer view {time.perf_counter() - t0:.2f} s (after the warm-up: already built)", flush=True)
    fill_times: list[float] = []
    fill = backend.fill_bitmask

    def timed_fill(states):
        s0 = time.perf_counter()
        mask = fill(states)
        fill_times.append(time.perf_counter() - s0)
        return mask

    backend.fill_bitmask = timed_fill  # type: ignore[method-assign]
    overlap = engine._can_overlap
    run_batch(engine, 4, args.input_len, 8, "json", "warm", fill_times)
    rows = []
    for n in (int(x) for x in args.batches.split(",")):
        for mode in ("free", "free-sync", "json"):
            engine._can_overlap = (lambda: False) if mode == "free-sync" else overlap  # type: ignore[method-assign]
            r = run_batch(engine, n, args.input_len, args.output_len, mode, f"{mode}{n}", fill_times)
            rows.append(r)
            print(f"n={n:>3} {mode:>9}: decode step {r['step_med_ms']:7.2f} ms (median, {r['steps']} steps); "
                  f"bitmask fill {r['fill_ms_per_step']:.2f} ms/step", flush=True)
        engine._can_overlap = overlap  # type: ignore[method-assign]
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
