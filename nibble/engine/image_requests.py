"""The engine's side of image input (nibble/models/multimodal.py has the model's): turning a request's raw
images (PIL images, arrays, bytes, data URLs, fetched URLs) into preprocessed `ImageInputs` and a prompt with
each image's placeholders expanded, and giving an admitted request its 3-D positions and prefix-cache key.
Built only when the model holds a vision tower (under tensor parallelism: on rank 0)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from nibble.engine.media import MediaPolicy, is_fetched_url, resolve_image_sources, shorten_url
from nibble.engine.request import Request
from nibble.models.mrope import MRopeParams, mrope_positions
from nibble.models.multimodal import ImageInputs, expand_image_tokens, image_cache_ids
from nibble.models.vision_processor import ImageProcessorParams, ProcessedImage, decode_image, preprocess_images

ImageArg = ImageInputs | tuple[torch.Tensor, torch.Tensor] | list[ProcessedImage]


def _decode(raw: Any, data: str | bytes) -> Any:
    """decode_image of one image; for a fetched URL the error names it, as the fetched bytes do not."""
    try:
        return decode_image(data)
    except ValueError as exc:
        if is_fetched_url(raw):
            raise ValueError(f"{shorten_url(raw.strip())}: {exc}") from None
        raise


class ImageRequests:
    """Image settings of one checkpoint (M-RoPE, the processor's, the tower's patch width) and the media policy.
    Every method raises ValueError with the reason (the engine answers RequestError)."""

    def __init__(self, model_dir: str | Path, patch_dim: int, policy: MediaPolicy) -> None:
        self.mrope = MRopeParams.from_model_dir(model_dir)
        self.processor = ImageProcessorParams.from_model_dir(model_dir)
        self.patch_dim = patch_dim
        self.policy = policy

    def attach(self, req: Request, images: ImageArg) -> None:
        """Give a request its images, 3-D positions and decode delta, and the prompt as the prefix cache keys it."""
        req.images = ImageInputs.of(images)
        req.mrope_positions, req.mrope_delta = mrope_positions(
            req.prompt_token_ids, req.images.grid_thw, self.mrope.image_token_id, self.mrope.spatial_merge_size)
        width = req.images.pixel_values.shape[1]
        if width != self.patch_dim:
            raise ValueError(f"pixel_values rows must have {self.patch_dim} values, got {width}")
        req.cache_prompt_ids = image_cache_ids(req.prompt_token_ids, self.mrope.image_token_id, req.images,
                                               self.mrope.spatial_merge_size)

    def expand_prompt(self, prompt_ids: list[int], images: ImageArg) -> list[int]:
        """The prompt with its one placeholder per image repeated to each image's token count."""
        counts = ImageInputs.of(images).num_tokens(self.mrope.spatial_merge_size)
        return expand_image_tokens(prompt_ids, self.mrope.image_token_id, counts)

    def preprocess(self, raw_images: list[Any]) -> ImageInputs:
        """Raw images, in prompt order (URLs fetched here under the policy, blocking), preprocessed."""
        resolved = resolve_image_sources(raw_images, self.policy)
        decoded = [_decode(raw, im) if isinstance(im, (str, bytes)) else im for raw, im in zip(raw_images, resolved)]
        return ImageInputs(*preprocess_images(decoded, self.processor))
