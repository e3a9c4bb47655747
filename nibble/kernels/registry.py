"""Backend registry: for each op an ordered list of implementations, a capability check for each, and
the start-up selection that self-tests every chosen backend on the model's real shapes.

`select_kernels` walks each op's backends in order: an unsupported one is recorded with its reason, a
supported one runs its self-test (selftest.py) and is taken if it passes; a failure is logged in one line
on `nibble.kernels` and the next backend is tried. `torch` (the reference) is always last and always
passes (it is only checked for finite output). Backends forced by the user (per op or per group: moe,
attention, linear) must pass, else `KernelSelectionError`.
"""

from __future__ import annotations

import importlib
import json
import logging
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from nibble.kernels._triton import HAVE_TRITON, capability, interpreting
from nibble.kernels.fla_tables import use_fla_tables
from nibble.kernels.kernel_set import OP_NAMES, KernelSet
from nibble.kernels.selftest import SELF_TESTS, SelfTestContext, SelfTestFailure
from nibble.models.config import ModelConfig

log = logging.getLogger("nibble.kernels")

OP_GROUPS: dict[str, tuple[str, ...]] = {
    "moe": ("route", "fused_moe"),
    "attention": ("store_kv", "paged_attention"),
    "linear": ("nvfp4_linear", "dense_linear"),
}


class KernelSelectionError(RuntimeError):
    """A forced backend is unknown, unsupported here, or failed its self-test."""


@dataclass(frozen=True)
class Platform:
    """What capability checks look at."""

    device: torch.device
    dtype: torch.dtype
    kv_cache_dtype: torch.dtype
    allow_interpreter: bool


@dataclass(frozen=True)
class Backend:
    """One implementation of an op: `target` is 'module:function' (imported only when the backend is
    tried) or the callable itself; `check` returns None when usable on a platform, else why not."""

    name: str
    target: str | Callable[..., Any]
    check: Callable[[Platform], str | None]

    def load(self) -> Callable[..., Any]:
        if callable(self.target):
            return self.target
        module, fn = self.target.split(":")
        return getattr(importlib.import_module(module), fn)


def triton_check(p: Platform) -> str | None:
    if not HAVE_TRITON:
        return "triton is not installed"
    if p.device.type == "cuda":
        if interpreting():
            return "TRITON_INTERPRET is set: kernels would run on the host"
        cc = capability(p.device)
        if cc is None or cc < (8, 0):
            return f"compute capability {cc} < 8.0"
        if p.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            return f"dtype {p.dtype} not supported"
        return None
    if p.device.type == "cpu":
        if not p.allow_interpreter:
            return "no GPU (the Triton interpreter is only used when explicitly allowed)"
        if not interpreting():
            return "TRITON_INTERPRET=1 must be set before triton is imported"
        if p.dtype != torch.float32:
            return f"the Triton interpreter computes {p.dtype} wrongly (fp32 only)"
        return None
    return f"device type {p.device.type} not supported"


def fla_check(p: Platform) -> str | None:
    reason = triton_check(p)
    if reason:
        return reason
    if p.device.type != "cuda":
        return "fla-core kernels need a CUDA device"
    log.info("gated_delta_rule: %s", use_fla_tables(p.device))
    try:
        importlib.import_module("fla.ops.gated_delta_rule")
    except Exception as e:  # fla raises more than ImportError when its drivers are missing
        return f"fla-core not importable ({type(e).__name__}: {e})"
    return None


def always(_p: Platform) -> str | None:
    return None


def default_backends() -> dict[str, tuple[Backend, ...]]:
    """Ordered candidates per op (a fresh dict; tests may add or replace entries)."""
    k = "nibble.kernels."

    def pair(target: str, ref: str) -> tuple[Backend, ...]:
        return (Backend("triton", k + target, triton_check), Backend("torch", k + ref, always))

    return {
        "rms_norm": pair("norm:rms_norm", "norm:rms_norm_ref"),
        "rms_norm_moe": pair("norm:rms_norm_moe", "norm:rms_norm_moe_ref"),
        "qk_rms_norm": pair("norm:qk_rms_norm", "norm:qk_rms_norm_ref"),
        "gated_rms_norm": pair("norm:gated_rms_norm", "norm:gated_rms_norm_ref"),
        "rope": pair("rope:rope", "rope:rope_ref"),
        "store_kv": pair("attention:store_kv", "attention:store_kv_ref"),
        "paged_attention": pair("paged_attention:paged_attention",
                                "attention:paged_attention_ref"),
        "sigmoid_mul": pair("activation:sigmoid_mul", "activation:sigmoid_mul_ref"),
        "causal_conv1d": pair("conv1d:causal_conv1d", "conv1d:causal_conv1d_ref"),
        "causal_conv1d_spec": pair("conv1d:causal_conv1d_spec", "conv1d:causal_conv1d_spec_ref"),
        "gdn_gating": pair("gdn_gating:gdn_gating", "gdn_gating:gdn_gating_ref"),
        "gated_delta_rule": (
            Backend("fla", k + "gated_delta:gated_delta_rule_fla", fla_check),
            Backend("triton", k + "gated_delta:gated_delta_rule_recurrent", triton_check),
            Backend("torch", k + "gated_delta:gated_delta_rule_ref", always),
        ),
        "gated_delta_rule_decode": pair("gated_delta:gated_delta_rule_decode",
                                        "gated_delta:gated_delta_rule_decode_ref"),
        "gated_delta_rule_spec": pair("gated_delta:gated_delta_rule_spec", "gated_delta:gated_delta_rule_spec_ref"),
        "route": pair("moe_route:route", "moe:route_ref"),
        "fused_moe": (
            Backend("triton", k + "fused_moe:fused_moe", triton_check),
            Backend("triton-generic", k + "fused_moe:fused_moe_generic", triton_check),
            Backend("torch", k + "moe:fused_moe_ref", always),
        ),
        "silu_and_mul": pair("activation:silu_and_mul", "activation:silu_and_mul_ref"),
        "moe_combine": pair("activation:moe_combine", "activation:moe_combine_ref"),
        "nvfp4_linear": (
            Backend("triton", k + "nvfp4_linear:nvfp4_linear", triton_check),
            Backend("triton-generic", k + "nvfp4_linear:nvfp4_linear_generic", triton_check),
            Backend("torch", k + "nvfp4_linear:nvfp4_linear_ref", always),
        ),
        "dense_linear": pair("dense_gemv:dense_linear", "dense_gemv:dense_linear_ref"),
    }


@dataclass
class OpResult:
    op: str
    backend: str
    status: str  # ok | failed | unsupported | skipped
    detail: str = ""
    seconds: float = 0.0
    first_call_seconds: float = 0.0
    rel_error: float | None = None


@dataclass
class SelectionReport:
    device: str
    dtype: str
    kv_cache_dtype: str
    results: list[OpResult] = field(default_factory=list)
    selected: dict[str, str] = field(default_factory=dict)
    total_seconds: float = 0.0

    def table(self) -> str:
        """Plain-text table: op, backend, status, times, detail."""
        rows = [("op", "backend", "status", "test s", "1st call s", "rel err", "detail")]
        for r in self.results:
            err = "" if r.rel_error is None else f"{r.rel_error:.2e}"
            timed = r.rel_error is not None
            t = f"{r.seconds:.3f}" if timed else ""
            t1 = f"{r.first_call_seconds:.2f}" if timed else ""
            mark = "*" if self.selected.get(r.op) == r.backend and r.status != "unsupported" else " "
            rows.append((r.op, mark + r.backend, r.status, t, t1, err, r.detail))
        widths = [max(len(row[i]) for row in rows) for i in range(6)]
        lines = [f"kernels on {self.device} ({self.dtype}, KV cache {self.kv_cache_dtype}); * = selected, "
                 f"self-tests took {self.total_seconds:.1f} s"]
        for row in rows:
            lines.append("  ".join(c.ljust(w) for c, w in zip(row[:6], widths)) + "  " + row[6])
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)


def _expand_forced(forced: Mapping[str, str] | None, table: Mapping[str, tuple[Backend, ...]]) -> dict[str, str]:
    """op -> forced backend. A group forces the ops of the group that have a backend of that name (e.g.
    `triton-generic` exists for fused_moe but not for route), and is an error if none has."""
    out: dict[str, str] = {}
    for key, backend in (forced or {}).items():
        if key in OP_GROUPS:
            ops = [op for op in OP_GROUPS[key] if any(b.name == backend for b in table.get(op, ()))]
            if not ops:
                have = sorted({b.name for op in OP_GROUPS[key] for b in table.get(op, ())})
                raise KernelSelectionError(f"{key}: no backend {backend!r} (have {', '.join(have)})")
            for op in ops:
                out[op] = backend
        elif key in OP_NAMES:
            out[key] = backend
        else:
            raise KernelSelectionError(f"unknown op or op group {key!r} (ops: {', '.join(OP_NAMES)}; groups: "
                                       f"{', '.join(OP_GROUPS)})")
    return out


def _run_test(op: str, fn: Callable[..., Any], ctx: SelfTestContext) -> tuple[float, float, float]:
    """(rel error, seconds of a second run, seconds of the first run incl. compilation)."""
    test = SELF_TESTS[op]
    t0 = time.perf_counter()
    err = test(fn, ctx)
    t1 = time.perf_counter()
    test(fn, ctx)
    t2 = time.perf_counter()
    return err, t2 - t1, t1 - t0


def select_kernels(model_config: ModelConfig, device: torch.device | str, dtype: torch.dtype,
                   kv_cache_dtype: torch.dtype | None = None, forced: Mapping[str, str] | None = None,
                   self_test: bool = True, *, block_size: int = 16, allow_interpreter: bool = False,
                   backends: Mapping[str, tuple[Backend, ...]] | None = None, seed: int | None = None,
                   tp_size: int = 1, expert_parallel: bool = False) -> tuple[KernelSet, SelectionReport]:
    """Pick one backend per op for this model, device and dtypes; see the module docstring.

    forced: op or group name -> backend name. block_size: the KV cache page size to test with.
    tp_size, expert_parallel: the linear and MoE self-tests run one tensor-parallel rank's shapes.
    allow_interpreter: let Triton backends run under TRITON_INTERPRET on the CPU (tests).
    backends: replaces `default_backends()` (tests). seed: for reproducible self-test inputs (default:
    fresh random inputs every start).
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    kv_cache_dtype = kv_cache_dtype or dtype
    platform = Platform(device, dtype, kv_cache_dtype, allow_interpreter)
    table = dict(backends) if backends is not None else default_backends()
    force = _expand_forced(forced, table)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed if seed is not None else int(time.time_ns() % (1 << 62)))
    ctx = SelfTestContext(model_config, device, dtype, kv_cache_dtype, block_size, gen, tp_size, expert_parallel)
    report = SelectionReport(str(device), str(dtype).removeprefix("torch."),
                             str(kv_cache_dtype).removeprefix("torch."))
    chosen: dict[str, Callable[..., Any]] = {}
    start = time.perf_counter()
    for op in OP_NAMES:
        candidates = table.get(op, ())
        if op in force:
            names = [b.name for b in candidates]
            if force[op] not in names:
                raise KernelSelectionError(f"{op}: no backend {force[op]!r} (have {', '.join(names)})")
            candidates = tuple(b for b in candidates if b.name == force[op])
        for backend in candidates:
            if op in chosen:
                report.results.append(OpResult(op, backend.name, "skipped"))
                continue
            reason = backend.check(platform)
            if reason:
                report.results.append(OpResult(op, backend.name, "unsupported", reason))
                if op in force:
                    raise KernelSelectionError(f"{op}: forced backend {backend.name!r} unsupported: {reason}")
                continue
            try:
                fn = backend.load()
                if backend.name == "torch" and device.type != "cuda":
                    # the reference itself, at real shapes, would take long on a CPU and prove nothing
                    result = OpResult(op, backend.name, "ok", "reference (not self-tested off GPU)")
                elif self_test:
                    err, secs, first = _run_test(op, fn, ctx)
                    result = OpResult(op, backend.name, "ok", "", secs, first, err)
                else:
                    result = OpResult(op, backend.name, "ok", "not self-tested")
            except Exception as e:
                detail = f"{type(e).__name__}: {e}".splitlines()[0][:300]
                if not isinstance(e, SelfTestFailure):
                    log.debug("self-test of %s/%s raised:\n%s", op, backend.name, traceback.format_exc())
                report.results.append(OpResult(op, backend.name, "failed", detail))
                log.warning("kernel self-test failed: op=%s backend=%s: %s", op, backend.name, detail)
                if op in force:
                    raise KernelSelectionError(f"{op}: forced backend {backend.name!r} failed its self-test: "
                                               f"{detail}") from e
                continue
            report.results.append(result)
            chosen[op] = fn
            report.selected[op] = backend.name
        if op not in chosen:
            raise KernelSelectionError(f"{op}: no usable backend ({', '.join(b.name for b in candidates)})")
    report.total_seconds = time.perf_counter() - start
    kernels = KernelSet(**chosen, backend_names=dict(report.selected))
    return kernels, report
