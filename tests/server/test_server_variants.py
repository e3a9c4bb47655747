"""Servers with other settings than the shared one: API key, a tiny queue (503), injected engine faults
(500 / error events), a stopped engine (/health 503), speculative decoding and priority scheduling."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest
import torch

from nibble.engine.async_engine import AsyncEngine, EngineDead

from .conftest import ServerHandle, make_engine, start_server

PROMPT = {"prompt": "hello", "max_tokens": 2}


def sse_payloads(response: httpx.Response) -> list[Any]:
    return [line[6:] if line == "data: [DONE]" else json.loads(line[6:])
            for line in response.iter_lines() if line.startswith("data: ")]


def test_api_key(engine: AsyncEngine) -> None:
    handle = start_server(engine, api_key="sk-secret")
    try:
        with httpx.Client(base_url=handle.url, timeout=30) as http:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sk-secret"}):
                for method, path, body in (("POST", "/v1/completions", PROMPT), ("GET", "/v1/models", None),
                                           ("POST", "/tokenize", {"prompt": "hi"})):
                    r = http.request(method, path, json=body, headers=headers)
                    assert r.status_code == 401, r.text
                    assert r.json()["error"]["code"] == "invalid_api_key"
            ok = http.post("/v1/completions", json=PROMPT, headers={"Authorization": "Bearer sk-secret"})
            assert ok.status_code == 200
            for open_path in ("/health", "/metrics", "/version"):
                assert http.get(open_path).status_code == 200
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=handle.api, api_key="wrong", max_retries=0).models.list()
        models = openai.OpenAI(base_url=handle.api, api_key="sk-secret", max_retries=0).models.list()
        assert [m.id for m in models.data] == [handle.model]
    finally:
        handle.stop()


@pytest.fixture(scope="module")
def small_queue_server(model_kwargs: dict[str, Any]) -> Iterator[ServerHandle]:
    eng = make_engine(model_kwargs, max_num_seqs=1, max_waiting_requests=1)
    handle = start_server(eng)
    yield handle
    handle.stop()
    eng.shutdown()


def test_overload_is_503_and_recovers(small_queue_server: ServerHandle) -> None:
    body = {"prompt": "burst", "max_tokens": 48, "ignore_eos": True}

    def post(_: int) -> httpx.Response:
        with httpx.Client(base_url=small_queue_server.url, timeout=60) as http:
            return http.post("/v1/completions", json=body)

    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(post, range(8)))
    codes = sorted(r.status_code for r in responses)
    assert 200 in codes and 503 in codes, codes
    assert set(codes) <= {200, 503}
    for r in responses:
        if r.status_code == 503:
            error = r.json()["error"]
            assert error["code"] == "server_overloaded" and "overloaded" in error["message"]
    with httpx.Client(base_url=small_queue_server.url, timeout=60) as http:
        assert http.post("/v1/completions", json=PROMPT).status_code == 200


@pytest.fixture()
def faulty_server(model_kwargs: dict[str, Any]) -> Iterator[ServerHandle]:
    eng = make_engine(model_kwargs)
    handle = start_server(eng)
    yield handle
    handle.stop()
    eng.shutdown()


def _fail_step_after(eng: AsyncEngine, good_steps: int) -> None:
    core = eng.engine
    real_step = core.step
    calls = {"n": 0}

    def step() -> list:
        calls["n"] += 1
        if calls["n"] > good_steps:
            calls["n"] = -10**9  # fail once, then run normally again
            raise RuntimeError("injected device fault")
        return real_step()

    core.step = step  # type: ignore[method-assign]


def _nan_logits_after(eng: AsyncEngine, good_steps: int) -> None:
    runner = eng.engine.runner
    real_execute = runner.execute
    calls = {"n": 0}

    def execute(sched: Any, inflight_tokens: Any = None) -> Any:
        logits, rows = real_execute(sched, inflight_tokens)
        calls["n"] += 1
        if logits is not None and calls["n"] == good_steps + 1:
            logits = torch.full_like(logits, float("nan"))
        return logits, rows

    runner.execute = execute  # type: ignore[method-assign]


def test_engine_fault_is_500_or_error_event(faulty_server: ServerHandle) -> None:
    eng = faulty_server.engine
    with httpx.Client(base_url=faulty_server.url, timeout=30) as http:
        _fail_step_after(eng, 0)
        r = http.post("/v1/completions", json=PROMPT)
        assert r.status_code == 500 and "injected device fault" in r.json()["error"]["message"]

        _fail_step_after(eng, 3)
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 50, "ignore_eos": True, "stream": True}
        with http.stream("POST", "/v1/chat/completions", json=body) as resp:
            assert resp.status_code == 200
            payloads = sse_payloads(resp)
        assert payloads[-1] == "[DONE]"
        assert "injected device fault" in payloads[-2]["error"]["message"]
        assert all("choices" in p for p in payloads[:-2])

        assert http.post("/v1/completions", json=PROMPT).status_code == 200


def test_non_finite_logits_are_500_or_error_event(faulty_server: ServerHandle) -> None:
    eng = faulty_server.engine
    with httpx.Client(base_url=faulty_server.url, timeout=30) as http:
        _nan_logits_after(eng, 0)
        r = http.post("/v1/completions", json={"prompt": "nan please", "max_tokens": 5})
        assert r.status_code == 500 and "non-finite" in r.json()["error"]["message"]

        _nan_logits_after(eng, 3)
        with http.stream("POST", "/v1/completions", json={"prompt": "x", "max_tokens": 20, "stream": True}) as resp:
            payloads = sse_payloads(resp)
        assert payloads[-1] == "[DONE]" and "non-finite" in payloads[-2]["error"]["message"]
        assert http.post("/v1/completions", json=PROMPT).status_code == 200


def test_stopped_engine(model_kwargs: dict[str, Any]) -> None:
    eng = make_engine(model_kwargs)
    handle = start_server(eng)
    try:
        with httpx.Client(base_url=handle.url, timeout=30) as http:
            assert http.get("/health").status_code == 200
            eng.shutdown()
            assert http.get("/health").status_code == 503
            r = http.post("/v1/completions", json=PROMPT)
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
            r = http.post("/reset_prefix_cache")
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
        # a command that reaches the engine after its thread took its last one is refused, not left unanswered
        with pytest.raises(EngineDead):
            eng._submit(("reset_prefix_cache", Future()))
    finally:
        handle.stop()


def test_speculative_decoding_server_matches_plain(engine: AsyncEngine, server: ServerHandle,
                                                   model_kwargs: dict[str, Any]) -> None:
    """A server with MTP speculative decoding answers chat completions (plain and streamed) with the same greedy
    text and usage as the shared server, and exports the draft counters."""
    spec_engine = make_engine(model_kwargs, num_speculative_tokens=2)
    handle = start_server(spec_engine)
    chat = {"messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": 24, "temperature": 0,
            "ignore_eos": True}
    completion = {"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    try:
        with httpx.Client(timeout=60) as http:
            def both(path: str, body: dict[str, Any]) -> tuple[Any, Any]:
                return tuple(http.post(f"{h.url}{path}", json={**body, "model": h.model}).json()
                             for h in (server, handle))

            ref, got = both("/v1/chat/completions", chat)
            assert got["choices"][0]["message"] == ref["choices"][0]["message"]
            assert got["usage"]["completion_tokens"] == ref["usage"]["completion_tokens"] == 24
            ref, got = both("/v1/completions", completion)
            assert got["choices"][0]["text"] == ref["choices"][0]["text"]
            with http.stream("POST", f"{handle.url}/v1/completions",
                             json={**completion, "model": handle.model, "stream": True}) as r:
                chunks = [p for p in sse_payloads(r) if p != "[DONE]"]
            assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == ref["choices"][0]["text"]
            metrics = http.get(f"{handle.url}/metrics").text
            assert "nibble:spec_decode_num_draft_tokens" in metrics
    finally:
        handle.stop()
        spec_engine.shutdown()


def test_priority_reaches_the_engine(model_kwargs: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """Under --scheduling-policy priority every generating endpoint hands the request's `priority` (and
    `cache_salt`) to the engine (each choice of n keeps them); a value that is not an integer is a 400 naming the
    field."""
    eng = make_engine(model_kwargs, scheduling_policy="priority")
    seen: list[int] = []
    salts: list[str | None] = []
    real = eng.engine.add_request

    def spy(request_id: str, prompt: Any, params: Any = None, **kwargs: Any) -> Any:
        seen.append(params.priority)
        salts.append(params.cache_salt)
        return real(request_id, prompt, params, **kwargs)

    monkeypatch.setattr(eng.engine, "add_request", spy)
    handle = start_server(eng)
    user = [{"role": "user", "content": "hi"}]
    try:
        with httpx.Client(base_url=handle.url, timeout=60, headers={"anthropic-version": "2023-06-01"}) as http:
            for path, body, expected in (
                    ("/v1/completions", {**PROMPT, "priority": -3, "n": 2}, [-3, -3]),
                    ("/v1/chat/completions", {"messages": user, "max_tokens": 2, "priority": 7}, [7]),
                    ("/v1/responses", {"input": "hi", "max_output_tokens": 2, "priority": 2}, [2]),
                    ("/v1/messages", {"model": handle.model, "messages": user, "max_tokens": 2, "priority": 4}, [4]),
                    ("/v1/completions", PROMPT, [0])):
                seen.clear()
                salts.clear()
                r = http.post(path, json={**body, "cache_salt": "tenant"})
                assert r.status_code == 200, (path, r.text)
                assert seen == expected and salts == ["tenant"] * len(expected), path
            for bad in ("high", True, 1.5):
                r = http.post("/v1/completions", json={**PROMPT, "priority": bad})
                assert r.status_code == 400 and r.json()["error"]["param"] == "priority", r.text
    finally:
        handle.stop()
        eng.shutdown()


def test_priority_under_fcfs_is_a_400(server: ServerHandle) -> None:
    """As vLLM: the default policy (fcfs) refuses a priority other than 0 rather than ignoring it."""
    user = [{"role": "user", "content": "hi"}]
    with httpx.Client(base_url=server.url, timeout=60, headers={"anthropic-version": "2023-06-01"}) as http:
        for path, body in (("/v1/completions", PROMPT), ("/v1/chat/completions", {"messages": user, "max_tokens": 2}),
                           ("/v1/responses", {"input": "hi", "max_output_tokens": 2}),
                           ("/v1/messages", {"model": server.model, "messages": user, "max_tokens": 2})):
            r = http.post(path, json={**body, "priority": 1})
            assert r.status_code == 400, (path, r.text)
            error = r.json()["error"]
            assert "priority" in error["message"] and "--scheduling-policy priority" in error["message"], path
            if path != "/v1/messages":  # Anthropic's errors have no param
                assert error["param"] == "priority", path
            assert http.post(path, json={**body, "priority": 0}).status_code == 200, path
