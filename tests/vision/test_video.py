"""Video input end to end: nibble's offline engine and HTTP server against transformers'
`Qwen3_5MoeForConditionalGeneration`.

A tiny random multimodal checkpoint with the demo tokenizer (its `<|video_pad|>` and vision tokens) is loaded by
both, unquantized and quantized by `nibble quantize` (transformers then runs the dequantized weights). nibble
preprocesses the videos and expands each prompt's video placeholder into timestamp text and per-patch
placeholders; transformers gets that prompt, nibble's `pixel_values_videos` / `video_grid_thw` and
`mm_token_type_ids` 2 on video tokens. Greedy generations must agree token for token for a prompt with a video
and one with an image and two videos, batched with a text request, with prefill chunks cut inside the videos.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from nibble.checkpoint.quantize import quantize_checkpoint
from nibble.engine.llm import LLM
from nibble.engine.llm_engine import RequestError
from nibble.engine.sampling_params import SamplingParams
from nibble.models.multimodal import VIDEO_PLACEHOLDER, VISION_PLACEHOLDER, ImageInputs, VideoInputs
from tests.helpers.tiny_models import make_tiny_qwen35_moe
from tests.vision.test_image_generation import (
    MAX_TOKENS,
    _assert_prompt_logprobs,
    _expected,
    _finish_one,
    _reference,
    _reference_log_probs,
)

DEMO_TOKENIZER = Path(__file__).resolve().parents[2] / "nibble" / "assets" / "demo_tokenizer"
# the demo tokenizer's vision tokens
START, END, IMAGE, VIDEO = 1000, 1001, 1003, 1004
# tiny frames: 4-pixel patches, 2x2 merge, at most 4096 pixels over all frames; 20x30 frames are resized to
# 16x32 (8 tokens per temporal patch), 16x24 ones kept (6 tokens)
VIDEO_CONFIG = {"size": {"shortest_edge": 64, "longest_edge": 4096}, "patch_size": 4, "temporal_patch_size": 2,
                "merge_size": 2, "fps": 2, "min_frames": 4, "max_frames": 8}
IMAGE_CONFIG = {"min_pixels": 64, "max_pixels": 32 * 32, "patch_size": 4}


def make_video_checkpoint(dst: Path) -> Path:
    """The tiny multimodal checkpoint with the demo tokenizer and tiny image and video processor configs."""
    model_dir = make_tiny_qwen35_moe(dst, multimodal=True, seed=5, vocab_size=1024, tokenizer_dir=DEMO_TOKENIZER)
    raw = json.loads((model_dir / "config.json").read_text())
    raw.update(vision_start_token_id=START, vision_end_token_id=END, image_token_id=IMAGE, video_token_id=VIDEO)
    (model_dir / "config.json").write_text(json.dumps(raw))
    (model_dir / "video_preprocessor_config.json").write_text(json.dumps(VIDEO_CONFIG))
    (model_dir / "preprocessor_config.json").write_text(json.dumps(IMAGE_CONFIG))
    return model_dir


@pytest.fixture(scope="module", params=["fp32", "nvfp4"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    base = tmp_path_factory.mktemp(f"video-{request.param}")
    model_dir = make_video_checkpoint(base / "fp32")
    if request.param == "nvfp4":
        quantize_checkpoint(model_dir, base / "nvfp4", progress=False)
        model_dir = base / "nvfp4"
    return model_dir, _reference(model_dir)


def _frames(n: int, h: int, w: int, seed: int) -> np.ndarray:
    return torch.randint(0, 256, (n, h, w, 3), generator=torch.Generator().manual_seed(seed),
                         dtype=torch.uint8).numpy()


def _run(llm: LLM, jobs: list[tuple[list[int], ImageInputs | None, VideoInputs | None]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for i, (prompt, images, videos) in enumerate(jobs):
        llm.engine.add_request(f"r{i}", prompt, params, images=images, videos=videos)
    done: dict[str, list[int]] = {}
    while llm.engine.has_unfinished_requests():
        for out in llm.engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert llm.engine.blocks.all_free()
    return [done[f"r{i}"] for i in range(len(jobs))]


@pytest.mark.parametrize(("budget", "num_spec"), [(96, 0), (8, 0), (8, 2)])
def test_video_generation_matches_transformers(checkpoint: tuple[Path, Any], budget: int, num_spec: int) -> None:
    """A video of 5 frames (3 temporal patches, the last frame repeated), and an image between two videos
    (the second given with metadata: 30 fps source frames), batched with a text prompt; budget 8 cuts the
    prefill inside the videos' placeholders; also under MTP speculative decoding. The expanded prompt is the
    template's text with each video's placeholder replaced by `<t seconds><|vision_start|>` + 8 placeholders
    + `<|vision_end|>` per patch."""
    model_dir, reference = checkpoint
    llm = LLM(model=str(model_dir), device="cpu", block_size=4, max_num_batched_tokens=budget, max_model_len=192,
              num_speculative_tokens=num_spec)
    tok = llm.get_tokenizer()
    one = _frames(5, 20, 30, seed=1)
    ids, none, videos = llm.engine.prepare_media(f"Watch {VIDEO_PLACEHOLDER} and say", [], [one])
    assert none is None and videos is not None and videos.grid_thw.tolist() == [[3, 4, 8]]
    assert videos.timestamps == ((0.25, 1.25, 2.0),)
    frame = [START, *[VIDEO] * 8, END]
    expanded = [*tok.encode("Watch "), *[t for s in ("<0.2 seconds>", "<1.2 seconds>", "<2.0 seconds>")
                                         for t in (*tok.encode(s), *frame)], *tok.encode(" and say")]
    assert ids == expanded
    image = _frames(1, 16, 24, seed=2)[0]
    meta = {"fps": 30.0, "frames_indices": [0, 15, 30, 45]}
    mixed = llm.engine.prepare_media(f"a{VIDEO_PLACEHOLDER}b{VISION_PLACEHOLDER}c{VIDEO_PLACEHOLDER}d", [image],
                                     [_frames(6, 16, 24, seed=3), (_frames(4, 20, 30, seed=4), meta)])
    assert mixed[2] is not None and mixed[2].timestamps == ((0.25, 1.25, 2.25), (0.25, 1.25))
    jobs = [(ids, None, videos), mixed, (list(range(7, 20)), None, None)]
    got = _run(llm, jobs)
    for (prompt, im, vid), tokens in zip(jobs, got):
        assert tokens == _expected(reference, prompt, im, vid)
    if num_spec:
        assert llm.engine.stats()["spec_decode_num_draft_tokens"] > 0


def test_video_prompt_logprobs_match_transformers(checkpoint: tuple[Path, Any]) -> None:
    """prompt_logprobs of a prompt with a video, an image and a second video, in chunks of 8 cut inside them:
    every position's log-probability of the next prompt token and its top-2 are transformers' (a stricter check
    of the vision rows and 3-D positions than greedy tokens, which a tiny random model keeps for small
    changes of its input)."""
    model_dir, reference = checkpoint
    llm = LLM(model=str(model_dir), device="cpu", block_size=4, max_num_batched_tokens=8, max_model_len=192)
    prompt, images, videos = llm.engine.prepare_media(
        f"a{VIDEO_PLACEHOLDER}b{VISION_PLACEHOLDER}c{VIDEO_PLACEHOLDER}d", [_frames(1, 16, 24, seed=2)[0]],
        [_frames(5, 20, 30, seed=3), _frames(4, 16, 24, seed=4)])
    assert videos is not None and images is not None
    out = _finish_one(llm, prompt, SamplingParams(max_tokens=1, prompt_logprobs=2), images=images, videos=videos)
    want = _reference_log_probs(reference, prompt, images, videos)
    _assert_prompt_logprobs(out, prompt, want, atol=2e-4, top=2)


def test_generate_and_chat_with_videos(checkpoint: tuple[Path, Any]) -> None:
    """LLM.generate with vLLM's multi_modal_data {"video": ...} and LLM.chat with a video content part give
    the prompt prepare_media builds and transformers' tokens; a follow-up turn starts from the cached prefix."""
    model_dir, reference = checkpoint
    llm = LLM(model=str(model_dir), device="cpu", block_size=4, max_num_batched_tokens=16, max_model_len=192)
    llm.engine.blocks.prefix.min_split_tokens = 8
    frames = _frames(4, 20, 30, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    text = f"What happens {VIDEO_PLACEHOLDER}?"
    (out,) = llm.generate({"prompt": text, "multi_modal_data": {"video": frames}}, params)
    ids, _, videos = llm.engine.prepare_media(text, [], [frames])
    assert out.prompt_token_ids == ids
    assert out.outputs[0].token_ids == _expected(reference, ids, None, videos)
    messages = [{"role": "user", "content": [{"type": "text", "text": "What happens"},
                                             {"type": "video", "video": frames}]}]
    before = llm.engine.stats()["prefix_cache_hits"]
    (chat,) = llm.chat(messages, params, enable_thinking=False)
    rendered = llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": "What happens" + VIDEO_PLACEHOLDER}], enable_thinking=False)
    ids, _, _ = llm.engine.prepare_media(rendered, [], [frames])
    assert chat.prompt_token_ids == ids
    assert chat.outputs[0].token_ids == _expected(reference, ids, None, videos)
    follow = [*ids, *chat.outputs[0].token_ids, 5, 6, 7]
    (again,) = _run(llm, [(follow, None, videos)])
    assert llm.engine.stats()["prefix_cache_hits"] - before >= len(ids) - 8
    assert again == _expected(reference, follow, None, videos)


def test_video_request_restrictions(checkpoint: tuple[Path, Any]) -> None:
    model_dir, _ = checkpoint
    llm = LLM(model=str(model_dir), device="cpu", block_size=4, max_model_len=192)
    engine = llm.engine
    frames = _frames(4, 16, 24, seed=6)
    ids, _, videos = engine.prepare_media(f"x{VIDEO_PLACEHOLDER}y", [], [frames])
    with pytest.raises(RequestError, match=r"videos: video frame 1 .* needs 6 placeholders"):
        engine.add_request("a", ids[:-6], SamplingParams(), videos=videos)
    with pytest.raises(RequestError, match="videos: the prompt has 2 video placeholders for 1 videos"):
        engine.prepare_media(f"{VIDEO_PLACEHOLDER}{VIDEO_PLACEHOLDER}", [], [frames])
    with pytest.raises(RequestError, match="videos: a video needs at least 2 frames"):
        engine.prepare_media(f"x{VIDEO_PLACEHOLDER}", [], [frames[:1]])
    with pytest.raises(RequestError, match=r"videos: (video data is not a decodable video|video input needs PyAV)"):
        engine.prepare_media(f"x{VIDEO_PLACEHOLDER}", [], [b"garbage bytes"])
    req = engine.add_request("c", ids, SamplingParams(max_tokens=1), videos=videos)
    assert req.mrope_delta < 0 and min(req.cache_prompt_ids or [0]) < 0 and req.has_vision
    engine.abort_request("c")


def test_chat_video_over_http(tmp_path: Path) -> None:
    """A video_url part (an mp4 data URL, encoded with PyAV here) on /v1/chat/completions: the prompt is the
    chat template's with the video's placeholder expanded, the greedy answer transformers' for it; the same
    video fetched from an http:// URL gives the same answer; a video that cannot be decoded is a 400 naming
    the problem."""
    pytest.importorskip("av")
    import base64

    import httpx

    from nibble.engine.async_engine import AsyncEngine
    from nibble.engine.config import EngineConfig
    from tests.helpers.http_media import local_http_server, send_bytes
    from tests.helpers.server import start_server
    from tests.vision.test_video_processor import _encode

    model_dir = make_video_checkpoint(tmp_path / "vl")
    data = _encode(_frames(12, 20, 30, seed=8), fps=10)
    url = "data:video/mp4;base64," + base64.b64encode(data).decode()
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                             {"type": "video_url", "video_url": {"url": url}}]}]
    engine = AsyncEngine.from_config(EngineConfig(model=str(model_dir), device="cpu", max_model_len=192,
                                                  block_size=4, max_num_batched_tokens=16))
    handle = start_server(engine)
    try:
        body = {"messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True,
                "chat_template_kwargs": {"enable_thinking": False}}
        r = httpx.post(handle.url + "/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        core = engine.engine
        tok = core.tokenizer
        text = tok.apply_chat_template([{"role": "user", "content": "What is this?" + VIDEO_PLACEHOLDER}],
                                       enable_thinking=False)
        prompt, _, videos = core.prepare_media(tok.encode(text), [], [url])
        # 12 frames at 10 fps: 4 sampled (the minimum), 2 temporal patches of 8 tokens
        assert videos is not None and videos.grid_thw.tolist() == [[2, 4, 8]]
        assert r.json()["usage"]["prompt_tokens"] == len(prompt) == len(tok.encode(text)) - 3 + prompt.count(VIDEO) \
            + 2 * 2 + sum(len(tok.encode(f"<{t:.1f} seconds>")) for t in videos.timestamps[0])
        expected = tok.decode(_expected(_reference(model_dir), prompt, None, videos))
        assert r.json()["choices"][0]["message"]["content"] == expected
        with local_http_server({"/clip.mp4": send_bytes(data, "video/mp4")}) as media:
            messages[0]["content"][1]["video_url"]["url"] = media + "/clip.mp4"
            r = httpx.post(handle.url + "/v1/chat/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["prompt_tokens"] == len(prompt)
            assert r.json()["choices"][0]["message"]["content"] == expected
            for bad, reason in (("data:video/mp4;base64,AAAA", "videos: video data is not a decodable video"),
                                (media + "/missing.mp4", f"videos: fetching {media}/missing.mp4: HTTP 404")):
                messages[0]["content"][1]["video_url"]["url"] = bad
                r = httpx.post(handle.url + "/v1/chat/completions", json=body, timeout=60)
                assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
                assert r.json()["error"]["message"].startswith(reason), r.text
    finally:
        handle.stop()
        engine.shutdown()
