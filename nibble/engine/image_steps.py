"""The image-input part of a model step (nibble/models/multimodal.py): per-sequence position offsets, and
for steps that feed prompt tokens of image requests, 3-D positions and vision-tower rows.

The vision tower runs here, eagerly, at the first step that feeds one of a request's image placeholders;
its output stays on the request (`Request.image_embeds`) for later chunks and for recomputation after
preemption.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from nibble.engine.request import Request
from nibble.models.multimodal import MultimodalStep, chunk_positions
from nibble.models.qwen3_5_vision import Qwen3_5VisionModel


def encode_images(visual: Qwen3_5VisionModel | None, req: Request, device: torch.device) -> torch.Tensor:
    """[image tokens, hidden] on `device`: the vision tower's rows for the request's images, in prompt order."""
    if visual is None or req.images is None:
        raise RuntimeError(f"request {req.request_id}: image input, but the model has no vision tower")
    pixels = req.images.pixel_values.to(device=device, dtype=visual.dtype)
    return visual(pixels, req.images.grid_thw)


def image_step_inputs(requests: Sequence[Request], num_new_tokens: Sequence[int],
                      visual: Qwen3_5VisionModel | None, image_token_id: int, device: torch.device
                      ) -> tuple[list[int], MultimodalStep | None]:
    """(position_offsets: each sequence's M-RoPE delta, [] when all are 0; the step's MultimodalStep when a
    sequence feeds prompt tokens of an image request, else None)."""
    offsets = [r.mrope_delta for r in requests]
    if not any(offsets):
        offsets = []
    if not any(r.has_images and r.num_computed_tokens < r.num_prompt_tokens for r in requests):
        return offsets, None
    positions, index, embeds = [], [], []
    base = 0
    for req, n in zip(requests, num_new_tokens):
        start = req.num_computed_tokens
        positions.append(chunk_positions(req.mrope_positions, req.mrope_delta, start, start + n))
        if req.has_images and start < req.num_prompt_tokens:
            prompt = req.prompt_token_ids
            chunk = torch.tensor(prompt[start:start + n], dtype=torch.int64)
            local = torch.nonzero(chunk == image_token_id).flatten()
            if local.numel():
                if req.image_embeds is None:
                    req.image_embeds = encode_images(visual, req, device)
                # the chunk may start inside an image: its first placeholder's row is the count before it
                first = sum(1 for t in prompt[:start] if t == image_token_id)
                rows = torch.arange(first, first + local.numel(), device=device)
                index.append(base + local)
                embeds.append(req.image_embeds[rows])
        base += n
    return offsets, MultimodalStep(
        positions=torch.cat(positions, dim=1),
        token_index=torch.cat(index) if index else torch.empty(0, dtype=torch.int64),
        embeds=torch.cat(embeds) if embeds else torch.empty(0, device=device))
