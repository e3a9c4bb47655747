"""Tiny checkpoints shared by the tensor-parallel tests (made once per session)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.parallel.scenario import make_checkpoints


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_checkpoints(tmp_path_factory.mktemp("tp_models"))
