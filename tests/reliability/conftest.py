"""Shared helpers of the reliability tests: engines on the embedded demo model (on the CPU; on the GPU
with NIBBLE_TEST_GPU=1), and HTTP servers run the way the server tests run theirs (uvicorn in a thread on
a free local port; tests/server/conftest.py), without the server tests' client dependencies."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from nibble.engine.async_engine import AsyncEngine
from nibble.engine.config import EngineConfig
from nibble.engine.llm_engine import LLMEngine
from nibble.engine.request import RequestOutput
from nibble.engine.sampling_params import SamplingParams
from tests.helpers.server import ServerHandle, start_server, wait_idle

__all__ = ["ServerHandle", "served", "wait_idle"]

REPO = Path(__file__).resolve().parents[2]
MAX_MODEL_LEN = 1024
GPU = os.environ.get("NIBBLE_TEST_GPU") == "1"


def engine_config(**overrides: Any) -> EngineConfig:
    """Demo-model engine settings. Tests that wrap the model pass enforce_eager=True: a CUDA graph replays
    the model captured at start-up, not the wrapper."""
    settings: dict[str, Any] = {"model": "demo", "device": "cuda" if GPU else "cpu", "max_model_len": MAX_MODEL_LEN,
                                "max_num_seqs": 8, "max_num_batched_tokens": 2048, **overrides}
    if GPU and "extra" not in settings:
        # Many engines live in one test process: size each KV cache to its needs, not to 90% of the GPU.
        blocks = settings["max_num_seqs"] * -(-settings["max_model_len"] // 16) + 1
        settings["extra"] = {"num_kv_blocks": blocks}
    return EngineConfig(**settings)


def greedy(max_tokens: int, **kw: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def run_to_end(engine: LLMEngine, *, after_step: Any = None, max_steps: int = 2000) -> dict[str, RequestOutput]:
    """Step until every request finished; returns each request's final output. after_step(engine) runs
    after every step (to abort, inspect...)."""
    final: dict[str, RequestOutput] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return final
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        if after_step is not None:
            after_step(engine)
    raise AssertionError(f"requests still unfinished after {max_steps} steps: {engine.stats()}")


def assert_engine_idle(engine: LLMEngine) -> None:
    stats = engine.stats()
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0, stats
    assert engine.blocks.all_free(), (len(engine.blocks.free_blocks), engine.blocks.num_blocks)
    assert not engine.requests


@contextmanager
def served(engine: LLMEngine) -> Iterator[ServerHandle]:
    """The real app (`build_app`) over an AsyncEngine driving `engine`, on a free port of 127.0.0.1."""
    async_engine = AsyncEngine(engine)
    handle = start_server(async_engine)
    try:
        yield handle
    finally:
        handle.stop()
        async_engine.shutdown()


def sse_events(response: httpx.Response) -> list[Any]:
    """The `data:` payloads of an event stream: parsed JSON, or the string '[DONE]'."""
    return [line[6:] if line == "data: [DONE]" else json.loads(line[6:])
            for line in response.iter_lines() if line.startswith("data: ")]
