"""Image URLs (nibble/engine/media.py): fetching over http(s) from a local server, file:// under an allowed
directory, and every refusal as a one-line ValueError naming the URL and the reason."""

from __future__ import annotations

import io
import os
import re
import socket
import threading
import time
from contextlib import AbstractContextManager
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from nibble.engine.config import EngineConfig, EngineConfigError
from nibble.engine.media import MediaPolicy, fetch_image_bytes, resolve_image_sources
from nibble.models.vision_processor import decode_image
from tests.helpers.http_media import local_http_server, redirect, send_bytes

LIMIT = 4096


def _raises(text: str) -> AbstractContextManager[pytest.ExceptionInfo[ValueError]]:
    """pytest.raises for a ValueError whose message contains `text`."""
    return pytest.raises(ValueError, match=re.escape(text))


def _png(seed: int = 0, size: tuple[int, int] = (12, 8)) -> bytes:
    array = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="PNG")
    return buf.getvalue()


PNG = _png()


def _slow(h: BaseHTTPRequestHandler) -> None:
    time.sleep(2.0)
    send_bytes(PNG)(h)


def _trickle(h: BaseHTTPRequestHandler) -> None:
    """Headers at once, then a byte every 0.1 s: no single read waits long, the whole takes 3 s."""
    h.send_response(200)
    h.send_header("Content-Length", "30")
    h.end_headers()
    for _ in range(30):
        h.wfile.write(b"x")
        h.wfile.flush()
        time.sleep(0.1)


def _no_content(h: BaseHTTPRequestHandler) -> None:
    h.send_response(204)
    h.end_headers()


@pytest.fixture(scope="module")
def base() -> str:
    routes = {"/img.png": send_bytes(PNG), "/k%C3%A4tzchen%20klein.png?v=%C3%A4": send_bytes(PNG),
              "/redirect": redirect("/img.png"),
              "/missing-redirect": redirect("/nothing-here"), "/big": send_bytes(b"\0" * (LIMIT + 1)),
              "/big-stream": send_bytes(b"\0" * (3 * LIMIT), content_length=False),
              "/exact": send_bytes(b"\1" * LIMIT, content_length=False),
              "/slow": _slow, "/trickle": _trickle, "/to-file": redirect("file:///etc/passwd"),
              "/to-ftp": redirect("ftp://127.0.0.1/img.png"), "/created": _no_content}
    for n in range(1, 7):
        routes[f"/chain/{n}"] = redirect(f"/chain/{n - 1}" if n > 1 else "/img.png", code=(301, 302, 303, 307)[n % 4])
    with local_http_server(routes) as url:
        port = url.rsplit(":", 1)[1]
        routes["/elsewhere"] = redirect(f"http://localhost:{port}/img.png")
        yield url


POLICY = MediaPolicy(timeout_s=5.0, max_bytes=LIMIT)


def test_fetch_and_redirects(base: str) -> None:
    assert fetch_image_bytes(base + "/img.png", POLICY) == PNG
    assert fetch_image_bytes(" " + base + "/redirect", POLICY) == PNG
    assert fetch_image_bytes(base + "/chain/5", POLICY) == PNG
    assert np.array_equal(np.array(decode_image(fetch_image_bytes(base + "/chain/1", POLICY))),
                          np.array(Image.open(io.BytesIO(PNG)).convert("RGB")))
    assert fetch_image_bytes(base + "/kätzchen klein.png?v=ä", POLICY) == PNG
    assert fetch_image_bytes(base + "/k%C3%A4tzchen%20klein.png?v=%C3%A4", POLICY) == PNG
    # exactly the limit is allowed, one byte more is not
    assert fetch_image_bytes(base + "/exact", POLICY) == b"\1" * LIMIT


@pytest.mark.parametrize(("path", "reason"), [
    ("/chain/6", "more than 5 redirects"),
    ("/missing", "HTTP 404"),
    ("/missing-redirect", "HTTP 404"),
    ("/created", "HTTP 204"),
    ("/big", f"is larger than {LIMIT} bytes (Content-Length {LIMIT + 1})"),
    ("/big-stream", f"is larger than {LIMIT} bytes"),
    ("/to-file", "redirected to file:///etc/passwd: only http:// and https:// URLs are fetched, not 'file'"),
    ("/to-ftp", "not 'ftp'"),
])
def test_fetch_refusals(base: str, path: str, reason: str) -> None:
    with pytest.raises(ValueError) as info:
        fetch_image_bytes(base + path, POLICY)
    message = str(info.value)
    assert message.startswith(f"fetching {base}{path}: ") and reason in message, message
    assert "\n" not in message and info.value.__cause__ is None


def test_allowed_domains(base: str) -> None:
    """Exact host names, case-insensitive, checked on every redirect before it is followed."""
    port = base.rsplit(":", 1)[1]
    only_ip = MediaPolicy(timeout_s=5.0, max_bytes=LIMIT, allowed_domains=("127.0.0.1",))
    assert fetch_image_bytes(base + "/redirect", only_ip) == PNG
    with _raises(f"fetching {base}/elsewhere: redirected to http://localhost:{port}/img.png: "
                                         "host 'localhost' is not in --allowed-media-domains"):
        fetch_image_bytes(base + "/elsewhere", only_ip)
    with _raises("host 'evil.com' is not in --allowed-media-domains"):
        fetch_image_bytes("https://evil.com/a.png", only_ip)
    # a suffix or a subdomain is another host
    for url in ("http://127.0.0.1.evil.com/a.png", "http://sub.example.com/a.png"):
        with _raises("is not in --allowed-media-domains"):
            fetch_image_bytes(url, MediaPolicy(allowed_domains=("127.0.0.1", "example.com")))
    # hosts that urllib would read otherwise than the check does
    for url in ("http://127.0.0.1.evil.com%23@127.0.0.1/a.png", "http://evil.com\\@127.0.0.1/a.png",
                "http://127.0.0.1%2eevil.com/a.png", f"http://user@127.0.0.1:{port}/img.png"):
        with _raises(f"fetching {url}: user info, backslashes and %-escapes in the host part are not supported"):
            fetch_image_bytes(url, only_ip)
    mixed_case = MediaPolicy(timeout_s=5.0, max_bytes=LIMIT, allowed_domains=("LocalHost", "127.0.0.1"))
    assert fetch_image_bytes(f"http://LOCALHOST:{port}/img.png", mixed_case) == PNG
    assert fetch_image_bytes(base + "/elsewhere", mixed_case) == PNG


def test_timeouts(base: str) -> None:
    """A server that does not answer, and one that answers too slowly as a whole (each read is quick)."""
    policy = MediaPolicy(timeout_s=0.5, max_bytes=LIMIT)
    for path in ("/slow", "/trickle"):
        start = time.monotonic()
        with _raises(f"fetching {base}{path}: timed out after 0.5 s"):
            fetch_image_bytes(base + path, policy)
        assert time.monotonic() - start < 1.5


def test_unreachable_and_unsupported() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once closed
    with _raises(f"fetching http://127.0.0.1:{port}/a.png: cannot connect"):
        fetch_image_bytes(f"http://127.0.0.1:{port}/a.png", POLICY)
    with _raises("fetching ftp://x/a.png: unsupported URL scheme 'ftp'"):
        fetch_image_bytes("ftp://x/a.png", POLICY)
    with _raises("invalid URL"):
        fetch_image_bytes("http://127.0.0.1:notaport/a.png", POLICY)
    long = "https://evil.com/" + "a" * 500
    with pytest.raises(ValueError) as info:
        fetch_image_bytes(long, MediaPolicy(allowed_domains=()))
    assert "a" * 200 not in str(info.value) and "...: host 'evil.com'" in str(info.value)


def test_file_urls(tmp_path: Path) -> None:
    allowed, outside = tmp_path / "media", tmp_path / "private"
    allowed.mkdir()
    outside.mkdir()
    (allowed / "cat 1.png").write_bytes(PNG)
    (allowed / "big.png").write_bytes(b"\0" * (LIMIT + 1))
    (outside / "secret.png").write_bytes(PNG)
    (allowed / "escape.png").symlink_to(outside / "secret.png")
    (allowed / "inner.png").symlink_to(allowed / "cat 1.png")
    os.mkfifo(allowed / "pipe.png")  # opening it for reading would wait for a writer
    policy = MediaPolicy(max_bytes=LIMIT, allowed_local_path=str(allowed))
    assert fetch_image_bytes(f"file://{allowed}/cat%201.png", policy) == PNG
    assert fetch_image_bytes(f"file://localhost{allowed}/inner.png", policy) == PNG
    with _raises(f"fetching file://{allowed}/cat%201.png: file:// URLs need "
                                         "--allowed-local-media-path"):
        fetch_image_bytes(f"file://{allowed}/cat%201.png", MediaPolicy())
    for url, reason in ((f"file://{outside}/secret.png", "outside --allowed-local-media-path"),
                        (f"file://{allowed}/escape.png", "outside --allowed-local-media-path"),
                        (f"file://{allowed}/../private/secret.png", "outside --allowed-local-media-path"),
                        (f"file://{allowed}/big.png", f"larger than {LIMIT} bytes"),
                        (f"file://{allowed}/none.png", "no such file"),
                        (f"file://{allowed}", "not a regular file"),
                        (f"file://{allowed}/pipe.png", "not a regular file"),
                        (f"file://host{allowed}/cat%201.png", "must name a local path")):
        with pytest.raises(ValueError) as info:
            fetch_image_bytes(url, policy)
        assert str(info.value).startswith(f"fetching {url}: ") and reason in str(info.value), str(info.value)


def test_resolve_image_sources(base: str) -> None:
    """URLs become their bytes (fetched concurrently: the server's handlers wait for each other), everything
    else is passed on as the same object."""
    data_url = "data:image/png;base64,AAAA"
    pil = Image.open(io.BytesIO(PNG))
    array = np.zeros((4, 4, 3), dtype=np.uint8)
    raw = b"\x89PNG..."
    sources = [data_url, raw, pil, array, base + "/img.png", "not a url"]
    out = resolve_image_sources(sources, POLICY)
    assert out[4] == PNG
    assert all(a is b for i, (a, b) in enumerate(zip(out, sources)) if i != 4)
    assert resolve_image_sources([data_url, raw], POLICY) == [data_url, raw]

    together = threading.Barrier(3, timeout=5)

    def meet(seed: int) -> object:
        def route(h: BaseHTTPRequestHandler) -> None:
            together.wait()
            send_bytes(_png(seed))(h)
        return route

    routes = {f"/{i}.png": meet(i) for i in range(3)}
    with local_http_server(routes) as url:
        urls = [f"{url}/{i}.png" for i in range(3)]
        assert resolve_image_sources([urls[2], data_url, urls[0], urls[1], urls[2]], POLICY) == [
            _png(2), data_url, _png(0), _png(1), _png(2)]
    with _raises(f"fetching {base}/missing: HTTP 404"):
        resolve_image_sources([base + "/img.png", base + "/missing", "ftp://x/y"], POLICY)


def test_engine_config_media_fields(tmp_path: Path) -> None:
    config = EngineConfig(model="demo", media_fetch_timeout_s=2.5, max_media_bytes=100,
                          allowed_media_domains=["a.example", "B.example"],  # type: ignore[arg-type]
                          allowed_local_media_path=str(tmp_path))
    assert config.allowed_media_domains == ("a.example", "B.example")
    assert config.media_policy == MediaPolicy(timeout_s=2.5, max_bytes=100, allowed_domains=("a.example", "B.example"),
                                              allowed_local_path=str(tmp_path))
    assert EngineConfig(model="demo").media_policy == MediaPolicy(timeout_s=10.0, max_bytes=20 * 2**20)
    file = tmp_path / "f"
    file.write_text("x")
    for kwargs, flag in (({"media_fetch_timeout_s": 0}, "--media-fetch-timeout"),
                         ({"max_media_bytes": -1}, "--max-media-bytes"),
                         ({"allowed_media_domains": "a.example"}, "--allowed-media-domains"),
                         ({"allowed_media_domains": ("",)}, "--allowed-media-domains"),
                         ({"allowed_local_media_path": str(tmp_path / "none")}, "--allowed-local-media-path"),
                         ({"allowed_local_media_path": str(file)}, "--allowed-local-media-path")):
        with pytest.raises(EngineConfigError, match=flag):
            EngineConfig(model="demo", **kwargs)  # type: ignore[arg-type]
