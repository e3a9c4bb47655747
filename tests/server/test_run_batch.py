"""`nibble run-batch`: OpenAI batch files answered through the server's own app, in order, concurrently, with the
HTTP server's bodies and errors; malformed lines named by line number; the CLI end to end."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import httpx
import pytest

from nibble.cli import main
from nibble.engine.async_engine import AsyncEngine
from nibble.server.run_batch import BatchSummary, run_batch

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
GREEDY = {"temperature": 0.0, "seed": 0, "max_tokens": 6, "ignore_eos": True}


def line(custom_id: str, url: str, body: dict[str, Any], **extra: Any) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body, **extra})


def chat_body(text: str) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": text}], **GREEDY}


def batch(engine: AsyncEngine, lines: list[str], **kwargs: Any) -> tuple[list[str], BatchSummary]:
    """Run the batch file made of `lines`; returns its output lines (text) and summary."""
    out: list[bytes] = []
    summary = asyncio.run(run_batch(engine, "\n".join(lines).encode(), out.append, **kwargs))
    assert all(o.endswith(b"\n") and o.count(b"\n") == 1 for o in out)
    return [o.decode() for o in out], summary


def raw_body(output_line: str) -> str:
    """The body of an output line as the text it holds (spliced in, not re-serialized)."""
    head, tail = '"body": ', '}, "error": null}\n'
    assert output_line.endswith(tail)
    return output_line[output_line.index(head) + len(head): -len(tail)]


def normalized(text: str, ids: list[str]) -> str:
    for i in ids:
        text = text.replace(i, "ID")
    return re.sub(r'"created":\d+', '"created":0', text)


def test_outputs_in_order_match_the_http_server(engine: AsyncEngine, http: httpx.Client) -> None:
    """Mixed chat and completions lines: one output line each, in input order, status 200, and a body that is
    byte for byte the HTTP server's for the same request (its id and created time aside)."""
    requests = [("c1", CHAT, chat_body("Hello there")), ("p1", COMPLETIONS, {"prompt": "Once upon", **GREEDY}),
                ("c2", CHAT, chat_body("Name a colour")), ("p2", COMPLETIONS, {"prompt": ["A", "B b"], **GREEDY})]
    out, summary = batch(engine, [line(*r) for r in requests])
    assert (summary.ok, summary.failed, summary.output_tokens) == (4, 0, 6 * 5)
    assert [json.loads(o)["custom_id"] for o in out] == [r[0] for r in requests]
    for (_, url, body), text in zip(requests, out):
        result = json.loads(text)
        assert result["id"].startswith("batch_req_") and result["error"] is None
        response = result["response"]
        assert response["status_code"] == 200
        assert response["request_id"] == response["body"]["id"]
        direct = http.post(url, json=body)
        assert direct.status_code == 200
        assert normalized(raw_body(text), [response["request_id"]]) == \
            normalized(direct.text, [direct.json()["id"]])


def test_request_errors_are_the_servers(engine: AsyncEngine, http: httpx.Client) -> None:
    """A body the server refuses keeps the server's status and error body, OpenAI's or (on /v1/messages)
    Anthropic's shape; the other lines still run."""
    bad = [(COMPLETIONS, {"prompt": "x", "max_tokens": -1}), (CHAT, {"messages": "not a list"}),
           (CHAT, {**chat_body("hi"), "model": "no-such-model"}), ("/v1/messages", {"messages": []})]
    lines = [line(f"bad{i}", url, body) for i, (url, body) in enumerate(bad)]
    out, summary = batch(engine, [*lines, line("ok", COMPLETIONS, {"prompt": "fine", **GREEDY})])
    assert (summary.ok, summary.failed) == (1, 4)
    for (url, body), text in zip(bad, out):
        response = json.loads(text)["response"]
        direct = http.post(url, json=body)
        assert direct.status_code in (400, 404)
        assert (response["status_code"], response["body"]) == (direct.status_code, direct.json())
    assert json.loads(out[0])["response"]["body"]["error"]["message"] == \
        "max_tokens: Input should be greater than or equal to 1 (got -1)"
    assert json.loads(out[3])["response"]["body"]["type"] == "error"  # Anthropic's error shape
    assert json.loads(out[4])["response"]["status_code"] == 200


def test_malformed_lines_are_named(engine: AsyncEngine) -> None:
    """Every line that is no request gets an output line with response null and an error naming its line
    number; blank lines are skipped (but counted in line numbers); nothing else is dropped."""
    ok = chat_body("hi")
    lines = ["not json", "[1, 2]", json.dumps({"url": CHAT, "body": ok}), "",
             json.dumps({"custom_id": "no-url", "body": ok}), line("emb", "/v1/embeddings", {"input": "x"}),
             line("get", CHAT, ok, method="GET"), json.dumps({"custom_id": "no-body", "url": CHAT}),
             line("stream", CHAT, {**ok, "stream": True}), line("first", CHAT, ok), line("first", COMPLETIONS, ok),
             '{"custom_id": "bytes", "body": "\xff"}']
    data = "\n".join(lines).encode().replace("\xff".encode(), b"\xff") + b"\n\n"
    out: list[bytes] = []
    summary = asyncio.run(run_batch(engine, data, out.append))
    results = [json.loads(o) for o in out]
    assert len(results) == len(lines) - 1 and (summary.ok, summary.failed) == (1, 10)
    expected = [(1, "invalid_json", None), (2, "invalid_request", None), (3, "missing_custom_id", None),
                (5, "missing_url", "no-url"), (6, "unsupported_url", "emb"), (7, "unsupported_method", "get"),
                (8, "missing_body", "no-body"), (9, "stream_not_supported", "stream"), None,
                (11, "duplicate_custom_id", "first"), (12, "invalid_json", None)]
    for want, result in zip(expected, results):
        if want is None:
            assert result["response"]["status_code"] == 200 and result["custom_id"] == "first"
            continue
        number, code, custom_id = want
        assert result["response"] is None and result["custom_id"] == custom_id
        assert result["error"]["code"] == code
        assert result["error"]["message"].startswith(f"line {number}: ")
    assert "already used on line 10" in results[9]["error"]["message"]
    assert "stream: true" in results[7]["error"]["message"]


def test_stream_spelled_otherwise_is_refused_too(engine: AsyncEngine) -> None:
    """The server would take "true" and 1 for true and stream; the batch refuses them like true."""
    data = "".join(line(f"s{i}", CHAT, {**chat_body("hi"), "stream": v}) + "\n" for i, v in enumerate(("true", 1)))
    out: list[bytes] = []
    asyncio.run(run_batch(engine, data.encode(), out.append))
    assert [json.loads(o)["error"]["code"] for o in out] == ["stream_not_supported"] * 2


def test_requests_run_concurrently(engine: AsyncEngine) -> None:
    """The lines share engine steps (continuous batching): far fewer steps than tokens; one at a time, at
    least a step per token."""
    lines = [line(f"r{i}", COMPLETIONS, {"prompt": f"Story {i}:", **GREEDY, "max_tokens": 8}) for i in range(6)]

    def steps_per_token(**kwargs: Any) -> float:
        before = engine.stats()
        _, summary = batch(engine, lines, **kwargs)
        after = engine.stats()
        assert summary.ok == 6 and summary.output_tokens == 48
        assert after["num_generated_tokens"] - before["num_generated_tokens"] == 48
        return (after["num_steps"] - before["num_steps"]) / 48

    assert steps_per_token() < 0.5
    assert steps_per_token(max_concurrency=1) >= 1


def test_cli_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`nibble run-batch -i IN -o OUT` with serve's engine flags: exit 0 though a line failed, the results in
    OUT in input order (the served name in the bodies), a summary on stderr."""
    src, dst = tmp_path / "requests.jsonl", tmp_path / "results.jsonl"
    src.write_text("\n".join([line("a", CHAT, chat_body("Hi")), "oops",
                              line("b", COMPLETIONS, {"prompt": "Hey", **GREEDY})]) + "\n")
    code = main(["run-batch", "-i", str(src), "-o", str(dst), "--device", "cpu", "--max-model-len", "512",
                 "--max-num-seqs", "4", "--served-model-name", "batch-model", "--log-level", "warning"])
    err = capsys.readouterr().err
    assert code == 0
    results = [json.loads(x) for x in dst.read_text().splitlines()]
    assert [r["custom_id"] for r in results] == ["a", None, "b"]
    assert [r["response"]["body"]["model"] for r in (results[0], results[2])] == ["batch-model"] * 2
    assert results[1]["error"]["code"] == "invalid_json"
    assert "3 requests: 2 ok, 1 failed" in err and "12 output tokens" in err and "tokens/s" in err
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_cli_file_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An unreadable input or an unwritable output is exit 2 with one line naming the file, before any engine
    starts; an existing output is left as it was."""
    missing = tmp_path / "nope.jsonl"
    code = main(["run-batch", "-i", str(missing), "-o", str(tmp_path / "out.jsonl")])
    err = capsys.readouterr().err
    assert code == 2 and f"error: cannot read the input file {missing}" in err and "Traceback" not in err
    assert not (tmp_path / "out.jsonl").exists()
    src = tmp_path / "in.jsonl"
    src.write_text(line("a", CHAT, chat_body("Hi")) + "\n")
    for out in (tmp_path / "no-dir" / "out.jsonl", tmp_path):
        code = main(["run-batch", "-i", str(src), "-o", str(out)])
        err = capsys.readouterr().err
        assert code == 2 and f"error: cannot write the output file {out}" in err


def test_cli_output_failing_mid_run(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A write that fails while the batch runs (a full disk, a closed pipe) is exit 2 naming the file, no
    traceback, and an existing output is left as it was."""
    import errno

    from nibble.server import run_batch as module

    def full(self, line: bytes) -> None:  # type: ignore[no-untyped-def]
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(module.OutputFile, "write", full)
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(line("a", COMPLETIONS, {"prompt": "Hey", **GREEDY}) + "\n")
    dst.write_text("old results\n")
    code = main(["run-batch", "-i", str(src), "-o", str(dst), "--device", "cpu", "--max-model-len", "256",
                 "--log-level", "warning"])
    err = capsys.readouterr().err
    assert code == 2 and f"error: cannot write the output file {dst}: No space left on device" in err
    assert "Traceback" not in err and dst.read_text() == "old results\n"
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_full_queue_is_waited_out(model_kwargs: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """A request the engine refuses because its queue is full (the HTTP server's 503) is sent again once the
    queue drains: a batch has no client to retry it."""
    from nibble.server import run_batch as module

    from .conftest import make_engine

    calls: list[str] = []
    real = module.call_app

    async def counting(app: Any, path: str, body: bytes) -> tuple[int, dict[str, str], bytes]:
        calls.append(path)
        return await real(app, path, body)

    monkeypatch.setattr(module, "call_app", counting)
    monkeypatch.setattr(module, "OVERLOAD_PAUSE_S", 0.01)
    engine = make_engine(model_kwargs, max_num_seqs=1, max_waiting_requests=1)
    try:
        lines = [line(f"r{i}", COMPLETIONS, {"prompt": f"Item {i}", **GREEDY}) for i in range(4)]
        out, summary = batch(engine, lines, max_concurrency=4)
    finally:
        engine.shutdown()
    assert (summary.ok, summary.failed) == (4, 0)
    assert [json.loads(o)["custom_id"] for o in out] == ["r0", "r1", "r2", "r3"]
    assert len(calls) > 4  # some were refused and sent again
