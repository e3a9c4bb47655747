"""Shared helpers of the reliability tests: engines on the embedded demo model (on the CPU; on the GPU
with NIBBLE_TEST_GPU=1), and HTTP servers run the way the server tests run theirs (uvicorn in a thread on
a free local port; tests/server/conftest.py), without the server tests' client dependencies."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from nibble.engine.async_engine import AsyncEngine
from nibble.engine.config import EngineConfig
from nibble.engine.llm_engine import LLMEngine
from nibble.engine.request import RequestOutput
from nibble.engine.sampling_params import SamplingParams

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


@dataclass
class ServerHandle:
    """A running server: base URL, the engine behind it, the uvicorn server and its thread."""

    url: str
    engine: AsyncEngine
    server: Any
    thread: threading.Thread

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@contextmanager
def served(engine: LLMEngine) -> Iterator[ServerHandle]:
    """The real app (`build_app`) over an AsyncEngine driving `engine`, on a free port of 127.0.0.1."""
    import uvicorn

    from nibble.server.api_server import build_app

    async_engine = AsyncEngine(engine)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(build_app(async_engine), log_level="warning", access_log=False,
                                           log_config=None))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "test server did not start"
        time.sleep(0.02)
    handle = ServerHandle(f"http://127.0.0.1:{sock.getsockname()[1]}", async_engine, server, thread)
    try:
        yield handle
    finally:
        handle.stop()
        async_engine.shutdown()


def wait_idle(engine: AsyncEngine, timeout: float = 5.0) -> bool:
    """Poll until the engine holds no request and every KV block and state slot is free."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = engine.stats()
        if stats["num_running"] == 0 and stats["num_waiting"] == 0 and engine.engine.blocks.all_free():
            return True
        time.sleep(0.05)
    return False


def sse_events(response: httpx.Response) -> list[Any]:
    """The `data:` payloads of an event stream: parsed JSON, or the string '[DONE]'."""
    return [line[6:] if line == "data: [DONE]" else json.loads(line[6:])
            for line in response.iter_lines() if line.startswith("data: ")]
