"""Settings and results of `nibble bench serve`: `BenchServeConfig` (one pass, or every pass of a sweep; checked
by `validate`, described in the result JSON), `BenchResult` (one finished pass) and `BenchError`. The load
generation that uses them is runner.py."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from nibble.bench.arrivals import RAMP_UP_STRATEGIES
from nibble.bench.backends import (
    BACKEND_ENDPOINTS,
    join_url,
)
from nibble.bench.metrics import GOODPUT_METRICS, PERCENTILE_METRICS, BenchMetrics, RequestOutput

DATASETS = ("random", "sharegpt", "custom", "prefix_repetition")
_FILE_DATASETS = ("sharegpt", "custom")


class BenchError(RuntimeError):
    """The benchmark cannot run (bad configuration, server unreachable or refusing requests)."""


@dataclass
class BenchServeConfig:
    """Settings of one benchmark pass (or of every pass of a concurrency sweep)."""

    base_url: str = "http://127.0.0.1:8000"
    backend: str = "openai"
    endpoint: str | None = None
    model: str | None = None
    api_key: str | None = None
    tokenizer: str | None = None
    dataset_name: str = "random"
    dataset_path: str | None = None
    num_prompts: int = 1000
    random_input_len: int = 1024
    random_output_len: int = 128
    random_range_ratio: float = 0.0
    random_prefix_len: int = 0
    sharegpt_output_len: int | None = None
    custom_output_len: int = 256
    skip_chat_template: bool = False
    prefix_repetition_prefix_len: int = 256
    prefix_repetition_suffix_len: int = 256
    prefix_repetition_num_prefixes: int = 10
    prefix_repetition_output_len: int = 128
    no_oversample: bool = False
    disable_shuffle: bool = False
    prompt_token_ids: bool = False
    seed: int = 0
    ignore_eos: bool = True
    temperature: float = 0.0
    # optional sampling fields, sent only when set (None leaves them to the server)
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    extra_body: dict[str, Any] = field(default_factory=dict)
    max_concurrency: int | None = None
    request_rate: float = math.inf
    burstiness: float = 1.0
    # the request rate moves from start to end over a pass instead of staying at request_rate
    ramp_up_strategy: str | None = None
    ramp_up_start_rps: float | None = None
    ramp_up_end_rps: float | None = None
    num_warmups: int = 0
    # drop the server's prefix cache before each pass (POST /reset_prefix_cache, where the server has it), so
    # that prompts repeated from the test request, the warm-ups or an earlier pass of a sweep are not
    # measured as cache hits
    reset_prefix_cache: bool = True
    percentiles: tuple[float, ...] = (50.0, 90.0, 99.0)
    # metrics whose mean/median/std/percentiles are reported (vLLM's default leaves out e2el; nibble has
    # always reported it)
    percentile_metrics: tuple[str, ...] = PERCENTILE_METRICS
    # service-level objectives in ms by metric (ttft, tpot, e2el) for request goodput; empty: no goodput
    goodput: dict[str, float] = field(default_factory=dict)
    request_timeout_s: float = 6 * 3600.0
    disable_tqdm: bool = False

    @property
    def url(self) -> str:
        """The URL requests are posted to."""
        return join_url(self.base_url, self.endpoint or BACKEND_ENDPOINTS[self.backend])

    @property
    def ramp_up(self) -> tuple[str, float, float] | None:
        """(strategy, start rps, end rps) when the rate ramps up, else None."""
        if self.ramp_up_strategy is None or self.ramp_up_start_rps is None or self.ramp_up_end_rps is None:
            return None
        return self.ramp_up_strategy, self.ramp_up_start_rps, self.ramp_up_end_rps

    def sampling_params(self) -> dict[str, Any]:
        """The optional sampling fields that are set, under their request-body names."""
        fields = {
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
        }
        return {k: v for k, v in fields.items() if v is not None}

    def validate(self) -> None:
        """Raise `BenchError` for settings that cannot work, before anything is sent."""
        problems = []
        if self.backend not in BACKEND_ENDPOINTS:
            problems.append(f"unknown backend {self.backend!r} (choose from {', '.join(BACKEND_ENDPOINTS)})")
        problems += self._dataset_problems()
        if self.prompt_token_ids and self.backend == "openai-chat":
            problems.append("prompts as token ids need the completions API (--backend openai)")
        if self.num_prompts < 1:
            problems.append(f"number of prompts must be >= 1, got {self.num_prompts}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            problems.append(f"max concurrency must be >= 1, got {self.max_concurrency}")
        if not self.request_rate > 0:
            problems.append(f"request rate must be > 0 (inf for no pacing), got {self.request_rate}")
        if not self.burstiness > 0:
            problems.append(f"burstiness must be > 0, got {self.burstiness}")
        problems += self._ramp_up_problems()
        problems += self._sampling_problems()
        if self.num_warmups < 0:
            problems.append(f"number of warm-ups must be >= 0, got {self.num_warmups}")
        if any(not 0 < p <= 100 for p in self.percentiles):
            problems.append(f"percentiles must be in (0, 100], got {list(self.percentiles)}")
        unknown = [m for m in self.percentile_metrics if m not in PERCENTILE_METRICS]
        if unknown or not self.percentile_metrics:
            problems.append(
                f"percentile metrics must be among {', '.join(PERCENTILE_METRICS)}, got {list(self.percentile_metrics)}"
            )
        for name, limit in self.goodput.items():
            if name not in GOODPUT_METRICS:
                problems.append(f"goodput objectives are for {', '.join(GOODPUT_METRICS)}, not {name!r}")
            elif not 0 <= limit < math.inf:
                problems.append(f"goodput objective {name} must be a number of ms >= 0, got {limit}")
        if not self.request_timeout_s > 0:
            problems.append(f"request timeout must be > 0, got {self.request_timeout_s}")
        if problems:
            raise BenchError("; ".join(problems))

    def _ramp_up_problems(self) -> list[str]:
        # The messages name the flags, as vLLM's do: these combinations only arise on the command line.
        start, end = self.ramp_up_start_rps, self.ramp_up_end_rps
        if self.ramp_up_strategy is None:
            if start is not None or end is not None:
                return ["--ramp-up-start-rps and --ramp-up-end-rps need --ramp-up-strategy (linear or exponential)"]
            return []
        if self.ramp_up_strategy not in RAMP_UP_STRATEGIES:
            return [f"unknown ramp-up strategy {self.ramp_up_strategy!r} (choose from {', '.join(RAMP_UP_STRATEGIES)})"]
        if not math.isinf(self.request_rate):
            return ["when using ramp-up, do not specify --request-rate: the ramp-up parameters set the request rate"]
        if start is None or end is None:
            return ["when using --ramp-up-strategy, both --ramp-up-start-rps and --ramp-up-end-rps must be specified"]
        if start < 0 or end <= 0:
            return [f"ramp-up start RPS must be >= 0 and end RPS > 0, got {start} and {end}"]
        if start > end:
            return [f"ramp-up start RPS must not exceed end RPS, got {start} > {end}"]
        if self.ramp_up_strategy == "exponential" and start == 0:
            return ["for exponential ramp-up, the start RPS cannot be 0"]
        return []

    def _sampling_problems(self) -> list[str]:
        problems = []
        if not self.temperature >= 0:
            problems.append(f"temperature must be >= 0, got {self.temperature}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            problems.append(f"top-p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < -1:
            problems.append(f"top-k must be >= 1, or 0 or -1 for no limit, got {self.top_k}")
        if self.min_p is not None and not 0 <= self.min_p <= 1:
            problems.append(f"min-p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty is not None and not self.repetition_penalty > 0:
            problems.append(f"repetition penalty must be > 0, got {self.repetition_penalty}")
        return problems

    def _dataset_problems(self) -> list[str]:
        name = self.dataset_name
        if name not in DATASETS:
            return [f"unknown dataset {name!r} (choose from {', '.join(DATASETS)})"]
        problems = []
        if name in _FILE_DATASETS and not self.dataset_path:
            problems.append(f"the {name} dataset reads a file: pass --dataset-path")
        if name not in _FILE_DATASETS and self.dataset_path:
            problems.append(
                f"the {name} dataset is generated and reads no file: drop --dataset-path, or pick "
                f"--dataset-name {' or '.join(_FILE_DATASETS)}"
            )
        if self.random_input_len < 1 or self.random_output_len < 1:
            problems.append("random input and output lengths must be >= 1")
        if not 0.0 <= self.random_range_ratio < 1.0:
            problems.append(f"random range ratio must be in [0, 1), got {self.random_range_ratio}")
        if self.random_prefix_len < 0:
            problems.append(f"random prefix length must be >= 0, got {self.random_prefix_len}")
        if self.sharegpt_output_len is not None and self.sharegpt_output_len < 1:
            problems.append(f"ShareGPT output length must be >= 1, got {self.sharegpt_output_len}")
        if self.custom_output_len < 1:
            problems.append(f"custom output length must be >= 1, got {self.custom_output_len}")
        if name == "prefix_repetition":
            if self.prefix_repetition_prefix_len < 1 or self.prefix_repetition_output_len < 1:
                problems.append("prefix-repetition prefix and output lengths must be >= 1")
            if self.prefix_repetition_suffix_len < 0:
                problems.append(
                    f"prefix-repetition suffix length must be >= 0, got {self.prefix_repetition_suffix_len}"
                )
            if self.prefix_repetition_num_prefixes < 1:
                problems.append("prefix-repetition number of prefixes must be >= 1")
            elif self.num_prompts < self.prefix_repetition_num_prefixes:
                problems.append(
                    f"number of prompts ({self.num_prompts}) must be >= the number of prefixes "
                    f"({self.prefix_repetition_num_prefixes})"
                )
        return problems

    @property
    def applies_chat_template(self) -> bool:
        """Whether custom prompts are wrapped in the chat template here: only for the completions API (vLLM's
        default); chat endpoints template the messages themselves, so wrapping would do it twice."""
        return self.dataset_name == "custom" and self.backend == "openai" and not self.skip_chat_template

    def dataset_params(self) -> dict[str, Any]:
        """The dataset and the settings that shape it, for the result file."""
        name = self.dataset_name
        d: dict[str, Any] = {"name": name, "seed": self.seed}
        if name == "random":
            d.update(
                input_len=self.random_input_len,
                output_len=self.random_output_len,
                range_ratio=self.random_range_ratio,
                prefix_len=self.random_prefix_len,
            )
        elif name == "prefix_repetition":
            d.update(
                prefix_len=self.prefix_repetition_prefix_len,
                suffix_len=self.prefix_repetition_suffix_len,
                num_prefixes=self.prefix_repetition_num_prefixes,
                output_len=self.prefix_repetition_output_len,
                shuffle=not self.disable_shuffle,
            )
        else:
            d.update(path=self.dataset_path, oversample=not self.no_oversample, shuffle=not self.disable_shuffle)
            if name == "sharegpt":
                d["output_len"] = self.sharegpt_output_len
            else:
                d["output_len"] = self.custom_output_len
                d["chat_template"] = self.applies_chat_template
        return d

    def dataset_label(self) -> str:
        """One line that says what the prompts are, for the console and plot titles."""
        name = self.dataset_name
        if name == "random":
            label = f"random {self.random_input_len} in / {self.random_output_len} out"
            if self.random_range_ratio:
                label += f" (range ratio {self.random_range_ratio})"
            if self.random_prefix_len:
                label += f", {self.random_prefix_len}-token shared prefix"
            return label
        if name == "prefix_repetition":
            return (
                f"prefix_repetition {self.prefix_repetition_num_prefixes} prefixes x "
                f"{self.prefix_repetition_prefix_len} tokens + {self.prefix_repetition_suffix_len}-token suffixes, "
                f"{self.prefix_repetition_output_len} out"
            )
        if name == "sharegpt":
            fixed = self.sharegpt_output_len
            out = "output lengths from the replies" if fixed is None else f"{fixed} out"
            return f"sharegpt {self.dataset_path} ({out})"
        template = "chat template applied" if self.applies_chat_template else "no chat template"
        if self.backend == "openai-chat":
            template = "sent as user messages"
        return f"custom {self.dataset_path} ({self.custom_output_len} out where a line sets none, {template})"

    def load_label(self) -> str:
        """How requests are paced, for the console: all at once, a fixed rate, or a ramp-up."""
        arrivals = "Poisson" if self.burstiness == 1 else f"gamma, burstiness {self.burstiness:g}"
        if self.ramp_up is not None:
            strategy, start, end = self.ramp_up
            return f"request rate ramps up {strategy}ly from {start:g} to {end:g} req/s ({arrivals} arrivals)"
        if math.isinf(self.request_rate):
            return "all requests at once"
        return f"request rate {self.request_rate:g} req/s ({arrivals} arrivals)"

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe settings for the result file; the API key is never written out."""
        d = dataclasses.asdict(self)
        d["api_key"] = "***" if self.api_key else None
        d["url"] = self.url
        d["percentiles"] = list(self.percentiles)
        d["percentile_metrics"] = list(self.percentile_metrics)
        if math.isinf(self.request_rate):
            d["request_rate"] = "inf"
        return d


@dataclass
class BenchResult:
    """One finished pass: resolved settings, aggregate metrics and every request's output."""

    config: BenchServeConfig
    model: str
    metrics: BenchMetrics
    outputs: list[RequestOutput]
    date: str = field(default_factory=lambda: datetime.now().isoformat(timespec="seconds"))

    def to_dict(self, detailed: bool = False) -> dict[str, Any]:
        """The result JSON: settings, vLLM-style flat metrics and, if `detailed`, per-request arrays."""
        d: dict[str, Any] = {
            "date": self.date,
            "backend": self.config.backend,
            "model_id": self.model,
            "num_prompts": len(self.outputs),
            "dataset": self.config.dataset_params(),
            "config": self.config.to_dict(),
            # the traffic settings also at the top, where vLLM's result files have them
            "request_rate": "inf" if math.isinf(self.config.request_rate) else self.config.request_rate,
            "burstiness": self.config.burstiness,
            **self.metrics.to_flat_dict(),
        }
        if self.config.ramp_up is not None:
            d["ramp_up_strategy"], d["ramp_up_start_rps"], d["ramp_up_end_rps"] = self.config.ramp_up
        if detailed:
            d["input_lens"] = [o.prompt_len for o in self.outputs]
            d["output_lens"] = [o.output_tokens for o in self.outputs]
            d["ttfts"] = [o.ttft for o in self.outputs]
            d["latencies"] = [o.latency for o in self.outputs]
            d["itls"] = [o.itl for o in self.outputs]
            d["start_times"] = [o.start_time for o in self.outputs]
            d["request_errors"] = [o.error for o in self.outputs]
        return d
