"""The periodic statistics lines (nibble/server/stat_logger.py, vLLM's serve log) and the per-position acceptance
counters behind their speculative-decoding line and /metrics: the figures follow the engine's own counters over
the interval, an idle engine logs nothing, and `--disable-log-stats` turns the lines off."""

from __future__ import annotations

import argparse
import itertools
import logging
import re
import time

import httpx
import pytest

from nibble.engine.async_engine import AsyncEngine
from nibble.engine.config import EngineConfig
from nibble.engine.llm_engine import LLMEngine
from nibble.engine.sampling_params import SamplingParams
from nibble.server.launch import add_cli_args, app_settings
from nibble.server.stat_logger import LOG_STATS_INTERVAL_S, StatLogger
from tests.test_ngram_spec import _repetitive_prompts
from tests.test_spec_decode import _Oracle, _run

from .conftest import metric_value, start_server, wait_idle

K = 3


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _numbers(line: str) -> dict[str, str]:
    return dict(re.findall(r"([A-Za-z][A-Za-z -]*?): ([0-9., ]+?)(?: tokens/s| tokens| reqs|%)?(?:,(?= [A-Z])|$)",
                           line))


@pytest.fixture(scope="module")
def spec_run() -> tuple[LLMEngine, dict[str, float], dict[str, float], list[str]]:
    """An n-gram engine whose drafts are the reference continuation, every so often corrupted (so that the
    accepted runs have every length 0..K), read by a StatLogger before and after; the clock says 4 s passed."""
    prompts = _repetitive_prompts(4, seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    ref = _run(LLMEngine(EngineConfig(model="demo", device="cpu", max_model_len=256)), prompts, params)
    engine = LLMEngine(EngineConfig(model="demo", device="cpu", max_model_len=256, num_speculative_tokens=K,
                                    speculative_method="ngram", prompt_lookup_min=2, prompt_lookup_max=3))
    with pytest.MonkeyPatch.context() as mp:
        _Oracle(engine, ref, K, 0.3).install(mp)
        clock = _Clock()
        before = engine.stats()
        stat_logger = StatLogger(engine.stats, clock)
        assert _run(engine, prompts, params) == ref
        for i, p in enumerate(prompts[:2]):  # still waiting when the line is made
            engine.add_request(f"w{i}", p, params)
        clock.now += 4.0
        lines = stat_logger.lines()
    return engine, before, engine.stats(), lines


def test_acceptance_counters_per_position(spec_run) -> None:  # type: ignore[no-untyped-def]
    _, _, stats, _ = spec_run
    per_pos = [stats[f"spec_decode_num_accepted_tokens_pos_{i}"] for i in range(K)]
    assert f"spec_decode_num_accepted_tokens_pos_{K}" not in stats
    assert sum(per_pos) == stats["spec_decode_num_accepted_tokens"] > 0
    # a draft is kept only after every draft before it: the counts never grow with the position
    assert all(a >= b for a, b in itertools.pairwise(per_pos)) and per_pos[-1] > 0
    assert stats["spec_decode_num_draft_tokens"] == K * stats["spec_decode_num_drafts"]
    assert per_pos[0] < stats["spec_decode_num_drafts"]  # some first drafts were corrupted


def test_lines_follow_the_engine_counters(spec_run) -> None:  # type: ignore[no-untyped-def]
    _, before, after, lines = spec_run
    assert len(lines) == 2
    main, spec = _numbers(lines[0]), _numbers(lines[1])

    def delta(key: str) -> float:
        return after[key] - before[key]

    assert float(main["Avg prompt throughput"]) == pytest.approx(delta("num_computed_prompt_tokens") / 4, abs=0.06)
    # the two requests still waiting arrived (num_prompt_tokens) but nothing of them was computed
    assert delta("num_computed_prompt_tokens") == delta("num_prompt_tokens") - sum(len(p) for p in
                                                                                  _repetitive_prompts(4, seed=2)[:2])
    assert float(main["Avg generation throughput"]) == pytest.approx(delta("num_generated_tokens") / 4, abs=0.06)
    assert int(main["Waiting"]) == 2 and int(main["Running"]) == 0
    drafts, accepted = delta("spec_decode_num_drafts"), delta("spec_decode_num_accepted_tokens")
    rates = [float(r) for r in spec["Per-position acceptance rate"].split(",")]
    assert len(rates) == K
    assert rates == pytest.approx([delta(f"spec_decode_num_accepted_tokens_pos_{i}") / drafts for i in range(K)],
                                  abs=5e-4)
    assert float(spec["Mean acceptance length"]) == pytest.approx(1 + accepted / drafts, abs=5e-3)
    assert float(spec["Mean acceptance length"]) == pytest.approx(1 + sum(rates), abs=5e-3)
    assert int(spec["Accepted"]) == accepted and int(spec["Drafted"]) == delta("spec_decode_num_draft_tokens")
    assert float(spec["Avg Draft acceptance rate"]) == pytest.approx(
        100 * accepted / delta("spec_decode_num_draft_tokens"), abs=0.05)


def test_an_idle_engine_logs_nothing_and_no_spec_line_without_drafts() -> None:
    engine = LLMEngine(EngineConfig(model="demo", device="cpu", max_model_len=256))
    clock = _Clock()
    stat_logger = StatLogger(engine.stats, clock)
    clock.now += 10
    assert stat_logger.lines() == []
    _run(engine, [[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True))
    clock.now += 10
    lines = stat_logger.lines()
    assert len(lines) == 1 and "Avg generation throughput: 0.4 tokens/s" in lines[0]
    clock.now += 10
    assert stat_logger.lines() == []


def test_server_logs_the_lines_while_it_works(caplog: pytest.LogCaptureFixture) -> None:
    engine = AsyncEngine(LLMEngine(EngineConfig(model="demo", device="cpu", max_model_len=256)))
    handle = start_server(engine, log_stats_interval_s=0.05)
    try:
        with caplog.at_level(logging.INFO, logger="nibble.server"), httpx.Client(base_url=handle.url) as http:
            assert http.post("/v1/completions", json={"prompt": "stats", "max_tokens": 40,
                                                      "ignore_eos": True}).status_code == 200
            time.sleep(0.2)
        assert wait_idle(engine)
        assert any("Avg generation throughput" in r.getMessage() for r in caplog.records)
    finally:
        handle.stop()
        engine.shutdown()


def test_metrics_expose_acceptance_per_position() -> None:
    engine = AsyncEngine(LLMEngine(EngineConfig(model="demo", device="cpu", max_model_len=256,
                                                num_speculative_tokens=2, speculative_method="ngram",
                                                prompt_lookup_min=1, prompt_lookup_max=2)))
    handle = start_server(engine)
    try:
        with httpx.Client(base_url=handle.url) as http:
            http.post("/v1/completions", json={"prompt": "a b a b a b a b", "max_tokens": 12, "ignore_eos": True})
            assert wait_idle(engine)
            text = http.get("/metrics").text
        stats = engine.stats()
        for prefix in ("nibble", "vllm"):
            for pos in range(2):
                assert metric_value(text, f"{prefix}:spec_decode_num_accepted_tokens_per_pos_total",
                                    position=str(pos)) == stats[f"spec_decode_num_accepted_tokens_pos_{pos}"]
            assert metric_value(text, f"{prefix}:spec_decode_num_drafts_total") == stats["spec_decode_num_drafts"] > 0
    finally:
        handle.stop()
        engine.shutdown()


def test_disable_log_stats_flag() -> None:
    parse = add_cli_args(argparse.ArgumentParser()).parse_args
    assert app_settings(parse([]))["log_stats_interval_s"] == LOG_STATS_INTERVAL_S
    assert "log_stats_interval_s" not in app_settings(parse(["--disable-log-stats"]))
