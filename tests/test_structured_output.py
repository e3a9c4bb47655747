"""Structured outputs on the demo model (CPU): every generated output follows its constraint (JSON schema,
JSON object, regex, choice, Lark and GBNF grammars), greedy and sampled, in batches with unconstrained
requests, through chunked prefill and preemption, with and without overlapped scheduling; the device bitmask
op against its reference; the tokens a mask allows against the text they would produce; bad constraints
refused with the field named."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import torch

from nibble.engine.llm import LLM
from nibble.engine.llm_engine import RequestError
from nibble.engine.sampling_params import SamplingParams, SamplingParamsError
from nibble.engine.structured_output import (
    StructuredOutputError,
    StructuredOutputsParams,
    apply_token_bitmask,
    apply_token_bitmask_reference,
    choice_regex,
)

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "mood": {"enum": ["happy", "sad", "calm"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    },
    "required": ["name", "age", "mood", "tags"],
    "additionalProperties": False,
}
PROMPTS = ["Tell me about", "The answer is", "Once upon a time there was a"]


def _check_schema(value: Any) -> None:
    """The checks SCHEMA asks for (no JSON-schema validator among the test dependencies)."""
    assert isinstance(value, dict) and set(value) == {"name", "age", "mood", "tags"}
    assert isinstance(value["name"], str) and len(value["name"]) <= 10
    assert isinstance(value["age"], int) and not isinstance(value["age"], bool) and 0 <= value["age"] <= 120
    assert value["mood"] in ("happy", "sad", "calm")
    assert isinstance(value["tags"], list) and len(value["tags"]) <= 3
    assert all(isinstance(t, bool) for t in value["tags"])


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(device="cpu", max_model_len=512)


def _generate(llm: LLM, so: StructuredOutputsParams, temperature: float, max_tokens: int = 120, **kw: Any):
    params = SamplingParams(temperature=temperature, seed=7 if temperature else None, max_tokens=max_tokens,
                            structured_outputs=so, **kw)
    return [o.outputs[0] for o in llm.generate(PROMPTS, params)]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_outputs_validate(llm: LLM, temperature: float) -> None:
    for out in _generate(llm, StructuredOutputsParams(json=SCHEMA), temperature):
        assert out.finish_reason == "stop", out.text
        _check_schema(json.loads(out.text))
        # the grammar ended the request itself: no end-of-sequence token was sampled
        assert not set(out.token_ids) & set(llm.engine.eos_token_ids)


def test_json_schema_given_as_text(llm: LLM) -> None:
    for out in _generate(llm, StructuredOutputsParams(json=json.dumps(SCHEMA)), 0.0):
        _check_schema(json.loads(out.text))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_object_is_an_object_prefix(llm: LLM, temperature: float) -> None:
    for out in _generate(llm, StructuredOutputsParams(json_object=True), temperature, max_tokens=40):
        if out.finish_reason == "stop":
            assert isinstance(json.loads(out.text), dict)
        else:  # a random model may not close the object in 40 tokens; what it wrote still starts one
            assert out.finish_reason == "length" and out.text.startswith("{")


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_regex_and_choice(llm: LLM, temperature: float) -> None:
    pattern = r"[a-z]{2,5}-[0-9]{3}(\.[A-Z])?"
    for out in _generate(llm, StructuredOutputsParams(regex=pattern), temperature):
        assert re.fullmatch(pattern, out.text), out.text
    choices = ("yes", "no", "a.b*c", "(maybe) [so]|x")
    for out in _generate(llm, StructuredOutputsParams(choice=choices), temperature):
        assert out.text in choices and out.finish_reason == "stop"


def test_lark_and_gbnf_grammars(llm: LLM) -> None:
    lark = 'start: "(" num ("+" num)* ")"\nnum: /[0-9]{1,3}/'
    for out in _generate(llm, StructuredOutputsParams(grammar=lark), 1.0, max_tokens=60):
        if out.finish_reason == "stop":
            assert re.fullmatch(r"\([0-9]{1,3}(\+[0-9]{1,3})*\)", out.text), out.text
    gbnf = 'root ::= "color: " ("red" | "green" | "blue")'
    for out in _generate(llm, StructuredOutputsParams(grammar=gbnf), 1.0):
        assert out.text in ("color: red", "color: green", "color: blue")


def test_constraint_starts_after_its_start_token(llm: LLM) -> None:
    """With start_token_id (the server's `</think>`), the tokens before it are free and the text after it
    follows the constraint; logit_bias forces the start token first."""
    think_end = llm.get_tokenizer().token_to_id("</think>")
    assert think_end is not None
    so = StructuredOutputsParams(regex="[0-9]{4}", start_token_id=think_end)
    outs = _generate(llm, so, 0.0, logit_bias={think_end: 100.0})
    for out in outs:
        assert out.token_ids[0] == think_end
        assert re.fullmatch("[0-9]{4}", llm.get_tokenizer().decode(out.token_ids[1:])), out.text
    free = _generate(llm, so, 0.0, max_tokens=6)  # without the start token nothing is constrained
    assert all(think_end not in o.token_ids for o in free)
    assert [o.token_ids for o in free] == [o.outputs[0].token_ids for o in llm.generate(
        PROMPTS, SamplingParams(temperature=0.0, max_tokens=6))]


def test_mixed_batch_with_chunked_prefill_preemption_and_overlap() -> None:
    """Constrained and free requests side by side, small token budget and KV cache (chunked prefill,
    preemption): the free requests get exactly what they get alone, the constrained ones stay valid, with
    and without overlapped scheduling (which pauses while a constraint is running)."""
    prompts = ["x " * n for n in (5, 60, 17, 33)]
    free = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    constrained = SamplingParams(temperature=0.8, seed=3, max_tokens=120,
                                 structured_outputs=StructuredOutputsParams(json=SCHEMA))
    params = [free, constrained, free, constrained]
    results = []
    for overlap in (False, True):
        llm = LLM(device="cpu", max_model_len=256, async_scheduling=overlap, max_num_batched_tokens=24,
                  extra={"num_kv_blocks": 16})
        outs = llm.generate(prompts, params)
        assert llm.engine.blocks.all_free()
        results.append([o.outputs[0].token_ids for o in outs])
        for i in (1, 3):
            _check_schema(json.loads(outs[i].outputs[0].text))
        alone = LLM(device="cpu", max_model_len=256).generate([prompts[0], prompts[2]], free)
        assert [outs[0].outputs[0].token_ids, outs[2].outputs[0].token_ids] == [a.outputs[0].token_ids
                                                                                 for a in alone]
    assert results[0] == results[1]


def test_n_choices_each_follow_the_constraint(llm: LLM) -> None:
    so = StructuredOutputsParams(json=SCHEMA)
    outs = llm.generate([PROMPTS[0]] * 4, [SamplingParams(temperature=1.0, seed=s, max_tokens=120,
                                                           structured_outputs=so) for s in range(4)])
    for o in outs:
        _check_schema(json.loads(o.outputs[0].text))


def test_allowed_tokens_extend_the_text_validly(llm: LLM) -> None:
    """Every token the mask allows after a partial answer keeps the text a prefix of some choice; every
    token it forbids does not (ids the tokenizer cannot decode to text excepted)."""
    tok = llm.get_tokenizer()
    choices = ("alpha", "alps", "beta gamma")
    backend = llm.engine.structured_output_backend()
    state = backend.compile(StructuredOutputsParams(choice=choices))
    prefix = tok.encode("al")
    for t in prefix:
        assert state.accept(t) is None
    mask = backend.fill_bitmask([state])[0]
    allowed = {t for t in range(tok.vocab_size) if (int(mask[t // 32]) >> (t % 32)) & 1}
    assert allowed
    for t in range(tok.vocab_size):
        text = tok.decode([*prefix, t], skip_special_tokens=False)
        if "\ufffd" in text:
            continue
        valid = any(c.startswith(text) and len(text) > 2 for c in choices)
        assert (t in allowed) == valid, (t, text)


def test_compiled_grammars_are_reused_as_independent_copies(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """A grammar compiled once (the server's validating compile) is not compiled again for the engine's own
    compile or later requests with the same constraint: each gets a fresh copy of the untouched matcher,
    which advances on its own."""
    import llguidance

    tok = llm.get_tokenizer()
    backend = llm.engine.structured_output_backend()
    params = StructuredOutputsParams(choice=("north", "south", "east by west"), start_token_id=None)
    first = backend.compile(params)
    built: list[object] = []
    real = llguidance.LLMatcher

    class Counting:
        """Stands in for the LLMatcher class: counts constructions, passes everything else through."""

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            built.append(args)
            return real(*args, **kwargs)

        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

    monkeypatch.setattr(llguidance, "LLMatcher", Counting())
    second = backend.compile(params)
    third = backend.compile(StructuredOutputsParams(choice=("north", "south", "east by west"),
                                                    start_token_id=tok.token_to_id("</think>")))
    assert built == [] and not third.started and second.started
    for t in tok.encode("south"):
        assert first.accept(t) in (None, "stopped")
    # the copies did not move with the first matcher: each still allows the start of every choice
    for state in (second, third):
        state.started = True
        mask = backend.fill_bitmask([state])[0]
        for word in ("north", "south", "east"):
            t = tok.encode(word)[0]
            assert (int(mask[t // 32]) >> (t % 32)) & 1, word
    other = backend.compile(StructuredOutputsParams(choice=("up", "down")))
    assert len(built) == 1 and other.matcher is not None


def test_bitmask_op_matches_reference() -> None:
    gen = torch.Generator().manual_seed(0)
    for vocab, num_rows in ((1000, 5), (97, 3), (64, 2)):
        logits = torch.randn(num_rows, vocab, generator=gen)
        rows = [0, num_rows - 1]
        sets = [set(torch.randint(0, vocab, (13,), generator=gen).tolist()) for _ in rows]
        words = (vocab + 31) // 32
        mask = torch.zeros(len(rows), words * 32, dtype=torch.int64)
        for i, s in enumerate(sets):
            mask[i, sorted(s)] = 1
        packed = (mask.view(len(rows), words, 32) << torch.arange(32)).sum(-1)
        packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
        expected = apply_token_bitmask_reference(logits, rows, sets)
        got = logits.clone()
        apply_token_bitmask(got, torch.tensor(rows), packed)
        assert torch.equal(got, expected)
    with pytest.raises(ValueError, match="bitmask must be"):
        apply_token_bitmask(torch.zeros(2, 64), torch.tensor([0]), torch.zeros(1, 3, dtype=torch.int32))


def test_choice_regex_escapes_metacharacters() -> None:
    choices = ("a.b", "(x)|[y]", "c*+?{2}", "q\\r", "-/#&~\"")
    pattern = choice_regex(choices)
    for c in choices:
        assert re.fullmatch(pattern, c)
    assert not re.fullmatch(pattern, "axb")


@pytest.mark.parametrize(("kwargs", "fragment"), [
    ({}, "exactly one"),
    ({"regex": "a", "choice": ["a"]}, "exactly one"),
    ({"choice": []}, "non-empty list"),
    ({"choice": "yes"}, "list of strings"),
    ({"regex": " "}, "non-empty string"),
    ({"json_object": "yes"}, "true or false"),
    ({"regex": "a", "start_token_id": -1}, "start_token_id"),
])
def test_bad_params(kwargs: dict[str, Any], fragment: str) -> None:
    with pytest.raises(StructuredOutputError, match=fragment):
        StructuredOutputsParams(**kwargs)


@pytest.mark.parametrize(("so", "fragment"), [
    (StructuredOutputsParams(regex="a(b"), "(?s)regex: .*unclosed group"),
    (StructuredOutputsParams(json={"type": "nope"}), "(?s)json: .*nope"),
    (StructuredOutputsParams(json="{oops"), "not valid JSON"),
    (StructuredOutputsParams(json="[1, 2]"), "must be a JSON object"),
    (StructuredOutputsParams(grammar="start: ("), "grammar: "),
    (StructuredOutputsParams(regex="a", start_token_id=10**7), "start_token_id must be in"),
])
def test_engine_refuses_bad_constraints(llm: LLM, so: StructuredOutputsParams, fragment: str) -> None:
    with pytest.raises(RequestError, match=fragment):
        llm.engine.add_request("bad", "hi", SamplingParams(structured_outputs=so))
    assert "bad" not in llm.engine.requests


def test_min_tokens_with_a_constraint_is_refused() -> None:
    with pytest.raises(SamplingParamsError, match="min_tokens"):
        SamplingParams(min_tokens=3, structured_outputs=StructuredOutputsParams(regex="a+"))


def test_tool_call_grammar_accepts_what_the_template_renders(llm: LLM) -> None:
    """The forced-tool-call grammar (server/tool_grammar.py) against the chat template's own rendering of
    past calls: a rendered call is accepted token by token; a call missing a required parameter, a call of
    another function, and a value holding a closing tag are not."""
    from nibble.server.tool_grammar import tool_call_grammar

    tok = llm.get_tokenizer()
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                         "opts": {"type": "object"}}, "required": ["city", "days"]}}},
             {"type": "function", "function": {"name": "ping"}}]
    tags = {t: tok.token_to_id(t) for t in ("<tool_call>", "</tool_call>")}
    backend = llm.engine.structured_output_backend()

    def accepted(text: str, name: str | None = None, parallel: bool = True) -> bool:
        state = backend.compile(StructuredOutputsParams(grammar=tool_call_grammar(tools, name, parallel, tags)))
        return all(state.accept(t) in (None, "stopped") for t in tok.encode(text)) and \
            state.matcher.is_accepting()

    calls = [{"type": "function", "function": {"name": "get_weather",
                                               "arguments": {"city": "New\nYork", "days": 3, "opts": {"a": [1]}}}},
             {"type": "function", "function": {"name": "ping", "arguments": {}}}]
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"},
                                        {"role": "assistant", "content": "", "tool_calls": calls}],
                                       tools=tools, enable_thinking=False, add_generation_prompt=False)
    turn = rendered[rendered.rindex("<|im_start|>assistant"):]  # the system prompt shows an example call too
    text = turn[turn.index("<tool_call>"):turn.rindex("</tool_call>") + len("</tool_call>")]
    assert accepted(text)
    first = text[:text.index("</tool_call>") + len("</tool_call>")]
    assert accepted(first, parallel=False) and accepted(first, name="get_weather")
    assert not accepted(text, parallel=False)
    assert not accepted(first, name="ping")
    assert not accepted(first.replace("<parameter=days>\n3\n</parameter>\n", ""))
    assert not accepted(first.replace("New\nYork", "New </parameter> York"))
    with pytest.raises(ValueError, match="no function named"):
        tool_call_grammar(tools, "nope")
