"""Fixtures for the HTTP server tests: the embedded demo model on the CPU, served by uvicorn on a free local
port (tests/helpers/server.py). One engine and one server are shared by the whole session; tests that need
other settings (API key, tiny queue, injected faults) start their own with `start_server`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from nibble.engine.async_engine import AsyncEngine
from nibble.engine.config import EngineConfig
from nibble.engine.tokenizer import Tokenizer
from tests.helpers.server import ServerHandle, start_server, wait_idle

__all__ = ["ServerHandle", "start_server", "wait_idle"]

ASSETS = Path(__file__).resolve().parents[2] / "nibble" / "assets"
DEMO_CONFIG = ASSETS / "demo_model" / "config.json"
DEMO_TOKENIZER = ASSETS / "demo_tokenizer"
MAX_MODEL_LEN = 1024

@pytest.fixture(scope="session")
def model_kwargs() -> dict[str, Any]:
    """EngineConfig arguments selecting the embedded demo model."""
    return {"model": "demo"}


def make_engine(model_kwargs: dict[str, Any], **overrides: Any) -> AsyncEngine:
    """A CPU engine for tests (small batch, short context) with `overrides` applied."""
    settings: dict[str, Any] = {"device": "cpu", "max_model_len": MAX_MODEL_LEN, "max_num_seqs": 8,
                                "max_num_batched_tokens": 2048, **model_kwargs, **overrides}
    return AsyncEngine.from_config(EngineConfig(**settings))


@pytest.fixture(scope="session")
def engine(model_kwargs: dict[str, Any]) -> Iterator[AsyncEngine]:
    eng = make_engine(model_kwargs)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="session")
def server(engine: AsyncEngine) -> Iterator[ServerHandle]:
    handle = start_server(engine)
    yield handle
    handle.stop()


@pytest.fixture(scope="session")
def tokenizer(engine: AsyncEngine) -> Tokenizer:
    assert engine.engine.tokenizer is not None
    return engine.engine.tokenizer


@pytest.fixture()
def client(server: ServerHandle) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture()
def http(server: ServerHandle) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def metric_value(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` in Prometheus text whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        head, _, value = line.rpartition(" ")
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total
