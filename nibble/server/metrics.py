"""Prometheus metrics of one server (GET /metrics), in a registry owned by the app.

Engine-wide numbers (queue lengths, KV-cache usage, token totals) are read from `engine.stats()` at
scrape time, so they are always current and cost nothing per step. Per-request numbers (finish reasons,
latencies) are recorded by the serving code when each engine request ends.

The metrics that vLLM also has are exposed a second time under vLLM's names (`vllm:num_requests_waiting`,
`vllm:kv_cache_usage_perc`, `vllm:time_to_first_token_seconds`, ...), so that dashboards, alerts and autoscalers
that read vLLM's gauges and counters work against nibble. The copies carry nibble's samples as they are: the
`model_name` label only (vLLM v1 adds `engine`), nibble's histogram buckets (quantiles computed from them differ
from vLLM's), and `time_per_output_token_seconds` observes one mean per request where vLLM v1 observes every
inter-token gap.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from nibble.engine.async_engine import AsyncEngine
from nibble.engine.model_runner import STEP_KINDS

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0, 2.5, 5.0)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
FINISH_REASONS = ("stop", "length", "abort", "error")
_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)


def spec_positions(stats: dict[str, float]) -> int:
    """Draft positions the engine's stats count acceptances for (num_speculative_tokens; 0 without)."""
    n = 0
    while f"spec_decode_num_accepted_tokens_pos_{n}" in stats:
        n += 1
    return n


class _EngineCollector(Collector):
    """Gauges and counters read from the engine at scrape time."""

    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self._engine = engine
        self._model = model_name

    def collect(self) -> Iterator[Metric]:
        stats = self._engine.stats()
        labels = ["model_name"]
        values = [self._model]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(values, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(values, value)
            return c

        yield gauge("nibble:num_requests_running", "Requests in the running batch.", stats.get("num_running", 0))
        yield gauge("nibble:num_requests_waiting", "Requests waiting to be scheduled.", stats.get("num_waiting", 0))
        yield gauge("nibble:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).",
                    stats.get("kv_cache_usage", 0.0))
        yield counter("nibble:prompt_tokens", "Prompt tokens of all requests the engine accepted.",
                      stats.get("num_prompt_tokens", 0))
        yield counter("nibble:generation_tokens", "Tokens generated.", stats.get("num_generated_tokens", 0))
        yield counter("nibble:num_preemptions", "Requests preempted for lack of cache space.",
                      stats.get("num_preemptions", 0))
        yield counter("nibble:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      stats.get("prefix_cache_queries", 0))
        yield counter("nibble:prefix_cache_hits", "Prompt tokens served from the prefix cache.",
                      stats.get("prefix_cache_hits", 0))
        yield counter("nibble:spec_decode_num_drafts", "Sequences of verify steps that fed drafts.",
                      stats.get("spec_decode_num_drafts", 0))
        yield counter("nibble:spec_decode_num_draft_tokens", "Draft tokens proposed (MTP head or n-gram lookup).",
                      stats.get("spec_decode_num_draft_tokens", 0))
        yield counter("nibble:spec_decode_num_accepted_tokens", "Draft tokens accepted by the target model.",
                      stats.get("spec_decode_num_accepted_tokens", 0))
        per_pos = CounterMetricFamily("nibble:spec_decode_num_accepted_tokens_per_pos",
                                      "Draft tokens accepted, by their position among a step's drafts.",
                                      labels=[*labels, "position"])
        for pos in range(spec_positions(stats)):
            per_pos.add_metric([*values, str(pos)], stats[f"spec_decode_num_accepted_tokens_pos_{pos}"])
        yield per_pos
        steps = CounterMetricFamily("nibble:model_steps", "Model steps by how they ran: replayed from a decode, "
                                    "mixed prefill/decode or speculative-verify CUDA graph, or eagerly.",
                                    labels=[*labels, "mode"])
        for kind in STEP_KINDS:
            steps.add_metric([*values, kind], stats.get(f"model_steps_{kind}", 0))
        yield steps


# nibble's metrics that vLLM has under the same name with its `vllm:` prefix
VLLM_NAMES = frozenset({
    "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prompt_tokens", "generation_tokens",
    "num_preemptions", "prefix_cache_queries", "prefix_cache_hits", "spec_decode_num_drafts",
    "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens_per_pos",
    "request_success", "time_to_first_token_seconds",
    "time_per_output_token_seconds", "e2e_request_latency_seconds", "request_prompt_tokens",
    "request_generation_tokens",
})


def vllm_aliases(families: list[Metric]) -> Iterator[Metric]:
    """The families named in VLLM_NAMES again, renamed `nibble:x` -> `vllm:x` (samples too)."""
    for family in families:
        base = family.name.removeprefix("nibble:")
        if base == family.name or base not in VLLM_NAMES:
            continue
        alias = Metric(f"vllm:{base}", family.documentation, family.type, family.unit)
        alias.samples = [sample._replace(name="vllm:" + sample.name.removeprefix("nibble:"))
                         for sample in family.samples]
        yield alias


class _Snapshot(Collector):
    """Metric families collected once, so that a scrape reads the engine's stats once and both names of a
    gauge agree."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


class ServerMetrics:
    """The metrics of one app. `observe_request` records one finished (or aborted) engine request."""

    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        """Create a fresh registry for `engine`, labelled with the served model name."""
        self.registry = CollectorRegistry()
        self._model = model_name
        self.registry.register(_EngineCollector(engine, model_name))
        labels = ["model_name"]
        self.request_success = Counter(
            "nibble:request_success", "Finished requests by finish reason.", ["model_name", "finished_reason"],
            registry=self.registry)
        self.ttft = Histogram(
            "nibble:time_to_first_token_seconds", "Time from arrival to the first generated token.", labels,
            buckets=_TTFT_BUCKETS, registry=self.registry)
        self.tpot = Histogram(
            "nibble:time_per_output_token_seconds", "Mean time between output tokens, per request.", labels,
            buckets=_TPOT_BUCKETS, registry=self.registry)
        self.e2e = Histogram(
            "nibble:e2e_request_latency_seconds", "Time from arrival to the end of the request.", labels,
            buckets=_E2E_BUCKETS, registry=self.registry)
        self.prompt_len = Histogram(
            "nibble:request_prompt_tokens", "Prompt length of finished requests.", labels,
            buckets=_TOKEN_BUCKETS, registry=self.registry)
        self.output_len = Histogram(
            "nibble:request_generation_tokens", "Generated tokens of finished requests.", labels,
            buckets=_TOKEN_BUCKETS, registry=self.registry)
        self.http_errors = Counter(
            "nibble:http_errors", "Error responses by HTTP status.", ["model_name", "status"], registry=self.registry)
        # Label sets are created up front so every series is present (at zero) from the first scrape.
        for reason in FINISH_REASONS:
            self.request_success.labels(model_name, reason)
        for hist in (self.ttft, self.tpot, self.e2e, self.prompt_len, self.output_len):
            hist.labels(model_name)

    def observe_request(self, finish_reason: str, num_prompt_tokens: int, num_output_tokens: int,
                        arrival_time: float | None, first_token_time: float | None, end_time: float) -> None:
        """Record one engine request; times are `time.monotonic()` values (the engine's clock)."""
        self.request_success.labels(self._model, finish_reason).inc()
        self.prompt_len.labels(self._model).observe(num_prompt_tokens)
        self.output_len.labels(self._model).observe(num_output_tokens)
        if arrival_time is not None:
            self.e2e.labels(self._model).observe(max(0.0, end_time - arrival_time))
            if first_token_time is not None:
                self.ttft.labels(self._model).observe(max(0.0, first_token_time - arrival_time))
        if first_token_time is not None and num_output_tokens > 1:
            self.tpot.labels(self._model).observe(max(0.0, end_time - first_token_time) / (num_output_tokens - 1))

    def observe_error(self, status: int) -> None:
        """Count one error response."""
        self.http_errors.labels(self._model, str(status)).inc()

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        families = list(self.registry.collect())
        return generate_latest(_Snapshot([*families, *vllm_aliases(families)])), CONTENT_TYPE_LATEST
