"""Non-finite values in one sequence fail that request only: a clear error and one log line naming the
engine step and batch; the other requests in the same batches finish with exactly the tokens they produce
when the failing request simply goes away at that step; its caches come back and stale NaN left in freed
cache memory never reaches a later request."""

from __future__ import annotations

import logging

import pytest

from nibble.engine.llm_engine import LLMEngine

from .conftest import assert_engine_idle, engine_config, greedy, run_to_end
from .faults import PoisonRow, poison_free_cache_memory

PROMPTS = {"a": "The weather today is", "victim": "Poison me at my fourth token please", "c": "Count: one two"}
MAX_TOKENS = 10
POISON_AFTER = 3


def _start(engine: LLMEngine) -> None:
    for rid, prompt in PROMPTS.items():
        engine.add_request(rid, prompt, greedy(MAX_TOKENS))


def _baseline() -> dict[str, list[int]]:
    """Same requests, same batches; the victim is aborted right after the step that would fail it."""
    engine = LLMEngine(engine_config(enforce_eager=True))
    _start(engine)

    aborted: dict[str, list[int]] = {}

    def abort_victim(eng: LLMEngine) -> None:
        victim = eng.requests.get("victim")
        if victim is not None and victim.num_output_tokens == POISON_AFTER + 1:
            out = eng.abort_request("victim")
            assert out is not None
            aborted["victim"] = out.outputs[0].token_ids

    outs = run_to_end(engine, after_step=abort_victim)
    return {**{rid: out.outputs[0].token_ids for rid, out in outs.items()}, **aborted}


@pytest.fixture(scope="module")
def baseline() -> dict[str, list[int]]:
    return _baseline()


@pytest.mark.parametrize(("where", "value"), [("logits", float("nan")), ("logits", float("inf")),
                                              ("layer", float("nan"))])
def test_non_finite_row_fails_only_its_request(where: str, value: float, baseline: dict[str, list[int]],
                                               caplog: pytest.LogCaptureFixture) -> None:
    engine = LLMEngine(engine_config(enforce_eager=True))
    poison = PoisonRow(engine, lambda r: r.request_id == "victim", POISON_AFTER, where=where, value=value)
    _start(engine)
    with caplog.at_level(logging.ERROR, logger="nibble.engine"):
        outs = run_to_end(engine)
    assert len(poison.fired) == 1
    step, batch_seqs, batch_tokens = poison.fired[0]

    victim = outs["victim"]
    assert victim.finished and victim.outputs[0].finish_reason == "error"
    assert victim.error and "non-finite" in victim.error and f"step {step}" in victim.error
    # Tokens before the poisoned step were sampled normally; nothing was sampled from the bad row.
    assert victim.outputs[0].token_ids == baseline["victim"][:POISON_AFTER]
    for rid in ("a", "c"):
        assert outs[rid].error is None and outs[rid].outputs[0].finish_reason == "length"
        assert outs[rid].outputs[0].token_ids == baseline[rid], rid

    lines = [r.getMessage() for r in caplog.records if "non-finite" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "victim" in lines[0] and f"step {step}" in lines[0]
    assert f"batch of {batch_seqs} sequences ({batch_tokens} tokens)" in lines[0]
    assert_engine_idle(engine)


def test_poisoned_prefill_fails_at_first_token(caplog: pytest.LogCaptureFixture) -> None:
    engine = LLMEngine(engine_config(enforce_eager=True))
    poison = PoisonRow(engine, lambda r: r.request_id == "victim", 0, where="layer")
    _start(engine)
    outs = run_to_end(engine)
    assert poison.fired and outs["victim"].outputs[0].finish_reason == "error"
    assert outs["victim"].outputs[0].token_ids == []
    assert all(outs[r].outputs[0].finish_reason == "length" for r in ("a", "c"))
    assert_engine_idle(engine)


def test_stale_nan_in_freed_caches_never_leaks() -> None:
    """A failed request leaves NaN in the KV blocks and GDN slots it used; a later request that gets that
    memory must not see it (blocks are read only up to the sequence length, slots are zeroed first)."""
    fresh = LLMEngine(engine_config(enforce_eager=True))
    fresh.add_request("d", "A brand new request after the failure", greedy(24))
    expected = run_to_end(fresh)["d"].outputs[0].token_ids

    engine = LLMEngine(engine_config(enforce_eager=True))
    PoisonRow(engine, lambda r: r.request_id == "victim", POISON_AFTER, where="layer")
    _start(engine)
    run_to_end(engine)
    assert poison_free_cache_memory(engine) == engine.blocks.num_blocks
    engine.add_request("d", "A brand new request after the failure", greedy(24))
    out = run_to_end(engine)["d"]
    assert out.outputs[0].finish_reason == "length"
    assert out.outputs[0].token_ids == expected
    assert_engine_idle(engine)
