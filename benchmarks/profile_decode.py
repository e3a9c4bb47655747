"""Where does a decode step's time go? For a dummy-weight model on the GPU: pure CUDA-graph replay time per
batch size, the engine's whole step (scheduling, input copies, sampling, detokenization), and torch
profiler tables of the CUDA kernels of one decode graph replay (with the number of kernels per step) and of
one eager prefill chunk, with its wall time against its kernel time and the host syncs it makes.

    python benchmarks/profile_decode.py --model benchmarks/models/Qwen3.5-35B-A3B-NVFP4 --out $OUT/profile
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import json
import pstats
import statistics
import time
import warnings
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from nibble.engine.config import EngineConfig
from nibble.engine.llm_engine import LLMEngine
from nibble.engine.sampling_params import SamplingParams
from nibble.layers.forward_batch import ForwardBatch


def host_profile(fn, *args, top_own: int, top_cumulative: int) -> str:
    """cProfile of one call of fn(*args) (the device synchronised after it): the top functions by own time,
    then by cumulative time."""
    prof = cProfile.Profile()
    prof.runcall(fn, *args)
    torch.cuda.synchronize()
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("tottime").print_stats(top_own)
    stats.sort_stats("cumulative").print_stats(top_cumulative)
    return text.getvalue()


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


def _kernel_table(fn, path: Path, rows: int = 40, cpu: bool = True) -> tuple[list[dict], int, float]:
    """Top kernels of one call of fn by device time, the number of kernel launches it made and their total
    device time (µs). cpu=False
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
    return out, launches, total


def _wall_ms(fn) -> float:
    """Host wall time of one call of fn with the GPU drained before and after, ms."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def _syncs(fn) -> dict[str, int]:
    """Where one call of fn makes the host wait for the device (torch's sync debug mode), by count."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    where = collections.Counter(f"{Path(w.filename).name}:{w.lineno}" for w in caught
                                if "synchroniz" in str(w.message))
    return dict(where.most_common())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--context-len", type=int, default=1024)
    ap.add_argument("--out", default="profile")
    ap.add_argument("--prefill-only", action="store_true", help="skip the decode batch sizes")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    engine = LLMEngine(EngineConfig(model=args.model, load_format="dummy", max_num_seqs=max(sizes),
                                    max_model_len=args.context_len + 256))
    vocab = engine.model_config.vocab_size
    summary = {}
    for bs in [] if args.prefill_only else sizes:
        for i in range(bs):
            engine.add_request(f"p{bs}-{i}", torch.randint(0, vocab, (args.context_len,)).tolist(),
                               SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
        while any(r.num_output_tokens == 0 for r in engine.requests.values()):
            engine.step()
        step_ms = [_wall_ms(engine.step) for _ in range(20)]
        graph_ms = _graph_ms(engine, bs)
        graphs = engine.runner.graphs
        assert graphs is not None
        replay = graphs.graphs[graphs.padded_size(bs)].replay
        table, launches, _ = _kernel_table(replay, out / f"decode_bs{bs}.json", cpu=False)
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
    pre_ms = _wall_ms(prefill)
    table, _, busy_us = _kernel_table(prefill, out / "prefill.json")
    busy_ms = busy_us / 1e3
    print(f"prefill {args.context_len} tokens: {pre_ms:.1f} ms wall, {busy_ms:.1f} ms of kernels")
    for row in table[:15]:
        print(f"   {row['pct']:5.1f}% {row['us']:9.0f}us x{row['count']:<4} {row['name']}")
    summary["prefill_ms"] = pre_ms
    summary["prefill_kernel_ms"] = busy_ms
    summary["prefill_syncs"] = _syncs(prefill)
    print(f"host syncs in one prefill: {sum(summary['prefill_syncs'].values())}")
    for where, n in summary["prefill_syncs"].items():
        print(f"   {n:4d} x {where}")
    # the same prefill without the host copy of the offsets (fla then plans its chunks from the device ones)
    host = batch.cu_seqlens_q_cpu
    batch.cu_seqlens_q_cpu = []
    summary["prefill_ms_device_offsets"] = min(_wall_ms(prefill) for _ in range(3))
    batch.cu_seqlens_q_cpu = host
    summary["prefill_ms_host_offsets"] = min(_wall_ms(prefill) for _ in range(3))
    print(f"prefill wall, best of 3: {summary['prefill_ms_host_offsets']:.1f} ms with host offsets, "
          f"{summary['prefill_ms_device_offsets']:.1f} ms without")
    # the host side of one prefill, by Python function (cProfile slows each call down, so the shares count)
    text = host_profile(prefill, top_own=35, top_cumulative=45)
    (out / "prefill_host.txt").write_text(text)
    print(text)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
