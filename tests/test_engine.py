"""Engine behaviour on the demo model (CPU): continuous batching, chunked prefill and preemption give the
same greedy tokens as running each request alone; seeded sampling does not depend on the batch; the FP8 KV
cache runs; every block and state slot is freed at the end."""

from __future__ import annotations

import pytest
import torch

from nibble.engine.llm import LLM
from nibble.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _prompts(vocab: int, lens: list[int], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, min(vocab, 990), (n,), generator=gen).tolist() for n in lens]


@pytest.fixture(scope="module")
def reference() -> tuple[list[list[int]], list[list[int]]]:
    llm = LLM(device="cpu", max_model_len=256)
    prompts = _prompts(llm.engine.model_config.vocab_size, [5, 40, 17, 3, 64, 29])
    alone = [llm.generate([p], GREEDY)[0].outputs[0].token_ids for p in prompts]
    return prompts, alone


def test_batched_chunked_and_preempted_runs_match_single_requests(reference) -> None:
    prompts, alone = reference
    # A 16-token budget forces chunked prefill; 14 blocks of 16 tokens force preemptions.
    llm = LLM(device="cpu", max_model_len=128, max_num_batched_tokens=16, extra={"num_kv_blocks": 14})
    outs = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == alone
    assert llm.engine.num_preemptions > 0
    assert llm.engine.blocks.all_free()


def test_seeded_sampling_is_independent_of_the_batch(reference) -> None:
    prompts, _ = reference
    llm = LLM(device="cpu", max_model_len=256)
    sp = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=1234, max_tokens=16, ignore_eos=True)
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    reversed_order = [o.outputs[0].token_ids for o in llm.generate(prompts[::-1], sp)][::-1]
    alone = [llm.generate([p], sp)[0].outputs[0].token_ids for p in prompts[:2]]
    assert together == reversed_order
    assert together[:2] == alone


def test_fp8_kv_cache_runs_and_stays_close(reference) -> None:
    prompts, alone = reference
    llm = LLM(device="cpu", max_model_len=256, kv_cache_dtype="fp8_e4m3")
    assert llm.engine.runner.caches.kv[3].k.dtype == torch.float8_e4m3fn
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    # FP8 K/V round values, so a late near-tie may flip; the first tokens must agree.
    assert all(o[:4] == a[:4] for o, a in zip(outs, alone))
    assert llm.engine.blocks.all_free()


def test_stop_conditions_and_abort() -> None:
    llm = LLM(device="cpu", max_model_len=256)
    prompt = _prompts(llm.engine.model_config.vocab_size, [12])[0]
    free_run = llm.generate([prompt], GREEDY)[0].outputs[0]
    stop_id = free_run.token_ids[5]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[stop_id]))[0]
    first = free_run.token_ids.index(stop_id)
    assert out.outputs[0].token_ids == free_run.token_ids[: first + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop_id
    engine = llm.engine
    engine.add_request("to-abort", prompt, SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    final = engine.abort_request("to-abort")
    assert final is not None and final.finished and final.outputs[0].finish_reason == "abort"
    assert not engine.has_unfinished_requests() and engine.blocks.all_free()


def test_llm_chat_renders_like_the_tokenizer_and_continues_a_final_message() -> None:
    """LLM.chat (vLLM's offline chat): each conversation rendered by the chat template (tools, thinking off,
    continue_final_message) and generated exactly as LLM.generate on the rendered text."""
    llm = LLM(device="cpu", max_model_len=1024)
    tok = llm.get_tokenizer()
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    convs = [[{"role": "user", "content": "hi"}], [{"role": "user", "content": "name a colour"}]]
    got = [o.outputs[0].token_ids for o in llm.chat(convs, greedy, tools=tools, enable_thinking=False)]
    texts = [tok.apply_chat_template(c, tools=tools, enable_thinking=False) for c in convs]
    assert got == [o.outputs[0].token_ids for o in llm.generate(texts, greedy)]
    prefill = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello, I am"}]
    out = llm.chat(prefill, greedy, add_generation_prompt=False, continue_final_message=True)[0]
    rendered = tok.apply_chat_template(prefill, add_generation_prompt=False, continue_final_message=True)
    assert rendered.endswith("Hello, I am") and out.prompt == rendered
    with pytest.raises(ValueError, match="add_generation_prompt=False"):
        llm.chat(prefill, greedy, continue_final_message=True)


def test_sampling_params_without_max_tokens_serve_prompts_of_any_length() -> None:
    """A SamplingParams without max_tokens fills each request's own room: the engine does not write one prompt's
    room into the caller's object, which would refuse the next, longer prompt."""
    llm = LLM(device="cpu", max_model_len=128)
    params = SamplingParams(temperature=0.0, ignore_eos=True)
    params.max_tokens = None
    short = llm.engine.add_request("short", [5] * 3, params)
    long = llm.engine.add_request("long", [7] * 60, params)
    assert params.max_tokens is None
    assert (short.sampling_params.max_tokens, long.sampling_params.max_tokens) == (125, 68)
    for rid in ("short", "long"):
        llm.engine.abort_request(rid)
