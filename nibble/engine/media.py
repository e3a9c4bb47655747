"""Image bytes for a URL, as vLLM gets them: http(s):// fetched, file:// read, under a `MediaPolicy`.

An image of a request may be a URL instead of inline data (`{"type": "image_url", "image_url": {"url":
"https://..."}}`). `resolve_image_sources` swaps such URLs for their bytes before decoding; data URLs, bytes,
PIL images and arrays pass through. The policy is the server's (`nibble serve --allowed-media-domains`,
`--allowed-local-media-path`, `--media-fetch-timeout`, `--max-media-bytes`): by default any http(s) host is
fetched, as vLLM does, so a public deployment should name the hosts it trusts, since the server otherwise
fetches whatever a client asks for from inside its network. file:// is refused unless a local directory is
allowed, and then only for files whose real path lies inside it (symlinks resolved).

Every refusal or failure is a `ValueError` that names the URL and the reason, e.g.
"fetching https://x/a.png: HTTP 404"; nothing else escapes, so the caller can turn it into a 400.
"""

from __future__ import annotations

import http.client
import os
import re
import stat
import string
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

DEFAULT_TIMEOUT_S = 10.0
DEFAULT_MAX_BYTES = 20 * 2**20
MAX_REDIRECTS = 5
# concurrent fetches of one request's images: a few hide the latency of several hosts without letting one
# request open many connections
MAX_CONCURRENT_FETCHES = 4
_READ_CHUNK = 64 * 1024
_SHOWN_URL_CHARS = 100
_USER_AGENT = "nibble (image fetch)"
# a URL scheme (RFC 3986), looked for at the start only: a data URL can be megabytes long
_SCHEME = re.compile(r"\s*([A-Za-z][A-Za-z0-9+.-]*):")


@dataclass(frozen=True)
class MediaPolicy:
    """What the server may fetch for a request's image URLs.

    timeout_s: seconds for connecting and for each read; a fetch (redirects included) still running after that
        long in all is stopped at its next read.
    max_bytes: the largest image body, in bytes (fetched or read from a file).
    allowed_domains: host names http(s) URLs (and each redirect) may point at, matched exactly and
        case-insensitively; None allows any host.
    allowed_local_path: the directory file:// URLs may read inside; None refuses file:// URLs.
    """

    timeout_s: float = DEFAULT_TIMEOUT_S
    max_bytes: int = DEFAULT_MAX_BYTES
    allowed_domains: tuple[str, ...] | None = None
    allowed_local_path: str | None = None


class _Refused(ValueError):
    """A reason without its URL; `fetch_image_bytes` adds the URL."""


def shorten_url(url: str) -> str:
    """The URL as error messages show it: at most ~100 characters (a long query string or path cut)."""
    return url if len(url) <= _SHOWN_URL_CHARS else url[:_SHOWN_URL_CHARS - 3] + "..."


def is_fetched_url(source: Any) -> bool:
    """Whether `resolve_image_sources` replaces this source: a string with a URL scheme other than data:."""
    if not isinstance(source, str):
        return False
    match = _SCHEME.match(source[:64])
    return match is not None and match.group(1).lower() != "data"


def fetch_image_bytes(url: str, policy: MediaPolicy) -> bytes:
    """The body of an http(s):// URL, or the contents of a file:// URL, as the policy allows; at most
    `policy.max_bytes` bytes. Raises ValueError "fetching <url>: <reason>" on any refusal or failure."""
    url = url.strip()
    try:
        scheme = urllib.parse.urlsplit(url).scheme.lower()
        if scheme in ("http", "https"):
            return _fetch_remote(url, policy)
        if scheme == "file":
            return _read_local(url, policy)
        raise _Refused(f"unsupported URL scheme '{scheme}' (images are taken as data:, http://, https:// or file:// "
                       "URLs)")
    except _Refused as exc:
        raise ValueError(f"fetching {shorten_url(url)}: {exc}") from None
    except ValueError as exc:  # urllib's own complaints about a malformed URL (a bad port, an unknown type)
        raise ValueError(f"fetching {shorten_url(url)}: invalid URL ({exc})") from None


def resolve_image_sources(sources: list[Any], policy: MediaPolicy) -> list[Any]:
    """`sources` with each http(s)/file URL string replaced by its bytes (`fetch_image_bytes`; several are
    fetched concurrently, a URL given twice once); data URLs, bytes, PIL images and arrays are kept as they
    are, a string with another scheme is refused. Raises the ValueError of the first failing URL, in order."""
    urls = list(dict.fromkeys(s.strip() for s in sources if is_fetched_url(s)))
    if not urls:
        return list(sources)
    fetched: dict[str, bytes]
    if len(urls) == 1:
        fetched = {urls[0]: fetch_image_bytes(urls[0], policy)}
    else:
        with ThreadPoolExecutor(max_workers=min(MAX_CONCURRENT_FETCHES, len(urls)),
                                thread_name_prefix="nibble-media") as pool:
            futures = [pool.submit(fetch_image_bytes, u, policy) for u in urls]
            try:
                fetched = {u: f.result() for u, f in zip(urls, futures)}
            except ValueError:
                # the request fails anyway: fetches not started yet need not run
                for f in futures:
                    f.cancel()
                raise
    return [fetched[s.strip()] if is_fetched_url(s) else s for s in sources]


def _check_host(url: str, policy: MediaPolicy, redirected: bool = False) -> None:
    """Refuse a URL the policy does not let the server fetch (scheme, then host)."""
    parts = urllib.parse.urlsplit(url)
    scheme = parts.scheme.lower()
    prefix = f"redirected to {shorten_url(url)}: " if redirected else ""
    if scheme not in ("http", "https"):
        raise _Refused(f"{prefix}only http:// and https:// URLs are fetched, not '{scheme}'")
    if any(c in parts.netloc for c in "@\\%"):
        # urllib and urlsplit disagree on the host of such URLs (urllib unquotes it, urlsplit takes what follows
        # the last '@'): the host checked must be the one connected to
        raise _Refused(f"{prefix}user info, backslashes and %-escapes in the host part are not supported")
    host = (parts.hostname or "").rstrip(".")
    if not host:
        raise _Refused(f"{prefix}the URL has no host")
    if policy.allowed_domains is not None and host.lower() not in {d.lower().rstrip(".")
                                                                   for d in policy.allowed_domains}:
        raise _Refused(f"{prefix}host '{host}' is not in --allowed-media-domains")


class _PolicyRedirects(urllib.request.HTTPRedirectHandler):
    """Follows at most MAX_REDIRECTS redirects, each to a URL the policy allows, checked before it is
    requested (urllib's own handler follows 10 and to any http(s) host)."""

    def __init__(self, policy: MediaPolicy) -> None:
        self.policy = policy
        self.hops = 0

    def http_error_302(self, req: urllib.request.Request, fp: Any, code: int, msg: str,
                       headers: Any) -> Any:
        location = headers.get("location") or headers.get("uri")
        if location:
            try:
                self.hops += 1
                if self.hops > MAX_REDIRECTS:
                    raise _Refused(f"more than {MAX_REDIRECTS} redirects")
                _check_host(urllib.parse.urljoin(req.full_url, location), self.policy, redirected=True)
            except _Refused:
                fp.close()
                raise
        return super().http_error_302(req, fp, code, msg, headers)

    http_error_301 = http_error_303 = http_error_307 = http_error_308 = http_error_302


def _timed_out(policy: MediaPolicy) -> _Refused:
    return _Refused(f"timed out after {policy.timeout_s:g} s")


def _fetch_remote(url: str, policy: MediaPolicy) -> bytes:
    _check_host(url, policy)
    deadline = time.monotonic() + policy.timeout_s
    opener = urllib.request.build_opener(_PolicyRedirects(policy))
    # http.client sends the request line as ASCII: non-ASCII and spaces in the path are %-escaped, as browsers
    # do (escapes already there are kept)
    parts = urllib.parse.urlsplit(url)
    quoted = parts._replace(path=urllib.parse.quote(parts.path, safe=string.punctuation),
                            query=urllib.parse.quote(parts.query, safe=string.punctuation))
    request = urllib.request.Request(urllib.parse.urlunsplit(quoted), headers={"User-Agent": _USER_AGENT})
    try:
        with opener.open(request, timeout=policy.timeout_s) as response:
            if response.status != 200:
                raise _Refused(f"HTTP {response.status}")
            length = response.headers.get("Content-Length")
            if length is not None and length.strip().isdigit() and int(length) > policy.max_bytes:
                raise _Refused(f"the image is larger than {policy.max_bytes} bytes (Content-Length {int(length)})")
            # read1 returns what one socket read gives, so a server that trickles bytes meets the deadline
            return _read_capped(response.read1, policy, deadline)
    except urllib.error.HTTPError as exc:
        exc.close()
        raise _Refused(f"HTTP {exc.code}") from None
    except urllib.error.URLError as exc:
        if isinstance(exc.reason, TimeoutError):
            raise _timed_out(policy) from None
        raise _Refused(f"cannot connect ({exc.reason})") from None
    except TimeoutError:
        raise _timed_out(policy) from None
    except http.client.InvalidURL as exc:
        raise _Refused(f"invalid URL ({exc})") from None
    except (http.client.HTTPException, OSError) as exc:
        raise _Refused(f"the connection failed ({type(exc).__name__}: {exc})") from None


def _read_capped(read: Callable[[int], bytes], policy: MediaPolicy, deadline: float | None) -> bytes:
    """Everything `read` gives until it returns b'' (at most max_bytes, else _Refused), before `deadline`
    (time.monotonic seconds; None: no deadline)."""
    chunks: list[bytes] = []
    size = 0
    while True:
        chunk = read(_READ_CHUNK)
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if size > policy.max_bytes:
            raise _Refused(f"the image is larger than {policy.max_bytes} bytes")
        chunks.append(chunk)
        if deadline is not None and time.monotonic() > deadline:
            raise _timed_out(policy)


def _read_local(url: str, policy: MediaPolicy) -> bytes:
    if policy.allowed_local_path is None:
        raise _Refused("file:// URLs need --allowed-local-media-path")
    parts = urllib.parse.urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise _Refused(f"file:// URLs must name a local path, not host '{parts.netloc}'")
    root = os.path.realpath(policy.allowed_local_path)
    # realpath resolves symlinks, so a link inside the directory that points out of it is refused too
    path = os.path.realpath(urllib.request.url2pathname(parts.path))
    if os.path.commonpath([root, path]) != root:
        raise _Refused("the file is outside --allowed-local-media-path")
    # O_NOFOLLOW: the checked path must not become a symlink between the check and the open; O_NONBLOCK: a
    # FIFO must not block the open (it is refused below, as everything but a regular file)
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise _Refused("no such file") from None
    except OSError as exc:
        raise _Refused(f"cannot open the file ({exc.strerror or exc})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise _Refused("not a regular file")
        if info.st_size > policy.max_bytes:
            raise _Refused(f"the image is larger than {policy.max_bytes} bytes")
        return _read_capped(lambda n: os.read(fd, n), policy, None)
    except OSError as exc:
        raise _Refused(f"cannot read the file ({exc.strerror or exc})") from None
    finally:
        os.close(fd)
