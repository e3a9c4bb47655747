"""A client that disconnects (streaming or not) aborts its engine request and frees its cache."""

from __future__ import annotations

import httpx
import pytest

from .conftest import ServerHandle, metric_value, wait_idle

LONG = {"max_tokens": 900, "ignore_eos": True, "temperature": 0.0}


def aborted(http: httpx.Client) -> float:
    return metric_value(http.get("/metrics").text, "nibble:request_success_total", finished_reason="abort")


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/completions", {"prompt": "Tell me a very long story", **LONG}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell me a long story"}], **LONG}),
])
def test_stream_disconnect_aborts(server: ServerHandle, http: httpx.Client, path: str, body: dict) -> None:
    before = aborted(http)
    with httpx.Client(base_url=server.url, timeout=30) as c, c.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        events = 0
        for line in r.iter_lines():
            if line.startswith("data: "):
                events += 1
            if events >= 4:
                break
        assert server.engine.stats()["num_running"] == 1
    assert wait_idle(server.engine), server.engine.stats()
    assert aborted(http) == before + 1


def test_non_stream_disconnect_aborts(server: ServerHandle, http: httpx.Client) -> None:
    before = aborted(http)
    with pytest.raises(httpx.ReadTimeout), httpx.Client(base_url=server.url, timeout=0.5) as c:
        c.post("/v1/completions", json={"prompt": "Tell me a very long story", **LONG})
    assert wait_idle(server.engine), server.engine.stats()
    assert aborted(http) == before + 1


def test_batch_disconnect_aborts_every_prompt(server: ServerHandle, http: httpx.Client) -> None:
    before = aborted(http)
    with pytest.raises(httpx.ReadTimeout), httpx.Client(base_url=server.url, timeout=0.5) as c:
        c.post("/v1/completions", json={"prompt": ["one story", "two stories", "three"], **LONG})
    assert wait_idle(server.engine), server.engine.stats()
    assert aborted(http) == before + 3
