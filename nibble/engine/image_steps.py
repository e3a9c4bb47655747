"""The image- and video-input part of a model step (nibble/models/multimodal.py): per-sequence position
offsets, and for steps that feed prompt tokens of such requests, 3-D positions and vision-tower rows.

The vision tower runs here, eagerly, at the first step that feeds one of a request's image placeholders (for
all its images) and at the first that feeds one of its video placeholders (for all its videos); its output
stays on the request (`Request.image_embeds`, `Request.video_embeds`) for later chunks and for recomputation
after preemption.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from nibble.engine.request import Request
from nibble.models.mrope import MRopeParams
from nibble.models.multimodal import MultimodalStep, VisionInputs, chunk_positions
from nibble.models.qwen3_5_vision import Qwen3_5VisionModel


def vision_calls(grid_thw: torch.Tensor, max_patches: int | None) -> list[tuple[int, int, list[tuple[int, int, int]]]]:
    """How to run the tower over images / videos of grids `grid_thw` [n, 3] in calls of at most `max_patches`
    patches each (None: one call): (first patch, end patch, grids) per call. A video is split between its
    temporal patches, each of which the tower attends within on its own (a frame pair alone gives the same rows);
    one image or temporal patch larger than the limit is a call of its own."""
    units = [(h, w) for t, h, w in grid_thw.tolist() for _ in range(t)]
    calls: list[tuple[int, int, list[tuple[int, int, int]]]] = []
    start = end = 0
    grids: list[tuple[int, int, int]] = []
    for h, w in units:
        if grids and max_patches is not None and end - start + h * w > max_patches:
            calls.append((start, end, grids))
            start, grids = end, []
        grids.append((1, h, w))
        end += h * w
    if grids:
        calls.append((start, end, grids))
    return calls


def encode_vision(visual: Qwen3_5VisionModel | None, req: Request, inputs: VisionInputs,
                  device: torch.device, max_patches: int | None = None) -> torch.Tensor:
    """[placeholder tokens, hidden] on `device`: the vision tower's rows for the request's images or videos
    (`inputs`), in prompt order, from calls of at most `max_patches` patches (`vision_calls`): the tower's
    working memory is then bounded by what the engine profiled, however many images a request holds."""
    if visual is None:
        raise RuntimeError(f"request {req.request_id}: image or video input, but the model has no vision tower")
    pixels = inputs.pixel_values
    parts = [visual(pixels[a:b].to(device=device, dtype=visual.dtype), grids)
             for a, b, grids in vision_calls(inputs.grid_thw, max_patches)]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def image_step_inputs(requests: Sequence[Request], num_new_tokens: Sequence[int],
                      visual: Qwen3_5VisionModel | None, mrope: MRopeParams, device: torch.device,
                      max_patches: int | None = None) -> tuple[list[int], MultimodalStep | None]:
    """(position_offsets: each sequence's M-RoPE delta, [] when all are 0; the step's MultimodalStep when a
    sequence feeds prompt tokens of an image or video request, else None). max_patches: the most patches one
    tower call takes (`encode_vision`)."""
    offsets = [r.mrope_delta for r in requests]
    if not any(offsets):
        offsets = []
    if not any(r.has_vision and r.num_computed_tokens < r.num_prompt_tokens for r in requests):
        return offsets, None
    positions, index, embeds = [], [], []
    base = 0
    for req, n in zip(requests, num_new_tokens):
        start = req.num_computed_tokens
        positions.append(chunk_positions(req.mrope_positions, req.mrope_delta, start, start + n))
        if req.has_vision and start < req.num_prompt_tokens:
            prompt = req.prompt_token_ids
            chunk = torch.tensor(prompt[start:start + n], dtype=torch.int64)
            for token_id, inputs, attr in ((mrope.image_token_id, req.images, "image_embeds"),
                                           (mrope.video_token_id, req.videos, "video_embeds")):
                if inputs is None:
                    continue
                local = torch.nonzero(chunk == token_id).flatten()
                if not local.numel():
                    continue
                if getattr(req, attr) is None:
                    setattr(req, attr, encode_vision(visual, req, inputs, device, max_patches))
                # the chunk may start inside an image or video: its first placeholder's row is the count before it
                first = sum(1 for t in prompt[:start] if t == token_id)
                rows = torch.arange(first, first + local.numel(), device=device)
                index.append(base + local)
                embeds.append(getattr(req, attr)[rows])
        base += n
    return offsets, MultimodalStep(
        positions=torch.cat(positions, dim=1),
        token_index=torch.cat(index) if index else torch.empty(0, dtype=torch.int64),
        embeds=torch.cat(embeds) if embeds else torch.empty(0, device=device))
