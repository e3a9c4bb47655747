"""Image input under tensor parallelism: rank 0 runs the vision tower and sends each image step's vision rows,
3-D positions and decode offsets to rank 1 (also under MTP speculative decoding); greedy generations (images in
prefill chunks cut inside their placeholders, next to a text request) equal transformers'."""

from __future__ import annotations

from pathlib import Path

import pytest

from nibble.checkpoint.quantize import quantize_checkpoint
from nibble.engine.llm import LLM
from tests.helpers.tiny_models import make_tiny_qwen35_moe
from tests.vision.test_image_generation import _expected, _generate, _mixed_jobs, _reference


@pytest.mark.parametrize("num_speculative_tokens", [0, 2])
def test_image_generation_tp2_matches_transformers(tmp_path: Path, num_speculative_tokens: int) -> None:
    model_dir = make_tiny_qwen35_moe(tmp_path / "fp32", multimodal=True, seed=5)
    quantize_checkpoint(model_dir, tmp_path / "nvfp4", progress=False)
    model_dir = tmp_path / "nvfp4"
    reference = _reference(model_dir)
    llm = LLM(model=str(model_dir), device="cpu", tensor_parallel_size=2, block_size=4, max_num_batched_tokens=8,
              max_model_len=96, max_num_seqs=4, num_speculative_tokens=num_speculative_tokens)
    try:
        assert llm.engine.workers is not None
        assert llm.engine.model.visual is not None and llm.engine.mrope is not None
        prompts, images = _mixed_jobs(llm)
        got = _generate(llm, prompts, images)
        for prompt, im, tokens in zip(prompts, images, got):
            assert tokens == _expected(reference, prompt, im)
    finally:
        llm.engine.shutdown()
