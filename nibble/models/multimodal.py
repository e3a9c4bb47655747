"""Image input of Qwen3.5 in the engine: what a request carries and what a model step needs from it.

A request with images holds their preprocessed pixels (`ImageInputs`) and a prompt in which every image
token is an `image_token_id` placeholder (`expand_image_tokens` turns one placeholder per image, as the chat
template writes it, into the image's token count). At admission the engine computes the prompt's 3-D
positions and delta (mrope.py). A step then needs, for the rows of such requests:

- rotary positions: a token past the prompt sits at index + delta on all three axes, a plain 1-D position
  (so decode steps only shift positions); a prompt chunk reads its positions from the request's
  [3, prompt_len] table, and the whole step then rotates with a per-token cos/sin table
  (`mrope.mrope_cos_sin`) instead of the 1-D cache;
- embeddings: the vision tower's output row of each placeholder replaces the placeholder's embedding
  (`MultimodalStep`); chunked prefill may cut an image's tokens, so rows are picked by the placeholder's
  rank among the prompt's placeholders.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from nibble.models.vision_processor import ProcessedImage


@dataclass
class ImageInputs:
    """The images of one request, as the vision tower takes them.

    pixel_values: float32 [sum of patches, patch_dim] (images one after another, host);
    grid_thw: int64 [num_images, 3] (t, h, w) in patches, in prompt order.
    """

    pixel_values: torch.Tensor
    grid_thw: torch.Tensor

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
            grid = grid.to(torch.int64).reshape(-1, 3)
            if pixels.dim() != 2 or int(grid.prod(dim=1).sum()) != pixels.shape[0]:
                raise ValueError(f"pixel_values {list(pixels.shape)} do not hold the patches of grids "
                                 f"{grid.tolist()}")
            return cls(pixels, grid)
        raise ValueError("images must be (pixel_values, grid_thw) tensors or a list of ProcessedImage")

    @property
    def num_images(self) -> int:
        return int(self.grid_thw.shape[0])

    def num_tokens(self, merge_size: int) -> list[int]:
        """Placeholder tokens of each image: t * h * w / merge_size**2."""
        return [int(t * h * w) // merge_size ** 2 for t, h, w in self.grid_thw.tolist()]

    def content_digests(self) -> list[bytes]:
        """A 16-byte digest of each image's grid and pixel values (what the vision tower's output depends on)."""
        out = []
        start = 0
        pixels = self.pixel_values.contiguous()
        for grid in self.grid_thw.tolist():
            n = grid[0] * grid[1] * grid[2]
            h = hashlib.blake2b(digest_size=16, person=b"nibble-image")
            h.update(str(grid).encode() + str(pixels.dtype).encode())
            h.update(pixels[start:start + n].numpy().tobytes())
            out.append(h.digest())
            start += n
        return out


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


def image_cache_ids(prompt_ids: Sequence[int], image_token_id: int, images: ImageInputs,
                    merge_size: int) -> list[int]:
    """The prompt as the prefix cache keys it: every image placeholder replaced by a negative id derived from
    its image's content and its rank in the image (placeholder ids are the same for every image; token ids
    are never negative). Two prompts share a cached prefix only where their text and images agree.

    Rank j of an image with digest halves (a, b) gets -1 - ((a + j * b) mod 2**62), b odd: two different
    images give one equal id at most at one rank, so a block with two or more of an image's tokens differs
    unless both 62-bit halves do."""
    digests = images.content_digests()
    counts = images.num_tokens(merge_size)
    out = list(prompt_ids)
    mask = (1 << 62) - 1
    image, rank = 0, 0
    for p, t in enumerate(out):
        if t != image_token_id:
            continue
        while rank == counts[image]:
            image, rank = image + 1, 0
        a = int.from_bytes(digests[image][:8], "little")
        b = int.from_bytes(digests[image][8:], "little") | 1
        out[p] = -1 - ((a + rank * b) & mask)
        rank += 1
    return out


@dataclass
class MultimodalStep:
    """What a step with image prompt chunks adds to its ForwardBatch.

    positions: int64 [3, num_tokens] (host) of every token of the step, the 3-D rotary positions;
    token_index: int64 [n] (host) flat indices of the step's image placeholder tokens;
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


# How Qwen3.5's chat template renders one image (add_vision_id off): its placeholder, expanded to the image's token
# count after tokenization (`expand_image_prompt`).
VISION_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"


def take_images(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[Any]]:
    """The conversation with each image content part replaced by a text part holding the template's vision
    placeholder (the chat template renders an image exactly so, and joins parts with no separator), and the
    images in order: the URL strings of image_url parts (data:, or fetched later: engine/media.py), the `image`
    value of image parts."""
    images: list[Any] = []
    out = []
    for msg in messages:
        content = msg.get("content")
        if not isinstance(content, list):
            out.append(msg)
            continue
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "image_url":
                url = part.get("image_url")
                images.append(url.get("url") if isinstance(url, dict) else url)
            elif kind == "image":
                images.append(part.get("image"))
            else:
                parts.append(part)
                continue
            parts.append({"type": "text", "text": VISION_PLACEHOLDER})
        out.append({**msg, "content": parts})
    return out, images
