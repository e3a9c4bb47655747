"""Malformed and hostile requests: each gets a clear 4xx OpenAI-style error (never a 5xx, a traceback or a
hang), and the server keeps serving normal requests, with no engine request left behind."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from nibble.engine.llm_engine import LLMEngine

from .conftest import MAX_MODEL_LEN, ServerHandle, engine_config, served, wait_idle

C, CH = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]


def raw(text: str) -> bytes:
    return text.encode()


# (id, path, body: dict for JSON or bytes sent as is, words the error message must contain)
CASES: list[tuple[str, str, Any, tuple[str, ...]]] = [
    ("huge-max-tokens", C, {"prompt": "hi", "max_tokens": 10**12}, ("maximum context length",)),
    ("huge-max-tokens-2^70", C, {"prompt": "hi", "max_tokens": 2**70}, ("max_tokens",)),
    ("huge-max-completion-tokens", CH, {"messages": USER, "max_completion_tokens": 10**9}, ("context length",)),
    ("negative-max-tokens", C, {"prompt": "hi", "max_tokens": -1}, ("max_tokens",)),
    ("negative-temperature", C, {"prompt": "hi", "temperature": -0.5}, ("temperature",)),
    ("negative-top-k", C, {"prompt": "hi", "top_k": -5}, ("top_k",)),
    ("negative-min-tokens", C, {"prompt": "hi", "min_tokens": -1}, ("min_tokens",)),
    ("negative-n", C, {"prompt": "hi", "n": -1}, ("n",)),
    ("negative-max-completion-tokens", CH, {"messages": USER, "max_completion_tokens": -3}, ("max_completion",)),
    ("nan-temperature", C, raw('{"prompt": "hi", "temperature": NaN}'), ("temperature",)),
    ("inf-top-p", C, raw('{"prompt": "hi", "top_p": Infinity}'), ("top_p",)),
    ("neg-inf-presence", C, raw('{"prompt": "hi", "presence_penalty": -Infinity}'), ("presence_penalty",)),
    ("overflow-temperature", C, raw('{"prompt": "hi", "temperature": 1e999}'), ("temperature",)),
    ("nan-repetition", C, raw('{"prompt": "hi", "repetition_penalty": NaN}'), ("repetition_penalty",)),
    ("nan-min-p", C, raw('{"prompt": "hi", "min_p": NaN}'), ("min_p",)),
    ("nan-max-tokens", C, raw('{"prompt": "hi", "max_tokens": NaN}'), ("max_tokens",)),
    ("inf-seed", C, raw('{"prompt": "hi", "seed": Infinity}'), ("seed",)),
    ("nan-chat-temperature", CH, raw('{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}'),
     ("temperature",)),
    ("invalid-utf8", C, b'{"prompt": "\xff\xfe hi"}', ("UTF-8",)),
    ("invalid-utf8-chat", CH, b'{"messages": [{"role": "user", "content": "\xc3\x28"}]}', ("UTF-8",)),
    ("lone-surrogate", C, raw('{"prompt": "\\ud800abc", "max_tokens": 2}'), ("surrogate",)),
    ("lone-surrogate-chat", CH, raw('{"messages": [{"role": "user", "content": "a\\udfff"}]}'), ("surrogate",)),
    ("giant-text-prompt", C, {"prompt": "word " * (MAX_MODEL_LEN * 5)}, ("maximum context length",)),
    ("giant-token-prompt", C, {"prompt": [1] * (MAX_MODEL_LEN * 2)}, ("maximum context length",)),
    ("giant-chat", CH, {"messages": [{"role": "user", "content": "word " * (MAX_MODEL_LEN * 5)}]},
     ("maximum context length",)),
    ("truncated-json", C, raw('{"prompt": "a"'), ("not valid JSON",)),
    ("trailing-garbage", C, raw('{"prompt": "a"} xyz'), ("not valid JSON",)),
    ("unquoted-keys", C, raw("{prompt: 'a'}"), ("not valid JSON",)),
    ("deep-nesting", C, raw("[" * 100_000), ("nested too deeply",)),
    ("not-an-object", CH, raw('["messages"]'), ("JSON object",)),
    ("prompt-dict", C, {"prompt": {"text": "hi"}}, ("prompt",)),
    ("messages-string", CH, {"messages": "hi"}, ("messages",)),
    ("messages-of-strings", CH, {"messages": ["hi"]}, ("messages",)),
    ("content-int", CH, {"messages": [{"role": "user", "content": 5}]}, ("content",)),
    ("stop-int", C, {"prompt": "hi", "stop": 5}, ("stop",)),
    ("max-tokens-float", C, {"prompt": "hi", "max_tokens": 3.5}, ("max_tokens",)),
    ("temperature-string", C, {"prompt": "hi", "temperature": "hot"}, ("temperature",)),
    ("stream-int", C, {"prompt": "hi", "stream": 5}, ("stream",)),
    ("model-list", C, {"prompt": "hi", "model": ["x"]}, ("model",)),
    ("unknown-role", CH, {"messages": [{"role": "wizard", "content": "x"}]}, ("messages",)),
    ("unknown-role-after-user", CH, {"messages": [*USER, {"role": "wizard", "content": "x"}]}, ("role",)),
    ("empty-role", CH, {"messages": [{"role": "", "content": "x"}, *USER]}, ("role",)),
    ("oov-token", C, {"prompt": [5000]}, ("token ids",)),
    ("negative-token", C, {"prompt": [-1]}, ("token ids",)),
    ("huge-token", C, {"prompt": [2**40]}, ("token ids",)),
    ("oov-token-in-batch", C, {"prompt": [[1, 2], [99999]]}, ("token ids",)),
    ("empty-prompt-list", C, {"prompt": []}, ("prompt",)),
    ("empty-prompt-in-list", C, {"prompt": [[]]}, ("prompt",)),
    ("empty-prompt", C, {"prompt": ""}, ("prompt",)),
    ("empty-messages", CH, {"messages": []}, ("messages",)),
    ("long-stop-list", C, {"prompt": "hi", "stop": [f"s{i}" for i in range(100_000)]}, ("stop",)),
    ("empty-stop", C, {"prompt": "hi", "stop": [""]}, ("stop",)),
    ("logprobs-21", C, {"prompt": "hi", "logprobs": 21}, ("logprobs",)),
    ("logprobs-negative", C, {"prompt": "hi", "logprobs": -1}, ("logprobs",)),
    ("logprobs-huge", C, {"prompt": "hi", "logprobs": 10**6}, ("logprobs",)),
    ("top-logprobs-21", CH, {"messages": USER, "logprobs": True, "top_logprobs": 21}, ("top_logprobs",)),
    ("top-logprobs-negative", CH, {"messages": USER, "logprobs": True, "top_logprobs": -1}, ("top_logprobs",)),
]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerHandle]:
    with served(LLMEngine(engine_config())) as handle:
        yield handle


@pytest.fixture()
def http(server: ServerHandle) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def post(http: httpx.Client, path: str, body: Any) -> httpx.Response:
    if isinstance(body, bytes):
        return http.post(path, content=body, headers={"content-type": "application/json"})
    return http.post(path, json=body)


def assert_clear_4xx(response: httpx.Response, words: tuple[str, ...] = ()) -> dict[str, Any]:
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:500])
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "code"}
    message = error["message"]
    assert "Traceback" not in response.text and "File \"" not in message
    for word in words:
        assert word.lower() in message.lower(), (word, message)
    return error


def assert_serving(http: httpx.Client) -> None:
    r = http.post(C, json={"prompt": "still serving?", "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")


@pytest.mark.parametrize(("path", "body", "words"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_hostile_request_gets_clear_4xx(http: httpx.Client, path: str, body: Any, words: tuple[str, ...]) -> None:
    assert_clear_4xx(post(http, path, body), words)


def test_server_serves_after_hostile_requests(server: ServerHandle, http: httpx.Client) -> None:
    for _, path, body, _ in CASES[::3]:
        assert 400 <= post(http, path, body).status_code < 500
    assert_serving(http)
    assert wait_idle(server.engine), server.engine.stats()


def _post_into(out: list[httpx.Response], http: httpx.Client, path: str, body: Any) -> None:
    out.append(post(http, path, body))


def test_multi_megabyte_bodies(server: ServerHandle, http: httpx.Client) -> None:
    """4 MB prompts are refused (too long) without blocking other clients meanwhile."""
    big = "word " * (800 * 1024)
    served_meanwhile: list[float] = []

    def probe() -> None:
        with httpx.Client(base_url=server.url, timeout=60) as other:
            t0 = time.monotonic()
            assert other.get("/health").status_code == 200
            served_meanwhile.append(time.monotonic() - t0)

    for path, body in ((C, {"prompt": big}), (CH, {"messages": [{"role": "user", "content": big}]}),
                       (C, {"prompt": [1] * (1 << 20)})):
        t0 = time.monotonic()
        responses: list[httpx.Response] = []
        worker = threading.Thread(target=_post_into, args=(responses, http, path, body))
        worker.start()
        time.sleep(0.2)
        probe()
        worker.join(timeout=120)
        assert not worker.is_alive(), f"{path}: no answer to a {len(json.dumps(body)) >> 20} MB body"
        assert_clear_4xx(responses[0], ("context length",))
        assert time.monotonic() - t0 < 60
    assert max(served_meanwhile) < 5.0, served_meanwhile
    assert_serving(http)
    assert wait_idle(server.engine), server.engine.stats()
