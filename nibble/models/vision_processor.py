"""Image preprocessing of Qwen3.5: a decoded image in, the vision tower's `pixel_values` and `grid_thw` out.

This reproduces what transformers (5.x) runs for `qwen3_5_moe` checkpoints: the Qwen2-VL image processor
configured by the checkpoint's `preprocessor_config.json`, in its PIL backend (`Qwen2VLImageProcessorPil`,
what transformers picks without torchvision). Its torchvision backend resizes with torch instead of PIL, so
its pixels can differ slightly from these; grids and token counts are the same.

1. `smart_resize`: both sides become multiples of patch_size * merge_size (32 for Qwen3.5), the area is
   brought within [min_pixels, max_pixels] and the aspect ratio is kept as well as rounding allows;
   the resampling is PIL's bicubic filter.
2. uint8 -> float: x * rescale_factor (in float64, then float32), then (x - mean) / std in float32.
3. A still image is one temporal patch: the frame is repeated temporal_patch_size times, so grid_t = 1.
4. Patchify to `pixel_values` [grid_t * grid_h * grid_w, C * T * P * P], rows ordered so that the
   merge_size x merge_size patches that the vision tower merges into one token are consecutive, each row
   laid out (channel, time, patch row, patch column).

The prompt gets grid_t * grid_h * grid_w / merge_size**2 image placeholder tokens per image.
`decode_image` turns a `data:` URL or raw bytes (those of a fetched URL too: engine/media.py) into the RGB
image this expects (EXIF orientation applied, transparency composited onto white as the processor does).

Exact against transformers; the engine (`LLMEngine.prepare_media`, for the offline API and the server)
preprocesses with it.
PIL is imported inside functions so that `import nibble` does not need it.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import torch

if TYPE_CHECKING:
    from PIL import Image

PREPROCESSOR_CONFIG = "preprocessor_config.json"
PROCESSOR_CONFIG = "processor_config.json"
MAX_ASPECT_RATIO = 200
_PIL_BICUBIC = 3
P = TypeVar("P")


@dataclass(frozen=True)
class ImageProcessorParams:
    """The image processor's settings; the defaults are those the Qwen3.5 checkpoints ship
    (256*256 to 4096*4096 pixels, 16-pixel patches, 2 frames per temporal patch, 2x2 merge, mean = std = 0.5).
    transformers' own class defaults are Qwen2-VL's (14-pixel patches, CLIP mean/std) and do not apply."""

    min_pixels: int = 256 * 256
    max_pixels: int = 4096 * 4096
    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255

    def __post_init__(self) -> None:
        for name in ("min_pixels", "max_pixels", "patch_size", "temporal_patch_size", "merge_size"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"image processor: {name} must be positive, got {getattr(self, name)}")
        if self.min_pixels > self.max_pixels:
            raise ValueError(f"image processor: min_pixels {self.min_pixels} > max_pixels {self.max_pixels}")
        if len(self.image_mean) != 3 or len(self.image_std) != 3 or any(s == 0 for s in self.image_std):
            raise ValueError(f"image processor: bad mean/std {self.image_mean} / {self.image_std}")

    @property
    def factor(self) -> int:
        """Both resized sides are multiples of this many pixels."""
        return self.patch_size * self.merge_size

    @property
    def patch_dim(self) -> int:
        """Length of one `pixel_values` row: 3 channels * temporal_patch_size * patch_size**2."""
        return 3 * self.temporal_patch_size * self.patch_size * self.patch_size

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ImageProcessorParams:
        """From the fields of a `preprocessor_config.json`. `size.shortest_edge` / `size.longest_edge` are
        pixel counts (min/max area), and legacy top-level `min_pixels` / `max_pixels` override them as they
        do in transformers. Settings that would switch off a step nibble always runs are refused."""
        kwargs = processor_kwargs(raw, "image processor", ("min_pixels", "max_pixels", "patch_size",
                                                             "temporal_patch_size", "merge_size"))
        return cls(**kwargs)

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> ImageProcessorParams:
        """From `preprocessor_config.json` (or the `image_processor` section of `processor_config.json`)
        when the directory has one; otherwise the Qwen3.5 defaults with the patch sizes of config.json's
        `vision_config`. A processor whose patch sizes disagree with the vision tower's is refused."""
        root = Path(model_dir)
        raw: dict[str, Any] | None = None
        if (root / PREPROCESSOR_CONFIG).is_file():
            raw = read_json_object(root / PREPROCESSOR_CONFIG)
        elif (root / PROCESSOR_CONFIG).is_file():
            raw = read_json_object(root / PROCESSOR_CONFIG).get("image_processor")
        tower = tower_patch_sizes(root)
        if raw is None:
            return cls(**tower)
        return check_tower_patch_sizes(cls.from_dict(raw), tower, root, "image processor")


@dataclass(frozen=True)
class ProcessedImage:
    """One image ready for the vision tower.

    pixel_values: float32 [grid_t * grid_h * grid_w, 3 * temporal_patch_size * patch_size**2].
    grid_thw: (grid_t, grid_h, grid_w) in patches, before merging.
    num_tokens: the image's placeholder tokens in the prompt, grid_t * grid_h * grid_w / merge_size**2.
    """

    pixel_values: torch.Tensor
    grid_thw: tuple[int, int, int]
    num_tokens: int


def read_json_object(path: Path) -> dict[str, Any]:
    """A JSON file holding an object; ValueError naming the file otherwise."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read ({e})") from e
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return raw

def processor_kwargs(raw: dict[str, Any], what: str, int_keys: Sequence[str]) -> dict[str, Any]:
    """Constructor arguments of an image or video processor's params from its config's fields (`what` names it
    in errors): `size.shortest_edge` / `size.longest_edge` as min/max pixels, `int_keys` as ints (legacy
    top-level min_pixels / max_pixels among them override `size`, as in transformers), mean / std (a list or one
    value for all channels) and rescale_factor. Settings that would switch off a step nibble always runs, or
    another resampling than bicubic, are refused."""
    for flag in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb"):
        if raw.get(flag, True) is False:
            raise ValueError(f"{what}: {flag}=false is not supported")
    if raw.get("resample", _PIL_BICUBIC) != _PIL_BICUBIC:
        raise ValueError(f"{what}: only bicubic resampling (3) is supported, got {raw['resample']}")
    size = raw.get("size") or {}
    kwargs: dict[str, Any] = {}
    if "shortest_edge" in size:
        kwargs["min_pixels"] = int(size["shortest_edge"])
    if "longest_edge" in size:
        kwargs["max_pixels"] = int(size["longest_edge"])
    for key in int_keys:
        if raw.get(key) is not None:
            kwargs[key] = int(raw[key])
    for key in ("image_mean", "image_std"):
        value = raw.get(key)
        if isinstance(value, list | tuple):
            kwargs[key] = tuple(float(v) for v in value)
        elif value is not None:
            kwargs[key] = (float(value),) * 3
    if raw.get("rescale_factor") is not None:
        kwargs["rescale_factor"] = float(raw["rescale_factor"])
    return kwargs


def tower_patch_sizes(root: Path) -> dict[str, int]:
    """The patch sizes config.json's `vision_config` gives (patch_size, temporal_patch_size, merge_size), those
    it sets; {} without one."""
    vision = read_json_object(root / "config.json").get("vision_config") if (root / "config.json").is_file() else None
    if not vision:
        return {}
    tower = {"patch_size": vision.get("patch_size"), "temporal_patch_size": vision.get("temporal_patch_size"),
             "merge_size": vision.get("spatial_merge_size")}
    return {k: int(v) for k, v in tower.items() if v is not None}


def check_tower_patch_sizes(params: P, tower: dict[str, int], root: Path, what: str) -> P:
    """`params` when its patch sizes are the tower's (`tower_patch_sizes`); ValueError naming `what` otherwise."""
    for key, value in tower.items():
        if getattr(params, key) != value:
            raise ValueError(f"{root}: {what} {key}={getattr(params, key)} but the vision tower has {value}")
    return params



def smart_resize(height: int, width: int, params: ImageProcessorParams) -> tuple[int, int]:
    """The (height, width) an image of this size is resized to: multiples of `params.factor`, area within
    [min_pixels, max_pixels], aspect ratio kept. Aspect ratios beyond 200:1 are refused (ValueError)."""
    if height <= 0 or width <= 0:
        raise ValueError(f"image size {width}x{height} is empty")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(f"image {width}x{height}: aspect ratio above {MAX_ASPECT_RATIO}:1 is not supported")
    f = params.factor
    # Python's round (half to even), and this order of operations, are what make sizes agree exactly.
    h = round(height / f) * f
    w = round(width / f) * f
    if h * w > params.max_pixels:
        beta = math.sqrt((height * width) / params.max_pixels)
        h = max(f, math.floor(height / beta / f) * f)
        w = max(f, math.floor(width / beta / f) * f)
    elif h * w < params.min_pixels:
        beta = math.sqrt(params.min_pixels / (height * width))
        h = math.ceil(height * beta / f) * f
        w = math.ceil(width * beta / f) * f
    return h, w


def num_image_tokens(height: int, width: int, params: ImageProcessorParams | None = None) -> int:
    """Placeholder tokens that an image of height x width pixels takes in the prompt, without processing it."""
    params = params or ImageProcessorParams()
    h, w = smart_resize(height, width, params)
    return (h // params.patch_size) * (w // params.patch_size) // (params.merge_size ** 2)


def _to_pil(image: Any) -> Image.Image:
    from PIL import Image

    if isinstance(image, Image.Image):
        return to_rgb(image)
    if isinstance(image, torch.Tensor):
        image = image.cpu().numpy()
    if not isinstance(image, np.ndarray):
        raise TypeError(f"expected a PIL image or an RGB uint8 array, got {type(image).__name__}")
    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[-1] != 3:
        raise ValueError(f"expected an RGB uint8 array [H, W, 3], got {image.dtype} {tuple(image.shape)}")
    return Image.fromarray(np.ascontiguousarray(image), mode="RGB")


def preprocess_image(image: Any, params: ImageProcessorParams | None = None) -> ProcessedImage:
    """A PIL image (any mode) or an RGB uint8 array/tensor [H, W, 3] -> `ProcessedImage`
    (pixel_values float32 [grid_h * grid_w, 3 * T * P * P] with grid_t = 1)."""
    from PIL import Image

    params = params or ImageProcessorParams()
    pil = _to_pil(image)
    height, width = smart_resize(pil.height, pil.width, params)
    if (width, height) != pil.size:
        pil = pil.resize((width, height), resample=Image.Resampling.BICUBIC)
    pixels = torch.from_numpy(np.array(pil, dtype=np.uint8))
    # Rescale in float64 and normalize in float32, the precisions transformers uses, so results are bit-equal.
    x = (pixels.to(torch.float64) * params.rescale_factor).to(torch.float32)
    mean = torch.tensor(params.image_mean, dtype=torch.float32)
    std = torch.tensor(params.image_std, dtype=torch.float32)
    x = ((x - mean) / std).permute(2, 0, 1)
    p, m, t = params.patch_size, params.merge_size, params.temporal_patch_size
    gh, gw = height // p, width // p
    patches = x.reshape(3, gh // m, m, p, gw // m, m, p)
    # -> [gh/m, gw/m, m, m, C, P, P]: a merge window's m*m patches become consecutive rows.
    patches = patches.permute(1, 4, 2, 5, 0, 3, 6)
    patches = patches.unsqueeze(5).expand(-1, -1, -1, -1, -1, t, -1, -1)
    pixel_values = patches.reshape(gh * gw, params.patch_dim).contiguous()
    return ProcessedImage(pixel_values, (1, gh, gw), gh * gw // (m * m))


def preprocess_images(images: list[Any], params: ImageProcessorParams | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Several images as the processor batches them: pixel_values float32 [sum of patches, patch_dim]
    (images one after another) and image_grid_thw int64 [num_images, 3]."""
    if not images:
        raise ValueError("no images")
    done = [preprocess_image(im, params) for im in images]
    return (torch.cat([d.pixel_values for d in done]),
            torch.tensor([d.grid_thw for d in done], dtype=torch.int64))


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB copy of a PIL image; transparency is composited onto white (what the processor does), other
    modes go through PIL's own conversion."""
    from PIL import Image

    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def decode_image(source: str | bytes, max_pixels: int | None = None) -> Image.Image:
    """A `data:image/...;base64,...` URL (str) or encoded image bytes -> RGB PIL image, EXIF orientation
    applied (http(s):// and file:// URLs are fetched into bytes before: engine/media.py). Anything else
    (other strings, bad base64, bytes that are no image, truncated files, images above
    `max_pixels` or PIL's decompression-bomb limit) raises ValueError with the reason."""
    from PIL import Image, ImageOps, UnidentifiedImageError

    data = data_url_bytes(source) if isinstance(source, str) else source
    if not isinstance(data, bytes | bytearray | memoryview):
        raise TypeError(f"expected a data URL or bytes, got {type(source).__name__}")
    if not data:
        raise ValueError("image data is empty")
    try:
        with Image.open(io.BytesIO(bytes(data))) as opened:
            if max_pixels is not None and opened.width * opened.height > max_pixels:
                raise ValueError(f"image {opened.width}x{opened.height} exceeds {max_pixels} pixels")
            opened.load()
            image = ImageOps.exif_transpose(opened)
            return to_rgb(image)
    except UnidentifiedImageError as e:
        raise ValueError("image data is not a recognised image format") from e
    except Image.DecompressionBombError as e:
        raise ValueError(f"image is too large to decode: {e}") from e
    except (OSError, SyntaxError) as e:
        # PIL reports truncated or corrupt files as OSError (SyntaxError from some plugins).
        raise ValueError(f"image data is corrupt or truncated: {e}") from e


def data_url_bytes(url: str, kind: str = "image", accepted: str = "http(s):// or file:// URLs (the engine "
                   "fetches those first: engine/media.py) or bytes") -> bytes:
    """The payload of a base64 `data:<kind>/<type>;base64,<data>` URL (kind: "image" or "video"); `accepted`:
    the other forms the caller takes, for the error on a string that is no data URL."""
    head, sep, payload = url.partition(",")
    if not head.lower().startswith("data:"):
        shown = url if len(url) <= 40 else url[:40] + "..."
        raise ValueError(f"{kind}s are taken as data:{kind}/...;base64 URLs, {accepted}, got '{shown}'")
    if not sep:
        raise ValueError("data URL has no ',' before its payload")
    media, *attrs = head[len("data:"):].split(";")
    if media and not media.lower().startswith(f"{kind}/"):
        raise ValueError(f"data URL media type '{media}' is not {'an' if kind[0] in 'aeiou' else 'a'} {kind}")
    if "base64" not in (a.strip().lower() for a in attrs):
        raise ValueError("data URL must be base64-encoded (';base64,')")
    try:
        return base64.b64decode("".join(payload.split()), validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"data URL payload is not valid base64: {e}") from e
