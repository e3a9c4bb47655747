"""`nibble quantize`: turn a BF16 (or fp32) Hugging Face Qwen3.5-MoE checkpoint into a ModelOpt NVFP4 one.

The output matches what ModelOpt's export writes: every quantized linear becomes `weight` (packed E2M1),
`weight_scale` (e4m3 per 16 inputs), `weight_scale_2` (fp32 global scale) and `input_scale`; routed experts
are always written per expert (`mlp.experts.E.{gate,up,down}_proj`), whatever the source layout. Linears
that read the same input share one global scale (gate/up of an expert; q/k/v; the GDN input projections;
the shared expert's gate/up and its gate), as ModelOpt does so that engines can fuse them into one GEMM.

There is no activation calibration: `input_scale` is written as 1.0. Weight-only (W4A16) engines, nibble
included, never read it; a W4A4 engine would need a calibrated checkpoint.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from nibble.checkpoint.safetensors_io import (
    DEFAULT_MAX_SHARD_SIZE,
    INDEX_FILE,
    CheckpointError,
    CheckpointReader,
    ShardWriter,
    parse_size,
)
from nibble.formats.nvfp4 import GROUP_SIZE, compute_weight_scale_2, quantize
from nibble.models.config import ConfigError, ModelConfig
from nibble.models.quant_config import NVFP4_GROUP_SIZE, QuantConfig

logger = logging.getLogger("nibble.quantize")

ARCHITECTURES = ("Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeForCausalLM")
MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "chat_template.jinja", "chat_template.json", "generation_config.json", "vocab.json", "merges.txt",
    "preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json",
)
EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")
# Linears fed by the same activation; ModelOpt gives the quantized ones a common weight_scale_2.
SHARED_INPUT_GROUPS = (
    ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    ("linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.in_proj_b", "linear_attn.in_proj_a"),
    ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj", "mlp.shared_expert_gate"),
)
# The MoE router is never quantized (engines hard-code it as BF16); ModelOpt still lists it.
ROUTER = "mlp.gate"
ALWAYS_COPIED_PREFIXES = ("model.visual.", "mtp.")

_EXPERT_RE = re.compile(r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


class QuantizeError(ValueError):
    """Input that `quantize_checkpoint` cannot turn into an NVFP4 checkpoint; the message says why."""


@dataclass
class _Linear:
    """One linear to write: its checkpoint module name, the source tensor it comes from, a reader for its
    weight [N, K] and K from the header (so deciding whether to quantize needs no read)."""

    module: str
    source: str
    load: Callable[[], torch.Tensor]
    in_features: int


def default_exclude_modules(config: ModelConfig, *, has_visual: bool, mtp_layers: tuple[int, ...],
                            has_mtp: bool) -> list[str]:
    """ModelOpt's exclude list for an experts-only NVFP4 export, written per layer as its exports (and the
    nvidia/Qwen3.5-*-NVFP4 checkpoints) do: everything but the routed experts stays BF16."""
    prefix = config.checkpoint_prefix
    out = []
    for i, layer_type in enumerate(config.layer_types):
        mixer = "linear_attn*" if layer_type == "linear_attention" else "self_attn*"
        out += [f"{prefix}layers.{i}.{mixer}", f"{prefix}layers.{i}.mlp.shared_expert*",
                f"{prefix}layers.{i}.mlp.shared_expert_gate"]
    return sorted(set(out + _forced_excludes(config, has_visual=has_visual, mtp_layers=mtp_layers,
                                             has_mtp=has_mtp)))


def _forced_excludes(config: ModelConfig, *, has_visual: bool, mtp_layers: tuple[int, ...],
                     has_mtp: bool) -> list[str]:
    """Entries for what is never quantized, whatever globs the user gave."""
    prefix = config.checkpoint_prefix
    out = ["lm_head", f"{prefix}embed_tokens"]
    out += [f"{prefix}layers.{i}.{ROUTER}" for i in range(config.num_hidden_layers)]
    if has_visual:
        out.append("model.visual*")
    if has_mtp:
        out += [f"mtp.layers.{i}*" for i in mtp_layers] + ["mtp*"]
    return out


def _check_source(src: Path) -> tuple[ModelConfig, dict[str, Any]]:
    if not src.is_dir():
        raise QuantizeError(f"{src}: source is not a directory")
    config_path = src / "config.json"
    if not config_path.is_file():
        raise QuantizeError(f"{src}: no config.json (is this a Hugging Face model directory?)")
    try:
        raw = json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        raise QuantizeError(f"{config_path}: invalid JSON: {e}") from e
    archs = raw.get("architectures") or []
    if not (set(archs) & set(ARCHITECTURES) or raw.get("model_type") in MODEL_TYPES):
        raise QuantizeError(f"{config_path}: not a Qwen3.5-MoE config (architectures {archs}, model_type "
                            f"'{raw.get('model_type')}'; expected one of {list(ARCHITECTURES)})")
    if raw.get("quantization_config") is not None or (src / "hf_quant_config.json").is_file():
        raise QuantizeError(f"{src}: the checkpoint is already quantized (quantization_config in config.json "
                            "or hf_quant_config.json present); quantize the BF16 original instead")
    try:
        config = ModelConfig.from_pretrained(src)
    except ConfigError as e:
        raise QuantizeError(str(e)) from e
    return config, raw


def _prepare_dst(src: Path, dst: Path, overwrite: bool) -> None:
    if dst.resolve() == src.resolve():
        raise QuantizeError(f"{dst}: destination is the source directory")
    if dst.exists() and not dst.is_dir():
        raise QuantizeError(f"{dst}: destination exists and is not a directory")
    if dst.is_dir() and any(dst.iterdir()):
        if not overwrite:
            raise QuantizeError(f"{dst}: destination exists and is not empty (pass overwrite=True / --overwrite)")
        # Stale shards from an earlier run with another shard count would otherwise survive next to the
        # new index.
        for stale in [*dst.glob("*.safetensors"), *dst.glob("*.safetensors.partial"), dst / INDEX_FILE]:
            stale.unlink(missing_ok=True)
    dst.mkdir(parents=True, exist_ok=True)


class _Quantizer:
    """Walks the source tensors in storage order, quantizes or copies each, feeds the ShardWriter."""

    def __init__(self, reader: CheckpointReader, config: ModelConfig, rules: QuantConfig,
                 writer: ShardWriter, bar: tqdm) -> None:
        self.reader = reader
        self.config = config
        self.rules = rules
        self.writer = writer
        self.bar = bar
        self.prefix = config.checkpoint_prefix
        self.layer_re = re.compile(re.escape(self.prefix) + r"layers\.(\d+)\.(.+)")
        self.done: set[str] = set()
        self.extra_excludes: list[str] = []
        self.num_quantized = 0
        self.experts_written: dict[int, set[str]] = {}

    def run(self) -> None:
        for name in self.reader.names:
            if name in self.done:
                continue
            m = self.layer_re.fullmatch(name)
            if m is None or name.startswith(ALWAYS_COPIED_PREFIXES):
                self._copy(name)
                continue
            layer, rest = int(m.group(1)), m.group(2)
            if rest in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"):
                self._fused_experts(name, layer, rest.rsplit(".", 1)[1])
            elif em := _EXPERT_RE.fullmatch(rest):
                self._per_expert(layer, int(em.group(1)), em.group(2))
            elif rest.endswith(".weight") and rest != f"{ROUTER}.weight" and len(self.reader.shape(name)) == 2:
                self._linear_group(layer, rest[: -len(".weight")])
            else:
                self._copy(name)

    def _copy(self, name: str) -> None:
        self.writer.add(name, self.reader.get(name))
        self._consumed((name,))

    def _consumed(self, names: tuple[str, ...]) -> None:
        new = [n for n in names if n not in self.done]
        self.done.update(new)
        self.bar.update(len(new))

    def _expected_expert_shape(self, proj: str) -> tuple[int, int]:
        h, i = self.config.hidden_size, self.config.moe_intermediate_size
        return (h, i) if proj == "down_proj" else (i, h)

    def _fused_experts(self, name: str, layer: int, kind: str) -> None:
        e, h, i = self.config.num_experts, self.config.hidden_size, self.config.moe_intermediate_size
        if kind == "gate_up_proj":
            expected, dims = (e, 2 * i, h), "num_experts, 2 * moe_intermediate_size, hidden_size"
        else:
            expected, dims = (e, h, i), "num_experts, hidden_size, moe_intermediate_size"
        found = self.reader.shape(name)
        if found != expected:
            raise QuantizeError(f"{self.reader.shard_of(name)}: '{name}' has shape {found}, "
                                f"expected {expected} ({dims})")
        base = f"{self.prefix}layers.{layer}.mlp.experts"
        for expert in range(e):
            t = self.reader.get_slice(name, expert)
            if kind == "gate_up_proj":
                # Gate rows come first, then up: the order of transformers' chunk(2) in the expert forward.
                members = [_Linear(f"{base}.{expert}.gate_proj", name, lambda t=t: t[:i], h),
                           _Linear(f"{base}.{expert}.up_proj", name, lambda t=t: t[i:], h)]
            else:
                members = [_Linear(f"{base}.{expert}.down_proj", name, lambda t=t: t, i)]
            self._write_group(members)
        self._consumed((name,))

    def _per_expert(self, layer: int, expert: int, proj: str) -> None:
        base = f"{self.prefix}layers.{layer}.mlp.experts.{expert}"
        if expert >= self.config.num_experts:
            raise QuantizeError(f"{self.reader.shard_of(f'{base}.{proj}.weight')}: '{base}.{proj}.weight' is "
                                f"beyond num_experts {self.config.num_experts}")
        projs = ("down_proj",) if proj == "down_proj" else ("gate_proj", "up_proj")
        members = []
        for p in projs:
            name = f"{base}.{p}.weight"
            if name not in self.reader:
                raise QuantizeError(f"{self.reader.model_dir}: '{name}' is missing (expert {expert} of layer "
                                    f"{layer} has {proj} but not {p})")
            found, expected = self.reader.shape(name), self._expected_expert_shape(p)
            if found != expected:
                raise QuantizeError(f"{self.reader.shard_of(name)}: '{name}' has shape {found}, expected "
                                    f"{expected}")
            members.append(_Linear(f"{base}.{p}", name, lambda name=name: self.reader.get(name), found[1]))
        self._write_group(members)
        self._consumed(tuple(lin.source for lin in members))

    def _linear_group(self, layer: int, module: str) -> None:
        group = next((g for g in SHARED_INPUT_GROUPS if module in g), (module,))
        base = f"{self.prefix}layers.{layer}"
        members = []
        for m in group:
            name = f"{base}.{m}.weight"
            if name in self.reader and name not in self.done and len(self.reader.shape(name)) == 2:
                shape = self.reader.shape(name)
                members.append(_Linear(f"{base}.{m}", name, lambda name=name: self.reader.get(name),
                                       shape[1]))
        self._write_group(members)
        self._consumed(tuple(lin.source for lin in members))

    def check_experts_complete(self) -> None:
        """Every layer must have all its routed experts (every Qwen3.5-MoE layer is an MoE layer); a truncated
        or mixed-up source would otherwise give a checkpoint that fails only at load time."""
        for layer in range(self.config.num_hidden_layers):
            written = self.experts_written.get(layer, set())
            for expert in range(self.config.num_experts):
                for proj in EXPERT_PROJS:
                    module = f"{self.prefix}layers.{layer}.mlp.experts.{expert}.{proj}"
                    if module not in written:
                        raise QuantizeError(f"{self.reader.model_dir}: no source tensor for '{module}' (layer "
                                            f"{layer} has {len(written)} of {3 * self.config.num_experts} "
                                            "expert projections)")

    def _write_group(self, members: list[_Linear]) -> None:
        """Quantize the group's members that are not excluded (sharing one weight_scale_2) and copy the rest
        unchanged as `<module>.weight`."""
        quantized = []
        for lin in members:
            if not self.rules.is_quantized(lin.module):
                continue
            if lin.in_features % GROUP_SIZE:
                entry = re.sub(r"(\.experts\.)\d+\.", r"\1*.", lin.module)
                if entry not in self.extra_excludes:
                    logger.warning("%s: in_features %d is not a multiple of %d; kept unquantized and "
                                   "excluded as '%s'", lin.module, lin.in_features, GROUP_SIZE, entry)
                    self.extra_excludes.append(entry)
                continue
            quantized.append(lin)
        for lin in members:
            if m := re.search(r"layers\.(\d+)\.mlp\.experts\.\d+\.", lin.module):
                self.experts_written.setdefault(int(m.group(1)), set()).add(lin.module)
        weights = {lin.module: lin.load() for lin in quantized}
        shared = compute_weight_scale_2(*weights.values()) if weights else None
        for lin in members:
            if lin.module not in weights:
                self.writer.add(f"{lin.module}.weight", lin.load())
                continue
            try:
                packed, block_scale, weight_scale_2 = quantize(weights[lin.module], shared)
            except (TypeError, ValueError) as e:
                raise QuantizeError(f"{self.reader.shard_of(lin.source)}: '{lin.source}': {e}") from e
            self.writer.add(f"{lin.module}.weight", packed)
            self.writer.add(f"{lin.module}.weight_scale", block_scale)
            self.writer.add(f"{lin.module}.weight_scale_2", weight_scale_2.clone())
            self.writer.add(f"{lin.module}.input_scale", torch.tensor(1.0, dtype=torch.float32))
            self.num_quantized += 1


def quantize_checkpoint(src_dir: str | Path, dst_dir: str | Path, exclude: list[str] | None = None,
                        max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE, progress: bool = True,
                        overwrite: bool = False) -> None:
    """Quantize the Qwen3.5-MoE checkpoint in `src_dir` (BF16/fp32, multimodal or text-only layout, experts
    fused `gate_up_proj` [E, 2I, H] / `down_proj` [E, H, I] or per expert) to ModelOpt NVFP4 in `dst_dir`.

    exclude: None for ModelOpt's experts-only scheme (the nvidia/Qwen3.5-*-NVFP4 recipe). A list of globs
    replaces it: every other linear of the language model whose module name no glob matches is quantized
    too. Never quantized, whatever the globs: lm_head, embeddings, norms, conv1d, A_log, dt_bias, the
    router (`mlp.gate`), the vision tower and the MTP head (these are always added to the exclude list),
    and any linear whose in_features is not a multiple of 16 (kept as is, added to the list, warned about).

    Writes sharded safetensors (at most `max_shard_size` per shard) plus index, hf_quant_config.json,
    config.json with `quantization_config`, and copies tokenizer/generation/processor files. input_scale is
    1.0 (no activation calibration). Reads one source tensor at a time (one expert slice of a fused tensor).
    A non-empty `dst_dir` is refused unless `overwrite`, which also removes its old shards.
    """
    src, dst = Path(src_dir), Path(dst_dir)
    config, raw_config = _check_source(src)
    if exclude is not None and (not isinstance(exclude, list | tuple)
                                or not all(isinstance(g, str) and g for g in exclude)):
        raise QuantizeError(f"exclude must be a list of non-empty glob strings, got {exclude!r}")
    max_bytes = parse_size(max_shard_size)
    try:
        reader = CheckpointReader(src)
    except CheckpointError as e:
        raise QuantizeError(str(e)) from e
    already = next((n for n in reader.names if n.endswith((".weight_scale", ".weight_scale_2"))
                    or reader.dtype(n) in (torch.uint8, torch.float8_e4m3fn)), None)
    if already is not None:
        raise QuantizeError(f"{reader.shard_of(already)}: '{already}' ({reader.dtype(already)}) looks "
                            "quantized; quantize the BF16 original instead")
    layers_prefix = f"{config.checkpoint_prefix}layers."
    if not any(n.startswith(layers_prefix) for n in reader.names):
        layout = "multimodal" if config.is_multimodal else "text-only"
        raise QuantizeError(f"{src}: no tensor is named '{layers_prefix}*' as the {layout} config.json implies "
                            f"(first tensor: '{reader.names[0] if reader.names else None}')")
    has_visual = any(n.startswith("model.visual.") for n in reader.names)
    mtp_layers = tuple(sorted({int(m.group(1)) for n in reader.names
                               if (m := re.match(r"mtp\.layers\.(\d+)\.", n))}))
    has_mtp = any(n.startswith("mtp.") for n in reader.names)
    forced = _forced_excludes(config, has_visual=has_visual, mtp_layers=mtp_layers, has_mtp=has_mtp)
    if exclude is None:
        globs = default_exclude_modules(config, has_visual=has_visual, mtp_layers=mtp_layers, has_mtp=has_mtp)
    else:
        globs = list(exclude)
    rules = QuantConfig(quant_algo="NVFP4", group_size=NVFP4_GROUP_SIZE, exclude_modules=tuple(globs))
    _prepare_dst(src, dst, overwrite)

    with ShardWriter(dst, max_bytes) as writer, \
            tqdm(total=len(reader.names), unit="tensor", desc="quantize", disable=not progress) as bar:
        job = _Quantizer(reader, config, rules, writer, bar)
        job.run()
        job.check_experts_complete()

    final = QuantConfig(quant_algo="NVFP4", group_size=NVFP4_GROUP_SIZE,
                        exclude_modules=tuple(sorted(set(globs) | set(forced) | set(job.extra_excludes))))
    (dst / "hf_quant_config.json").write_text(json.dumps(final.to_hf_quant_config(), indent=4) + "\n")
    out_config = dict(raw_config)
    out_config["quantization_config"] = final.to_quantization_config()
    (dst / "config.json").write_text(json.dumps(out_config, indent=2) + "\n")
    for file in TOKENIZER_FILES:
        if (src / file).is_file():
            shutil.copy2(src / file, dst / file)
    logger.info("quantized %d linears to NVFP4; wrote %s (%.2f GB of tensors)", job.num_quantized, dst,
                writer.total_size / 1e9)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Arguments of `nibble quantize SRC DST [--exclude GLOB ...] [--max-shard-size 5GB] [--overwrite]
    [--no-progress]`."""
    parser.add_argument("src", help="BF16 Hugging Face Qwen3.5-MoE checkpoint directory")
    parser.add_argument("dst", help="output directory for the ModelOpt NVFP4 checkpoint")
    parser.add_argument("--exclude", nargs="+", action="extend", metavar="GLOB", default=None,
                        help="module-name globs to keep in BF16; replaces the default experts-only scheme, "
                             "so every other linear is quantized")
    parser.add_argument("--max-shard-size", default="5GB", help="largest shard, e.g. 5GB, 500MB (default 5GB)")
    parser.add_argument("--overwrite", action="store_true", help="allow a non-empty destination directory")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run_cli(args: argparse.Namespace) -> int:
    """Run `nibble quantize` with parsed arguments; returns the process exit code."""
    try:
        quantize_checkpoint(args.src, args.dst, exclude=args.exclude, max_shard_size=args.max_shard_size,
                            progress=not args.no_progress, overwrite=args.overwrite)
    except (ValueError, OSError) as e:
        print(f"nibble quantize: error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {args.dst}")
    return 0
