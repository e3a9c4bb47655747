"""Where does a decode step's time go? For a dummy-weight model on the GPU: pure CUDA-graph replay time per
batch size, the engine's whole step (scheduling, input copies, sampling, detokenization), and torch
profiler tables of the CUDA kernels of one decode graph replay (with the number of kernels per step) and of
one eager prefill chunk.

    python benchmarks/profile_decode.py --model benchmarks/models/Qwen3.5-35B-A3B-NVFP4 --out $OUT/profile
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from nibble.engine.config import EngineConfig
from nibble.engine.llm_engine import LLMEngine
from nibble.engine.sampling_params import SamplingParams
from nibble.layers.forward_batch import ForwardBatch


def _graph_ms(engine: LLMEngine, bs: int, iters: int = 50) -> float:
    graphs = engine.runner.graphs
    assert graphs is not None
    g = graphs.graphs[graphs.padded_size(bs)]
    for _ in range(5):
        g.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def _kernel_table(fn, path: Path, rows: int = 40, cpu: bool = True) -> tuple[list[dict], int]:
    """Top kernels of one call of fn by device time, and the number of kernel launches it made. cpu=False
    records CUDA activity only (a graph replay: its kernels, no host ops)."""
    acts = [ProfilerActivity.CUDA, ProfilerActivity.CPU] if cpu else [ProfilerActivity.CUDA]
    with profile(activities=acts) as prof:
        fn()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA" or getattr(e, "self_device_time_total", 0)]
    events.sort(key=lambda e: getattr(e, "self_device_time_total", 0), reverse=True)
    total = sum(getattr(e, "self_device_time_total", 0) for e in events)
    launches = sum(e.count for e in events if e.device_type.name == "CUDA")
    out = [{"name": e.key[:90], "count": e.count, "us": getattr(e, "self_device_time_total", 0),
            "pct": 100 * getattr(e, "self_device_time_total", 0) / max(total, 1)} for e in events[:rows]]
    path.write_text(json.dumps({"total_us": total, "launches": launches, "kernels": out}, indent=1))
    return out, launches


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--context-len", type=int, default=1024)
    ap.add_argument("--out", default="profile")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    engine = LLMEngine(EngineConfig(model=args.model, load_format="dummy", max_num_seqs=max(sizes),
                                    max_model_len=args.context_len + 256))
    vocab = engine.model_config.vocab_size
    summary = {}
    for bs in sizes:
        for i in range(bs):
            engine.add_request(f"p{bs}-{i}", torch.randint(0, vocab, (args.context_len,)).tolist(),
                               SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
        while any(r.num_output_tokens == 0 for r in engine.requests.values()):
            engine.step()
        step_ms = []
        for _ in range(20):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            engine.step()
            torch.cuda.synchronize()
            step_ms.append((time.perf_counter() - t0) * 1e3)
        graph_ms = _graph_ms(engine, bs)
        graphs = engine.runner.graphs
        assert graphs is not None
        replay = graphs.graphs[graphs.padded_size(bs)].replay
        table, launches = _kernel_table(replay, out / f"decode_bs{bs}.json", cpu=False)
        collectives = sum(r["count"] for r in table if "nccl" in r["name"].lower())
        summary[bs] = {"engine_step_ms": statistics.median(step_ms), "graph_replay_ms": graph_ms,
                       "kernels_per_step": launches, "collective_kernels": collectives, "top_kernels": table[:12]}
        print(f"bs={bs}: engine step {statistics.median(step_ms):.2f} ms, graph replay {graph_ms:.2f} ms, "
              f"{launches} kernels per step ({collectives} collectives)")
        for row in table[:15]:
            print(f"   {row['pct']:5.1f}% {row['us']:9.0f}us x{row['count']:<4} {row['name']}")
        for rid in list(engine.requests):
            engine.abort_request(rid)
    prompt = torch.randint(0, vocab, (args.context_len,)).tolist()
    slot = 1
    engine.runner.caches.reset_state_slots([slot])
    nblk = -(-args.context_len // engine.config.block_size)
    batch = ForwardBatch.build([prompt], [0], [list(range(1, nblk + 1))], [slot], engine.config.block_size,
                               engine.device)

    def prefill() -> None:
        with torch.inference_mode():
            engine.model(batch, engine.runner.caches)

    prefill()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    prefill()
    torch.cuda.synchronize()
    pre_ms = (time.perf_counter() - t0) * 1e3
    table, _ = _kernel_table(prefill, out / "prefill.json")
    print(f"prefill {args.context_len} tokens: {pre_ms:.1f} ms")
    for row in table[:15]:
        print(f"   {row['pct']:5.1f}% {row['us']:9.0f}us x{row['count']:<4} {row['name']}")
    summary["prefill_ms"] = pre_ms
    (out / "summary.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
