"""Prompt log-probabilities in the engine (demo model, CPU; the values themselves are checked against
transformers in test_model_vs_transformers.py): the same whatever the chunking, batching, prefix cache and
preemption, equal to the log-probabilities of the same tokens when the model generated them, and refused
under speculative decoding."""

from __future__ import annotations

import pytest
import torch

from nibble.engine.config import EngineConfig
from nibble.engine.llm import LLM
from nibble.engine.llm_engine import LLMEngine, RequestError
from nibble.engine.request import TokenLogprobs
from nibble.engine.sampling_params import SamplingParams, SamplingParamsError

PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=2)


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(4)
    shared = torch.randint(0, 900, (300,), generator=gen).tolist()
    return [shared + torch.randint(0, 900, (n,), generator=gen).tolist() for n in (7, 30)] + \
        [torch.randint(0, 900, (n,), generator=gen).tolist() for n in (2, 90)]


def _values(entries: list[TokenLogprobs | None] | None) -> list[tuple[int, float, dict[int, float]] | None]:
    assert entries is not None
    return [None if e is None else (e.token_id, e.logprob, e.top) for e in entries]


def _close(a: list, b: list) -> None:
    assert len(a) == len(b) and a[0] is None and b[0] is None
    for x, y in zip(a[1:], b[1:]):
        assert x[0] == y[0] and x[1] == pytest.approx(y[1], abs=1e-4)
        assert set(x[2]) == set(y[2])


@pytest.fixture(scope="module")
def reference() -> list[list]:
    llm = LLM(device="cpu", max_model_len=512, enable_prefix_caching=False)
    return [_values(o.prompt_logprobs) for o in llm.generate(_prompts(), PARAMS)]


def test_chunked_cached_and_preempted_runs_agree(reference: list[list]) -> None:
    prompts = _prompts()
    # a cached prefix is not used (its positions' log-probabilities were never computed) ...
    warm = LLM(device="cpu", max_model_len=512)
    warm.generate(prompts[:1], SamplingParams(max_tokens=1))
    outs = warm.generate(prompts, PARAMS)
    assert [o.num_cached_tokens for o in outs] == [0] * len(prompts)
    for out, want in zip(outs, reference):
        _close(_values(out.prompt_logprobs), want)
    # ... and chunks of 40 tokens on a KV pool that forces preemptions give the same values
    tight = LLM(device="cpu", max_model_len=512, max_num_batched_tokens=40, extra={"num_kv_blocks": 26})
    outs = tight.generate(prompts, PARAMS)
    assert tight.engine.num_preemptions > 0
    for out, want in zip(outs, reference):
        _close(_values(out.prompt_logprobs), want)
    assert tight.engine.blocks.all_free()


def test_prompt_logprobs_equal_the_generated_tokens_logprobs() -> None:
    """Teacher forcing: the log-probability of a token the model generated (computed by the sampler from a
    decode step) equals its prompt log-probability when the prompt continues with it."""
    llm = LLM(device="cpu", max_model_len=512, max_num_batched_tokens=16)
    prompt = _prompts()[2] + [5, 6, 7]
    first = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2))[0]
    generated = first.outputs[0].token_ids
    assert first.outputs[0].logprobs is not None
    second = llm.generate([prompt + generated], SamplingParams(max_tokens=1, prompt_logprobs=2))[0]
    entries = second.prompt_logprobs
    assert entries is not None
    for j, gen_lp in enumerate(first.outputs[0].logprobs):
        entry = entries[len(prompt) + j]
        assert entry is not None and entry.token_id == gen_lp.token_id
        assert entry.logprob == pytest.approx(gen_lp.logprob, abs=1e-4)
        assert set(entry.top) == set(gen_lp.top)


def test_requests_without_prompt_logprobs_get_none() -> None:
    llm = LLM(device="cpu", max_model_len=128)
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))[0]
    assert out.prompt_logprobs is None


def test_bad_values_and_speculative_decoding_are_refused() -> None:
    for bad in (-1, 1.5):
        with pytest.raises(SamplingParamsError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)
    spec = LLMEngine(EngineConfig(model="demo", device="cpu", max_model_len=128, num_speculative_tokens=2))
    # the upper bound is the engine's --max-logprobs (default 20)
    with pytest.raises(SamplingParamsError, match="prompt_logprobs must be at most 20"):
        spec.add_request("r", [1, 2, 3], SamplingParams(prompt_logprobs=21))
    with pytest.raises(RequestError, match="prompt_logprobs"):
        spec.add_request("r", [1, 2, 3], SamplingParams(prompt_logprobs=1))
