"""The engine's side of image and video input (nibble/models/multimodal.py has the model's): turning a request's
raw images (PIL images, arrays, bytes, data URLs, fetched URLs) and videos (frames, encoded bytes, data URLs,
fetched URLs) into preprocessed `ImageInputs` / `VideoInputs` and a prompt with each one's placeholders
expanded, and giving an admitted request its 3-D positions and prefix-cache key. Built only when the model
holds a vision tower (under tensor parallelism: on rank 0)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from nibble.engine.media import MediaPolicy, is_fetched_url, resolve_image_sources, shorten_url
from nibble.engine.request import Request
from nibble.models.config import read_config_json
from nibble.models.mrope import MRopeParams, mrope_positions
from nibble.models.multimodal import (
    ImageInputs,
    VideoInputs,
    VisionInputs,
    expand_image_tokens,
    expand_video_tokens,
    timestamp_text,
    video_placeholder_ids,
    vision_cache_ids,
)
from nibble.models.video_decode import to_video_frames
from nibble.models.video_processor import ProcessedVideo, VideoProcessorParams, preprocess_video
from nibble.models.vision_processor import ImageProcessorParams, ProcessedImage, decode_image, preprocess_images

ImageArg = ImageInputs | tuple[torch.Tensor, torch.Tensor] | list[ProcessedImage]
VideoArg = VideoInputs | tuple[torch.Tensor, torch.Tensor] | list[ProcessedVideo]


def _naming_url(raw: Any, decode: Callable[[], Any]) -> Any:
    """decode() of one image or video; for a fetched URL the error names it, as the fetched bytes do not."""
    try:
        return decode()
    except ValueError as exc:
        if is_fetched_url(raw):
            raise ValueError(f"{shorten_url(raw.strip())}: {exc}") from None
        raise


def vision_max_patches(model: Any, model_dir: str | Path) -> int | None:
    """The most patches one vision-tower call takes: those of the largest image the image processor makes (a
    video's temporal patches are grouped up to it); None without a tower."""
    if getattr(model, "visual", None) is None:
        return None
    params = ImageProcessorParams.from_model_dir(model_dir)
    return params.max_pixels // params.patch_size ** 2


class ImageRequests:
    """Image and video settings of one checkpoint (M-RoPE, the processors', the tower's patch width, the video
    prompt's special tokens) and the media policy. Every method raises ValueError with the reason (the engine
    answers RequestError)."""

    def __init__(self, model_dir: str | Path, patch_dim: int, policy: MediaPolicy,
                 hf_overrides: dict[str, Any] | None = None) -> None:
        raw = read_config_json(model_dir, hf_overrides)
        self.mrope = MRopeParams.from_config_dict(raw)
        self.processor = ImageProcessorParams.from_model_dir(model_dir)
        self.video_processor = VideoProcessorParams.from_model_dir(model_dir)
        self.vision_start_id: int | None = raw.get("vision_start_token_id")
        self.vision_end_id: int | None = raw.get("vision_end_token_id")
        self.patch_dim = patch_dim
        self.policy = policy

    def attach(self, req: Request, images: ImageArg | None, videos: VideoArg | None) -> None:
        """Give a request its images and videos, 3-D positions and decode delta, and the prompt as the prefix
        cache keys it."""
        req.images = ImageInputs.of(images) if images is not None else None
        req.videos = VideoInputs.of(videos) if videos is not None else None
        if req.videos is not None and self.mrope.video_token_id is None:
            raise ValueError("the model's config.json has no video_token_id")
        m = self.mrope
        req.mrope_positions, req.mrope_delta = mrope_positions(
            req.prompt_token_ids, req.images.grid_thw if req.images is not None else None, m.image_token_id,
            m.spatial_merge_size, req.videos.grid_thw if req.videos is not None else None,
            m.video_token_id if req.videos is not None else None)
        inputs: dict[int, VisionInputs] = {}
        if req.images is not None:
            inputs[m.image_token_id] = req.images
        if req.videos is not None:
            inputs[m.video_token_id] = req.videos  # type: ignore[index]
        for item in inputs.values():
            if item.pixel_values.shape[1] != self.patch_dim:
                raise ValueError(f"pixel_values rows must have {self.patch_dim} values, got "
                                 f"{item.pixel_values.shape[1]}")
        req.cache_prompt_ids = vision_cache_ids(req.prompt_token_ids, m.spatial_merge_size, inputs)

    def expand_prompt(self, prompt_ids: list[int], images: ImageArg) -> list[int]:
        """The prompt with its one placeholder per image repeated to each image's token count."""
        counts = ImageInputs.of(images).num_tokens(self.mrope.spatial_merge_size)
        return expand_image_tokens(prompt_ids, self.mrope.image_token_id, counts)

    def expand_video_prompt(self, prompt_ids: list[int], videos: VideoArg,
                            encode: Callable[[str], list[int]]) -> list[int]:
        """The prompt with its one placeholder per video (`<|vision_start|><|video_pad|><|vision_end|>`, or a
        bare `<|video_pad|>`) replaced by each temporal patch's timestamp text (tokenized by `encode`) and
        placeholders."""
        videos = VideoInputs.of(videos)
        video_id, start, end = self.mrope.video_token_id, self.vision_start_id, self.vision_end_id
        if video_id is None or start is None or end is None:
            raise ValueError("the model's config.json lacks video_token_id, vision_start_token_id or "
                             "vision_end_token_id")
        if len(videos.timestamps) != videos.num_videos:
            raise ValueError("the videos carry no timestamps to write into the prompt")
        merge = self.mrope.spatial_merge_size
        replacements = []
        for (t, h, w), stamps in zip(videos.grid_thw.tolist(), videos.timestamps):
            if len(stamps) != t:
                raise ValueError(f"a video of {t} temporal patches has {len(stamps)} timestamps")
            text_ids = [encode(timestamp_text(s)) for s in stamps]
            replacements.append(video_placeholder_ids(text_ids, h * w // merge ** 2, video_id, start, end))
        return expand_video_tokens(prompt_ids, video_id, start, end, replacements)

    def preprocess(self, raw_images: list[Any]) -> ImageInputs:
        """Raw images, in prompt order (URLs fetched here under the policy, blocking), preprocessed."""
        resolved = resolve_image_sources(raw_images, self.policy)
        decoded = [_naming_url(raw, lambda im=im: decode_image(im)) if isinstance(im, (str, bytes)) else im
                   for raw, im in zip(raw_images, resolved)]
        return ImageInputs(*preprocess_images(decoded, self.processor))

    def preprocess_videos(self, raw_videos: list[Any]) -> VideoInputs:
        """Raw videos, in prompt order (URLs fetched here under the policy, blocking), decoded (PyAV),
        sampled and preprocessed."""
        if not raw_videos:
            raise ValueError("no videos")
        resolved = resolve_image_sources(raw_videos, self.policy)
        params = self.video_processor
        done = [_naming_url(raw, lambda v=v: preprocess_video(to_video_frames(v, params), params))
                for raw, v in zip(raw_videos, resolved)]
        return VideoInputs.of(done)
