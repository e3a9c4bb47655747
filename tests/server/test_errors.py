"""Bad requests get 4xx with an OpenAI error body (never a traceback or a hang), and the server keeps
serving afterwards."""

from __future__ import annotations

import json
import sys
from typing import Any

import httpx
import openai
import pytest

from nibble.server import request_body

from .conftest import MAX_MODEL_LEN, ServerHandle

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "hi"}]


def completion(**fields: Any) -> dict[str, Any]:
    return {"prompt": "hello", "max_tokens": 2, **fields}


def chat(**fields: Any) -> dict[str, Any]:
    return {"messages": USER, "max_tokens": 2, **fields}


# (path, JSON body, expected param or None)
BAD_BODIES = [
    (COMPLETIONS, completion(temperature=-1), "temperature"),
    (COMPLETIONS, completion(top_p=0), "top_p"),
    (COMPLETIONS, completion(top_p=1.5), "top_p"),
    (COMPLETIONS, completion(max_tokens=0), "max_tokens"),
    (COMPLETIONS, completion(max_tokens=-5), "max_tokens"),
    (COMPLETIONS, completion(logprobs=50), "logprobs"),
    (COMPLETIONS, completion(presence_penalty=3), "presence_penalty"),
    (COMPLETIONS, completion(repetition_penalty=0), "repetition_penalty"),
    (COMPLETIONS, completion(min_p=2), "min_p"),
    (COMPLETIONS, completion(top_k=-7), "top_k"),
    (COMPLETIONS, completion(min_tokens=5, max_tokens=2), "min_tokens"),
    (COMPLETIONS, completion(seed=2**70), "seed"),
    (COMPLETIONS, completion(n=0), "n"),
    (COMPLETIONS, completion(n=65), "n"),
    (COMPLETIONS, completion(best_of=3), "best_of"),
    (COMPLETIONS, completion(suffix="tail"), "suffix"),
    (COMPLETIONS, completion(logit_bias={"five": 1.0}), "logit_bias"),
    (COMPLETIONS, completion(logit_bias={"5": 200}), "logit_bias"),
    (COMPLETIONS, completion(logit_bias={"1000000": 1.0}), None),
    (COMPLETIONS, completion(stop=[""]), "stop"),
    (COMPLETIONS, completion(stop_token_ids=[-1]), "stop_token_ids"),
    (COMPLETIONS, completion(guided_json={"type": "foo"}), "guided_json"),
    (COMPLETIONS, completion(guided_json="{not json"), "guided_json"),
    (COMPLETIONS, completion(guided_regex="a(b"), "guided_regex"),
    (COMPLETIONS, completion(guided_choice=[]), "guided_choice"),
    (COMPLETIONS, completion(guided_grammar="start: ("), "guided_grammar"),
    (COMPLETIONS, completion(structured_outputs={"regex": "a+", "choice": ["a"]}), "structured_outputs"),
    (COMPLETIONS, completion(structured_outputs={"whitespace_pattern": " "}), "structured_outputs"),
    (COMPLETIONS, completion(structured_outputs={"choice": "yes"}), "structured_outputs"),
    (COMPLETIONS, completion(guided_regex="a+", response_format={"type": "json_object"}),
     "response_format, guided_regex"),
    (COMPLETIONS, completion(guided_json={"type": "object"}, structured_outputs={"regex": "a+"}),
     "structured_outputs, guided_json"),
    (CHAT, chat(guided_regex="a+", guided_choice=["a"], response_format={"type": "text"}),
     "guided_regex, guided_choice"),
    (COMPLETIONS, completion(guided_regex="a+", min_tokens=2), "min_tokens"),
    (COMPLETIONS, completion(use_beam_search=True), "use_beam_search"),
    (CHAT, chat(length_penalty=0.5), "length_penalty"),
    (COMPLETIONS, completion(logits_processors=["my.module:Processor"]), "logits_processors"),
    (COMPLETIONS, completion(allowed_token_ids=[]), "allowed_token_ids"),
    (COMPLETIONS, completion(allowed_token_ids=[3, -1]), "allowed_token_ids"),
    (CHAT, chat(allowed_token_ids=[3, 10**6]), "allowed_token_ids"),
    (COMPLETIONS, completion(bad_words="word"), "bad_words"),
    (CHAT, chat(bad_words=["fine", " "]), "bad_words"),
    (COMPLETIONS, completion(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
    (CHAT, chat(truncate_prompt_tokens=-2), "truncate_prompt_tokens"),
    (COMPLETIONS, completion(truncate_prompt_tokens=MAX_MODEL_LEN + 1), "truncate_prompt_tokens"),
    (CHAT, chat(prompt_logprobs=2, stream=True), "prompt_logprobs"),
    (CHAT, chat(prompt_logprobs=21), "prompt_logprobs"),
    (COMPLETIONS, completion(prompt=""), "prompt"),
    (COMPLETIONS, completion(prompt=[]), "prompt"),
    (COMPLETIONS, completion(prompt=[[]]), "prompt"),
    (COMPLETIONS, completion(prompt=5), "prompt"),
    (COMPLETIONS, completion(prompt=[1, "a"]), "prompt"),
    (COMPLETIONS, completion(prompt=[10**9]), None),
    (COMPLETIONS, {"max_tokens": 2}, "prompt"),
    (COMPLETIONS, completion(max_tokens="many"), "max_tokens"),
    (COMPLETIONS, completion(stream="maybe"), "stream"),
    (COMPLETIONS, completion(stream_options={"include_usage": True}), "stream_options"),
    (COMPLETIONS, completion(prompt=[1] * (MAX_MODEL_LEN + 1)), "prompt"),
    (COMPLETIONS, completion(prompt=[1] * MAX_MODEL_LEN, max_tokens=None), "prompt"),
    (COMPLETIONS, completion(max_tokens=MAX_MODEL_LEN), "max_tokens"),
    (CHAT, chat(messages=[]), "messages"),
    (CHAT, chat(messages="hi"), "messages"),
    (CHAT, chat(messages=[{"role": "user"}]), "messages"),
    (CHAT, chat(messages=[{"role": 5, "content": "x"}]), "messages"),
    (CHAT, chat(messages=[{"role": "system", "content": "only a system prompt"}]), "messages"),
    (CHAT, chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
     "messages"),
    (CHAT, {"max_tokens": 2}, "messages"),
    (CHAT, chat(tools=[{"type": "function", "function": {}}]), "tools"),
    (CHAT, chat(tools="get_weather"), "tools"),
    (CHAT, chat(tool_choice="required"), "tool_choice"),
    (CHAT, chat(tool_choice={"type": "function", "function": {"name": "f"}}), "tool_choice"),
    (CHAT, chat(tool_choice={"type": "function", "function": {"name": "g"}},
                tools=[{"type": "function", "function": {"name": "f"}}]), "tool_choice"),
    (CHAT, chat(tool_choice={"type": "function"}), "tool_choice"),
    (CHAT, chat(tool_choice="always"), "tool_choice"),
    (CHAT, chat(tool_choice="required", tools=[{"type": "function", "function": {"name": "f"}}],
                response_format={"type": "json_object"}), "tool_choice"),
    (CHAT, chat(response_format={"type": "json_schema"}), "response_format"),
    (CHAT, chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 3}}}),
     "response_format"),
    (CHAT, chat(response_format={"type": "yaml"}), "response_format"),
    (CHAT, chat(top_logprobs=3), "top_logprobs"),
    (CHAT, chat(logprobs=True, top_logprobs=30), "top_logprobs"),
    (CHAT, chat(temperature=-1), "temperature"),
    (CHAT, chat(max_completion_tokens=0), "max_completion_tokens"),
    (CHAT, chat(max_completion_tokens=MAX_MODEL_LEN), "max_completion_tokens"),
    (CHAT, chat(n=0), "n"),
    (CHAT, chat(n=1000), "n"),
    (CHAT, chat(functions=[{"name": "f"}]), "functions"),
    (CHAT, chat(enable_thinking="no"), "enable_thinking"),
    (CHAT, chat(chat_template_kwargs={"messages": []}), "chat_template_kwargs"),
    (CHAT, chat(messages=[{"role": "user", "content": "word " * MAX_MODEL_LEN}]), "messages"),
]


def check_error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert "Traceback" not in error["message"]
    return error


def assert_still_serving(http: httpx.Client) -> None:
    ok = http.post(COMPLETIONS, json=completion(max_tokens=2, temperature=0))
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize(("path", "body", "param"), BAD_BODIES, ids=[f"{'chat' if p == CHAT else 'cmpl'}-{i}-{param}"
                                                                     for i, (p, _, param) in enumerate(BAD_BODIES)])
def test_bad_request_is_400(http: httpx.Client, path: str, body: dict[str, Any], param: str | None) -> None:
    error = check_error(http.post(path, json=body), 400)
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param, error
        assert param.split(".")[0] in error["message"] or param == "messages"
    assert_still_serving(http)


@pytest.mark.parametrize("raw", [b"{", b"not json", b"", b"[1, 2]", b'"text"', b"\xff\xfe", b'{"prompt": "a",}'])
@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_malformed_body_is_400(http: httpx.Client, path: str, raw: bytes) -> None:
    check_error(http.post(path, content=raw, headers={"content-type": "application/json"}), 400)
    assert_still_serving(http)


def test_oversized_and_deeply_nested_bodies(http: httpx.Client, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(request_body, "MAX_BODY_BYTES", 1000)
    check_error(http.post(COMPLETIONS, json=completion(prompt="x" * 2000)), 413)
    monkeypatch.undo()
    check_error(http.post(COMPLETIONS, content=b"[" * 100_000 + b"]" * 100_000), 400)
    nested: Any = "x"
    for _ in range(5000):
        nested = {"a": nested}
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(20_000)
    try:
        body = json.dumps(chat(messages=[{"role": "user", "content": "hi", "extra": nested}]))
    finally:
        sys.setrecursionlimit(limit)
    response = http.post(CHAT, content=body)
    assert response.status_code in (200, 400), response.text
    assert_still_serving(http)


def test_unknown_model_is_404(http: httpx.Client, client: openai.OpenAI, server: ServerHandle) -> None:
    for path, body in ((COMPLETIONS, completion(model="no-such-model")), (CHAT, chat(model="no-such-model"))):
        error = check_error(http.post(path, json=body), 404)
        assert error["code"] == "model_not_found" and error["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=1)
    # The served name and the model path are both accepted.
    core = server.engine.engine
    for name in {server.model, core.config.model, str(core.model_dir)}:
        assert http.post(COMPLETIONS, json=completion(model=name)).status_code == 200
    check_error(http.get("/v1/models/no-such-model"), 404)
    assert http.get(f"/v1/models/{server.model}").json()["id"] == server.model


def test_unknown_route_and_method(http: httpx.Client) -> None:
    check_error(http.get("/v1/nothing-here"), 404)
    check_error(http.get(COMPLETIONS), 405)


def test_openai_client_raises_bad_request(client: openai.OpenAI, server: ServerHandle) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=server.model, prompt="hi", max_tokens=1, temperature=-1)
    assert "temperature" in str(info.value)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=server.model, messages=[], max_tokens=1)
