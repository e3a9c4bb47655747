"""Video preprocessing of Qwen3.5: sampled RGB frames in, the vision tower's `pixel_values`, `grid_thw` and
each temporal patch's timestamp out.

This follows transformers' (5.x) `Qwen3VLVideoProcessor`, which `qwen3_5_moe` checkpoints use, configured by
the checkpoint's video processor settings (`video_preprocessor_config.json`):

1. Frame sampling (`sample_frame_indices`, for a decoded video): int(total / video_fps * fps) frames, at
   least min_frames, at most max_frames and the video's frame count, evenly spaced over the whole video
   (np.linspace rounded).
2. `video_smart_resize`: like the image's, but the pixel limits count every frame (t x h x w), so a longer
   clip gets smaller frames; sides become multiples of patch_size * merge_size. The resampling is torch's
   antialiased bicubic on uint8 (`F.interpolate`), which is what transformers' torchvision backend calls
   on the CPU (torchvision itself is not needed); PIL's bicubic, the image processor's, differs from it.
3. uint8 -> float32, then (x - mean * 255) / (std * 255) (transformers' fused rescale and normalise).
4. The frame count is padded to a multiple of temporal_patch_size with copies of the last frame, and each
   group of temporal_patch_size frames is one temporal patch: grid_t = frames / temporal_patch_size.
5. Patchify as for images: rows ordered patch group by patch group, within a group in merge-window order,
   each row laid out (channel, time, patch row, patch column).

Timestamps (`frame_timestamps`): a temporal patch is at the mean of its first and last frame's time
(source index / source fps); the prompt writes it as `<{t:.1f} seconds>` before the patch's placeholders
(multimodal.video_placeholder_ids). Decoding encoded videos (PyAV) is in video_decode.py; it resizes each kept
frame as it is decoded, with `resize_frames` and the size `video_smart_resize` gives for the source size, so
`VideoFrames.source_size` tells `preprocess_video` that its frames are already resized.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from nibble.models.vision_processor import (
    MAX_ASPECT_RATIO,
    PREPROCESSOR_CONFIG,
    PROCESSOR_CONFIG,
    check_tower_patch_sizes,
    processor_kwargs,
    read_json_object,
    tower_patch_sizes,
)

VIDEO_PREPROCESSOR_CONFIG = "video_preprocessor_config.json"


@dataclass(frozen=True)
class VideoProcessorParams:
    """The video processor's settings. The defaults are the values Qwen3-VL and Qwen3.5 checkpoints ship in
    `video_preprocessor_config.json` (4096 to 25165824 pixels over all frames, 16-pixel patches, 2 frames per
    temporal patch, 2x2 merge, mean = std = 0.5, 2 frames a second, 4 to 768 frames); transformers' class
    defaults (128*32*32 to 768*32*32 pixels) do not apply to them.

    cap_pixels_per_frame / max_video_tokens: transformers' optional per-frame cap (off unless the config turns
    it on, as in transformers 5.x): each frame gets at most max_video_tokens * factor**2 pixels, at most an
    even share of max_pixels, and at least 1.05 * min_pixels."""

    min_pixels: int = 4096
    max_pixels: int = 25165824
    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255
    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 768
    do_sample_frames: bool = True
    cap_pixels_per_frame: bool = False
    max_video_tokens: int = 768

    def __post_init__(self) -> None:
        for name in ("min_pixels", "max_pixels", "patch_size", "temporal_patch_size", "merge_size", "min_frames",
                     "max_frames", "max_video_tokens"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"video processor: {name} must be positive, got {getattr(self, name)}")
        if self.min_pixels > self.max_pixels:
            raise ValueError(f"video processor: min_pixels {self.min_pixels} > max_pixels {self.max_pixels}")
        if self.min_frames > self.max_frames:
            raise ValueError(f"video processor: min_frames {self.min_frames} > max_frames {self.max_frames}")
        if not self.fps > 0:
            raise ValueError(f"video processor: fps must be positive, got {self.fps}")
        if len(self.image_mean) != 3 or len(self.image_std) != 3 or any(s == 0 for s in self.image_std):
            raise ValueError(f"video processor: bad mean/std {self.image_mean} / {self.image_std}")

    @property
    def factor(self) -> int:
        """Both resized sides are multiples of this many pixels."""
        return self.patch_size * self.merge_size

    @property
    def patch_dim(self) -> int:
        """Length of one `pixel_values` row: 3 channels * temporal_patch_size * patch_size**2."""
        return 3 * self.temporal_patch_size * self.patch_size * self.patch_size

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> VideoProcessorParams:
        """From the fields of a video processor config: `size.shortest_edge` / `size.longest_edge` are pixel
        counts over all frames (min/max). Settings that would switch off a step nibble always runs, or that it
        does not implement (num_frames sampling, other resampling), are refused."""
        kwargs = processor_kwargs(raw, "video processor", ("patch_size", "temporal_patch_size", "merge_size",
                                                             "min_frames", "max_frames", "max_video_tokens"))
        if raw.get("num_frames") is not None:
            raise ValueError("video processor: sampling a fixed num_frames is not supported (fps sampling is)")
        if raw.get("fps") is not None:
            kwargs["fps"] = float(raw["fps"])
        for key in ("do_sample_frames", "cap_pixels_per_frame"):
            if raw.get(key) is not None:
                kwargs[key] = bool(raw[key])
        return cls(**kwargs)

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> VideoProcessorParams:
        """The checkpoint's settings, looked for as transformers does: the `video_processor` section of
        `processor_config.json`, else `video_preprocessor_config.json`, else `preprocessor_config.json` (the
        image processor's file, which older checkpoints share); none: the defaults with the patch sizes of
        config.json's `vision_config`. Patch sizes that disagree with the vision tower's are refused."""
        root = Path(model_dir)
        raw: dict[str, Any] | None = None
        if (root / PROCESSOR_CONFIG).is_file():
            raw = read_json_object(root / PROCESSOR_CONFIG).get("video_processor")
        for name in (VIDEO_PREPROCESSOR_CONFIG, PREPROCESSOR_CONFIG):
            if raw is None and (root / name).is_file():
                raw = read_json_object(root / name)
        tower = tower_patch_sizes(root)
        if raw is None:
            return cls(**tower)
        return check_tower_patch_sizes(cls.from_dict(raw), tower, root, "video processor")


@dataclass(frozen=True)
class VideoFrames:
    """The frames of one video that the processor takes, in order.

    frames: uint8 [T, H, W, 3] RGB; fps: the source video's frame rate; indices: each frame's index in the
    source video (T of them), which with fps gives its time; source_size: None when the frames are at their
    source size, else the (height, width) of the source frames, which were already resized (as they were
    decoded) to `video_smart_resize(T, *source_size)`.
    """

    frames: np.ndarray
    fps: float
    indices: tuple[int, ...]
    source_size: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        f = self.frames
        if not isinstance(f, np.ndarray) or f.dtype != np.uint8 or f.ndim != 4 or f.shape[-1] != 3:
            shape = tuple(f.shape) if hasattr(f, "shape") else type(f).__name__
            raise ValueError(f"video frames must be an RGB uint8 array [T, H, W, 3], got {shape}")
        if len(self.indices) != f.shape[0]:
            raise ValueError(f"{len(self.indices)} frame indices for {f.shape[0]} frames")
        if not (math.isfinite(self.fps) and self.fps > 0):
            raise ValueError(f"video fps must be positive, got {self.fps}")
        if self.source_size is not None and (len(self.source_size) != 2 or min(self.source_size) <= 0):
            raise ValueError(f"video source size must be a positive (height, width), got {self.source_size}")


@dataclass(frozen=True)
class ProcessedVideo:
    """One video ready for the vision tower.

    pixel_values: float32 [grid_t * grid_h * grid_w, 3 * temporal_patch_size * patch_size**2];
    grid_thw: (grid_t, grid_h, grid_w) in patches, before merging; timestamps: seconds of each of the grid_t
    temporal patches; num_tokens: its placeholder tokens, grid_t * grid_h * grid_w / merge_size**2.
    """

    pixel_values: torch.Tensor
    grid_thw: tuple[int, int, int]
    timestamps: tuple[float, ...]
    num_tokens: int



def sample_frame_indices(total_frames: int, video_fps: float, params: VideoProcessorParams) -> list[int]:
    """Indices of the frames to keep from a video of total_frames frames at video_fps frames a second."""
    if total_frames <= 0:
        raise ValueError("the video has no frames")
    if not params.do_sample_frames:
        return list(range(total_frames))
    n = int(total_frames / video_fps * params.fps)
    n = min(max(n, params.min_frames), params.max_frames, total_frames)
    return np.linspace(0, total_frames - 1, n).round().astype(int).tolist()


def frame_timestamps(indices: Sequence[int], video_fps: float, temporal_patch_size: int) -> list[float]:
    """Seconds of each temporal patch: indices padded with the last one to a multiple of the patch size (as the
    frames are), and each patch at the mean of its first and last frame's time."""
    idx = list(indices)
    if not idx:
        raise ValueError("no frames")
    idx += [idx[-1]] * (-len(idx) % temporal_patch_size)
    times = [i / video_fps for i in idx]
    return [(times[i] + times[i + temporal_patch_size - 1]) / 2 for i in range(0, len(times), temporal_patch_size)]


def video_smart_resize(num_frames: int, height: int, width: int, params: VideoProcessorParams) -> tuple[int, int]:
    """The (height, width) every frame of a num_frames-frame video of this size is resized to: multiples of
    `params.factor`, all frames together within [min_pixels, max_pixels] (max_pixels per-frame capped when
    cap_pixels_per_frame), aspect ratio kept. ValueError for fewer frames than a temporal patch, empty frames
    or aspect ratios beyond 200:1."""
    t = params.temporal_patch_size
    if num_frames < t:
        raise ValueError(f"a video needs at least {t} frames (one temporal patch), got {num_frames}")
    if height <= 0 or width <= 0:
        raise ValueError(f"video frames of {width}x{height} pixels are empty")
    f = params.factor
    max_pixels = params.max_pixels
    if params.cap_pixels_per_frame:
        per_frame = max(min(params.max_video_tokens * f * f, params.max_pixels // num_frames),
                        int(params.min_pixels * 1.05))
        max_pixels = per_frame * num_frames
    if height < f or width < f:
        # frames smaller than one merge window are sized as if scaled up to it first (transformers does this)
        scale = max(f / height, f / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(f"video {width}x{height}: aspect ratio above {MAX_ASPECT_RATIO}:1 is not supported")
    # Python's round (half to even) and this order of operations are transformers'
    h = round(height / f) * f
    w = round(width / f) * f
    t_bar = round(num_frames / t) * t
    if t_bar * h * w > max_pixels:
        beta = math.sqrt((num_frames * height * width) / max_pixels)
        h = max(f, math.floor(height / beta / f) * f)
        w = max(f, math.floor(width / beta / f) * f)
    elif t_bar * h * w < params.min_pixels:
        beta = math.sqrt(params.min_pixels / (num_frames * height * width))
        h = math.ceil(height * beta / f) * f
        w = math.ceil(width * beta / f) * f
    return h, w


def resize_frames(frames: np.ndarray, size: tuple[int, int]) -> torch.Tensor:
    """RGB uint8 frames [T, H, W, 3] -> uint8 [T, 3, h, w] at size (h, w): torch's antialiased bicubic, left
    as they are when already of that size. Each frame is resized on its own (the same bytes whether T is 1 or
    the whole video), which lets video_decode.py resize frames one at a time as it decodes them."""
    x = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2).contiguous()
    if tuple(x.shape[2:]) != tuple(size):
        x = F.interpolate(x, size=list(size), mode="bicubic", align_corners=False, antialias=True)
    return x


def preprocess_video(video: VideoFrames, params: VideoProcessorParams | None = None) -> ProcessedVideo:
    """Sampled frames -> `ProcessedVideo` (pixel_values float32 [grid_t * grid_h * grid_w, patch_dim])."""
    params = params or VideoProcessorParams()
    num_frames, height, width = video.frames.shape[:3]
    # the size comes from the source size, not from frames resized while decoding: video_smart_resize of its
    # own output can differ from it (its frame count is rounded to whole temporal patches)
    source = video.source_size or (height, width)
    h, w = video_smart_resize(num_frames, *source, params)
    if video.source_size is not None and (height, width) != (h, w):
        raise ValueError(f"{num_frames} video frames of {source[1]}x{source[0]} are resized to {w}x{h}, but "
                         f"were decoded at {width}x{height}")
    x = resize_frames(video.frames, (h, w))  # [T, 3, h, w]
    # transformers fuses the rescale into the normalisation: mean and std scaled by 1 / rescale_factor, in fp32
    mean = torch.tensor(params.image_mean, dtype=torch.float32) * (1.0 / params.rescale_factor)
    std = torch.tensor(params.image_std, dtype=torch.float32) * (1.0 / params.rescale_factor)
    x = (x.to(torch.float32) - mean.view(-1, 1, 1)) / std.view(-1, 1, 1)
    t, p, m = params.temporal_patch_size, params.patch_size, params.merge_size
    pad = -num_frames % t
    if pad:
        x = torch.cat([x, x[-1:].expand(pad, -1, -1, -1)])
    gt, gh, gw = (num_frames + pad) // t, h // p, w // p
    patches = x.view(gt, t, 3, gh // m, m, p, gw // m, m, p)
    # -> [gt, gh/m, gw/m, m, m, C, T, P, P]: a merge window's m*m patches become consecutive rows
    patches = patches.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    pixel_values = patches.reshape(gt * gh * gw, params.patch_dim).contiguous()
    timestamps = frame_timestamps(video.indices, video.fps, t)
    return ProcessedVideo(pixel_values, (gt, gh, gw), tuple(timestamps), gt * gh * gw // (m * m))
