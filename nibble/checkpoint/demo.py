"""The embedded demo checkpoint: a tiny Qwen3.5-MoE NVFP4 model with random weights, a small tokenizer and
the Qwen3.5 chat template, shipped inside the package so `nibble generate` works with no download."""

from __future__ import annotations

from pathlib import Path

DEMO_NAME = "demo"
DEMO_DIR = Path(__file__).resolve().parent.parent / "assets" / "demo_model"


def resolve_model_path(model: str) -> Path:
    """'demo' (or '') -> the embedded demo checkpoint; anything else is a directory path."""
    if model in ("", DEMO_NAME):
        return DEMO_DIR
    path = Path(model).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"model directory '{model}' does not exist (nibble loads local Hugging Face "
                                f"checkpoint directories; use 'demo' for the embedded demo model)")
    return path
