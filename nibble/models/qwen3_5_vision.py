"""Qwen3.5 vision encoder (the `model.visual.*` tower of `Qwen3_5MoeForConditionalGeneration`), in plain PyTorch.

The checkpoint loader builds it as `model.visual` (nibble/checkpoint/loader.py) and the engine runs it at an
image request's first prefill chunk. It computes what transformers' `Qwen3_5MoeVisionModel` computes.

    pixel_values [num_patches, C*T*P*P], grid_thw [num_images, 3] -> embeddings [num_patches / merge^2, out_hidden]

Patches arrive as the image processor emits them: image by image, frame by frame, and within a frame in
spatial-merge-block order (block row, block column, row in block, column in block), so that every merge^2
consecutive patches form one output token. Each patch is embedded by a linear map (the checkpoint's Conv3d
with stride = kernel), gets the learned position table resampled bilinearly to its image's grid, and passes
`depth` pre-LayerNorm blocks whose attention sees only the patches of the same frame and rotates q/k by the
patch's (row, column) (2-D rotary). The merger normalises, concatenates merge^2 neighbours and projects to
the language model's width.

Parameter names are the checkpoint's with `model.visual.` (or `visual.`) removed: `load_weights` takes the
checkpoint names as they are, streamed one at a time like the text model's, and `load_vision_state` fills
the module from a dict.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from nibble.layers.linear import FLOAT_DTYPES, WeightLoadError, check_tensor
from nibble.layers.parallel import TensorSource, read_full
from nibble.models.config import ConfigError

VISION_CHECKPOINT_PREFIXES = ("model.visual.", "visual.")
# transformers hard-codes these: LayerNorm eps of the blocks and the merger, erf GELU in the merger.
LAYER_NORM_EPS = 1e-6
_ACTIVATIONS = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}


@dataclass(frozen=True)
class VisionConfig:
    """Shapes of the vision tower, from a checkpoint config.json's `vision_config`. Derived values are
    properties."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    out_hidden_size: int
    num_position_embeddings: int
    hidden_act: str
    rope_theta: float
    source: str = field(default="", compare=False)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Values per flattened patch: C * T * P * P."""
        return self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size

    @property
    def merge_unit(self) -> int:
        """Patches per output token: merge^2."""
        return self.spatial_merge_size * self.spatial_merge_size

    @property
    def merged_hidden_size(self) -> int:
        return self.hidden_size * self.merge_unit

    @property
    def num_grid_per_side(self) -> int:
        """Side of the square learned position table."""
        return math.isqrt(self.num_position_embeddings)

    @classmethod
    def from_dict(cls, vision: dict[str, Any], source: str = "config.json") -> VisionConfig:
        """vision: the `vision_config` object of a Qwen3.5 multimodal config.json."""
        where = f"{source} (vision_config)"

        def get(key: str, default: Any = ...) -> Any:
            if key in vision:
                return vision[key]
            if default is ...:
                raise ConfigError(f"{where}: missing field '{key}'")
            return default

        rope = dict(vision.get("rope_parameters") or {})
        rope_type = rope.get("rope_type", "axial")
        if rope_type != "axial":
            raise ConfigError(f"{where}: rope_type '{rope_type}' is not supported (the tower uses 'axial')")
        if vision.get("deepstack_visual_indexes"):
            raise ConfigError(f"{where}: deepstack_visual_indexes {vision['deepstack_visual_indexes']} are not "
                              "supported (Qwen3.5's tower has none)")
        cfg = cls(
            depth=int(get("depth")),
            hidden_size=int(get("hidden_size")),
            intermediate_size=int(get("intermediate_size")),
            num_heads=int(get("num_heads")),
            in_channels=int(get("in_channels", 3)),
            patch_size=int(get("patch_size")),
            temporal_patch_size=int(get("temporal_patch_size", 2)),
            spatial_merge_size=int(get("spatial_merge_size", 2)),
            out_hidden_size=int(get("out_hidden_size")),
            num_position_embeddings=int(get("num_position_embeddings")),
            hidden_act=str(get("hidden_act", "gelu_pytorch_tanh")),
            rope_theta=float(rope.get("rope_theta", vision.get("rope_theta", 10000.0))),
            source=source,
        )
        cfg._validate(where)
        return cfg

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> VisionConfig:
        """The vision config of a checkpoint directory; ConfigError if it has none (a text-only checkpoint)."""
        path = Path(model_dir) / "config.json"
        try:
            raw = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"{path}: cannot read: {e}") from e
        if not isinstance(raw.get("vision_config"), dict):
            raise ConfigError(f"{path}: no vision_config (a text-only checkpoint)")
        return cls.from_dict(raw["vision_config"], source=str(path))

    def _validate(self, where: str) -> None:
        def check(cond: bool, msg: str) -> None:
            if not cond:
                raise ConfigError(f"{where}: {msg}")

        check(self.hidden_size % self.num_heads == 0,
              f"hidden_size {self.hidden_size} is not a multiple of num_heads {self.num_heads}")
        # the axial rotary splits each half of the head between rows and columns
        check(self.head_dim % 4 == 0, f"head dim {self.head_dim} is not a multiple of 4")
        check(self.num_grid_per_side ** 2 == self.num_position_embeddings,
              f"num_position_embeddings {self.num_position_embeddings} is not a square")
        check(self.hidden_act in _ACTIVATIONS,
              f"hidden_act '{self.hidden_act}' is not supported ({', '.join(_ACTIVATIONS)})")
        check(min(self.depth, self.patch_size, self.temporal_patch_size, self.spatial_merge_size) > 0,
              "depth, patch sizes and spatial_merge_size must be positive")


@dataclass(frozen=True)
class VisionLayout:
    """Per-batch values every block shares, computed once per forward from grid_thw.

    rows, cols: int64 [num_patches], each patch's position in its frame. cos, sin: fp32 [num_patches,
    head_dim / 2], the rotary angles. segments: per distinct frame length L, int64 [num_frames_of_L, L], the
    patch indices of each frame of that length (attention is restricted to a frame).
    """

    rows: torch.Tensor
    cols: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    segments: tuple[torch.Tensor, ...]


def parse_grid(grid_thw: torch.Tensor | Sequence[Sequence[int]], config: VisionConfig,
               num_patches: int | None = None) -> list[tuple[int, int, int]]:
    """grid_thw [num_images, 3] (frames, patch rows, patch columns) as Python ints, checked against the merge
    size and, when given, the number of patches. Raises ValueError naming the bad image."""
    grid = grid_thw.tolist() if isinstance(grid_thw, torch.Tensor) else list(grid_thw)
    if not grid or any(not isinstance(g, (list, tuple)) or len(g) != 3 for g in grid):
        raise ValueError(f"grid_thw must have shape [num_images, 3] with num_images >= 1, got {grid}")
    m = config.spatial_merge_size
    out = []
    for i, g in enumerate(grid):
        t, h, w = (int(x) for x in g)
        if min(t, h, w) <= 0 or h % m or w % m:
            raise ValueError(f"grid_thw[{i}] = {[t, h, w]}: frames, rows and columns must be positive and rows "
                             f"and columns multiples of spatial_merge_size {m}")
        out.append((t, h, w))
    total = sum(t * h * w for t, h, w in out)
    if num_patches is not None and total != num_patches:
        raise ValueError(f"grid_thw {[list(g) for g in out]} describes {total} patches but pixel_values has "
                         f"{num_patches} rows")
    return out


def _block_order(h: int, w: int, m: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, cols) int64 [h * w] of a frame's patches in spatial-merge-block order."""
    shape = (h // m, w // m, m, m)
    block_row = torch.arange(h // m, device=device).view(-1, 1, 1, 1)
    block_col = torch.arange(w // m, device=device).view(1, -1, 1, 1)
    in_block = torch.arange(m, device=device)
    rows = (block_row * m + in_block.view(1, 1, -1, 1)).expand(shape).reshape(-1)
    cols = (block_col * m + in_block.view(1, 1, 1, -1)).expand(shape).reshape(-1)
    return rows, cols


def build_layout(grid: Sequence[tuple[int, int, int]], config: VisionConfig, device: torch.device) -> VisionLayout:
    """The layout of a batch of images given as `parse_grid` returns them."""
    rows, cols, by_length = [], [], {}
    start = 0
    for t, h, w in grid:
        r, c = _block_order(h, w, config.spatial_merge_size, device)
        rows.append(r.repeat(t))
        cols.append(c.repeat(t))
        for _ in range(t):
            by_length.setdefault(h * w, []).append(start)
            start += h * w
    row, col = torch.cat(rows), torch.cat(cols)
    # head_dim / 4 frequencies, used once for the row and once for the column: together half a head
    half = config.head_dim // 2
    inv_freq = 1.0 / config.rope_theta ** (torch.arange(0, half, 2, dtype=torch.float32, device=device) / half)
    angles = torch.cat([row[:, None].float() * inv_freq, col[:, None].float() * inv_freq], dim=-1)
    segments = tuple(torch.tensor(starts, device=device)[:, None] + torch.arange(length, device=device)
                     for length, starts in by_length.items())
    return VisionLayout(row, col, angles.cos(), angles.sin(), segments)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, head_dim] rotated in fp32 by cos/sin [N, head_dim / 2] (pairs i, i + head_dim / 2)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos[:, None], sin[:, None]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class VisionAttention(nn.Module):
    """Bidirectional multi-head attention within each frame. [N, hidden] -> [N, hidden]."""

    def __init__(self, config: VisionConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.head_dim = config.head_dim
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size, dtype=dtype, device=device)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, layout: VisionLayout) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        q, k = apply_rotary(q, layout.cos, layout.sin), apply_rotary(k, layout.cos, layout.sin)
        out = torch.empty_like(q)
        # frames of equal length (all frames of a video, same-size images) share one batched SDPA call
        for index in layout.segments:
            qs, ks, vs = (t[index].transpose(1, 2) for t in (q, k, v))  # [frames, heads, L, head_dim]
            out[index] = F.scaled_dot_product_attention(qs, ks, vs).transpose(1, 2)
        return self.proj(out.view(n, -1))


class VisionMLP(nn.Module):
    def __init__(self, config: VisionConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.approximate = _ACTIVATIONS[config.hidden_act]
        self.linear_fc1 = nn.Linear(config.hidden_size, config.intermediate_size, dtype=dtype, device=device)
        self.linear_fc2 = nn.Linear(config.intermediate_size, config.hidden_size, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate=self.approximate))


class VisionBlock(nn.Module):
    """Pre-LayerNorm transformer block. [N, hidden] -> [N, hidden]."""

    def __init__(self, config: VisionConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=LAYER_NORM_EPS, dtype=dtype, device=device)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=LAYER_NORM_EPS, dtype=dtype, device=device)
        self.attn = VisionAttention(config, dtype, device)
        self.mlp = VisionMLP(config, dtype, device)

    def forward(self, x: torch.Tensor, layout: VisionLayout) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), layout)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    """Flattened patches [N, C*T*P*P] -> [N, hidden]. The weight keeps the checkpoint's Conv3d shape
    [hidden, C, T, P, P]; a stride-equals-kernel convolution over one patch is a matmul."""

    def __init__(self, config: VisionConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        shape = (config.hidden_size, config.in_channels, config.temporal_patch_size, config.patch_size,
                 config.patch_size)
        self.proj = nn.Module()
        self.proj.weight = nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)
        self.proj.bias = nn.Parameter(torch.empty(shape[0], dtype=dtype, device=device), requires_grad=False)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        return F.linear(pixels.to(weight.dtype), weight.view(weight.shape[0], -1), self.proj.bias)


class PatchMerger(nn.Module):
    """[N, hidden] -> [N / merge^2, out_hidden]: norm, concatenate merge^2 consecutive patches, 2-layer MLP."""

    def __init__(self, config: VisionConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.merged = config.merged_hidden_size
        self.norm = nn.LayerNorm(config.hidden_size, eps=LAYER_NORM_EPS, dtype=dtype, device=device)
        self.linear_fc1 = nn.Linear(self.merged, self.merged, dtype=dtype, device=device)
        self.linear_fc2 = nn.Linear(self.merged, config.out_hidden_size, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x).view(-1, self.merged)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class Qwen3_5VisionModel(nn.Module):
    """forward(pixel_values [num_patches, patch_dim], grid_thw [num_images, 3]) -> [num_patches / merge^2,
    out_hidden_size] in `dtype`, the images' tokens concatenated in input order.

    Parameters start uninitialised (memory allocated on `device`, no random init): fill them with
    `load_weights` (+ `check_complete`) or `load_vision_state`.
    """

    def __init__(self, config: VisionConfig, dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        # built on meta and then allocated: the checkpoint overwrites every value, so random init is wasted time
        meta = torch.device("meta")
        self.patch_embed = PatchEmbed(config, dtype, meta)
        self.pos_embed = nn.Embedding(config.num_position_embeddings, config.hidden_size, dtype=dtype, device=meta)
        self.blocks = nn.ModuleList(VisionBlock(config, dtype, meta) for _ in range(config.depth))
        self.merger = PatchMerger(config, dtype, meta)
        self.to_empty(device=device)
        self.requires_grad_(False)
        self._loaded: set[str] = set()

    def forward(self, pixel_values: torch.Tensor,
                grid_thw: torch.Tensor | Sequence[Sequence[int]]) -> torch.Tensor:
        cfg = self.config
        if pixel_values.dim() != 2 or pixel_values.shape[1] != cfg.patch_dim:
            raise ValueError(f"pixel_values must have shape [num_patches, {cfg.patch_dim}] (C*T*P*P = "
                             f"{cfg.in_channels}*{cfg.temporal_patch_size}*{cfg.patch_size}*{cfg.patch_size}), "
                             f"got {list(pixel_values.shape)}")
        grid = parse_grid(grid_thw, cfg, pixel_values.shape[0])
        layout = build_layout(grid, cfg, pixel_values.device)
        x = self.patch_embed(pixel_values) + self.position_embeddings(grid, layout)
        for block in self.blocks:
            x = block(x, layout)
        return self.merger(x)

    def position_embeddings(self, grid: Sequence[tuple[int, int, int]], layout: VisionLayout) -> torch.Tensor:
        """[num_patches, hidden]: the learned table resampled (bilinear, corners aligned, fp32) to each image's
        grid and read at each patch's (row, column)."""
        side = self.config.num_grid_per_side
        table = self.pos_embed.weight.float().view(side, side, -1).permute(2, 0, 1)[None]
        parts, start = [], 0
        resized: dict[tuple[int, int], torch.Tensor] = {}
        for t, h, w in grid:
            if (h, w) not in resized:
                resized[h, w] = F.interpolate(table, size=(h, w), mode="bilinear", align_corners=True)[0]
            end = start + h * w
            parts.append(resized[h, w][:, layout.rows[start:end], layout.cols[start:end]].T.repeat(t, 1))
            start += t * h * w
        return torch.cat(parts).to(self.dtype)

    def expected_tensor_names(self, prefix: str = "model.visual.") -> list[str]:
        """Checkpoint names of every parameter."""
        return [prefix + n for n, _ in self.named_parameters()]

    def load_weights(self, weights: Iterable[tuple[str, TensorSource]]) -> None:
        """Copy checkpoint tensors (`model.visual.*` or `visual.*` names, in memory or lazily read) into the
        parameters. Raises WeightLoadError naming the tensor on an unknown name, shape or dtype mismatch;
        call `check_complete()` afterwards to find tensors the checkpoint lacked."""
        params = dict(self.named_parameters())
        for name, tensor in weights:
            local = strip_vision_prefix(name)
            if local is None or local not in params:
                raise WeightLoadError(f"tensor '{name}': not part of the Qwen3.5 vision tower")
            param = params[local]
            check_tensor(name, tensor, param.shape, FLOAT_DTYPES)
            with torch.no_grad():
                param.copy_(read_full(tensor))
            self._loaded.add(local)

    def check_complete(self) -> None:
        """Raise WeightLoadError listing the vision tensors not loaded yet (by checkpoint name)."""
        missing = [n for n in self.expected_tensor_names() if strip_vision_prefix(n) not in self._loaded]
        if missing:
            shown = ", ".join(missing[:8]) + (f" ... ({len(missing)} in all)" if len(missing) > 8 else "")
            raise WeightLoadError(f"checkpoint is missing vision tensors: {shown}")


def strip_vision_prefix(name: str) -> str | None:
    """The module-local name of a vision tower checkpoint tensor, None for any other tensor."""
    for prefix in VISION_CHECKPOINT_PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix):]
    return None


def load_vision_state(model: Qwen3_5VisionModel, tensors: Mapping[str, TensorSource]) -> None:
    """Fill `model` from tensors keyed by checkpoint names; names outside the vision tower are ignored, so a
    whole checkpoint's dict may be passed. Raises WeightLoadError naming a missing, unknown or mis-shaped
    tensor."""
    model.load_weights((n, t) for n, t in tensors.items() if strip_vision_prefix(n) is not None)
    model.check_complete()
