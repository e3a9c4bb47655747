"""A request's video, in any of the forms it may come in, as the `VideoFrames` the processor takes
(video_processor.py).

- Encoded video: bytes (a fetched http(s):// or file:// URL's too: engine/media.py) or a
  `data:video/...;base64,...` URL, decoded with PyAV (the optional `av` dependency: `pip install nibble[video]`)
  and sampled at the processor's fps while decoding, so only the kept frames are held; the source frame rate
  is the stream's average rate, as transformers' PyAV loader takes it.
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

from nibble.models.video_processor import VideoFrames, VideoProcessorParams, sample_frame_indices
from nibble.models.vision_processor import data_url_bytes, to_rgb

NEEDS_PYAV = "video input needs PyAV: pip install av"


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
    RGB. ValueError when PyAV is missing, the data is no video (or is corrupt), or it has no frames."""
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
            total = int(stream.frames)
        if total <= 0:
            # the container does not say: count by decoding
            total, _ = _decode(av, data, set())
        indices = sample_frame_indices(total, fps, params)
        count, kept = _decode(av, data, set(indices))
        if count != total:
            # the container's frame count was wrong: sample again over the frames that are there
            indices = sample_frame_indices(count, fps, params)
            count, kept = _decode(av, data, set(indices))
    except av.FFmpegError as exc:
        raise ValueError(f"video data is not a decodable video: {exc}") from None
    if len(kept) != len(set(indices)) or len({f.shape for f in kept.values()}) != 1:
        raise ValueError("the video's frames could not all be decoded at one size")
    return VideoFrames(np.stack([kept[i] for i in indices]), fps, tuple(indices))


def _decode(av: Any, data: bytes, wanted: set[int]) -> tuple[int, dict[int, np.ndarray]]:
    """(number of frames of the first video stream, RGB uint8 [H, W, 3] of the frames whose index is wanted)."""
    kept: dict[int, np.ndarray] = {}
    count = 0
    with av.open(io.BytesIO(data), mode="r") as container:
        for frame in container.decode(video=0):
            if count in wanted:
                kept[count] = frame.to_ndarray(format="rgb24")
            count += 1
    return count, kept

