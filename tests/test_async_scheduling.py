"""Overlapped scheduling (EngineConfig.async_scheduling) on the demo model (CPU): the next step is queued
before the host has seen the tokens of the one before it, which it then reads on the device. Whatever the
mix of prefill chunks, preemptions, stop conditions, sampling settings and aborts, the outputs must be
exactly those of the synchronous engine, and every block and state slot must come back."""

from __future__ import annotations

import pytest
import torch

from nibble.engine.llm import LLM
from nibble.engine.sampling_params import SamplingParams
from nibble.engine.structured_output import StructuredOutputsParams


def _prompts(lens: list[int], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 990, (n,), generator=gen).tolist() for n in lens]


def _spy_inflight(llm: LLM) -> list[bool]:
    """Record, per executed step, whether it was given the tokens of a step still in flight."""
    seen: list[bool] = []
    runner = llm.engine.runner
    execute = runner.execute

    def spy(sched, inflight_tokens=None):
        seen.append(inflight_tokens is not None)
        return execute(sched, inflight_tokens)

    runner.execute = spy  # type: ignore[method-assign]
    return seen


def _run(prompts: list[list[int]], params: list[SamplingParams] | SamplingParams, overlap: bool, **engine):
    llm = LLM(device="cpu", max_model_len=256, async_scheduling=overlap, **engine)
    seen = _spy_inflight(llm)
    outs = llm.generate(prompts, params)
    assert llm.engine.blocks.all_free()
    assert all(not r.pending_rows for r in llm.engine.requests.values())
    return outs, seen, llm


def _fields(outs) -> list[tuple]:
    return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason, o.outputs[0].stop_reason)
            for o in outs]


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return _prompts([5, 40, 17, 3, 64, 29, 9])


def test_greedy_with_chunked_prefill_and_preemption_matches_sync(prompts) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    engine = {"max_num_batched_tokens": 16, "extra": {"num_kv_blocks": 14}}
    sync, seen_sync, _ = _run(prompts, params, False, **engine)
    over, seen_over, llm = _run(prompts, params, True, **engine)
    assert _fields(over) == _fields(sync)
    assert not any(seen_sync)
    assert any(seen_over)
    assert llm.engine.num_preemptions > 0


def test_requests_reaching_max_tokens_are_not_scheduled_again(prompts) -> None:
    params = [SamplingParams(temperature=0.0, max_tokens=6 + 3 * i, ignore_eos=True) for i in range(len(prompts))]
    sync, seen_sync, _ = _run(prompts, params, False)
    over, seen_over, _ = _run(prompts, params, True)
    assert _fields(over) == _fields(sync)
    assert len(seen_over) == len(seen_sync)


def test_stop_tokens_stop_strings_min_tokens_and_eos_match_sync(prompts) -> None:
    free = _run(prompts, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True), False)[0]
    params = []
    for i, o in enumerate(free):
        ids, text = o.outputs[0].token_ids, o.outputs[0].text
        if i % 3 == 0:
            params.append(SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[ids[4]]))
        elif i % 3 == 1 and len(text) > 6:
            params.append(SamplingParams(temperature=0.0, max_tokens=20, stop=[text[3:6]]))
        else:
            # min_tokens keeps the stop token (the 3rd one sampled) suppressed for the first 5 tokens
            params.append(SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[ids[2]], min_tokens=5))
    sync = _run(prompts, params, False)[0]
    over, seen, _ = _run(prompts, params, True)
    assert _fields(over) == _fields(sync)
    assert any(seen)
    assert any(o.outputs[0].finish_reason == "stop" for o in sync)


def test_seeded_sampling_and_logprobs_match_sync(prompts) -> None:
    params = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True,
                            logprobs=3)
    sync = _run(prompts, params, False)[0]
    over, seen, _ = _run(prompts, params, True)
    assert _fields(over) == _fields(sync)
    for a, b in zip(over, sync):
        la, lb = a.outputs[0].logprobs, b.outputs[0].logprobs
        assert [x.token_id for x in la] == [x.token_id for x in lb]
        assert [x.logprob for x in la] == pytest.approx([x.logprob for x in lb])
        assert [set(x.top) for x in la] == [set(x.top) for x in lb]
    assert any(seen)


def test_penalties_and_grammars_keep_overlap_with_deferred_sampling(prompts) -> None:
    """Requests that sample from their earlier tokens (penalties, min_tokens, a grammar) next to free ones:
    the next step's forward pass is still queued ahead, its sampling waits for the host to handle the step
    before, and every output equals the synchronous engine's."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 8}},
              "required": ["a", "b"]}
    params = [
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(temperature=0.8, seed=3, max_tokens=12, ignore_eos=True, presence_penalty=0.5,
                       frequency_penalty=0.7, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=schema)),
        SamplingParams(temperature=0.9, seed=5, max_tokens=20,
                       structured_outputs=StructuredOutputsParams(choice=("red", "green", "blue"))),
        SamplingParams(temperature=0.0, max_tokens=12, min_tokens=9, stop_token_ids=[7, 11, 13]),
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.7, seed=9, max_tokens=12, ignore_eos=True),
    ]
    sync = _run(prompts, params, False)[0]
    llm = LLM(device="cpu", max_model_len=256)
    seen = _spy_inflight(llm)
    deferred = []
    sample_deferred = llm.engine._sample_deferred

    def spy(launched):  # type: ignore[no-untyped-def]
        deferred.append(len(launched.sampled))
        sample_deferred(launched)

    llm.engine._sample_deferred = spy  # type: ignore[method-assign]
    over = llm.generate(prompts, params)
    assert _fields(over) == _fields(sync)
    for a, b in zip(over, sync):
        assert [t.logprob for t in a.outputs[0].logprobs or []] == \
            pytest.approx([t.logprob for t in b.outputs[0].logprobs or []], abs=1e-4)
    assert sum(seen) > 5 and len(deferred) > 5
    assert llm.engine.blocks.all_free()


def test_abort_while_a_step_is_in_flight() -> None:
    prompts = _prompts([12, 20])
    llm = LLM(device="cpu", max_model_len=256)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    alone = llm.generate([prompts[1]], params)[0].outputs[0].token_ids
    engine.add_request("a", prompts[0], params)
    engine.add_request("b", prompts[1], params)
    engine.step()
    engine.step()
    assert engine._inflight is not None
    final = engine.abort_request("a")
    assert final is not None and final.outputs[0].finish_reason == "abort"
    assert all(t >= 0 for t in final.outputs[0].token_ids)
    done = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id == "b"
            done = out if out.finished else done
    assert done is not None and done.outputs[0].token_ids == alone
    assert engine.blocks.all_free()


def test_pending_tokens_in_token_slice_and_runner_inputs() -> None:
    from nibble.engine.model_runner import _pending_inputs
    from nibble.engine.request import PENDING_BASE, Request

    req = Request("r", [1, 2, 3], SamplingParams())
    req.output_token_ids = [4, 5]
    req.pending_rows = [7]
    assert req.num_tokens == 6 and req.num_output_tokens == 2 and req.num_pending_tokens == 1
    assert req.token_slice(0, 6) == [1, 2, 3, 4, 5, PENDING_BASE - 7]
    assert req.token_slice(5, 6) == [PENDING_BASE - 7]
    assert req.token_slice(2, 4) == [3, 4]

    inflight = torch.tensor([10, 11, 12])
    ids, pending = _pending_inputs([5, PENDING_BASE, 7, PENDING_BASE - 2], inflight, torch.device("cpu"))
    assert ids == [5, 0, 7, 0]
    assert pending is not None
    assert pending[0].tolist() == [1, 3] and pending[1].tolist() == [10, 12]
    assert _pending_inputs([5, 6], None, torch.device("cpu")) == ([5, 6], None)
    with pytest.raises(RuntimeError, match="no step is in flight"):
        _pending_inputs([PENDING_BASE], None, torch.device("cpu"))


def test_a_failed_deferred_sampling_still_delivers_the_outputs_before_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """The deferred sampling of the queued step fails after the step before it has been handled (one request
    finished there): that request's final output is still returned, and the next call raises."""
    from nibble.engine import engine_steps

    llm = LLM(device="cpu", max_model_len=256)
    engine = llm.engine
    a, b = _prompts([9, 14], seed=3)
    engine.add_request("a", a, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, repetition_penalty=1.2))
    engine.add_request("b", b, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True,
                                              repetition_penalty=1.2))
    real = engine_steps.sample_launch

    def failing(*args, own_pending=0, **kwargs):  # type: ignore[no-untyped-def]
        if own_pending and "a" not in engine.requests:  # "a" has ended and its output was built
            raise RuntimeError("injected sampling failure")
        return real(*args, own_pending=own_pending, **kwargs)

    monkeypatch.setattr(engine_steps, "sample_launch", failing)
    finished = {}
    with pytest.raises(RuntimeError, match="injected"):
        while engine.has_unfinished_requests():
            finished.update((o.request_id, o) for o in engine.step() if o.finished)
    assert len(finished["a"].outputs[0].token_ids) == 4 and "b" not in finished
    assert engine._inflight is None and not engine.requests["b"].pending_rows
    engine.abort_request("b")
    assert engine.blocks.all_free()
