"""/v1/completions over HTTP with the official openai client."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from nibble.engine.llm import LLM
from nibble.engine.sampling_params import SamplingParams
from nibble.engine.tokenizer import Tokenizer
from nibble.server.metrics import ServerMetrics
from nibble.server.protocol import CompletionRequest
from nibble.server.serving_completions import CompletionServing

from .conftest import ServerHandle

GREEDY = {"temperature": 0.0}
NO_EOS = {"ignore_eos": True}


def complete(client: openai.OpenAI, server: ServerHandle, prompt, **kwargs):
    extra = kwargs.pop("extra_body", {})
    return client.completions.create(model=server.model, prompt=prompt, extra_body={**NO_EOS, **extra}, **kwargs)


def stream_text(client: openai.OpenAI, server: ServerHandle, prompt, **kwargs) -> tuple[dict[int, str], list]:
    chunks = list(complete(client, server, prompt, stream=True, **kwargs))
    texts: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    return texts, chunks


def test_basic_response(client: openai.OpenAI, server: ServerHandle, tokenizer: Tokenizer) -> None:
    out = complete(client, server, "The capital of France is", max_tokens=8, **GREEDY)
    assert out.id.startswith("cmpl-")
    assert out.object == "text_completion"
    assert out.model == server.model
    assert out.created > 0
    assert len(out.choices) == 1
    choice = out.choices[0]
    assert choice.index == 0 and choice.finish_reason == "length"
    assert out.usage.prompt_tokens == len(tokenizer.encode("The capital of France is"))
    assert out.usage.completion_tokens == 8
    assert out.usage.total_tokens == out.usage.prompt_tokens + 8


def test_default_max_tokens_is_16(client: openai.OpenAI, server: ServerHandle) -> None:
    out = complete(client, server, "Hello", **GREEDY)
    assert out.usage.completion_tokens == 16
    assert out.choices[0].finish_reason == "length"


def test_stream_matches_non_stream(client: openai.OpenAI, server: ServerHandle) -> None:
    full = complete(client, server, "Once upon a time", max_tokens=24, **GREEDY)
    texts, chunks = stream_text(client, server, "Once upon a time", max_tokens=24,
                                stream_options={"include_usage": True}, **GREEDY)
    assert texts[0] == full.choices[0].text
    ids = {c.id for c in chunks}
    assert len(ids) == 1 and next(iter(ids)).startswith("cmpl-")
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_batch_prompts_run_concurrently_and_match(client: openai.OpenAI, server: ServerHandle) -> None:
    prompts = ["Alpha", "Beta gamma", "Delta"]
    singles = [complete(client, server, p, max_tokens=12, **GREEDY).choices[0].text for p in prompts]
    batch = complete(client, server, prompts, max_tokens=12, **GREEDY)
    assert [c.index for c in batch.choices] == [0, 1, 2]
    assert [c.text for c in batch.choices] == singles
    assert batch.usage.completion_tokens == 36
    texts, _ = stream_text(client, server, prompts, max_tokens=12, **GREEDY)
    assert [texts[i] for i in range(3)] == singles


def test_token_id_prompts(client: openai.OpenAI, server: ServerHandle, tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("Token ids work too")
    by_text = complete(client, server, "Token ids work too", max_tokens=10, **GREEDY).choices[0].text
    assert complete(client, server, ids, max_tokens=10, **GREEDY).choices[0].text == by_text
    batch = complete(client, server, [ids, ids], max_tokens=10, **GREEDY)
    assert [c.text for c in batch.choices] == [by_text, by_text]


def test_concurrent_requests_match_sequential(client: openai.OpenAI, server: ServerHandle) -> None:
    prompts = [f"Request number {i} says" for i in range(8)]
    sequential = [complete(client, server, p, max_tokens=20, **GREEDY).choices[0].text for p in prompts]
    with ThreadPoolExecutor(8) as pool:
        concurrent = list(pool.map(lambda p: complete(client, server, p, max_tokens=20, **GREEDY).choices[0].text,
                                   prompts))
    assert concurrent == sequential


def test_seeded_sampling_is_reproducible(client: openai.OpenAI, server: ServerHandle) -> None:
    def sample(seed: int) -> str:
        return complete(client, server, "Random words:", max_tokens=16, temperature=1.0, seed=seed).choices[0].text

    assert sample(1234) == sample(1234)
    assert len({sample(s) for s in (1, 2, 3, 4)}) > 1


def test_logprobs_format(client: openai.OpenAI, server: ServerHandle) -> None:
    out = complete(client, server, "Logprobs", max_tokens=10, logprobs=3, **GREEDY)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 10
    assert all(v <= 0 for v in lp.token_logprobs)
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 4
        assert top[token] == logprob
        # Greedy: the sampled token is the most likely one.
        assert logprob >= max(top.values()) - 1e-5
    assert lp.text_offset[0] == 0
    assert all(b - a == len(t) for a, b, t in zip(lp.text_offset, lp.text_offset[1:], lp.tokens))
    if "\ufffd" not in "".join(lp.tokens):
        assert "".join(lp.tokens) == out.choices[0].text
    chunks = list(complete(client, server, "Logprobs", max_tokens=10, logprobs=3, stream=True, **GREEDY))
    streamed = [t for c in chunks for ch in c.choices if ch.logprobs for t in ch.logprobs.tokens]
    offsets = [o for c in chunks for ch in c.choices if ch.logprobs for o in ch.logprobs.text_offset]
    assert streamed == lp.tokens and offsets == lp.text_offset


def test_echo_with_logprobs_as_lm_eval_asks(client: openai.OpenAI, server: ServerHandle, tokenizer: Tokenizer) -> None:
    """lm-eval's loglikelihood request (echo, logprobs=1, max_tokens=1, greedy): the prompt's text comes back
    before the generated one, and the logprobs cover every prompt token (null for the first) and then the
    generated one, with the prompt tokens' values the engine computes for them; streamed the same."""
    prompt = "The quick brown fox jumps over the lazy dog"
    ids = tokenizer.encode(prompt)
    out = complete(client, server, prompt, max_tokens=1, logprobs=1, echo=True, **GREEDY)
    choice = out.choices[0]
    assert choice.text.startswith(prompt) and len(choice.text) > len(prompt)
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == len(ids) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    assert all(top[token] == value for token, value, top in zip(lp.tokens[1:], lp.token_logprobs[1:],
                                                                lp.top_logprobs[1:]))
    assert lp.text_offset[len(ids)] == len(prompt)
    want = LLM(device="cpu", max_model_len=256).generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=1))
    entries = want[0].prompt_logprobs
    assert entries is not None
    assert lp.token_logprobs[1:len(ids)] == pytest.approx([e.logprob for e in entries[1:]], abs=1e-5)
    chunks = list(complete(client, server, prompt, max_tokens=1, logprobs=1, echo=True, stream=True, **GREEDY))
    assert "".join(ch.text for c in chunks for ch in c.choices) == choice.text
    assert [t for c in chunks for ch in c.choices if ch.logprobs for t in ch.logprobs.token_logprobs] == \
        lp.token_logprobs
    plain = complete(client, server, [ids], max_tokens=2, echo=True, **GREEDY)
    assert plain.choices[0].text.startswith(tokenizer.decode(ids)) and plain.choices[0].logprobs is None


def test_vllm_prompt_logprobs(server: ServerHandle, tokenizer: Tokenizer) -> None:
    """vLLM's `prompt_logprobs` request field: per prompt token {token id: logprob, rank, decoded_token} for the
    token itself and the top alternatives (ranked 1, 2, ...), null for the first token; streamed in the first
    chunk; the same values as echo's."""
    import json

    import httpx

    prompt = "The quick brown fox jumps over the lazy dog"
    ids = tokenizer.encode(prompt)
    body = {"model": server.model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 2}
    r = httpx.post(server.api + "/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    rows = r.json()["choices"][0]["prompt_logprobs"]
    assert len(rows) == len(ids) and rows[0] is None
    for token, row in zip(ids[1:], rows[1:]):
        mine = row[str(token)]
        assert mine["logprob"] <= 0 and mine["rank"] >= 1 and mine["decoded_token"] == tokenizer.decode([token])
        others = sorted((v for k, v in row.items() if k != str(token)), key=lambda v: v["rank"])
        assert 2 <= len(row) <= 3 and all(v["rank"] in (1, 2) for v in others)
        assert all(mine["logprob"] <= v["logprob"] + 1e-6 or mine["rank"] < v["rank"] for v in others)
    echo = httpx.post(server.api + "/completions", json={**body, "prompt_logprobs": None, "echo": True,
                                                         "logprobs": 0}, timeout=60).json()
    token_logprobs = echo["choices"][0]["logprobs"]["token_logprobs"]
    assert [row[str(t)]["logprob"] for t, row in zip(ids[1:], rows[1:])] == token_logprobs[1:len(ids)]
    with httpx.stream("POST", server.api + "/completions", json={**body, "stream": True}, timeout=60) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    firsts = [ch["prompt_logprobs"] for c in chunks for ch in c["choices"] if ch.get("prompt_logprobs")]
    assert firsts == [rows]
    bad = httpx.post(server.api + "/completions", json={**body, "prompt_logprobs": 21}, timeout=60)
    assert bad.status_code == 400 and "prompt_logprobs" in bad.text


def test_stop_string_and_stop_token(client: openai.OpenAI, server: ServerHandle) -> None:
    full = complete(client, server, "Stop test", max_tokens=20, logprobs=0, **GREEDY).choices[0]
    text = full.text
    stop = next(text[i:i + 2] for i in range(4, len(text) - 2) if text[i:i + 2].strip() and "\ufffd" not in
                text[i:i + 2])
    out = complete(client, server, "Stop test", max_tokens=20, stop=[stop], **GREEDY).choices[0]
    assert out.finish_reason == "stop"
    assert out.text == text[: text.index(stop)]
    assert out.model_extra["stop_reason"] == stop
    with_stop = complete(client, server, "Stop test", max_tokens=20, stop=[stop],
                         extra_body={"include_stop_str_in_output": True}, **GREEDY).choices[0]
    assert with_stop.text == text[: text.index(stop) + len(stop)]

    streamed, _ = stream_text(client, server, "Stop test", max_tokens=20, stop=[stop], **GREEDY)
    assert streamed[0] == out.text

    # A token whose text encodes back to exactly one id, so that id is known to be in the output.
    tokens = full.logprobs.tokens
    tok = server.engine.engine.tokenizer
    position, stop_id = next((i, tok.encode(t)[0]) for i, t in enumerate(tokens)
                             if i >= 1 and len(tok.encode(t)) == 1 and tok.decode(tok.encode(t)) == t)
    out = complete(client, server, "Stop test", max_tokens=20, extra_body={"stop_token_ids": [stop_id]}, **GREEDY)
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].model_extra["stop_reason"] == stop_id
    assert out.usage.completion_tokens <= position + 1


def test_explicit_null_max_tokens_fills_the_context(server: ServerHandle) -> None:
    serving = _serving(server)
    req = CompletionRequest.model_validate({"prompt": "x", "max_tokens": None})
    assert serving._max_tokens(req, 100) == serving.max_model_len - 100
    req = CompletionRequest.model_validate({"prompt": "x"})
    assert serving._max_tokens(req, 100) == 16
    assert serving._max_tokens(req, serving.max_model_len - 3) == 3


def test_generation_config_defaults_fill_unset_fields(server: ServerHandle) -> None:
    serving = _serving(server)
    defaults = server.engine.engine.generation_defaults.sampling_overrides()
    unset = serving.sampling_params(CompletionRequest.model_validate({"prompt": "x"}), 16, None)
    for name in ("temperature", "top_p", "top_k"):
        if name in defaults:
            assert getattr(unset, name) == defaults[name]
    explicit = serving.sampling_params(
        CompletionRequest.model_validate({"prompt": "x", "temperature": 0.0, "top_p": 0.5, "top_k": 3}), 16, None)
    assert (explicit.temperature, explicit.top_p, explicit.top_k) == (0.0, 0.5, 3)


def _serving(server: ServerHandle) -> CompletionServing:
    return CompletionServing(server.engine, server.model, {server.model}, ServerMetrics(server.engine, server.model))


def test_n_choices_per_prompt(client: openai.OpenAI, server: ServerHandle, tokenizer: Tokenizer) -> None:
    """n > 1: choice i * n + j is prompt i's j-th completion; the prompt counts once in the usage; seeded
    choices differ from each other, are reproducible, and choice 0 is the single completion with that seed."""
    prompts = ["Alpha", "Beta gamma"]
    sampled = {"temperature": 1.0, "top_p": 1.0, "seed": 123, "max_tokens": 10}
    out = complete(client, server, prompts, n=3, **sampled)
    assert [c.index for c in out.choices] == list(range(6))
    assert out.usage.prompt_tokens == sum(len(tokenizer.encode(p)) for p in prompts)
    assert out.usage.completion_tokens == 60
    again = complete(client, server, prompts, n=3, **sampled)
    assert [c.text for c in again.choices] == [c.text for c in out.choices]
    for i, prompt in enumerate(prompts):
        texts = [c.text for c in out.choices[3 * i:3 * i + 3]]
        assert len(set(texts)) > 1
        assert texts[0] == complete(client, server, prompt, **sampled).choices[0].text
    greedy = complete(client, server, "Delta", n=2, max_tokens=8, **GREEDY)
    assert greedy.choices[0].text == greedy.choices[1].text
    texts, chunks = stream_text(client, server, prompts, n=3, stream_options={"include_usage": True}, **sampled)
    assert [texts[k] for k in range(6)] == [c.text for c in out.choices]
    assert chunks[-1].usage.completion_tokens == 60


def test_logit_bias(client: openai.OpenAI, server: ServerHandle, tokenizer: Tokenizer) -> None:
    """+100 on one token makes it every token sampled; -100 bans the greedy choice."""
    forced = tokenizer.encode(" x")[-1]
    out = complete(client, server, "Once upon a time", max_tokens=6, temperature=0.9, seed=1,
                   logit_bias={str(forced): 100}, logprobs=0)
    assert out.choices[0].logprobs.tokens == [tokenizer.decode([forced])] * 6
    greedy = complete(client, server, "Once upon a time", max_tokens=1, **GREEDY, logprobs=0)
    first = greedy.choices[0].logprobs.tokens[0]
    same_text = [t for t in range(tokenizer.vocab_size) if tokenizer.decode([t]) == first]
    again = complete(client, server, "Once upon a time", max_tokens=1, **GREEDY, logprobs=0,
                     logit_bias={str(t): -100 for t in same_text})
    assert again.choices[0].logprobs.tokens[0] != first


def test_usage_reports_prompt_tokens_served_from_the_prefix_cache(client: openai.OpenAI, server: ServerHandle,
                                                                   tokenizer: Tokenizer) -> None:
    shared = "You are a careful assistant. " * 60
    prompts = [shared + tail for tail in ("Say hello.", "Count to three.", "Name a colour.")]
    outs = [complete(client, server, p, max_tokens=2, **GREEDY) for p in prompts]
    details = [o.usage.prompt_tokens_details for o in outs]
    assert all(d is not None for d in details)
    common = len(tokenizer.encode(shared))
    block = server.engine.engine.config.block_size
    # the second prompt discovers the shared prefix and computes it; the third starts from it
    assert details[1].cached_tokens == 0
    assert 0 < details[2].cached_tokens <= common and details[2].cached_tokens % block == 0
    assert details[2].cached_tokens > common - 2 * block


def test_cache_salt_separates_prefix_cache_users(client: openai.OpenAI, server: ServerHandle) -> None:
    """vLLM's cache_salt: a prompt prefix cached for one salt is no hit for another (or for none)."""
    shared = "Tenant notes: the quick brown fox jumps over the lazy dog. " * 30
    prompts = [shared + tail for tail in ("One.", "Two.", "Three.", "Four.")]

    def cached(prompt: str, salt: str | None) -> int:
        out = complete(client, server, prompt, max_tokens=2, **GREEDY,
                       extra_body={"cache_salt": salt} if salt else {})
        return out.usage.prompt_tokens_details.cached_tokens

    assert [cached(prompts[0], "t1"), cached(prompts[1], "t1")] == [0, 0]
    assert cached(prompts[2], "t1") > 0
    assert cached(prompts[3], "t2") == 0 and cached(prompts[3], None) == 0
    r = httpx.post(server.api + "/completions", json={"prompt": "x", "cache_salt": ""})
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"
