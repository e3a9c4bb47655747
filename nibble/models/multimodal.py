"""Image and video input of Qwen3.5 in the engine: what a request carries and what a model step needs from it.

A request with images holds their preprocessed pixels (`ImageInputs`) and a prompt in which every image
token is an `image_token_id` placeholder (`expand_image_tokens` turns one placeholder per image, as the chat
template writes it, into the image's token count). A video (`VideoInputs`) is a sequence of temporal
patches (2 frames each): `expand_video_tokens` turns the template's `<|vision_start|><|video_pad|><|vision_end|>`
into, per patch, its timestamp as text (`<1.2 seconds>`) and `<|vision_start|>`, the patch's
`video_token_id` placeholders, `<|vision_end|>` (as vLLM and Qwen's processor write it). At admission the
engine computes the prompt's 3-D positions and delta (mrope.py). A step then needs, for the rows of such
requests:

- rotary positions: a token past the prompt sits at index + delta on all three axes, a plain 1-D position
  (so decode steps only shift positions); a prompt chunk reads its positions from the request's
  [3, prompt_len] table, and the whole step then rotates with a per-token cos/sin table
  (`mrope.mrope_cos_sin`) instead of the 1-D cache;
- embeddings: the vision tower's output row of each placeholder replaces the placeholder's embedding
  (`MultimodalStep`); images and videos each have their own rows, in prompt order; chunked prefill may cut
  an image's or a video's tokens, so rows are picked by the placeholder's rank among the prompt's
  placeholders of its kind.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, ClassVar

import torch

from nibble.models.video_processor import ProcessedVideo
from nibble.models.vision_processor import ProcessedImage


@dataclass
class VisionInputs:
    """Images or videos of one request, as the vision tower takes them.

    pixel_values: float32 [sum of patches, patch_dim] (items one after another, host);
    grid_thw: int64 [num_items, 3] (t, h, w) in patches, in prompt order.
    """

    pixel_values: torch.Tensor
    grid_thw: torch.Tensor
    # what the content digests are personalised with, so that an image and a video never share one
    DIGEST_PERSON: ClassVar[bytes] = b"nibble-image"

    def num_tokens(self, merge_size: int) -> list[int]:
        """Placeholder tokens of each item: t * h * w / merge_size**2."""
        return [int(t * h * w) // merge_size ** 2 for t, h, w in self.grid_thw.tolist()]

    @cached_property
    def content_digests(self) -> list[bytes]:
        """A 16-byte digest of each item's grid and pixel values (what the vision tower's output depends on),
        hashed once per object: the server has them hashed with the preprocessing, off the engine's thread."""
        out = []
        start = 0
        pixels = self.pixel_values.contiguous()
        for grid in self.grid_thw.tolist():
            n = grid[0] * grid[1] * grid[2]
            h = hashlib.blake2b(digest_size=16, person=self.DIGEST_PERSON)
            h.update(str(grid).encode() + str(pixels.dtype).encode())
            h.update(pixels[start:start + n].numpy().tobytes())
            out.append(h.digest())
            start += n
        return out

    @staticmethod
    def _checked_grid(pixels: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
        grid = grid.to(torch.int64).reshape(-1, 3)
        if pixels.dim() != 2 or int(grid.prod(dim=1).sum()) != pixels.shape[0]:
            raise ValueError(f"pixel_values {list(pixels.shape)} do not hold the patches of grids {grid.tolist()}")
        return grid


@dataclass
class ImageInputs(VisionInputs):
    """The images of one request (`VisionInputs`: pixel_values [sum of patches, patch_dim], grid_thw
    [num_images, 3] with t = 1)."""

    @classmethod
    def of(cls, images: Any) -> ImageInputs:
        """From an ImageInputs, a (pixel_values, grid_thw) pair (as `preprocess_images` returns) or a list
        of `ProcessedImage`. ValueError on other shapes."""
        if isinstance(images, ImageInputs):
            return images
        if isinstance(images, (list, tuple)) and images and all(isinstance(i, ProcessedImage) for i in images):
            return cls(torch.cat([i.pixel_values for i in images]),
                       torch.tensor([i.grid_thw for i in images], dtype=torch.int64))
        if isinstance(images, tuple) and len(images) == 2 and all(isinstance(t, torch.Tensor) for t in images):
            pixels, grid = images
            return cls(pixels, cls._checked_grid(pixels, grid))
        raise ValueError("images must be (pixel_values, grid_thw) tensors or a list of ProcessedImage")

    @property
    def num_images(self) -> int:
        return int(self.grid_thw.shape[0])


@dataclass
class VideoInputs(VisionInputs):
    """The videos of one request (`VisionInputs`: pixel_values [sum of patches, patch_dim], grid_thw
    [num_videos, 3], t the number of temporal patches), and timestamps: per video, the seconds of each
    temporal patch (what the prompt writes before it; empty when the prompt is already expanded)."""

    timestamps: tuple[tuple[float, ...], ...] = ()
    DIGEST_PERSON: ClassVar[bytes] = b"nibble-video"

    @classmethod
    def of(cls, videos: Any) -> VideoInputs:
        """From a VideoInputs, a list of `ProcessedVideo`, or (pixel_values, grid_thw) tensors of videos whose
        prompt is already expanded. ValueError on other shapes."""
        if isinstance(videos, VideoInputs):
            return videos
        if isinstance(videos, (list, tuple)) and videos and all(isinstance(v, ProcessedVideo) for v in videos):
            return cls(torch.cat([v.pixel_values for v in videos]),
                       torch.tensor([v.grid_thw for v in videos], dtype=torch.int64),
                       tuple(v.timestamps for v in videos))
        if isinstance(videos, tuple) and len(videos) == 2 and all(isinstance(t, torch.Tensor) for t in videos):
            pixels, grid = videos
            return cls(pixels, cls._checked_grid(pixels, grid))
        raise ValueError("videos must be (pixel_values, grid_thw) tensors or a list of ProcessedVideo")

    @property
    def num_videos(self) -> int:
        return int(self.grid_thw.shape[0])


def expand_image_tokens(prompt_ids: Sequence[int], image_token_id: int, num_tokens: Sequence[int]) -> list[int]:
    """Replace the i-th `image_token_id` of the prompt by num_tokens[i] of them (one placeholder per image in,
    e.g. the chat template's `<|vision_start|><|image_pad|><|vision_end|>`). ValueError when the prompt
    has not exactly one placeholder per image."""
    found = sum(1 for t in prompt_ids if t == image_token_id)
    if found != len(num_tokens):
        raise ValueError(f"the prompt has {found} image placeholders for {len(num_tokens)} images")
    out: list[int] = []
    i = 0
    for t in prompt_ids:
        if t == image_token_id:
            out.extend([image_token_id] * num_tokens[i])
            i += 1
        else:
            out.append(t)
    return out


def video_placeholder_ids(timestamp_ids: Sequence[Sequence[int]], tokens_per_patch: int, video_token_id: int,
                          vision_start_id: int, vision_end_id: int) -> list[int]:
    """The token ids one video's placeholder becomes: per temporal patch, its timestamp text's ids (the
    tokenized `<{t:.1f} seconds>`, `timestamp_ids[i]`), then vision_start, tokens_per_patch video
    placeholders, vision_end."""
    out: list[int] = []
    for ids in timestamp_ids:
        out += [*ids, vision_start_id, *[video_token_id] * tokens_per_patch, vision_end_id]
    return out


def timestamp_text(seconds: float) -> str:
    """How the prompt writes a temporal patch's time (one decimal, as vLLM and transformers do)."""
    return f"<{seconds:.1f} seconds>"


def expand_video_tokens(prompt_ids: Sequence[int], video_token_id: int, vision_start_id: int, vision_end_id: int,
                        replacements: Sequence[Sequence[int]]) -> list[int]:
    """Replace the i-th video placeholder of the prompt by replacements[i] (`video_placeholder_ids`): the
    chat template's `<|vision_start|><|video_pad|><|vision_end|>` as a whole (the replacement brings each
    patch's own start and end), or a bare `<|video_pad|>`. ValueError when the prompt has not exactly one
    placeholder per video."""
    found = sum(1 for t in prompt_ids if t == video_token_id)
    if found != len(replacements):
        raise ValueError(f"the prompt has {found} video placeholders for {len(replacements)} videos")
    ids = list(prompt_ids)
    out: list[int] = []
    i = p = 0
    while p < len(ids):
        if ids[p] != video_token_id:
            out.append(ids[p])
            p += 1
            continue
        if out and out[-1] == vision_start_id and p + 1 < len(ids) and ids[p + 1] == vision_end_id:
            out.pop()
            p += 1
        out.extend(replacements[i])
        i += 1
        p += 1
    return out


def vision_cache_ids(prompt_ids: Sequence[int], merge_size: int, inputs: Mapping[int, VisionInputs]) -> list[int]:
    """The prompt as the prefix cache keys it: every placeholder (a key of `inputs`: the image and the video
    token id) replaced by a negative id derived from its item's content and its rank in the item
    (placeholder ids are the same for every image or video; token ids are never negative). Two prompts share
    a cached prefix only where their text, images and videos agree.

    Rank j of an item with digest halves (a, b) gets -1 - ((a + j * b) mod 2**62), b odd: two different
    items give one equal id at most at one rank, so a block with two or more of an item's tokens differs
    unless both 62-bit halves do."""
    digests = {tok: v.content_digests for tok, v in inputs.items()}
    counts = {tok: v.num_tokens(merge_size) for tok, v in inputs.items()}
    cursor = dict.fromkeys(inputs, (0, 0))  # per kind: (item, rank in it)
    out = list(prompt_ids)
    mask = (1 << 62) - 1
    for p, t in enumerate(out):
        if t not in cursor:
            continue
        item, rank = cursor[t]
        while rank == counts[t][item]:
            item, rank = item + 1, 0
        a = int.from_bytes(digests[t][item][:8], "little")
        b = int.from_bytes(digests[t][item][8:], "little") | 1
        out[p] = -1 - ((a + rank * b) & mask)
        cursor[t] = (item, rank + 1)
    return out


@dataclass
class MultimodalStep:
    """What a step with image or video prompt chunks adds to its ForwardBatch.

    positions: int64 [3, num_tokens] (host) of every token of the step, the 3-D rotary positions;
    token_index: int64 [n] (host) flat indices of the step's image and video placeholder tokens;
    embeds: [n, hidden] (device) the vision tower rows that replace their embeddings.
    """

    positions: torch.Tensor
    token_index: torch.Tensor
    embeds: torch.Tensor


def chunk_positions(mrope_positions: torch.Tensor | None, delta: int, start: int, end: int) -> torch.Tensor:
    """int64 [3, end - start]: the rotary positions of token indices start..end-1 of a request whose prompt
    positions are `mrope_positions` [3, prompt_len] (None: text-only) and later tokens index + delta."""
    prompt_len = 0 if mrope_positions is None else mrope_positions.shape[1]
    out = torch.arange(max(start, prompt_len) + delta, max(end, prompt_len) + delta, dtype=torch.int64).repeat(3, 1)
    if mrope_positions is not None and start < prompt_len:
        out = torch.cat([mrope_positions[:, start:min(end, prompt_len)], out], dim=1)
    return out


# How Qwen3.5's chat template renders an image and a video (add_vision_id off): placeholders expanded after
# tokenization (`LLMEngine.prepare_media`).
VISION_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO_PLACEHOLDER = "<|vision_start|><|video_pad|><|vision_end|>"


def take_media(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[Any], list[Any]]:
    """The conversation with each image or video content part replaced by a text part holding the template's
    placeholder for it (the chat template renders them exactly so, and joins parts with no separator), and
    the images and the videos in order: the URL strings of image_url / video_url parts (data:, or fetched
    later: engine/media.py), the `image` / `video` value of image / video parts."""
    images: list[Any] = []
    videos: list[Any] = []
    out = []
    for msg in messages:
        content = msg.get("content")
        if not isinstance(content, list):
            out.append(msg)
            continue
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in ("image_url", "video_url"):
                url = part.get(kind)
                (images if kind == "image_url" else videos).append(url.get("url") if isinstance(url, dict) else url)
            elif kind in ("image", "video"):
                (images if kind == "image" else videos).append(part.get(kind))
            else:
                parts.append(part)
                continue
            placeholder = VISION_PLACEHOLDER if kind.startswith("image") else VIDEO_PLACEHOLDER
            parts.append({"type": "text", "text": placeholder})
        out.append({**msg, "content": parts})
    return out, images, videos
