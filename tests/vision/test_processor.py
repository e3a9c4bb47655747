"""nibble.models.vision_processor against transformers' image processor for Qwen3.5 (Qwen2VLImageProcessorPil
loaded from the published Qwen3.5 preprocessor_config.json): pixel_values bit for bit, image_grid_thw,
placeholder counts; config reading; data URL / bytes decoding and its errors."""

from __future__ import annotations

import base64
import io
import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from nibble.models.vision_processor import (
    ImageProcessorParams,
    decode_image,
    num_image_tokens,
    preprocess_image,
    preprocess_images,
    smart_resize,
)

# preprocessor_config.json of the published Qwen3.5 checkpoints.
QWEN35_PREPROCESSOR = {
    "size": {"longest_edge": 16777216, "shortest_edge": 65536},
    "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "processor_class": "Qwen3VLProcessor", "image_processor_type": "Qwen2VLImageProcessorFast",
}
# A smaller budget (legacy min/max_pixels keys, CLIP mean/std) so that big images stay cheap to compare.
SMALL_PREPROCESSOR = {**QWEN35_PREPROCESSOR, "min_pixels": 64 * 64, "max_pixels": 320 * 320,
                      "image_mean": [0.48145466, 0.4578275, 0.40821073],
                      "image_std": [0.26862954, 0.26130258, 0.27577711]}


def _hf_processor(tmp: Path, raw: dict[str, Any]) -> Any:
    sys.modules.setdefault("fla", None)  # type: ignore[arg-type]
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    (tmp / "preprocessor_config.json").write_text(json.dumps(raw))
    return Qwen2VLImageProcessorPil.from_pretrained(tmp)


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, ImageProcessorParams]:
    d = tmp_path_factory.mktemp("qwen35_proc")
    hf = _hf_processor(d, QWEN35_PREPROCESSOR)
    return hf, ImageProcessorParams.from_model_dir(d)


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, ImageProcessorParams]:
    d = tmp_path_factory.mktemp("small_proc")
    hf = _hf_processor(d, SMALL_PREPROCESSOR)
    return hf, ImageProcessorParams.from_model_dir(d)


def _picture(width: int, height: int, seed: int = 0, channels: int = 3) -> np.ndarray:
    """uint8 [H, W, C]: gradients plus noise, so that resampling errors would show."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([255 * x / max(width, 1), 255 * y / max(height, 1), 128 + 0 * x] + [200 + 0 * x] *
                    (channels - 3), axis=-1)
    return np.clip(base + rng.normal(0, 30, base.shape), 0, 255).astype(np.uint8)


def _compare(hf: Any, params: ImageProcessorParams, image: Any) -> tuple[torch.Tensor, int]:
    ref = hf(images=image, return_tensors="pt")
    got = preprocess_image(image, params)
    assert got.grid_thw == tuple(ref["image_grid_thw"][0].tolist())
    assert got.pixel_values.dtype == torch.float32 and got.pixel_values.shape == ref["pixel_values"].shape
    assert torch.equal(got.pixel_values, ref["pixel_values"])
    return ref["image_grid_thw"][0], got.num_tokens


@pytest.mark.parametrize("width,height", [(37, 91), (640, 480), (1, 1), (300, 2), (255, 257), (1000, 33)])
def test_pixel_values_match_transformers(qwen35: tuple[Any, ImageProcessorParams], width: int, height: int) -> None:
    hf, params = qwen35
    image = Image.fromarray(_picture(width, height, seed=width), mode="RGB")
    grid, tokens = _compare(hf, params, image)
    # The processor's own placeholder arithmetic (Qwen3VLProcessor.replace_image_token) and its size-only path.
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    proc = SimpleNamespace(image_processor=hf, image_token="<|image_pad|>")
    placeholders = Qwen3VLProcessor.replace_image_token(proc, {"image_grid_thw": grid[None]}, 0)
    assert tokens == placeholders.count("<|image_pad|>") == int(grid.prod()) // 4
    assert num_image_tokens(height, width, params) == hf.get_number_of_image_patches(height, width) // 4 == tokens


@pytest.mark.parametrize("width,height", [(3000, 2000), (1800, 4100), (50, 50)])
def test_scaled_to_the_pixel_budget_match_transformers(small: tuple[Any, ImageProcessorParams], width: int,
                                                       height: int) -> None:
    hf, params = small
    assert params.max_pixels == 320 * 320 and params.min_pixels == 64 * 64
    grid, _ = _compare(hf, params, Image.fromarray(_picture(width, height), mode="RGB"))
    assert int(grid[1] * grid[2]) * 16 * 16 <= params.max_pixels


def test_other_inputs_and_modes_match_transformers(qwen35: tuple[Any, ImageProcessorParams]) -> None:
    hf, params = qwen35
    rgb = _picture(45, 70, seed=1)
    _compare(hf, params, rgb)  # numpy [H, W, 3]
    rgba = _picture(45, 70, seed=2, channels=4)
    rgba[..., 3] = np.linspace(0, 255, 45, dtype=np.uint8)[None, :]
    _compare(hf, params, Image.fromarray(rgba, mode="RGBA"))
    _compare(hf, params, Image.fromarray(rgb[..., 0], mode="L"))
    _compare(hf, params, Image.fromarray(rgb, mode="RGB").convert("P", palette=Image.Palette.ADAPTIVE))
    got = preprocess_image(torch.from_numpy(rgb), params).pixel_values
    assert torch.equal(got, preprocess_image(rgb, params).pixel_values)


def test_batch_matches_transformers(qwen35: tuple[Any, ImageProcessorParams]) -> None:
    hf, params = qwen35
    images = [Image.fromarray(_picture(w, h, seed=w)) for w, h in [(37, 91), (400, 120), (64, 64)]]
    ref = hf(images=images, return_tensors="pt")
    pixel_values, grid_thw = preprocess_images(images, params)
    assert torch.equal(grid_thw, ref["image_grid_thw"]) and torch.equal(pixel_values, ref["pixel_values"])


def test_patch_layout() -> None:
    """Row r of pixel_values is patch (row, col) of the merge window order; its columns are (c, t, y, x)."""
    params = ImageProcessorParams(min_pixels=64 * 96, max_pixels=64 * 96, image_mean=(0.0,) * 3,
                                  image_std=(1.0,) * 3, rescale_factor=1.0)
    img = _picture(96, 64, seed=5)
    out = preprocess_image(img, params)
    assert out.grid_thw == (1, 4, 6) and out.num_tokens == 6
    rows = out.pixel_values.view(4 // 2, 6 // 2, 2, 2, 3, 2, 16, 16)
    for r, c in [(0, 0), (1, 4), (3, 5), (2, 1)]:
        patch = torch.from_numpy(img[16 * r:16 * r + 16, 16 * c:16 * c + 16]).permute(2, 0, 1).float()
        for t in range(2):
            assert torch.equal(rows[r // 2, c // 2, r % 2, c % 2, :, t], patch)


def test_smart_resize_matches_transformers() -> None:
    sys.modules.setdefault("fla", None)  # type: ignore[arg-type]
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf_smart_resize

    params = ImageProcessorParams()
    rng = np.random.default_rng(0)
    sizes = [(1, 1), (16, 16), (4096, 4096), (4097, 4097), (8000, 6000), (20000, 100), (100, 20000), (31, 6200)]
    sizes += [tuple(int(v) for v in rng.integers(1, 9000, 2)) for _ in range(2000)]
    for h, w in sizes:
        if max(h, w) / min(h, w) > 200:
            with pytest.raises(ValueError, match="aspect ratio"):
                smart_resize(h, w, params)
            continue
        got = smart_resize(h, w, params)
        assert got == hf_smart_resize(h, w, factor=32, min_pixels=65536, max_pixels=16777216), (h, w)
        assert got[0] % 32 == 0 and got[1] % 32 == 0 and got[0] * got[1] <= params.max_pixels
    assert math.prod(smart_resize(8000, 6000, params)) <= 4096 * 4096


def test_params_from_model_dir(tmp_path: Path) -> None:
    assert ImageProcessorParams.from_model_dir(tmp_path) == ImageProcessorParams()
    (tmp_path / "config.json").write_text(json.dumps(
        {"vision_config": {"patch_size": 14, "temporal_patch_size": 2, "spatial_merge_size": 2}}))
    assert ImageProcessorParams.from_model_dir(tmp_path).patch_size == 14
    (tmp_path / "processor_config.json").write_text(json.dumps({"image_processor": {"patch_size": 14,
                                                                                    "size": {"longest_edge": 10**6}}}))
    assert ImageProcessorParams.from_model_dir(tmp_path).max_pixels == 10**6
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(QWEN35_PREPROCESSOR))
    with pytest.raises(ValueError, match="patch_size=16 but the vision tower has 14"):
        ImageProcessorParams.from_model_dir(tmp_path)
    with pytest.raises(ValueError, match="do_normalize"):
        ImageProcessorParams.from_dict({"do_normalize": False})
    with pytest.raises(ValueError, match="bicubic"):
        ImageProcessorParams.from_dict({"resample": 2})


def _encoded(image: Image.Image, fmt: str, **kwargs: Any) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **kwargs)
    return buf.getvalue()


def test_decode_data_url_and_bytes() -> None:
    rgb = Image.fromarray(_picture(23, 17, seed=3))
    png = _encoded(rgb, "PNG")
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    for decoded in (decode_image(url), decode_image(png)):
        assert decoded.mode == "RGB" and np.array_equal(np.array(decoded), np.array(rgb))
    rgba = Image.fromarray(_picture(8, 8, seed=4, channels=4), mode="RGBA")
    assert decode_image(_encoded(rgba, "PNG")).mode == "RGB"
    # EXIF orientation 6 (rotate 90° clockwise to display) is applied, as transformers' load_image does.
    exif = Image.Exif()
    exif[0x0112] = 6
    jpeg = decode_image(_encoded(rgb, "JPEG", exif=exif.tobytes()))
    assert jpeg.size == (17, 23)


@pytest.mark.parametrize("source,match", [
    ("https://example.com/cat.png", "data:image/...;base64 URLs, http\\(s\\):// or file:// URLs \\(the engine fetches"),
    ("cat.png", "got 'cat.png'"),
    ("data:image/png;base64", "no ','"),
    ("data:image/png,abcd", "base64-encoded"),
    ("data:text/plain;base64,aGVsbG8=", "not an image"),
    ("data:image/png;base64,@@@not-base64@@@", "not valid base64"),
    ("data:image/png;base64,aGVsbG8gd29ybGQ=", "not a recognised image"),
    (b"", "empty"),
    (b"GIF89a\x00\x00 not really", "not a recognised image|corrupt"),
])
def test_decode_errors(source: str | bytes, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        decode_image(source)


def test_decode_truncated_and_oversized() -> None:
    png = _encoded(Image.fromarray(_picture(64, 64, seed=6)), "PNG")
    with pytest.raises(ValueError, match="corrupt or truncated"):
        decode_image(png[: len(png) // 2])
    with pytest.raises(ValueError, match="exceeds 1000 pixels"):
        decode_image(png, max_pixels=1000)
