"""vLLM's command line for Qwen3.5 on `nibble serve`: the flags of vLLM's recipe and of the NVFP4 model cards
parse and do what they say (or are refused with a clear error), and --default-chat-template-kwargs and
--max-logprobs reach every endpoint."""

from __future__ import annotations

import argparse
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from nibble.checkpoint.demo import resolve_model_path
from nibble.cli import build_parser, engine_config_from_args
from nibble.engine.async_engine import AsyncEngine
from nibble.engine.config import EngineConfig, EngineConfigError
from nibble.engine.sampling_params import SamplingParams, SamplingParamsError
from nibble.models.config import ModelConfig
from nibble.models.quant_config import QuantConfigError, check_quantization
from nibble.server.compat_args import log_compat_notes
from nibble.server.launch import add_cli_args, app_settings, engine_config_kwargs, run_cli
from nibble.server.reasoning import THINK_END, THINK_START

from .conftest import ServerHandle, make_engine, start_server
from .test_launch import _free_port, _serve_process

USER = [{"role": "user", "content": "Name a colour."}]
NO_THINK_PROMPT_END = f"{THINK_START}\n\n{THINK_END}\n\n"


def parse(*argv: str) -> argparse.Namespace:
    return add_cli_args(argparse.ArgumentParser()).parse_args(list(argv))


def config_of(*argv: str) -> EngineConfig:
    return EngineConfig(**engine_config_kwargs(parse(*argv)))


def run_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """run_cli's one-line start-up error for `argv` (on the CPU, a free port)."""
    code = run_cli(parse("--host", "127.0.0.1", "--port", "0", "--device", "cpu", *argv))
    err = capsys.readouterr().err.strip()
    assert code != 0 and "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


def test_recipe_and_model_card_command_lines_parse() -> None:
    """The flags of vLLM's Qwen3.5 recipe and of the NVFP4 model cards (-tp beside --tensor-parallel-size,
    -dp 1, --max-cudagraph-capture-size for --cuda-graph-max-batch-size), with the no-ops, become the same
    EngineConfig as nibble's own flags."""
    config = config_of("--model", "/m", "-dp", "1", "-pp", "1", "--enable-expert-parallel", "--language-model-only",
                       "--reasoning-parser", "qwen3", "--enable-prefix-caching", "--quantization", "modelopt_fp4",
                       "--tensor-parallel-size", "8", "-tp", "4", "--kv-cache-dtype", "fp8",
                       "--mm-encoder-tp-mode", "data", "--max-num-seqs", "64", "--speculative-config",
                       '{"method": "qwen3_next_mtp", "num_speculative_tokens": 2}', "--enable-chunked-prefill",
                       "--async-scheduling", "--disable-custom-all-reduce", "--enable-log-requests",
                       "--uvicorn-log-level", "warning", "--disable-uvicorn-access-log", "--mm-processor-cache-gb",
                       "4", "--max-cudagraph-capture-size", "128", "--max-logprobs", "8", "-q", "nvfp4")
    expected = {"model": "/m", "tensor_parallel_size": 4, "enable_expert_parallel": True, "enable_prefix_caching": True,
                "quantization": "nvfp4", "kv_cache_dtype": "fp8", "max_num_seqs": 64, "num_speculative_tokens": 2,
                "async_scheduling": True, "cuda_graph_max_batch_size": 128, "max_logprobs": 8,
                "limit_mm_per_prompt": {"image": 0, "video": 0}}
    assert {k: getattr(config, k) for k in expected} == expected
    assert not config.vision_enabled
    # the no-ops change nothing else
    assert config_of("--enable-chunked-prefill", "--disable-custom-all-reduce", "--enable-log-requests",
                     "--mm-processor-cache-gb", "2", "--mm-encoder-tp-mode", "weights", "--async-scheduling",
                     "--disable-uvicorn-access-log") == EngineConfig(model="demo")
    assert config_of("--cuda-graph-max-batch-size", "32").cuda_graph_max_batch_size == 32


def test_unsupported_flags_and_values_are_argparse_errors(capsys: pytest.CaptureFixture[str]) -> None:
    for bad in (["-pp", "2"], ["--data-parallel-size", "4"], ["--mm-encoder-tp-mode", "shard"],
                ["--no-enable-chunked-prefill"], ["--pipeline-parallel-size", "two"], ["--uvicorn-log-level", "x"],
                ["--distributed-executor-backend", "ray"]):
        with pytest.raises(SystemExit) as info:
            parse(*bad)
        assert info.value.code == 2, bad
    err = capsys.readouterr().err
    assert "--pipeline-parallel-size 2 is not supported" in err and "--data-parallel-size 4 is not supported" in err
    assert "use --tensor-parallel-size with --enable-expert-parallel" in err


def test_language_model_only(capsys: pytest.CaptureFixture[str]) -> None:
    """--language-model-only is --limit-mm-per-prompt '{"image": 0, "video": 0}'; a limit that allows images or
    videos beside it is a one-line start-up error naming both flags."""
    assert config_of("--language-model-only").limit_mm_per_prompt == {"image": 0, "video": 0}
    assert config_of("--language-model-only", "--limit-mm-per-prompt", '{"image": 0}').limit_mm_per_prompt == {
        "image": 0, "video": 0}
    with pytest.raises(EngineConfigError, match="--language-model-only serves text only"):
        engine_config_kwargs(parse("--language-model-only", "--limit-mm-per-prompt", '{"image": 2, "video": 0}'))
    err = run_error(capsys, "--language-model-only", "--limit-mm-per-prompt", '{"video": 1}')
    assert "--language-model-only" in err and "--limit-mm-per-prompt allows {'video': 1}" in err
    generate = build_parser(["generate"]).parse_args(["generate", "--language-model-only", "-q", "modelopt"])
    config = engine_config_from_args(generate)
    assert not config.vision_enabled and config.quantization == "modelopt"


def test_hf_overrides(capsys: pytest.CaptureFixture[str]) -> None:
    """--hf-overrides (serve, generate, bench latency) takes a JSON object into EngineConfig.hf_overrides; bad JSON
    or another JSON value is an argparse error naming the flag. On the demo model (max_position_embeddings 32768)
    a longer --max-model-len is a start-up error naming both lengths, and with YaRN overrides one past
    original_max_position_embeddings x factor is."""
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    text = json.dumps({"text_config": {"rope_parameters": rope}})
    assert config_of("--hf-overrides", text).hf_overrides == {"text_config": {"rope_parameters": rope}}
    for command in (["generate"], ["bench", "latency"]):
        args = build_parser(command).parse_args([*command, "--hf-overrides", text])
        assert engine_config_from_args(args).hf_overrides == {"text_config": {"rope_parameters": rope}}
    assert engine_config_from_args(build_parser(["generate"]).parse_args(["generate"])).hf_overrides is None
    for bad in ("{'rope_type': 'yarn'}", "[1, 2]"):
        with pytest.raises(SystemExit):
            parse("--hf-overrides", bad)
        with pytest.raises(SystemExit):
            build_parser(["generate"]).parse_args(["generate", "--hf-overrides", bad])
    err = capsys.readouterr().err
    assert "argument --hf-overrides: --hf-overrides is not valid JSON" in err
    assert "argument --hf-overrides: --hf-overrides takes a JSON object" in err
    with pytest.raises(EngineConfigError, match="--hf-overrides must be a JSON object"):
        EngineConfig(model="demo", hf_overrides=[1])  # type: ignore[arg-type]
    err = run_error(capsys, "--max-model-len", "40000")
    assert "--max-model-len 40000 exceeds the model's max_position_embeddings 32768" in err
    err = run_error(capsys, "--hf-overrides", text, "--max-model-len", "140000")
    assert "--max-model-len 140000 exceeds the model's context length 131072" in err


def test_quantization_is_checked_against_the_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """-q names vLLM's method; the demo checkpoint is ModelOpt NVFP4, so modelopt_fp4 / modelopt / nvfp4 (any
    case) and none pass; another method, or an NVFP4 flag on an unquantized checkpoint, fails at start-up with
    the flag and what the checkpoint holds."""
    demo = resolve_model_path("demo")
    quant = ModelConfig.from_pretrained(demo).quant
    assert quant is not None
    for method in ("modelopt_fp4", "MODELOPT", "nvfp4", "none", None):
        check_quantization(EngineConfig(model="demo", quantization=method).quantization, quant, demo)
    assert EngineConfig(model="demo", quantization="None").quantization is None
    for method in ("fp8", "awq", "gptq"):
        with pytest.raises(QuantConfigError, match=f"--quantization {method}: .*holds ModelOpt NVFP4 weights"):
            check_quantization(method, quant, demo)
    err = run_error(capsys, "--quantization", "fp8")
    assert "--quantization fp8" in err and "holds ModelOpt NVFP4 weights" in err
    # a BF16 checkpoint: the demo's config.json without its quantization config, random weights
    raw = json.loads((demo / "config.json").read_text())
    raw.pop("quantization_config")
    (tmp_path / "config.json").write_text(json.dumps(raw))
    err = run_error(capsys, "--model", str(tmp_path), "--load-format", "dummy", "-q", "modelopt_fp4")
    assert "--quantization modelopt_fp4" in err and "holds unquantized weights" in err


def test_mm_encoder_tp_mode_is_logged_under_tensor_parallelism(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("nibble.server.test")
    with caplog.at_level(logging.INFO, logger=logger.name):
        log_compat_notes(parse("--mm-encoder-tp-mode", "data"), logger)
        assert not caplog.records
        log_compat_notes(parse("--mm-encoder-tp-mode", "data", "-tp", "2"), logger)
    assert "runs the vision tower unsharded on tensor-parallel rank 0" in caplog.text


def test_max_logprobs_setting() -> None:
    assert EngineConfig(model="demo").max_logprobs == 20
    assert config_of("--max-logprobs", "-1").max_logprobs == -1
    with pytest.raises(EngineConfigError, match="--max-logprobs"):
        EngineConfig(model="demo", max_logprobs=-2)


def test_engine_caps_logprobs(engine: AsyncEngine) -> None:
    """The offline path too: the engine refuses logprobs above --max-logprobs (default 20)."""
    core = engine.engine
    assert core.max_logprobs == 20
    for field in ("logprobs", "prompt_logprobs"):
        with pytest.raises(SamplingParamsError, match=f"{field} must be at most 20"):
            core.check_logprobs(SamplingParams(**{field: 21}))
    core.check_logprobs(SamplingParams(logprobs=20, prompt_logprobs=20))


@pytest.fixture(scope="module")
def uncapped() -> Iterator[ServerHandle]:
    """A server whose engine has --max-logprobs -1 (up to the vocabulary size)."""
    eng = make_engine({"model": "demo"}, max_logprobs=-1)
    handle = start_server(eng)
    yield handle
    handle.stop()
    eng.shutdown()


def test_max_logprobs_caps_every_endpoint(server: ServerHandle, uncapped: ServerHandle) -> None:
    """Above the cap, each endpoint answers 400 naming its own field; --max-logprobs -1 lifts the default 20 up
    to the vocabulary size."""
    vocab = uncapped.engine.engine.model_config.vocab_size
    chat = {"messages": USER, "max_tokens": 2, "logprobs": True}
    cases = [("/v1/chat/completions", {**chat, "top_logprobs": "N"}, "top_logprobs"),
             ("/v1/chat/completions", {"messages": USER, "max_tokens": 2, "prompt_logprobs": "N"}, "prompt_logprobs"),
             ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "logprobs": "N"}, "logprobs"),
             ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "prompt_logprobs": "N"}, "prompt_logprobs"),
             ("/v1/responses", {"input": "hi", "max_output_tokens": 2, "top_logprobs": "N"}, "top_logprobs")]
    for path, body, field in cases:
        for handle, n, status in ((server, 21, 400), (uncapped, 25, 200), (uncapped, vocab + 1, 400)):
            r = httpx.post(handle.url + path, json={k: n if v == "N" else v for k, v in body.items()}, timeout=60)
            assert r.status_code == status, (path, field, n, r.text)
            if status == 400:
                error = r.json()["error"]
                assert error["param"] == field and f"{field} must be at most" in error["message"], error
                assert "--max-logprobs" in error["message"]
    out = httpx.post(uncapped.url + "/v1/chat/completions", json={**chat, "top_logprobs": 25}, timeout=60).json()
    assert len(out["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 25


@pytest.fixture(scope="module")
def no_think(engine: AsyncEngine) -> Iterator[ServerHandle]:
    """The shared engine behind a server started with --default-chat-template-kwargs '{"enable_thinking": false}'."""
    handle = start_server(engine, default_chat_template_kwargs={"enable_thinking": False})
    yield handle
    handle.stop()


def _post(handle: ServerHandle, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(handle.url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_default_chat_template_kwargs(no_think: ServerHandle) -> None:
    """The server default turns thinking off on every chat endpoint; a request's own setting (its
    chat_template_kwargs, or the endpoint's thinking field) wins."""
    tok = no_think.engine.engine.tokenizer
    assert tok is not None

    def rendered(**kwargs: Any) -> str:
        ids = _post(no_think, "/tokenize", {"messages": USER, **kwargs})["tokens"]
        return tok.decode(ids, skip_special_tokens=False)

    assert rendered().endswith(NO_THINK_PROMPT_END)
    assert rendered(chat_template_kwargs={"enable_thinking": True}).endswith(f"{THINK_START}\n")
    gen = {"temperature": 0.0, "ignore_eos": True}
    chat = {"messages": USER, "max_tokens": 6, **gen}
    plain = _post(no_think, "/v1/chat/completions", chat)["choices"][0]["message"]
    assert plain["content"] and not plain.get("reasoning_content")
    for override in ({"chat_template_kwargs": {"enable_thinking": True}}, {"enable_thinking": True}):
        thinking = _post(no_think, "/v1/chat/completions", {**chat, **override})["choices"][0]["message"]
        assert thinking["reasoning_content"], override
    response = {"input": "Name a colour.", "max_output_tokens": 6, **gen}
    assert [o["type"] for o in _post(no_think, "/v1/responses", response)["output"]] == ["message"]
    thought = _post(no_think, "/v1/responses", {**response, "chat_template_kwargs": {"enable_thinking": True}})
    assert thought["output"][0]["type"] == "reasoning"
    message = {"model": no_think.model, "messages": USER, "max_tokens": 6, **gen}
    assert [b["type"] for b in _post(no_think, "/v1/messages", message)["content"]] == ["text"]
    enabled = _post(no_think, "/v1/messages", {**message, "thinking": {"type": "enabled", "budget_tokens": 64}})
    assert enabled["content"][0]["type"] == "thinking"


def test_default_chat_template_kwargs_errors(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse("--default-chat-template-kwargs", "enable_thinking=false")
    assert "takes a JSON object" in capsys.readouterr().err
    err = run_error(capsys, "--default-chat-template-kwargs", '{"tools": []}')
    assert err.startswith("nibble serve: error: --default-chat-template-kwargs: 'tools' cannot be set")


def test_vllm_command_line_end_to_end() -> None:
    """`nibble serve` with a vLLM command line: it serves, the template default and the logprobs cap apply, and
    --uvicorn-log-level warning silences uvicorn's INFO lines (nibble's own stay)."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    args = ["--model", "demo", "--device", "cpu", "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "256",
            "-tp", "1", "-dp", "1", "--language-model-only", "--reasoning-parser", "qwen3", "--enable-prefix-caching",
            "-q", "modelopt_fp4", "--mm-encoder-tp-mode", "data", "--enable-chunked-prefill", "--async-scheduling",
            "--disable-custom-all-reduce", "--enable-log-requests", "--uvicorn-log-level", "warning",
            "--disable-uvicorn-access-log", "--mm-processor-cache-gb", "0", "--max-cudagraph-capture-size", "8",
            "--max-logprobs", "5", "--default-chat-template-kwargs", '{"enable_thinking": false}']
    with _serve_process(args, url, env={**os.environ, "NIBBLE_API_KEY": ""}) as output:
        ids = httpx.post(url + "/tokenize", json={"messages": USER}, timeout=30).json()["tokens"]
        text = httpx.post(url + "/detokenize", json={"tokens": ids}, timeout=30).json()["prompt"]
        assert text.endswith(NO_THINK_PROMPT_END)
        r = httpx.post(url + "/v1/chat/completions", timeout=30,
                       json={"messages": USER, "max_tokens": 2, "logprobs": True, "top_logprobs": 6})
        assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"
    assert f"listening on {url}" in output[0] and "Application startup complete" not in output[0]


def test_several_served_model_names(engine: AsyncEngine) -> None:
    """vLLM's `--served-model-name A B`: every name is listed and accepted, responses carry the first; /ping
    answers as /health does."""
    args = parse("--served-model-name", "qwen35", "Qwen/Qwen3.5-122B-A10B")
    assert config_of("--served-model-name", "qwen35", "Qwen/Qwen3.5-122B-A10B").served_model_name == "qwen35"
    assert app_settings(args)["served_model_aliases"] == ("Qwen/Qwen3.5-122B-A10B",)
    handle = start_server(engine, served_model_name="qwen35", served_model_aliases=("Qwen/Qwen3.5-122B-A10B",))
    try:
        listed = httpx.get(handle.url + "/v1/models").json()["data"]
        assert [m["id"] for m in listed] == ["qwen35", "Qwen/Qwen3.5-122B-A10B"]
        assert httpx.get(handle.url + "/v1/models/Qwen/Qwen3.5-122B-A10B").json()["id"] == "Qwen/Qwen3.5-122B-A10B"
        out = _post(handle, "/v1/completions", {"model": "Qwen/Qwen3.5-122B-A10B", "prompt": "hi", "max_tokens": 2})
        assert out["model"] == "qwen35"
        r = httpx.post(handle.url + "/v1/completions", json={"model": "other", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 404
        assert httpx.get(handle.url + "/ping").status_code == httpx.post(handle.url + "/ping").status_code == 200
    finally:
        handle.stop()


def test_force_include_usage(engine: AsyncEngine) -> None:
    """--enable-force-include-usage: a stream that does not ask for usage still ends with a usage chunk."""
    assert app_settings(parse("--enable-force-include-usage"))["force_include_usage"] is True
    assert "force_include_usage" not in app_settings(parse("--enable-prompt-tokens-details"))
    handle = start_server(engine, force_include_usage=True)
    try:
        for path, body in (("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", {"messages": USER})):
            body = {**body, "max_tokens": 3, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", handle.url + path, json=body, timeout=60) as r:
                chunks = [json.loads(line[6:]) for line in r.iter_lines()
                          if line.startswith("data: ") and line != "data: [DONE]"]
            assert chunks[-1]["usage"]["completion_tokens"] == 3, path
            assert all(c.get("usage") is None for c in chunks[:-1]), path
    finally:
        handle.stop()


def test_reasoning_config(capsys: pytest.CaptureFixture[str]) -> None:
    """vLLM's --reasoning-config (which its thinking_token_budget needs): Qwen3.5's markers are accepted, others
    are an error naming the key."""
    markers = '{"reasoning_start_str": "<think>", "reasoning_end_str": "</think>"}'
    assert parse("--reasoning-config", markers).reasoning_config == json.loads(markers)
    assert config_of("--reasoning-config", markers) == EngineConfig(model="demo")
    with_parser = '{"reasoning_parser": "qwen3"}'
    assert parse("--reasoning-config", with_parser).reasoning_config == {"reasoning_parser": "qwen3"}
    for bad, message in (('{"reasoning_end_str": "</reason>"}', "reasoning_end_str"), ("[1]", "JSON object"),
                         ('{"think": 1}', "unknown keys"), ("{", "JSON object"),
                         ('{"reasoning_parser": "gpt_oss"}', "reasoning_parser")):
        with pytest.raises(SystemExit):
            parse("--reasoning-config", bad)
        assert message in capsys.readouterr().err
