"""`nibble bench serve` against a stand-in OpenAI-compatible server with known timings.

The stand-in is a real aiohttp server on a random 127.0.0.1 port, run on its own event loop in a thread so
that the benchmark's client timings are not distorted by sharing a loop with it. It streams `max_tokens`
tokens with a fixed delay before the first chunk and between chunks, and records what it was sent.
"""

from __future__ import annotations

import asyncio
import json
import math
import socket
import threading
from pathlib import Path

import pytest
from aiohttp import web
from tokenizers import Tokenizer, models, pre_tokenizers

from nibble.bench.datasets import load_tokenizer, sample_random_requests
from nibble.bench.serve import BenchServeConfig, main, run_benchmark

MODEL = "stand-in/tiny"
QWEN_TOKENIZER = Path("/work/shared/models/qwen3.5/tokenizer/tokenizer.json")


class StandInServer:
    """Streams completions with controlled delays; counts requests and concurrency."""

    def __init__(
        self,
        ttft_s: float = 0.0,
        itl_s: float = 0.0,
        tokens_per_chunk: int = 1,
        send_usage: bool = True,
        fail_every: int = 0,
    ) -> None:
        self.ttft_s = ttft_s
        self.itl_s = itl_s
        self.tokens_per_chunk = tokens_per_chunk
        self.send_usage = send_usage
        self.fail_every = fail_every
        self.num_requests = 0
        self.in_flight = 0
        self.peak_in_flight = 0
        self.bodies: list[dict] = []
        self.auth_headers: list[str | None] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None
        self.port = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> StandInServer:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=10)
        return self

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.num_requests += 1
        self.bodies.append(body)
        self.auth_headers.append(request.headers.get("Authorization"))
        if body.get("model") != MODEL:
            return web.json_response({"error": {"message": f"model {body.get('model')} not found"}}, status=404)
        if self.fail_every and self.num_requests % self.fail_every == 0:
            return web.json_response({"error": {"message": "stand-in failure"}}, status=500)
        chat = request.path.endswith("/chat/completions")
        prompt = body["messages"][0]["content"] if chat else body["prompt"]
        prompt_tokens = len(prompt) if isinstance(prompt, list) else len(prompt.split())
        num_tokens = body["max_tokens"]
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        try:
            for i in range(math.ceil(num_tokens / self.tokens_per_chunk)):
                await asyncio.sleep(self.ttft_s if i == 0 else self.itl_s)
                text = " tok" * self.tokens_per_chunk
                choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
                await resp.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
            if self.send_usage:
                usage = {"prompt_tokens": prompt_tokens, "completion_tokens": num_tokens}
                await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        finally:
            # Leaving before [DONE] keeps the count conservative: a client may start its next request as
            # soon as it reads [DONE].
            self.in_flight -= 1
        await resp.write(b"data: [DONE]\n\n")
        return resp


@pytest.fixture
def serve():
    """Factory for stand-in servers, all stopped at teardown."""
    servers: list[StandInServer] = []

    def make(**behaviour) -> StandInServer:
        servers.append(StandInServer(**behaviour).start())
        return servers[-1]

    yield make
    for s in servers:
        s.stop()


@pytest.fixture(scope="module")
def word_tokenizer(tmp_path_factory) -> Path:
    """A word-level tokenizer whose tokens are whitespace-separated words (so the stand-in can count them),
    with an added special token that the dataset must never sample."""
    vocab = {"[UNK]": 0, **{f"w{i}": i + 1 for i in range(200)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<|eos|>"])
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


def _cfg(server: StandInServer, tokenizer: Path, **overrides) -> BenchServeConfig:
    base = dict(
        base_url=server.base_url,
        tokenizer=str(tokenizer),
        num_prompts=8,
        random_input_len=12,
        random_output_len=10,
        disable_tqdm=True,
    )
    return BenchServeConfig(**{**base, **overrides})


def test_counts_and_request_body(serve, word_tokenizer):
    server = serve()
    result = asyncio.run(run_benchmark(_cfg(server, word_tokenizer, num_prompts=8, api_key="secret")))
    m = result.metrics
    assert result.model == MODEL  # resolved from /v1/models
    assert (m.num_completed, m.num_failed) == (8, 0)
    assert m.total_input_tokens == 8 * 12
    assert m.total_output_tokens == 8 * 10
    assert server.num_requests == 1 + 8  # the test request, then the pass
    body = server.bodies[-1]
    assert body["max_tokens"] == 10 and body["ignore_eos"] is True and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True} and body["temperature"] == 0.0
    assert isinstance(body["prompt"], str) and len(body["prompt"].split()) == 12
    assert "<|eos|>" not in body["prompt"]
    assert set(server.auth_headers) == {"Bearer secret"}


def test_usage_preferred_over_chunks_and_fallback(serve, word_tokenizer):
    with_usage = serve(tokens_per_chunk=2)
    m = asyncio.run(run_benchmark(_cfg(with_usage, word_tokenizer, num_prompts=4))).metrics
    assert m.total_output_tokens == 4 * 10
    no_usage = serve(tokens_per_chunk=2, send_usage=False)
    m = asyncio.run(run_benchmark(_cfg(no_usage, word_tokenizer, num_prompts=4))).metrics
    assert m.total_output_tokens == 4 * 5  # one token per content chunk when the server sends no usage
    assert m.total_input_tokens == 4 * 12  # the dataset's lengths


def test_timings_match_server_delays(serve, word_tokenizer):
    ttft_s, itl_s, out_len = 0.06, 0.012, 12
    server = serve(ttft_s=ttft_s, itl_s=itl_s)
    cfg = _cfg(server, word_tokenizer, num_prompts=6, random_output_len=out_len, max_concurrency=2)
    result = asyncio.run(run_benchmark(cfg))
    m = result.metrics
    assert m.num_completed == 6
    assert ttft_s * 1000 * 0.95 <= m.ttft.median <= ttft_s * 1000 + 40
    assert itl_s * 1000 * 0.9 <= m.itl.median <= itl_s * 1000 + 8
    assert itl_s * 1000 * 0.9 <= m.tpot.mean <= itl_s * 1000 + 8
    expected_e2e = (ttft_s + (out_len - 1) * itl_s) * 1000
    assert expected_e2e * 0.95 <= m.e2el.median <= expected_e2e + 60
    assert all(len(o.itl) == out_len - 1 for o in result.outputs)
    for o in result.outputs:
        assert o.latency == pytest.approx(o.ttft + sum(o.itl), abs=0.02)
    assert set(m.ttft.percentiles) == {"p50", "p90", "p99"}
    # 6 requests, 2 at a time, ~0.19 s each: three waves.
    assert 3 * expected_e2e / 1000 * 0.95 <= m.duration <= 3 * expected_e2e / 1000 + 0.5
    assert m.output_throughput == pytest.approx(m.total_output_tokens / m.duration)


def test_max_concurrency_respected(serve, word_tokenizer):
    server = serve(ttft_s=0.01, itl_s=0.002)
    cfg = _cfg(server, word_tokenizer, num_prompts=12, max_concurrency=3, num_warmups=2)
    m = asyncio.run(run_benchmark(cfg)).metrics
    assert server.peak_in_flight == 3
    assert m.peak_concurrent_requests == 3 and m.max_concurrency == 3
    assert m.num_completed == 12  # warm-ups are not counted
    assert server.num_requests == 1 + 2 + 12


def test_request_rate_spreads_arrivals(serve, word_tokenizer):
    server = serve()
    cfg = _cfg(server, word_tokenizer, num_prompts=20, request_rate=50.0, random_output_len=2)
    result = asyncio.run(run_benchmark(cfg))
    starts = sorted(o.start_time for o in result.outputs)
    # 19 exponential gaps of mean 20 ms: ~0.38 s (std ~0.09 s); all at once would be a few ms.
    assert starts[-1] - starts[0] > 0.1
    assert result.metrics.num_completed == 20


def test_failures_counted_and_reported(serve, word_tokenizer):
    server = serve(fail_every=3)
    m = asyncio.run(run_benchmark(_cfg(server, word_tokenizer, num_prompts=9, max_concurrency=1))).metrics
    # Server request numbers 2..10 are the pass; 3, 6 and 9 fail.
    assert (m.num_completed, m.num_failed) == (6, 3)
    assert m.errors and all("HTTP 500" in e and "stand-in failure" in e for e in m.errors)
    assert m.total_output_tokens == 6 * 10


def test_chat_backend(serve, word_tokenizer):
    server = serve(itl_s=0.001)
    cfg = _cfg(server, word_tokenizer, backend="openai-chat", num_prompts=4, ignore_eos=False)
    m = asyncio.run(run_benchmark(cfg)).metrics
    assert (m.num_completed, m.total_output_tokens) == (4, 40)
    body = server.bodies[-1]
    assert body["messages"][0]["role"] == "user" and len(body["messages"][0]["content"].split()) == 12
    assert body["max_completion_tokens"] == 10 and "ignore_eos" not in body


def test_prompt_token_ids(serve, word_tokenizer):
    server = serve()
    cfg = _cfg(server, word_tokenizer, prompt_token_ids=True, random_range_ratio=0.5, num_prompts=10)
    result = asyncio.run(run_benchmark(cfg))
    sent = server.bodies[1:]
    assert all(isinstance(b["prompt"], list) and all(isinstance(t, int) for t in b["prompt"]) for b in sent)
    assert sorted(len(b["prompt"]) for b in sent) == sorted(o.prompt_len for o in result.outputs)
    assert {len(b["prompt"]) for b in sent} != {12}  # lengths vary with a range ratio
    assert all(6 <= len(b["prompt"]) <= 18 and 5 <= b["max_tokens"] <= 15 for b in sent)


def test_random_prompts_exact_length_word_tokenizer(word_tokenizer):
    tok = load_tokenizer(word_tokenizer)
    reqs = sample_random_requests(tok, 20, 30, 8, range_ratio=0.3, seed=3)
    for r in reqs:
        assert len(tok.encode(r.prompt, add_special_tokens=False).ids) == r.prompt_len
    assert len({r.prompt_len for r in reqs}) > 1


@pytest.mark.skipif(not QWEN_TOKENIZER.exists(), reason="Qwen3.5 tokenizer not present")
def test_random_prompts_exact_length_qwen_tokenizer():
    tok = load_tokenizer(QWEN_TOKENIZER.parent)
    for input_len in (1, 7, 256):
        reqs = sample_random_requests(tok, 8, input_len, 4, seed=input_len)
        assert all(len(tok.encode(r.prompt, add_special_tokens=False).ids) == input_len for r in reqs)
    ids = sample_random_requests(tok, 2, 64, 4, as_token_ids=True)[0].prompt
    assert len(ids) == 64 and not set(ids) & set(tok.get_added_tokens_decoder())


def test_cli_single_run_writes_detailed_json(serve, word_tokenizer, tmp_path, capsys):
    server = serve(itl_s=0.001)
    rc = main(
        [
            "--base-url",
            server.base_url + "/v1",
            "--tokenizer",
            str(word_tokenizer),
            "--num-prompts",
            "5",
            "--random-input-len",
            "8",
            "--random-output-len",
            "6",
            "--max-concurrency",
            "2",
            "--percentiles",
            "50,99.9",
            "--disable-tqdm",
            "--save-detailed",
            "--result-dir",
            str(tmp_path),
            "--result-filename",
            "run.json",
        ]
    )
    assert rc == 0
    out = capsys.readouterr().out
    assert "Serving Benchmark Result" in out and "P99.9 TTFT (ms):" in out
    doc = json.loads((tmp_path / "run.json").read_text())
    assert doc["completed"] == 5 and doc["total_output_tokens"] == 30 and doc["max_concurrency"] == 2
    assert "p99.9_itl_ms" in doc and doc["config"]["request_rate"] == "inf"
    assert len(doc["itls"]) == 5 and all(len(x) == 5 for x in doc["itls"])


def test_cli_sweep_writes_json_and_plot(serve, word_tokenizer, tmp_path, capsys):
    server = serve(itl_s=0.001)
    rc = main(
        [
            "--host",
            "127.0.0.1",
            "--port",
            str(server.port),
            "--model",
            MODEL,
            "--tokenizer",
            str(word_tokenizer),
            "--random-input-len",
            "8",
            "--random-output-len",
            "4",
            "--concurrency-sweep",
            "1,2,4",
            "--prompts-per-concurrency",
            "2",
            "--disable-tqdm",
            "--save-result",
            "--result-dir",
            str(tmp_path),
        ]
    )
    assert rc == 0
    assert "out tok/s" in capsys.readouterr().out
    (json_path,) = tmp_path.glob("*.json")
    runs = json.loads(json_path.read_text())["runs"]
    assert [(r["max_concurrency"], r["completed"]) for r in runs] == [(1, 2), (2, 4), (4, 8)]
    assert server.peak_in_flight <= 4
    png = json_path.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_cli_unreachable_server(word_tokenizer, capsys):
    port = _free_port()
    rc = main(["--port", str(port), "--tokenizer", str(word_tokenizer), "--num-prompts", "2", "--disable-tqdm"])
    assert rc == 1
    err = capsys.readouterr().err
    assert f"cannot connect to http://127.0.0.1:{port}/v1/models: is the server running?" in err
    assert "Traceback" not in err


def test_cli_rejected_request(serve, word_tokenizer, capsys):
    server = serve()
    rc = main(["--base-url", server.base_url, "--model", "wrong", "--tokenizer", str(word_tokenizer), "--disable-tqdm"])
    assert rc == 1
    err = capsys.readouterr().err
    assert "HTTP 404" in err and "model wrong not found" in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--random-range-ratio", "1.5"], "range ratio"),
        (["--concurrency-sweep", "1,x"], "--concurrency-sweep"),
        (["--concurrency-sweep", "0,4"], ">= 1"),
        (["--percentiles", "50,101"], "percentiles"),
        (["--backend", "openai-chat", "--prompt-token-ids"], "completions API"),
        (["--extra-body", "[1]"], "JSON object"),
        (["--max-concurrency", "0"], "max concurrency"),
    ],
)
def test_cli_bad_input(word_tokenizer, capsys, argv, message):
    assert main(["--tokenizer", str(word_tokenizer), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and message in err


def test_cli_missing_tokenizer(capsys, tmp_path):
    assert main(["--disable-tqdm"]) == 2
    assert "needs a tokenizer" in capsys.readouterr().err
    assert main(["--tokenizer", str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err
