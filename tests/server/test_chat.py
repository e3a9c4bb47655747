"""/v1/chat/completions over HTTP with the official openai client."""

from __future__ import annotations

import httpx
import openai

from nibble.engine.tokenizer import Tokenizer
from nibble.server import reasoning

from .conftest import ServerHandle

MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}]
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}


def chat(client: openai.OpenAI, server: ServerHandle, messages=MESSAGES, extra_body=None, **kwargs):
    return client.chat.completions.create(model=server.model, messages=messages, temperature=0.0,
                                          extra_body={"ignore_eos": True, **(extra_body or {})}, **kwargs)


def collect_stream(chunks) -> dict:
    parts = {"role": [], "reasoning": "", "content": "", "finish": [], "usage": None, "ids": set()}
    for chunk in chunks:
        parts["ids"].add(chunk.id)
        if chunk.usage is not None:
            parts["usage"] = chunk.usage
        for choice in chunk.choices:
            delta = choice.delta
            if delta.role:
                parts["role"].append(delta.role)
            parts["content"] += delta.content or ""
            parts["reasoning"] += (delta.model_extra or {}).get("reasoning_content") or ""
            if choice.finish_reason:
                parts["finish"].append(choice.finish_reason)
    return parts


def prompt_len(tokenizer: Tokenizer, messages=MESSAGES, **kwargs) -> int:
    return len(tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True, **kwargs)))


def test_basic_response_and_usage(client: openai.OpenAI, server: ServerHandle, tokenizer: Tokenizer) -> None:
    out = chat(client, server, max_tokens=12)
    assert out.id.startswith("chatcmpl-") and out.object == "chat.completion" and out.model == server.model
    choice = out.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert out.usage.prompt_tokens == prompt_len(tokenizer)
    assert out.usage.completion_tokens == 12
    assert out.usage.total_tokens == out.usage.prompt_tokens + 12


def test_thinking_is_on_by_default_and_split(client: openai.OpenAI, server: ServerHandle) -> None:
    thinking = chat(client, server, max_tokens=16).choices[0].message
    plain = chat(client, server, max_tokens=16, extra_body=NO_THINK).choices[0].message
    assert plain.content and not (plain.model_extra or {}).get("reasoning_content")
    reasoning = (thinking.model_extra or {}).get("reasoning_content")
    # A random model rarely closes its think block: then everything is reasoning and nothing is content.
    assert reasoning or thinking.content
    top_level = chat(client, server, max_tokens=16, extra_body={"enable_thinking": False}).choices[0].message
    assert top_level.content == plain.content


def test_reasoning_effort_none_turns_thinking_off(client: openai.OpenAI, server: ServerHandle) -> None:
    plain = chat(client, server, max_tokens=16, extra_body=NO_THINK)
    no_effort = chat(client, server, max_tokens=16, reasoning_effort="none")
    assert no_effort.choices[0].message.content == plain.choices[0].message.content
    assert no_effort.usage.prompt_tokens == plain.usage.prompt_tokens
    thinking = chat(client, server, max_tokens=16)
    high = chat(client, server, max_tokens=16, reasoning_effort="high")
    assert high.usage.prompt_tokens == thinking.usage.prompt_tokens != plain.usage.prompt_tokens
    for extra, param in (({"enable_thinking": True}, "reasoning_effort"), ({"reasoning_effort": "extreme"}, None)):
        body = {"model": server.model, "messages": MESSAGES, "max_tokens": 4, "reasoning_effort": "none", **extra}
        r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 400, r.text
        assert param is None or r.json()["error"]["param"] == param


def test_rendered_prompt_matches_completions(client: openai.OpenAI, server: ServerHandle,
                                             tokenizer: Tokenizer) -> None:
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, enable_thinking=False)
    via_chat = chat(client, server, max_tokens=16, extra_body=NO_THINK).choices[0].message.content
    via_completion = client.completions.create(model=server.model, prompt=prompt, max_tokens=16, temperature=0.0,
                                               extra_body={"ignore_eos": True}).choices[0].text
    assert via_chat == via_completion


def test_reasoning_split_of_the_raw_output(client: openai.OpenAI, server: ServerHandle,
                                           tokenizer: Tokenizer) -> None:
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    raw = client.completions.create(model=server.model, prompt=prompt, max_tokens=24, temperature=0.0,
                                    extra_body={"ignore_eos": True, "skip_special_tokens": True}).choices[0].text
    message = chat(client, server, max_tokens=24).choices[0].message
    assert (message.model_extra.get("reasoning_content"), message.content) == reasoning.extract(raw, True)
    hidden = chat(client, server, max_tokens=24, extra_body={"include_reasoning": False}).choices[0].message
    assert not hidden.model_extra.get("reasoning_content") and hidden.content == message.content


def test_stream_matches_non_stream(client: openai.OpenAI, server: ServerHandle) -> None:
    for extra in ({}, NO_THINK):
        full = chat(client, server, max_tokens=20, extra_body=extra)
        parts = collect_stream(chat(client, server, max_tokens=20, extra_body=extra, stream=True,
                                    stream_options={"include_usage": True}))
        message = full.choices[0].message
        assert parts["role"] == ["assistant"]
        assert parts["content"] == (message.content or "")
        assert parts["reasoning"] == ((message.model_extra or {}).get("reasoning_content") or "")
        assert parts["finish"] == [full.choices[0].finish_reason]
        assert parts["usage"].completion_tokens == full.usage.completion_tokens
        assert parts["usage"].prompt_tokens == full.usage.prompt_tokens
        assert len(parts["ids"]) == 1 and next(iter(parts["ids"])).startswith("chatcmpl-")


def test_tools_are_rendered_into_the_prompt(client: openai.OpenAI, server: ServerHandle,
                                            tokenizer: Tokenizer) -> None:
    out = chat(client, server, max_tokens=4, tools=TOOLS, tool_choice="auto")
    with_tools = prompt_len(tokenizer, tools=TOOLS)
    assert out.usage.prompt_tokens == with_tools > prompt_len(tokenizer)
    assert out.choices[0].finish_reason in ("length", "tool_calls")
    none = chat(client, server, max_tokens=4, tools=TOOLS, tool_choice="none")
    assert none.usage.prompt_tokens == prompt_len(tokenizer)
    parts = collect_stream(chat(client, server, max_tokens=8, tools=TOOLS, stream=True))
    assert parts["finish"] and parts["finish"][0] in ("length", "tool_calls")


def test_logprobs_format(client: openai.OpenAI, server: ServerHandle) -> None:
    out = chat(client, server, max_tokens=8, logprobs=True, top_logprobs=2, extra_body=NO_THINK)
    content = out.choices[0].logprobs.content
    assert len(content) == 8
    for entry in content:
        assert entry.logprob <= 0 and isinstance(entry.bytes, list)
        assert bytes(entry.bytes).decode("utf-8", errors="replace") == entry.token
        assert len(entry.top_logprobs) == 2
        assert entry.logprob >= entry.top_logprobs[0].logprob - 1e-5
    chunks = list(chat(client, server, max_tokens=8, logprobs=True, top_logprobs=2, extra_body=NO_THINK,
                       stream=True))
    streamed = [e.token for c in chunks for ch in c.choices if ch.logprobs for e in ch.logprobs.content]
    assert streamed == [e.token for e in content]
    no_lp = chat(client, server, max_tokens=2)
    assert no_lp.choices[0].logprobs is None


def test_max_completion_tokens(client: openai.OpenAI, server: ServerHandle) -> None:
    out = chat(client, server, max_completion_tokens=5)
    assert out.usage.completion_tokens == 5 and out.choices[0].finish_reason == "length"


def test_default_max_tokens_fills_the_context(client: openai.OpenAI, server: ServerHandle,
                                              tokenizer: Tokenizer) -> None:
    limit = server.engine.engine.max_model_len
    base = prompt_len(tokenizer)
    word_len = len(tokenizer.encode(" hello"))
    filler = " hello" * ((limit - base - 6) // word_len)
    messages = [{"role": "user", "content": "What is the weather in Paris?" + filler}]
    n_prompt = prompt_len(tokenizer, messages)
    assert 0 < limit - n_prompt <= 12
    out = chat(client, server, messages=messages)
    assert out.usage.prompt_tokens == n_prompt
    assert out.usage.completion_tokens == limit - n_prompt
    assert out.choices[0].finish_reason == "length"


def test_multi_turn_with_tool_results(client: openai.OpenAI, server: ServerHandle, tokenizer: Tokenizer) -> None:
    messages = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    out = chat(client, server, messages=messages, tools=TOOLS, max_tokens=4)
    assert out.usage.prompt_tokens == prompt_len(tokenizer, messages, tools=TOOLS)


def test_n_choices(client: openai.OpenAI, server: ServerHandle, tokenizer: Tokenizer) -> None:
    """n > 1: one choice per index with its own message and finish reason, streamed per index (a role
    chunk each); the prompt counts once in the usage."""
    def sampled_chat(**kwargs):
        return client.chat.completions.create(model=server.model, messages=MESSAGES, temperature=1.0, seed=7,
                                              max_tokens=12, n=3, extra_body={"ignore_eos": True, **NO_THINK},
                                              **kwargs)

    out = sampled_chat()
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" and c.message.role == "assistant" for c in out.choices)
    assert len({c.message.content for c in out.choices}) > 1
    assert out.usage.prompt_tokens == prompt_len(tokenizer, enable_thinking=False)
    assert out.usage.completion_tokens == 36
    chunks = list(sampled_chat(stream=True, stream_options={"include_usage": True}))
    per_index: dict[int, list] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            per_index.setdefault(choice.index, []).append(choice)
    assert sorted(per_index) == [0, 1, 2]
    for j, parts in per_index.items():
        assert [p.delta.role for p in parts if p.delta.role] == ["assistant"]
        assert "".join(p.delta.content or "" for p in parts) == out.choices[j].message.content
        assert [p.finish_reason for p in parts if p.finish_reason] == ["length"]
    assert chunks[-1].usage.completion_tokens == 36


def test_continue_final_message(client: openai.OpenAI, server: ServerHandle, tokenizer: Tokenizer,
                                http: httpx.Client) -> None:
    """The answer the client prefilled is continued: the prompt is the conversation cut after the final message's
    content (as transformers cuts it), the output is all content (the think block is closed in the prompt), and
    the generation is the completions endpoint's for that prompt text."""
    messages = [*MESSAGES, {"role": "assistant", "content": "It is"}]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True)
    assert rendered.endswith("</think>\n\nIt is")
    out = chat(client, server, messages=messages, max_tokens=8,
               extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert out.usage.prompt_tokens == len(tokenizer.encode(rendered))
    message = out.choices[0].message
    assert (message.model_extra or {}).get("reasoning_content") is None
    raw = client.completions.create(model=server.model, prompt=rendered, max_tokens=8, temperature=0.0,
                                    extra_body={"ignore_eos": True})
    assert message.content == raw.choices[0].text
    body = {"messages": messages, "continue_final_message": True, "add_generation_prompt": False}
    assert http.post("/tokenize", json=body).json()["tokens"] == tokenizer.encode(rendered)
    # a <think> in the client's own prefill is text, not an open think block
    tagged = [*MESSAGES, {"role": "assistant", "content": "Use the <think> tag"}]
    out = chat(client, server, messages=tagged, max_tokens=4,
               extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert (out.choices[0].message.model_extra or {}).get("reasoning_content") is None
    assert out.choices[0].message.content
    r = http.post("/v1/chat/completions", json={"messages": messages, "continue_final_message": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message", r.text
