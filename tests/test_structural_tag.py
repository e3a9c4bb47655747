"""Structural tags (vLLM's `response_format: {"type": "structural_tag", ...}`, engine/structural_tag.py): free
text whose tagged segments must be a structure's begin, a JSON value of its schema and its end. Checked on the
grammar against the demo tokenizer, on generations of the demo model pushed to write the trigger, and through
the HTTP server's fields and errors."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from nibble.engine.async_engine import AsyncEngine
from nibble.engine.config import EngineConfig
from nibble.engine.llm import LLM
from nibble.engine.sampling_params import SamplingParams
from nibble.engine.structural_tag import StructuralTagError, parse_structural_tag
from nibble.engine.structured_output import StructuredOutputError, StructuredOutputsParams
from tests.helpers.server import start_server, wait_idle

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
          "additionalProperties": False}
SPEC = {"type": "structural_tag", "triggers": ["<function="],
        "structures": [{"begin": "<function=count>", "schema": SCHEMA, "end": "</function>"},
                       {"begin": "<function=flag>", "schema": {"type": "boolean"}, "end": "</function>"},
                       {"begin": "<function=any>", "schema": True, "end": "</function>"}]}


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(device="cpu", max_model_len=256)


def _accepts(llm: LLM, text: str, spec: object = SPEC) -> bool:
    """Whether the constraint lets the tokens of `text` through, one by one."""
    state = llm.engine.structured_output_backend().compile(StructuredOutputsParams(structural_tag=spec))
    return all(state.accept(t) in (None, "stopped") for t in llm.get_tokenizer().encode(text))


@pytest.mark.parametrize(("text", "ok"), [
    ("any prose at all, with < and = and function", True),
    ('call <function=count>{"n":12}</function> and go on', True),
    ('two <function=flag>true</function> then <function=count>{"n":0}</function>', True),
    ('<function=count>{"m":1}</function>', False),  # a key the schema does not have
    ('<function=count>{"n":"x"}</function>', False),  # a string where the schema wants an integer
    ('<function=count>{"n":1}</end>', False),  # not the structure's end
    ("<function=other>{}", False),  # no structure begins so after the trigger
    ('<function=flag>yes</function>', False),
    ('<function=any>[1,{"a":null}]</function>', True),  # schema true: any JSON value
])
def test_the_grammar_allows_exactly_the_tagged_structures(llm: LLM, text: str, ok: bool) -> None:
    assert _accepts(llm, text) is ok
    assert _accepts(llm, text, json.dumps(SPEC)) is ok  # vLLM's structured_outputs.structural_tag is JSON text


def test_generations_keep_every_tag_well_formed(llm: LLM) -> None:
    """The demo model, pushed towards the trigger's first token by a logit bias, writes tags; every complete
    one holds a value of its structure's schema, and a cut-off last one is a prefix of such."""
    trigger_token = llm.get_tokenizer().encode("<function")[0]
    # the demo tokenizer's one-token trigger: once the model writes it, the grammar takes over
    # (count and flag only: a string value of the any-structure may itself hold the trigger's text)
    spec = {**SPEC, "triggers": ["<function"], "structures": SPEC["structures"][:2]}
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=60, ignore_eos=True, logit_bias={trigger_token: 6.0},
                             structured_outputs=StructuredOutputsParams(structural_tag=spec)) for s in range(6)]
    texts = [o.outputs[0].text for o in llm.generate([[5, 6, 7]] * len(params), params)]
    tags = [m for t in texts for m in re.finditer(r"<function=(count|flag)>(.*?)</function>", t, re.S)]
    assert tags, texts
    for m in tags:
        value = json.loads(m.group(2))
        if m.group(1) == "count":
            assert set(value) == {"n"} and isinstance(value["n"], int)
        else:
            assert isinstance(value, bool)
    for t in texts:  # every trigger goes on as one of the begins, a cut-off one as a prefix of one
        for start in (i for i in range(len(t)) if t.startswith("<function", i)):
            rest = t[start + len("<function"):]
            assert any(b.startswith(rest[: len(b)]) or rest.startswith(b) for b in ("=count>", "=flag>")), t


@pytest.mark.parametrize(("spec", "message"), [
    ("{", "not valid JSON"),
    ({"structures": [], "triggers": ["<f"]}, "structures must be a non-empty list"),
    ({"structures": SPEC["structures"]}, "triggers must be a non-empty list"),
    ({**SPEC, "triggers": ["<tool>"]}, "structures[0].begin '<function=count>' does not start with any of the "
                                       "triggers"),
    ({**SPEC, "structures": [{"begin": "<function=x>", "schema": "int", "end": ""}]}, "structures[0].schema"),
    ({**SPEC, "structures": [{"begin": "<function=x>", "schema": False, "end": ""}]}, "structures[0].schema"),
    ({**SPEC, "structures": [{"begin": "<function=x>", "schema": {}}]}, "structures[0].end must be a string"),
    ({"type": "structural_tag", "format": {"type": "triggered_tags"}}, "the 'format' form"),
    ({**SPEC, "extra": 1}, "unknown field(s) extra"),
    ({**SPEC, "type": "json_schema"}, "type must be 'structural_tag'"),
])
def test_bad_specs_name_their_fault(spec: object, message: str) -> None:
    with pytest.raises(StructuralTagError) as info:
        parse_structural_tag(spec)  # type: ignore[arg-type]
    assert message in str(info.value)
    with pytest.raises(StructuredOutputError, match=re.escape(f"structural_tag: {message}")):
        from nibble.engine.structured_output import grammar_source

        grammar_source(StructuredOutputsParams(structural_tag=spec))  # type: ignore[arg-type]


def test_over_http() -> None:
    engine = AsyncEngine.from_config(EngineConfig(model="demo", device="cpu", max_model_len=256))
    handle = start_server(engine)
    try:
        with httpx.Client(base_url=handle.url + "/v1", timeout=60) as http:
            chat = {"messages": [{"role": "user", "content": "count"}], "max_tokens": 16,
                    "chat_template_kwargs": {"enable_thinking": False}}
            ok = http.post("/chat/completions", json={**chat, "response_format": SPEC})
            assert ok.status_code == 200, ok.text
            ok = http.post("/completions", json={"prompt": "x", "max_tokens": 8,
                                                 "structured_outputs": {"structural_tag": json.dumps(SPEC)}})
            assert ok.status_code == 200, ok.text
            bad = http.post("/chat/completions",
                            json={**chat, "response_format": {**SPEC, "triggers": ["<tool>"]}})
            assert bad.status_code == 400
            error = bad.json()["error"]
            assert error["param"] == "response_format"
            assert "structures[0].begin '<function=count>' does not start with any of the triggers" in error["message"]
            both = http.post("/chat/completions", json={**chat, "response_format": SPEC,
                                                         "structured_outputs": {"regex": "a"}})
            assert both.status_code == 400
        assert wait_idle(engine)
    finally:
        handle.stop()
        engine.shutdown()
