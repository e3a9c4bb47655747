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
from tests.vision.test_image_generation import (
    _assert_prompt_logprobs,
    _expected,
    _finish_one,
    _generate,
    _images,
    _mixed_jobs,
    _prompt,
    _reference,
    _reference_log_probs,
)

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
    prompts, images = _mixed_jobs(llm)
    one = images[0]
    assert one is not None
    prompts.append(_prompt(llm, one, 9))  # the same image again, in another prompt
    images.append(one)
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


def test_video_and_image_prompt_logprobs_on_gpu(tmp_path: Path) -> None:
    """A prompt with a video, an image and a second video on the GPU (fp32), in prefill chunks cut inside them:
    every position's log-probability of the next prompt token is transformers' (vision rows, timestamps and
    3-D positions of both kinds), and greedy decoding after it (from CUDA graphs) gives transformers' tokens."""
    from nibble.engine.sampling_params import SamplingParams
    from nibble.models.multimodal import VIDEO_PLACEHOLDER, VISION_PLACEHOLDER
    from tests.vision.test_video import _frames, make_video_checkpoint

    model_dir = make_video_checkpoint(tmp_path / "video")
    reference = _reference(model_dir)
    llm = LLM(model=str(model_dir), device="cuda", dtype="float32", max_num_batched_tokens=8, max_model_len=256,
              extra={"num_kv_blocks": 64})
    prompt, images, videos = llm.engine.prepare_media(
        f"a{VIDEO_PLACEHOLDER}b{VISION_PLACEHOLDER}c{VIDEO_PLACEHOLDER}d", [_frames(1, 16, 24, seed=2)[0]],
        [_frames(5, 20, 30, seed=3), _frames(4, 16, 24, seed=4)])
    assert images is not None and videos is not None
    out = _finish_one(llm, prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, prompt_logprobs=1),
                      images=images, videos=videos)
    _assert_prompt_logprobs(out, prompt, _reference_log_probs(reference, prompt, images, videos), atol=2e-3)
    assert out.outputs[0].token_ids == _expected(reference, prompt, images, videos)
    assert llm.engine.stats()["model_steps_decode_graph"] > 0
