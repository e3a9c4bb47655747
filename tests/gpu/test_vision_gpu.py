"""Image input on the GPU (run through the device tool with NIBBLE_TEST_GPU=1): a tiny random multimodal
checkpoint, fp32 and NVFP4, served by nibble on CUDA (vision tower on the GPU, image prefill chunks eager, decode
steps replayed from CUDA graphs with the image's shifted positions, overlapped scheduling) gives transformers'
greedy tokens, alone and batched with text requests, with prefill chunks cut inside the images' tokens."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from nibble.checkpoint.quantize import quantize_checkpoint
from nibble.engine.llm import LLM
from tests.helpers.tiny_models import make_tiny_qwen35_moe
from tests.vision.test_image_generation import _expected, _generate, _images, _prompt, _reference

pytestmark = pytest.mark.skipif(os.environ.get("NIBBLE_TEST_GPU") != "1" or not torch.cuda.is_available(),
                                reason="GPU test (NIBBLE_TEST_GPU=1 on a CUDA machine)")

# wide enough for the Triton / fla kernels' tiles (head dims 64, GDN heads of 64, 128-wide experts)
DIMS = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64, num_experts=8,
            num_experts_per_tok=2, moe_intermediate_size=128, shared_expert_intermediate_size=128)


@pytest.fixture(scope="module", params=["fp32", "nvfp4"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    base = tmp_path_factory.mktemp(f"vl-gpu-{request.param}")
    model_dir = make_tiny_qwen35_moe(base / "fp32", multimodal=True, seed=5, **DIMS)
    if request.param == "nvfp4":
        quantize_checkpoint(model_dir, base / "nvfp4", progress=False)
        model_dir = base / "nvfp4"
    return model_dir, _reference(model_dir)


@pytest.mark.parametrize(("budget", "num_spec"), [(256, 0), (8, 0), (8, 2)])
def test_image_generation_on_gpu_matches_transformers(checkpoint: tuple[Path, Any], budget: int,
                                                      num_spec: int) -> None:
    """Also under MTP speculative decoding (verify and drafting graphs at index + delta)."""
    model_dir, reference = checkpoint
    llm = LLM(model=str(model_dir), device="cuda", dtype="float32", max_num_batched_tokens=budget,
              max_model_len=256, num_speculative_tokens=num_spec, extra={"num_kv_blocks": 64})
    one = _images([(16, 24)], seed=1)
    two = _images([(24, 32), (16, 24)], seed=2)
    prompts = [_prompt(llm, one, 3), _prompt(llm, two, 4), list(range(7, 20)), _prompt(llm, one, 9)]
    images = [one, two, None, one]
    got = _generate(llm, prompts, images)
    print("kernels:", llm.engine.kernel_report.selected)
    for prompt, im, tokens in zip(prompts, images, got):
        assert tokens == _expected(reference, prompt, im)
    stats = llm.engine.stats()
    assert stats["model_steps_verify_graph" if num_spec else "model_steps_decode_graph"] > 0, stats
    assert next(llm.engine.model.visual.parameters()).device.type == "cuda"


def test_image_generation_in_bf16_runs_clean(checkpoint: tuple[Path, Any]) -> None:
    """bf16 (the serving dtype): the same requests finish with real tokens, and the image prompts' first tokens
    are transformers' ones (later ones may flip on the random model's near-ties)."""
    model_dir, reference = checkpoint
    llm = LLM(model=str(model_dir), device="cuda", dtype="bfloat16", max_num_batched_tokens=8,
              max_model_len=256, extra={"num_kv_blocks": 64})
    one = _images([(16, 24)], seed=1)
    two = _images([(24, 32), (16, 24)], seed=2)
    prompts = [_prompt(llm, one, 3), _prompt(llm, two, 4)]
    got = _generate(llm, prompts, [one, two])
    same = sum(tokens[:2] == _expected(reference, p, im)[:2] for p, im, tokens in zip(prompts, [one, two], got))
    assert same >= 1, got
