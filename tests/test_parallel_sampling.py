"""Parallel sampling offline (`SamplingParams(n=...)` with `LLM.generate`, as vLLM): each choice runs as an engine
request of its own (`SamplingParams.for_choice`) and the prompt's RequestOutput holds all of them, indexed; a
seeded choice j is what a single request with seed + j generates."""

from __future__ import annotations

import pytest

from nibble.engine.errors import RequestError
from nibble.engine.llm import LLM
from nibble.engine.sampling_params import SEED_MAX, SEED_MIN, SamplingParams, SamplingParamsError


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(device="cpu", max_model_len=256)


def test_choices_are_the_seeded_single_requests(llm: LLM) -> None:
    prompts = [[5, 9, 13, 2], [700, 3]]
    params = SamplingParams(n=3, temperature=0.9, seed=11, max_tokens=8, ignore_eos=True, logprobs=1)
    outs = llm.generate(prompts, params)
    assert [len(o.outputs) for o in outs] == [3, 3]
    for prompt, out in zip(prompts, outs):
        assert [c.index for c in out.outputs] == [0, 1, 2]
        assert out.prompt_token_ids == prompt and out.finished
        for j, choice in enumerate(out.outputs):
            alone = llm.generate(prompt, SamplingParams(temperature=0.9, seed=11 + j, max_tokens=8, ignore_eos=True,
                                                        logprobs=1))[0].outputs[0]
            assert choice.token_ids == alone.token_ids and len(choice.logprobs or []) == 8
    assert len({tuple(c.token_ids) for c in outs[0].outputs}) > 1, "seeded choices differ"
    assert len({o.request_id for o in outs}) == 2
    assert llm.engine.blocks.all_free() and not llm.engine.requests


def test_greedy_choices_agree_and_single_choice_is_unchanged(llm: LLM) -> None:
    out = llm.generate([3, 4, 5], SamplingParams(n=2, temperature=0.0, max_tokens=6, ignore_eos=True))[0]
    assert out.outputs[0].token_ids == out.outputs[1].token_ids
    one = llm.generate([3, 4, 5], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))[0]
    assert len(one.outputs) == 1 and one.outputs[0].token_ids == out.outputs[0].token_ids


def test_for_choice_and_bounds() -> None:
    params = SamplingParams(n=4, seed=SEED_MAX, stop=["x"])
    child = params.for_choice(1)
    assert child.n == 1 and child.seed == SEED_MIN  # wraps around the generator's seed range
    assert child.stop == ["x"] and child.stop is not params.stop
    assert SamplingParams(n=2).for_choice(1).seed is None
    for bad in (0, -1, True, 1.5):
        with pytest.raises(SamplingParamsError, match="n must be an integer >= 1"):
            SamplingParams(n=bad)  # type: ignore[arg-type]


def test_one_engine_request_is_one_sequence(llm: LLM) -> None:
    with pytest.raises(RequestError, match="n must be 1 for one engine request"):
        llm.engine.add_request("x", [1, 2], SamplingParams(n=2))
    assert not llm.engine.requests


def test_offline_generate_is_not_capped_by_the_servers_queue_limit() -> None:
    llm = LLM(device="cpu", max_model_len=64, max_num_seqs=2, max_waiting_requests=1)
    outs = llm.generate([[1, 2, 3]] * 3, SamplingParams(n=2, max_tokens=2, ignore_eos=True))
    assert [len(o.outputs) for o in outs] == [2, 2, 2]
