"""`nibble doctor`: environment and GPU report, Triton smoke test, the op x backend self-test table with
what the engine would select, the checkpoint check, the verdict and its exit code, text and JSON output.

The test session sets TRITON_INTERPRET=1 (tests/conftest.py); most tests hide it from the registry so
that the Triton backends are reported unsupported instead of crawling through the interpreter at doctor
shapes, while the torch references are self-tested for real."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import nibble.doctor.kernels as doctor_kernels
import nibble.kernels.registry as registry
from nibble.doctor import add_cli_args, render, run_cli, run_doctor
from nibble.doctor.environment import triton_probe
from nibble.kernels._triton import interpreting
from nibble.kernels.kernel_set import OP_NAMES
from nibble.kernels.registry import Backend, always, default_backends
from tests.reliability.checkpoints import damaged

REPO = Path(__file__).resolve().parents[1]


def args(*argv: str) -> argparse.Namespace:
    return add_cli_args(argparse.ArgumentParser()).parse_args(["--device", "cpu", *argv])


@pytest.fixture(autouse=True)
def no_interpreter(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if "interpreter" not in request.node.name:
        monkeypatch.setattr(registry, "interpreting", lambda: False)


def test_builtin_run_on_cpu() -> None:
    doc = run_doctor(args())
    env = doc["env"]
    assert env["python"] == sys.version.split()[0] and env["torch"] == torch.__version__
    assert set(env["packages"]) >= {"torch", "triton", "fla-core", "transformers", "safetensors", "tokenizers"}
    assert doc["gpus"] == [] or torch.cuda.is_available()
    (kernels,) = doc["kernels"]
    assert kernels["device"] == "cpu" and kernels["dtype"] == "float32" and "built-in" in kernels["shapes"]
    assert set(kernels["selected"]) == set(OP_NAMES) and set(kernels["selected"].values()) == {"torch"}
    for r in kernels["results"]:
        if r["backend"] == "torch":
            assert r["status"] == "ok" and r["rel_error"] == 0.0, r
        else:
            assert r["status"] == "unsupported" and r["detail"], r
    assert doc["checkpoint"] is None
    assert doc["verdict"]["ok"] and not doc["verdict"]["problems"]
    assert any("no GPU" in w for w in doc["verdict"]["warnings"])
    text = render(doc)
    for line in ("nibble doctor", "environment", "gpus", "triton smoke test", "kernel self-tests", "verdict: OK"):
        assert line in text
    assert "*torch" in text and "fused_moe" in text


def test_triton_probe_under_interpreter() -> None:
    if not interpreting():
        pytest.skip("TRITON_INTERPRET is not set")
    probe = triton_probe(torch.device("cpu"))
    assert probe["status"] == "ok" and "interpreter" in probe["detail"] and probe["compile_s"] >= 0


def test_model_checkpoint_section_and_real_shapes(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(args("--model", "demo", "--json")) == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc) == {"nibble", "env", "gpus", "triton", "kernels", "checkpoint", "verdict"}
    assert "demo_model" in doc["kernels"][0]["shapes"]
    assert doc["checkpoint"]["ok"] and doc["checkpoint"]["facts"]["num_tensors"] == 901
    assert doc["verdict"]["ok"]
    assert run_cli(args("--model", "demo", "--quick")) == 0
    text = capsys.readouterr().out
    assert "built-in" in text and "(sampled)" in text and "result: OK" in text


def test_broken_checkpoint_fails_the_verdict(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model_dir, culprit = damaged(tmp_path, "wrong-shape")
    assert run_cli(args("--model", str(model_dir))) == 1
    text = capsys.readouterr().out
    assert "verdict: FAILED" in text and "ERROR   bad_tensor" in text and "(128, 100)" in text
    assert culprit in text
    # Kernel shapes come from the config alone, so --shapes-only skips the damaged weights.
    assert run_cli(args("--model", str(model_dir), "--shapes-only")) == 0


def test_missing_model_dir(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(args("--model", "/no/such/model")) == 1
    text = capsys.readouterr().out
    assert "does not exist" in text and "built-in" in text


def test_forced_backends(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(args("--moe-backend", "torch")) == 0
    assert run_cli(args("--moe-backend", "triton")) == 1
    text = capsys.readouterr().out
    assert "route: forced backend 'triton' is unsupported" in text
    assert run_cli(args("--linear-backend", "cutlass", "--json")) == 1
    problems = json.loads(capsys.readouterr().out)["verdict"]["problems"]
    assert any("'cutlass' does not exist" in p for p in problems), problems


def _table_with(op: str, *extra: Backend, keep_torch: bool = True) -> Any:
    def table() -> dict[str, tuple[Backend, ...]]:
        out = default_backends()
        torch_only = tuple(b for b in out[op] if b.name == "torch" and keep_torch)
        out[op] = (*extra, *torch_only)
        return out

    return table


def test_failing_backend_is_reported_and_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    def wrong(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: Any = None) -> Any:
        return x * 2, (x if residual is None else x + residual) if residual is not None else None

    def crashes(*_a: Any, **_k: Any) -> Any:
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(doctor_kernels, "default_backends",
                        _table_with("rms_norm", Backend("wrong", wrong, always), Backend("boom", crashes, always)))
    doc = run_doctor(args())
    rows = {r["backend"]: r for r in doc["kernels"][0]["results"] if r["op"] == "rms_norm"}
    assert rows["wrong"]["status"] == "failed" and "relative error" in rows["wrong"]["detail"]
    assert rows["boom"]["status"] == "failed" and "kernel exploded" in rows["boom"]["detail"]
    assert doc["kernels"][0]["selected"]["rms_norm"] == "torch" and doc["verdict"]["ok"]


def test_op_without_passing_backend_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    def crashes(*_a: Any, **_k: Any) -> Any:
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(doctor_kernels, "default_backends",
                        _table_with("fused_moe", Backend("boom", crashes, always), keep_torch=False))
    doc = run_doctor(args())
    assert not doc["verdict"]["ok"]
    assert doc["verdict"]["problems"] == ["kernels on cpu: fused_moe: no backend passes its self-test"]
    assert "fused_moe" not in doc["kernels"][0]["selected"]


def test_cli_entry_point() -> None:
    """Through `nibble` itself, in a fresh process: exit code and one JSON document on stdout."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-m", "nibble.cli", "doctor", "--device", "cpu", "--json", "--quick",
                           "--model", "demo"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    assert doc["verdict"]["ok"] and doc["checkpoint"]["ok"]
    assert doc["triton"]["cpu"]["status"] == "unsupported"
    assert "Traceback" not in proc.stderr


def test_gpu_line_names_the_tuning_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """Simulated GPUs (none here): an H100 has a table of its own over the H200's (same compute capability), a
    GH200 has none and takes the H200's, an sm_80 card unknown to by_capability.json default.json only."""
    import types

    import nibble.doctor.environment as environment
    import nibble.kernels.tuning_tables as tuning_tables

    doc = run_doctor(args())
    gib = 2**30
    cards = [("NVIDIA H100 80GB HBM3", 9, 0), ("NVIDIA GH200 480GB", 9, 0), ("NVIDIA A100-SXM4-80GB", 8, 0)]
    props = [types.SimpleNamespace(name=n, major=a, minor=b, total_memory=80 * gib, multi_processor_count=132)
             for n, a, b in cards]
    monkeypatch.setattr(environment.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(environment.torch.cuda, "device_count", lambda: len(cards))
    monkeypatch.setattr(environment.torch.cuda, "get_device_properties", lambda i: props[i])
    monkeypatch.setattr(environment.torch.cuda, "mem_get_info", lambda i: (70 * gib, 80 * gib))
    monkeypatch.setattr(tuning_tables, "device_key", lambda d: props[d.index].name.lower().replace(" ", "_"))
    monkeypatch.setattr(tuning_tables, "capability", lambda d: (props[d.index].major, props[d.index].minor))
    tuning_tables.named_tables.cache_clear()
    try:
        gpus = environment.list_gpus()
    finally:
        tuning_tables.named_tables.cache_clear()
    assert [g["tuning_tables"] for g in gpus] == [["nvidia_h200", "nvidia_h100_80gb_hbm3"], ["nvidia_h200"], []]
    doc["gpus"] = gpus
    text = render(doc)
    assert ("NVIDIA H100 80GB HBM3: sm_90, 132 SMs, 70.0 of 80.0 GiB free, tuning/nvidia_h100_80gb_hbm3.json over "
            "tuning/nvidia_h200.json") in text
    assert "NVIDIA GH200 480GB: sm_90, 132 SMs, 70.0 of 80.0 GiB free, tuning/nvidia_h200.json" in text
    assert "NVIDIA A100-SXM4-80GB: sm_80, 132 SMs, 70.0 of 80.0 GiB free, tuning/default.json only" in text
