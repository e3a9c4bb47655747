"""nibble's chat-template rendering against transformers' `apply_chat_template(..., tokenize=False)`."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from nibble.engine.chat_template import ChatTemplate, ChatTemplateError, validate_messages
from nibble.engine.tokenizer import Tokenizer

ASSETS = Path(__file__).resolve().parent.parent / "nibble" / "assets"
DEMO_DIR = ASSETS / "demo_tokenizer"
QWEN_TEMPLATE = (ASSETS / "qwen3_5_chat_template.jinja").read_text(encoding="utf-8")

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city. Returns <json> & notes — ünïcode ok",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name"},
                "days": {"type": "integer"},
                "units": {"type": "string", "enum": ["metric", "imperial"]},
            },
            "required": ["city"],
        },
    },
}
SEARCH_TOOL = {
    "type": "function",
    "function": {"name": "search", "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}},
}


def _call(name: str, args: dict[str, Any], call_id: str = "call_1") -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


CONVERSATIONS: dict[str, list[dict[str, Any]]] = {
    "single_user": [{"role": "user", "content": "Hello!"}],
    "system_user": [
        {"role": "system", "content": "  You are terse.  "},
        {"role": "user", "content": "Explain RoPE in one line."},
    ],
    "multi_turn_reasoning": [
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "Simple addition.\n"},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "6", "reasoning_content": "Again addition."},
        {"role": "user", "content": "Thanks"},
    ],
    "inline_think_in_content": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<think>\nThe user greets me.\n</think>\n\nHello there."},
        {"role": "user", "content": "Bye"},
    ],
    "tools_and_responses": [
        {"role": "system", "content": "Use tools when needed."},
        {"role": "user", "content": "Weather in Paris and Tokyo for 3 days?"},
        {
            "role": "assistant",
            "content": "Let me look that up.",
            "reasoning_content": "Two cities, two calls.",
            "tool_calls": [
                _call("get_weather", {"city": "Paris", "days": 3}),
                _call("get_weather", {"city": "東京", "days": 3, "units": "metric"}, "call_2"),
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21, "sky": "clear"}'},
        {"role": "tool", "tool_call_id": "call_2", "content": '{"temp": 25, "sky": "rain"}'},
        {"role": "assistant", "content": "Paris 21°C clear, Tokyo 25°C rain."},
        {"role": "user", "content": "Now search for umbrellas."},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [_call("search", {"q": "umbrella", "filters": {"price": [10, 20]}, "flag": True})],
        },
        {"role": "tool", "content": "3 results"},
    ],
    "list_content_parts": [
        {"role": "system", "content": [{"type": "text", "text": "Be kind. "}, {"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "text", "text": "Part one, "}, {"type": "text", "text": "part two."}]},
    ],
    "unicode_and_markup": [
        {"role": "user", "content": "Ünïcödé 你好 👩‍💻 <b>bold</b> & {{ not jinja }}"},
    ],
}


@pytest.fixture(scope="module")
def hf_tokenizer():
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_file=str(DEMO_DIR / "tokenizer.json"),
        chat_template=QWEN_TEMPLATE,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_pretrained(DEMO_DIR)


def _hf(hf_tokenizer, messages, **kwargs) -> str:
    return hf_tokenizer.apply_chat_template(copy.deepcopy(messages), tokenize=False, **kwargs)


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("enable_thinking", [None, True, False])
def test_matches_transformers(hf_tokenizer, tok, name, add_generation_prompt, enable_thinking) -> None:
    messages = CONVERSATIONS[name]
    tools = [WEATHER_TOOL, SEARCH_TOOL] if name.startswith("tools") else None
    kwargs: dict[str, Any] = {"add_generation_prompt": add_generation_prompt}
    if enable_thinking is not None:
        kwargs["enable_thinking"] = enable_thinking
    want = _hf(hf_tokenizer, messages, tools=tools, **kwargs)
    got = tok.apply_chat_template(
        copy.deepcopy(messages),
        tools=tools,
        add_generation_prompt=add_generation_prompt,
        enable_thinking=enable_thinking,
    )
    assert got == want


@pytest.mark.parametrize("enable_thinking", [None, False])
@pytest.mark.parametrize("prefill", [
    {"role": "assistant", "content": "The answer is"},
    {"role": "assistant", "content": "```json\n{\"a\": 1,\n  "},  # trailing whitespace: the template trims it
    {"role": "assistant", "reasoning_content": "Think first.", "content": "So:"},
    {"role": "assistant", "content": [{"type": "text", "text": "Part one, "}, {"type": "text", "text": "two"}]},
])
def test_continue_final_message_matches_transformers(hf_tokenizer, tok, prefill, enable_thinking) -> None:
    messages = [*CONVERSATIONS["single_user"], prefill]
    kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    want = _hf(hf_tokenizer, messages, add_generation_prompt=False, continue_final_message=True, **kwargs)
    got = tok.apply_chat_template(copy.deepcopy(messages), add_generation_prompt=False, continue_final_message=True,
                                  enable_thinking=enable_thinking)
    assert got == want and not got.endswith("<|im_end|>\n")


def test_continue_final_message_cuts_in_the_final_message(tok) -> None:
    """The prefill's untrimmed text also occurs earlier (in the system prompt): the cut is still after the final
    message's content, where transformers' search of the whole prompt would cut inside the system prompt."""
    messages = [{"role": "system", "content": "Answer Yes or No."}, {"role": "user", "content": "Sure?"},
                {"role": "assistant", "content": "Yes "}]
    got = tok.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True)
    full = tok.apply_chat_template(messages, add_generation_prompt=False)
    assert got.endswith("</think>\n\nYes") and full.startswith(got) and full[len(got):] == "<|im_end|>\n"


@pytest.mark.parametrize(("messages", "kwargs", "match"), [
    ([{"role": "user", "content": "hi"}], {"add_generation_prompt": False}, "continues an assistant message"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a"}], {}, "cannot both be true"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}], {"add_generation_prompt": False},
     "nothing to continue"),
])
def test_continue_final_message_errors(tok, messages, kwargs, match) -> None:
    with pytest.raises(ChatTemplateError, match=match):
        tok.apply_chat_template(messages, continue_final_message=True, **kwargs)


def test_tools_without_system_message(hf_tokenizer, tok) -> None:
    messages = CONVERSATIONS["single_user"]
    want = _hf(hf_tokenizer, messages, tools=[WEATHER_TOOL], add_generation_prompt=True)
    assert tok.apply_chat_template(messages, tools=[WEATHER_TOOL]) == want
    assert json.dumps(WEATHER_TOOL, ensure_ascii=False) in want  # tojson keeps non-ASCII and markup as is


def test_openai_style_inputs_are_normalised(hf_tokenizer, tok) -> None:
    """JSON-string arguments, `developer` role, `reasoning` alias and null fields render like their HF forms."""
    hf_messages = CONVERSATIONS["tools_and_responses"]
    openai_messages = copy.deepcopy(hf_messages)
    for msg in openai_messages:
        for call in msg.get("tool_calls", []):
            call["function"]["arguments"] = json.dumps(call["function"]["arguments"])
        msg.setdefault("name", None)
    openai_messages[0]["role"] = "developer"
    openai_messages[2]["reasoning"] = openai_messages[2].pop("reasoning_content")
    tools = [WEATHER_TOOL, SEARCH_TOOL]
    want = _hf(hf_tokenizer, hf_messages, tools=tools, add_generation_prompt=True)
    assert tok.apply_chat_template(openai_messages, tools=tools) == want


def test_chat_template_kwargs_reach_the_template(hf_tokenizer, tok) -> None:
    messages = CONVERSATIONS["single_user"]
    chat_template_kwargs = {"enable_thinking": False, "eos_token": "<|endoftext|>", "custom": [1, 2]}
    source = "{{ eos_token }}|{{ custom | tojson }}|{{ enable_thinking }}|{{ messages | length }}"
    want = _hf(hf_tokenizer, messages, chat_template=source, add_generation_prompt=True, **chat_template_kwargs)
    assert ChatTemplate(source).render(validate_messages(messages), **chat_template_kwargs) == want
    want = _hf(hf_tokenizer, messages, add_generation_prompt=True, **chat_template_kwargs)
    assert tok.apply_chat_template(messages, **chat_template_kwargs) == want


CUSTOM_TEMPLATES = [
    "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.role }}:{{ m.content }}\n{% endfor %}",
    "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}",
    "{{ dict(a=1, b=[1, 2]) | tojson(indent=2, sort_keys=True) }}|{{ {'x': '<&>é'} | tojson }}",
    "{%- for m in messages %}\n  {{- m.content | trim }}\n{%- endfor %}\n{{ eos_token }}{{ pad_token }}",
    "{% if add_generation_prompt %}GEN{% endif %}{{ custom_var | default('none') }}",
    "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}",
    "{{ strftime_now('%Y') }}",
]


@pytest.mark.parametrize("source", CUSTOM_TEMPLATES)
def test_environment_matches_transformers(hf_tokenizer, source: str) -> None:
    messages = [{"role": "user", "content": "  one  "}, {"role": "assistant", "content": "two"}]
    want = _hf(hf_tokenizer, messages, chat_template=source, add_generation_prompt=True, custom_var="set")
    special = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    got = ChatTemplate(source).render(validate_messages(messages), custom_var="set", **special)
    assert got == want


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([{"role": "system", "content": "only a system prompt"}], "No user query found"),
        ([{"role": "user", "content": "a"}, {"role": "system", "content": "late"}], "System message must be at"),
        ([{"role": "user", "content": "a"}, {"role": "narrator", "content": "x"}],
         r"Unexpected message role.*messages\[1\]: 'narrator'"),
    ],
)
def test_template_exceptions_become_chat_template_errors(tok, messages, match) -> None:
    with pytest.raises(ChatTemplateError, match=match):
        tok.apply_chat_template(messages)


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([], "at least one message"),
        ("hello", "must be a list"),
        (["hello"], r"messages\[0\]: must be an object"),
        ([{"content": "x"}], r"messages\[0\]\.role"),
        ([{"role": "user"}], r"messages\[0\]\.content: required"),
        ([{"role": "user", "content": 5}], "must be a string or a list of text parts"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "text only"),
        ([{"role": "user", "content": [{"type": "text"}]}], r"content\[0\]\.text"),
        ([{"role": "user", "content": "x", "tool_calls": []}], "only assistant messages"),
        (
            [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{bad"}}]}],
            r"arguments: not valid JSON",
        ),
        ([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}], "JSON object"),
        ([{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}], r"function\.name"),
    ],
)
def test_invalid_messages(tok, messages, match) -> None:
    with pytest.raises(ChatTemplateError, match=match):
        tok.apply_chat_template(messages)


@pytest.mark.parametrize(
    ("tools", "match"),
    [
        ({"type": "function"}, "must be a list"),
        ([{"type": "retrieval"}], "only 'function'"),
        ([{"type": "function", "function": {}}], r"function\.name"),
        ([{"type": "function", "function": {"name": "f", "parameters": []}}], "JSON schema object"),
    ],
)
def test_invalid_tools(tok, tools, match) -> None:
    with pytest.raises(ChatTemplateError, match=match):
        tok.apply_chat_template(CONVERSATIONS["single_user"], tools=tools)


def test_bad_templates_and_sandbox() -> None:
    with pytest.raises(ChatTemplateError, match="syntax error at line 1"):
        ChatTemplate("{% if %}")
    with pytest.raises(ChatTemplateError, match="empty"):
        ChatTemplate("  ")
    messages = validate_messages(CONVERSATIONS["single_user"])
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{{ messages.append(1) }}").render(messages)
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{% set ns = namespace(_x=1) %}").render(messages)
    with pytest.raises(ChatTemplateError, match="boom"):
        ChatTemplate("{{ raise_exception('boom') }}").render(messages)


def test_model_without_template(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_bytes((DEMO_DIR / "tokenizer.json").read_bytes())
    tok = Tokenizer.from_pretrained(tmp_path)
    assert not tok.has_chat_template
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tok.apply_chat_template(CONVERSATIONS["single_user"])


def test_named_templates_from_config(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_bytes((DEMO_DIR / "tokenizer.json").read_bytes())
    templates = [{"name": "default", "template": "plain"}, {"name": "tool_use", "template": "tools"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": templates}))
    tok = Tokenizer.from_pretrained(tmp_path)
    assert tok.apply_chat_template(CONVERSATIONS["single_user"]) == "plain"
    assert tok.apply_chat_template(CONVERSATIONS["single_user"], tools=[SEARCH_TOOL]) == "tools"
