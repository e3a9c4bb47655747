"""Settings and results of `nibble bench serve`: `BenchServeConfig` (one pass, or every pass of a sweep; checked
by `validate`, described in the result JSON), `BenchResult` (one finished pass) and `BenchError`. The load
generation that uses them is runner.py."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from nibble.bench.backends import (
    BACKEND_ENDPOINTS,
    join_url,
)
from nibble.bench.metrics import BenchMetrics, RequestOutput

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
    extra_body: dict[str, Any] = field(default_factory=dict)
    max_concurrency: int | None = None
    request_rate: float = math.inf
    burstiness: float = 1.0
    num_warmups: int = 0
    # drop the server's prefix cache before each pass (POST /reset_prefix_cache, where the server has it), so
    # that prompts repeated from the test request, the warm-ups or an earlier pass of a sweep are not
    # measured as cache hits
    reset_prefix_cache: bool = True
    percentiles: tuple[float, ...] = (50.0, 90.0, 99.0)
    request_timeout_s: float = 6 * 3600.0
    disable_tqdm: bool = False

    @property
    def url(self) -> str:
        """The URL requests are posted to."""
        return join_url(self.base_url, self.endpoint or BACKEND_ENDPOINTS[self.backend])

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
        if self.num_warmups < 0:
            problems.append(f"number of warm-ups must be >= 0, got {self.num_warmups}")
        if any(not 0 < p <= 100 for p in self.percentiles):
            problems.append(f"percentiles must be in (0, 100], got {list(self.percentiles)}")
        if not self.request_timeout_s > 0:
            problems.append(f"request timeout must be > 0, got {self.request_timeout_s}")
        if problems:
            raise BenchError("; ".join(problems))

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

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe settings for the result file; the API key is never written out."""
        d = dataclasses.asdict(self)
        d["api_key"] = "***" if self.api_key else None
        d["url"] = self.url
        d["percentiles"] = list(self.percentiles)
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
            **self.metrics.to_flat_dict(),
        }
        if detailed:
            d["input_lens"] = [o.prompt_len for o in self.outputs]
            d["output_lens"] = [o.output_tokens for o in self.outputs]
            d["ttfts"] = [o.ttft for o in self.outputs]
            d["latencies"] = [o.latency for o in self.outputs]
            d["itls"] = [o.itl for o in self.outputs]
            d["start_times"] = [o.start_time for o in self.outputs]
            d["request_errors"] = [o.error for o in self.outputs]
        return d
