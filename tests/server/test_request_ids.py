"""Client-chosen request ids (X-Request-Id header, vLLM's `request_id` body field): they name the response and
the log lines, come back in the X-Request-Id header, and two requests with the same id still run as two engine
requests."""

from __future__ import annotations

import asyncio
import logging

import httpx
import pytest

from .conftest import ServerHandle

PROMPT = {"prompt": "hello", "max_tokens": 3, "ignore_eos": True}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "ignore_eos": True}


def test_header_names_the_response_and_the_log(http: httpx.Client, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="nibble.server"):
        r = http.post("/v1/completions", json=PROMPT, headers={"X-Request-Id": "gateway-42"})
    assert r.status_code == 200
    assert r.json()["id"] == "cmpl-gateway-42" and r.headers["x-request-id"] == "gateway-42"
    assert any(rec.getMessage().startswith("cmpl-gateway-42: 200") for rec in caplog.records)
    chat = http.post("/v1/chat/completions", json={**CHAT, "request_id": "from-body"})
    assert chat.json()["id"] == "chatcmpl-from-body" and chat.headers["x-request-id"] == "chatcmpl-from-body"
    # the header wins over the body field, as in vLLM
    both = http.post("/v1/chat/completions", json={**CHAT, "request_id": "b"}, headers={"X-Request-Id": "h"})
    assert both.json()["id"] == "chatcmpl-h"


def test_streams_and_errors_carry_the_header(http: httpx.Client) -> None:
    with http.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True},
                     headers={"X-Request-Id": "s-1"}) as r:
        assert r.headers["x-request-id"] == "s-1"
        ids = {line for line in r.iter_lines() if '"id":"chatcmpl-s-1"' in line}
    assert ids
    bad = http.post("/v1/completions", json={**PROMPT, "temperature": -1}, headers={"X-Request-Id": "e-1"})
    assert bad.status_code == 400 and bad.headers["x-request-id"] == "e-1"
    own = http.post("/v1/completions", json=PROMPT)
    assert own.headers["x-request-id"] == own.json()["id"] and own.json()["id"].startswith("cmpl-")
    assert http.get("/health").headers["x-request-id"]
    # an id that cannot go into a header or a log line is replaced by nibble's own
    odd = http.post("/v1/completions", json={**PROMPT, "request_id": "a\nb"})
    assert odd.json()["id"] != "cmpl-a\nb" and "\n" not in odd.headers["x-request-id"]


def test_the_same_id_twice_runs_two_requests(server: ServerHandle) -> None:
    async def both() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            body = {**PROMPT, "max_tokens": 8, "temperature": 0.0}
            return await asyncio.gather(*(client.post("/v1/completions", json=body, headers={"X-Request-Id": "dup"})
                                          for _ in range(2)))

    first, second = asyncio.run(both())
    assert first.status_code == second.status_code == 200, (first.text, second.text)
    assert first.json()["id"] == second.json()["id"] == "cmpl-dup"
    assert first.json()["choices"][0]["text"] == second.json()["choices"][0]["text"]
    assert first.json()["usage"]["completion_tokens"] == second.json()["usage"]["completion_tokens"] == 8


def test_unhandled_errors_carry_the_id_and_cors_headers(engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """An exception no handler takes is the API's JSON 500, with the X-Request-Id and CORS headers that
    Starlette's own last-resort answer would lack."""
    from .conftest import start_server

    handle = start_server(engine, cors={"allow_origins": ["*"]})
    try:
        def broken() -> dict:
            raise RuntimeError("stats exploded")

        monkeypatch.setattr(engine, "stats", broken)
        r = httpx.get(handle.url + "/metrics", headers={"X-Request-Id": "boom-1", "Origin": "http://page.example"})
        assert r.status_code == 500 and r.headers["x-request-id"] == "boom-1"
        assert r.headers["access-control-allow-origin"] == "*"
        assert r.json()["error"]["message"] == "internal server error: RuntimeError: stats exploded"
    finally:
        handle.stop()
