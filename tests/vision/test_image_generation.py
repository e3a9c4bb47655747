"""Image input end to end: nibble's offline engine against transformers' `Qwen3_5MoeForConditionalGeneration`.

A tiny random multimodal checkpoint (vision tower included) is loaded by both, unquantized and quantized by
`nibble quantize` (transformers then runs the dequantized weights); greedy generations for prompts with one
image and with two images and text between them must agree token for token, alone, batched with a text
request, and with prefill chunks that cut inside an image's placeholder tokens.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from nibble.checkpoint.quantize import quantize_checkpoint
from nibble.checkpoint.safetensors_io import iter_tensors, list_shards
from nibble.engine.llm import LLM
from nibble.engine.llm_engine import RequestError
from nibble.engine.sampling_params import SamplingParams
from nibble.models.multimodal import ImageInputs
from nibble.models.vision_processor import ImageProcessorParams, preprocess_images
from tests.helpers.tiny_models import _dequantized, _fuse_experts, _transformers, make_tiny_qwen35_moe

MAX_TOKENS = 8
# tiny images: 4-pixel patches, 2x2 merge; 16x24 and 24x32 pixels give 6 and 12 image tokens
PROCESSOR = ImageProcessorParams(min_pixels=64, max_pixels=32 * 32, patch_size=4)


def _reference(model_dir: Path) -> Any:
    """transformers' multimodal model holding the checkpoint (NVFP4 weights dequantized), fp32, eval."""
    transformers = _transformers()
    raw = json.loads((model_dir / "config.json").read_text())
    raw.pop("quantization_config", None)
    config = transformers.Qwen3_5MoeConfig(**raw)
    with torch.random.fork_rng(devices=[]):
        model = transformers.Qwen3_5MoeForConditionalGeneration(config)
    tensors = {n: t for n, t, _ in iter_tensors(list_shards(model_dir)) if not n.startswith("mtp.")}
    model.load_state_dict(_fuse_experts(_dequantized(tensors)), strict=True)
    return model.float().eval()


@pytest.fixture(scope="module", params=["fp32", "nvfp4"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    base = tmp_path_factory.mktemp(f"vl-{request.param}")
    model_dir = make_tiny_qwen35_moe(base / "fp32", multimodal=True, seed=5)
    if request.param == "nvfp4":
        quantize_checkpoint(model_dir, base / "nvfp4", progress=False)
        model_dir = base / "nvfp4"
    return model_dir, _reference(model_dir)


def _images(sizes: list[tuple[int, int]], seed: int) -> ImageInputs:
    gen = torch.Generator().manual_seed(seed)
    arrays = [torch.randint(0, 256, (h, w, 3), generator=gen, dtype=torch.uint8).numpy() for h, w in sizes]
    return ImageInputs(*preprocess_images(arrays, PROCESSOR))


def _prompt(llm: LLM, images: ImageInputs, seed: int) -> list[int]:
    """Random text with `<vision_start><image_pad><vision_end>` per image, text between, expanded."""
    raw = json.loads((Path(llm.engine.model_dir) / "config.json").read_text())
    start, end, pad = raw["vision_start_token_id"], raw["vision_end_token_id"], raw["image_token_id"]
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, start, (5,), generator=gen).tolist()
    for _ in range(images.num_images):
        ids += [start, pad, end, *torch.randint(0, start, (4,), generator=gen).tolist()]
    return llm.engine.expand_image_prompt(ids, images)


def _media_kwargs(reference: Any, ids: torch.Tensor, images: ImageInputs | None, videos: Any) -> dict[str, Any]:
    """transformers' keyword arguments for a prompt [1, L] with these images / videos (none for a text prompt):
    pixels, grids and token types (1 image, 2 video)."""
    if images is None and videos is None:
        return {}
    config = reference.config
    kwargs: dict[str, Any] = {"mm_token_type_ids": (ids == config.image_token_id).int()
                              + 2 * (ids == getattr(config, "video_token_id", -1)).int()}
    if images is not None:
        kwargs.update(pixel_values=images.pixel_values, image_grid_thw=images.grid_thw)
    if videos is not None:
        kwargs.update(pixel_values_videos=videos.pixel_values, video_grid_thw=videos.grid_thw)
    return kwargs


def _mixed_jobs(llm: LLM) -> tuple[list[list[int]], list[ImageInputs | None]]:
    """The prompts most tests run together, and their images: one image (6 tokens), two images (12 and 6 tokens)
    with text between, and a text prompt."""
    one = _images([(16, 24)], seed=1)
    two = _images([(24, 32), (16, 24)], seed=2)
    return [_prompt(llm, one, 3), _prompt(llm, two, 4), list(range(7, 20))], [one, two, None]


def _expected(reference: Any, prompt: list[int], images: ImageInputs | None, videos: Any = None) -> list[int]:
    """transformers' greedy MAX_TOKENS tokens after the prompt."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = reference.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0,
                                 **_media_kwargs(reference, ids, images, videos))
    return out[0, len(prompt):].tolist()


def _finish_one(llm: LLM, prompt: list[int], params: SamplingParams, **media: Any) -> Any:
    """Run one request (images= / videos= as add_request takes them) to its end; its final RequestOutput."""
    llm.engine.add_request("one", prompt, params, **media)
    out = None
    while llm.engine.has_unfinished_requests():
        for o in llm.engine.step():
            out = o if o.finished else out
    assert out is not None
    return out


def _reference_log_probs(reference: Any, prompt: list[int], images: ImageInputs | None = None,
                         videos: Any = None) -> torch.Tensor:
    """transformers' log-probabilities [len(prompt), V] after each prompt position, images and videos given."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        logits = reference(ids, **_media_kwargs(reference, ids, images, videos)).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def _assert_prompt_logprobs(out: Any, prompt: list[int], want: torch.Tensor, atol: float, top: int = 0) -> None:
    """Every prompt position's log-probability of the next prompt token is want's within atol (and its top
    alternatives want's, when top > 0)."""
    assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(prompt)
    for p, entry in enumerate(out.prompt_logprobs[1:], start=1):
        assert entry is not None and entry.token_id == prompt[p]
        assert entry.logprob == pytest.approx(want[p - 1, prompt[p]].item(), abs=atol)
        if top:
            assert set(entry.top) == set(torch.topk(want[p - 1], top).indices.tolist())


def _generate(llm: LLM, prompts: list[list[int]], images: list[ImageInputs | None]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    ids = []
    for i, (prompt, im) in enumerate(zip(prompts, images)):
        ids.append(f"r{i}")
        llm.engine.add_request(f"r{i}", prompt, params, images=im)
    done: dict[str, list[int]] = {}
    while llm.engine.has_unfinished_requests():
        for out in llm.engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert llm.engine.blocks.all_free()
    return [done[r] for r in ids]


@pytest.mark.parametrize("budget", [64, 8])
def test_image_generation_matches_transformers(checkpoint: tuple[Path, Any], budget: int) -> None:
    """One image, two images with text between, and a text prompt, batched; budget 8 cuts the prefill
    inside the images' tokens (6 and 12 of them)."""
    model_dir, reference = checkpoint
    llm = LLM(model=str(model_dir), device="cpu", block_size=4, max_num_batched_tokens=budget, max_model_len=96)
    prompts, images = _mixed_jobs(llm)
    got = _generate(llm, prompts, images)
    for prompt, im, tokens in zip(prompts, images, got):
        assert tokens == _expected(reference, prompt, im)


def test_image_prompts_share_cached_prefixes(checkpoint: tuple[Path, Any]) -> None:
    """Prefix caching keys image placeholders by their image's content: the next turn of an image conversation
    starts from the ended turn's entry, a prompt that differs only in its second image reuses nothing past the
    first one, and both still generate transformers' tokens."""
    model_dir, reference = checkpoint
    llm = LLM(model=str(model_dir), device="cpu", block_size=4, max_num_batched_tokens=16, max_model_len=96)
    llm.engine.blocks.prefix.min_split_tokens = 8
    two = _images([(24, 32), (16, 24)], seed=2)
    first = _prompt(llm, two, 4)
    (out,) = _generate(llm, [first], [two])
    assert out == _expected(reference, first, two)

    def hits() -> int:
        return int(llm.engine.stats()["prefix_cache_hits"])

    before = hits()
    follow = first + out + [11, 12, 13, 14, 15]
    (got,) = _generate(llm, [follow], [two])
    assert hits() - before >= len(first)
    assert got == _expected(reference, follow, two)

    other = ImageInputs(torch.cat([two.pixel_values[:48], _images([(16, 24)], seed=9).pixel_values]), two.grid_thw)
    assert not torch.equal(other.pixel_values, two.pixel_values)
    second_image_at = [i for i, t in enumerate(first) if t == reference.config.image_token_id][12]
    before = hits()
    (got,) = _generate(llm, [first], [other])
    assert hits() - before <= second_image_at
    assert got == _expected(reference, first, other)


@pytest.mark.parametrize("oracle", [False, True])
def test_image_generation_with_speculative_decoding(checkpoint: tuple[Path, Any], oracle: bool) -> None:
    """MTP speculative decoding with image requests: verify steps rotate at index + delta, the head reads the
    vision rows and M-RoPE positions of the prompt; greedy tokens are transformers', with the head's own drafts
    and with drafts that are transformers' continuation (every third one corrupted, so that verify steps
    accept runs of them)."""
    model_dir, reference = checkpoint
    llm = LLM(model=str(model_dir), device="cpu", block_size=4, max_num_batched_tokens=8, max_model_len=96,
              num_speculative_tokens=2)
    prompts, images = _mixed_jobs(llm)
    expected = [_expected(reference, p, im) for p, im in zip(prompts, images)]
    engine = llm.engine
    if oracle:
        refs = {f"r{i}": p + e for i, (p, e) in enumerate(zip(prompts, expected))}
        real = engine.runner.execute_spec
        count = [0]

        def execute_spec(sched, *args):  # type: ignore[no-untyped-def]
            if sched.spec_verify:
                for req in sched.requests:
                    ref = refs[req.request_id]
                    start = req.num_computed_tokens + 1
                    count[0] += 1
                    req.draft_token_ids = [(ref[p] if p < len(ref) else 0) + (count[0] % 3 == 0 and j == 1)
                                           for j, p in enumerate(range(start, start + 2))]
            return real(sched, *args)

        engine.runner.execute_spec = execute_spec  # type: ignore[method-assign]
    assert _generate(llm, prompts, images) == expected
    stats = engine.stats()
    assert stats["spec_decode_num_draft_tokens"] > 0
    if oracle:
        assert stats["spec_decode_num_accepted_tokens"] > stats["spec_decode_num_draft_tokens"] // 2


def test_image_prompt_logprobs_match_transformers(checkpoint: tuple[Path, Any]) -> None:
    """prompt_logprobs of a prompt with two images, in chunks cut inside the images: each position's
    log-probability of the next prompt token (placeholders included) and its top-2 are transformers'."""
    model_dir, reference = checkpoint
    llm = LLM(model=str(model_dir), device="cpu", block_size=4, max_num_batched_tokens=8, max_model_len=96)
    two = _images([(24, 32), (16, 24)], seed=2)
    prompt = _prompt(llm, two, 4)
    out = _finish_one(llm, prompt, SamplingParams(max_tokens=1, prompt_logprobs=2), images=two)
    _assert_prompt_logprobs(out, prompt, _reference_log_probs(reference, prompt, two), atol=2e-4, top=2)


def test_limit_mm_per_prompt(checkpoint: tuple[Path, Any]) -> None:
    """--limit-mm-per-prompt: a prompt with more images than allowed is refused before its images are decoded;
    image and video limits 0 leave the vision tower unloaded (text still served) and refuse images."""
    model_dir, _ = checkpoint
    llm = LLM(model=str(model_dir), device="cpu", block_size=4, max_model_len=96,
              limit_mm_per_prompt={"image": 1})
    two = _images([(24, 32), (16, 24)], seed=2)
    prompt = _prompt(llm, two, 4)
    with pytest.raises(RequestError, match=r"at most 1 image per prompt \(--limit-mm-per-prompt\), got 2"):
        llm.engine.add_request("a", prompt, SamplingParams(), images=two)
    with pytest.raises(RequestError, match="at most 1 image per prompt"):
        llm.engine.prepare_media("x", ["not decoded", "not decoded"])
    one = _images([(16, 24)], seed=1)
    llm.engine.add_request("b", _prompt(llm, one, 3), SamplingParams(max_tokens=1), images=one)
    llm.engine.abort_request("b")
    text_only = LLM(model=str(model_dir), device="cpu", block_size=4, max_model_len=96,
                    limit_mm_per_prompt={"image": 0, "video": 0})
    assert text_only.engine.model.visual is None and text_only.engine.images is None
    with pytest.raises(RequestError, match="no vision tower"):
        text_only.engine.add_request("c", prompt, SamplingParams(), images=two)
    out = text_only.generate([list(range(7, 20))], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


def test_image_request_restrictions(checkpoint: tuple[Path, Any]) -> None:
    model_dir, _ = checkpoint
    llm = LLM(model=str(model_dir), device="cpu", block_size=4, max_model_len=96)
    one = _images([(16, 24)], seed=1)
    prompt = _prompt(llm, one, 3)
    with pytest.raises(RequestError, match="placeholder"):
        llm.engine.add_request("b", prompt[:-8], SamplingParams(), images=one)
    req = llm.engine.add_request("c", prompt, SamplingParams(max_tokens=1), images=one)
    assert req.mrope_delta < 0 and req.cache_prompt_ids is not None and min(req.cache_prompt_ids) < 0
    llm.engine.abort_request("c")


def test_generate_with_multi_modal_data(checkpoint: tuple[Path, Any], tmp_path: Path) -> None:
    """LLM.generate with vLLM's prompt dict: raw images (an array and a PNG data URL) preprocessed with the
    checkpoint's processor settings, one placeholder per image expanded; same tokens as transformers."""
    import base64
    import io
    import shutil

    from PIL import Image

    model_dir, reference = checkpoint
    local = tmp_path / "model"
    shutil.copytree(model_dir, local)
    (local / "preprocessor_config.json").write_text(json.dumps(
        {"min_pixels": PROCESSOR.min_pixels, "max_pixels": PROCESSOR.max_pixels, "patch_size": 4}))
    llm = LLM(model=str(local), device="cpu", block_size=4, max_num_batched_tokens=8, max_model_len=96)
    gen = torch.Generator().manual_seed(7)
    arrays = [torch.randint(0, 256, (h, w, 3), generator=gen, dtype=torch.uint8).numpy()
              for h, w in [(16, 24), (24, 16)]]
    buf = io.BytesIO()
    Image.fromarray(arrays[1]).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    raw = json.loads((local / "config.json").read_text())
    start, end, pad = raw["vision_start_token_id"], raw["vision_end_token_id"], raw["image_token_id"]
    ids = [3, 4, start, pad, end, 5, 6, start, pad, end, 7]
    (out,) = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": [arrays[0], url]}},
                          SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    images = ImageInputs(*preprocess_images(arrays, PROCESSOR))
    prompt = llm.engine.expand_image_prompt(ids, images)
    assert out.prompt_token_ids == prompt
    assert out.outputs[0].token_ids == _expected(reference, prompt, images)


def test_chat_image_parts_become_template_placeholders() -> None:
    from nibble.models.multimodal import VISION_PLACEHOLDER, take_media

    messages = [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "data:x"}},
        {"type": "image", "image": "IMG"}, {"type": "text", "text": "b"}]}]
    conv, images, videos = take_media(messages)
    assert images == ["data:x", "IMG"] and videos == []
    assert [p["text"] for p in conv[0]["content"]] == ["a", VISION_PLACEHOLDER, VISION_PLACEHOLDER, "b"]


def test_chat_image_over_http(tmp_path: Path) -> None:
    """An image_url part (a PNG data URL) on /v1/chat/completions: the prompt is the chat template's with the
    image's placeholders expanded, and the greedy answer is transformers' for it. The same image as an
    input_image part on /v1/responses, a base64 block on /v1/messages, and fetched from an http:// URL (a local
    server) on all three gives the same prompt and answer; a URL that cannot be fetched is a 400 naming it."""
    import base64
    import io
    import socket

    import httpx
    from PIL import Image

    from nibble.engine.async_engine import AsyncEngine
    from nibble.engine.config import EngineConfig
    from tests.helpers.http_media import local_http_server, send_bytes
    from tests.helpers.server import start_server

    demo_tokenizer = Path(__file__).resolve().parents[2] / "nibble" / "assets" / "demo_tokenizer"
    model_dir = make_tiny_qwen35_moe(tmp_path / "vl", multimodal=True, seed=5, vocab_size=1024,
                                     tokenizer_dir=demo_tokenizer)
    raw = json.loads((model_dir / "config.json").read_text())
    # the demo tokenizer's vision tokens
    raw.update(vision_start_token_id=1000, vision_end_token_id=1001, image_token_id=1003)
    (model_dir / "config.json").write_text(json.dumps(raw))
    (model_dir / "preprocessor_config.json").write_text(json.dumps(
        {"min_pixels": PROCESSOR.min_pixels, "max_pixels": PROCESSOR.max_pixels, "patch_size": 4}))
    array = torch.randint(0, 256, (16, 24, 3), generator=torch.Generator().manual_seed(3), dtype=torch.uint8).numpy()
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                             {"type": "image_url", "image_url": {"url": url}}]}]

    engine = AsyncEngine.from_config(EngineConfig(model=str(model_dir), device="cpu", max_model_len=128,
                                                  block_size=4, max_num_batched_tokens=16))
    handle = start_server(engine)
    try:
        body = {"messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True,
                        "chat_template_kwargs": {"enable_thinking": False}, "logprobs": True}
        r = httpx.post(handle.url + "/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        out = r.json()
        tok = engine.engine.tokenizer
        text = tok.apply_chat_template([{"role": "user", "content": "What is this?<|vision_start|><|image_pad|>"
                                                                    "<|vision_end|>"}], enable_thinking=False)
        images = ImageInputs(*preprocess_images([array], PROCESSOR))
        prompt = engine.engine.expand_image_prompt(tok.encode(text, add_special_tokens=False), images)
        assert out["usage"]["prompt_tokens"] == len(prompt) == len(tok.encode(text)) - 1 + 6
        expected = _expected(_reference(model_dir), prompt, images)
        # the answer's tokens: as many as transformers generated, and the same text
        assert len(out["choices"][0]["logprobs"]["content"]) == len(expected) == MAX_TOKENS
        assert out["choices"][0]["message"]["content"] == tok.decode(expected)
        # /v1/responses: an input_image part of a user message is the same request
        rbody = {"input": [{"role": "user", "content": [{"type": "input_text", "text": "What is this?"},
                                                        {"type": "input_image", "image_url": url}]}],
                 "max_output_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True,
                 "reasoning": {"effort": "none"}}
        r = httpx.post(handle.url + "/v1/responses", json=rbody, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["input_tokens"] == len(prompt)
        assert r.json()["output"][-1]["content"][0]["text"] == tok.decode(expected)
        rbody["input"][0]["content"][1] = {"type": "input_image", "file_id": "file-1"}
        r = httpx.post(handle.url + "/v1/responses", json=rbody, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "input[0].content[1].image_url", r.text
        # /v1/messages: a base64 image block
        b64 = url.split(",", 1)[1]
        mbody = {"model": handle.model, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True,
                 "thinking": {"type": "disabled"}, "messages": [{"role": "user", "content": [
                     {"type": "text", "text": "What is this?"},
                     {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64}}]}]}
        r = httpx.post(handle.url + "/v1/messages", json=mbody, timeout=120)
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        assert usage["input_tokens"] + usage["cache_read_input_tokens"] == len(prompt)
        assert r.json()["content"][-1]["text"] == tok.decode(expected)
        with local_http_server({"/cat.png": send_bytes(buf.getvalue()),
                                "/notes.txt": send_bytes(b"not an image", "text/plain")}) as media:
            # the same PNG from an http:// URL: the same prompt and answer on the three endpoints
            fetched = media + "/cat.png"
            messages[0]["content"][1]["image_url"]["url"] = fetched
            r = httpx.post(handle.url + "/v1/chat/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["prompt_tokens"] == len(prompt)
            assert r.json()["choices"][0]["message"]["content"] == tok.decode(expected)
            mbody["messages"][0]["content"][1] = {"type": "image", "source": {"type": "url", "url": fetched}}
            r = httpx.post(handle.url + "/v1/messages", json=mbody, timeout=120)
            assert r.status_code == 200, r.text
            usage = r.json()["usage"]
            assert usage["input_tokens"] + usage["cache_read_input_tokens"] == len(prompt)
            assert r.json()["content"][-1]["text"] == tok.decode(expected)
            rbody["input"][0]["content"][1] = {"type": "input_image", "image_url": fetched}
            r = httpx.post(handle.url + "/v1/responses", json=rbody, timeout=120)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["input_tokens"] == len(prompt)
            assert r.json()["output"][-1]["content"][0]["text"] == tok.decode(expected)
            # a URL that cannot be had is a 400 naming it and why
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                closed = f"http://127.0.0.1:{s.getsockname()[1]}/cat.png"
            for bad, reason in ((media + "/missing.png", f"images: fetching {media}/missing.png: HTTP 404"),
                                (closed, f"images: fetching {closed}: cannot connect"),
                                (media + "/notes.txt", f"images: {media}/notes.txt: image data is not a recognised "
                                                       "image format")):
                messages[0]["content"][1]["image_url"]["url"] = bad
                r = httpx.post(handle.url + "/v1/chat/completions", json=body, timeout=60)
                assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
                assert r.json()["error"]["message"].startswith(reason), r.text
            mbody["messages"][0]["content"][1]["source"]["url"] = media + "/missing.png"
            r = httpx.post(handle.url + "/v1/messages", json=mbody, timeout=60)
            assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
            assert f"fetching {media}/missing.png: HTTP 404" in r.json()["error"]["message"], r.text
            # file:// is refused without --allowed-local-media-path
            rbody["input"][0]["content"][1]["image_url"] = "file:///etc/hostname"
            r = httpx.post(handle.url + "/v1/responses", json=rbody, timeout=60)
            assert r.status_code == 400 and "file:// URLs need --allowed-local-media-path" in r.text, r.text
    finally:
        handle.stop()
        engine.shutdown()
