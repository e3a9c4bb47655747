"""A local HTTP server for image-URL tests: routes (path -> handler) served by `http.server` in a thread on a
free port of 127.0.0.1; unknown paths are 404. Nothing beyond localhost is reached."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

Route = Callable[[BaseHTTPRequestHandler], None]


def send_bytes(body: bytes, content_type: str = "image/png", content_length: bool = True) -> Route:
    """A route answering 200 with `body`; without Content-Length the end of the body is the connection's close
    (the handler speaks HTTP/1.0)."""
    def route(h: BaseHTTPRequestHandler) -> None:
        h.send_response(200)
        h.send_header("Content-Type", content_type)
        if content_length:
            h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    return route


def redirect(location: str, code: int = 302) -> Route:
    def route(h: BaseHTTPRequestHandler) -> None:
        h.send_response(code)
        h.send_header("Location", location)
        h.send_header("Content-Length", "0")
        h.end_headers()

    return route


@contextlib.contextmanager
def local_http_server(routes: dict[str, Route]) -> Iterator[str]:
    """Serve `routes` (the request path, query included, -> its handler); yields the base URL
    'http://127.0.0.1:PORT'. A route may add to `routes` while serving (e.g. knowing the port)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            route = routes.get(self.path)
            try:
                if route is None:
                    self.send_error(404)
                else:
                    route(self)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client gave up (a timeout or size test): nothing to answer

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
