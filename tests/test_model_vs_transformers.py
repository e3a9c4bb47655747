"""nibble's Qwen3.5-MoE against transformers' own implementation.

Tiny random checkpoints are made with transformers, quantized by `nibble quantize`, and compared with
transformers running the dequantized weights: logits of a batched prefill of sequences of different lengths
and of 32 batched decode steps (max relative error < 1e-4 in fp32), and greedy generations token for token.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from nibble.checkpoint.loader import load_model
from nibble.checkpoint.quantize import quantize_checkpoint
from nibble.engine.llm import LLM
from nibble.engine.sampling_params import SamplingParams
from nibble.kernels.kernel_set import KernelSet
from nibble.layers.forward_batch import ForwardBatch, ModelCaches
from nibble.models.config import ModelConfig
from tests.helpers.tiny_models import load_dequantized_reference, make_tiny_qwen35_moe

CONFIGS = {
    "gqa-8experts": dict(),
    "odd-sizes": dict(hidden_size=96, num_hidden_layers=5, num_attention_heads=6, num_key_value_heads=2,
                      head_dim=16, linear_num_key_heads=3, linear_num_value_heads=6, linear_key_head_dim=16,
                      linear_value_head_dim=32, num_experts=12, num_experts_per_tok=3, moe_intermediate_size=48,
                      shared_expert_intermediate_size=80, vocab_size=300,
                      layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention",
                                   "linear_attention"]),
    "mha-multimodal-fused": dict(num_attention_heads=4, num_key_value_heads=4, num_experts=4, num_experts_per_tok=1,
                                 moe_intermediate_size=64, multimodal=True, fused_experts=True, seed=3),
}
PROMPT_LENS = [9, 3, 17, 1]
DECODE_STEPS = 32
BLOCK_SIZE = 4


@pytest.fixture(scope="module", params=list(CONFIGS))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    base = tmp_path_factory.mktemp(request.param)
    src = make_tiny_qwen35_moe(base / "bf16", **CONFIGS[request.param])
    dst = base / "nvfp4"
    quantize_checkpoint(src, dst, progress=False)
    reference = load_dequantized_reference(dst)
    return dst, reference


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


DENSE_CALLS: list[int] = []


def _dense_kernels(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """`dense_linear` with its kernels forced: "gemv" for up to 8 tokens, "dot" for 9-16, torch above."""
    from nibble.kernels.dense_gemv import dense_linear_launch

    t = x.numel() // x.shape[-1]
    DENSE_CALLS.append(t)
    path = "gemv" if t <= 8 else "dot"
    return dense_linear_launch(x, w, config={"path": path, "block_n": 32, "block_k": 64, "warps": 4, "stages": 2})


def _fused_elementwise_kernels() -> KernelSet:
    """The reference set with the Triton kernels (interpreter) of the ops that read strided views of the
    fused projections: the GDN gating (alone and inside the decode step), the router, the shared expert's
    activation and combination (alone and inside the next RMSNorm), the attention q/k norm and output gate;
    and the BF16 projections' decode GEMV kernels (`dense_linear`, the 4-sequence decode steps)."""
    from nibble.kernels import activation, gated_delta, gdn_gating, moe_route, norm

    return replace(KernelSet.reference(), gdn_gating=gdn_gating.gdn_gating, route=moe_route.route,
                   silu_and_mul=activation.silu_and_mul, moe_combine=activation.moe_combine,
                   sigmoid_mul=activation.sigmoid_mul, qk_rms_norm=norm.qk_rms_norm,
                   rms_norm_moe=norm.rms_norm_moe, gated_delta_rule_decode=gated_delta.gated_delta_rule_decode,
                   dense_linear=_dense_kernels)


@torch.inference_mode()
@pytest.mark.parametrize("kernels", ["reference", "triton-elementwise"])
def test_logits_prefill_and_decode_match_transformers(checkpoint: tuple[Path, object], kernels: str) -> None:
    model_dir, reference = checkpoint
    config = ModelConfig.from_pretrained(model_dir)
    assert config.quant is not None and config.quant.quant_algo == "NVFP4"
    kernel_set = KernelSet.reference() if kernels == "reference" else _fused_elementwise_kernels()
    model = load_model(model_dir, config, kernel_set, dtype=torch.float32, device="cpu")
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, config.vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    max_len = max(PROMPT_LENS) + DECODE_STEPS
    blocks_per_seq = -(-max_len // BLOCK_SIZE)
    # Interleaved block ids so that every sequence's blocks are scattered through the cache.
    block_tables = [[1 + i + j * len(seqs) for j in range(blocks_per_seq)] for i in range(len(seqs))]
    caches = ModelCaches.allocate(config, 1 + blocks_per_seq * len(seqs), BLOCK_SIZE, len(seqs) + 1,
                                  torch.float32, torch.float32, "cpu")
    slots = [4, 2, 1, 3]
    step_logits: list[list[torch.Tensor]] = [[] for _ in seqs]
    feed = [list(s) for s in seqs]
    context = [0] * len(seqs)
    for _ in range(DECODE_STEPS + 1):
        batch = ForwardBatch.build(feed, context, block_tables, slots, BLOCK_SIZE)
        logits = model.compute_logits(model(batch, caches)[batch.logits_indices])
        for i in range(len(seqs)):
            step_logits[i].append(logits[i])
            context[i] += len(feed[i])
            nxt = int(logits[i].argmax())
            seqs[i].append(nxt)
            feed[i] = [nxt]
    for i, seq in enumerate(seqs):
        ref = reference(torch.tensor([seq])).logits[0].float()
        first = PROMPT_LENS[i] - 1
        for step, got in enumerate(step_logits[i]):
            err = _rel_err(got, ref[first + step])
            assert err < 1e-4, f"sequence {i}, step {step}: relative error {err:.2e}"
    if kernels != "reference":
        assert 4 in DENSE_CALLS  # the decode steps' projections went through dense_linear


@torch.inference_mode()
def test_greedy_generation_matches_transformers(checkpoint: tuple[Path, object]) -> None:
    model_dir, reference = checkpoint
    llm = LLM(model=str(model_dir), device="cpu", block_size=BLOCK_SIZE, max_num_batched_tokens=16,
              max_model_len=64)
    vocab = llm.engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=DECODE_STEPS, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        ref = reference.generate(torch.tensor([prompt]), max_new_tokens=DECODE_STEPS, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
        assert out.outputs[0].token_ids == ref[0, len(prompt):].tolist()
    assert llm.engine.blocks.all_free()


def test_prompt_logprobs_match_transformers(checkpoint: tuple[Path, object]) -> None:
    """Log-probabilities of every prompt token given the ones before it (prompts chunked over several steps,
    batched with each other), against transformers' forward pass over the whole prompt: the prompt tokens'
    own values and the top-3 alternatives."""
    model_dir, reference = checkpoint
    llm = LLM(model=str(model_dir), device="cpu", block_size=BLOCK_SIZE, max_num_batched_tokens=16,
              max_model_len=64)
    vocab = llm.engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in [*PROMPT_LENS, 40]]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=3))
    for prompt, out in zip(prompts, outs):
        entries = out.prompt_logprobs
        assert entries is not None and len(entries) == len(prompt) and entries[0] is None
        with torch.no_grad():
            ref = torch.log_softmax(reference(torch.tensor([prompt])).logits[0].float(), dim=-1)
        for p in range(1, len(prompt)):
            entry = entries[p]
            assert entry is not None and entry.token_id == prompt[p]
            assert abs(entry.logprob - float(ref[p - 1, prompt[p]])) < 1e-4
            top_ids = torch.topk(ref[p - 1], 3).indices
            assert set(entry.top) == set(top_ids.tolist())
            for t, v in entry.top.items():
                assert abs(v - float(ref[p - 1, t])) < 1e-4
    assert llm.engine.blocks.all_free()
