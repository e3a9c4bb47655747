"""Speculative decoding with the MTP head (nibble/engine/spec_decode.py, spec_sampler.py) on the demo model
(CPU). Greedy outputs must equal the same engine's outputs without speculation, whatever the drafts: the
head's own (random weights, so nearly all rejected) and oracle drafts (the reference continuation, partly
corrupted) that make the engine accept 0..k drafts per step, exercising the GDN state snapshots, the KV
positions and the stop conditions inside accepted runs. The acceptance rule itself is checked against the
distribution it must reproduce."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from nibble.engine.config import EngineConfig, EngineConfigError, parse_speculative_config
from nibble.engine.llm_engine import LLMEngine
from nibble.engine.request import Request
from nibble.engine.sampling_params import SamplingParams
from nibble.engine.spec_sampler import accept_drafts
from nibble.server.launch import add_cli_args, engine_config_kwargs

GREEDY = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)


def _engine(max_model_len: int = 512, **kwargs: object) -> LLMEngine:
    return LLMEngine(EngineConfig(model="demo", device="cpu", max_model_len=max_model_len, **kwargs))  # type: ignore[arg-type]


def _prompts(num: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 1000, (int(n),), generator=gen).tolist()
            for n in torch.randint(5, 40, (num,), generator=gen)]


def _run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
         first: int = 0) -> dict[str, list[int]]:
    plist = params if isinstance(params, list) else [params] * len(prompts)
    for i, (p, sp) in enumerate(zip(prompts, plist)):
        engine.add_request(f"r{first + i}", p, sp)
    out: dict[str, list[int]] = {}
    steps = 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                out[o.request_id] = list(o.outputs[0].token_ids)
        steps += 1
        assert steps < 2000
    return out


@pytest.fixture(scope="module")
def plain() -> LLMEngine:
    return _engine()


class _Oracle:
    """Replaces each verify step's drafts with the reference continuation of the request, each draft
    corrupted with probability `noise` (the head still runs and writes its KV as usual)."""

    def __init__(self, engine: LLMEngine, refs: dict[str, list[int]], k: int, noise: float) -> None:
        self.engine, self.refs, self.k, self.noise = engine, refs, k, noise
        self.gen = torch.Generator().manual_seed(5)
        self.real = engine.runner.execute_spec

    def execute_spec(self, sched, *args):  # type: ignore[no-untyped-def]
        if sched.spec_verify:
            for req in sched.requests:
                if req.request_id not in self.refs:
                    continue  # no reference: the head's own drafts
                ref = req.prompt_token_ids + self.refs[req.request_id]
                start = req.num_computed_tokens + 1
                row = [ref[p] if p < len(ref) else 0 for p in range(start, start + self.k)]
                req.draft_token_ids = [(t + 1) % 1000 if torch.rand((), generator=self.gen) < self.noise else t
                                       for t in row]
        return self.real(sched, *args)

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(self.engine.runner, "execute_spec", self.execute_spec)


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_output_equals_plain_decoding_with_the_heads_own_drafts(plain: LLMEngine, k: int) -> None:
    prompts = _prompts(4, seed=k)
    ref = _run(plain, prompts, GREEDY)
    spec = _engine(num_speculative_tokens=k)
    assert _run(spec, prompts, GREEDY) == ref
    stats = spec.stats()
    assert stats["spec_decode_num_draft_tokens"] > 0
    assert stats["spec_decode_num_accepted_tokens"] <= stats["spec_decode_num_draft_tokens"]
    assert spec.blocks.all_free()


@pytest.mark.parametrize(("k", "noise"), [(2, 0.0), (2, 0.3), (4, 0.25)])
def test_accepted_drafts_leave_the_same_state_as_plain_decoding(plain: LLMEngine, monkeypatch: pytest.MonkeyPatch,
                                                                k: int, noise: float) -> None:
    prompts = _prompts(3, seed=10 + k)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    ref = _run(plain, prompts, params)
    spec = _engine(num_speculative_tokens=k)
    _Oracle(spec, ref, k, noise).install(monkeypatch)
    assert _run(spec, prompts, params) == ref
    stats = spec.stats()
    accepted, drafted = stats["spec_decode_num_accepted_tokens"], stats["spec_decode_num_draft_tokens"]
    if noise == 0.0:
        assert accepted == drafted  # every oracle draft is right: k + 1 tokens per verify step
    assert 0 < accepted < drafted or noise == 0.0
    assert spec.num_steps < plain.num_steps


def test_stops_inside_an_accepted_run_and_features_that_take_one_token(plain: LLMEngine,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    prompts = _prompts(4, seed=3)
    free = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    base = _run(plain, prompts, free)
    stop_tok = base["r0"][7]
    params = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop_token_ids=[stop_tok]),
              SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, repetition_penalty=1.3),
              SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=2)]
    ref = _run(plain, prompts, params)
    assert len(ref["r0"]) < 20 and len(ref["r1"]) == 9
    spec = _engine(num_speculative_tokens=3)
    _Oracle(spec, base, 3, 0.0).install(monkeypatch)
    assert _run(spec, prompts, params) == ref
    assert spec.blocks.all_free()


def _shared_prompts(shared_len: int = 150) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    shared = torch.randint(0, 1000, (shared_len,), generator=gen).tolist()
    return [shared + torch.randint(0, 1000, (30,), generator=gen).tolist() for _ in range(3)]


def test_preemption_keeps_outputs(plain: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    prompts = _shared_prompts()
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    ref = _run(plain, prompts, params)
    tight = _engine(num_speculative_tokens=2, max_num_batched_tokens=64, enable_prefix_caching=False,
                    extra={"num_kv_blocks": 26})
    _Oracle(tight, ref, 2, 0.2).install(monkeypatch)
    assert _run(tight, prompts, params) == ref
    assert tight.num_preemptions > 0
    assert tight.blocks.all_free()


def test_prefix_cache_hits_keep_outputs(plain: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    prompts = _shared_prompts(300)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    ref = _run(plain, prompts, params)
    cached = _engine(num_speculative_tokens=2)
    _Oracle(cached, ref, 2, 0.2).install(monkeypatch)
    out: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):  # one after the other: the later ones start from the cached prefix
        out.update(_run(cached, [p], params, first=i))
    assert out == ref
    assert cached.stats()["prefix_cache_hits"] > 0
    assert cached.blocks.all_free()


def test_seeded_sampling_runs_and_respects_limits() -> None:
    spec = _engine(num_speculative_tokens=2)
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, max_tokens=12, seed=3, ignore_eos=True)
    first = _run(spec, _prompts(2, seed=4), params)
    second = _run(spec, _prompts(2, seed=4), params)
    assert first == second and all(len(t) == 12 for t in first.values())


def test_acceptance_reproduces_the_target_distribution() -> None:
    torch.manual_seed(0)
    vocab, num = 6, 40000
    target = torch.log(torch.tensor([[0.35, 0.25, 0.2, 0.1, 0.05, 0.05], [0.1, 0.1, 0.5, 0.1, 0.1, 0.1]]))
    logits = target[None].expand(num, 2, vocab).contiguous()
    drafts = torch.full((num, 1), 1, dtype=torch.int64)
    reqs = [Request("x", [1], SamplingParams(temperature=1.0)) for _ in range(num)]
    gen = torch.Generator().manual_seed(1)
    acc = accept_drafts(logits.clone(), drafts, reqs, gen)
    first = acc.tokens[:, 0]
    freq = torch.bincount(first, minlength=vocab).float() / num
    assert torch.allclose(freq, target[0].exp(), atol=0.01)
    accepted = acc.num_accepted == 1
    assert abs(accepted.float().mean().item() - 0.25) < 0.01  # p(draft) under the target
    second = torch.bincount(acc.tokens[accepted, 1], minlength=vocab).float() / accepted.sum()
    assert torch.allclose(second, target[1].exp(), atol=0.02)
    greedy = [Request("g", [1], SamplingParams(temperature=0.0)) for _ in range(3)]
    g_logits = torch.zeros(3, 3, vocab)
    g_logits[:, 0, 2] = g_logits[:, 1, 4] = g_logits[:, 2, 0] = 5.0
    g = accept_drafts(g_logits, torch.tensor([[2, 4], [2, 1], [3, 4]]), greedy)
    assert g.num_accepted.tolist() == [2, 1, 0]
    assert g.tokens.tolist() == [[2, 4, 0], [2, 4, 4], [2, 2, 2]]  # padding repeats the new token


def test_configuration_errors() -> None:
    assert parse_speculative_config('{"method": "qwen3_next_mtp", "num_speculative_tokens": 3}') == {
        "speculative_method": "mtp", "num_speculative_tokens": 3}
    for bad in ("{", "[]", '{"method": "eagle"}', '{"num_speculative_tokens": "2"}', '{"model": "x"}'):
        with pytest.raises(EngineConfigError):
            parse_speculative_config(bad)
    EngineConfig(model="demo", num_speculative_tokens=2, tensor_parallel_size=2)  # tests/parallel run it
    with pytest.raises(EngineConfigError, match="num-speculative-tokens"):
        EngineConfig(model="demo", num_speculative_tokens=9)
    args = add_cli_args(argparse.ArgumentParser()).parse_args(
        ["--speculative-config", json.dumps({"method": "mtp", "num_speculative_tokens": 2})])
    assert engine_config_kwargs(args)["num_speculative_tokens"] == 2


def test_warm_up_under_speculation_leaves_no_trace() -> None:
    spec = _engine(num_speculative_tokens=2, max_model_len=128, max_num_batched_tokens=64, max_num_seqs=8)
    assert spec.warm_up() > 0
    assert spec.blocks.all_free() and not spec.requests
    stats = spec.stats()
    assert stats["num_steps"] == 0 and stats["spec_decode_num_draft_tokens"] == 0
    out = _run(spec, _prompts(2, seed=9), GREEDY)
    assert all(len(t) == GREEDY.max_tokens for t in out.values())


def test_min_p_rows_are_renormalised_before_acceptance() -> None:
    vocab, num = 6, 40000
    probs = torch.tensor([0.35, 0.25, 0.2, 0.1, 0.05, 0.05])
    logits = torch.log(probs)[None, None].expand(num, 2, vocab).contiguous()
    reqs = [Request("x", [1], SamplingParams(temperature=1.0, min_p=0.5)) for _ in range(num)]
    acc = accept_drafts(logits, torch.full((num, 1), 1, dtype=torch.int64), reqs, torch.Generator().manual_seed(2))
    freq = torch.bincount(acc.tokens[:, 0], minlength=vocab).float() / num
    kept = torch.where(probs >= 0.5 * probs.max(), probs, 0.0)
    assert torch.allclose(freq, kept / kept.sum(), atol=0.01)


def test_a_request_stopping_inside_an_accepted_run_leaves_its_cache_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(11)
    prompt = torch.randint(0, 1000, (300,), generator=gen).tolist()
    free = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    plain = _engine()
    base = _run(plain, [prompt], free)
    stop = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop_token_ids=[base["r0"][5]])
    plain.blocks.clear_prefix_cache()
    ref = _run(plain, [prompt], stop)
    spec = _engine(num_speculative_tokens=3)
    _Oracle(spec, base, 3, 0.0).install(monkeypatch)
    assert _run(spec, [prompt], stop) == ref

    def entries(engine: LLMEngine) -> list[int]:
        assert engine.blocks.prefix is not None
        return sorted(e.num_tokens for e in engine.blocks.prefix.entries.values())

    # everything before the stop token (plain decoding, with the step after it already queued, has one more)
    assert len(ref["r0"]) == 6 and entries(spec) == [len(prompt) + 5] and entries(plain) == [len(prompt) + 6]
    assert spec.blocks.all_free()


def test_a_non_finite_logit_only_fails_the_row_whose_token_it_gives() -> None:
    logits = torch.zeros(2, 3, 5)
    logits[:, :, 1] = 4.0
    logits[0, 2, 0] = float("nan")  # after the rejected draft: never used
    logits[1, 1, 3] = float("inf")  # the position the new token comes from
    greedy = [Request("g", [1], SamplingParams(temperature=0.0)) for _ in range(2)]
    acc = accept_drafts(logits, torch.tensor([[1, 2], [1, 1]]), greedy)
    assert acc.num_accepted.tolist() == [1, 1] and acc.bad.tolist() == [False, True]
    assert acc.tokens[0, :2].tolist() == [1, 1]


def test_mixed_traffic_with_aborts_matches_plain(plain: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Requests of assorted lengths arriving while others decode (verify and prefill steps alternating), one
    aborted mid-run: every greedy output equals plain decoding's and nothing is left allocated."""
    prompts = _prompts(6, seed=21)
    params = [SamplingParams(temperature=0.0, max_tokens=6 + 5 * i, ignore_eos=True) for i in range(6)]
    ref = _run(plain, prompts, params)
    spec = _engine(num_speculative_tokens=3, max_num_batched_tokens=48)
    _Oracle(spec, ref, 3, 0.35).install(monkeypatch)
    out: dict[str, list[int]] = {}
    for i in range(3):
        spec.add_request(f"r{i}", prompts[i], params[i])
    spec.add_request("gone", prompts[0], params[5])
    steps = 0
    while spec.has_unfinished_requests():
        steps += 1
        if steps == 3:
            for i in range(3, 6):
                spec.add_request(f"r{i}", prompts[i], params[i])
        gone = spec.requests.get("gone")
        if gone is not None and gone.num_output_tokens >= 3:  # aborted while decoding
            aborted = spec.abort_request("gone")
            assert aborted is not None and aborted.finished
        for o in spec.step():
            if o.finished and o.request_id != "gone":
                out[o.request_id] = list(o.outputs[0].token_ids)
    assert out == ref and "gone" not in spec.requests
    assert spec.blocks.all_free()


def test_logprobs_of_accepted_tokens_match_plain_decoding(plain: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    prompts = _prompts(2, seed=31)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)

    def run(engine: LLMEngine) -> dict[str, list]:
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, params)
        out: dict[str, list] = {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    out[o.request_id] = list(o.outputs[0].logprobs or [])
        return out

    ref = run(plain)
    spec = _engine(num_speculative_tokens=3)
    _Oracle(spec, {k: [lp.token_id for lp in v] for k, v in ref.items()}, 3, 0.0).install(monkeypatch)
    got = run(spec)
    assert spec.stats()["spec_decode_num_accepted_tokens"] > 0  # log-prob rows accept drafts
    for rid, lps in ref.items():
        assert [lp.token_id for lp in got[rid]] == [lp.token_id for lp in lps]
        for a, b in zip(got[rid], lps):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert a.top.keys() == b.top.keys() and len(a.top) == 3
            assert all(a.top[t] == pytest.approx(b.top[t], abs=1e-4) for t in a.top)
