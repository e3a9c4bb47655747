"""Start-up warm-up (nibble/engine/warmup.py) on the demo model (CPU): it must run a step of every planned
token count, a prefill continuing on its cached prefix next to a decoding request and a pure decode batch,
and leave the engine exactly as it found it, so that generations after it equal those of a fresh engine."""

from __future__ import annotations

import pytest
import torch

from nibble.engine import llm_engine
from nibble.engine.llm import LLM
from nibble.engine.sampling_params import SamplingParams
from nibble.engine.warmup import warmup_token_counts


@pytest.mark.parametrize("budget", [1, 7, 8, 9, 64, 100, 8192])
def test_token_counts_cover_every_octave(budget: int) -> None:
    counts = warmup_token_counts(budget)
    assert counts == sorted(set(counts))
    assert counts[0] == 1 and counts[-1] == budget
    assert set(range(1, min(8, budget) + 1)) <= set(counts)
    for lo in range(3, budget.bit_length()):  # at least two sizes in every octave [2^k, 2^(k+1))
        assert len([c for c in counts if 1 << lo <= c < 2 << lo]) >= min(2, budget - (1 << lo) + 1)


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(0, 990, (n,), generator=gen).tolist() for n in (7, 50, 19, 2)]


def _fields(outs) -> list[tuple]:
    return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in outs]


def test_warm_up_runs_every_step_kind_and_leaves_no_trace() -> None:
    engine_args = {"device": "cpu", "max_model_len": 256, "max_num_batched_tokens": 64}
    # no per-request seed: the engine's generator draws the samples, so it must be reseeded by the warm-up
    params = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=10, ignore_eos=True)
    expected = LLM(**engine_args).generate(_prompts(), params)

    llm = LLM(**engine_args)
    engine = llm.engine
    steps: list[tuple[list[int], list[int]]] = []
    execute = engine.runner.execute

    def spy(sched, inflight_tokens=None):
        steps.append(([r.num_computed_tokens for r in sched.requests], list(sched.num_new_tokens)))
        return execute(sched, inflight_tokens)

    engine.runner.execute = spy  # type: ignore[method-assign]
    assert engine.warm_up() > 0
    totals = {sum(new) for _, new in steps}
    assert set(warmup_token_counts(64)) <= totals
    assert any(len(new) > 1 for ctx, new in steps if sum(new) > 1)  # varlen prefill
    assert any(any(c > 0 and n > 1 for c, n in zip(ctx, new)) and 1 in new for ctx, new in steps)  # prefix + decode
    assert any(len(new) >= 8 and set(new) == {1} for _, new in steps)  # decode batch
    assert engine.blocks.all_free() and not engine.requests and not engine.has_unfinished_requests()
    assert engine.stats() == {"num_running": 0, "num_waiting": 0, "kv_cache_usage": 0.0, "num_steps": 0,
                              "num_generated_tokens": 0, "num_prompt_tokens": 0, "num_preemptions": 0,
                              "num_computed_prompt_tokens": 0,
                              "prefix_cache_queries": 0, "prefix_cache_hits": 0, "spec_decode_num_drafts": 0,
                              "spec_decode_num_draft_tokens": 0, "spec_decode_num_accepted_tokens": 0,
                              "model_steps_decode_graph": 0, "model_steps_mixed_graph": 0,
                              "model_steps_verify_graph": 0, "model_steps_eager": 0}
    assert _fields(llm.generate(_prompts(), params)) == _fields(expected)


def test_warm_up_needs_an_idle_engine() -> None:
    llm = LLM(device="cpu", max_model_len=64)
    llm.engine.add_request("busy", [1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="idle"):
        llm.engine.warm_up()


def test_cpu_engines_skip_the_start_up_warm_up(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(engine) -> float:
        raise AssertionError("warm-up ran on a CPU engine")

    monkeypatch.setattr(llm_engine, "warm_up", fail)
    LLM(device="cpu", max_model_len=64)
