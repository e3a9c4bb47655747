"""A real nibble HTTP server for tests: the app of `build_app` served by uvicorn in a background thread on a
free port of 127.0.0.1, plus a poll for an engine that has gone idle. Shared by tests/server and
tests/reliability."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

import uvicorn

from nibble.engine.async_engine import AsyncEngine
from nibble.server.api_server import build_app


@dataclass
class ServerHandle:
    """A running server: its base URL, the engine behind it and how to stop it."""

    url: str
    engine: AsyncEngine
    server: uvicorn.Server
    thread: threading.Thread

    @property
    def api(self) -> str:
        return self.url + "/v1"

    @property
    def model(self) -> str:
        return self.engine.engine.model_name

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def start_server(engine: AsyncEngine, api_key: str | None = None, cors: dict[str, Any] | None = None,
                 **app_settings: Any) -> ServerHandle:
    """Serve `engine` with uvicorn in a background thread on a free port of 127.0.0.1 (`cors` and
    `app_settings`, e.g. default_chat_template_kwargs: see build_app)."""
    app = build_app(engine, api_key=api_key, cors=cors, **app_settings)
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
    return ServerHandle(f"http://127.0.0.1:{port}", engine, server, thread)


def wait_idle(engine: AsyncEngine, timeout: float = 5.0) -> bool:
    """Poll until the engine holds no request and every KV block and state slot is free."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = engine.stats()
        if stats["num_running"] == 0 and stats["num_waiting"] == 0 and engine.engine.blocks.all_free():
            return True
        time.sleep(0.05)
    return False
