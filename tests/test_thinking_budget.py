"""vLLM's thinking_token_budget (nibble/engine/thinking_budget.py) in the sampler, the verify step and on the demo
model (CPU): after `budget` generated tokens of thinking the next token is `</think>` and the tokens before it are
the free run's; a prompt outside thinking and a `</think>` generated before the budget leave the output as it is;
the outputs are the same with overlapped scheduling (which defers sampling only at the forced step), under
speculative decoding (drafts past the budget rejected), under preemption, and a JSON schema that starts after the
reasoning constrains the answer that follows a forced end."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from nibble.engine.llm import LLM
from nibble.engine.llm_engine import LLMEngine
from nibble.engine.request import Request
from nibble.engine.sampler import sample
from nibble.engine.sampling_params import SamplingParams, SamplingParamsError
from nibble.engine.spec_sampler import accept_drafts
from nibble.engine.structured_output import StructuredOutputsParams
from nibble.engine.thinking_budget import ThinkingBudget, thinking_budget_of
from tests.test_spec_decode import _engine, _Oracle, _run
from tests.test_token_masks import overlap_runs

START, END, NL = 1015, 1016, 198  # the demo tokenizer's <think>, </think> and "\n"
# 1 + 4 * 2 tokens: a prefill and two verify steps of 3 drafts, none of them past max_tokens
GREEDY = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)


def _thinking(n: int, seed: int) -> list[int]:
    """A prompt of n random tokens that leaves the model thinking, as the chat template's `<think>\\n` does."""
    gen = torch.Generator().manual_seed(seed)
    return [*torch.randint(0, 990, (n,), generator=gen).tolist(), START, NL]


def _with(params: SamplingParams, **changes: object) -> SamplingParams:
    return dataclasses.replace(params, **changes)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(device="cpu", max_model_len=256)


def _ids(llm: LLM, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]  # type: ignore[arg-type]


class _FakeTokenizer:
    def __init__(self, ids: dict[str, int]) -> None:
        self.ids = ids

    def token_to_id(self, token: str) -> int | None:
        return self.ids.get(token)


def test_admission_finds_the_thinking_prompts_and_checks_the_field() -> None:
    tok = _FakeTokenizer({"<think>": START, "</think>": END})
    params = SamplingParams(thinking_token_budget=4)
    assert thinking_budget_of(params, tok, [1, START, NL], 1024) == ThinkingBudget(4, END)  # type: ignore[arg-type]
    assert thinking_budget_of(params, tok, [START, 2, END, START], 1024) is not None  # type: ignore[arg-type]
    for outside in ([1, 2], [START, 2, END, 3], [END, 1]):
        assert thinking_budget_of(params, tok, outside, 1024) is None  # type: ignore[arg-type]
    assert thinking_budget_of(SamplingParams(), None, [START], 1024) is None
    for bad in (None, _FakeTokenizer({"</think>": END})):
        with pytest.raises(SamplingParamsError, match=r"^thinking_token_budget needs a tokenizer with <think>"):
            thinking_budget_of(params, bad, [START], 1024)  # type: ignore[arg-type]
    for value in (-1, True, 2.5, "3"):
        with pytest.raises(SamplingParamsError, match=r"^thinking_token_budget must be an integer >= 0"):
            SamplingParams(thinking_token_budget=value)  # type: ignore[arg-type]
    assert ThinkingBudget(2, END).forces([5, 6], 2) and not ThinkingBudget(2, END).forces([END, 6], 2)
    assert not ThinkingBudget(2, END).forces([5, 6, END], 3)  # only the budget's own position is ever forced


def test_sampler_forces_the_end_over_every_other_mask() -> None:
    logits = torch.randn(4, 1024, generator=torch.Generator().manual_seed(0))
    budget = ThinkingBudget(2, END)
    reqs = [Request("greedy", [1], SamplingParams(temperature=0.0, logprobs=0), thinking_budget=budget),
            Request("sampled", [1], SamplingParams(temperature=2.0, allowed_token_ids=[3, 4]),
                    thinking_budget=budget),
            Request("early", [1], SamplingParams(temperature=0.0), thinking_budget=budget),
            Request("before", [1], SamplingParams(temperature=0.0), thinking_budget=budget)]
    for req, out in zip(reqs, ([7, 8], [7, 8], [END, 8], [7])):
        req.output_token_ids = out
    result = sample(logits.clone(), reqs)
    # the end is forced over allowed_token_ids and at any temperature; after a generated end, or before the
    # budget, the row is the free arg-max
    assert result.token_ids == [END, END, int(logits[2].argmax()), int(logits[3].argmax())]
    lp = result.logprobs[0]
    assert lp is not None and lp.logprob == pytest.approx(float(torch.log_softmax(logits[0], -1)[END]), abs=1e-5)


def test_verify_step_forces_the_budget_position() -> None:
    """Position j of a verify step samples output index num_output + j: a draft there other than `</think>` is
    rejected and `</think>` comes instead; an accepted `</think>` leaves the next position free; a `</think>`
    among the drafts before the budget position leaves it free."""
    vocab = 1024
    logits = torch.zeros(3, 3, vocab)
    logits[:, :, 5] = 4.0  # the free arg-max everywhere...
    logits[2, 0, END] = 9.0  # ...but where the last row's model ends its thinking itself
    reqs = [Request(name, [1], SamplingParams(temperature=0.0), thinking_budget=ThinkingBudget(3, END))
            for name in ("rejects", "accepts", "ended")]
    for req in reqs:
        req.output_token_ids = [9, 9]  # the budget position is j = 1
    drafts = torch.tensor([[5, 5], [5, END], [END, 5]])
    acc = accept_drafts(logits.clone(), drafts, reqs)
    assert acc.num_accepted.tolist() == [1, 2, 2]
    assert acc.tokens[0, :2].tolist() == [5, END]
    assert acc.tokens[1].tolist() == [5, END, 5]
    assert acc.tokens[2].tolist() == [END, 5, 5]
    sampled = [Request("s", [1], SamplingParams(temperature=1.0), thinking_budget=ThinkingBudget(0, END))
               for _ in range(200)]
    acc = accept_drafts(logits[:1].expand(200, 3, vocab).contiguous(), torch.full((200, 2), 5), sampled,
                        torch.Generator().manual_seed(0))
    assert acc.num_accepted.sum().item() == 0 and set(acc.tokens[:, 0].tolist()) == {END}


def test_end_follows_the_budgeted_tokens(llm: LLM) -> None:
    prompt = _thinking(6, seed=1)
    free = _ids(llm, [prompt], GREEDY)[0]
    assert END not in free
    for budget in (0, 1, 4):
        out = _ids(llm, [prompt], _with(GREEDY, thinking_token_budget=budget))[0]
        assert out[:budget] == free[:budget] and out[budget] == END and len(out) == 9
        assert END not in out[budget + 1:]  # sampling is free again, and this model does not think twice
    # max_tokens still applies: the forced token counts toward it, a budget past it changes nothing
    assert _ids(llm, [prompt], _with(GREEDY, max_tokens=5, thinking_token_budget=4))[0] == [*free[:4], END]
    assert _ids(llm, [prompt], _with(GREEDY, max_tokens=4, thinking_token_budget=4))[0] == free[:4]
    # a prompt that already left its thinking: nothing forced
    closed = [*prompt, 7, END, NL]
    assert _ids(llm, [closed], _with(GREEDY, thinking_token_budget=1)) == _ids(llm, [closed], GREEDY)
    text = llm.get_tokenizer().decode(prompt, skip_special_tokens=False)
    out = llm.generate([text], _with(GREEDY, thinking_token_budget=3))[0].outputs[0]
    assert out.token_ids[3] == END and "</think>" in out.text


@pytest.fixture(scope="module")
def natural(llm: LLM) -> SamplingParams:
    """Params under which the free run of `_thinking(6, seed=1)` emits `</think>` itself before index 3 and
    something else at it: only tokens A and `</think>` allowed, A chosen among candidates."""
    prompt = _thinking(6, seed=1)
    cands = [_with(GREEDY, max_tokens=4, allowed_token_ids=[a, END]) for a in range(100, 116)]
    for params, out in zip(cands, _ids(llm, [prompt] * len(cands), cands)):
        if END in out[1:3] and out[0] != END and out[3] != END:
            return _with(params, max_tokens=GREEDY.max_tokens)
    raise AssertionError("no candidate ends its thinking before the budget")


def _mixed(natural: SamplingParams) -> tuple[list[list[int]], list[SamplingParams]]:
    """Budgets 0, 3 and 6, none, a prompt outside thinking, and a `</think>` generated before the budget."""
    prompts = [_thinking(n, seed) for seed, n in enumerate((5, 17, 9, 30, 12))]
    prompts[4] = prompts[4] + [3, END, NL]
    params = [_with(GREEDY, thinking_token_budget=0), _with(GREEDY, thinking_token_budget=3),
              _with(GREEDY, thinking_token_budget=6, logprobs=2), GREEDY, _with(GREEDY, thinking_token_budget=2)]
    return [*prompts, _thinking(6, seed=1)], [*params, _with(natural, thinking_token_budget=3)]


def test_natural_end_before_the_budget_forces_nothing(llm: LLM, natural: SamplingParams) -> None:
    params = natural
    prompt = _thinking(6, seed=1)
    assert _ids(llm, [prompt], _with(params, thinking_token_budget=3)) == _ids(llm, [prompt], params)


def test_overlapped_scheduling_defers_only_the_forced_step(natural: SamplingParams) -> None:
    prompts, params = _mixed(natural)
    params.append(_with(GREEDY, temperature=0.8, seed=5, thinking_token_budget=4))
    prompts.append(_thinking(8, seed=9))
    (sync, sync_deferred), (overlapped, deferred) = overlap_runs(prompts, params)
    # at most the steps sampling index 3, 4 or 6 (budget 0 is sampled by the prefill, 2 is outside thinking)
    assert not sync_deferred and 0 < len(deferred) <= 3
    assert sync == overlapped
    for (tokens, _), sp, prompt in zip(overlapped, params, prompts):
        budget = sp.thinking_token_budget
        if budget is not None and prompt[-1] == NL and prompt[-2] == START and not sp.allowed_token_ids:
            assert tokens[budget] == END and END not in tokens[:budget]


def test_speculative_decoding_rejects_drafts_past_the_budget(natural: SamplingParams,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Oracle drafts of the free continuations propose thinking tokens at the budget position: they are rejected
    and the greedy outputs (and raw log-probs) equal plain decoding's; drafts of the budgeted continuations are all
    accepted, `</think>` among them."""
    prompts, params = _mixed(natural)
    plain = _engine()
    free = _run(plain, prompts, [_with(p, thinking_token_budget=None) for p in params])
    ref = _run(plain, prompts, params)
    assert ref != free
    for refs in (free, ref):
        spec = _engine(num_speculative_tokens=3)
        _Oracle(spec, refs, 3, 0.0).install(monkeypatch)
        assert _run(spec, prompts, params) == ref
        stats = spec.stats()
        accepted, drafted = stats["spec_decode_num_accepted_tokens"], stats["spec_decode_num_draft_tokens"]
        assert (accepted == drafted) if refs is ref else (0 < accepted < drafted)
    assert _run(_engine(num_speculative_tokens=2), prompts, params) == ref  # the head's own drafts
    sampled = _run(_engine(num_speculative_tokens=2), prompts[:2],
                   _with(GREEDY, temperature=1.0, seed=2, thinking_token_budget=3))
    assert all(t[3] == END and END not in t[:3] for t in sampled.values())


def test_preemption_keeps_the_budget() -> None:
    """Blocks for two of the three requests: one is preempted before its budget and recomputed later."""
    gen = torch.Generator().manual_seed(7)
    prompts = [[*torch.randint(0, 990, (60,), generator=gen).tolist(), START, NL] for _ in range(3)]
    params = [_with(GREEDY, max_tokens=24, thinking_token_budget=b) for b in (3, 12, 20)]
    ref = _run(_engine(), prompts, params)
    assert all(ref[f"r{i}"][p.thinking_token_budget] == END for i, p in enumerate(params))  # type: ignore[index]
    tight = _engine(enable_prefix_caching=False, extra={"num_kv_blocks": 13})
    assert _run(tight, prompts, params) == ref
    assert tight.num_preemptions > 0 and tight.blocks.all_free()


def test_json_schema_answer_after_a_forced_end(monkeypatch: pytest.MonkeyPatch) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    params = _with(GREEDY, max_tokens=24, ignore_eos=False, thinking_token_budget=3,
                   structured_outputs=StructuredOutputsParams(json=schema, start_token_id=END))
    prompts = [_thinking(7, seed=3), _thinking(11, seed=4)]
    outs: list[dict[str, list[int]]] = []
    for engine in (_engine(), _engine(num_speculative_tokens=2)):
        engine.add_request("r", prompts[0], params)
        engine.add_request("t", prompts[1], _with(params, temperature=1.0, seed=1))
        done = {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    assert o.outputs[0].finish_reason == "stop", o
                    done[o.request_id] = o.outputs[0]
        for out in done.values():
            assert out.token_ids[3] == END
            assert json.loads(out.text.split("</think>", 1)[1]).keys() == {"ok"}
        outs.append({k: v.token_ids for k, v in done.items()})
    assert outs[0]["r"] == outs[1]["r"]


def test_engine_refuses_a_budget_without_think_tokens(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    engine: LLMEngine = llm.engine
    monkeypatch.setattr(engine, "tokenizer", None)
    with pytest.raises(SamplingParamsError, match=r"^thinking_token_budget needs a tokenizer"):
        engine.add_request("x", [1, START, NL], SamplingParams(thinking_token_budget=2))
    assert not engine.requests
