"""Decoding encoded videos (nibble/models/video_decode.py) with PyAV, on small videos encoded here: kept frames
are resized as they are decoded with pixel values identical to resizing them after decoding, the container's
frame count may be wrong or missing, streams that report no frame rate, no size or huge frames are refused
before decoding, and a display-matrix rotation is applied."""

from __future__ import annotations

import io
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
import torch

from nibble.models.video_decode import MAX_VIDEO_SIDE, decode_video, upright
from nibble.models.video_processor import (
    VideoFrames,
    VideoProcessorParams,
    preprocess_video,
    sample_frame_indices,
    video_smart_resize,
)
from tests.vision.test_video_processor import TINY, _encode

av = pytest.importorskip("av")


def _noise(n: int, h: int, w: int, seed: int) -> np.ndarray:
    """Smooth random frames (mpeg4 keeps them close, and resizing them changes every pixel)."""
    g = torch.Generator().manual_seed(seed)
    coarse = torch.randint(0, 256, (n, 3, h // 4 + 1, w // 4 + 1), generator=g, dtype=torch.uint8)
    fine = torch.nn.functional.interpolate(coarse.float(), size=[h, w], mode="bilinear", align_corners=False)
    return fine.round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).contiguous().numpy()


def _decoded_at_source_size(data: bytes, params: VideoProcessorParams, quarters: int = 0) -> VideoFrames:
    """What decode_video held before it resized while decoding: every sampled frame at its source size (turned
    `quarters` quarter turns counter-clockwise with np.rot90), for preprocess_video to resize."""
    with av.open(io.BytesIO(data)) as container:
        fps = float(container.streams.video[0].average_rate)
        frames = [np.rot90(f.to_ndarray(format="rgb24"), quarters) for f in container.decode(video=0)]
    indices = sample_frame_indices(len(frames), fps, params)
    return VideoFrames(np.stack([frames[i] for i in indices]), fps, tuple(indices))


def _assert_same_video(got: VideoFrames, want: VideoFrames, params: VideoProcessorParams) -> None:
    assert got.indices == want.indices and got.fps == want.fps
    assert got.source_size == want.frames.shape[1:3]
    a, b = preprocess_video(got, params), preprocess_video(want, params)
    assert a.grid_thw == b.grid_thw and a.timestamps == b.timestamps and a.num_tokens == b.num_tokens
    assert torch.equal(a.pixel_values, b.pixel_values)


# (frames, height, width, fps, params): 5 of 25 frames shrunk to 16x32; 3 frames of 26x96 resized to 24x96,
# a size video_smart_resize does not keep (3 frames of 24x96 would become 24x104: the source size must decide);
# 4 frames of 20x30 to 16x32; 6 of 16x24 kept as they are
SIZES = [(25, 32, 48, 10, TINY), (3, 26, 96, 10, VideoProcessorParams(min_pixels=64, max_pixels=8192, patch_size=4)),
         (12, 20, 30, 10, TINY), (6, 16, 24, 2, TINY)]


@pytest.mark.parametrize(("n", "h", "w", "fps", "params"), SIZES)
def test_frames_resized_while_decoding_are_bit_identical(n: int, h: int, w: int, fps: int,
                                                         params: VideoProcessorParams) -> None:
    """decode_video holds its kept frames at the size preprocess_video resizes them to (not the source size),
    and the pixel values, grid and timestamps are those of resizing the source-size frames afterwards."""
    data = _encode(_noise(n, h, w, seed=n), fps)
    v = decode_video(data, params)
    size = video_smart_resize(len(v.indices), h, w, params)
    assert v.frames.shape == (len(v.indices), *size, 3) and v.source_size == (h, w)
    _assert_same_video(v, _decoded_at_source_size(data, params), params)
    if (h, w) == (26, 96):
        assert size == (24, 96) and video_smart_resize(len(v.indices), *size, params) == (24, 104)
    with pytest.raises(ValueError, match="were decoded at"):
        # frames resized for another source size are refused, not resized twice
        preprocess_video(VideoFrames(v.frames, v.fps, v.indices, (w, h)), params)


class _Stream:
    """A video stream whose reported attributes (and codec_context's width / height) are overridden."""

    def __init__(self, stream: Any, overrides: dict[str, Any]) -> None:
        self._stream, self._overrides = stream, overrides

    def __getattr__(self, name: str) -> Any:
        if name == "codec_context":
            ctx = self._stream.codec_context
            return type("Ctx", (), {k: self._overrides.get(k, getattr(ctx, k)) for k in ("width", "height")})()
        return self._overrides[name] if name in self._overrides else getattr(self._stream, name)


class _Container:
    """An input container whose first video stream reports the overrides; counts the frames decoded."""

    decoded = 0

    def __init__(self, container: Any, overrides: dict[str, Any]) -> None:
        self._c = container
        self.streams = type("Streams", (), {"video": [_Stream(container.streams.video[0], overrides)]})()

    def __enter__(self) -> _Container:
        return self

    def __exit__(self, *exc: object) -> None:
        self._c.close()

    def decode(self, **kw: Any) -> Iterator[Any]:
        for frame in self._c.decode(**kw):
            _Container.decoded += 1
            yield frame


@contextmanager
def _stream_reports(monkeypatch: pytest.MonkeyPatch, **overrides: Any) -> Iterator[None]:
    real_open = av.open
    _Container.decoded = 0
    with monkeypatch.context() as m:
        m.setattr(av, "open", lambda *a, **k: _Container(real_open(*a, **k), overrides))
        yield


@pytest.mark.parametrize("reported", [40, 12, 0, -1])
def test_wrong_container_frame_count(monkeypatch: pytest.MonkeyPatch, reported: int) -> None:
    """A container that over- or understates its frame count, or gives none: the frames are sampled (and so
    resized) over the 25 frames decoding finds, exactly as for the honest container."""
    data = _encode(_noise(25, 32, 48, seed=3), 10)
    honest = decode_video(data, TINY)
    with _stream_reports(monkeypatch, frames=reported):
        v = decode_video(data, TINY)
    assert v.indices == honest.indices == (0, 6, 12, 18, 24) and v.source_size == honest.source_size
    assert np.array_equal(v.frames, honest.frames)
    _assert_same_video(v, _decoded_at_source_size(data, TINY), TINY)


def test_matroska_without_frame_count() -> None:
    data = _encode(_noise(25, 32, 48, seed=4), 10, container="matroska")
    with av.open(io.BytesIO(data)) as container:
        assert container.streams.video[0].frames == 0
    _assert_same_video(decode_video(data, TINY), _decoded_at_source_size(data, TINY), TINY)


def test_too_few_frames() -> None:
    """One frame is less than a temporal patch, whether the container's count says so or decoding does."""
    data = _encode(_noise(1, 16, 24, seed=5), 10)
    with pytest.raises(ValueError, match="at least 2 frames"):
        decode_video(data, TINY)
    with pytest.raises(ValueError, match="at least 2 frames"):
        decode_video(_encode(_noise(1, 16, 24, seed=5), 10, container="matroska"), TINY)


@pytest.mark.parametrize(("overrides", "match"), [
    ({"average_rate": 0, "guessed_rate": None, "base_rate": None}, "no frame rate"),
    ({"width": 0}, "frame size 0x32 is empty"),
    ({"height": 0}, "frame size 48x0 is empty"),
    ({"width": MAX_VIDEO_SIDE + 1}, "larger than 16384 pixels a side"),
    ({"height": 100_000}, "larger than 16384 pixels a side"),
])
def test_bad_streams_refused_before_decoding(monkeypatch: pytest.MonkeyPatch, overrides: dict[str, Any],
                                             match: str) -> None:
    data = _encode(_noise(4, 32, 48, seed=6), 10)
    with _stream_reports(monkeypatch, **overrides), pytest.raises(ValueError, match=match):
        decode_video(data, TINY)
    assert _Container.decoded == 0


def test_huge_frames_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """A real stream of 16400-pixel-wide frames (raw video, cheap to make) is refused from the size it
    reports, and from its first decoded frame when it reports a small one."""
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="avi") as out:
        stream = out.add_stream("rawvideo", rate=10)
        stream.width, stream.height, stream.pix_fmt = MAX_VIDEO_SIDE + 16, 16, "rgb24"
        for f in np.zeros((4, 16, MAX_VIDEO_SIDE + 16, 3), np.uint8):
            for packet in stream.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    with pytest.raises(ValueError, match=r"stream's frames of 16400x16 are larger than 16384 pixels a side"):
        decode_video(buf.getvalue(), TINY)
    with _stream_reports(monkeypatch, width=48), pytest.raises(ValueError, match=r"video's frames of 16400x16"):
        decode_video(buf.getvalue(), TINY)


def test_upright_turns_by_the_display_rotation() -> None:
    """upright turns a frame rotation degrees counter-clockwise (FFmpeg's display-matrix angle): -90, the
    rotation of a phone video recorded upright, is a quarter turn clockwise; other angles are left alone."""
    a = np.arange(6).reshape(2, 3, 1)  # [[0, 1, 2], [3, 4, 5]]
    assert upright(a, 0)[..., 0].tolist() == [[0, 1, 2], [3, 4, 5]]
    assert upright(a, -90)[..., 0].tolist() == [[3, 0], [4, 1], [5, 2]]  # clockwise: the left column on top
    assert upright(a, 270)[..., 0].tolist() == [[3, 0], [4, 1], [5, 2]]
    assert upright(a, 90)[..., 0].tolist() == [[2, 5], [1, 4], [0, 3]]  # counter-clockwise
    assert upright(a, 180)[..., 0].tolist() == upright(a, -180)[..., 0].tolist() == [[5, 4, 3], [2, 1, 0]]
    assert upright(a, 45) is a and upright(a, 89.5)[..., 0].tolist() == [[2, 5], [1, 4], [0, 3]]


@pytest.mark.parametrize(("rotation", "quarters", "corner"), [(-90, -1, (0, -1)), (90, 1, (-1, 0)),
                                                              (180, 2, (-1, -1))])
def test_rotated_video_decodes_upright(rotation: int, quarters: int, corner: tuple[int, int]) -> None:
    """A 32x48 video with a display matrix (written with PyAV's set_display_rotation): its frames come out
    turned, the white block of the stored frame's top-left corner in the corner the rotation takes it to
    (-90, a phone's portrait video: top-right), resized for the upright size (a quarter turn: 32 wide, 48
    high, resized to 16x32), with the pixel values of turning and then resizing the source-size frames."""
    if not hasattr(av.video.stream.VideoStream, "set_display_rotation"):
        pytest.skip("this PyAV cannot write a display matrix")
    frames = _noise(25, 32, 48, seed=7) // 2
    frames[:, :12, :12] = 255
    data = _encode(frames, 10, rotation=rotation)
    v = decode_video(data, TINY)
    source = (48, 32) if rotation % 180 else (32, 48)
    assert v.source_size == source and v.frames.shape[1:3] == video_smart_resize(5, *source, TINY)
    assert v.frames.shape[1:3] == ((32, 16) if rotation % 180 else (16, 32))
    h, w = v.frames.shape[1:3]
    rows = slice(0, h // 8) if corner[0] == 0 else slice(h - h // 8, h)
    cols = slice(0, w // 8) if corner[1] == 0 else slice(w - w // 8, w)
    assert v.frames[:, rows, cols].min() > 200 and v.frames.mean() < 150
    _assert_same_video(v, _decoded_at_source_size(data, TINY, quarters), TINY)
