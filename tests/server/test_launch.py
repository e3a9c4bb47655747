"""`nibble serve` command-line handling: flags -> EngineConfig, one-line errors, a real server process."""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from nibble.engine.config import EngineConfig, EngineConfigError
from nibble.server.launch import add_cli_args, cors_settings, engine_config_kwargs, run_cli


def parse(*argv: str) -> argparse.Namespace:
    return add_cli_args(argparse.ArgumentParser()).parse_args(list(argv))


def test_defaults_are_engine_defaults() -> None:
    args = parse()
    assert EngineConfig(**engine_config_kwargs(args)) == EngineConfig(model="demo")
    assert (args.host, args.port, args.served_model_name) == ("0.0.0.0", 8000, None)


def test_flags_map_to_engine_config() -> None:
    args = parse("--model", "/m", "--tokenizer", "/t", "--served-model-name", "qwen", "--device", "cpu",
                 "--dtype", "bfloat16", "--kv-cache-dtype", "fp8_e4m3", "--load-format", "dummy",
                 "--max-model-len", "4096", "--max-num-seqs", "32", "--max-num-batched-tokens", "2048",
                 "--gpu-memory-utilization", "0.8", "--block-size", "32", "--enforce-eager", "--seed", "7",
                 "--moe-backend", "triton", "--attention-backend", "torch", "--linear-backend", "triton",
                 "--max-waiting-requests", "10", "--kv-cache-memory-gb", "2", "--log-level", "DEBUG",
                 "--no-async-scheduling", "--no-warmup", "--generation-config", "vllm",
                 "--override-generation-config", '{"temperature": 0.3}', "--scheduling-policy", "priority")
    config = EngineConfig(**engine_config_kwargs(args))
    expected = {"model": "/m", "tokenizer": "/t", "served_model_name": "qwen", "device": "cpu", "dtype": "bfloat16",
                "kv_cache_dtype": "fp8_e4m3", "load_format": "dummy", "max_model_len": 4096, "max_num_seqs": 32,
                "max_num_batched_tokens": 2048, "gpu_memory_utilization": 0.8, "block_size": 32,
                "enforce_eager": True, "seed": 7, "moe_backend": "triton", "attention_backend": "torch",
                "linear_backend": "triton", "max_waiting_requests": 10, "kv_cache_memory_gb": 2.0,
                "async_scheduling": False, "warmup": False, "generation_config": "vllm",
                "override_generation_config": {"temperature": 0.3}, "scheduling_policy": "priority"}
    assert {k: getattr(config, k) for k in expected} == expected
    assert args.log_level == "debug"


def test_media_flags(tmp_path: Path) -> None:
    """vLLM's --allowed-media-domains (several hosts) and --allowed-local-media-path, and the fetch limits, reach
    EngineConfig's media policy; unset, any host is fetched and file:// refused."""
    args = parse("--allowed-media-domains", "images.example", "CDN.example", "--allowed-local-media-path",
                 str(tmp_path), "--media-fetch-timeout", "2.5", "--max-media-bytes", "1000")
    policy = EngineConfig(**engine_config_kwargs(args)).media_policy
    assert (policy.allowed_domains, policy.allowed_local_path, policy.timeout_s, policy.max_bytes) == (
        ("images.example", "CDN.example"), str(tmp_path), 2.5, 1000)
    default = EngineConfig(**engine_config_kwargs(parse())).media_policy
    assert (default.allowed_domains, default.allowed_local_path, default.timeout_s, default.max_bytes) == (
        None, None, 10.0, 20 * 2**20)


def test_limit_mm_per_prompt_flag() -> None:
    config = EngineConfig(**engine_config_kwargs(parse("--limit-mm-per-prompt", '{"image": 2, "video": 0}')))
    assert (config.mm_limit("image"), config.mm_limit("video"), config.vision_enabled) == (2, 0, True)
    text_only = EngineConfig(**engine_config_kwargs(parse("--limit-mm-per-prompt", '{"image": 0, "video": 0}')))
    assert not text_only.vision_enabled
    assert EngineConfig(**engine_config_kwargs(parse())).mm_limit("image") is None
    for bad, match in (({"audio": 1}, "keys among image, video"), ({"image": -1}, "integers >= 0"),
                       ({"image": True}, "integers >= 0")):
        with pytest.raises(EngineConfigError, match=match):
            EngineConfig(model="demo", limit_mm_per_prompt=bad)


def test_api_key_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NIBBLE_API_KEY", "sk-env")
    assert parse().api_key == "sk-env"
    assert parse("--api-key", "sk-flag").api_key == "sk-flag"


def test_bad_choice_is_an_argparse_error(capsys: pytest.CaptureFixture[str]) -> None:
    for bad in (["--kv-cache-dtype", "int4"], ["--scheduling-policy", "lifo"]):
        with pytest.raises(SystemExit) as info:
            parse(*bad)
        assert info.value.code == 2
    assert "'fcfs', 'priority'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        parse("--override-generation-config", "[1]")
    assert info.value.code == 2 and "takes a JSON object" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "needle"), [
    (["--model", "/no/such/dir"], "does not exist"),
    (["--model", "{empty}"], "config.json"),
    (["--block-size", "3"], "--block-size"),
    (["--max-num-seqs", "0"], "--max-num-seqs"),
    (["--tensor-parallel-size", "0"], "--tensor-parallel-size"),
    (["--port", "{busy}"], "cannot listen"),
    (["--chat-template", "/no/such/template.jinja"], "--chat-template"),
    (["--chat-template", "{% if %}"], "--chat-template"),
    (["--max-stored-responses", "-1"], "--max-stored-responses"),
    (["--generation-config", "/no/such/dir"], "--generation-config"),
    (["--override-generation-config", '{"temp": 1}'], "--override-generation-config"),
    (["--allowed-local-media-path", "/no/such/dir"], "--allowed-local-media-path"),
    (["--media-fetch-timeout", "0"], "--media-fetch-timeout"),
    (["--max-media-bytes", "0"], "--max-media-bytes"),
])
def test_startup_errors_are_one_line(argv: list[str], needle: str, tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    subst = {"{empty}": str(tmp_path), "{busy}": str(busy.getsockname()[1])}
    argv = [subst.get(a, a) for a in argv]
    try:
        code = run_cli(parse("--host", "127.0.0.1", "--port", "0", "--device", "cpu", *argv))
    finally:
        busy.close()
    err = capsys.readouterr().err.strip()
    assert code != 0
    assert needle in err and "Traceback" not in err
    assert len(err.splitlines()) == 1, err


def test_a_vllm_command_line_is_accepted(capsys: pytest.CaptureFixture[str]) -> None:
    """The flags vLLM needs for Qwen3.5's tool calls and reasoning (what nibble always does), and its CORS and
    chat-template flags, parse; unknown parser names are argparse errors naming the choices."""
    args = parse("--model", "/m", "--enable-auto-tool-choice", "--tool-call-parser", "qwen3_coder",
                 "--reasoning-parser", "qwen3", "--trust-remote-code", "--disable-log-requests",
                 "--allowed-origins", '["https://app.example"]', "--allowed-credentials", "--chat-template", "t.jinja")
    assert EngineConfig(**engine_config_kwargs(args)).chat_template == "t.jinja"
    assert cors_settings(args) == {"allow_origins": ["https://app.example"], "allow_methods": ["*"],
                                   "allow_headers": ["*"], "allow_credentials": True}
    for bad in (["--tool-call-parser", "hermes"], ["--reasoning-parser", "granite"],
                ["--allowed-origins", "https://app.example"]):
        with pytest.raises(SystemExit) as info:
            parse(*bad)
        assert info.value.code == 2
    assert "qwen3_coder" in capsys.readouterr().err


def test_chat_template_and_cors(tmp_path: Path) -> None:
    """--chat-template replaces the model's template (a file here); CORS answers a browser's preflight."""
    from nibble.engine.async_engine import AsyncEngine
    from tests.helpers.server import start_server

    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}", encoding="utf-8")
    engine = AsyncEngine.from_config(EngineConfig(model="demo", device="cpu", max_model_len=256,
                                                  chat_template=str(template)))
    handle = start_server(engine, cors=cors_settings(parse("--allowed-origins", '["https://app.example"]')))
    try:
        tok = engine.engine.tokenizer
        assert tok is not None
        r = httpx.post(handle.url + "/tokenize", json={"messages": [{"role": "user", "content": "hi there"}]})
        assert r.status_code == 200 and r.json()["tokens"] == tok.encode("<<hi there>>", add_special_tokens=False)
        pre = httpx.options(handle.url + "/v1/chat/completions",
                            headers={"Origin": "https://app.example", "Access-Control-Request-Method": "POST"})
        assert pre.status_code == 200
        assert pre.headers["access-control-allow-origin"] == "https://app.example"
        other = httpx.options(handle.url + "/v1/chat/completions",
                              headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
        assert "access-control-allow-origin" not in other.headers
    finally:
        handle.stop()
        engine.shutdown()
    inline = AsyncEngine.from_config(EngineConfig(model="demo", device="cpu", max_model_len=256,
                                                  chat_template="{{ messages[0]['content'] }}!"))
    try:
        assert inline.engine.tokenizer is not None
        assert inline.engine.tokenizer.apply_chat_template([{"role": "user", "content": "x"}]) == "x!"
    finally:
        inline.shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _serve_process(args: list[str], url: str, verify: ssl.SSLContext | bool = True,
                   env: dict[str, str] | None = None) -> Iterator[list[str]]:
    """`nibble serve ARGS` in a subprocess, polled on `url`/health until it answers (90 s at most); yields a list
    that holds the process's whole output once it stopped (SIGINT), after the block. Its exit code must be 0."""
    proc = subprocess.Popen([sys.executable, "-m", "nibble.cli", "serve", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    output: list[str] = []
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            try:
                if httpx.get(url + "/health", verify=verify, timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.2)
        yield output
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        output.append(out)
    assert proc.returncode == 0, out


def test_serve_process_end_to_end(model_kwargs: dict[str, Any]) -> None:
    port = _free_port()
    args = ["--model", model_kwargs["model"], "--device", "cpu", "--host", "127.0.0.1", "--port", str(port),
            "--max-model-len", "512", "--max-num-seqs", "4", "--served-model-name", "tiny", "--api-key", "sk-test",
            "--max-stored-responses", "0"]
    url = f"http://127.0.0.1:{port}"
    with _serve_process(args, url, env={**os.environ, "NIBBLE_API_KEY": ""}) as output:
        headers = {"Authorization": "Bearer sk-test"}
        r = httpx.post(url + "/v1/completions", headers=headers, timeout=30,
                       json={"model": "tiny", "prompt": "hi", "max_tokens": 3, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        assert httpx.get(url + "/v1/models", headers=headers).json()["data"][0]["id"] == "tiny"
        r = httpx.post(url + "/v1/responses", headers=headers, timeout=30,
                       json={"model": "tiny", "input": "hi", "max_output_tokens": 3, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["output_tokens"] == 3 and r.json()["store"] is False
        assert httpx.get(url + f"/v1/responses/{r.json()['id']}", headers=headers).status_code == 404
    assert "cmpl-" in output[0] and "completion 3 tokens" in output[0]


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")
def test_https(tmp_path: Path) -> None:
    """--ssl-keyfile/--ssl-certfile serve HTTPS (plain HTTP is refused); a key without its certificate or a
    certificate that is not one is a one-line start-up error before the engine starts."""
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "2", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    port = _free_port()
    args = ["--device", "cpu", "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "256",
            "--ssl-keyfile", str(key), "--ssl-certfile", str(cert), "--root-path", "/nb"]
    url = f"https://127.0.0.1:{port}"
    trust = ssl.create_default_context(cafile=str(cert))
    with _serve_process(args, url, verify=trust) as output:
        assert httpx.get(url + "/v1/models", verify=trust).json()["data"][0]["id"] == "demo"
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
    assert f"listening on https://127.0.0.1:{port}/nb" in output[0]
    for argv, needle in ((["--ssl-keyfile", str(key)], "go together"),
                         (["--ssl-keyfile", str(key), "--ssl-certfile", str(key)], "cannot be used for HTTPS"),
                         (["--ssl-keyfile", str(key), "--ssl-certfile", str(tmp_path / "none.pem")], "no such file")):
        done = subprocess.run([sys.executable, "-m", "nibble.cli", "serve", "--device", "cpu", "--port", "0", *argv],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 1 and needle in done.stderr and len(done.stderr.strip().splitlines()) == 1, \
            done.stderr
