"""The `vllm bench serve` flags of `nibble bench serve`: --goodput, --percentile-metrics / --metric-percentiles,
the sampling fields, --ramp-up-strategy and --tokenizer, against the stand-in server of test_bench_serve.py."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest

from nibble.bench.arrivals import arrival_offsets, ramp_up_rates
from nibble.bench.metrics import RequestOutput, compute_metrics, format_metrics, format_sweep
from nibble.bench.serve import BenchServeConfig, main, run_benchmark
from nibble.cli import build_parser
from tests.test_bench_serve import StandInServer, stand_in_servers, write_word_tokenizer

SAMPLING_FIELDS = ("top_p", "top_k", "min_p", "repetition_penalty")


stand_in = pytest.fixture(stand_in_servers, name="stand_in")


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    """A directory holding the word-level tokenizer.json (the form --tokenizer takes from vLLM users)."""
    directory = tmp_path_factory.mktemp("tok")
    write_word_tokenizer(directory)
    return directory


def _argv(server: StandInServer, tok_dir: Path, *extra: str) -> list[str]:
    return ["--base-url", server.base_url, "--tokenizer", str(tok_dir), "--num-prompts", "4",
            "--random-input-len", "6", "--random-output-len", "4", "--disable-tqdm", *extra]


def _output(ttft: float, latency: float, tokens: int, success: bool = True) -> RequestOutput:
    return RequestOutput(success=success, prompt_len=5, output_tokens=tokens, ttft=ttft, latency=latency)


def test_goodput_counts_requests_within_every_objective():
    outputs = [
        _output(0.125, 1.0, 8),  # TPOT 125 ms
        _output(0.5, 1.0, 11),  # TPOT 50 ms
        _output(0.05, 0.05, 1),  # one token: no decode phase, so no TPOT to miss
        _output(0.0, 0.0, 0, success=False),  # failed requests never count
    ]
    cases = [
        ({"ttft": 125}, 2),  # an objective met exactly counts
        ({"ttft": 600, "tpot": 80}, 2),
        ({"tpot": 200, "e2el": 500}, 1),
        ({"e2el": 1000}, 3),
    ]
    for slo, good in cases:
        m = compute_metrics(outputs, 2.0, [50.0], goodput=slo)
        assert m.request_goodput == pytest.approx(good / 2.0), slo
        assert m.to_flat_dict()["request_goodput"] == m.request_goodput
        assert "Request goodput (req/s):" in format_metrics(m)
        assert "good/s" in format_sweep([(1, m)])
    m = compute_metrics(outputs, 2.0, [50.0])
    assert m.request_goodput is None and m.to_flat_dict()["request_goodput"] is None
    assert "goodput" not in format_metrics(m) and "good/s" not in format_sweep([(1, m)])


def test_goodput_from_the_bench_s_own_timings(stand_in, tok_dir, tmp_path, capsys):
    # requests 2..9 are the pass (1 is the test request); 3, 6 and 9 wait 0.4 s for their first token
    server = stand_in(ttft_for=lambda n: 0.4 if n % 3 == 0 else 0.0)
    argv = _argv(server, tok_dir, "--num-prompts", "8", "--goodput", "ttft:200", "e2el:5000", "--save-detailed",
                 "--result-dir", str(tmp_path), "--result-filename", "run.json")
    assert main(argv) == 0
    doc = json.loads((tmp_path / "run.json").read_text())
    # goodput is counted from the per-request timings the bench recorded, and those follow the schedule
    good = sum(ttft <= 0.2 and latency <= 5.0 for ttft, latency in zip(doc["ttfts"], doc["latencies"]))
    assert good == 5 and doc["completed"] == 8
    assert doc["request_goodput"] == pytest.approx(good / doc["duration"])
    assert doc["request_goodput"] < doc["request_throughput"]
    assert doc["config"]["goodput"] == {"ttft": 200.0, "e2el": 5000.0}
    assert "Request goodput (req/s):" in capsys.readouterr().out


def test_percentile_metrics_select_the_reported_keys(stand_in, tok_dir, tmp_path, capsys):
    server = stand_in()
    argv = _argv(server, tok_dir, "--percentile-metrics", "e2el,ttft", "--metric-percentiles", "50,95",
                 "--result-dir", str(tmp_path), "--result-filename", "run.json")
    assert main(argv) == 0
    doc = json.loads((tmp_path / "run.json").read_text())
    for name in ("ttft", "e2el"):
        for stat in ("mean", "median", "std", "p50", "p95"):
            assert f"{stat}_{name}_ms" in doc
    assert not [k for k in doc if k.endswith(("_tpot_ms", "_itl_ms")) or k.startswith("p99_")]
    assert doc["config"]["percentile_metrics"] == ["e2el", "ttft"] and doc["config"]["percentiles"] == [50, 95]
    out = capsys.readouterr().out
    assert "Mean TTFT (ms):" in out and "P95 E2EL (ms):" in out
    assert "TPOT (ms)" not in out.split("Serving Benchmark Result")[1] and "ITL" not in out
    # the default reports all four, with the keys nibble has always written
    assert main([*_argv(server, tok_dir), "--result-dir", str(tmp_path), "--result-filename", "all.json"]) == 0
    doc = json.loads((tmp_path / "all.json").read_text())
    assert all(f"{s}_{n}_ms" in doc for s in ("mean", "median", "std", "p50", "p90", "p99")
               for n in ("ttft", "tpot", "itl", "e2el"))


def test_percentiles_is_an_alias_of_metric_percentiles():
    for flag in ("--percentiles", "--metric-percentiles"):
        argv = ["bench", "serve", flag, "25,75"]
        assert build_parser(argv).parse_args(argv).metric_percentiles == "25,75"


def test_plot_leaves_out_unselected_metrics(tmp_path):
    from nibble.bench.plot import plot_sweep

    rows = [{"max_concurrency": c, "output_throughput": 10.0 * c, "median_tpot_ms": 5.0, "p99_tpot_ms": 7.0}
            for c in (1, 2)]
    path = plot_sweep({"run": rows}, tmp_path / "sweep.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sampling_flags_reach_request_bodies(stand_in, tok_dir):
    server = stand_in()
    flags = ["--temperature", "0.7", "--top-p", "0.9", "--top-k", "20", "--min-p", "0.05",
             "--repetition-penalty", "1.1"]
    assert main(_argv(server, tok_dir, *flags)) == 0
    expected = {"temperature": 0.7, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1}
    assert len(server.bodies) == 5  # the test request and the pass carry them alike
    assert all({k: b[k] for k in expected} == expected for b in server.bodies)

    server.bodies.clear()
    assert main(_argv(server, tok_dir, "--backend", "openai-chat", "--top-k", "20",
                      "--extra-body", '{"top_k": 5}')) == 0
    assert all(b["top_k"] == 5 and "messages" in b for b in server.bodies)  # --extra-body has the last word

    server.bodies.clear()
    assert main(_argv(server, tok_dir)) == 0
    assert all(b["temperature"] == 0.0 and not set(SAMPLING_FIELDS) & set(b) for b in server.bodies)


def test_ramp_up_rates_follow_the_strategy():
    linear = ramp_up_rates("linear", 2.0, 20.0, 10)
    assert linear[0] == 2.0 and linear[-1] == 20.0 and np.allclose(np.diff(linear), 2.0)
    exponential = ramp_up_rates("exponential", 1.0, 16.0, 5)
    assert np.allclose(exponential, [1.0, 2.0, 4.0, 8.0, 16.0])


@pytest.mark.parametrize(("strategy", "start", "end"), [("linear", 1.0, 50.0), ("exponential", 2.0, 50.0)])
def test_ramp_up_gaps_follow_the_rate_at_each_point(strategy, start, end):
    num = 4000
    rates = ramp_up_rates(strategy, start, end, num)
    offsets = arrival_offsets(num, float("inf"), 1.0, seed=7, ramp_up=(strategy, start, end))
    assert offsets[0] == 0.0 and np.all(np.diff(offsets) >= 0)
    # Poisson gaps: in each tenth of the requests the mean gap is the mean of 1/rate there (400 gaps each,
    # so about 5% noise)
    gaps, expected = np.diff(offsets), 1.0 / rates[1:]
    for block in np.array_split(np.arange(num - 1), 10):
        assert gaps[block].mean() == pytest.approx(expected[block].mean(), rel=0.2)
    # the fixed-rate path is unchanged: mean gap 1/rate
    assert np.diff(arrival_offsets(num, 25.0, 1.0, seed=7)).mean() == pytest.approx(1 / 25.0, rel=0.1)
    assert not arrival_offsets(5, float("inf"), 1.0, seed=7).any()
    # a linear ramp may start at 0 requests/s: the first request goes out at once, the rate of the next is > 0
    assert np.isfinite(arrival_offsets(5, float("inf"), 1.0, seed=7, ramp_up=("linear", 0.0, 4.0))).all()


def test_ramp_up_send_times_follow_the_schedule(stand_in, tok_dir):
    server = stand_in()
    ramp = ("linear", 2.0, 20.0)
    cfg = BenchServeConfig(base_url=server.base_url, tokenizer=str(tok_dir), num_prompts=10, random_input_len=6,
                           random_output_len=2, disable_tqdm=True, burstiness=100.0, ramp_up_strategy=ramp[0],
                           ramp_up_start_rps=ramp[1], ramp_up_end_rps=ramp[2])
    result = asyncio.run(run_benchmark(cfg))
    sent = np.array([o.start_time for o in result.outputs])
    sent -= sent[0]
    # burstiness 100: gaps within ~10% of 1/rate, 250 ms at first down to 50 ms; a send may be late (a busy
    # event loop) but never early
    expected = arrival_offsets(10, cfg.request_rate, 100.0, cfg.seed, ramp)
    assert np.all(sent >= expected - 0.05) and np.all(sent <= expected + 0.3), (sent, expected)
    assert np.allclose(np.diff(expected), 1 / ramp_up_rates(*ramp, 10)[1:], rtol=0.35)
    doc = result.to_dict()
    assert (doc["ramp_up_strategy"], doc["ramp_up_start_rps"], doc["ramp_up_end_rps"]) == ramp
    assert doc["request_rate"] == "inf" and result.metrics.num_completed == 10


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--goodput", "ttft=500"], "--goodput takes KEY:VALUE"),
        (["--goodput", "ttft:500", "itl:20"], "--goodput: unknown metric 'itl'"),
        (["--goodput", "tpot:fast"], "--goodput: 'tpot:fast' needs a number"),
        (["--goodput", "e2el:-5"], "--goodput: the objective for e2el"),
        (["--percentile-metrics", "ttft,p99"], "--percentile-metrics: unknown metric 'p99'"),
        (["--percentile-metrics", ","], "--percentile-metrics is empty"),
        (["--metric-percentiles", "50,x"], "--metric-percentiles must be"),
        (["--temperature", "-1"], "temperature must be >= 0"),
        (["--top-p", "1.5"], "top-p must be in (0, 1]"),
        (["--top-k", "-2"], "top-k must be"),
        (["--min-p", "2"], "min-p must be in [0, 1]"),
        (["--repetition-penalty", "0"], "repetition penalty must be > 0"),
        (["--ramp-up-strategy", "linear", "--ramp-up-start-rps", "1", "--ramp-up-end-rps", "5",
          "--request-rate", "3"], "do not specify --request-rate"),
        (["--ramp-up-strategy", "linear", "--ramp-up-start-rps", "1"],
         "both --ramp-up-start-rps and --ramp-up-end-rps must be specified"),
        (["--ramp-up-strategy", "linear", "--ramp-up-start-rps", "8", "--ramp-up-end-rps", "2"],
         "start RPS must not exceed end RPS"),
        (["--ramp-up-strategy", "exponential", "--ramp-up-start-rps", "0", "--ramp-up-end-rps", "2"],
         "the start RPS cannot be 0"),
        (["--ramp-up-start-rps", "1", "--ramp-up-end-rps", "2"], "need --ramp-up-strategy"),
    ],
)
def test_cli_bad_values(tok_dir, capsys, argv, message):
    assert main(["--tokenizer", str(tok_dir), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and message in err and "Traceback" not in err, err


def test_cli_unknown_ramp_up_strategy(tok_dir, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--tokenizer", str(tok_dir), "--ramp-up-strategy", "quadratic"])
    assert exc.value.code == 2 and "--ramp-up-strategy" in capsys.readouterr().err


def test_tokenizer_flag(stand_in, tok_dir, tmp_path, capsys):
    server = stand_in()
    # --tokenizer wins over --model-path (which is not even read here)
    assert main(_argv(server, tok_dir, "--model-path", str(tmp_path / "missing"))) == 0
    assert all(len(b["prompt"].split()) == 6 for b in server.bodies)
    capsys.readouterr()
    assert main(["--tokenizer", str(tmp_path)]) == 2
    assert f"tokenizer directory {tmp_path} holds no tokenizer.json" in capsys.readouterr().err
    assert main(["--tokenizer", "Qwen/Qwen3.5-35B-A3B"]) == 2
    assert "does not exist" in (err := capsys.readouterr().err) and "hub names are not downloaded" in err
