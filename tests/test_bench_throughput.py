"""`nibble bench throughput` end to end through `nibble.cli.main` on the demo model (CPU).

What the engine was sent is recorded by wrapping `LLMEngine.add_request`, so the report's counts are checked
against the requests themselves rather than against the bench's own arithmetic: prompt tokens = the lengths of
the prompts added, output tokens = num_prompts x output_len (every request with ignore_eos and max_tokens =
its output length), rates = counts / elapsed_time; the warm-up is added before the clock starts.
"""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch

from nibble.bench import throughput
from nibble.bench.throughput import WARMUP_ID_PREFIX
from nibble.checkpoint.demo import DEMO_DIR
from nibble.cli import main
from nibble.engine.llm_engine import LLMEngine
from nibble.engine.tokenizer import Tokenizer

BASE = ["bench", "throughput", "--device", "cpu", "--max-model-len", "256", "--max-num-seqs", "16", "--disable-tqdm"]


class Sent:
    """The requests the engine was given: (request id, prompt ids, max_tokens, ignore_eos), bench and warm-up."""

    def __init__(self) -> None:
        self.all: list[tuple[str, list[int], int | None, bool]] = []

    @property
    def bench(self) -> list[tuple[str, list[int], int | None, bool]]:
        return [s for s in self.all if not s[0].startswith(WARMUP_ID_PREFIX)]


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> Sent:
    record = Sent()
    add = LLMEngine.add_request

    def spy(self, request_id, prompt, params=None, **kw):
        record.all.append((request_id, list(prompt), params.max_tokens, params.ignore_eos))
        return add(self, request_id, prompt, params, **kw)

    monkeypatch.setattr(LLMEngine, "add_request", spy)
    return record


def run(tmp_path: Path, *flags: str) -> tuple[int, dict]:
    out = tmp_path / "tput.json"
    rc = main([*BASE, "--output-json", str(out), *flags])
    return rc, json.loads(out.read_text()) if out.exists() else {}


def check_rates(doc: dict) -> None:
    t = doc["elapsed_time"]
    assert t > 0
    assert doc["total_num_tokens"] == doc["total_prompt_tokens"] + doc["total_output_tokens"]
    assert doc["requests_per_second"] == pytest.approx(doc["num_requests"] / t)
    assert doc["tokens_per_second"] == pytest.approx(doc["total_num_tokens"] / t)
    assert doc["output_tokens_per_second"] == pytest.approx(doc["total_output_tokens"] / t)


def test_random_counts_rates_and_report(tmp_path: Path, sent: Sent, capsys: pytest.CaptureFixture) -> None:
    rc, doc = run(tmp_path, "--num-prompts", "4", "--input-len", "16", "--output-len", "3", "--seed", "3")
    assert rc == 0
    bench = sent.bench
    assert len(bench) == 4 and all(len(p) == 16 and mt == 3 and eos for _, p, mt, eos in bench)
    assert doc["num_requests"] == 4
    assert doc["total_prompt_tokens"] == sum(len(p) for _, p, _, _ in bench) == 4 * 16
    assert doc["total_output_tokens"] == 4 * 3
    check_rates(doc)
    assert doc["dataset"] == {"name": "random", "seed": 3, "input_len": 16, "output_len": 3, "range_ratio": 0.0,
                              "prefix_len": 0}
    assert doc["engine_config"]["device"] == "cpu" and doc["engine_config"]["max_model_len"] == 256
    assert doc["engine_config"]["max_num_seqs"] == 16 and doc["engine_config"]["seed"] == 3
    assert doc["device"] == "cpu" and doc["gpu_name"] is None
    assert doc["torch_version"] == torch.__version__ and doc["triton_version"]
    assert isinstance(doc["argv"], list) and doc["args"]["num_prompts"] == 4
    printed = capsys.readouterr().out
    assert f"{doc['requests_per_second']:.2f} requests/s" in printed
    assert "Total num prompt tokens:  64" in printed and "Total num output tokens:  12" in printed


def test_parallel_sampling_counts_every_sequence(tmp_path: Path, sent: Sent) -> None:
    rc, doc = run(tmp_path, "--num-prompts", "2", "--n", "3", "--input-len", "8", "--output-len", "2")
    assert rc == 0
    bench = sent.bench
    assert len(bench) == 6 and len({tuple(p) for _, p, _, _ in bench}) == 2  # one engine request per sequence
    assert doc["num_requests"] == 2
    assert doc["total_prompt_tokens"] == 2 * 8 and doc["total_output_tokens"] == 2 * 3 * 2
    check_rates(doc)


def test_random_lengths_and_prefix_are_counted_as_sent(tmp_path: Path, sent: Sent) -> None:
    rc, doc = run(tmp_path, "--num-prompts", "4", "--input-len", "12", "--output-len", "4",
                  "--random-range-ratio", "0.5", "--prefix-len", "4")
    assert rc == 0
    bench = sent.bench
    lens = [len(p) for _, p, _, _ in bench]
    assert len(bench) == 4 and all(4 + 6 <= n <= 4 + 18 for n in lens) and len(set(lens)) > 1
    assert len({tuple(p[:4]) for _, p, _, _ in bench}) == 1  # the shared prefix
    assert all(2 <= mt <= 6 and eos for _, _, mt, eos in bench)
    assert doc["total_prompt_tokens"] == sum(lens)
    assert doc["total_output_tokens"] == sum(mt for _, _, mt, _ in bench)
    check_rates(doc)


def test_warm_up_runs_before_the_clock(tmp_path: Path, sent: Sent, monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[str] = []
    clock = throughput.time.perf_counter

    def perf_counter() -> float:
        events.append("clock")
        return clock()

    monkeypatch.setattr(throughput, "time", types.SimpleNamespace(perf_counter=perf_counter))
    add = LLMEngine.add_request

    def tagged(self, request_id, *a, **kw):
        events.append("warmup" if request_id.startswith(WARMUP_ID_PREFIX) else "bench")
        return add(self, request_id, *a, **kw)

    monkeypatch.setattr(LLMEngine, "add_request", tagged)
    rc, doc = run(tmp_path, "--num-prompts", "2", "--input-len", "8", "--output-len", "2")
    assert rc == 0 and doc["total_output_tokens"] == 4
    first_clock = events.index("clock")
    assert events[:first_clock] == ["warmup"] * throughput.WARMUP_PROMPTS
    assert events[first_clock + 1:] == ["bench"] * 2 + ["clock"]


def _write_sharegpt(path: Path, pairs: list[tuple[str, str]]) -> Path:
    convs = [{"id": str(i), "conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]}
             for i, (q, a) in enumerate(pairs)]
    convs.append({"id": "lonely", "conversations": [{"from": "human", "value": "no reply here"}]})
    path.write_text(json.dumps(convs))
    return path


SHAREGPT = [  # replies of 7, 10 and 7 demo tokens
    ("What is the capital of France?", "Paris, of course."),
    ("Tell me about a dragon.", "It learned to fly."),
    ("How do I sort a list?", "Call sorted on it."),
]


@pytest.mark.parametrize("fixed_output", [None, 2])
def test_sharegpt_file(tmp_path: Path, sent: Sent, fixed_output: int | None) -> None:
    tok = Tokenizer.from_pretrained(DEMO_DIR)
    replies = {tuple(tok.encode(q)): len(tok.encode(a)) for q, a in SHAREGPT}
    path = _write_sharegpt(tmp_path / "sg.json", SHAREGPT)
    flags = ["--dataset-path", str(path), "--num-prompts", "4"]  # sharegpt without --dataset-name, as vLLM
    if fixed_output is not None:
        flags += ["--output-len", str(fixed_output)]
    rc, doc = run(tmp_path, *flags)
    assert rc == 0
    bench = sent.bench
    assert len(bench) == 4 and all(tuple(p) in replies for _, p, _, _ in bench)  # 3 conversations, one repeated
    expected_out = [fixed_output or replies[tuple(p)] for _, p, _, _ in bench]
    assert [mt for _, _, mt, _ in bench] == expected_out
    assert doc["dataset"]["name"] == "sharegpt" and doc["num_requests"] == 4
    assert doc["total_prompt_tokens"] == sum(len(p) for _, p, _, _ in bench)
    assert doc["total_output_tokens"] == sum(expected_out)
    check_rates(doc)


@pytest.mark.parametrize("skip_template", [False, True])
def test_custom_file(tmp_path: Path, sent: Sent, skip_template: bool) -> None:
    tok = Tokenizer.from_pretrained(DEMO_DIR)
    lines = [{"prompt": "Write a haiku about the sea.", "output_tokens": 2}, {"prompt": "List three primes."}]
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    flags = ["--dataset-name", "custom", "--dataset-path", str(path), "--num-prompts", "2", "--output-len", "3"]
    rc, doc = run(tmp_path, *flags, *(["--skip-chat-template"] if skip_template else []))
    assert rc == 0

    def sent_as(text: str) -> list[int]:
        if not skip_template:
            text = tok.apply_chat_template([{"role": "user", "content": text}])
        return tok.encode(text)

    expected = {tuple(sent_as(line["prompt"])): line.get("output_tokens", 3) for line in lines}
    bench = sent.bench
    assert {tuple(p): mt for _, p, mt, _ in bench} == expected
    assert doc["total_prompt_tokens"] == sum(len(p) for p in expected)
    assert doc["total_output_tokens"] == 2 + 3
    assert doc["dataset"]["chat_template"] is not skip_template
    check_rates(doc)


def test_prefix_repetition(tmp_path: Path, sent: Sent) -> None:
    rc, doc = run(tmp_path, "--dataset-name", "prefix_repetition", "--num-prompts", "4",
                  "--prefix-repetition-prefix-len", "8", "--prefix-repetition-suffix-len", "4",
                  "--prefix-repetition-num-prefixes", "2", "--output-len", "2")
    assert rc == 0
    bench = sent.bench
    assert len(bench) == 4 and all(len(p) == 12 and mt == 2 for _, p, mt, _ in bench)
    assert len({tuple(p[:8]) for _, p, _, _ in bench}) == 2
    assert doc["total_prompt_tokens"] == 4 * 12 and doc["total_output_tokens"] == 4 * 2
    check_rates(doc)


def test_token_count_mismatch_is_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture) -> None:
    add = LLMEngine.add_request

    def short(self, request_id, prompt, params=None, **kw):
        if not request_id.startswith(WARMUP_ID_PREFIX):
            params.max_tokens -= 1  # an engine that stops one token early
        return add(self, request_id, prompt, params, **kw)

    monkeypatch.setattr(LLMEngine, "add_request", short)
    rc, doc = run(tmp_path, "--num-prompts", "2", "--input-len", "8", "--output-len", "3")
    err = capsys.readouterr().err
    assert rc == 1 and doc == {}
    assert "error: the engine did not generate the requested token counts" in err
    assert "request 0: 8 prompt / 2 output tokens, expected 8 / 3" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("flags, message", [
    (["--input-len", "0"], "--input-len must be >= 1, got 0"),
    (["--output-len", "-2"], "--output-len must be >= 1, got -2"),
    (["--num-prompts", "0"], "--num-prompts must be >= 1"),
    (["--n", "0"], "--n must be >= 1, got 0"),
    (["--random-range-ratio", "1.5"], "--random-range-ratio must be in [0, 1)"),
    (["--dataset-name", "sharegpt"], "the sharegpt dataset reads a file: pass --dataset-path"),
    (["--dataset-path", "/nonexistent/sg.json"], "dataset file /nonexistent/sg.json does not exist"),
    (["--dataset-name", "random", "--dataset-path", "{tmp}/bad.jsonl"], "--dataset-path: the random dataset"),
    (["--dataset-name", "custom", "--dataset-path", "{tmp}/bad.jsonl"], "bad.jsonl: line 2: no string \"prompt\""),
    (["--dataset-path", "{tmp}/bad.jsonl"], "bad.jsonl: invalid JSON"),
    (["--input-len", "250", "--output-len", "10"],
     "a request needs 250 prompt + 10 output = 260 tokens, more than the max model len 256 (--max-model-len)"),
    (["--max-model-len", "100000"], "--max-model-len 100000 exceeds the model's max_position_embeddings"),
    (["--model", "/nonexistent/model"], "model directory '/nonexistent/model' does not exist"),
    (["--tokenizer", "{tmp}"], "no tokenizer.json at"),
    (["--output-json", "/nonexistent/dir/out.json"], "--output-json: directory /nonexistent/dir does not exist"),
    (["--dataset-name", "prefix_repetition", "--num-prompts", "3"], "--num-prompts (3) must be >= "
                                                                     "--prefix-repetition-num-prefixes (10)"),
])
def test_bad_input_exits_2_before_loading(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture, flags: list[str], message: str) -> None:
    (tmp_path / "bad.jsonl").write_text('{"prompt": "fine"}\n{"text": "no prompt"}\n')

    def no_engine(self, config):
        raise AssertionError("the model must not load for bad input")

    monkeypatch.setattr(LLMEngine, "__init__", no_engine)
    rc = main([*BASE, *[f.replace("{tmp}", str(tmp_path)) for f in flags]])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith("error: ") and message in err, err
    assert "Traceback" not in err


def test_help_lists_vllm_and_engine_flags(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench", "throughput", "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--num-prompts", "--input-len", "--output-len", "--dataset-name", "--dataset-path",
                 "--random-range-ratio", "--random-prefix-len", "--output-json", "--max-num-seqs", "--seed",
                 "--load-format", "--enforce-eager"):
        assert flag in text
