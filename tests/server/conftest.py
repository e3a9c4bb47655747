"""Fixtures for the HTTP server tests: a tiny model on the CPU, served by uvicorn on a free local port.

The embedded demo checkpoint is used when it exists; until then a stand-in is built from a tiny
text-only Qwen3.5-MoE config.json plus the demo tokenizer, with random weights (`load_format="dummy"`).
One engine and one server are shared by the whole session; tests that need other settings (API key,
tiny queue, injected faults) start their own with `start_server`.
"""

from __future__ import annotations

import json
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import uvicorn

from nibble.engine.async_engine import AsyncEngine
from nibble.engine.config import EngineConfig
from nibble.engine.tokenizer import Tokenizer
from nibble.server.api_server import build_app

ASSETS = Path(__file__).resolve().parents[2] / "nibble" / "assets"
DEMO_CONFIG = ASSETS / "demo_model" / "config.json"
DEMO_TOKENIZER = ASSETS / "demo_tokenizer"
MAX_MODEL_LEN = 1024

STANDIN_CONFIG: dict[str, Any] = {
    "architectures": ["Qwen3_5MoeForCausalLM"],
    "model_type": "qwen3_5_moe_text",
    "vocab_size": 1024,
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 48,
    "max_position_embeddings": 4096,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "dtype": "bfloat16",
}


def build_standin_model(directory: Path) -> Path:
    """Write the stand-in checkpoint (config + demo tokenizer files) into `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    for item in DEMO_TOKENIZER.iterdir():
        shutil.copy(item, directory / item.name)
    tokenizer = Tokenizer.from_pretrained(directory)
    config = dict(STANDIN_CONFIG)
    assert tokenizer.vocab_size <= config["vocab_size"]
    config["eos_token_id"] = tokenizer.token_to_id("<|im_end|>")
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory


@pytest.fixture(scope="session")
def model_kwargs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """EngineConfig arguments selecting the demo model, or the stand-in while the demo is not built."""
    if DEMO_CONFIG.is_file():
        return {"model": "demo"}
    return {"model": str(build_standin_model(tmp_path_factory.mktemp("standin_model"))), "load_format": "dummy"}


def make_engine(model_kwargs: dict[str, Any], **overrides: Any) -> AsyncEngine:
    """A CPU engine for tests (small batch, short context) with `overrides` applied."""
    settings: dict[str, Any] = {"device": "cpu", "max_model_len": MAX_MODEL_LEN, "max_num_seqs": 8,
                                "max_num_batched_tokens": 2048, **model_kwargs, **overrides}
    return AsyncEngine.from_config(EngineConfig(**settings))


@dataclass
class ServerHandle:
    """A running server: its base URL, the engine behind it and how to stop it."""

    url: str
    engine: AsyncEngine
    model: str
    server: uvicorn.Server
    thread: threading.Thread

    @property
    def api(self) -> str:
        return self.url + "/v1"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def start_server(engine: AsyncEngine, api_key: str | None = None) -> ServerHandle:
    """Serve `engine` with uvicorn in a background thread on a free port of 127.0.0.1."""
    app = build_app(engine, api_key=api_key)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, log_config=None))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("test server did not start")
        time.sleep(0.02)
    return ServerHandle(f"http://127.0.0.1:{port}", engine, engine.engine.model_name, server, thread)


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


def wait_idle(engine: AsyncEngine, timeout: float = 5.0) -> bool:
    """Poll until the engine has no running or waiting request and every cache block is free."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = engine.stats()
        if stats["num_running"] == 0 and stats["num_waiting"] == 0 and engine.engine.blocks.all_free():
            return True
        time.sleep(0.05)
    return False


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
