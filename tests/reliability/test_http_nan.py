"""Non-finite logits of one request, through the real HTTP server: a streaming request gets an error event
(then [DONE], never a finish_reason or garbage text after the fault), a non-streaming one an error response,
and a request running in the same batches completes with the same text as when it runs alone."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from nibble.engine.llm_engine import LLMEngine

from .conftest import ServerHandle, engine_config, served, sse_events, wait_idle
from .faults import PoisonRow

MARK = "please poison this one"
POISON_AFTER = 3
NEIGHBOUR = {"prompt": "A request that shares the batch", "max_tokens": 40, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def setup() -> Iterator[tuple[ServerHandle, PoisonRow]]:
    core = LLMEngine(engine_config(enforce_eager=True))
    tok = core.tokenizer
    assert tok is not None
    poison = PoisonRow(core, lambda r: MARK in tok.decode(r.prompt_token_ids), POISON_AFTER)
    poison.fired.append((-1, 0, 0))  # disarmed until a test re-arms it
    with served(core) as handle:
        yield handle, poison


def _neighbour_text(handle: ServerHandle) -> str:
    with httpx.Client(base_url=handle.url, timeout=60) as http:
        r = http.post("/v1/completions", json=NEIGHBOUR)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "length"
    return r.json()["choices"][0]["text"]


@pytest.fixture(scope="module")
def alone(setup: tuple[ServerHandle, PoisonRow]) -> str:
    return _neighbour_text(setup[0])


def _with_neighbour(handle: ServerHandle, poison: PoisonRow, send: Any) -> tuple[Any, str]:
    """Start the neighbour, wait until it runs, arm the poison and run `send(http)` alongside it."""
    result: dict[str, str] = {}
    neighbour = threading.Thread(target=lambda: result.setdefault("text", _neighbour_text(handle)))
    neighbour.start()
    deadline = time.monotonic() + 30
    while handle.engine.stats()["num_running"] < 1:
        assert time.monotonic() < deadline, "the neighbour request never started"
        time.sleep(0.005)
    poison.fired.clear()
    with httpx.Client(base_url=handle.url, timeout=60) as http:
        victim = send(http)
    neighbour.join(timeout=60)
    assert not neighbour.is_alive(), "the neighbour request hung"
    assert len(poison.fired) == 1 and poison.fired[0][1] == 2, poison.fired  # fired in a shared batch
    return victim, result["text"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_stream_gets_error_event(setup: tuple[ServerHandle, PoisonRow], alone: str, path: str) -> None:
    handle, poison = setup
    body: dict[str, Any] = {"max_tokens": 30, "ignore_eos": True, "stream": True, "temperature": 0}
    if path.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": MARK}]
    else:
        body["prompt"] = MARK

    def send(http: httpx.Client) -> list[Any]:
        with http.stream("POST", path, json=body) as r:
            assert r.status_code == 200
            return sse_events(r)

    events, neighbour = _with_neighbour(handle, poison, send)
    assert events[-1] == "[DONE]"
    error = events[-2]["error"]
    assert "non-finite" in error["message"] and f"step {poison.fired[0][0]}" in error["message"]
    assert error["type"] == "server_error"
    for event in events[:-2]:
        assert all(c.get("finish_reason") is None for c in event["choices"]), event
    assert neighbour == alone
    assert wait_idle(handle.engine), handle.engine.stats()


def test_non_stream_gets_error_response(setup: tuple[ServerHandle, PoisonRow], alone: str) -> None:
    handle, poison = setup
    body = {"prompt": MARK, "max_tokens": 30, "ignore_eos": True, "temperature": 0}
    response, neighbour = _with_neighbour(handle, poison, lambda http: http.post("/v1/completions", json=body))
    assert response.status_code == 500, response.text
    error = response.json()["error"]
    assert "non-finite" in error["message"] and error["code"] == "generation_error"
    assert "Traceback" not in response.text
    assert neighbour == alone
    assert wait_idle(handle.engine), handle.engine.stats()
    assert handle.engine.engine.blocks.all_free()
    assert _neighbour_text(handle) == alone
