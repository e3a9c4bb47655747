"""nibble's Qwen3.5 vision tower against transformers' `Qwen3_5MoeVisionModel`.

A tiny random tower is made with transformers, its weights are copied into nibble's module through the
checkpoint-name loader, and both encode a batch of images of different grids (one of two frames, one larger
than the learned position table): fp32 outputs agree to 1e-5 relative, bf16 within bf16 rounding.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from nibble.layers.linear import WeightLoadError
from nibble.models.config import ConfigError
from nibble.models.qwen3_5_vision import Qwen3_5VisionModel, VisionConfig, load_vision_state

TINY = dict(depth=2, hidden_size=64, num_heads=4, intermediate_size=128, num_position_embeddings=64,
            out_hidden_size=96, patch_size=4, temporal_patch_size=2, spatial_merge_size=2, in_channels=3,
            hidden_act="gelu_pytorch_tanh")
GRIDS = [[1, 4, 6], [1, 8, 8], [2, 4, 4], [1, 12, 10], [1, 2, 2]]
REAL_CONFIG = Path("/work/shared/models/qwen3.5/Qwen3.5-397B-A17B/config.json")


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


@pytest.fixture(scope="module")
def reference() -> torch.nn.Module:
    """transformers' tower with every parameter random, LayerNorms included, at scales that keep activations
    O(1)."""
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeVisionConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeVisionModel

    model = Qwen3_5MoeVisionModel(Qwen3_5MoeVisionConfig(**TINY)).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if p.dim() == 1:
                p.copy_(1 + 0.1 * noise if "norm" in name and name.endswith("weight") else 0.1 * noise)
            elif name == "pos_embed.weight":
                p.copy_(0.5 * noise)
            else:
                p.copy_(noise / p[0].numel() ** 0.5)
    return model


def _checkpoint(reference: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {f"model.visual.{n}": t.clone() for n, t in reference.state_dict().items()}


def _nibble(reference: torch.nn.Module, dtype: torch.dtype) -> Qwen3_5VisionModel:
    model = Qwen3_5VisionModel(VisionConfig.from_dict(TINY), dtype=dtype)
    tensors = _checkpoint(reference)
    tensors["model.language_model.embed_tokens.weight"] = torch.zeros(4, 4)  # not the tower's: ignored
    load_vision_state(model, tensors)
    return model


def _pixels(grids: list[list[int]], seed: int) -> torch.Tensor:
    n = sum(t * h * w for t, h, w in grids)
    return torch.randn(n, 3 * 2 * 4 * 4, generator=torch.Generator().manual_seed(seed))


def _expected(reference: torch.nn.Module, pixels: torch.Tensor, grids: list[list[int]]) -> torch.Tensor:
    with torch.no_grad():
        return reference(pixels, grid_thw=torch.tensor(grids)).pooler_output


def test_fp32_matches_transformers(reference: torch.nn.Module) -> None:
    model = _nibble(reference, torch.float32)
    for seed in (1, 2):
        pixels = _pixels(GRIDS, seed)
        want = _expected(reference, pixels, GRIDS)
        with torch.no_grad():
            got = model(pixels, torch.tensor(GRIDS))
        assert got.shape == (sum(t * h * w for t, h, w in GRIDS) // 4, 96) == want.shape
        assert got.dtype == torch.float32
        assert _rel_err(got, want) < 1e-5


def test_images_do_not_see_each_other(reference: torch.nn.Module) -> None:
    """Each image's tokens depend only on its own patches: the batch equals the images encoded one by one."""
    model = _nibble(reference, torch.float32)
    pixels = _pixels(GRIDS, 3)
    with torch.no_grad():
        batched = model(pixels, GRIDS)
        alone = torch.cat([model(chunk, [g]) for chunk, g in
                           zip(pixels.split([t * h * w for t, h, w in GRIDS]), GRIDS)])
    assert _rel_err(batched, alone) < 1e-6


@pytest.mark.parametrize("max_patches", [None, 1, 30, 64, 100])
def test_tower_calls_bounded_by_patches_give_the_same_rows(reference: torch.nn.Module,
                                                           max_patches: int | None) -> None:
    """encode_vision in calls of at most max_patches patches (a video split between its temporal patches, a
    larger image alone) gives the rows of one call, and no call but a single oversized unit exceeds the bound."""
    from nibble.engine.image_steps import encode_vision, vision_calls
    from nibble.engine.request import Request
    from nibble.engine.sampling_params import SamplingParams
    from nibble.models.multimodal import ImageInputs

    model = _nibble(reference, torch.float32)
    grid = torch.tensor(GRIDS)
    calls = vision_calls(grid, max_patches)
    assert calls[0][0] == 0 and calls[-1][1] == sum(t * h * w for t, h, w in GRIDS)
    for a, b, grids in calls:
        assert max_patches is None or b - a <= max_patches or len(grids) == 1
        assert b - a == sum(h * w for _, h, w in grids) and all(t == 1 for t, _, _ in grids)
    pixels = _pixels(GRIDS, 5)
    req = Request("r", [1], SamplingParams())
    with torch.no_grad():
        whole = model(pixels, GRIDS)
        got = encode_vision(model, req, ImageInputs(pixels, grid), torch.device("cpu"), max_patches)
    assert _rel_err(got, whole) < 1e-6


def test_bf16_close_to_fp32_reference(reference: torch.nn.Module) -> None:
    model = _nibble(reference, torch.bfloat16)
    pixels = _pixels(GRIDS, 4)
    want = _expected(reference, pixels, GRIDS)
    with torch.no_grad():
        got = model(pixels, torch.tensor(GRIDS))
    assert got.dtype == torch.bfloat16
    assert _rel_err(got, want) < 3e-2


def test_bad_inputs_raise_clear_errors(reference: torch.nn.Module) -> None:
    model = _nibble(reference, torch.float32)
    pixels = _pixels([[1, 4, 4]], 5)
    with pytest.raises(ValueError, match=r"describes 16 patches but pixel_values has 15 rows"):
        model(pixels[:15], [[1, 4, 4]])
    with pytest.raises(ValueError, match=r"pixel_values must have shape \[num_patches, 96\]"):
        model(pixels[:, :90], [[1, 4, 4]])
    with pytest.raises(ValueError, match=r"grid_thw\[0\] = \[1, 3, 4\].*multiples of spatial_merge_size 2"):
        model(pixels[:12], [[1, 3, 4]])
    with pytest.raises(ValueError, match=r"shape \[num_images, 3\]"):
        model(pixels, [[4, 4]])
    with pytest.raises(ValueError, match=r"shape \[num_images, 3\]"):
        model(pixels, torch.tensor([1, 4, 4]))


def test_loader_names_missing_unknown_and_misshaped_tensors(reference: torch.nn.Module) -> None:
    config = VisionConfig.from_dict(TINY)
    tensors = _checkpoint(reference)
    del tensors["model.visual.blocks.1.attn.proj.bias"]
    with pytest.raises(WeightLoadError, match=r"missing vision tensors: model\.visual\.blocks\.1\.attn\.proj\.bias"):
        load_vision_state(Qwen3_5VisionModel(config, torch.float32), tensors)

    tensors = _checkpoint(reference)
    tensors["model.visual.merger.linear_fc1.weight"] = torch.zeros(256, 255)
    with pytest.raises(WeightLoadError, match=r"'model\.visual\.merger\.linear_fc1\.weight': expected shape "
                                              r"\(256, 256\), found \(256, 255\)"):
        load_vision_state(Qwen3_5VisionModel(config, torch.float32), tensors)

    tensors = _checkpoint(reference)
    tensors["model.visual.blocks.7.norm1.weight"] = torch.zeros(64)
    with pytest.raises(WeightLoadError, match=r"'model\.visual\.blocks\.7\.norm1\.weight': not part of"):
        load_vision_state(Qwen3_5VisionModel(config, torch.float32), tensors)

    # the text-only layout's `visual.` prefix is read too
    model = Qwen3_5VisionModel(config, torch.float32)
    load_vision_state(model, {n.removeprefix("model."): t for n, t in _checkpoint(reference).items()})


@pytest.mark.skipif(not REAL_CONFIG.is_file(), reason="Qwen3.5 config files not present")
def test_real_config_names_and_shapes_match_transformers() -> None:
    """At Qwen3.5-397B's size (on the meta device), nibble's parameters are transformers' state dict."""
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeVisionConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeVisionModel

    raw = json.loads(REAL_CONFIG.read_text())["vision_config"]
    config = VisionConfig.from_pretrained(REAL_CONFIG.parent)
    assert (config.depth, config.hidden_size, config.head_dim, config.patch_dim, config.num_grid_per_side,
            config.merged_hidden_size, config.out_hidden_size) == (27, 1152, 72, 1536, 48, 4608, 4096)
    with torch.device("meta"):
        theirs = Qwen3_5MoeVisionModel(Qwen3_5MoeVisionConfig(**{k: v for k, v in raw.items() if k != "model_type"}))
    ours = Qwen3_5VisionModel(config, device="meta")
    assert {n: tuple(t.shape) for n, t in ours.state_dict().items()} == \
        {n: tuple(t.shape) for n, t in theirs.state_dict().items()}


def test_config_errors() -> None:
    with pytest.raises(ConfigError, match="missing field 'depth'"):
        VisionConfig.from_dict({k: v for k, v in TINY.items() if k != "depth"})
    with pytest.raises(ConfigError, match="num_position_embeddings 60 is not a square"):
        VisionConfig.from_dict({**TINY, "num_position_embeddings": 60})
    with pytest.raises(ConfigError, match="deepstack_visual_indexes"):
        VisionConfig.from_dict({**TINY, "deepstack_visual_indexes": [3]})
