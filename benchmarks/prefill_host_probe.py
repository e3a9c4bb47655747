"""How long does a short eager prefill take on the host and on the GPU, and how much of it is fla-core's chunked
delta rule? For one sequence of L tokens through `engine.model` (dummy weights): the wall time (synchronised,
best of 5) and the kernels' busy time (torch profiler), with the GDN layers' delta rule through fla-core's
chunked kernel and through nibble's in-place recurrent kernel; then the delta rule alone per call, at the
model's GDN shapes, both ways; and a cProfile of the L = 64 prefill with fla.

    python benchmarks/prefill_host_probe.py --model benchmarks/models/Qwen3.5-122B-A10B-NVFP4 --out $OUT/ph
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch
from profile_decode import host_profile
from torch.profiler import ProfilerActivity, profile

from nibble.engine.config import EngineConfig
from nibble.engine.llm_engine import LLMEngine
from nibble.kernels.gated_delta import gated_delta_rule_fla, gated_delta_rule_recurrent
from nibble.layers.forward_batch import ForwardBatch

BACKENDS = {"fla": gated_delta_rule_fla, "recurrent": gated_delta_rule_recurrent}


def _wall_ms(fn, reps: int = 5) -> float:
    best = float("inf")
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return 1e3 * best


def _busy_ms(fn) -> float:
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(e.device_time_total for e in prof.key_averages()) / 1e3


def _use(engine: LLMEngine, name: str) -> None:
    """Point every module's KernelSet at one delta-rule backend."""
    for module in engine.model.modules():
        ks = getattr(module, "kernels", None)
        if ks is not None and hasattr(ks, "gated_delta_rule"):
            module.kernels = dataclasses.replace(ks, gated_delta_rule=BACKENDS[name])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--lengths", default="16,64,128,256,512,1024")
    ap.add_argument("--out", default="prefill_host")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    engine = LLMEngine(EngineConfig(model=args.model, load_format="dummy", max_model_len=4096, max_num_seqs=8))
    cfg = engine.model_config
    vocab = cfg.vocab_size
    caches = engine.runner.caches
    bs = engine.config.block_size
    results: dict = {"model": []}
    for length in (int(x) for x in args.lengths.split(",")):
        prompt = torch.randint(0, vocab, (length,)).tolist()
        batch = ForwardBatch.build([prompt], [0], [list(range(1, -(-length // bs) + 1))], [1], bs, engine.device)
        row: dict = {"tokens": length}
        for name in BACKENDS:
            _use(engine, name)

            def prefill(batch: ForwardBatch = batch) -> None:
                with torch.inference_mode():
                    engine.model(batch, caches)

            prefill()
            row[f"{name}_wall_ms"] = round(_wall_ms(prefill), 2)
            row[f"{name}_busy_ms"] = round(_busy_ms(prefill), 2)
        results["model"].append(row)
        print(json.dumps(row), flush=True)
    _use(engine, "fla")
    # the delta rule alone at the model's GDN shapes, one sequence
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    state = torch.zeros(4, hv, dk, dv, dtype=torch.float32, device="cuda")
    slots = torch.tensor([1], dtype=torch.int32, device="cuda")
    results["delta_rule"] = []
    for length in (int(x) for x in args.lengths.split(",")):
        q = torch.randn(length, hk, dk, dtype=torch.bfloat16, device="cuda")
        k = torch.randn(length, hk, dk, dtype=torch.bfloat16, device="cuda")
        v = torch.randn(length, hv, dv, dtype=torch.bfloat16, device="cuda")
        g = -torch.rand(length, hv, dtype=torch.float32, device="cuda")
        beta = torch.rand(length, hv, dtype=torch.bfloat16, device="cuda")
        cu = torch.tensor([0, length], dtype=torch.int32, device="cuda")
        row = {"tokens": length}
        args_ = (q, k, v, g, beta, state, cu, slots)
        for name, fn in BACKENDS.items():
            def call(fn=fn, args_=args_, length=length) -> None:
                fn(*args_, cu_seqlens_cpu=[0, length])

            call()
            row[f"{name}_wall_ms"] = round(_wall_ms(call, 20), 3)
            row[f"{name}_busy_ms"] = round(_busy_ms(call), 3)
        results["delta_rule"].append(row)
        print(json.dumps(row), flush=True)
    prompt = torch.randint(0, vocab, (64,)).tolist()
    batch = ForwardBatch.build([prompt], [0], [list(range(1, 5))], [1], bs, engine.device)
    with torch.inference_mode():
        text = host_profile(engine.model, batch, caches, top_own=60, top_cumulative=80)
    (out / "prefill64_host.txt").write_text(text)
    (out / "summary.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
