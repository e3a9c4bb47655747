"""`nibble bench latency`'s measurement loop on the demo model (CPU): the prefill phase lasts until every
request has its first token and the decode steps are exactly the steps after it, with and without overlapped
scheduling and with the prefill split into chunks."""

from __future__ import annotations

import pytest

from nibble.bench.latency import run_latency
from nibble.engine.llm import LLM


@pytest.mark.parametrize("overlap", [True, False])
def test_phases_and_decode_step_count(overlap: bool) -> None:
    engine = LLM(device="cpu", max_model_len=256, async_scheduling=overlap, max_num_batched_tokens=48).engine
    steps = []
    step = engine.step

    def counting_step():
        outs = step()
        steps.append(outs)
        return outs

    engine.step = counting_step  # type: ignore[method-assign]
    r = run_latency(engine, batch_size=3, input_len=40, output_len=6)
    # 120 prompt tokens in chunks of 48: the last request gets its first token in the third step
    first_all = next(i for i in range(len(steps))
                     if {o.request_id for outs in steps[: i + 1] for o in outs} >= {f"lat-0-{j}" for j in range(3)})
    assert first_all == 2
    assert 0 < r["prefill_s"] < r["total_s"]
    assert r["decode_step_median_ms"] > 0 and r["decode_tok_s"] > 0
    # every call after that returns one more token for each request, the last 5 of 6
    assert len(steps) - first_all - 1 == 5 == r["num_decode_steps"]
    assert engine.blocks.all_free()
