"""Build the embedded demo checkpoint (nibble/assets/demo_model): a tiny random Qwen3.5-MoE in the
published multimodal layout, made with transformers and quantized with `nibble quantize`, plus the demo
tokenizer and the Qwen3.5 chat template. Deterministic; run from the repository root:

    python scripts/build_demo_model.py
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from nibble.checkpoint.quantize import quantize_checkpoint  # noqa: E402
from tests.helpers.tiny_models import make_tiny_qwen35_moe  # noqa: E402

DEMO_DIR = ROOT / "nibble" / "assets" / "demo_model"
TOKENIZER_DIR = ROOT / "nibble" / "assets" / "demo_tokenizer"
DEMO_CONFIG = dict(
    hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
    num_experts=16, num_experts_per_tok=4, moe_intermediate_size=64, shared_expert_intermediate_size=128,
    vocab_size=1024, seed=20261202, multimodal=True, dtype=torch.bfloat16,
    config_overrides={"eos_token_id": 993, "pad_token_id": 991, "max_position_embeddings": 32768},
)


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        src = make_tiny_qwen35_moe(Path(tmp) / "bf16", tokenizer_dir=TOKENIZER_DIR, **DEMO_CONFIG)
        if DEMO_DIR.exists():
            shutil.rmtree(DEMO_DIR)
        quantize_checkpoint(src, DEMO_DIR, progress=False)
    readme = ("# nibble demo model\n\nA tiny Qwen3.5-MoE (4 layers, 16 experts, NVFP4 routed experts) with RANDOM "
              "weights: its output is gibberish. It exists so that nibble runs end to end with no download. "
              "Rebuild with `python scripts/build_demo_model.py`.\n")
    (DEMO_DIR / "README.md").write_text(readme)
    size = sum(f.stat().st_size for f in DEMO_DIR.iterdir())
    print(f"wrote {DEMO_DIR} ({size / 1e6:.2f} MB): {sorted(p.name for p in DEMO_DIR.iterdir())}")
    print(json.loads((DEMO_DIR / "config.json").read_text())["architectures"])


if __name__ == "__main__":
    main()
