"""Overlapped scheduling on the GPU (run through the device tool with NIBBLE_TEST_GPU=1): the demo model with
CUDA graphs gives the same tokens with and without it, the overlapped decode steps make no host sync (the
next step is queued while the one before runs), and most steps really overlap."""

from __future__ import annotations

import os

import pytest
import torch

from nibble.engine.llm import LLM
from nibble.engine.sampling_params import SamplingParams
from nibble.engine.structured_output import StructuredOutputsParams

pytestmark = pytest.mark.skipif(os.environ.get("NIBBLE_TEST_GPU") != "1" or not torch.cuda.is_available(),
                                reason="GPU test (NIBBLE_TEST_GPU=1 on a CUDA machine)")


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, 990, (n,), generator=gen).tolist() for n in (5, 40, 17, 3, 64, 29, 9, 120)]


def _generate(overlap: bool, params: list[SamplingParams]) -> tuple[list[list[int]], int, LLM]:
    llm = LLM(device="cuda", max_model_len=512, async_scheduling=overlap, extra={"num_kv_blocks": 512})
    runner = llm.engine.runner
    execute = runner.execute
    overlapped = []

    def spy(sched, inflight_tokens=None):
        overlapped.append(inflight_tokens is not None)
        return execute(sched, inflight_tokens)

    runner.execute = spy  # type: ignore[method-assign]
    outs = llm.generate(_prompts(), params)
    assert llm.engine.blocks.all_free()
    return [o.outputs[0].token_ids for o in outs], sum(overlapped), llm


def test_overlapped_scheduling_matches_sync_on_gpu() -> None:
    params = [SamplingParams(temperature=0.0, max_tokens=8 + 4 * i, ignore_eos=True) for i in range(4)]
    params += [SamplingParams(temperature=0.7, top_p=0.9, seed=11 + i, max_tokens=20, ignore_eos=True)
               for i in range(4)]
    sync, n_sync, llm = _generate(False, params)
    assert llm.engine.runner.graphs is not None
    del llm
    over, n_over, _ = _generate(True, params)
    assert n_sync == 0 and n_over > 10
    assert over == sync


def test_overlapped_decode_steps_do_not_sync() -> None:
    llm = LLM(device="cuda", max_model_len=512, extra={"num_kv_blocks": 512})
    engine = llm.engine
    for i, p in enumerate(_prompts()):
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    for _ in range(4):  # prefill, then decode steps with the graphs
        engine.step()
    assert engine._inflight is not None
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(10):
            outs = engine.step()
            assert len(outs) == 8
    finally:
        torch.cuda.set_sync_debug_mode(0)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.blocks.all_free()


def test_deferred_sampling_steps_do_not_sync() -> None:
    """With penalties and a grammar in the batch the next step's forward pass is still queued ahead (its
    sampling deferred until the step before is handled), and nothing in that makes the host wait for the
    GPU: penalty ids and bitmasks go through pinned memory."""
    llm = LLM(device="cuda", max_model_len=512, extra={"num_kv_blocks": 512})
    engine = llm.engine
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, repetition_penalty=1.2),
              SamplingParams(temperature=0.8, seed=1, max_tokens=40, ignore_eos=True, frequency_penalty=0.5),
              SamplingParams(temperature=0.0, max_tokens=40,
                             structured_outputs=StructuredOutputsParams(regex="[a-z ]{200}"))]
    params += [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)] * 5
    for i, (p, sp) in enumerate(zip(_prompts(), params)):
        engine.add_request(f"r{i}", p, sp)
    for _ in range(4):
        engine.step()
    assert engine._inflight is not None
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(10):
            assert len(engine.step()) == 8
    finally:
        torch.cuda.set_sync_debug_mode(0)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.blocks.all_free()


def test_no_kernel_compiles_after_the_warm_up() -> None:
    """After the start-up warm-up, bursts of prompts of any lengths (varlen prefill, chunks continuing on a
    cached prefix, mixed and decode steps, new batch sizes) compile no Triton kernel: each would cost a
    request 0.1-1 s on arrival."""
    import triton

    llm = LLM(device="cuda", max_model_len=1024, max_num_batched_tokens=256, extra={"num_kv_blocks": 1024})
    compiled: list[str] = []

    def hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled) -> bool:
        compiled.append(fn.name)
        return False

    previous = triton.knobs.runtime.jit_cache_hook
    triton.knobs.runtime.jit_cache_hook = hook
    try:
        gen = torch.Generator().manual_seed(5)
        for n in (3, 17, 40):
            lens = torch.randint(1, 700, (n,), generator=gen).tolist()
            prompts = [torch.randint(0, 990, (m,), generator=gen).tolist() for m in lens]
            llm.generate(prompts, SamplingParams(temperature=0.8, top_p=0.9, max_tokens=12, ignore_eos=True))
    finally:
        triton.knobs.runtime.jit_cache_hook = previous
    assert compiled == []


def test_logit_bias_and_choices_under_overlap() -> None:
    """logit_bias on the device (greedy and sampled rows, with overlapped decode steps) and seeded choices
    as separate requests: forced tokens come out, banned ones do not."""
    llm = LLM(device="cuda", max_model_len=512, extra={"num_kv_blocks": 256}, warmup=False)
    prompts = _prompts()[:4]
    params = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logit_bias={42: 100.0}),
              SamplingParams(temperature=0.9, seed=1, max_tokens=16, ignore_eos=True, logit_bias={7: 100.0}),
              SamplingParams(temperature=0.9, seed=2, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)]
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert outs[0] == [42] * 16 and outs[1] == [7] * 16
    banned = set(outs[3])
    again = llm.generate([prompts[3]], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True,
                                                      logit_bias={t: -100.0 for t in banned}))
    assert not banned & set(again[0].outputs[0].token_ids)


def test_structured_outputs_under_cuda_graphs() -> None:
    """Constrained requests (JSON schema, regex, choice) beside free ones on the GPU, decode steps replayed
    from CUDA graphs: every constrained output follows its constraint, and the free requests get the same
    tokens as in a run without the constrained ones."""
    import json
    import re

    from nibble.engine.structured_output import StructuredOutputsParams

    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"},
                                               "w": {"type": "string", "maxLength": 8}},
              "required": ["n", "ok", "w"], "additionalProperties": False}
    llm = LLM(device="cuda", max_model_len=512, extra={"num_kv_blocks": 256}, warmup=False)
    prompts = _prompts()
    free = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    params = [free, SamplingParams(temperature=0.8, seed=1, max_tokens=80,
                                   structured_outputs=StructuredOutputsParams(json=schema)),
              free, SamplingParams(temperature=0.0, max_tokens=20,
                                   structured_outputs=StructuredOutputsParams(regex="[a-z]{3}-[0-9]{4}")),
              free, SamplingParams(temperature=1.0, seed=2, max_tokens=20,
                                   structured_outputs=StructuredOutputsParams(choice=["alpha", "beta", "gamma"])),
              free, free]
    outs = [o.outputs[0] for o in llm.generate(prompts, params)]
    value = json.loads(outs[1].text)
    assert set(value) == {"n", "ok", "w"} and isinstance(value["ok"], bool) and len(value["w"]) <= 8
    assert re.fullmatch("[a-z]{3}-[0-9]{4}", outs[3].text)
    assert outs[5].text in ("alpha", "beta", "gamma")
    free_rows = [0, 2, 4, 6, 7]
    alone = llm.generate([prompts[i] for i in free_rows], free)
    assert [outs[i].token_ids for i in free_rows] == [a.outputs[0].token_ids for a in alone]


def test_prefix_cache_hits_match_full_prefill_on_gpu() -> None:
    """Requests starting from a cached prefix (state copied from the cache, fla's chunked prefill continuing on
    it, attention reading the shared blocks) give the tokens of the same prompts computed in full."""
    gen = torch.Generator().manual_seed(3)
    system = torch.randint(0, 990, (300,), generator=gen).tolist()
    prompts = [system + torch.randint(0, 990, (n,), generator=gen).tolist() for n in (7, 30, 1, 90, 12)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=1)
    plain = LLM(device="cuda", max_model_len=512, enable_prefix_caching=False, extra={"num_kv_blocks": 256})
    full = plain.generate(prompts, params)
    del plain
    llm = LLM(device="cuda", max_model_len=512, extra={"num_kv_blocks": 256})
    outs = [llm.generate([p], params)[0] for p in prompts[:2]] + llm.generate(prompts[2:], params)
    assert [o.num_cached_tokens for o in outs] == [0, 0, 288, 288, 288]
    for a, b in zip(full, outs):
        ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
        assert ta[:8] == tb[:8]
        la = [t.logprob for t in a.outputs[0].logprobs or []][:8]
        lb = [t.logprob for t in b.outputs[0].logprobs or []][:8]
        assert la == pytest.approx(lb, abs=0.05)
    assert llm.engine.blocks.all_free()


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_next_turn_continues_from_the_ended_request_on_gpu(kv_cache_dtype: str) -> None:
    """An ended request's entry (prompt and output, ending inside a block): the next turn gets its state and a
    copy of its partial block's K/V (a byte copy, FP8 caches too) and gives the tokens of the full prefill."""
    gen = torch.Generator().manual_seed(4)
    prompt = torch.randint(0, 990, (300,), generator=gen).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=1)
    args = {"device": "cuda", "max_model_len": 512, "kv_cache_dtype": kv_cache_dtype, "extra": {"num_kv_blocks": 256}}
    llm = LLM(**args)
    first = llm.generate([prompt], params)[0]
    turn = prompt + first.outputs[0].token_ids + [11, 12, 13]
    hit = llm.generate([turn], params)[0]
    assert hit.num_cached_tokens == len(turn) - 4
    del llm
    full = LLM(enable_prefix_caching=False, **args).generate([turn], params)[0]
    assert hit.outputs[0].token_ids[:8] == full.outputs[0].token_ids[:8]
    la = [t.logprob for t in hit.outputs[0].logprobs or []][:8]
    lb = [t.logprob for t in full.outputs[0].logprobs or []][:8]
    assert la == pytest.approx(lb, abs=0.05)


def _mixed_run(max_mixed_tokens: int, dtype: str) -> tuple[dict[str, list[int]], int, LLM]:
    """Greedy outputs of requests that arrive while others decode, prompts chunked by a 96-token budget, and
    the number of steps run from a mixed-step graph."""
    llm = LLM(device="cuda", dtype=dtype, max_model_len=512, max_num_batched_tokens=96,
              cuda_graph_max_mixed_tokens=max_mixed_tokens, warmup=False, extra={"num_kv_blocks": 512})
    engine = llm.engine
    graphs = engine.runner.mixed_graphs
    used = []
    if graphs is not None:
        run = graphs.run

        def spy(size, num_seqs):
            used.append(size)
            return run(size, num_seqs)

        graphs.run = spy  # type: ignore[method-assign]
    gen = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, 990, (n,), generator=gen).tolist() for n in (5, 40, 17, 3, 150, 29, 9, 77, 200, 1)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    out: dict[str, list[int]] = {}
    for i, p in enumerate(prompts[:4]):
        engine.add_request(f"r{i}", p, params)
    steps = 0
    while engine.has_unfinished_requests():
        if steps in (3, 6):
            for i in range(4 + 3 * (steps == 6), 7 + 3 * (steps == 6)):
                engine.add_request(f"r{i}", prompts[i], params)
        for o in engine.step():
            if o.finished:
                out[o.request_id] = list(o.outputs[0].token_ids)
        steps += 1
    assert engine.blocks.all_free()
    return out, len(used), llm


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mixed_step_graphs_match_eager_steps(dtype: str) -> None:
    """Short prefills, chunked prompts and mixed prefill+decode steps replayed from CUDA graphs (padded to a
    captured size) give the tokens of the same steps run eagerly; in bf16 at least most of them (the padded
    step may take other MoE tiles, and the demo model's near-ties then flip)."""
    eager, n_eager, llm = _mixed_run(0, dtype)
    assert n_eager == 0 and llm.engine.runner.mixed_graphs is None
    del llm
    graph, n_graph, llm = _mixed_run(512, dtype)
    assert llm.engine.runner.mixed_graphs is not None and n_graph > 5
    if dtype == "float32":
        assert graph == eager
    else:
        same = sum(graph[k][:4] == eager[k][:4] for k in eager)
        assert same >= len(eager) - 2, (graph, eager)


def test_mixed_step_graph_logits_match_eager() -> None:
    """One mixed step (a prefill chunk continuing on cached context next to decoding sequences) from its graph
    against the same step run eagerly from the same caches: the sampled rows' logits and the caches agree."""
    from nibble.engine.step_inputs import StepInputs

    llm = LLM(device="cuda", dtype="float32", max_model_len=512, warmup=False, extra={"num_kv_blocks": 256})
    runner = llm.engine.runner
    graphs = runner.mixed_graphs
    assert graphs is not None
    gen = torch.Generator(device="cuda").manual_seed(1)
    for c in runner.caches.kv:
        if c is not None:
            c.k.normal_(generator=gen)
            c.v.normal_(generator=gen)
    for s in runner.caches.gdn:
        if s is not None:
            s.conv.normal_(generator=gen)
            s.ssm.normal_(generator=gen).mul_(0.1)
    lens = [(40, 37), (7, 1), (100, 1), (0, 12)]
    tokens, tables, nxt = [], [], 1
    for ctx, n in lens:
        tokens.append(torch.randint(0, 990, (n,)).tolist())
        need = -(-(ctx + n) // llm.engine.config.block_size)
        tables.append(list(range(nxt, nxt + need)))
        nxt += need
    step = StepInputs(token_ids=tokens, context_lens=[c for c, _ in lens], block_tables=tables,
                      state_slots=[1, 2, 3, 4], new_state_slots=[], sample_rows=[0, 1, 3])
    live = [t for c in runner.caches.kv if c is not None for t in (c.k, c.v)] + \
        [t for s in runner.caches.gdn if s is not None for t in (s.conv, s.ssm)]
    saved = [t.clone() for t in live]
    with_graph = runner.run(step)
    after_graph = [t.clone() for t in live]
    for t, s in zip(live, saved):
        t.copy_(s)
    runner.mixed_graphs = None
    eager = runner.run(step)
    torch.testing.assert_close(with_graph, eager, rtol=1e-4, atol=1e-4)
    num_slots = next(s for s in runner.caches.gdn if s is not None).conv.shape[0]
    for got, want in zip(after_graph, live):
        if got.shape[0] == num_slots:
            got, want = got[1:], want[1:]  # slot 0: the scratch slot of padded sequences
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_prompt_logprobs_on_gpu() -> None:
    """Prompt log-probabilities on the GPU (their steps run eagerly, beside graph-replayed ones): a generated
    token's log-probability equals its prompt log-probability when the prompt continues with it."""
    llm = LLM(device="cuda", dtype="float32", max_model_len=512, max_num_batched_tokens=64, warmup=False,
              extra={"num_kv_blocks": 256})
    prompt = _prompts()[4]
    first = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2))[0]
    generated = first.outputs[0].token_ids
    second = llm.generate([prompt + generated], SamplingParams(max_tokens=1, prompt_logprobs=2))[0]
    entries = second.prompt_logprobs
    assert entries is not None and entries[0] is None and len(entries) == len(prompt) + len(generated)
    for j, lp in enumerate(first.outputs[0].logprobs or []):
        entry = entries[len(prompt) + j]
        assert entry is not None and entry.token_id == lp.token_id
        assert abs(entry.logprob - lp.logprob) < 1e-3
    stats = llm.engine.stats()
    assert stats["model_steps_eager"] > 0 and stats["model_steps_decode_graph"] > 0


@pytest.mark.parametrize("num_spec", [0, 2])
def test_token_masks_on_gpu(num_spec: int) -> None:
    """allowed_token_ids and bad_words on the GPU (fp32, decode steps from CUDA graphs; overlapped scheduling,
    or verify graphs under speculative decoding): the outputs equal the synchronous / plain run's, keep to the
    allowed set and never contain a banned word's tokens."""
    from tests.test_token_masks import _contains, _encoder, _mixed, tokenize_bad_words

    plain = LLM(device="cuda", dtype="float32", max_model_len=256, async_scheduling=False, warmup=False,
                extra={"num_kv_blocks": 128})
    prompts, params = _mixed(plain)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    del plain
    llm = LLM(device="cuda", dtype="float32", max_model_len=256, num_speculative_tokens=num_spec, warmup=False,
              extra={"num_kv_blocks": 128})
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    # the seeded sampled request (row 2) draws other random numbers under speculative decoding
    same = range(len(want)) if not num_spec else [i for i, p in enumerate(params) if p.temperature == 0.0]
    assert [got[i] for i in same] == [want[i] for i in same]
    stats = llm.engine.stats()
    assert stats["model_steps_verify_graph" if num_spec else "model_steps_decode_graph"] > 0, stats
    tok = llm.get_tokenizer()
    for tokens, sp in zip(got, params):
        assert not any(_contains(tokens, s) for s in tokenize_bad_words(sp.bad_words or [], _encoder(tok), 1024))
        assert sp.allowed_token_ids is None or set(tokens) <= set(sp.allowed_token_ids)


@pytest.mark.parametrize("num_spec", [0, 2])
def test_thinking_budget_on_gpu(num_spec: int) -> None:
    """thinking_token_budget on the GPU (fp32; decode steps from CUDA graphs with overlapped scheduling, or verify
    graphs under speculative decoding): `</think>` right after `budget` tokens, the tokens before it those of the
    free synchronous run, and the same outputs as that run's forced one."""
    from tests.test_thinking_budget import END, _thinking

    prompts = [_thinking(n, seed) for seed, n in enumerate((5, 17, 40))]
    free = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    budgets = [0, 3, 9]
    plain = LLM(device="cuda", dtype="float32", max_model_len=256, async_scheduling=False, warmup=False,
                extra={"num_kv_blocks": 128})
    unforced = [o.outputs[0].token_ids for o in plain.generate(prompts, free)]
    params = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, thinking_token_budget=b)
              for b in budgets]
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    del plain
    llm = LLM(device="cuda", dtype="float32", max_model_len=256, num_speculative_tokens=num_spec, warmup=False,
              extra={"num_kv_blocks": 128})
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == want
    for tokens, free_tokens, b in zip(got, unforced, budgets):
        if END not in free_tokens[:b]:
            assert tokens[:b] == free_tokens[:b] and tokens[b] == END
    stats = llm.engine.stats()
    assert stats["model_steps_verify_graph" if num_spec else "model_steps_decode_graph"] > 0, stats


def test_ngram_speculation_on_gpu() -> None:
    """n-gram drafts on the GPU (fp32): verify graphs captured without the MTP drafting pass and prefill steps
    from mixed graphs that keep each sequence's last hidden row give plain decoding's greedy outputs, on
    prompts that repeat themselves (so drafts are accepted) and on random ones."""
    from tests.test_ngram_spec import _repetitive_prompts

    prompts = _repetitive_prompts(6, seed=1) + _prompts()[:4]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    plain = LLM(device="cuda", dtype="float32", max_model_len=256, async_scheduling=False, warmup=False,
                extra={"num_kv_blocks": 256})
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    del plain
    llm = LLM(device="cuda", dtype="float32", max_model_len=256, num_speculative_tokens=3,
              speculative_method="ngram", prompt_lookup_min=2, prompt_lookup_max=4, warmup=False,
              extra={"num_kv_blocks": 256})
    assert llm.engine.model.mtp is None and llm.engine.runner.verify_graphs is not None
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == want
    stats = llm.engine.stats()
    assert stats["model_steps_verify_graph"] > 0 and stats["spec_decode_num_draft_tokens"] > 0, stats
    assert llm.engine.blocks.all_free()


def test_shared_expert_stream_matches_inline_on_gpu() -> None:
    """The shared expert on its own stream beside the routed experts (the default, from 2 tokens a step) gives
    the tokens of the inline order, in prefills (eager and mixed-step graphs) and decode-step graphs (batch 1
    inline, larger ones with the fork), greedy and seeded."""
    from nibble.layers.moe import SparseMoE

    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True) for _ in range(4)]
    params += [SamplingParams(temperature=0.8, seed=5 + i, max_tokens=24, ignore_eos=True) for i in range(4)]
    tokens = {}
    for overlap in (False, True):
        llm = LLM(device="cuda", max_model_len=512, shared_expert_overlap=overlap, extra={"num_kv_blocks": 512})
        blocks = [m for m in llm.engine.model.modules() if isinstance(m, SparseMoE)]
        assert blocks and all((b.side_stream is not None) == overlap for b in blocks)
        tokens[overlap] = [o.outputs[0].token_ids for o in llm.generate(_prompts(), params)]
        assert llm.engine.blocks.all_free()
        del llm
    assert tokens[True] == tokens[False]


def test_padded_decode_graphs_match_eager_steps() -> None:
    """Decode batches of 5, 4, 3, 2, 1 sequences (requests ending one after another) replayed from the 8-, 4-, 2-
    and 1-row graphs, whose padding rows are routed to no expert, give the greedy tokens of eager steps (fp32)."""
    params = [SamplingParams(temperature=0.0, max_tokens=6 + 5 * i, ignore_eos=True) for i in range(5)]
    prompts = _prompts()[:5]
    tokens = {}
    for eager in (True, False):
        llm = LLM(device="cuda", dtype="float32", max_model_len=512, enforce_eager=eager,
                  extra={"num_kv_blocks": 256})
        assert (llm.engine.runner.graphs is None) == eager
        tokens[eager] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        if not eager:
            assert llm.engine.runner.step_counts["decode_graph"] > 10
        del llm
    assert tokens[False] == tokens[True]
