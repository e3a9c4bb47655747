"""Every kernel backend's self-test on one device, as a table op x backend -> ok / failed / unsupported.

Unlike the engine's start-up selection (`nibble.kernels.registry.select_kernels`), which stops at the first
backend of an op that passes, the doctor tries them all, then marks the one the engine would pick: the first
passing backend in registry order, or the forced one. The verdict lists what would stop the engine from
starting: an op with no passing backend, or a forced backend that is unknown, unsupported or failing.
"""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from nibble.kernels.kernel_set import OP_NAMES
from nibble.kernels.registry import OP_GROUPS, Backend, OpResult, Platform, SelectionReport, default_backends
from nibble.kernels.selftest import SELF_TESTS, SelfTestContext, SelfTestFailure
from nibble.models.config import ModelConfig
from nibble.models.quant_config import QuantConfig

log = logging.getLogger("nibble.doctor")

# A small Qwen3.5-MoE-like text model (NVFP4 routed experts, everything else BF16) for self-tests when no
# --model is given or with --quick: real code paths (GQA, partial RoPE, GDN head groups, top-k routing) at
# sizes that run in seconds, even on a CPU.
BUILTIN_CONFIG = {
    "architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text", "vocab_size": 2048,
    "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
    "head_dim": 64, "linear_num_key_heads": 4, "linear_num_value_heads": 8, "linear_key_head_dim": 32,
    "linear_value_head_dim": 32, "linear_conv_kernel_dim": 4, "num_experts": 16, "num_experts_per_tok": 4,
    "moe_intermediate_size": 128, "shared_expert_intermediate_size": 128, "max_position_embeddings": 8192,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    "rms_norm_eps": 1e-6, "dtype": "bfloat16",
}
BUILTIN_EXCLUDES = ("lm_head", "model.embed_tokens", "model.layers.*.linear_attn*", "model.layers.*.self_attn*",
                    "model.layers.*.mlp.gate", "model.layers.*.mlp.shared_expert*")


def builtin_config() -> ModelConfig:
    quant = QuantConfig(quant_algo="NVFP4", group_size=16, exclude_modules=BUILTIN_EXCLUDES)
    return ModelConfig.from_dict(dict(BUILTIN_CONFIG), source="built-in doctor config", quant=quant)


@dataclass
class KernelCheck:
    """The table for one device plus what it means for the engine."""

    report: SelectionReport
    shapes: str
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, object]:
        return {"shapes": self.shapes, "ok": self.ok, "problems": self.problems, "notes": self.notes,
                **self.report.to_dict()}


def expand_forced(forced: Mapping[str, str] | None) -> tuple[dict[str, str], list[str]]:
    """(op -> backend, problems): group names (moe, attention, linear) expand to their ops."""
    out: dict[str, str] = {}
    problems = []
    for key, backend in (forced or {}).items():
        ops = OP_GROUPS.get(key, (key,) if key in OP_NAMES else ())
        if not ops:
            problems.append(f"forced backend for unknown op or group {key!r}")
        for op in ops:
            out[op] = backend
    return out, problems


# CUDA errors that poison the context: every later launch in the process fails the same way.
STICKY_CUDA_ERRORS = ("illegal memory access", "unspecified launch failure", "device-side assert",
                      "misaligned address", "illegal instruction")


def check_kernels(config: ModelConfig, shapes: str, device: torch.device, dtype: torch.dtype,
                  kv_cache_dtype: torch.dtype, forced: Mapping[str, str] | None = None, *, block_size: int = 16,
                  test_references: bool = True, seed: int = 0) -> KernelCheck:
    """Run each backend of each op on `device`; see the module docstring.

    test_references: run the torch backends' self-tests too (off a GPU at full model shapes they take
    minutes and only prove the reference runs, so the engine skips them there).
    """
    interp = device.type == "cpu" and dtype == torch.float32
    platform = Platform(device, dtype, kv_cache_dtype, allow_interpreter=interp)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    ctx = SelfTestContext(config, device, dtype, kv_cache_dtype, block_size, gen)
    report = SelectionReport(str(device), str(dtype).removeprefix("torch."), str(kv_cache_dtype).removeprefix("torch."))
    force, problems = expand_forced(forced)
    check = KernelCheck(report, shapes, problems)
    table = default_backends()
    broken: str | None = None
    start = time.perf_counter()
    for op in OP_NAMES:
        candidates = table.get(op, ())
        if op in force and force[op] not in [b.name for b in candidates]:
            check.problems.append(f"{op}: forced backend {force[op]!r} does not exist "
                                  f"(have {', '.join(b.name for b in candidates)})")
        for backend in candidates:
            reason = backend.check(platform)
            if reason:
                report.results.append(OpResult(op, backend.name, "unsupported", reason))
                continue
            if broken is not None:
                report.results.append(OpResult(op, backend.name, "skipped", f"not run: {broken}"))
                continue
            if backend.name == "torch" and not test_references:
                report.results.append(OpResult(op, backend.name, "ok", "reference (not self-tested off GPU at "
                                                                       "these shapes)"))
                continue
            report.results.append(_run_one(op, backend, ctx))
            last = report.results[-1]
            if last.status == "failed" and device.type == "cuda" and any(m in last.detail for m in STICKY_CUDA_ERRORS):
                broken = f"the CUDA context broke during {op}/{backend.name}"
        passing = [r.backend for r in report.results if r.op == op and r.status == "ok"]
        chosen = force.get(op) if op in force else (passing[0] if passing else None)
        if chosen is not None and chosen in passing:
            report.selected[op] = chosen
        elif op in force:
            status = next((r for r in report.results if r.op == op and r.backend == force[op]), None)
            if status is not None:
                check.problems.append(f"{op}: forced backend {force[op]!r} is {status.status}: {status.detail}")
        else:
            check.problems.append(f"{op}: no backend passes its self-test")
    report.total_seconds = time.perf_counter() - start
    if broken:
        check.notes.append(f"{broken}; later self-tests on this device were not run")
    return check


def _run_one(op: str, backend: Backend, ctx: SelfTestContext) -> OpResult:
    name = backend.name
    try:
        fn = backend.load()
        t0 = time.perf_counter()
        err = SELF_TESTS[op](fn, ctx)
        t1 = time.perf_counter()
        SELF_TESTS[op](fn, ctx)
        t2 = time.perf_counter()
    except Exception as e:  # every failure is a row of the table, never a crash of the doctor
        detail = f"{type(e).__name__}: {e}".splitlines()[0][:300]
        if not isinstance(e, SelfTestFailure):
            log.debug("self-test of %s/%s raised:\n%s", op, name, traceback.format_exc())
        return OpResult(op, name, "failed", detail)
    detail = "reference: runs, finite output" if name == "torch" else ""
    return OpResult(op, name, "ok", detail, t2 - t1, t1 - t0, err)
