"""A request's video, in any of the forms it may come in, as the `VideoFrames` the processor takes
(video_processor.py).

- Encoded video: bytes (a fetched http(s):// or file:// URL's too: engine/media.py) or a
  `data:video/...;base64,...` URL, decoded with PyAV (the optional `av` dependency: `pip install nibble[video]`)
  and sampled at the processor's fps while decoding; the source frame rate is the stream's average rate, as
  transformers' PyAV loader takes it. Each kept frame is resized as soon as it is decoded, to the size
  `preprocess_video` would give it (`video_smart_resize` of the kept frame count and the source size, the same
  `resize_frames`), so only the resized frames are held: at most the processor's pixel budget over all frames
  (25165824 pixels, 75 MB, by default) instead of up to 768 source frames (19 GB of 4K), with pixel values
  identical to resizing them all afterwards. A stream that reports no frame rate, no size or a side above
  16384 pixels is refused before any frame is decoded. Every frame is still decoded (to count them and reach
  the kept ones), so decoding time grows with the video's length; only the size of the encoded video (for a
  fetched one `--max-media-bytes`, engine/media.py) bounds it.
- Rotation: a stream's display matrix (phone videos are stored sideways with one) is applied, as the ffmpeg
  command line does by default (so do OpenCV's FFmpeg backend, which vLLM's default video loader uses, unless
  CAP_PROP_ORIENTATION_AUTO is turned off, and torchcodec from 0.11): a frame PyAV reports with
  `VideoFrame.rotation` r (FFmpeg's counter-clockwise display angle, within a degree of a multiple of 90) is
  turned r degrees counter-clockwise before it is resized, so the model sees the video upright and the pixel
  budget uses its upright height and width. transformers' PyAV loader does not rotate: its frames, and so
  its pixel values for such a video, are as stored. Flips in the matrix and other angles are ignored; PyAV
  builds without `VideoFrame.rotation` leave frames as stored.
- Frames already sampled: an RGB uint8 array or tensor [T, H, W, 3], or a list of frames (PIL images or
  [H, W, 3] arrays). They are used as they are, as vLLM takes pre-sampled frames; without metadata they are
  taken to be 1 / fps seconds apart (fps: the processor's sampling rate).
- `(frames, metadata)` as vLLM takes them: metadata {"fps": source frame rate, "frames_indices": each frame's
  index in the source (default 0..T-1), "do_sample_frames": sample these frames at the processor's fps first
  (default false)}.

Every problem is a ValueError with the reason.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import torch

from nibble.models.video_processor import (
    VideoFrames,
    VideoProcessorParams,
    resize_frames,
    sample_frame_indices,
    video_smart_resize,
)
from nibble.models.vision_processor import data_url_bytes, to_rgb

NEEDS_PYAV = "video input needs PyAV: pip install av"
# the largest frame side decoded (FFmpeg's own limit is far above; one 16384 x 16384 RGB frame is 768 MB)
MAX_VIDEO_SIDE = 16384


def to_video_frames(video: Any, params: VideoProcessorParams) -> VideoFrames:
    """Any accepted form of one video (module docstring) -> its frames to process."""
    if isinstance(video, VideoFrames):
        return video
    if isinstance(video, str | bytes | bytearray | memoryview):
        return decode_video(video, params)
    if isinstance(video, tuple) and len(video) == 2 and isinstance(video[1], dict):
        frames, meta = _stack(video[0]), video[1]
        fps = meta.get("fps")
        if fps is None:
            raise ValueError("video metadata needs 'fps' (the frame rate of the video the frames come from)")
        indices = meta.get("frames_indices")
        indices = list(range(len(frames))) if indices is None else [int(i) for i in np.asarray(indices).ravel()]
        if len(indices) != len(frames):
            raise ValueError(f"video metadata has {len(indices)} frames_indices for {len(frames)} frames")
        if meta.get("do_sample_frames"):
            keep = sample_frame_indices(len(frames), float(fps), params)
            frames, indices = frames[keep], [indices[k] for k in keep]
        return VideoFrames(frames, float(fps), tuple(indices))
    frames = _stack(video)
    return VideoFrames(frames, float(params.fps), tuple(range(len(frames))))


def _stack(frames: Any) -> np.ndarray:
    """uint8 [T, H, W, 3] from an array/tensor of that shape or a list of PIL images / [H, W, 3] arrays."""
    from PIL import Image

    if isinstance(frames, torch.Tensor):
        frames = frames.cpu().numpy()
    if isinstance(frames, list | tuple):
        if not frames:
            raise ValueError("the video has no frames")
        arrays = []
        for f in frames:
            if isinstance(f, Image.Image):
                f = np.asarray(to_rgb(f))
            elif isinstance(f, torch.Tensor):
                f = f.cpu().numpy()
            if not isinstance(f, np.ndarray) or f.dtype != np.uint8 or f.ndim != 3 or f.shape[-1] != 3:
                what = f"{f.dtype} {tuple(f.shape)}" if isinstance(f, np.ndarray) else type(f).__name__
                raise ValueError(f"video frames must be PIL images or RGB uint8 arrays [H, W, 3], got {what}")
            arrays.append(f)
        if len({a.shape for a in arrays}) != 1:
            raise ValueError(f"the frames of a video must all have one size, got {sorted({a.shape for a in arrays})}")
        frames = np.stack(arrays)
    if not isinstance(frames, np.ndarray):
        raise ValueError(f"a video is encoded bytes, a data:video URL, an RGB uint8 array [T, H, W, 3], a list of "
                         f"frames or (frames, metadata), got {type(frames).__name__}")
    if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3 or frames.shape[0] == 0:
        raise ValueError(f"video frames must be an RGB uint8 array [T, H, W, 3], got {frames.dtype} "
                         f"{tuple(frames.shape)}")
    return frames


def decode_video(source: str | bytes | bytearray | memoryview, params: VideoProcessorParams) -> VideoFrames:
    """An encoded video (bytes or a `data:video/...;base64,` URL) -> its frames sampled at the processor's fps,
    RGB, upright, already resized for `preprocess_video` (`source_size` set). ValueError when PyAV is missing,
    the data is no video (or is corrupt), it has too few frames, or its stream reports no frame rate, no size or
    too large a size."""
    try:
        import av
    except ImportError:
        raise ValueError(NEEDS_PYAV) from None
    data = (data_url_bytes(source, "video", "http(s):// or file:// URLs (the engine fetches those first: "
                                             "engine/media.py), bytes or frames")
            if isinstance(source, str) else bytes(source))
    if not data:
        raise ValueError("video data is empty")
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.video:
                raise ValueError("the data holds no video stream")
            stream = container.streams.video[0]
            rate = stream.average_rate or stream.guessed_rate or stream.base_rate
            if not rate or rate <= 0:
                raise ValueError("the video stream has no frame rate")
            fps = float(rate)
            _check_size(stream.codec_context.width, stream.codec_context.height, "the video stream's")
            total = int(stream.frames)
        # two passes at most: the container's frame count (if any) decides the sampling and so the resized
        # size; when decoding finds another count (or the container gives none), the second pass samples the
        # frames that are there
        for _ in range(2):
            indices = sample_frame_indices(total, fps, params) if total > 0 else []
            # too few frames for a temporal patch: only count them, the count may yet prove the container wrong
            keep = indices if len(indices) >= params.temporal_patch_size else []
            count, frames, source_size = _decode(av, data, keep, params)
            if count == total:
                break
            total = count
    except av.FFmpegError as exc:
        raise ValueError(f"video data is not a decodable video: {exc}") from None
    if count == 0:
        raise ValueError("the video has no frames")
    if count == total and len(indices) < params.temporal_patch_size:
        raise ValueError(f"a video needs at least {params.temporal_patch_size} frames (one temporal patch), got "
                         f"{len(indices)}")
    if count != total or frames is None or source_size is None:
        raise ValueError("the video's frames could not all be decoded")
    return VideoFrames(frames, fps, tuple(indices), source_size)


def _check_size(width: int, height: int, what: str) -> None:
    if width <= 0 or height <= 0:
        raise ValueError(f"{what} frame size {width}x{height} is empty")
    if max(width, height) > MAX_VIDEO_SIDE:
        raise ValueError(f"{what} frames of {width}x{height} are larger than {MAX_VIDEO_SIDE} pixels a side")


def upright(frame: np.ndarray, rotation: float) -> np.ndarray:
    """A decoded frame [H, W, C] turned by its display rotation: rotation degrees counter-clockwise (PyAV's
    `VideoFrame.rotation`, FFmpeg's av_display_rotation_get), so a phone video stored sideways (-90) is turned
    a quarter clockwise to [W, H, C]. Angles other than multiples of 90 are ignored. A view, not a copy."""
    quarters = round(rotation / 90)
    if abs(rotation - 90 * quarters) > 1:
        return frame
    return np.rot90(frame, k=quarters % 4)


def _decode(av: Any, data: bytes, indices: list[int], params: VideoProcessorParams
            ) -> tuple[int, np.ndarray | None, tuple[int, int] | None]:
    """Decode the first video stream: (its number of frames, the frames at indices (in that order, repeats
    allowed) upright and resized to `video_smart_resize(len(indices), *upright source size)`: uint8
    [len(indices), h, w, 3], that source (height, width)); frames and size are None when indices is empty or
    not all of them were decoded. Only one source frame is held at a time."""
    slots: dict[int, list[int]] = {}
    for pos, index in enumerate(indices):
        slots.setdefault(index, []).append(pos)
    out: np.ndarray | None = None
    source_size: tuple[int, int] | None = None
    size = (0, 0)
    filled = 0
    count = 0
    with av.open(io.BytesIO(data), mode="r") as container:
        for frame in container.decode(video=0):
            if count in slots:
                # VideoFrame.rotation is missing from older PyAV builds: their frames stay as stored
                rgb = upright(frame.to_ndarray(format="rgb24"), getattr(frame, "rotation", 0))
                if source_size is None:
                    source_size = (rgb.shape[0], rgb.shape[1])
                    _check_size(source_size[1], source_size[0], "the video's")
                    size = video_smart_resize(len(indices), *source_size, params)
                    out = np.empty((len(indices), *size, 3), dtype=np.uint8)
                elif rgb.shape[:2] != source_size:
                    raise ValueError(f"the video's frames are not all one size: {source_size[1]}x{source_size[0]} "
                                     f"and {rgb.shape[1]}x{rgb.shape[0]}")
                assert out is not None
                resized = resize_frames(rgb[None], size)[0].permute(1, 2, 0).numpy()  # [h, w, 3]
                for pos in slots[count]:
                    out[pos] = resized
                    filled += 1
            count += 1
    if out is None or filled != len(indices):
        return count, None, None
    return count, out, source_size
