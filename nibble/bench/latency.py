"""`nibble bench latency`: offline prefill time, decode step time and tok/s at batch 1 and batch N, next to
the bytes-per-token roofline (bytes one decode step must read / measured device copy bandwidth)."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from nibble.layers.moe import RoutedExperts


@dataclass
class StepBytes:
    """Bytes one decode step reads: dense weights, routed experts hit, KV cache and GDN state traffic."""

    dense: int
    experts: int
    kv: int
    state: int

    @property
    def total(self) -> int:
        return self.dense + self.experts + self.kv + self.state


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def decode_step_bytes(engine: Any, batch_size: int, context_len: int) -> StepBytes:
    """Expected bytes of one decode step of `batch_size` sequences at `context_len` tokens of context."""
    model, cfg = engine.model, engine.model_config
    expert_bytes_per_layer = 0
    expert_ids = set()
    for mod in model.modules():
        if isinstance(mod, RoutedExperts):
            expert_bytes_per_layer = sum(_nbytes(p) for p in mod.parameters()) // mod.num_experts
            expert_ids.update(id(p) for p in mod.parameters())
    embed = id(model.embed_tokens.weight)
    dense = sum(_nbytes(p) for p in model.parameters() if id(p) not in expert_ids and id(p) != embed)
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    distinct = e * (1.0 - (1.0 - k / e) ** batch_size)
    experts = int(distinct * expert_bytes_per_layer * cfg.num_hidden_layers)
    kv_elem = engine.config.kv_torch_dtype.itemsize
    kv = batch_size * context_len * cfg.kv_cache_bytes_per_token(kv_elem)
    state = 2 * batch_size * cfg.gdn_state_bytes_per_seq(engine.config.torch_dtype.itemsize)
    return StepBytes(dense, experts, kv, state)


def measure_copy_bandwidth(device: torch.device, num_bytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus written."""
    n = num_bytes // 4
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            dst.copy_(src)
        end.record()
        torch.cuda.synchronize(device)
        seconds = start.elapsed_time(end) / 1e3 / 10
    else:
        t0 = time.perf_counter()
        for _ in range(3):
            dst.copy_(src)
        seconds = (time.perf_counter() - t0) / 3
    return 2 * n * 4 / seconds


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_latency(engine: Any, batch_size: int, input_len: int, output_len: int, num_iters: int = 1) -> dict[str, Any]:
    """Prefill `batch_size` random prompts of input_len tokens, then decode output_len steps; timings per phase:
    prefill_s until every request has its first token, decode steps after that."""
    from nibble.engine.sampling_params import SamplingParams

    device = engine.device
    vocab = engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(0)
    results = []
    for it in range(num_iters):
        for i in range(batch_size):
            prompt = torch.randint(0, vocab, (input_len,), generator=gen).tolist()
            engine.add_request(f"lat-{it}-{i}", prompt,
                               SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True))
        step_times: list[float] = []
        first_token: dict[str, float] = {}
        _sync(device)
        t_start = time.perf_counter()
        # No device sync per step: with overlapped scheduling `step` returns while the next step runs, and the
        # interval between two returns is the step time either way (a step waits for its sampled tokens).
        # Decode steps are those after every request has its first token (no prefill chunk in the batch).
        t_prev = t_start
        decode_tokens = 0
        while engine.has_unfinished_requests():
            outs = engine.step()
            now = time.perf_counter()
            if len(first_token) == batch_size:
                step_times.append(now - t_prev)
                decode_tokens += sum(len(o.outputs[0].delta_token_ids) for o in outs)
            t_prev = now
            for o in outs:
                first_token.setdefault(o.request_id, now)
        prefill_time = max(first_token.values()) - t_start
        _sync(device)
        total = time.perf_counter() - t_start
        results.append((prefill_time, step_times, total, decode_tokens))
    prefill_time, step_times, total, decode_tokens = results[-1]
    median = statistics.median(step_times) if step_times else float("nan")
    # a speculative decoding step yields one token per sequence plus its accepted drafts
    tokens_per_step = decode_tokens / len(step_times) if step_times else float("nan")
    return {"batch_size": batch_size, "input_len": input_len, "output_len": output_len,
            "prefill_s": prefill_time, "num_decode_steps": len(step_times), "decode_step_median_ms": median * 1e3,
            "decode_step_p90_ms": (sorted(step_times)[int(0.9 * (len(step_times) - 1))] * 1e3
                                   if step_times else float("nan")),
            "decode_tok_s": tokens_per_step / median if step_times else float("nan"),
            "decode_tokens_per_step": tokens_per_step, "total_s": total}


def add_cli_args(p: argparse.ArgumentParser) -> None:
    from nibble.cli import _add_engine_args

    _add_engine_args(p)
    p.add_argument("--batch-sizes", default="1,8", help="comma-separated decode batch sizes")
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-iters", type=int, default=1, help="repeat each batch size; the last run is reported")
    p.add_argument("--output-json", default=None)


def run_cli(args: argparse.Namespace) -> int:
    from nibble.cli import engine_config_from_args
    from nibble.engine.llm_engine import LLMEngine

    sizes = [int(x) for x in str(args.batch_sizes).split(",") if x.strip()]
    if not sizes or min(sizes) < 1:
        raise ValueError(f"--batch-sizes must be positive integers, got '{args.batch_sizes}'")
    cfg = engine_config_from_args(args)
    cfg = cfg.replace(max_num_seqs=max(sizes),
                      max_model_len=cfg.max_model_len or args.input_len + args.output_len + 16)
    engine = LLMEngine(cfg)
    bandwidth = measure_copy_bandwidth(engine.device)
    run_latency(engine, 1, min(args.input_len, 64), 4)
    rows = []
    for bs in sizes:
        r = run_latency(engine, bs, args.input_len, args.output_len, args.num_iters)
        sb = decode_step_bytes(engine, bs, args.input_len + args.output_len // 2)
        roof_step = sb.total / bandwidth
        r.update({"bytes_per_step": asdict(sb), "bytes_per_step_total": sb.total, "copy_bandwidth_Bps": bandwidth,
                  "roofline_step_ms": roof_step * 1e3, "roofline_tok_s": bs / roof_step,
                  "fraction_of_roofline": (roof_step * 1e3) / r["decode_step_median_ms"]})
        rows.append(r)
    print(f"device {engine.device}, copy bandwidth {bandwidth / 1e12:.2f} TB/s (read+write)")
    print(f"{'batch':>5} {'prefill s':>9} {'step ms':>8} {'tok/s':>9} {'GB/step':>8} {'roof ms':>8} "
          f"{'roof tok/s':>10} {'% roof':>6}")
    for r in rows:
        print(f"{r['batch_size']:>5} {r['prefill_s']:>9.3f} {r['decode_step_median_ms']:>8.2f} "
              f"{r['decode_tok_s']:>9.1f} {r['bytes_per_step_total'] / 1e9:>8.2f} {r['roofline_step_ms']:>8.2f} "
              f"{r['roofline_tok_s']:>10.1f} {100 * r['fraction_of_roofline']:>5.1f}%")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"model": args.model, "device": str(engine.device), "rows": rows}, f, indent=2)
    return 0
