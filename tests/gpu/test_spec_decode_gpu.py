"""Speculative decoding on the GPU (NIBBLE_TEST_GPU=1): the demo model in fp32 with the verify and drafting
steps replayed from CUDA graphs gives the same greedy tokens as plain decoding, with the MTP head's own
drafts and with oracle drafts (the reference continuation, partly corrupted) that get accepted."""

from __future__ import annotations

import os

import pytest
import torch

from nibble.engine.config import EngineConfig
from nibble.engine.llm_engine import LLMEngine
from nibble.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(os.environ.get("NIBBLE_TEST_GPU") != "1" or not torch.cuda.is_available(),
                                reason="GPU test (NIBBLE_TEST_GPU=1 on a CUDA machine)")

PARAMS = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


def _engine(**kwargs: object) -> LLMEngine:
    return LLMEngine(EngineConfig(model="demo", device="cuda", dtype="float32", max_model_len=1024,
                                  extra={"num_kv_blocks": 1024}, **kwargs))  # type: ignore[arg-type]


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, 990, (n,), generator=gen).tolist() for n in (5, 40, 17, 3, 300, 29, 9, 120)]


def _run(engine: LLMEngine, refs: dict[str, list[int]] | None = None, noise: float = 0.0) -> dict[str, list[int]]:
    gen = torch.Generator().manual_seed(1)
    real = engine.runner.execute_spec
    k = engine.num_spec_tokens

    def oracle(sched, *args):  # type: ignore[no-untyped-def]
        if sched.spec_verify and refs is not None:
            for req in sched.requests:
                ref = req.prompt_token_ids + refs[req.request_id]
                start = req.num_computed_tokens + 1
                req.draft_token_ids = [
                    ((ref[p] if p < len(ref) else 0) + (torch.rand((), generator=gen) < noise).item()) % 990
                    for p in range(start, start + k)]
        return real(sched, *args)

    if k:
        engine.runner.execute_spec = oracle  # type: ignore[method-assign]
    for i, p in enumerate(_prompts()):
        engine.add_request(f"r{i}", p, PARAMS)
    out: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                out[o.request_id] = list(o.outputs[0].token_ids)
    assert engine.blocks.all_free()
    return out


def test_verify_graphs_match_plain_decoding() -> None:
    ref = _run(_engine())
    for k, noise in ((1, 0.0), (3, 0.3)):
        spec = _engine(num_speculative_tokens=k)
        assert spec.runner.verify_graphs is not None and spec.runner.mixed_graphs is not None
        assert _run(spec) == ref  # the head's own drafts
        assert _run(spec, ref, noise) == ref
        stats = spec.stats()
        assert stats["spec_decode_num_accepted_tokens"] > 0
        # prefills (prompts of up to 300 tokens) through the mixed-step graphs, verify steps through theirs
        assert stats["model_steps_mixed_graph"] > 0 and stats["model_steps_verify_graph"] > 0
        del spec
        torch.cuda.empty_cache()
