"""Multimodal rotary positions (M-RoPE) of Qwen3.5: 3-D (temporal, height, width) position ids for prompts
that mix text, image and video placeholder tokens, and the interleaved cos/sin they select.

Positions, as transformers' `Qwen3_5MoeModel.get_rope_index` computes them:

- a text token takes (p, p, p) and advances p by one;
- an image whose grid is (t, h, w) patches fills its t * (h/m) * (w/m) placeholder tokens (m: spatial merge
  size), in row-major (t, row, column) order, with (p + ti, p + row, p + column); p then advances by
  max(h, w) / m, so text after a still image continues at the image's largest position + 1;
- a video whose grid is (t, h, w) is t frames (temporal patches) of grid (1, h, w), each placed like an
  image: Qwen3.5 writes every frame's placeholders apart, after its timestamp text, so time advances through
  the text positions rather than the temporal axis (transformers splits video_grid_thw the same way);
- after the prompt, token index i decodes at position i + delta on all three axes, delta = max position
  + 1 - prompt length (0 for text-only prompts, negative with images).

Every position is at most the token's index, so a 1-D cos/sin table sized for the context covers them.

Rotary frequencies: Qwen3.5 rotates the first rotary_dim = head_dim * partial_rotary_factor channels of
each head (rotate-half layout, rotary_dim / 2 frequencies). With mrope_section (s_t, s_h, s_w), frequency j
reads the height position when j % 3 == 1 and j < 3 * s_h, the width position when j % 3 == 2 and
j < 3 * s_w, and the temporal one otherwise; for [11, 11, 10] and 32 frequencies that is
T H W T H W ... T H T. transformers' Qwen3.5 code interleaves this way whatever `mrope_interleaved` says.
With the three axes equal (text only) this is exactly the 1-D rope of nibble/kernels/rope.py.

Exact against transformers. The engine (nibble/engine/image_steps.py) feeds the per-token table of
`mrope_cos_sin` to the existing `rope` kernel with positions arange(T) for steps with image prompt chunks,
and shifts plain 1-D positions by the delta elsewhere.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nibble.kernels.rope import rope_ref
from nibble.models.config import read_config_json

DEFAULT_MROPE_SECTION = (11, 11, 10)


@dataclass(frozen=True)
class MRopeParams:
    """What the 3-D positions need from a multimodal config.json (video_token_id: None when it has none)."""

    image_token_id: int
    spatial_merge_size: int = 2
    mrope_section: tuple[int, int, int] = DEFAULT_MROPE_SECTION
    video_token_id: int | None = None

    @classmethod
    def from_config_dict(cls, raw: dict[str, Any]) -> MRopeParams:
        """From a `Qwen3_5MoeForConditionalGeneration` config.json: top-level `image_token_id` and
        `video_token_id`, `vision_config.spatial_merge_size`, `text_config.rope_parameters.mrope_section`."""
        if "image_token_id" not in raw:
            raise ValueError("config has no image_token_id: not a multimodal Qwen3.5 config")
        text = raw.get("text_config") or {}
        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        section = tuple(int(s) for s in rope.get("mrope_section", DEFAULT_MROPE_SECTION))
        if len(section) != 3:
            raise ValueError(f"mrope_section {section} must have 3 entries")
        merge = int((raw.get("vision_config") or {}).get("spatial_merge_size", 2))
        video = raw.get("video_token_id")
        return cls(int(raw["image_token_id"]), merge, section,  # type: ignore[arg-type]
                   int(video) if video is not None else None)

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, hf_overrides: dict[str, Any] | None = None) -> MRopeParams:
        """From a checkpoint directory's config.json, `hf_overrides` (--hf-overrides) applied."""
        return cls.from_config_dict(read_config_json(model_dir, hf_overrides))


def mrope_positions(input_ids: Sequence[int] | torch.Tensor,
                    image_grid_thw: Sequence[Sequence[int]] | torch.Tensor | None,
                    image_token_id: int, spatial_merge_size: int = 2,
                    video_grid_thw: Sequence[Sequence[int]] | torch.Tensor | None = None,
                    video_token_id: int | None = None) -> tuple[torch.Tensor, int]:
    """3-D positions of one prompt.

    input_ids: [L] token ids, each image's placeholders as `image_token_id` runs of
    t * h * w / spatial_merge_size**2 tokens, each video frame's (temporal patch's) as a `video_token_id` run
    of h * w / spatial_merge_size**2; image_grid_thw / video_grid_thw: [num_items, 3] (t, h, w) in patches, in
    prompt order (None or empty: none). Adjacent images may share one run. video_token_id None: no video
    placeholders (its tokens count as text). Computed on the host. Returns (positions int64 [3, L], delta),
    delta being the offset from token index to position for the tokens after the prompt. ValueError when
    placeholders and grids disagree.
    """
    ids = torch.as_tensor(input_ids, dtype=torch.int64).reshape(-1).cpu()
    grids = {image_token_id: ("image", _grids(image_grid_thw))}
    videos = _grids(video_grid_thw)
    if videos:
        if video_token_id is None:
            raise ValueError("video grids given without a video_token_id")
        grids[video_token_id] = ("video frame", [(1, h, w) for t, h, w in videos for _ in range(t)])
    length = ids.numel()
    positions = torch.empty(3, length, dtype=torch.int64)
    if length == 0:
        if any(g for _, g in grids.values()):
            raise ValueError("image or video grids for an empty prompt")
        return positions, 0
    # kind of each token: its placeholder id, or -1 for text
    kind = torch.full_like(ids, -1)
    for tok in grids:
        kind[ids == tok] = tok
    bounds = [0, *(torch.nonzero(kind[1:] != kind[:-1]).flatten() + 1).tolist(), length]
    m = spatial_merge_size
    pos = 0
    used = dict.fromkeys(grids, 0)
    for start, end in itertools.pairwise(bounds):
        tok = int(kind[start])
        if tok == -1:
            positions[:, start:end] = torch.arange(pos, pos + end - start)
            pos += end - start
            continue
        name, items = grids[tok]
        i = start
        while i < end:
            if used[tok] == len(items):
                raise ValueError(f"{name} placeholder at token {i} but only {len(items)} {name} grids")
            t, h, w = items[used[tok]]
            if h % m or w % m or min(t, h, w) <= 0:
                raise ValueError(f"{name} grid {(t, h, w)} is not a positive multiple of the merge size {m}")
            gh, gw = h // m, w // m
            n = t * gh * gw
            if i + n > end:
                raise ValueError(f"{name} {used[tok]} (grid {(t, h, w)}) needs {n} placeholders, "
                                 f"the run at token {i} has {end - i}")
            cell = torch.arange(n)
            positions[0, i:i + n] = pos + cell // (gh * gw)
            positions[1, i:i + n] = pos + (cell // gw) % gh
            positions[2, i:i + n] = pos + cell % gw
            pos += max(h, w) // m
            i += n
            used[tok] += 1
    for tok, (name, items) in grids.items():
        if used[tok] != len(items):
            raise ValueError(f"{len(items)} {name} grids but placeholders for {used[tok]}")
    return positions, int(positions.max()) + 1 - length


def _grids(grid_thw: Sequence[Sequence[int]] | torch.Tensor | None) -> list[tuple[int, int, int]]:
    rows = torch.as_tensor([] if grid_thw is None else grid_thw, dtype=torch.int64).reshape(-1, 3)
    return [(int(t), int(h), int(w)) for t, h, w in rows.tolist()]


def mrope_decode_positions(start: int, count: int, delta: int) -> torch.Tensor:
    """int64 [3, count]: positions of the tokens at indices start .. start + count - 1 past the prompt."""
    return torch.arange(start + delta, start + delta + count, dtype=torch.int64).repeat(3, 1)


def mrope_axis(num_freqs: int, mrope_section: Sequence[int] = DEFAULT_MROPE_SECTION) -> torch.Tensor:
    """int64 [num_freqs]: which position axis (0 temporal, 1 height, 2 width) each rotary frequency reads."""
    j = torch.arange(num_freqs)
    axis = torch.zeros(num_freqs, dtype=torch.int64)
    axis[(j % 3 == 1) & (j < 3 * mrope_section[1])] = 1
    axis[(j % 3 == 2) & (j < 3 * mrope_section[2])] = 2
    return axis


def mrope_cos_sin(positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                  mrope_section: Sequence[int] = DEFAULT_MROPE_SECTION) -> torch.Tensor:
    """Per-token cos/sin rows for 3-D positions, in the layout of the 1-D cache.

    positions: int64 [3, T]; cos_sin_cache: fp32 [max_positions, rotary_dim] as `build_cos_sin_cache`
    makes it (cos of the rotary_dim/2 frequencies, then their sin). Returns fp32 [T, rotary_dim]; row i is
    cache row positions[axis(j), i] in frequency column j (cos and sin alike), so it equals
    cos_sin_cache[positions[0]] when the three axes agree.
    """
    if positions.dim() != 2 or positions.shape[0] != 3:
        raise ValueError(f"mrope positions must be [3, T], got {tuple(positions.shape)}")
    half = cos_sin_cache.shape[-1] // 2
    axis = mrope_axis(half, mrope_section).to(cos_sin_cache.device).repeat(2)
    per_axis = cos_sin_cache[positions.to(cos_sin_cache.device)]  # [3, T, rotary_dim]
    index = axis.view(1, 1, -1).expand(1, per_axis.shape[1], -1)
    return per_axis.gather(0, index).squeeze(0)


def mrope_ref(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
              mrope_section: Sequence[int] = DEFAULT_MROPE_SECTION) -> tuple[torch.Tensor, torch.Tensor]:
    """M-RoPE on q [T, Hq, D] and k [T, Hk, D] (new tensors, their dtypes, math in fp32).

    positions: int64 [3, T]; cos_sin_cache: fp32 [max_positions, rotary_dim] with rotary_dim <= D (the
    partial rotary: head_dim * partial_rotary_factor); channels past rotary_dim pass through.
    """
    table = mrope_cos_sin(positions, cos_sin_cache, mrope_section)
    rows = torch.arange(table.shape[0], device=table.device)
    return rope_ref(q, k, rows, table)
