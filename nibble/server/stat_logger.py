"""Periodic engine statistics in the server log, the lines vLLM's serve prints every 10 seconds.

Operators read throughput, queue lengths, KV-cache usage, the prefix-cache hit rate and, under speculative
decoding, the acceptance figures off these lines while tuning flags such as --max-num-seqs or
--num-speculative-tokens. The rates are over the interval since the last line; an interval with nothing
running, waiting or computed logs nothing, so an idle server stays quiet. `--disable-log-stats` turns them off.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from nibble.server.metrics import spec_positions

logger = logging.getLogger("nibble.server")

# vLLM's interval (VLLM_LOG_STATS_INTERVAL)
LOG_STATS_INTERVAL_S = 10.0


class StatLogger:
    """Turns successive `engine.stats()` readings into log lines (`lines`), and logs them every interval
    (`run`). stats: returns the engine's counters and gauges (LLMEngine.stats)."""

    def __init__(self, stats: Callable[[], dict[str, float]], clock: Callable[[], float] = time.monotonic) -> None:
        self._stats = stats
        self._clock = clock
        self._last = stats()
        self._last_time = clock()

    def lines(self) -> list[str]:
        """The lines for the interval since the last call (none when the engine did nothing and holds no
        request)."""
        now, cur = self._clock(), self._stats()
        last, elapsed = self._last, max(now - self._last_time, 1e-9)
        self._last, self._last_time = cur, now

        def delta(key: str) -> float:
            return cur.get(key, 0) - last.get(key, 0)

        # prompt tokens the model computed in the interval (not those that arrived, nor prefix-cache hits)
        prompt, generated = delta("num_computed_prompt_tokens"), delta("num_generated_tokens")
        running, waiting = int(cur.get("num_running", 0)), int(cur.get("num_waiting", 0))
        if not (prompt or generated or running or waiting):
            return []
        queries, hits = delta("prefix_cache_queries"), delta("prefix_cache_hits")
        out = [f"Avg prompt throughput: {prompt / elapsed:.1f} tokens/s, "
               f"Avg generation throughput: {generated / elapsed:.1f} tokens/s, Running: {running} reqs, "
               f"Waiting: {waiting} reqs, KV cache usage: {100 * cur.get('kv_cache_usage', 0.0):.1f}%, "
               f"Prefix cache hit rate: {100 * hits / queries if queries else 0.0:.1f}%"]
        drafts = delta("spec_decode_num_drafts")
        if drafts:
            drafted, accepted = delta("spec_decode_num_draft_tokens"), delta("spec_decode_num_accepted_tokens")
            per_pos = ", ".join(f"{delta(f'spec_decode_num_accepted_tokens_pos_{i}') / drafts:.3f}"
                                for i in range(spec_positions(cur)))
            out.append(f"SpecDecoding metrics: Mean acceptance length: {1 + accepted / drafts:.2f}, "
                       f"Accepted throughput: {accepted / elapsed:.2f} tokens/s, "
                       f"Drafted throughput: {drafted / elapsed:.2f} tokens/s, Accepted: {int(accepted)} tokens, "
                       f"Drafted: {int(drafted)} tokens, Per-position acceptance rate: {per_pos}, "
                       f"Avg Draft acceptance rate: {100 * accepted / drafted if drafted else 0.0:.1f}%")
        return out

    async def run(self, interval_s: float = LOG_STATS_INTERVAL_S) -> None:
        """Log `lines()` every interval_s seconds until cancelled."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                for line in self.lines():
                    logger.info("%s", line)
            except Exception:  # a stats read that fails must not end the server's logging for good
                logger.exception("reading the engine's statistics failed")
