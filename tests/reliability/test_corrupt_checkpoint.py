"""Damaged checkpoints: a corrupt or truncated shard, a shard the index names but that is missing, a tensor
of the wrong shape or dtype, a missing tensor. Each gives a clear load error naming the file or tensor:
from the engine constructor (an exception, no partial engine), from `nibble serve` (exit code 1 and a
one-line message, no traceback) and from the checkpoint checker behind `nibble doctor`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from nibble.checkpoint.validate import validate_checkpoint
from nibble.engine.llm_engine import LLMEngine

from .checkpoints import DAMAGES, damaged
from .conftest import REPO, engine_config


def names(culprit: str) -> tuple[str, ...]:
    """How a message may name the culprit: the file, the stored tensor name or the model's own name."""
    return (culprit, culprit.replace("model.language_model.", "model."))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, str]]:
    root = tmp_path_factory.mktemp("damaged")
    return {kind: damaged(root, kind) for kind in DAMAGES}


@pytest.mark.parametrize("kind", list(DAMAGES))
def test_engine_load_error_names_the_culprit(checkpoints: dict[str, tuple[Path, str]], kind: str) -> None:
    model_dir, culprit = checkpoints[kind]
    with pytest.raises(ValueError) as info:
        LLMEngine(engine_config(model=str(model_dir)))
    message = str(info.value)
    assert any(n in message for n in names(culprit)), message


def test_serve_exits_with_one_line_error(checkpoints: dict[str, tuple[Path, str]]) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = {kind: subprocess.Popen(
        [sys.executable, "-m", "nibble.cli", "serve", "--model", str(model_dir), "--device", "cpu",
         "--host", "127.0.0.1", "--port", "0", "--max-model-len", "512"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for kind, (model_dir, _) in checkpoints.items()}
    for kind, proc in procs.items():
        try:
            out, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail(f"{kind}: nibble serve did not exit on a broken checkpoint")
        culprit = checkpoints[kind][1]
        assert proc.returncode == 1, (kind, proc.returncode, err[-2000:])
        assert "Traceback" not in err + out, (kind, err[-3000:])
        errors = [line for line in err.splitlines() if "error:" in line]
        assert len(errors) == 1 and "nibble serve: error:" in errors[0], (kind, err[-2000:])
        assert any(n in errors[0] for n in names(culprit)), (kind, errors[0])


@pytest.mark.parametrize("kind", [*DAMAGES, "nan-scales"])
def test_checker_reports_the_culprit(tmp_path: Path, kind: str) -> None:
    model_dir, culprit = damaged(tmp_path, kind)
    report = validate_checkpoint(model_dir)
    assert not report.ok
    errors = [f for f in report.findings if f.severity == "error"]
    assert any(n in (f.message + str(f.file) + str(f.tensor)) for f in errors for n in names(culprit)), \
        report.render()
