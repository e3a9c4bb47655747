"""`nibble doctor`: explain the whole stack on this machine and say whether nibble would start and serve.

It reports the environment (Python, platform, torch and its CUDA/ROCm/cuDNN, the NVIDIA driver, package
versions, fla-core), every GPU, whether Triton compiles and runs a tiny kernel on each GPU, and runs every
kernel backend's self-test on each device (on the shapes of `--model`'s config.json, else of a small built-in
config), printed as a table op x backend. With `--model` it also checks the checkpoint without loading it
(`nibble.checkpoint.validate`).

Exit code 1 when the engine would not start: an op with no passing backend, a forced backend that fails, or
a checkpoint error; warnings do not change the exit code. `--json` prints one JSON document instead.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from nibble import __version__
from nibble.doctor.environment import collect_environment, list_gpus, triton_probe
from nibble.doctor.kernels import KernelCheck, builtin_config, check_kernels

DTYPES = {"auto": None, "bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Declare the `nibble doctor` flags on `parser`."""
    parser.add_argument("--model", default=None, help="checkpoint directory (or 'demo') to check, and whose "
                                                      "config.json gives the kernel self-test shapes")
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of text")
    parser.add_argument("--device", default="auto", help="auto | cuda (every GPU) | cuda:N | cpu (default: auto)")
    parser.add_argument("--quick", action="store_true", help="self-test kernels on the small built-in shapes and "
                                                             "sample the checkpoint's block scales")
    parser.add_argument("--deep", action="store_true", help="also read every weight of the checkpoint "
                                                            "(finite values, no lost FP4 blocks)")
    parser.add_argument("--shapes-only", action="store_true", help="use --model's config.json for kernel shapes "
                                                                   "only; skip the checkpoint check")
    parser.add_argument("--dtype", default="auto", choices=tuple(DTYPES), help="activation dtype to test "
                                                                               "(default: bf16 on GPU, fp32 on CPU)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8", "fp8_e4m3"))
    parser.add_argument("--moe-backend", default=None, help="check as `nibble serve --moe-backend` would")
    parser.add_argument("--attention-backend", default=None)
    parser.add_argument("--linear-backend", default=None)
    parser.add_argument("--seed", type=int, default=0, help="seed of the self-test inputs")
    return parser


def _devices(spec: str) -> tuple[list[torch.device], list[str]]:
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if spec == "cpu" or (spec == "auto" and have == 0):
        return [torch.device("cpu")], []
    if spec in ("auto", "cuda"):
        if have == 0:
            return [], ["--device cuda: torch sees no GPU (see torch_cuda and the driver above)"]
        return [torch.device("cuda", i) for i in range(have)], []
    try:
        dev = torch.device(spec)
    except RuntimeError:
        return [], [f"--device {spec!r}: not a device (auto, cuda, cuda:N or cpu)"]
    if dev.type != "cuda" or dev.index is None or dev.index >= have:
        return [], [f"--device {spec}: no such device ({have} GPUs visible)"]
    return [dev], []


def _shape_config(args: argparse.Namespace) -> tuple[Any, str, bool]:
    """(ModelConfig, description, is_builtin) for the kernel self-tests."""
    if args.model and not args.quick:
        from nibble.checkpoint.demo import resolve_model_path
        from nibble.models.config import ModelConfig

        try:
            path = resolve_model_path(args.model)
            return ModelConfig.from_pretrained(path), f"config.json of {path}", False
        except (ValueError, OSError) as e:
            return builtin_config(), f"built-in small config ({args.model}: {e})", True
    return builtin_config(), "built-in small Qwen3.5-MoE config (hidden 256, 16 experts, NVFP4)", True


def _small(config: Any) -> bool:
    """Whether the torch references' self-tests stay quick on a CPU (the MoE one dequantizes experts)."""
    return config.hidden_size * config.moe_intermediate_size * min(config.num_experts, 64) <= 1 << 26


def run_doctor(args: argparse.Namespace) -> dict[str, Any]:
    """Everything the doctor finds, as one JSON-able document (see `render` for the text form)."""
    t0 = time.perf_counter()
    doc: dict[str, Any] = {"nibble": __version__, "env": collect_environment(), "gpus": list_gpus()}
    devices, problems = _devices(args.device)
    warnings: list[str] = []
    doc["triton"] = {str(d): triton_probe(d) for d in devices}
    for dev, probe in doc["triton"].items():
        if probe["status"] == "failed":
            warnings.append(f"triton on {dev}: {probe['detail']} (the torch fallbacks are used)")
    config, shapes, builtin = _shape_config(args)
    forced = {k: v for k, v in (("moe", args.moe_backend), ("attention", args.attention_backend),
                                ("linear", args.linear_backend)) if v and v != "auto"}
    checks: list[KernelCheck] = []
    for dev in devices:
        dtype = DTYPES[args.dtype] or (torch.bfloat16 if dev.type == "cuda" else torch.float32)
        kv = torch.float8_e4m3fn if args.kv_cache_dtype.startswith("fp8") else dtype
        checks.append(check_kernels(config, shapes, dev, dtype, kv, forced, seed=args.seed,
                                    test_references=dev.type == "cuda" or builtin or _small(config)))
    doc["kernels"] = [c.to_dict() for c in checks]
    for c in checks:
        problems += [f"kernels on {c.report.device}: {p}" for p in c.problems]
        warnings += [f"kernels on {c.report.device}: {n}" for n in c.notes]
    if devices and all(d.type == "cpu" for d in devices):
        warnings.append("no GPU checked: these results say nothing about the GPU kernels")
    doc["checkpoint"] = None
    if args.model and not args.shapes_only:
        from nibble.checkpoint.demo import resolve_model_path
        from nibble.checkpoint.validate import validate_checkpoint

        try:
            path: Path | str = resolve_model_path(args.model)
        except OSError as e:
            path = args.model
            problems.append(f"checkpoint: {e}")
        ckpt = validate_checkpoint(path, deep=args.deep, sample_scales=args.quick)
        doc["checkpoint"] = ckpt.to_dict()
        if not ckpt.ok:
            problems.append(f"checkpoint {path}: {ckpt.num('error')} errors (see the findings)")
        if ckpt.num("warning"):
            warnings.append(f"checkpoint {path}: {ckpt.num('warning')} warnings")
    doc["verdict"] = {"ok": not problems, "problems": problems, "warnings": warnings,
                      "seconds": round(time.perf_counter() - t0, 2)}
    return doc


def _gib(x: float | None) -> str:
    return "?" if x is None else f"{x:.1f}"


def render(doc: dict[str, Any]) -> str:
    """The document as text for a terminal."""
    env = doc["env"]
    pk = env["packages"]
    fla = env["fla"]
    out = [f"nibble doctor {doc['nibble']}", "environment"]
    out.append(f"  python      {env['python']} ({env['executable']})")
    out.append(f"  platform    {env['platform']}, {env['cpu_count']} CPUs")
    stack = ", ".join(f"{k} {env[v] or '-'}" for k, v in (("CUDA", "torch_cuda"), ("ROCm", "torch_hip"),
                                                           ("cuDNN", "cudnn")))
    out.append(f"  torch       {env['torch']} ({stack}; GPU available: {env['cuda_available']})")
    smi = env["nvidia_smi"]
    smi_note = "nvidia-smi not found" if smi is None else smi.get("error", "from nvidia-smi")
    out.append(f"  driver      {env['driver'] or '-'} ({smi_note})")
    out.append(f"  triton      {pk['triton'] or 'not installed'}"
               f"{' (TRITON_INTERPRET=1)' if env['triton_interpret'] else ''}")
    out.append(f"  fla-core    {fla['version'] or 'not installed'}; gated_delta_rule importable: "
               f"{fla['importable']}{' (' + fla['detail'] + ')' if fla['detail'] else ''}")
    if fla.get("configs"):
        out.append(f"              {fla['configs']}")
    out.append("  packages    " + ", ".join(f"{p} {pk[p] or '-'}" for p in ("transformers", "safetensors",
                                                                             "tokenizers", "fastapi", "uvicorn",
                                                                             "llguidance")))
    out.append("gpus")
    for g in doc["gpus"] or []:
        tables = [f"tuning/{t}.json" for t in reversed(g.get("tuning_tables") or [])]
        table = " over ".join(tables) if tables else "tuning/default.json only"
        out.append(f"  [{g['index']}] {g['name']}: sm_{g['capability'].replace('.', '')}, {g['sm_count']} SMs, "
                   f"{_gib(g['memory_free_gib'])} of {_gib(g['memory_total_gib'])} GiB free, {table}"
                   f"{'  ERROR ' + g['error'] if 'error' in g else ''}")
    if not doc["gpus"]:
        out.append("  none visible to torch")
    out.append("triton smoke test (16x16 dot + exp)")
    for dev, p in doc["triton"].items():
        times = f" compile {p['compile_s']:.2f} s" if "compile_s" in p else ""
        times += f", run {p['run_s'] * 1e3:.2f} ms" if "run_s" in p else ""
        out.append(f"  {dev}: {p['status']}{times}" + (f" - {p['detail']}" if p.get("detail") else ""))
    for k in doc["kernels"]:
        out.append(f"kernel self-tests, shapes: {k['shapes']}")
        out.append(_kernel_table(k))
    if doc["checkpoint"] is not None:
        from nibble.checkpoint.validate import render_report

        out.append(render_report(doc["checkpoint"]))
    v = doc["verdict"]
    out.append(f"verdict: {'OK' if v['ok'] else 'FAILED'} ({v['seconds']:.1f} s)")
    out += [f"  problem: {p}" for p in v["problems"]] + [f"  warning: {w}" for w in v["warnings"]]
    return "\n".join(out)


def _kernel_table(k: dict[str, Any]) -> str:
    rows = [("op", "backend", "status", "error", "time", "first call", "detail")]
    for r in k["results"]:
        mark = "*" if k["selected"].get(r["op"]) == r["backend"] else " "
        ran = r["status"] in ("ok", "failed") and (r["seconds"] or r["first_call_seconds"])
        rows.append((r["op"], mark + r["backend"], r["status"],
                     "" if r["rel_error"] is None else f"{r['rel_error']:.1e}",
                     f"{r['seconds'] * 1e3:.1f} ms" if ran else "", f"{r['first_call_seconds']:.2f} s" if ran else "",
                     r["detail"]))
    widths = [max(len(row[i]) for row in rows) for i in range(6)]
    head = (f"  on {k['device']} ({k['dtype']}, KV cache {k['kv_cache_dtype']}); * = what the engine would "
            f"select; {k['total_seconds']:.1f} s")
    return "\n".join([head] + ["  " + "  ".join(c.ljust(w) for c, w in zip(row[:6], widths)) + "  " + row[6]
                               for row in rows])


def run_cli(args: argparse.Namespace) -> int:
    """Run the doctor with parsed flags; prints the report, returns 0 (OK) or 1 (would not start)."""
    doc = run_doctor(args)
    if args.json:
        json.dump(doc, sys.stdout, indent=1, default=str)
        sys.stdout.write("\n")
    else:
        print(render(doc))
    return 0 if doc["verdict"]["ok"] else 1
