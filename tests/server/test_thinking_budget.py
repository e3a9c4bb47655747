"""thinking_token_budget over HTTP on the demo model (its chat template leaves the model thinking): on chat
completions the reasoning is exactly the budget's tokens, `</think>` follows and the content after it, streamed
or not, for every choice of n; on completions a prompt that ends inside thinking is budgeted and one outside is
not; Responses forwards the field; /v1/messages enforces thinking.budget_tokens (the request field wins); a JSON
schema constrains the answer after a forced end; bad values are 400s naming the field."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from nibble.engine.tokenizer import Tokenizer
from nibble.server.reasoning import extract

from .conftest import ServerHandle

END = 1016  # the demo tokenizer's </think>
MESSAGES = [{"role": "user", "content": "Name a colour."}]
BASE = {"temperature": 0.0, "ignore_eos": True, "max_tokens": 10}
IDS = {"logprobs": True, "return_tokens_as_token_ids": True}


def post(server: ServerHandle, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(server.api + path, json={"model": server.model, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def chat_ids(choice: dict[str, Any]) -> list[int]:
    return [int(e["token"].removeprefix("token_id:")) for e in choice["logprobs"]["content"]]


def test_chat_reasoning_is_the_budget(server: ServerHandle, tokenizer: Tokenizer) -> None:
    body = {**BASE, **IDS, "messages": MESSAGES}
    free = chat_ids(post(server, "/chat/completions", body)["choices"][0])
    choice = post(server, "/chat/completions", {**body, "thinking_token_budget": 4})["choices"][0]
    ids = chat_ids(choice)
    assert END not in free and ids[:4] == free[:4] and ids[4] == END and len(ids) == 10
    message = choice["message"]
    assert message["reasoning_content"] == tokenizer.decode(ids[:4]).strip()
    assert message["content"] and (message["reasoning_content"], message["content"]) == \
        extract(tokenizer.decode(ids), True)
    with httpx.stream("POST", server.api + "/chat/completions", timeout=120,
                      json={"model": server.model, **BASE, "messages": MESSAGES, "thinking_token_budget": 4,
                            "stream": True}) as s:
        deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in s.iter_lines()
                  if line.startswith("data: {") and json.loads(line[6:])["choices"]]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == message["reasoning_content"]
    assert "".join(d.get("content") or "" for d in deltas) == message["content"]
    sampled = post(server, "/chat/completions", {**body, "thinking_token_budget": 3, "n": 2, "temperature": 1.0,
                                                 "seed": 11})["choices"]
    assert len(sampled) == 2 and all(chat_ids(c)[3] == END and END not in chat_ids(c)[:3] for c in sampled)


def test_completions_budget_only_a_thinking_prompt(server: ServerHandle, tokenizer: Tokenizer) -> None:
    thinking = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    assert thinking.endswith("<think>\n")
    for prompt, budget in ((thinking, 2), (thinking + "Red.\n</think>\n\n", None)):
        body = {**BASE, "prompt": prompt, "logprobs": 0, "return_tokens_as_token_ids": True}
        ids = [[int(t.removeprefix("token_id:")) for t in post(server, "/completions", b)["choices"][0]["logprobs"]
                ["tokens"]] for b in (body, {**body, "thinking_token_budget": 2})]
        if budget is None:
            assert ids[1] == ids[0]
        else:
            assert ids[1][:2] == ids[0][:2] and ids[1][2] == END


def test_responses_forward_the_budget(server: ServerHandle) -> None:
    chat = post(server, "/chat/completions", {**BASE, "messages": MESSAGES, "thinking_token_budget": 3})
    out = post(server, "/responses", {"input": "Name a colour.", "max_output_tokens": 10, "temperature": 0.0,
                                      "ignore_eos": True, "thinking_token_budget": 3})
    assert [o["type"] for o in out["output"]] == ["reasoning", "message"]
    assert out["output"][0]["content"][0]["text"] == chat["choices"][0]["message"]["reasoning_content"]
    assert out["output"][1]["content"][0]["text"] == chat["choices"][0]["message"]["content"]


def test_messages_enforce_budget_tokens(server: ServerHandle) -> None:
    def message(**fields: Any) -> list[dict[str, Any]]:
        r = httpx.post(server.url + "/v1/messages", timeout=120,
                       json={"model": server.model, "messages": MESSAGES, "max_tokens": 10, "temperature": 0.0,
                             "ignore_eos": True, **fields})
        assert r.status_code == 200, r.text
        return r.json()["content"]

    for budget, fields in ((3, {}), (1, {"thinking_token_budget": 1})):
        chat = post(server, "/chat/completions", {**BASE, "messages": MESSAGES,
                                                  "thinking_token_budget": budget})["choices"][0]["message"]
        blocks = message(thinking={"type": "enabled", "budget_tokens": 3}, **fields)
        assert blocks == [{"type": "thinking", "thinking": chat["reasoning_content"], "signature": ""},
                          {"type": "text", "text": chat["content"]}]
    assert message(thinking={"type": "adaptive"})[0]["thinking"] != blocks[0]["thinking"]


def test_json_schema_after_a_forced_end(server: ServerHandle) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    out = post(server, "/chat/completions", {
        "messages": MESSAGES, "temperature": 0.0, "max_tokens": 30, "thinking_token_budget": 2,
        "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}})["choices"][0]
    assert out["finish_reason"] == "stop" and out["message"]["reasoning_content"]
    assert json.loads(out["message"]["content"]).keys() == {"ok"}


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", {"messages": MESSAGES, "thinking_token_budget": -1}),
    ("/v1/completions", {"prompt": "hi", "thinking_token_budget": "many"}),
    ("/v1/responses", {"input": "hi", "thinking_token_budget": -3}),
])
def test_bad_budgets_are_400s_naming_the_field(server: ServerHandle, path: str, body: dict[str, Any]) -> None:
    r = httpx.post(server.url + path, json={"model": server.model, "max_tokens": 2, **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "thinking_token_budget"
    r = httpx.post(server.url + "/v1/messages", timeout=60, json={"model": server.model, "max_tokens": 2,
                                                                   "messages": MESSAGES, "thinking_token_budget": -1})
    assert r.status_code == 400 and "thinking_token_budget" in r.json()["error"]["message"]
