"""`nibble bench serve` against a stand-in OpenAI-compatible server with known timings.

The stand-in is a real aiohttp server on a random 127.0.0.1 port, run on its own event loop in a thread so
that the benchmark's client timings are not distorted by sharing a loop with it. It streams `max_tokens`
tokens with a fixed delay before the first chunk and between chunks, and records what it was sent.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import math
import random
import socket
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from aiohttp import web
from tokenizers import Tokenizer, models, pre_tokenizers

import nibble
from nibble.bench.datasets import load_tokenizer, sample_prefix_repetition_requests, sample_random_requests
from nibble.bench.datasets_files import load_sharegpt, sample_sharegpt_requests
from nibble.bench.serve import BenchError, BenchServeConfig, build_requests, main, run_benchmark, run_sweep

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
        ttft_for: Callable[[int], float] | None = None,
    ) -> None:
        self.ttft_s = ttft_s
        # delay before the first chunk of the n-th request (1-based; 1 is the bench's test request), for
        # timings that differ between requests; ttft_s when None
        self.ttft_for = ttft_for
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
        number = self.num_requests
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
        ttft_s = self.ttft_s if self.ttft_for is None else self.ttft_for(number)
        try:
            for i in range(math.ceil(num_tokens / self.tokens_per_chunk)):
                await asyncio.sleep(ttft_s if i == 0 else self.itl_s)
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


def stand_in_servers():
    """Factory for stand-in servers, all stopped at teardown (the body of this file's `serve` fixture and of
    test_bench_serve_flags.py's)."""
    servers: list[StandInServer] = []

    def make(**behaviour) -> StandInServer:
        servers.append(StandInServer(**behaviour).start())
        return servers[-1]

    yield make
    for s in servers:
        s.stop()


serve = pytest.fixture(stand_in_servers, name="serve")


def write_word_tokenizer(directory: Path) -> Path:
    """A word-level tokenizer whose tokens are whitespace-separated words (so the stand-in can count them),
    with an added special token that the dataset must never sample; returns its tokenizer.json."""
    vocab = {"[UNK]": 0, **{f"w{i}": i + 1 for i in range(200)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<|eos|>"])
    path = directory / "tokenizer.json"
    tok.save(str(path))
    return path


@pytest.fixture(scope="module")
def word_tokenizer(tmp_path_factory) -> Path:
    """The word-level tokenizer's tokenizer.json."""
    return write_word_tokenizer(tmp_path_factory.mktemp("tok"))


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


def _words(n: int, start: int = 0) -> str:
    """`n` words of the word tokenizer's vocabulary: exactly `n` tokens."""
    return " ".join(f"w{(start + i) % 200}" for i in range(n))


def _write_sharegpt(path: Path, conversations: list) -> Path:
    """ShareGPT JSON from lists of turn texts (alternating human/gpt); dicts are written as they are."""
    entries = [
        c
        if isinstance(c, dict)
        else {"conversations": [{"from": "human gpt".split()[i % 2], "value": v} for i, v in enumerate(c)]}
        for c in conversations
    ]
    path.write_text(json.dumps(entries, indent=1))
    return path


def _write_jsonl(path: Path, lines: list) -> Path:
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return path


@pytest.fixture(scope="module")
def qwen_tokenizer() -> Tokenizer:
    if not QWEN_TOKENIZER.exists():
        pytest.skip("Qwen3.5 tokenizer not present")
    return load_tokenizer(QWEN_TOKENIZER)


def test_sharegpt_length_filter_follows_vllm(word_tokenizer, tmp_path):
    path = _write_sharegpt(
        tmp_path / "sg.json",
        [
            [_words(5), _words(6)],
            [_words(1024), _words(1024)],  # prompt at the limit, total exactly 2048
            [_words(3), _words(10)],  # prompt too short
            [_words(10), _words(3)],  # reply too short
            [_words(1025), _words(10)],  # prompt too long
            [_words(1000), _words(1049)],  # prompt + reply = 2049
            [_words(7), _words(8), _words(30)],  # only the first two turns count
            [_words(10)],  # no reply: skipped when loading, as vLLM does
            {"id": "no conversations"},
        ],
    )
    data = load_sharegpt(path)
    assert (data.num_entries, len(data.pairs)) == (9, 7)
    tok = load_tokenizer(word_tokenizer)
    reqs = sample_sharegpt_requests(data, tok, 100, oversample=False)
    assert sorted((r.prompt_len, r.output_len) for r in reqs) == [(5, 6), (7, 8), (1024, 1024)]
    assert all(r.prompt in {_words(5), _words(7), _words(1024)} for r in reqs)
    # A fixed output length lifts the reply minimum and replaces the reply's length in the total.
    fixed = sample_sharegpt_requests(data, tok, 100, output_len=8, oversample=False)
    assert sorted(r.prompt_len for r in fixed) == [5, 7, 10, 1000, 1024] and {r.output_len for r in fixed} == {8}


def test_sharegpt_seeded_order_and_oversampling(word_tokenizer, tmp_path):
    convs = [[_words(4 + i, 10 * i), _words(5 + i)] for i in range(6)]
    data = load_sharegpt(_write_sharegpt(tmp_path / "sg.json", convs))
    tok = load_tokenizer(word_tokenizer)

    def prompts(**kw) -> list:
        return [r.prompt for r in sample_sharegpt_requests(data, tok, **{"num_prompts": 6, **kw})]

    # Python's random with the seed, as vLLM shuffles, so a seed picks the conversations vLLM's would.
    order = list(range(6))
    random.Random(3).shuffle(order)
    assert prompts(seed=3) == [convs[i][0] for i in order] == prompts(seed=3)
    assert prompts(seed=4) != prompts(seed=3) and sorted(prompts(seed=4)) == sorted(prompts(seed=3))
    assert prompts(shuffle=False) == [c[0] for c in convs]
    topped_up = prompts(num_prompts=10, seed=3)
    assert len(topped_up) == 10 and set(topped_up) == set(convs[i][0] for i in order)
    assert topped_up[:6] == prompts(seed=3) and topped_up == prompts(num_prompts=10, seed=3)
    assert len(prompts(num_prompts=10, oversample=False)) == 6
    ids = sample_sharegpt_requests(data, tok, 2, as_token_ids=True)
    assert all(isinstance(r.prompt, list) and len(r.prompt) == r.prompt_len for r in ids)


def test_sharegpt_chat_run_without_oversampling(serve, word_tokenizer, tmp_path):
    convs = [[_words(4 + i, 7 * i), _words(4 + 2 * i)] for i in range(5)] + [[_words(2), _words(9)]]
    path = _write_sharegpt(tmp_path / "sg.json", convs)
    server = serve()
    cfg = _cfg(
        server,
        word_tokenizer,
        backend="openai-chat",
        dataset_name="sharegpt",
        dataset_path=str(path),
        num_prompts=8,
        no_oversample=True,
    )
    result = asyncio.run(run_benchmark(cfg))
    assert result.metrics.num_completed == 5  # 5 usable conversations, sent once each
    sent = {b["messages"][0]["content"]: b["max_tokens"] for b in server.bodies[1:]}
    assert sent == {_words(4 + i, 7 * i): 4 + 2 * i for i in range(5)}
    assert server.bodies[-1]["messages"][0]["role"] == "user"
    assert result.metrics.total_input_tokens == sum(4 + i for i in range(5))
    doc = result.to_dict()
    assert doc["dataset"] == {
        "name": "sharegpt",
        "seed": 0,
        "path": str(path),
        "oversample": False,
        "shuffle": True,
        "output_len": None,
    }
    assert doc["config"]["dataset_path"] == str(path)


def test_custom_dataset_lengths_and_chat_template(word_tokenizer, tmp_path):
    path = _write_jsonl(
        tmp_path / "c.jsonl",
        [
            {"prompt": _words(3), "output_tokens": 5},
            "",
            {"prompt": _words(2, 9)},
            {"prompt": _words(1, 50), "note": "extra fields are ignored"},
        ],
    )
    cfg = BenchServeConfig(
        tokenizer=str(word_tokenizer),
        dataset_name="custom",
        dataset_path=str(path),
        num_prompts=3,
        custom_output_len=7,
        skip_chat_template=True,
    )
    reqs = build_requests(cfg)
    assert {r.prompt: (r.prompt_len, r.output_len) for r in reqs} == {
        _words(3): (3, 5),
        _words(2, 9): (2, 7),
        _words(1, 50): (1, 7),
    }
    assert [r.prompt for r in build_requests(cfg)] == [r.prompt for r in reqs]
    assert len(build_requests(cfg, 7)) == 7
    # vLLM wraps custom prompts in the chat template for the completions API unless told not to.
    demo = Path(nibble.__file__).parent / "assets" / "demo_tokenizer"
    templated = build_requests(dataclasses.replace(cfg, tokenizer=str(demo), skip_chat_template=False))
    demo_tok = load_tokenizer(demo)
    for r in templated:
        assert r.prompt.startswith("<|im_start|>user\n") and "<|im_start|>assistant" in r.prompt
        assert r.prompt_len == len(demo_tok.encode(r.prompt).ids)
    # A chat endpoint templates the messages itself.
    chat = build_requests(
        dataclasses.replace(cfg, tokenizer=str(demo), skip_chat_template=False, backend="openai-chat")
    )
    assert {r.prompt for r in chat} == {_words(3), _words(2, 9), _words(1, 50)}
    with pytest.raises(BenchError, match=r"has none.*--skip-chat-template"):
        build_requests(dataclasses.replace(cfg, skip_chat_template=False))


def test_prefix_repetition_groups_and_seeds(word_tokenizer):
    tok = load_tokenizer(word_tokenizer)
    for as_ids in (False, True):
        reqs = sample_prefix_repetition_requests(tok, 10, 6, 4, 3, 5, seed=2, as_token_ids=as_ids)
        seqs = [r.prompt if as_ids else tok.encode(r.prompt, add_special_tokens=False).ids for r in reqs]
        assert all(len(s) == 10 for s in seqs) and {(r.prompt_len, r.output_len) for r in reqs} == {(10, 5)}
        groups = collections.Counter(tuple(s[:6]) for s in seqs)
        assert sorted(groups.values()) == [3, 3, 4]  # 10 prompts spread over 3 prefixes
        assert len({tuple(s) for s in seqs}) == 10
    same = sample_prefix_repetition_requests(tok, 10, 6, 4, 3, 5, seed=2)
    assert same == sample_prefix_repetition_requests(tok, 10, 6, 4, 3, 5, seed=2)
    other = sample_prefix_repetition_requests(tok, 10, 6, 4, 3, 5, seed=3)
    assert {r.prompt for r in other}.isdisjoint(r.prompt for r in same)
    shared = sample_random_requests(tok, 5, 8, 3, range_ratio=0.5, prefix_len=4, seed=1)
    assert len({tuple(r.prompt.split()[:4]) for r in shared}) == 1
    assert all(len(r.prompt.split()) == r.prompt_len and 8 <= r.prompt_len <= 16 for r in shared)


def test_shared_prefixes_encode_identically_with_qwen(qwen_tokenizer):
    """Byte-level BPE can merge across the prefix/suffix boundary; a server's prefix cache needs equal ids."""
    tok = qwen_tokenizer
    reqs = sample_prefix_repetition_requests(tok, 7, 48, 16, 3, 4, seed=5)
    seqs = [tok.encode(r.prompt, add_special_tokens=False).ids for r in reqs]
    assert all(len(s) == 64 for s in seqs) and len({tuple(s[:48]) for s in seqs}) == 3
    shared = sample_random_requests(tok, 4, 8, 4, prefix_len=24, seed=5)
    seqs = [tok.encode(r.prompt, add_special_tokens=False).ids for r in shared]
    assert all(len(s) == r.prompt_len == 32 for s, r in zip(seqs, shared)) and len({tuple(s[:24]) for s in seqs}) == 1


def test_cli_prefix_repetition_run(serve, word_tokenizer, tmp_path, capsys):
    server = serve(itl_s=0.001)
    argv = [
        "--base-url",
        server.base_url,
        "--tokenizer",
        str(word_tokenizer),
        "--dataset-name",
        "prefix_repetition",
        "--prefix-repetition-prefix-len",
        "6",
        "--prefix-repetition-suffix-len",
        "4",
        "--prefix-repetition-num-prefixes",
        "2",
        "--prefix-repetition-output-len",
        "3",
        "--num-prompts",
        "6",
        "--max-concurrency",
        "2",
        "--disable-tqdm",
        "--result-dir",
        str(tmp_path),
        "--result-filename",
        "pr.json",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "Dataset: prefix_repetition 2 prefixes x 6 tokens + 4-token suffixes, 3 out" in out
    doc = json.loads((tmp_path / "pr.json").read_text())
    assert (doc["completed"], doc["total_input_tokens"], doc["total_output_tokens"]) == (6, 60, 18)
    assert doc["dataset"] == {
        "name": "prefix_repetition",
        "seed": 0,
        "prefix_len": 6,
        "suffix_len": 4,
        "num_prefixes": 2,
        "output_len": 3,
        "shuffle": True,
    }
    prompts = [b["prompt"].split() for b in server.bodies[1:]]
    assert sorted(collections.Counter(tuple(p[:6]) for p in prompts).values()) == [3, 3]
    assert len({tuple(p) for p in prompts}) == 6 and all(b["max_tokens"] == 3 for b in server.bodies[1:])


def _bad_files(tmp_path: Path) -> dict[str, Path]:
    bad_json = tmp_path / "bad.json"
    bad_json.write_text('[\n  {"conversations": [\n    {"from": "human", "value": "hi"},,\n  ]}\n]\n')
    return {
        "bad_json": bad_json,
        "not_list": _write_jsonl(tmp_path / "obj.json", [{"conversations": []}]),
        "no_value": _write_sharegpt(
            tmp_path / "nv.json", [[_words(5), _words(5)], {"conversations": [{"value": "a"}, {"from": "gpt"}]}]
        ),
        "too_short": _write_sharegpt(tmp_path / "short.json", [[_words(2), _words(9)], [_words(9), _words(1)]]),
        "no_turns": _write_sharegpt(tmp_path / "flat.json", [{"prompt": "hi"}]),
        "jsonl_bad": _write_jsonl(tmp_path / "b.jsonl", [{"prompt": "a"}, '{"prompt": "b"']),
        "jsonl_no_prompt": _write_jsonl(tmp_path / "np.jsonl", [{"prompt": "a"}, "", {"text": "b"}]),
        "jsonl_bad_out": _write_jsonl(tmp_path / "bo.jsonl", [{"prompt": "a", "output_tokens": 0}]),
        "jsonl_ok": _write_jsonl(tmp_path / "ok.jsonl", [{"prompt": "a"}]),
    }


@pytest.mark.parametrize(
    ("argv", "rc", "message"),
    [
        (["--dataset-name", "sharegpt"], 2, "the sharegpt dataset reads a file: pass --dataset-path"),
        (
            ["--dataset-name", "custom", "--dataset-path", "{tmp}/missing.jsonl"],
            2,
            "{tmp}/missing.jsonl does not exist",
        ),
        (["--dataset-path", "{jsonl_ok}"], 2, "the random dataset is generated and reads no file"),
        (["--dataset-name", "prefix_repetition", "--num-prompts", "3"], 2, "must be >= the number of prefixes (10)"),
        (
            ["--dataset-name", "sharegpt", "--dataset-path", "{bad_json}"],
            1,
            "{bad_json}: invalid JSON at line 3 column",
        ),
        (["--dataset-name", "sharegpt", "--dataset-path", "{not_list}"], 1, "expected a JSON list of conversations"),
        (
            ["--dataset-name", "sharegpt", "--dataset-path", "{no_value}"],
            1,
            'entry 1: conversations[1] has no string "value"',
        ),
        (["--dataset-name", "sharegpt", "--dataset-path", "{too_short}"], 1, "no usable conversations: none of its 2"),
        (
            ["--dataset-name", "sharegpt", "--dataset-path", "{no_turns}"],
            1,
            'no usable conversations: none of its 1 entries has a "conversations"',
        ),
        (["--dataset-name", "custom", "--dataset-path", "{jsonl_bad}"], 1, "{jsonl_bad}: line 2: invalid JSON"),
        (["--dataset-name", "custom", "--dataset-path", "{jsonl_no_prompt}"], 1, 'line 3: no string "prompt" field'),
        (
            ["--dataset-name", "custom", "--dataset-path", "{jsonl_bad_out}"],
            1,
            '"output_tokens" must be an integer >= 1',
        ),
        (["--dataset-name", "custom", "--dataset-path", "{jsonl_ok}"], 1, "--skip-chat-template"),
    ],
)
def test_cli_dataset_errors(word_tokenizer, tmp_path, capsys, argv, rc, message):
    names = {k: str(v) for k, v in _bad_files(tmp_path).items()} | {"tmp": str(tmp_path)}
    argv = [a.format(**names) for a in argv]
    assert main(["--port", str(_free_port()), "--tokenizer", str(word_tokenizer), "--disable-tqdm", *argv]) == rc
    err = capsys.readouterr().err
    assert err.startswith("error:") and message.format(**names) in err, err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_prefix_repetition_against_nibble_reports_cache_hits(tmp_path, capsys):
    """A real nibble server (the demo model on the CPU) serves prefix_repetition's shared prefixes from its
    prefix cache, and the bench reports the hit tokens from the responses' usage."""
    from nibble.engine.async_engine import AsyncEngine
    from nibble.engine.config import EngineConfig
    from tests.helpers.server import start_server

    engine = AsyncEngine.from_config(EngineConfig(model="demo", device="cpu", max_model_len=512, max_num_seqs=4))
    handle = start_server(engine)
    try:
        tokenizer = Path(nibble.__file__).parent / "assets" / "demo_tokenizer"
        argv = ["--base-url", handle.url, "--tokenizer", str(tokenizer),
                "--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", "320",
                "--prefix-repetition-suffix-len", "8", "--prefix-repetition-num-prefixes", "2",
                "--prefix-repetition-output-len", "2", "--num-prompts", "6", "--max-concurrency", "1",
                "--disable-tqdm", "--result-dir", str(tmp_path), "--result-filename", "nibble.json"]
        assert main(argv) == 0
    finally:
        handle.stop()
        engine.shutdown()
    doc = json.loads((tmp_path / "nibble.json").read_text())
    assert doc["completed"] == 6 and doc["failed"] == 0
    # the cache was reset after the test request, so the hits are the pass's own: one request at a time, the
    # second prompt of a group finds the shared prefix (nibble caches prefixes of 256 tokens or more) and
    # computes it once more, the third starts from it
    assert doc["config"]["reset_prefix_cache"] is True
    assert 2 * 320 <= doc["total_cached_tokens"] < 6 * 320, doc["total_cached_tokens"]
    out = capsys.readouterr().out
    assert "Prefix-cache hit tokens:" in out and "was not reset" not in out


def test_prefix_cache_reset_before_each_pass(serve, word_tokenizer, capsys):
    """A server without /reset_prefix_cache gets one note; --keep-prefix-cache sends no reset at all."""
    server = serve()
    asyncio.run(run_sweep(_cfg(server, word_tokenizer, num_prompts=2), [1, 2]))
    assert capsys.readouterr().out.count("prefix cache was not reset before the pass (unsupported)") == 1
    asyncio.run(run_sweep(_cfg(server, word_tokenizer, num_prompts=2, reset_prefix_cache=False), [1, 2]))
    assert "was not reset" not in capsys.readouterr().out
