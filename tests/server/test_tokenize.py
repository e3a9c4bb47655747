"""/tokenize and /detokenize: the token ids the generation endpoints would feed the engine (raw prompt, or
messages through the chat template), their text back, and clear 400s for bad input."""

from __future__ import annotations

import httpx
import openai
import pytest

from nibble.engine.tokenizer import Tokenizer

from .conftest import ServerHandle
from .test_errors import check_error

MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_prompt_round_trip_matches_completions(http: httpx.Client, client: openai.OpenAI, server: ServerHandle,
                                               tokenizer: Tokenizer) -> None:
    text = "The capital of France is"
    r = http.post("/tokenize", json={"model": server.model, "prompt": text})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tokenizer.encode(text) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == server.engine.engine.max_model_len
    usage = client.completions.create(model=server.model, prompt=text, max_tokens=1).usage
    assert usage.prompt_tokens == body["count"]
    back = http.post("/detokenize", json={"tokens": body["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": text}


def test_messages_count_as_chat_does(http: httpx.Client, client: openai.OpenAI, server: ServerHandle,
                                     tokenizer: Tokenizer) -> None:
    kwargs = {"enable_thinking": False}
    r = http.post("/tokenize", json={"messages": MESSAGES, "chat_template_kwargs": kwargs})
    assert r.status_code == 200, r.text
    ids = r.json()["tokens"]
    rendered = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, **kwargs)
    assert ids == tokenizer.encode(rendered)
    usage = client.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=1,
                                           extra_body={"chat_template_kwargs": kwargs}).usage
    assert usage.prompt_tokens == len(ids)
    assert http.post("/detokenize", json={"tokens": ids}).json() == {"prompt": rendered}


@pytest.mark.parametrize("path,body,param", [
    ("/tokenize", {}, None),
    ("/tokenize", {"prompt": "a", "messages": MESSAGES}, None),
    ("/tokenize", {"prompt": "a", "temperature": 1}, "temperature"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/tokenize", {"messages": [{"role": "user"}]}, "messages"),
    ("/tokenize", {"prompt": "a", "model": "other"}, "model"),
    ("/tokenize", {"messages": MESSAGES, "chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
    ("/detokenize", {"tokens": [1, -3]}, "tokens"),
    ("/detokenize", {"tokens": [10**9]}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
])
def test_bad_input_is_a_clear_error(http: httpx.Client, path: str, body: dict, param: str | None) -> None:
    r = http.post(path, json=body)
    err = check_error(r, 404 if param == "model" else 400)
    if param is not None:
        assert err["param"] == param, err
