"""Start-up warm-up: dummy requests through the engine's own steps before the first real one.

Triton compiles a kernel variant the first time a launch needs it (a new tile configuration from the tuning
tables, which are keyed by token count; the varlen or cached-prefix paths; the sorted MoE alignment), and fla
autotunes on first use. Served requests would otherwise pay that on arrival: on the H200 a first burst of 32
prompts waited 3.2 s longer for its first tokens than the same burst later (docs/benchmarks.md). The warm-up
runs prefill steps of token counts spread over every octave up to max_num_batched_tokens, a chunked prefill
that continues on a cached prefix next to decoding requests, sampling with top-k/top-p/logprobs, and a pure
decode batch; then it leaves the engine as it found it (no requests, every block free, counters and the
sampling generator reset), so outputs are the same with and without it.
"""

from __future__ import annotations

import logging
import math
import time
from typing import TYPE_CHECKING

import torch

from nibble.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from nibble.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)

WARMUP_PREFIX = "__nibble_warmup__"


def warmup_token_counts(max_num_tokens: int) -> list[int]:
    """Step sizes to run: 1..8, then two per octave (2^k and 1.5 * 2^k), then max_num_tokens itself."""
    counts = set(range(1, min(8, max_num_tokens) + 1))
    for k in range(3, max(3, max_num_tokens.bit_length())):
        counts.update(c for c in (1 << k, 3 << (k - 1)) if c <= max_num_tokens)
    counts.add(max_num_tokens)
    return sorted(counts)


def _split(num_tokens: int, max_len: int, max_seqs: int) -> list[int] | None:
    """Prompt lengths (at most max_len each, two or more sequences when num_tokens > 1) summing to num_tokens."""
    n = max(min(2, num_tokens), math.ceil(num_tokens / max_len))
    if n > max_seqs:
        return None
    return [num_tokens // n + (i < num_tokens % n) for i in range(n)]


class _Driver:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.gen = torch.Generator().manual_seed(0)
        self.num_requests = 0
        self.num_steps = 0

    def prompt(self, length: int) -> list[int]:
        return torch.randint(0, self.engine.model_config.vocab_size, (length,), generator=self.gen).tolist()

    def run(self, waves: list[tuple[int, SamplingParams]]) -> None:
        for length, params in waves:
            self.engine.add_request(f"{WARMUP_PREFIX}{self.num_requests}", self.prompt(length), params)
            self.num_requests += 1
        while self.engine.has_unfinished_requests():
            self.engine.step()
            self.num_steps += 1


def warm_up(engine: LLMEngine) -> float:
    """Run the warm-up on an idle engine, then `engine.reset()`; returns its seconds."""
    if engine.has_unfinished_requests():
        raise RuntimeError("warm-up needs an idle engine")
    t0 = time.perf_counter()
    cfg = engine.config
    max_prompt_len = engine.max_model_len - 1
    budget = cfg.max_num_batched_tokens
    driver = _Driver(engine)
    greedy = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    for num_tokens in warmup_token_counts(budget):
        lengths = _split(num_tokens, max_prompt_len, cfg.max_num_seqs)
        if lengths is not None:
            driver.run([(n, greedy) for n in lengths])
    if engine.max_model_len > 8:
        # a prefill longer than the token budget continues on its cached prefix next to a decoding request
        sampled = SamplingParams(temperature=0.8, top_p=0.9, top_k=20, logprobs=2, max_tokens=6, ignore_eos=True)
        long_len = min(budget + budget // 2 + 5, engine.max_model_len - 2)
        driver.run([(2, sampled), (long_len, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))])
        decode = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        driver.run([(4, decode)] * min(cfg.max_num_seqs, 8))
    engine.reset()
    seconds = time.perf_counter() - t0
    logger.info("warm-up: %d requests, %d steps in %.1f s", driver.num_requests, driver.num_steps, seconds)
    return seconds
