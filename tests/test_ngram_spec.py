"""Speculative decoding with n-gram drafts (nibble/engine/ngram_proposer.py; vLLM's `"method": "ngram"`) on the
demo model (CPU). The lookup is checked against a brute-force search; the engine's greedy outputs must equal
plain decoding's, with its own drafts and with oracle drafts that make it accept 0..k per step (the verify path
without the MTP head's passes); a checkpoint without an MTP head can draft this way."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
import torch

from nibble.engine.config import EngineConfig, EngineConfigError, parse_speculative_config
from nibble.engine.llm_engine import LLMEngine
from nibble.engine.ngram_proposer import NgramProposer, TokenHistory, find_ngram_continuation, propose_ngram_drafts
from nibble.engine.request import Request
from nibble.engine.sampling_params import SamplingParams
from nibble.server.launch import add_cli_args, engine_config_kwargs
from tests.helpers.moe_routing import record_routing
from tests.test_spec_decode import _Oracle, _run

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _engine(**kwargs: object) -> LLMEngine:
    return LLMEngine(EngineConfig(model="demo", device="cpu", max_model_len=512, **kwargs))  # type: ignore[arg-type]


def _ngram_engine(k: int = 3, **kwargs: object) -> LLMEngine:
    return _engine(num_speculative_tokens=k, speculative_method="ngram", prompt_lookup_min=2, prompt_lookup_max=4,
                   **kwargs)


def _repetitive_prompts(num: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a random block (three times, then part of it): the lookup finds n-grams in them."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(num):
        block = torch.randint(0, 1000, (int(torch.randint(6, 15, (), generator=gen)),), generator=gen).tolist()
        out.append(block * 3 + block[: len(block) // 2])
    return out


def _brute_force(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int] | None:
    """The specification, searched naively: the longest suffix of min_n..max_n tokens found earlier with a token
    after it, its latest occurrence, continued by the tokens after it (and the drafts, past the end)."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        tail = tokens[length - n:]
        starts = [p for p in range(length - n) if tokens[p:p + n] == tail]
        if starts:
            seq = list(tokens)
            for j in range(k):
                seq.append(seq[starts[-1] + n + j])
            return seq[length:]
    return None


@pytest.mark.parametrize(("vocab", "max_len"), [(2, 40), (3, 40), (8, 40), (60, 400)])
def test_lookup_matches_a_brute_force_search(vocab: int, max_len: int) -> None:
    """Small vocabularies give suffixes whose first token is everywhere (whole-array passes), the large one
    rare first tokens (only their windows checked further)."""
    gen = torch.Generator().manual_seed(vocab)
    for trial in range(300):
        length = int(torch.randint(1, max_len, (), generator=gen))
        tokens = torch.randint(0, vocab, (length,), generator=gen).tolist()
        min_n = int(torch.randint(1, 4, (), generator=gen))
        max_n = min_n + int(torch.randint(0, 4, (), generator=gen))
        k = int(torch.randint(1, 6, (), generator=gen))
        got = find_ngram_continuation(np.array(tokens, dtype=np.int64), k, min_n, max_n)
        assert got == _brute_force(tokens, k, min_n, max_n), (trial, tokens, k, min_n, max_n)


def test_drafts_always_number_k() -> None:
    arr = np.array([5, 6, 7, 8], dtype=np.int64)
    assert find_ngram_continuation(arr, 3, 2, 3) is None
    assert propose_ngram_drafts(arr, 3, 2, 3) == [8, 8, 8]  # nothing recurs: the last token repeated
    arr = np.array([5, 6, 9, 7, 6], dtype=np.int64)
    assert propose_ngram_drafts(arr, 3, 2, 3) == [9, 7, 6]  # no 2-gram recurs: the last token's continuation
    assert propose_ngram_drafts(np.array([4]), 2, 1, 1) == [4, 4]


def test_history_follows_the_requests_tokens() -> None:
    history = TokenHistory([1, 2, 3])
    history.extend(list(range(200)))
    assert history.array.tolist() == [1, 2, 3, *range(200)]
    proposer = NgramProposer(2, 1, 3)
    req = Request("r", [1, 2, 3, 1, 2], SamplingParams())
    assert proposer.propose(req) == [3, 1]
    req.output_token_ids += [3, 1]
    assert proposer.propose(req) == [2, 3] and len(req.token_history) == 7
    req.output_token_ids += [7]
    assert proposer.propose(req) == [7, 7]
    with pytest.raises(ValueError, match="min_n"):
        NgramProposer(2, 3, 2)


@pytest.fixture(scope="module")
def plain() -> LLMEngine:
    return _engine()


@pytest.mark.parametrize("k", [2, 4])
def test_greedy_output_equals_plain_decoding_with_ngram_drafts(plain: LLMEngine, k: int) -> None:
    prompts = _repetitive_prompts(4, seed=k)
    ref = _run(plain, prompts, GREEDY)
    spec = _ngram_engine(k)
    assert spec.model.mtp is None  # no head built, no KV cache for it
    assert _run(spec, prompts, GREEDY) == ref
    stats = spec.stats()
    assert stats["spec_decode_num_draft_tokens"] > 0
    assert stats["spec_decode_num_accepted_tokens"] <= stats["spec_decode_num_draft_tokens"]
    assert spec.blocks.all_free()


@pytest.mark.parametrize(("k", "noise"), [(3, 0.0), (3, 0.3)])
def test_accepted_ngram_drafts_leave_the_same_state_as_plain_decoding(plain: LLMEngine, k: int, noise: float,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Oracle drafts in place of the lookup's: accepted runs of 0..k tokens through the verify path that has no
    MTP pass after it."""
    prompts = _repetitive_prompts(3, seed=11)
    params = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, repetition_penalty=1.3)]
    ref = _run(plain, prompts, params)
    spec = _ngram_engine(k)
    _Oracle(spec, ref, k, noise).install(monkeypatch)
    assert _run(spec, prompts, params) == ref
    stats = spec.stats()
    accepted, drafted = stats["spec_decode_num_accepted_tokens"], stats["spec_decode_num_draft_tokens"]
    # (the repetition-penalty request's rows go through the regular sampler, its drafts uncounted: it takes one
    # token per step, so the step count is no measure here)
    assert accepted > 0 and (accepted == drafted if noise == 0.0 else accepted < drafted)
    assert spec.blocks.all_free()


def test_preemption_and_arrivals_keep_outputs(plain: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    prompts = _repetitive_prompts(4, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    ref = _run(plain, prompts, params)
    tight = _ngram_engine(2, max_num_batched_tokens=48, enable_prefix_caching=False, extra={"num_kv_blocks": 14})
    _Oracle(tight, ref, 2, 0.2).install(monkeypatch)
    assert _run(tight, prompts, params) == ref
    assert tight.num_preemptions > 0
    assert tight.blocks.all_free()


def test_a_checkpoint_without_an_mtp_head_drafts_with_ngrams(plain: LLMEngine) -> None:
    no_head = {"text_config": {"mtp_num_hidden_layers": 0}}
    with pytest.raises(EngineConfigError, match="ngram"):
        _engine(num_speculative_tokens=2, hf_overrides=no_head)
    spec = _ngram_engine(3, hf_overrides=no_head)
    assert spec.model_config.mtp_num_hidden_layers == 0
    prompts = _repetitive_prompts(2, seed=9)
    assert _run(spec, prompts, GREEDY) == _run(plain, prompts, GREEDY)


def test_seeded_sampling_runs_and_respects_limits() -> None:
    spec = _ngram_engine(3)
    params = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=15, seed=3, ignore_eos=True)
    first = _run(spec, _repetitive_prompts(2, seed=4), params)
    second = _run(spec, _repetitive_prompts(2, seed=4), params)
    assert first == second and all(len(t) == 15 for t in first.values())


def test_speculative_config_for_ngram() -> None:
    parse = parse_speculative_config
    assert parse('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
                 '"prompt_lookup_min": 2}') == {"speculative_method": "ngram", "num_speculative_tokens": 4,
                                                "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    # as vLLM: one bound stands for both, neither gives 5
    assert parse('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}')["prompt_lookup_min"] == 3
    assert parse('{"method": "ngram", "prompt_lookup_min": 2}')["prompt_lookup_max"] == 2
    assert parse('{"method": "ngram"}')["prompt_lookup_min"] == 5
    for bad, match in [('{"method": "mtp", "prompt_lookup_max": 3}', "for method ngram"),
                       ('{"method": "ngram", "prompt_lookup_max": "3"}', "integer"),
                       ('{"method": "ngram", "prompt_lookup_window": 3}', "unsupported")]:
        with pytest.raises(EngineConfigError, match=match):
            parse(bad)
    with pytest.raises(EngineConfigError, match="prompt_lookup_min <= prompt_lookup_max"):
        EngineConfig(model="demo", **parse('{"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}'))
    args = add_cli_args(argparse.ArgumentParser()).parse_args(
        ["--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4})])
    config = EngineConfig(**engine_config_kwargs(args))
    assert (config.speculative_method, config.num_speculative_tokens, config.prompt_lookup_min,
            config.prompt_lookup_max) == ("ngram", 3, 4, 4)
    assert config.speculative and not config.mtp_drafts


def test_llm_takes_vllms_speculative_config_dict() -> None:
    from nibble.engine.llm import LLM

    llm = LLM(device="cpu", max_model_len=256,
              speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3})
    config = llm.engine.config
    assert (config.speculative_method, config.num_speculative_tokens, config.prompt_lookup_max) == ("ngram", 2, 3)
    out = llm.generate([_repetitive_prompts(1)[0]], GREEDY)
    assert len(out[0].outputs[0].token_ids) == GREEDY.max_tokens


def test_warm_up_under_ngram_speculation_leaves_no_trace(plain: LLMEngine) -> None:
    spec = _ngram_engine(2, max_num_batched_tokens=64, max_num_seqs=8)
    assert spec.warm_up() > 0
    assert spec.blocks.all_free() and not spec.requests
    stats = spec.stats()
    assert stats["num_steps"] == 0 and stats["spec_decode_num_draft_tokens"] == 0
    assert stats["spec_decode_num_drafts"] == 0 and stats["spec_decode_num_accepted_tokens_pos_0"] == 0
    prompts = _repetitive_prompts(2, seed=6)
    assert _run(spec, prompts, GREEDY) == _run(plain, prompts, GREEDY)


def test_a_zero_lookup_bound_is_named_as_given() -> None:
    with pytest.raises(EngineConfigError, match="got 0 and 0"):
        EngineConfig(model="demo", **parse_speculative_config('{"method": "ngram", "prompt_lookup_max": 0}'))


def test_offline_commands_take_the_speculative_config(capsys: pytest.CaptureFixture[str]) -> None:
    from nibble.cli import build_parser, engine_config_from_args, main

    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2})
    argv = ["bench", "throughput", "--device", "cpu", "--speculative-config", spec]
    config = engine_config_from_args(build_parser(argv).parse_args(argv))
    assert (config.speculative_method, config.num_speculative_tokens, config.prompt_lookup_min) == ("ngram", 2, 2)
    assert main(["generate", "--device", "cpu", "--max-model-len", "128", "--prompt", "a b a b a b a b",
                 "--max-tokens", "6", "--speculative-config", spec]) == 0
    assert main(["generate", "--device", "cpu", "--prompt", "x", "--speculative-config", spec,
                 "--num-speculative-tokens", "2"]) == 2
    assert "not both" in capsys.readouterr().err


def test_padded_verify_graphs_match_eager_verify_steps() -> None:
    """Verify steps of 3 sequences through the 4-sequence verify graph (each replay computed eagerly here, as the
    captured graph would): the greedy outputs of eager verify steps, and the padding sequence's rows routed to
    no expert."""
    from nibble.engine.spec_decode import VerifyGraphs, _VerifyGraph

    prompts = _repetitive_prompts(3, seed=5)
    eager = _run(_ngram_engine(k=2), prompts, GREEDY)
    engine = _ngram_engine(k=2)
    runner = engine.runner
    seen = record_routing(runner.model)
    graphs = VerifyGraphs(runner.model, runner.caches, 4, 2, runner.max_num_blocks_per_seq, runner.max_seq_len,
                          runner.block_size, runner.device, mtp_drafts=False)
    assert graphs.sizes[-1] == 4

    class _Replay:
        def __init__(self, bs: int, logits: torch.Tensor) -> None:
            self.bs, self.logits = bs, logits

        def replay(self) -> None:
            self.logits.copy_(graphs._target(self.bs)[1])

    for bs in graphs.sizes:
        logits = torch.empty(bs * graphs.n, runner.model_config.vocab_size)
        graphs.graphs[bs] = _VerifyGraph(_Replay(bs, logits), None, logits, None)  # type: ignore[arg-type]
    runner.verify_graphs = graphs
    assert _run(engine, prompts, GREEDY) == eager
    assert runner.step_counts["verify_graph"] > 0
    padded = [ids for ids in seen if ids.shape[0] == 4 * graphs.n]
    assert padded
    for ids in padded:
        assert bool((ids[:3 * graphs.n] >= 0).all()) and bool((ids[3 * graphs.n:] == -1).all())
