"""Padded mixed prefill/decode steps (nibble/engine/mixed_graphs.py) on the demo model (CPU): the padded batch a
captured graph runs, computed eagerly here, must give the real sequences the logits, KV cache and GDN states of
the unpadded step, whatever the padding rows hold, and an engine that runs its short prefill and mixed steps
padded must generate what the plain engine does."""

from __future__ import annotations

import pytest
import torch

from nibble.engine.config import EngineConfig, EngineConfigError
from nibble.engine.llm_engine import LLMEngine
from nibble.engine.mixed_graphs import GraphKey, MixedGraphs, mixed_capture_sizes
from nibble.engine.sampling_params import SamplingParams
from nibble.engine.step_inputs import StepInputs
from nibble.kernels.gated_delta import RECURRENT_MAX_TOKENS
from tests.helpers.moe_routing import record_routing


def _engine(**kwargs: object) -> LLMEngine:
    return LLMEngine(EngineConfig(model="demo", device="cpu", max_model_len=512, **kwargs))  # type: ignore[arg-type]


def _install(engine: LLMEngine, max_tokens: int = 512) -> MixedGraphs:
    runner = engine.runner
    graphs = MixedGraphs(runner.model, runner.caches, max_tokens, engine.config.max_num_seqs,
                         runner.max_num_blocks_per_seq, runner.max_model_len, runner.device,
                         full_hidden=engine.config.mtp_drafts)
    runner.mixed_graphs = graphs
    return graphs


class _EagerReplay:
    """Stands in for a captured graph on the CPU: a replay computes the loaded padded step into the output buffer,
    as a real one rewrites its captured output."""

    def __init__(self, graphs: MixedGraphs, key: GraphKey) -> None:
        self.graphs, self.key = graphs, key

    def replay(self) -> None:
        self.graphs.outputs[self.key] = self.graphs.forward(self.key)


def _fake_capture(graphs: MixedGraphs, max_tokens: int) -> set[GraphKey]:
    """'Capture' the keys of up to max_tokens tokens (`_EagerReplay`); the others stay uncaptured."""
    keys = {k for k in graphs.keys if k[0] <= max_tokens}
    for key in keys:
        graphs.graphs[key] = _EagerReplay(graphs, key)  # type: ignore[assignment]
    return keys


def test_capture_sizes() -> None:
    sizes = mixed_capture_sizes(512, 256)
    assert sizes[0] == (16, 8) and sizes[-1] == (512, 256)
    assert all(b < t for t, b in sizes)
    assert mixed_capture_sizes(4096, 8)[-1] == (RECURRENT_MAX_TOKENS, 8)
    assert mixed_capture_sizes(100, 4)[-1] == (96, 4)
    assert mixed_capture_sizes(15, 4) == []


def test_padded_size_fits_tokens_and_sequences() -> None:
    engine = _engine()
    graphs = _install(engine)
    assert graphs.padded_size(3, 2, 2) == (16, 8, True)
    assert graphs.padded_size(16, 9, 8) == (24, 12, True)
    assert graphs.padded_size(40, 9, 32) == (48, 24, False)
    assert graphs.padded_size(105, 101, 5) == (256, 128, True)
    assert graphs.padded_size(513, 2, 300) is None
    assert graphs.padded_size(300, 300, 1) is None
    assert set(graphs.keys) == {(t, b, True) for t, b in graphs.sizes} | \
        {(t, b, False) for t, b in graphs.sizes if t > 16}


def test_short_query_graphs_size_attention_for_split_kv() -> None:
    graphs = _install(_engine())
    assert graphs.batch((64, 32, True)).max_query_len == 16
    assert graphs.batch((64, 32, False)).max_query_len == 64
    assert graphs.batch((16, 8, True)).max_query_len == 16
    with pytest.raises(ValueError, match="does not fit"):
        graphs.load((64, 32, True), [[1] * 17], [0], [[1, 2]], [1], 16)


def test_config_rejects_negative_mixed_tokens() -> None:
    with pytest.raises(EngineConfigError, match="--cuda-graph-max-mixed-tokens"):
        EngineConfig(model="demo", cuda_graph_max_mixed_tokens=-1)


def _step(engine: LLMEngine, lens: list[list[int]], seed: int) -> StepInputs:
    """A step of sequences that each own fresh blocks and a fresh GDN slot: (context, new tokens) per sequence."""
    gen = torch.Generator().manual_seed(seed)
    bs = engine.config.block_size
    tokens, ctxs, tables, slots = [], [], [], []
    next_block = 1
    for i, (ctx, n) in enumerate(lens):
        tokens.append(torch.randint(0, 1000, (n,), generator=gen).tolist())
        ctxs.append(ctx)
        need = -(-(ctx + n) // bs)
        tables.append(list(range(next_block, next_block + need)))
        next_block += need
        slots.append(1 + i)
    return StepInputs(token_ids=tokens, context_lens=ctxs, block_tables=tables, state_slots=slots,
                      new_state_slots=[], sample_rows=list(range(len(lens))))


def _snapshot(engine: LLMEngine) -> list[torch.Tensor]:
    caches = engine.runner.caches
    return [t.clone() for c in caches.kv if c is not None for t in (c.k, c.v)] + \
        [t.clone() for s in caches.gdn if s is not None for t in (s.conv, s.ssm)]


def _restore(engine: LLMEngine, saved: list[torch.Tensor]) -> None:
    caches = engine.runner.caches
    live = [t for c in caches.kv if c is not None for t in (c.k, c.v)] + \
        [t for s in caches.gdn if s is not None for t in (s.conv, s.ssm)]
    for dst, src in zip(live, saved, strict=True):
        dst.copy_(src)


@pytest.mark.parametrize("lens", [[(0, 5)], [(0, 13), (7, 1), (20, 1)], [(3, 40), (0, 2), (30, 1), (0, 9)]])
def test_padded_step_equals_plain_step(lens: list[tuple[int, int]]) -> None:
    engine = _engine()
    runner = engine.runner
    gen = torch.Generator().manual_seed(1)
    # random caches, so that context positions and the GDN states start from something
    for c in runner.caches.kv:
        if c is not None:
            c.k.copy_(torch.randn(c.k.shape, generator=gen))
            c.v.copy_(torch.randn(c.v.shape, generator=gen))
    for s in runner.caches.gdn:
        if s is not None:
            s.conv.copy_(torch.randn(s.conv.shape, generator=gen))
            s.ssm.copy_(torch.randn(s.ssm.shape, generator=gen) * 0.1)
    step = _step(engine, lens, seed=2)
    saved = _snapshot(engine)
    plain = runner.run(step)
    plain_caches = _snapshot(engine)
    _restore(engine, saved)
    graphs = _install(engine)
    key = graphs.padded_size(sum(n for _, n in lens), len(lens), max(n for _, n in lens))
    assert key is not None
    load = graphs.load

    def poisoned_load(*args, **kwargs):  # type: ignore[no-untyped-def]
        # after the step's inputs: stray tokens with a real token id, NaN in the padding's scratch slot
        load(*args, **kwargs)
        graphs.input_ids[sum(n for _, n in lens):] = 123
        for s in runner.caches.gdn:
            if s is not None:
                s.conv[0] = float("nan")
                s.ssm[0] = float("nan")

    graphs.load = poisoned_load  # type: ignore[method-assign]
    padded = runner.run(step)
    assert padded is not None and plain is not None
    torch.testing.assert_close(padded, plain, rtol=1e-5, atol=1e-5)
    num_slots = next(s for s in runner.caches.gdn if s is not None).conv.shape[0]
    for got, want in zip(_snapshot(engine), plain_caches, strict=True):
        if got.shape[0] == num_slots:
            got, want = got[1:], want[1:]  # slot 0 is the scratch slot padded rows may use
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_padding_tokens_are_routed_to_no_expert() -> None:
    """The MoE blocks of a padded step see the real tokens routed as usual and the padding routed nowhere, so
    the experts' work follows the step's tokens, not the graph's size."""
    engine = _engine()
    runner = engine.runner
    lens = [(0, 13), (7, 1), (20, 1)]
    num_tokens = sum(n for _, n in lens)
    seen = record_routing(runner.model)
    graphs = _install(engine)
    key = graphs.padded_size(num_tokens, len(lens), 13)
    assert key is not None and key[0] > num_tokens
    assert runner.run(_step(engine, lens, seed=3)) is not None
    assert seen and all(ids.shape[0] == key[0] for ids in seen)
    for ids in seen:
        assert bool((ids[:num_tokens] >= 0).all()) and bool((ids[num_tokens:] == -1).all())


def test_padded_decode_graph_routes_only_real_sequences() -> None:
    """A decode batch of 3 in the 4-row decode graph (its replay computed eagerly here): the real rows' logits
    are the plain step's, and the padding row is routed to no expert."""
    from nibble.engine.cuda_graphs import DecodeGraphs

    engine = _engine()
    runner = engine.runner
    lens = [(5, 1), (9, 1), (2, 1)]
    step = _step(engine, lens, seed=4)
    saved = _snapshot(engine)
    plain = runner.run(step)
    _restore(engine, saved)
    seen = record_routing(runner.model)
    graphs = DecodeGraphs(runner.model, runner.caches, 4, runner.max_num_blocks_per_seq, runner.max_model_len,
                          runner.device)
    assert graphs.padded_size(3) == 4

    class _Replay:
        def replay(self) -> None:
            graphs.outputs[4] = graphs._step(4)

    graphs.graphs[4] = _Replay()  # type: ignore[assignment]
    runner.graphs = graphs
    padded = runner.run(step)
    assert runner.step_counts["decode_graph"] == 1
    assert padded is not None and plain is not None
    torch.testing.assert_close(padded, plain, rtol=1e-5, atol=1e-5)
    assert seen and all(ids.shape[0] == 4 for ids in seen)
    for ids in seen:
        assert bool((ids[:3] >= 0).all()) and bool((ids[3] == -1).all())


def test_step_counts_say_what_ran() -> None:
    """A padded step counts as a mixed-step graph only when a graph of its size was replayed; computed eagerly
    (no graph of that size) it counts as eager, as an unpadded step does."""
    engine = _engine()
    runner = engine.runner
    graphs = _install(engine)
    step = _step(engine, [(0, 5), (0, 3)], seed=4)
    key = graphs.padded_size(8, 2, 5)
    assert key is not None and not graphs.replays(key)
    eager = runner.run(step)
    assert runner.step_counts == {"decode_graph": 0, "mixed_graph": 0, "verify_graph": 0, "eager": 1}
    graphs.graphs[key] = _EagerReplay(graphs, key)  # type: ignore[assignment]
    assert graphs.replays(key)
    replayed = runner.run(step)
    assert runner.step_counts == {"decode_graph": 0, "mixed_graph": 1, "verify_graph": 0, "eager": 1}
    assert eager is not None and replayed is not None and replayed.shape == eager.shape
    runner.mixed_graphs = None
    runner.run(step)
    assert runner.step_counts["eager"] == 2


@pytest.mark.parametrize(("num_speculative_tokens", "method"), [(0, "mtp"), (2, "mtp"), (2, "ngram")])
def test_engine_outputs_with_padded_mixed_steps(num_speculative_tokens: int, method: str) -> None:
    """With speculative decoding the prefill steps' target pass runs padded (every token's hidden row out, for
    the MTP head; each sequence's last with n-gram drafts) and the verify steps as before."""
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 1000, (int(n),), generator=gen).tolist()
               for n in torch.randint(3, 60, (6,), generator=gen)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    def generate(engine: LLMEngine) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for i, p in enumerate(prompts[:3]):
            engine.add_request(f"r{i}", p, params)
        steps = 0
        while engine.has_unfinished_requests():
            if steps == 3:  # arrivals while the first ones decode: mixed steps
                for i, p in enumerate(prompts[3:], start=3):
                    engine.add_request(f"r{i}", p, params)
            for o in engine.step():
                if o.finished:
                    out[o.request_id] = list(o.outputs[0].token_ids)
            steps += 1
            assert steps < 500
        return out

    want = generate(_engine(max_num_batched_tokens=64))
    spec = {"num_speculative_tokens": num_speculative_tokens, "speculative_method": method}
    if num_speculative_tokens:
        assert generate(_engine(max_num_batched_tokens=64, **spec)) == want
    engine = _engine(max_num_batched_tokens=64, **spec)
    graphs = _install(engine, max_tokens=64)
    captured = _fake_capture(graphs, max_tokens=32)
    calls: list[GraphKey] = []
    real = graphs.run

    def run(size: GraphKey, num_seqs: int) -> torch.Tensor:
        calls.append(size)
        return real(size, num_seqs)

    graphs.run = run  # type: ignore[method-assign]
    runner = engine.runner
    prepare = runner._prepare_caches
    model_steps = [0]

    def counting_prepare(step: StepInputs) -> None:  # once per model step, whichever way it runs
        model_steps[0] += 1
        prepare(step)

    runner._prepare_caches = counting_prepare  # type: ignore[method-assign]
    assert generate(engine) == want
    replayed = [k for k in calls if k in captured]
    assert replayed and len(replayed) < len(calls), "steps of captured and of uncaptured sizes both ran padded"
    # a padded step of a size without a graph ran eagerly and counts so
    stats = engine.stats()
    assert stats["model_steps_mixed_graph"] == len(replayed)
    assert stats["model_steps_eager"] == model_steps[0] - len(replayed)
    assert stats["model_steps_decode_graph"] == stats["model_steps_verify_graph"] == 0
    if num_speculative_tokens:
        assert stats["spec_decode_num_draft_tokens"] > 0
