"""Host cost of one scheduling round's prefix-cache check while a cut is under way (CPU, demo model): a
request computes a long prompt prefix, another is cut at its end, and N more sharing it wait for that entry;
every round asks `BlockManager.awaits_cut` of each waiting request. Prints the first round (which computes the
prompts' block digests, a cost each request pays once) and the next ones."""

from __future__ import annotations

import argparse
import time

import torch

from nibble.engine.config import EngineConfig
from nibble.engine.llm_engine import LLMEngine
from nibble.engine.sampling_params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--waiting", type=int, default=3000)
    ap.add_argument("--prefix-len", type=int, default=1500)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    engine = LLMEngine(EngineConfig(model="demo", device="cpu", max_model_len=args.prefix_len + 64,
                                    max_num_batched_tokens=256, max_num_seqs=4, kv_cache_memory_gb=1.0))
    gen = torch.Generator().manual_seed(0)
    shared = torch.randint(0, 1000, (args.prefix_len,), generator=gen).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    engine.add_request("first", [*shared, 1, 2], params)
    for _ in range(-(-args.prefix_len // 256) + 2):
        engine.step()
    for i in range(args.waiting):
        engine.add_request(f"w{i}", shared + torch.randint(0, 1000, (5,), generator=gen).tolist(), params)
    engine.step()
    engine.step()
    waiting = list(engine.scheduler.waiting)
    assert engine.blocks.prefix is not None and engine.blocks.prefix.splitting, "no cut under way"
    for r in range(args.rounds):
        t0 = time.perf_counter()
        num = sum(engine.blocks.awaits_cut(req) for req in waiting)
        print(f"round {r}: {num} of {len(waiting)} waiting for the cut, {1e3 * (time.perf_counter() - t0):.1f} ms")


if __name__ == "__main__":
    main()
