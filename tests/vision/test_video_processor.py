"""Video preprocessing (nibble/models/video_processor.py, video_decode.py) against transformers' Qwen3-VL
video processor, piece by piece: torchvision is not installed, so `Qwen3VLVideoProcessor` cannot run as a
whole, but its frame sampling, resize arithmetic, timestamps, patch order and token counts are plain functions
that run here. Decoding is checked on a small video encoded with PyAV in the test (skipped without `av`);
M-RoPE positions of prompts mixing images and videos against transformers' `get_rope_index`."""

from __future__ import annotations

import base64
import functools
import io
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from nibble.models.mrope import mrope_positions
from nibble.models.multimodal import (
    VIDEO_PLACEHOLDER,
    VISION_PLACEHOLDER,
    ImageInputs,
    VideoInputs,
    expand_video_tokens,
    take_media,
    video_placeholder_ids,
    vision_cache_ids,
)
from nibble.models.video_decode import NEEDS_PYAV, decode_video, to_video_frames
from nibble.models.video_processor import (
    VideoFrames,
    VideoProcessorParams,
    frame_timestamps,
    preprocess_video,
    sample_frame_indices,
    video_smart_resize,
)

IMAGE, VIDEO, START, END = 248056, 248057, 248053, 248054
TINY = VideoProcessorParams(min_pixels=64, max_pixels=4096, patch_size=4, max_frames=8)


def _hf_processor(params: VideoProcessorParams) -> SimpleNamespace:
    """The attributes transformers' Qwen3VLVideoProcessor methods read, as `self`."""
    return SimpleNamespace(fps=params.fps, min_frames=params.min_frames, max_frames=params.max_frames,
                           size={"shortest_edge": params.min_pixels, "longest_edge": params.max_pixels},
                           patch_size=params.patch_size, merge_size=params.merge_size,
                           temporal_patch_size=params.temporal_patch_size,
                           cap_pixels_per_frame=params.cap_pixels_per_frame, max_video_tokens=params.max_video_tokens)


@pytest.mark.parametrize("total,fps", [(30, 10.0), (8, 30.0), (3, 24.0), (2000, 25.0), (101, 29.97), (1, 1.0)])
def test_frame_sampling_matches_transformers(total: int, fps: float) -> None:
    """Frame indices (fps 2, 4 to 768 frames; and a max_frames of 8) are Qwen3VLVideoProcessor.sample_frames'."""
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    from transformers.video_utils import VideoMetadata

    for params in (VideoProcessorParams(), TINY):
        want = Qwen3VLVideoProcessor.sample_frames(_hf_processor(params),
                                                   VideoMetadata(total_num_frames=total, fps=fps)).tolist()
        assert sample_frame_indices(total, fps, params) == want
    assert sample_frame_indices(5, 30.0, VideoProcessorParams(do_sample_frames=False)) == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="no frames"):
        sample_frame_indices(0, 30.0, TINY)


def test_timestamps_match_transformers() -> None:
    """Each temporal patch at the mean time of its first and last frame, an odd count padded with the last
    frame: Qwen3VLProcessor._calculate_timestamps."""
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    for indices, fps in (([0, 6, 12, 17, 23], 10.0), ([0, 6, 12, 17, 23, 29], 10.0), (list(range(9)), 2.0),
                         ([3, 50, 97, 144], 29.97)):
        assert frame_timestamps(indices, fps, 2) == Qwen3VLProcessor._calculate_timestamps(None, list(indices), fps, 2)
    assert frame_timestamps([0, 6, 12, 17, 23], 10.0, 2) == pytest.approx([0.3, 1.45, 2.3])


def test_resize_matches_transformers() -> None:
    """Resized sizes over frame counts, sizes (tiny, huge, thin) and limits, with and without the per-frame cap,
    are transformers' smart_resize (and the cap arithmetic of Qwen3VLVideoProcessor.resize); token counts are
    get_num_of_video_patches'."""
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor, smart_resize

    sizes = [(16, 24), (20, 30), (7, 300), (480, 640), (1080, 1920), (2160, 3840), (33, 33), (5, 900)]
    for params in (VideoProcessorParams(), TINY, VideoProcessorParams(cap_pixels_per_frame=True),
                   VideoProcessorParams(min_pixels=128 * 32 * 32, max_pixels=768 * 32 * 32)):
        f = params.factor
        for frames in (2, 3, 4, 9, 64, 768):
            for h, w in sizes:
                max_pixels = params.max_pixels
                if params.cap_pixels_per_frame:
                    per_frame = max(min(params.max_video_tokens * f * f, params.max_pixels // frames),
                                    int(params.min_pixels * 1.05))
                    max_pixels = per_frame * frames
                want = smart_resize(frames, h, w, temporal_factor=2, factor=f, min_pixels=params.min_pixels,
                                    max_pixels=max_pixels)
                assert video_smart_resize(frames, h, w, params) == want, (params, frames, h, w)
                if not params.cap_pixels_per_frame:
                    rh, rw = want
                    patches = Qwen3VLVideoProcessor.get_num_of_video_patches(_hf_processor(params), frames, h, w)
                    assert -(-frames // 2) * (rh // params.patch_size) * (rw // params.patch_size) == patches
    with pytest.raises(ValueError, match="at least 2 frames"):
        video_smart_resize(1, 32, 32, TINY)
    with pytest.raises(ValueError, match="aspect ratio"):
        video_smart_resize(4, 10, 4000, TINY)


def test_pixel_values_match_transformers_pipeline() -> None:
    """pixel_values of an odd number of 20x30 frames: resized to 16x32 with torch's antialiased uint8 bicubic
    (what torchvision runs for transformers on the CPU), normalised as transformers' fused rescale, the last
    frame repeated, and patchified by Qwen3VLVideoProcessor.patchify itself; grid and timestamps alike."""
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    frames = torch.randint(0, 256, (5, 20, 30, 3), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    video = VideoFrames(frames.numpy(), fps=10.0, indices=(0, 6, 12, 17, 23))
    out = preprocess_video(video, TINY)
    x = F.interpolate(frames.permute(0, 3, 1, 2).contiguous(), size=[16, 32], mode="bicubic", align_corners=False,
                      antialias=True).float()
    x = (x - 127.5) / 127.5
    want, gt, gh, gw = Qwen3VLVideoProcessor.patchify(None, x[None], 4, 2, 2)
    assert (gt, gh, gw) == out.grid_thw == (3, 4, 8)
    assert torch.equal(out.pixel_values, want[0])
    assert out.num_tokens == 3 * 4 * 8 // 4 and out.timestamps == pytest.approx((0.3, 1.45, 2.3))
    # a frame already of its resized size is not resampled
    same = preprocess_video(VideoFrames(frames[:, :16, :24].numpy().copy(), 2.0, (0, 1, 2, 3, 4)), TINY)
    direct = (frames[:, :16, :24].permute(0, 3, 1, 2).float() - 127.5) / 127.5
    assert torch.equal(same.pixel_values, Qwen3VLVideoProcessor.patchify(None, direct[None], 4, 2, 2)[0][0])


def test_frame_inputs() -> None:
    """Arrays, tensors and frame lists are taken as sampled frames 1 / fps apart; (frames, metadata) as vLLM
    passes them carries the source fps and indices, and may ask for sampling first."""
    from PIL import Image

    arr = np.random.default_rng(0).integers(0, 256, (6, 16, 24, 3), dtype=np.uint8)
    v = to_video_frames(arr, TINY)
    assert v.fps == 2.0 and v.indices == tuple(range(6)) and np.array_equal(v.frames, arr)
    assert np.array_equal(to_video_frames(torch.from_numpy(arr), TINY).frames, arr)
    assert np.array_equal(to_video_frames([Image.fromarray(a) for a in arr], TINY).frames, arr)
    v = to_video_frames((arr, {"fps": 30.0, "frames_indices": [0, 5, 10, 15, 20, 25]}), TINY)
    assert v.fps == 30.0 and v.indices == (0, 5, 10, 15, 20, 25)
    v = to_video_frames((arr, {"fps": 3.0, "do_sample_frames": True}), TINY)
    assert v.indices == (0, 2, 3, 5) and np.array_equal(v.frames, arr[[0, 2, 3, 5]])
    for bad, match in ((arr[..., :2], "RGB uint8"), ([arr[0], arr[1, :8]], "one size"), ([], "no frames"),
                       ((arr, {}), "'fps'"), ((arr, {"fps": 2, "frames_indices": [1]}), "frames_indices"),
                       (3, "a video is"), ("https-not-a-data-url", "data:video")):
        with pytest.raises(ValueError, match=match):
            to_video_frames(bad, TINY)


def _encode(frames: np.ndarray, fps: int, container: str = "mp4", rotation: int | None = None) -> bytes:
    """frames [T, H, W, 3] as an mpeg4 video; rotation: a display matrix rotating them that many degrees
    counter-clockwise (as PyAV reads it back as VideoFrame.rotation)."""
    import av

    buf = io.BytesIO()
    with av.open(buf, mode="w", format=container) as out:
        stream = out.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        stream.options = {"qscale": "1"}
        if rotation is not None:
            stream.set_display_rotation(rotation)
        for f in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


def test_decode_video_with_pyav() -> None:
    """An mp4 of 25 flat-colour frames at 10 fps: 5 frames kept (25 / 10 * 2), evenly spaced, decoded to
    their colours (mpeg4 is lossy: within a few levels); the same from a data URL; errors name the problem."""
    pytest.importorskip("av")
    levels = np.arange(25) * 10
    frames = np.repeat(levels[:, None, None, None], 3, axis=3).repeat(32, axis=1).repeat(48, axis=2).astype(np.uint8)
    data = _encode(frames, 10)
    v = decode_video(data, TINY)
    # held already resized to the 16x32 preprocess_video gives 5 frames of 32x48
    assert v.fps == 10.0 and v.indices == (0, 6, 12, 18, 24) and v.frames.shape == (5, 16, 32, 3)
    assert v.source_size == (32, 48)
    assert np.abs(v.frames.astype(int).mean(axis=(1, 2, 3)) - levels[list(v.indices)]).max() < 4
    url = "data:video/mp4;base64," + base64.b64encode(data).decode()
    assert np.array_equal(decode_video(url, TINY).frames, v.frames)
    out = preprocess_video(v, TINY)
    assert out.grid_thw == (3, 4, 8) and out.timestamps == pytest.approx((0.3, 1.5, 2.4))
    for bad, match in ((b"not a video at all", "not a decodable video"), (b"", "empty"),
                       ("data:image/png;base64,AAAA", "not a video"), ("data:video/mp4;base64,@@", "base64")):
        with pytest.raises(ValueError, match=match):
            decode_video(bad, TINY)


def test_decode_without_pyav(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "av", None)
    with pytest.raises(ValueError, match=NEEDS_PYAV):
        decode_video(b"\0\0\0 ftypisom", TINY)
    assert NEEDS_PYAV == "video input needs PyAV: pip install av"


def test_params_from_model_dir(tmp_path: Path) -> None:
    """processor_config.json's video_processor, else video_preprocessor_config.json, else the image processor's
    preprocessor_config.json; a Qwen3.5 video config; refusals."""
    config = {"vision_config": {"patch_size": 16, "temporal_patch_size": 2, "spatial_merge_size": 2}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert VideoProcessorParams.from_model_dir(tmp_path) == VideoProcessorParams()
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"size": {"shortest_edge": 65536,
                                                                           "longest_edge": 16777216}}))
    assert VideoProcessorParams.from_model_dir(tmp_path).min_pixels == 65536
    qwen = {"size": {"longest_edge": 25165824, "shortest_edge": 4096}, "patch_size": 16, "temporal_patch_size": 2,
            "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "fps": 2, "min_frames": 4,
            "max_frames": 768, "do_sample_frames": True, "resample": 3, "rescale_factor": 0.00392156862745098,
            "processor_class": "Qwen3VLProcessor", "video_processor_type": "Qwen3VLVideoProcessor"}
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps(qwen))
    params = VideoProcessorParams.from_model_dir(tmp_path)
    assert params == VideoProcessorParams(rescale_factor=0.00392156862745098)
    (tmp_path / "processor_config.json").write_text(json.dumps({"video_processor": {**qwen, "fps": 1}}))
    assert VideoProcessorParams.from_model_dir(tmp_path).fps == 1.0
    (tmp_path / "processor_config.json").write_text(json.dumps({"video_processor": {**qwen, "patch_size": 14}}))
    with pytest.raises(ValueError, match="patch_size=14 but the vision tower has 16"):
        VideoProcessorParams.from_model_dir(tmp_path)
    for bad, match in (({"num_frames": 16}, "num_frames"), ({"resample": 2}, "bicubic"),
                       ({"do_normalize": False}, "do_normalize"), ({"min_frames": 9, "max_frames": 8}, "min_frames")):
        with pytest.raises(ValueError, match=match):
            VideoProcessorParams.from_dict(bad)


def _hf_rope_index(ids: list[int], image_grid: list[list[int]], video_grid: list[list[int]]
                   ) -> tuple[torch.Tensor, int]:
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeModel

    model = SimpleNamespace(config=SimpleNamespace(vision_config=SimpleNamespace(spatial_merge_size=2)))
    model.get_vision_position_ids = functools.partial(Qwen3_5MoeModel.get_vision_position_ids, model)
    t = torch.tensor([ids])
    mm = (t == IMAGE).int() + 2 * (t == VIDEO).int()
    images = torch.tensor(image_grid) if image_grid else None
    videos = torch.tensor(video_grid) if video_grid else None
    pos, delta = Qwen3_5MoeModel.get_rope_index(model, t, mm, images, videos)
    return pos[:, 0], int(delta)


def test_mrope_positions_with_videos_match_transformers() -> None:
    """A prompt with a video (3 temporal patches of 2x3 tokens, timestamps between), an image and a second
    video of another size: nibble's positions and delta are get_rope_index's (which splits each video into
    t one-patch grids)."""
    stamps = [[11, 12, 13], [14, 15], [16, 17, 18]]
    first = video_placeholder_ids(stamps, 6, VIDEO, START, END)
    second = video_placeholder_ids([[21], [22]], 4, VIDEO, START, END)
    prompt = [1, 2, START, VIDEO, END, 3, START, IMAGE, END, 4, 5, START, VIDEO, END, 6]
    ids = expand_video_tokens(prompt, VIDEO, START, END, [first, second])
    ids = [t for i in ids for t in ([IMAGE] * 8 if i == IMAGE else [i])]
    assert ids.count(VIDEO) == 3 * 6 + 2 * 4 and ids.count(START) == 3 + 1 + 2
    videos, images = [[3, 4, 6], [2, 4, 4]], [[1, 4, 8]]
    want, want_delta = _hf_rope_index(ids, images, videos)
    got, delta = mrope_positions(ids, images, IMAGE, 2, videos, VIDEO)
    assert torch.equal(got, want) and delta == want_delta
    only_video = expand_video_tokens([7, START, VIDEO, END, 8], VIDEO, START, END, [first])
    want, want_delta = _hf_rope_index(only_video, [], [[3, 4, 6]])
    got, delta = mrope_positions(only_video, None, IMAGE, 2, [[3, 4, 6]], VIDEO)
    assert torch.equal(got, want) and delta == want_delta
    # without videos, video placeholders are text; a frame short of placeholders is refused
    assert mrope_positions(only_video, None, IMAGE, 2)[1] == 0
    with pytest.raises(ValueError, match="video frame 2"):
        mrope_positions(only_video[:-3], None, IMAGE, 2, [[3, 4, 6]], VIDEO)


def test_video_placeholder_expansion_and_cache_ids() -> None:
    """The template's <vision_start><video_pad><vision_end> (or a bare <video_pad>) becomes, per temporal
    patch, timestamp text + <vision_start> + its placeholders + <vision_end>; prefix-cache ids differ between
    videos and between an image and a video of the same pixels."""
    rep = video_placeholder_ids([[9], [8]], 2, VIDEO, START, END)
    assert rep == [9, START, VIDEO, VIDEO, END, 8, START, VIDEO, VIDEO, END]
    assert expand_video_tokens([1, START, VIDEO, END, 2], VIDEO, START, END, [rep]) == [1, *rep, 2]
    assert expand_video_tokens([1, VIDEO, 2], VIDEO, START, END, [rep]) == [1, *rep, 2]
    with pytest.raises(ValueError, match="2 video placeholders for 1 videos"):
        expand_video_tokens([VIDEO, VIDEO], VIDEO, START, END, [rep])
    pixels = torch.randn(16, 96, generator=torch.Generator().manual_seed(1))
    video = VideoInputs(pixels, torch.tensor([[2, 2, 4]]))
    other = VideoInputs(pixels.flip(0), torch.tensor([[2, 2, 4]]))
    image = ImageInputs(pixels, torch.tensor([[1, 4, 4]]))
    ids = [1, *rep, 2]
    a = vision_cache_ids(ids, 2, {VIDEO: video})
    assert a[0] == 1 and a[-1] == 2 and len({x for x in a if x < 0}) == 4
    assert a == vision_cache_ids(ids, 2, {VIDEO: VideoInputs(pixels.clone(), torch.tensor([[2, 2, 4]]))})
    assert set(a).isdisjoint(x for x in vision_cache_ids(ids, 2, {VIDEO: other}) if x < 0)
    as_image = vision_cache_ids([IMAGE] * 4, 2, {IMAGE: image})
    assert set(as_image).isdisjoint(a)


def test_chat_video_parts_become_template_placeholders() -> None:
    """vLLM's video_url parts and {"type": "video"} parts become the template's video placeholder, in order,
    beside image parts."""
    messages = [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}, {"type": "text", "text": "a"},
        {"type": "image_url", "image_url": {"url": "data:x"}}, {"type": "video", "video": "CLIP"}]},
        {"role": "assistant", "content": "ok"}]
    conv, images, videos = take_media(messages)
    assert images == ["data:x"] and videos == ["data:video/mp4;base64,AAAA", "CLIP"]
    assert [p["text"] for p in conv[0]["content"]] == [VIDEO_PLACEHOLDER, "a", VISION_PLACEHOLDER, VIDEO_PLACEHOLDER]
    assert conv[1] == messages[1]
