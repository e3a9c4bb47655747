"""vLLM's request fields allowed_token_ids, bad_words, truncate_prompt_tokens, return_tokens_as_token_ids and (on
chat) prompt_logprobs over HTTP, on the demo model: token ids read back through return_tokens_as_token_ids show
that only allowed tokens are generated and banned words never are; a truncated prompt gives what its last k
tokens give; chat's prompt_logprobs are the completions endpoint's for the rendered prompt."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from nibble.engine.token_masks import tokenize_bad_words
from nibble.engine.tokenizer import Tokenizer
from nibble.server.token_text import TokenTexts

from .conftest import MAX_MODEL_LEN, ServerHandle

MESSAGES = [{"role": "user", "content": "Name a colour."}]
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
BASE = {"temperature": 0.0, "ignore_eos": True, "max_tokens": 12}
ALLOWED = list(range(1, 1024, 4))


def post(server: ServerHandle, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(server.api + path, json={"model": server.model, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def stream(server: ServerHandle, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", server.api + path, json={"model": server.model, "stream": True, **body},
                      timeout=120) as s:
        return [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]


def as_id(token: str) -> int:
    assert token.startswith("token_id:"), token
    return int(token.removeprefix("token_id:"))


def completion_ids(server: ServerHandle, body: dict[str, Any]) -> list[int]:
    """The generated token ids of a completion, read from its logprobs as token ids."""
    out = post(server, "/completions", {**body, "logprobs": 0, "return_tokens_as_token_ids": True})
    return [as_id(t) for t in out["choices"][0]["logprobs"]["tokens"]]


def test_completions_tokens_as_ids_parse_back(server: ServerHandle, tokenizer: Tokenizer) -> None:
    texts = TokenTexts(tokenizer)
    body = {**BASE, "prompt": "The colour of the sky", "logprobs": 3}
    plain = post(server, "/completions", body)["choices"][0]
    as_ids = post(server, "/completions", {**body, "return_tokens_as_token_ids": True})["choices"][0]
    ids = [as_id(t) for t in as_ids["logprobs"]["tokens"]]
    assert as_ids["text"] == plain["text"] and len(ids) == 12
    assert [texts.text(i) for i in ids] == plain["logprobs"]["tokens"]
    assert as_ids["logprobs"]["token_logprobs"] == plain["logprobs"]["token_logprobs"]
    assert as_ids["logprobs"]["text_offset"] == plain["logprobs"]["text_offset"]  # offsets into the text
    for i, top, plain_top in zip(ids, as_ids["logprobs"]["top_logprobs"], plain["logprobs"]["top_logprobs"]):
        assert f"token_id:{i}" in top and all(as_id(k) >= 0 for k in top)
        # by text, two tokens of the same text share an entry: ids name each of them
        assert set(plain_top.values()) <= set(top.values())
    chunks = stream(server, "/completions", {**body, "return_tokens_as_token_ids": True})
    assert [as_id(t) for c in chunks for ch in c["choices"] if ch["logprobs"] for t in ch["logprobs"]["tokens"]] \
        == ids
    echo = post(server, "/completions", {**body, "max_tokens": 1, "echo": True, "return_tokens_as_token_ids": True})
    prompt_ids = tokenizer.encode(body["prompt"])
    assert [as_id(t) for t in echo["choices"][0]["logprobs"]["tokens"]][:len(prompt_ids)] == prompt_ids


def test_chat_tokens_as_ids_in_content_and_alternatives(server: ServerHandle, tokenizer: Tokenizer) -> None:
    texts = TokenTexts(tokenizer)
    body = {**BASE, **NO_THINK, "messages": MESSAGES, "logprobs": True, "top_logprobs": 2,
            "return_tokens_as_token_ids": True}
    content = post(server, "/chat/completions", body)["choices"][0]["logprobs"]["content"]
    ids = [as_id(e["token"]) for e in content]
    assert len(ids) == 12
    for i, entry in zip(ids, content):
        assert entry["bytes"] == texts.byte_list(i)  # the token's own bytes, as without the flag
        assert len(entry["top_logprobs"]) == 2 and all(as_id(a["token"]) >= 0 for a in entry["top_logprobs"])
    streamed = [as_id(e["token"]) for c in stream(server, "/chat/completions", body) for ch in c["choices"]
                if ch.get("logprobs") for e in ch["logprobs"]["content"]]
    assert streamed == ids


def test_allowed_token_ids_on_both_endpoints(server: ServerHandle) -> None:
    body = {**BASE, "prompt": "Once upon a time", "allowed_token_ids": ALLOWED}
    ids = completion_ids(server, body)
    free = completion_ids(server, {**body, "allowed_token_ids": None})
    assert len(ids) == 12 and set(ids) <= set(ALLOWED) and not set(free) <= set(ALLOWED)
    sampled = completion_ids(server, {**body, "temperature": 1.0, "seed": 7, "allowed_token_ids": [9, 99, 999]})
    assert set(sampled) <= {9, 99, 999}
    chat = post(server, "/chat/completions", {**BASE, **NO_THINK, "messages": MESSAGES, "logprobs": True,
                                             "allowed_token_ids": ALLOWED, "return_tokens_as_token_ids": True})
    assert {as_id(e["token"]) for e in chat["choices"][0]["logprobs"]["content"]} <= set(ALLOWED)


def test_bad_words_never_appear(server: ServerHandle, tokenizer: Tokenizer) -> None:
    prompt = "Once upon a time"
    free = completion_ids(server, {**BASE, "prompt": prompt})
    # a word of two tokens that the free run generates, as vLLM tokenizes it
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    word, seqs = next((w, s) for i in range(len(free) - 1)
                      if "\ufffd" not in (w := tokenizer.decode(free[i:i + 2])) and w.strip()
                      and free[i:i + 2] in (s := tokenize_bad_words([w], encode, 1024)))
    single = tokenizer.decode(free[:1])
    banned = seqs + tokenize_bad_words([single], encode, 1024)
    ids = completion_ids(server, {**BASE, "prompt": prompt, "bad_words": [word, single]})
    assert ids != free and len(ids) == 12
    assert not any(ids[i:i + len(s)] == s for s in banned for i in range(len(ids)))
    chat = post(server, "/chat/completions", {**BASE, **NO_THINK, "messages": MESSAGES, "logprobs": True,
                                             "bad_words": [word, single], "return_tokens_as_token_ids": True})
    out = [as_id(e["token"]) for e in chat["choices"][0]["logprobs"]["content"]]
    assert not any(out[i:i + len(s)] == s for s in banned for i in range(len(out)))


def test_truncate_prompt_tokens(server: ServerHandle, tokenizer: Tokenizer) -> None:
    prompt = "The quick brown fox jumps over the lazy dog and keeps on running"
    ids = tokenizer.encode(prompt)
    cut = post(server, "/completions", {**BASE, "prompt": prompt, "truncate_prompt_tokens": 5, "echo": True})
    want = post(server, "/completions", {**BASE, "prompt": ids[-5:]})
    assert cut["usage"]["prompt_tokens"] == 5
    assert cut["choices"][0]["text"] == tokenizer.decode(ids[-5:]) + want["choices"][0]["text"]
    whole = post(server, "/completions", {**BASE, "prompt": ids, "truncate_prompt_tokens": -1})
    assert whole["usage"]["prompt_tokens"] == len(ids)
    rendered = httpx.post(server.url + "/tokenize", json={"messages": MESSAGES, **NO_THINK}).json()["tokens"]
    chat = post(server, "/chat/completions", {**BASE, **NO_THINK, "messages": MESSAGES, "truncate_prompt_tokens": 7})
    tail = post(server, "/completions", {**BASE, "prompt": rendered[-7:], "skip_special_tokens": True})
    assert chat["usage"]["prompt_tokens"] == 7 < len(rendered)
    assert chat["choices"][0]["message"]["content"] == tail["choices"][0]["text"]
    usage = {"stream_options": {"include_usage": True}}
    chunks = stream(server, "/chat/completions", {**BASE, **NO_THINK, **usage, "messages": MESSAGES,
                                                  "truncate_prompt_tokens": 7})
    assert chunks[-1]["usage"]["prompt_tokens"] == 7
    assert "".join(ch["delta"].get("content", "") for c in chunks for ch in c["choices"]) == \
        chat["choices"][0]["message"]["content"]
    long = httpx.post(server.api + "/completions", json={**BASE, "prompt": [5] * (MAX_MODEL_LEN + 10),
                                                         "truncate_prompt_tokens": 100})
    assert long.status_code == 200 and long.json()["usage"]["prompt_tokens"] == 100


def test_chat_prompt_logprobs_equal_the_completions_endpoints(server: ServerHandle) -> None:
    rendered = httpx.post(server.url + "/tokenize", json={"messages": MESSAGES, **NO_THINK}).json()["tokens"]
    chat = post(server, "/chat/completions", {**BASE, **NO_THINK, "messages": MESSAGES, "max_tokens": 1,
                                             "prompt_logprobs": 2, "n": 2})
    completion = post(server, "/completions", {**BASE, "prompt": rendered, "max_tokens": 1, "prompt_logprobs": 2})
    rows = chat["prompt_logprobs"]
    assert len(rows) == len(rendered) and rows[0] is None
    want = completion["choices"][0]["prompt_logprobs"]
    # the same entries; the values up to float noise (here two choices share the batch)
    assert [None if r is None else {k: (v["rank"], v["decoded_token"]) for k, v in r.items()} for r in rows] == \
        [None if r is None else {k: (v["rank"], v["decoded_token"]) for k, v in r.items()} for r in want]
    assert [v["logprob"] for r in rows[1:] for v in r.values()] == \
        pytest.approx([v["logprob"] for r in want[1:] for v in r.values()], abs=1e-4)
    assert all(str(t) in row for t, row in zip(rendered[1:], rows[1:]))
    plain = post(server, "/chat/completions", {**BASE, **NO_THINK, "messages": MESSAGES, "max_tokens": 1})
    assert plain["prompt_logprobs"] is None
    zero = stream(server, "/chat/completions", {**BASE, **NO_THINK, "messages": MESSAGES, "prompt_logprobs": 0})
    assert zero and all("prompt_logprobs" not in c for c in zero)  # 0 with a stream asks for nothing, as in vLLM
