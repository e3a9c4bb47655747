"""vLLM's allowed_token_ids and bad_words (nibble/engine/token_masks.py) and truncate_prompt_tokens, in the
sampler and on the demo model (CPU): only allowed tokens are sampled and greedy takes the best of them (checked
against the raw log-probabilities the request reports), banned words never appear (a multi-token word's prefix
may be generated, its last token is then avoided), with overlapped scheduling and under speculative decoding
(drafts that propose banned tokens are rejected) the outputs equal plain synchronous decoding's."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from nibble.engine.llm import LLM
from nibble.engine.llm_engine import LLMEngine
from nibble.engine.request import Request, TokenLogprobs
from nibble.engine.sampler import sample
from nibble.engine.sampling_params import SamplingParams, SamplingParamsError, truncate_prompt
from nibble.engine.spec_sampler import accept_drafts
from nibble.engine.token_masks import BadWordsError, banned_tokens, tokenize_bad_words
from nibble.engine.tokenizer import Tokenizer
from tests.test_spec_decode import _engine, _Oracle, _run

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=5)
ALLOWED = list(range(0, 1024, 3))


def _prompts(lens: list[int], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 990, (n,), generator=gen).tolist() for n in lens]


def _with(params: SamplingParams, **changes: object) -> SamplingParams:
    return dataclasses.replace(params, **changes)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(device="cpu", max_model_len=256)


def _encoder(tok: Tokenizer):  # type: ignore[no-untyped-def]
    return lambda text: tok.encode(text, add_special_tokens=False)


def _contains(tokens: list[int], seq: list[int]) -> bool:
    return any(tokens[i:i + len(seq)] == seq for i in range(len(tokens) - len(seq) + 1))


def _best_other(entry: TokenLogprobs, banned: set[int]) -> int:
    """The most likely token of a raw distribution's top entries outside `banned`."""
    return max((t for t in entry.top if t not in banned), key=lambda t: entry.top[t])


def test_bad_words_are_tokenized_as_vllm_does() -> None:
    table = {"hello": [1, 2], " hello": [3, 2], "x": [5], " x": [6, 7], "ab": [8, 9], " ab": [8, 9]}
    # " hello": another first token, as many tokens -> kept; " x": more tokens, " ab": the same first token
    assert tokenize_bad_words(["hello", "  x", "ab"], table.__getitem__, 100) == [[1, 2], [3, 2], [5], [8, 9]]
    with pytest.raises(BadWordsError, match="outside the model's vocabulary"):
        tokenize_bad_words(["hello"], table.__getitem__, 3)
    with pytest.raises(BadWordsError, match="at most 1024 tokens"):
        tokenize_bad_words(["w", "v"], lambda text: list(range(600)), 1000)


def test_banned_tokens_follow_the_generated_tokens() -> None:
    words = [[4], [1, 2, 3]]
    assert banned_tokens(words, []) == [4]
    assert banned_tokens(words, [9, 1]) == [4]
    assert banned_tokens(words, [9, 1, 2]) == [4, 3]
    assert banned_tokens(words, [1, 2, 9]) == [4]


def test_sampler_masks_each_row_and_reports_raw_logprobs() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    raw = torch.log_softmax(logits, dim=-1)
    order = logits.argsort(dim=-1, descending=True)
    allowed = [3, 17, 40]
    reqs = [Request("a", [1], SamplingParams(temperature=0.0, allowed_token_ids=allowed, logprobs=0)),
            Request("b", [1], SamplingParams(temperature=0.0), bad_words_ids=[[int(order[1, 0])]]),
            Request("c", [1], SamplingParams(temperature=0.0), bad_words_ids=[[7, int(order[2, 0])]]),
            Request("d", [1], SamplingParams(temperature=0.0), bad_words_ids=[[7, int(order[3, 0])]])]
    reqs[2].output_token_ids = [5, 7]  # the word's prefix was just generated: its last token is banned
    reqs[3].output_token_ids = [7, 5]
    out = sample(logits.clone(), reqs)
    assert out.token_ids[0] == max(allowed, key=lambda t: float(logits[0, t]))
    lp = out.logprobs[0]
    assert lp is not None and lp.logprob == pytest.approx(float(raw[0, out.token_ids[0]]), abs=1e-5)
    assert out.token_ids[1:] == [int(order[1, 1]), int(order[2, 1]), int(order[3, 0])]
    for seed in range(30):  # sampled rows draw from the allowed tokens only
        row = Request("s", [1], SamplingParams(temperature=1.5, seed=seed, allowed_token_ids=[5, 6, 9]))
        row.generator = torch.Generator().manual_seed(seed)
        assert sample(logits[:1].clone(), [row]).token_ids[0] in (5, 6, 9)


def test_acceptance_masks_every_verified_position() -> None:
    """A verify step: drafts outside allowed_token_ids, or completing a bad word after the generated tokens and
    the drafts before them, are rejected, and the new token follows the masked distribution."""
    vocab = 8
    logits = torch.zeros(2, 3, vocab)
    logits[:, :, 1] = 5.0  # the unrestricted arg-max everywhere
    logits[:, :, 2] = 3.0
    reqs = [Request("a", [1], SamplingParams(temperature=0.0, allowed_token_ids=[2, 3])),
            Request("b", [1], SamplingParams(temperature=0.0, logprobs=1), bad_words_ids=[[6, 1, 1]])]
    reqs[1].output_token_ids = [6]
    acc = accept_drafts(logits.clone(), torch.tensor([[1, 2], [1, 1]]), reqs)
    assert acc.num_accepted.tolist() == [0, 1]
    assert acc.tokens[0, 0].item() == 2  # the best allowed token, not the rejected draft
    assert acc.tokens[1, :2].tolist() == [1, 2]  # "6 1" then 1 would end the word: the next best
    assert acc.logprob_parts[0][0, 1].item() == pytest.approx(torch.log_softmax(logits[1, 1], -1)[2].item())
    sampled = [Request("s", [1], SamplingParams(temperature=1.0, allowed_token_ids=[2, 3])) for _ in range(2000)]
    big = logits[:1].expand(2000, 3, vocab).contiguous()
    acc = accept_drafts(big, torch.ones(2000, 2, dtype=torch.int64), sampled, torch.Generator().manual_seed(0))
    assert acc.num_accepted.sum().item() == 0 and set(acc.tokens[:, 0].tolist()) == {2, 3}


def test_greedy_with_allowed_token_ids_takes_the_best_allowed_token(llm: LLM) -> None:
    allowed = set(ALLOWED)
    params = _with(GREEDY, allowed_token_ids=ALLOWED, logprobs=20)
    out = llm.generate(_prompts([9]), params)[0].outputs[0]
    assert out.logprobs is not None and len(out.token_ids) == 16
    redirected = 0
    for token, entry in zip(out.token_ids, out.logprobs):
        assert token in allowed
        # entry.top: the 20 most likely tokens of the unrestricted distribution
        candidates = {t: v for t, v in entry.top.items() if t in allowed}
        assert candidates and entry.logprob == pytest.approx(max(candidates.values()), abs=1e-6)
        redirected += max(entry.top, key=lambda t: entry.top[t]) not in allowed
    assert redirected > 0
    seeded = llm.generate(_prompts([9, 30]), _with(GREEDY, temperature=1.0, seed=5, allowed_token_ids=[7, 70, 700]))
    assert all(t in (7, 70, 700) for o in seeded for t in o.outputs[0].token_ids)


def _word_at(tok: Tokenizer, tokens: list[int], start: int, length: int) -> tuple[str, list[list[int]]] | None:
    """A word whose vLLM tokenization includes tokens[start:start + length], and its token sequences."""
    word = tok.decode(tokens[start:start + length])
    if "\ufffd" in word or not word.strip():
        return None
    seqs = tokenize_bad_words([word], _encoder(tok), 1024)
    return (word, seqs) if tokens[start:start + length] in seqs else None


def test_bad_words_of_one_and_several_tokens(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    prompt = _prompts([5])[0]
    free = llm.generate([prompt], GREEDY)[0].outputs[0]
    tokens, entries = free.token_ids, free.logprobs
    assert entries is not None
    for length in (1, 2):
        word, seqs = next(hit for s in range(len(tokens) - length) if (hit := _word_at(tok, tokens, s, length)))
        # where the free run first completes one of the word's token sequences
        end = next(e for e in range(len(tokens)) if tokens[e] in banned_tokens(seqs, tokens[:e]))
        out = llm.generate([prompt], _with(GREEDY, bad_words=[word]))[0].outputs[0].token_ids
        assert out[:end] == tokens[:end]  # for two tokens this holds the word's first token
        assert length == 1 or any(s[0] == out[end - 1] for s in seqs)
        assert out[end] == _best_other(entries[end], set(banned_tokens(seqs, tokens[:end])))
        assert not any(_contains(out, s) for s in seqs)


def _mixed(llm: LLM) -> tuple[list[list[int]], list[SamplingParams]]:
    """Prompts and params mixing masked and plain requests: per prompt, a multi-token bad word taken from its free
    run (so that it would occur), allowed_token_ids, both, and nothing."""
    tok = llm.get_tokenizer()
    prompts = _prompts([5, 40, 17, 3])
    frees = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    words = [next(h[0] for s in range(len(f) - 2) if (h := _word_at(tok, f, s, 2)) is not None) for f in frees]
    params = [_with(GREEDY, bad_words=[words[0], words[2]]),
              _with(GREEDY, allowed_token_ids=ALLOWED),
              _with(GREEDY, bad_words=[words[2]], allowed_token_ids=ALLOWED, temperature=0.8, seed=3),
              GREEDY]
    return prompts, params


Outputs = list[tuple[list[int], list[float]]]


def overlap_runs(prompts: list[list[int]], params: list[SamplingParams]) -> list[tuple[Outputs, list[int]]]:
    """The prompts generated with overlapped scheduling off, then on: per run each output's (token ids,
    logprobs) and the steps whose sampling waited for the host (`_sample_deferred`); every block is free after."""
    runs = []
    for overlap in (False, True):
        engine = LLM(device="cpu", max_model_len=256, async_scheduling=overlap)
        deferred: list[int] = []
        real = engine.engine._sample_deferred

        def spy(launched, real=real, deferred=deferred):  # type: ignore[no-untyped-def]
            deferred.append(launched.step)
            real(launched)

        engine.engine._sample_deferred = spy  # type: ignore[method-assign]
        outs = engine.generate(prompts, params)
        runs.append(([(o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs or []]) for o in outs],
                     deferred))
        assert engine.engine.blocks.all_free()
    return runs


def test_overlapped_scheduling_defers_bad_words_rows_and_matches_sync(llm: LLM) -> None:
    prompts, params = _mixed(llm)
    (sync, sync_deferred), (overlapped, deferred) = overlap_runs(prompts, params)
    assert not sync_deferred and deferred
    assert sync == overlapped
    tok = llm.get_tokenizer()
    for (tokens, _), sp in zip(overlapped, params):
        seqs = tokenize_bad_words(sp.bad_words or [], _encoder(tok), 1024)
        assert not any(_contains(tokens, s) for s in seqs)
        assert sp.allowed_token_ids is None or set(tokens) <= set(sp.allowed_token_ids)


def test_speculative_decoding_rejects_drafts_the_masks_forbid(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """Oracle drafts from the unrestricted continuation propose the banned and disallowed tokens: the verify
    steps must reject them, and the greedy outputs (and raw log-probs) equal plain decoding's."""
    prompts, params = _mixed(llm)
    greedy = [p for p in params if p.temperature == 0.0]
    prompts = [pr for pr, p in zip(prompts, params) if p.temperature == 0.0]
    plain = _engine()
    free = _run(plain, prompts, GREEDY)
    ref = _run(plain, prompts, greedy)
    assert ref != free
    spec = _engine(num_speculative_tokens=3)
    _Oracle(spec, free, 3, 0.0).install(monkeypatch)
    lps: dict[str, list[float]] = {}
    for i, (p, sp) in enumerate(zip(prompts, greedy)):
        spec.add_request(f"r{i}", p, sp)
    got: dict[str, list[int]] = {}
    while spec.has_unfinished_requests():
        for o in spec.step():
            if o.finished:
                got[o.request_id] = list(o.outputs[0].token_ids)
                lps[o.request_id] = [lp.logprob for lp in o.outputs[0].logprobs or []]
    assert got == ref
    assert spec.stats()["spec_decode_num_accepted_tokens"] > 0
    # drafts of the masked continuation itself are all accepted: masked rows keep speculating
    exact = _engine(num_speculative_tokens=3)
    _Oracle(exact, ref, 3, 0.0).install(monkeypatch)
    assert _run(exact, prompts, greedy) == ref
    stats = exact.stats()
    assert stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"] > 0
    for i, sp in enumerate(greedy):
        plain_lps = [lp.logprob for lp in llm.generate([prompts[i]], sp)[0].outputs[0].logprobs or []]
        assert lps[f"r{i}"] == pytest.approx(plain_lps, abs=1e-4)
    sampled = _run(_engine(num_speculative_tokens=2), _prompts([7, 20]),
                   _with(GREEDY, temperature=1.0, seed=1, allowed_token_ids=[5, 50, 500]))
    assert all(set(t) <= {5, 50, 500} for t in sampled.values())


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm: LLM) -> None:
    prompt = _prompts([40])[0]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    cut = llm.generate([prompt], _with(params, truncate_prompt_tokens=10))[0]
    assert cut.prompt_token_ids == prompt[-10:]
    assert cut.outputs[0].token_ids == llm.generate([prompt[-10:]], params)[0].outputs[0].token_ids
    whole = llm.generate([prompt], _with(params, truncate_prompt_tokens=-1))[0]  # max_model_len: nothing cut
    assert whole.prompt_token_ids == prompt
    tok = llm.get_tokenizer()
    text = tok.decode(prompt)
    ids = tok.encode(text)
    out = llm.generate([text], _with(params, truncate_prompt_tokens=6))[0]
    assert out.prompt_token_ids == ids[-6:] and out.prompt == tok.decode(ids[-6:], skip_special_tokens=False)
    with pytest.raises(SamplingParamsError, match=r"truncate_prompt_tokens must be at most .* \(256\), got 300"):
        llm.engine.add_request("x", prompt, _with(params, truncate_prompt_tokens=300))
    # the image tokens (id 9 here) are all kept, since the request's images stay, or the cut is refused
    assert truncate_prompt([1, 9, 9, 2, 3], 4, 100, vision_token_ids=(9,)) == [9, 9, 2, 3]
    for k in (3, 2):
        with pytest.raises(SamplingParamsError, match="would cut into an image"):
            truncate_prompt([1, 9, 9, 2, 3], k, 100, vision_token_ids=(9,))


@pytest.mark.parametrize(("changes", "match"), [
    ({"allowed_token_ids": []}, "allowed_token_ids must be a non-empty list"),
    ({"allowed_token_ids": [1, -2]}, r"allowed_token_ids must be token ids .* got \[-2\]"),
    ({"bad_words": ["ok", "  "]}, "bad_words entries must not be empty"),
    ({"bad_words": ["w"] * 129}, "bad_words must have at most 128 entries"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens must be an integer >= 1, or -1"),
    ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens must be"),
])
def test_bad_values_are_refused_naming_the_field(changes: dict, match: str) -> None:
    with pytest.raises(SamplingParamsError, match=match):
        SamplingParams(**changes)


def test_engine_checks_the_vocabulary(llm: LLM) -> None:
    engine: LLMEngine = llm.engine
    with pytest.raises(SamplingParamsError, match=r"allowed_token_ids must be in \[0, 1024\), got \[1024\]"):
        engine.add_request("x", [1, 2], SamplingParams(allowed_token_ids=[3, 1024]))
    assert not engine.requests
    assert SamplingParams(bad_words=[]).bad_words is None  # an empty list bans nothing, as in vLLM
