"""What `nibble doctor` reports about the machine: Python, platform, torch and its GPU stack, the NVIDIA
driver, every GPU, the versions of the packages nibble uses, and whether Triton compiles and runs a tiny
kernel correctly on each GPU."""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import platform
import shutil
import subprocess
import sys
import time
import warnings
from typing import Any

import torch

from nibble.kernels._triton import HAVE_TRITON, interpreting, tl, triton
from nibble.kernels.fla_tables import use_fla_tables
from nibble.kernels.tuning_tables import device_tables

PACKAGES = ("torch", "triton", "fla-core", "transformers", "safetensors", "tokenizers", "fastapi", "uvicorn",
            "numpy", "llguidance")
NVIDIA_SMI_TIMEOUT_S = 15


def package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _fla_status() -> dict[str, Any]:
    """fla-core's version and whether its gated delta rule ops import (they need a working Triton driver)."""
    out: dict[str, Any] = {"version": package_version("fla-core"), "importable": False, "detail": "",
                           "configs": ""}
    if out["version"] is None:
        out["detail"] = "not installed (GDN uses nibble's own Triton kernel or the torch reference)"
        return out
    if torch.cuda.is_available():
        # before fla's first import, which fixes its config mode (fla_tables.py)
        out["configs"] = use_fla_tables(torch.device("cuda", 0))
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            importlib.import_module("fla.ops.gated_delta_rule")
        out["importable"] = True
        notes = [str(w.message) for w in caught if "Triton is not supported" in str(w.message)]
        out["detail"] = notes[0][:160] if notes else ""
    except Exception as e:  # fla raises more than ImportError when no Triton driver is active
        out["detail"] = f"{type(e).__name__}: {e}"[:200]
    return out


def _nvidia_smi() -> dict[str, Any] | None:
    """Driver version and per-GPU rows from nvidia-smi, or None when it is absent or fails."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    query = "driver_version,name,memory.total,memory.used,temperature.gpu,power.draw"
    try:
        res = subprocess.run([exe, f"--query-gpu={query}", "--format=csv,noheader,nounits"], capture_output=True,
                             text=True, timeout=NVIDIA_SMI_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"error": f"nvidia-smi failed: {e}"}
    if res.returncode != 0:
        return {"error": f"nvidia-smi exited {res.returncode}: {res.stderr.strip()[:200]}"}
    rows = [[c.strip() for c in line.split(",")] for line in res.stdout.strip().splitlines() if line.strip()]
    keys = query.split(",")
    return {"driver_version": rows[0][0] if rows else None, "gpus": [dict(zip(keys, r)) for r in rows]}


def collect_environment() -> dict[str, Any]:
    """Versions and the GPU stack as torch sees it."""
    cuda_ok = torch.cuda.is_available()
    env: dict[str, Any] = {
        "python": sys.version.split()[0],
        "executable": sys.executable,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "torch_hip": getattr(torch.version, "hip", None),
        "cudnn": torch.backends.cudnn.version() if cuda_ok and torch.backends.cudnn.is_available() else None,
        "cuda_available": cuda_ok,
        "packages": {p: package_version(p) for p in PACKAGES},
        "fla": _fla_status(),
        "triton_interpret": interpreting(),
    }
    smi = _nvidia_smi()
    env["nvidia_smi"] = smi
    driver = smi.get("driver_version") if smi else None
    if driver is None and cuda_ok:
        get = getattr(torch._C, "_cuda_getDriverVersion", None)
        version = get() if get is not None else None
        driver = f"supports CUDA {version // 1000}.{version % 1000 // 10} (from torch)" if version else None
    env["driver"] = driver
    return env


def list_gpus() -> list[dict[str, Any]]:
    """Every visible GPU: name, compute capability, memory total/free, SM count, and the tuning tables its
    kernels take over default.json (the device's own last; empty: default.json alone)."""
    gpus = []
    for i in range(torch.cuda.device_count() if torch.cuda.is_available() else 0):
        p = torch.cuda.get_device_properties(i)
        gpu: dict[str, Any] = {"index": i, "name": p.name, "capability": f"{p.major}.{p.minor}",
                               "memory_total_gib": round(p.total_memory / 2**30, 2), "memory_free_gib": None,
                               "sm_count": p.multi_processor_count,
                               "tuning_tables": list(device_tables(torch.device("cuda", i)))}
        try:
            gpu["memory_free_gib"] = round(torch.cuda.mem_get_info(i)[0] / 2**30, 2)
        except RuntimeError as e:  # a GPU in a bad state still gets listed
            gpu["error"] = str(e)[:200]
        gpus.append(gpu)
    return gpus


@triton.jit
def _probe_kernel(a_ptr, b_ptr, c_ptr, out_ptr, N: tl.constexpr):
    """out = a @ b + exp(c) for one N x N tile: a dot (tensor-core path) and an elementwise op."""
    r = tl.arange(0, N)
    offs = r[:, None] * N + r[None, :]
    a = tl.load(a_ptr + offs)
    b = tl.load(b_ptr + offs)
    c = tl.load(c_ptr + offs)
    tl.store(out_ptr + offs, tl.dot(a, b, input_precision="ieee") + tl.exp(c))


def triton_probe(device: torch.device) -> dict[str, Any]:
    """Compile and run `_probe_kernel` on `device`; status ok | failed | unsupported, with times."""
    if not HAVE_TRITON:
        return {"status": "unsupported", "detail": "triton is not installed"}
    if device.type == "cpu" and not interpreting():
        return {"status": "unsupported", "detail": "no GPU: Triton kernels would only run under TRITON_INTERPRET=1 "
                                                   "(the interpreter; right for fp32 only)"}
    if device.type == "cuda" and interpreting():
        return {"status": "unsupported", "detail": "TRITON_INTERPRET is set: kernels would run on the host"}
    n = 16
    gen = torch.Generator(device="cpu").manual_seed(0)
    a, b, c = (torch.randn(n, n, generator=gen).to(device) for _ in range(3))
    out = torch.full((n, n), float("nan"), device=device)
    try:
        t0 = time.perf_counter()
        _probe_kernel[(1,)](a, b, c, out, N=n)
        _sync(device)
        t1 = time.perf_counter()
        _probe_kernel[(1,)](a, b, c, out, N=n)
        _sync(device)
        t2 = time.perf_counter()
    except Exception as e:  # compilation or launch failure: the whole message matters here
        return {"status": "failed", "detail": f"{type(e).__name__}: {e}".splitlines()[0][:300]}
    ref = a.double() @ b.double() + c.double().exp()
    err = float((out.double() - ref).abs().max() / ref.abs().max())
    if not err < 1e-4:
        return {"status": "failed", "detail": f"wrong result (max rel error {err:.2e})",
                "compile_s": round(t1 - t0, 3)}
    mode = "interpreter" if device.type == "cpu" else "compiled"
    return {"status": "ok", "detail": f"{mode}, max rel error {err:.1e}", "compile_s": round(t1 - t0, 3),
            "run_s": round(t2 - t1, 5)}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
