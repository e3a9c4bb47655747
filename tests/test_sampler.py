"""logit_bias in the sampler (CPU): added to the logits before everything else, per request, for greedy and
sampled rows alike; the log-probabilities stay those of the raw distribution; bad values and ids are
refused with the field named."""

from __future__ import annotations

import pytest
import torch

from nibble.engine.llm import LLM
from nibble.engine.request import Request
from nibble.engine.sampler import sample
from nibble.engine.sampling_params import SamplingParams, SamplingParamsError

VOCAB = 50


def _requests(*params: SamplingParams) -> list[Request]:
    return [Request(f"r{i}", [1, 2, 3], p, eos_token_ids=(0,)) for i, p in enumerate(params)]


def test_bias_forces_and_bans_tokens_per_row() -> None:
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(0))
    top = logits.argmax(dim=-1)
    reqs = _requests(
        SamplingParams(temperature=0.0, logit_bias={7: 100.0}),
        SamplingParams(temperature=0.0, logit_bias={int(top[1]): -100.0}),
        SamplingParams(temperature=1.0, seed=3, logit_bias={11: 100.0}, logprobs=1),
        SamplingParams(temperature=0.0),
    )
    raw = torch.log_softmax(logits, dim=-1)
    out = sample(logits.clone(), reqs)
    assert out.token_ids[0] == 7
    assert out.token_ids[1] != int(top[1])
    assert out.token_ids[1] == int(torch.topk(logits[1], 2).indices[1])
    assert out.token_ids[2] == 11
    assert out.token_ids[3] == int(top[3])
    lp = out.logprobs[2]
    assert lp is not None and lp.logprob == pytest.approx(float(raw[2, 11]), abs=1e-5)


@pytest.mark.parametrize("bias,match", [({3: 101.0}, "values must be in"), ({3: float("nan")}, "values must be in"),
                                        ({-1: 1.0}, "keys must be token ids"), ({"3": 1.0}, "keys must be")])
def test_bad_bias_is_refused(bias: dict, match: str) -> None:
    with pytest.raises(SamplingParamsError, match=match):
        SamplingParams(logit_bias=bias)


def test_engine_refuses_ids_outside_the_vocabulary() -> None:
    llm = LLM(device="cpu", max_model_len=64)
    vocab = llm.engine.model_config.vocab_size
    with pytest.raises(ValueError, match=rf"logit_bias token ids must be in \[0, {vocab}\), got \[{vocab}\]"):
        llm.engine.add_request("x", [1, 2], SamplingParams(logit_bias={vocab: 5.0, 1: 2.0}))
    outs = llm.generate([[1, 2, 3]], SamplingParams(temperature=0.8, max_tokens=6, logit_bias={42: 100.0}))
    assert outs[0].outputs[0].token_ids == [42] * 6
