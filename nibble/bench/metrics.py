"""Per-request timings and the aggregate serving metrics computed from them.

Definitions follow the convention of `vllm bench serve`: TTFT is the time to the first content chunk,
TPOT is (latency - TTFT) / (output tokens - 1) per request, ITL is every gap between consecutive content
chunks pooled over all requests, E2E is the whole request. Aggregates cover successful requests only.
Request goodput is the number of successful requests per second that meet every given service-level
objective (`--goodput ttft:500 tpot:50`, in ms). Mean, median, std and percentiles are reported for the
metrics `--percentile-metrics` selects; all four are always computed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

# Failed requests whose messages the summary keeps; the rest are only counted.
_NUM_ERRORS_KEPT = 5

# the latency metrics with a distribution, in report order (vLLM's names)
PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")
# the per-request metrics a goodput objective can bound (ITL is per gap, not per request)
GOODPUT_METRICS = ("ttft", "tpot", "e2el")


@dataclass
class RequestOutput:
    """What one streamed request produced; times are in seconds (time.perf_counter based)."""

    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    start_time: float = 0.0
    error: str = ""
    # prompt tokens the server served from its prefix cache (usage.prompt_tokens_details.cached_tokens);
    # None when the server does not say
    cached_tokens: int | None = None


@dataclass(frozen=True)
class Distribution:
    """Summary of one latency quantity, in milliseconds."""

    mean: float
    median: float
    std: float
    percentiles: dict[str, float]

    @classmethod
    def of(cls, values_s: Sequence[float], percentiles: Sequence[float]) -> Distribution:
        """Summarise `values_s` (seconds); an empty sequence gives zeros so failed runs still print."""
        v = np.asarray(values_s, dtype=np.float64) * 1000.0
        if v.size == 0:
            return cls(0.0, 0.0, 0.0, {_pct_key(p): 0.0 for p in percentiles})
        return cls(
            mean=float(v.mean()),
            median=float(np.median(v)),
            std=float(v.std()),
            percentiles={_pct_key(p): float(np.percentile(v, p)) for p in percentiles},
        )


def _pct_key(p: float) -> str:
    """`p99`, `p99.9`: integral percentiles without a trailing `.0`."""
    return f"p{int(p)}" if float(p).is_integer() else f"p{p}"


@dataclass(frozen=True)
class BenchMetrics:
    """Aggregate metrics of one benchmark pass."""

    num_completed: int
    num_failed: int
    errors: list[str]
    duration: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    max_concurrency: int | None
    peak_concurrent_requests: int
    # prompt tokens served from the server's prefix cache, summed over the requests whose usage reports them
    # (None when none does)
    total_cached_tokens: int | None
    ttft: Distribution
    tpot: Distribution
    itl: Distribution
    e2el: Distribution
    # successful requests per second that met every objective; None when no objective was set
    request_goodput: float | None = None
    # the distributions the summary and the flat result show
    percentile_metrics: tuple[str, ...] = PERCENTILE_METRICS

    def to_flat_dict(self) -> dict[str, float | int | list[str] | None]:
        """Flat keys in the style of vLLM's result JSON (`mean_ttft_ms`, `p99_itl_ms`, ...)."""
        out: dict[str, float | int | list[str] | None] = {
            "completed": self.num_completed,
            "failed": self.num_failed,
            "errors": list(self.errors),
            "duration": self.duration,
            "total_input_tokens": self.total_input_tokens,
            "total_output_tokens": self.total_output_tokens,
            "request_throughput": self.request_throughput,
            "request_goodput": self.request_goodput,
            "output_throughput": self.output_throughput,
            "total_token_throughput": self.total_token_throughput,
            "max_concurrency": self.max_concurrency,
            "peak_concurrent_requests": self.peak_concurrent_requests,
            "total_cached_tokens": self.total_cached_tokens,
        }
        for name in PERCENTILE_METRICS:
            if name not in self.percentile_metrics:
                continue
            dist: Distribution = getattr(self, name)
            out[f"mean_{name}_ms"] = dist.mean
            out[f"median_{name}_ms"] = dist.median
            out[f"std_{name}_ms"] = dist.std
            for key, value in dist.percentiles.items():
                out[f"{key}_{name}_ms"] = value
        return out

    def to_dict(self) -> dict:
        """Nested form (distributions as sub-dicts)."""
        return asdict(self)


def _tpot(o: RequestOutput) -> float:
    """Seconds per output token after the first; a one-token request has no decode phase (0 for goodput)."""
    return (o.latency - o.ttft) / (o.output_tokens - 1) if o.output_tokens > 1 else 0.0


def count_good(outputs: Sequence[RequestOutput], slo_ms: Mapping[str, float]) -> int:
    """Successful requests whose TTFT, TPOT and E2E latency are each within the objective set for it (ms);
    an objective that is not set does not count."""
    unknown = set(slo_ms) - set(GOODPUT_METRICS)
    if unknown:
        raise ValueError(f"goodput objectives are for {', '.join(GOODPUT_METRICS)}, not {', '.join(sorted(unknown))}")
    good = 0
    for o in outputs:
        if not o.success:
            continue
        values_s = {"ttft": o.ttft, "tpot": _tpot(o), "e2el": o.latency}
        if all(values_s[name] * 1000.0 <= limit for name, limit in slo_ms.items()):
            good += 1
    return good


def compute_metrics(
    outputs: Sequence[RequestOutput],
    duration: float,
    percentiles: Sequence[float],
    max_concurrency: int | None = None,
    peak_concurrent_requests: int = 0,
    percentile_metrics: Sequence[str] = PERCENTILE_METRICS,
    goodput: Mapping[str, float] | None = None,
) -> BenchMetrics:
    """Aggregate per-request outputs of a pass that took `duration` seconds of wall time; `goodput` maps
    metric names (ttft, tpot, e2el) to objectives in ms, and request goodput is only reported with one."""
    ok = [o for o in outputs if o.success]
    failed = [o for o in outputs if not o.success]
    total_in = sum(o.prompt_len for o in ok)
    total_out = sum(o.output_tokens for o in ok)
    # A request with one output token has no decode phase, so it has no TPOT.
    tpots = [_tpot(o) for o in ok if o.output_tokens > 1]
    itls = [gap for o in ok for gap in o.itl]
    cached = [o.cached_tokens for o in ok if o.cached_tokens is not None]
    safe_duration = duration if duration > 0 else float("inf")
    return BenchMetrics(
        num_completed=len(ok),
        num_failed=len(failed),
        errors=[o.error for o in failed[:_NUM_ERRORS_KEPT]],
        duration=duration,
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        request_throughput=len(ok) / safe_duration,
        output_throughput=total_out / safe_duration,
        total_token_throughput=(total_in + total_out) / safe_duration,
        max_concurrency=max_concurrency,
        peak_concurrent_requests=peak_concurrent_requests,
        total_cached_tokens=sum(cached) if cached else None,
        ttft=Distribution.of([o.ttft for o in ok], percentiles),
        tpot=Distribution.of(tpots, percentiles),
        itl=Distribution.of(itls, percentiles),
        e2el=Distribution.of([o.latency for o in ok], percentiles),
        request_goodput=count_good(ok, goodput) / safe_duration if goodput else None,
        percentile_metrics=tuple(percentile_metrics),
    )


_WIDTH = 50
_LABEL_WIDTH = 40
_SECTIONS = (
    ("ttft", "TTFT", "Time to First Token"),
    ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
    ("itl", "ITL", "Inter-token Latency"),
    ("e2el", "E2EL", "End-to-end Latency"),
)


def _row(label: str, value: float | int | str) -> str:
    text = f"{value:.2f}" if isinstance(value, float) else str(value)
    return f"{label:<{_LABEL_WIDTH}}{text:>{_WIDTH - _LABEL_WIDTH}}"


def format_metrics(m: BenchMetrics, title: str = "Serving Benchmark Result", dataset: str | None = None) -> str:
    """The result table printed after a pass, laid out like vLLM's so the numbers read the same way;
    `dataset` (what the prompts were) heads it when given."""
    lines = [f" {title} ".center(_WIDTH, "=")]
    if dataset:
        lines.append(f"Dataset: {dataset}")
    lines.append(_row("Successful requests:", m.num_completed))
    lines.append(_row("Failed requests:", m.num_failed))
    if m.max_concurrency is not None:
        lines.append(_row("Maximum request concurrency:", m.max_concurrency))
    lines += [
        _row("Peak concurrent requests:", m.peak_concurrent_requests),
        _row("Benchmark duration (s):", m.duration),
        _row("Total input tokens:", m.total_input_tokens),
        *([_row("Prefix-cache hit tokens:", f"{m.total_cached_tokens} "
                f"({100 * m.total_cached_tokens / max(m.total_input_tokens, 1):.1f}%)")]
          if m.total_cached_tokens is not None else []),
        _row("Total generated tokens:", m.total_output_tokens),
        _row("Request throughput (req/s):", m.request_throughput),
        *([_row("Request goodput (req/s):", m.request_goodput)] if m.request_goodput is not None else []),
        _row("Output token throughput (tok/s):", m.output_throughput),
        _row("Total token throughput (tok/s):", m.total_token_throughput),
    ]
    for name, short, heading in _SECTIONS:
        if name not in m.percentile_metrics:
            continue
        dist: Distribution = getattr(m, name)
        lines.append(f" {heading} ".center(_WIDTH, "-"))
        lines.append(_row(f"Mean {short} (ms):", dist.mean))
        lines.append(_row(f"Median {short} (ms):", dist.median))
        lines.append(_row(f"Std {short} (ms):", dist.std))
        for key, value in dist.percentiles.items():
            if key != "p50":  # the median row already shows it
                lines.append(_row(f"{key.upper()} {short} (ms):", value))
    if m.errors:
        lines.append(" First errors ".center(_WIDTH, "-"))
        lines += [f"  {e}" for e in m.errors]
    lines.append("=" * _WIDTH)
    return "\n".join(lines)


def format_sweep(results: Sequence[tuple[int, BenchMetrics]]) -> str:
    """One line per concurrency level: throughput (and goodput, when objectives were set) and median/p99
    latencies side by side."""
    goodput = any(m.request_goodput is not None for _, m in results)
    good_column = f" {'good/s':>8}" if goodput else ""
    header = (
        f"{'conc':>6} {'ok':>6} {'fail':>5} {'req/s':>8}{good_column} {'out tok/s':>10} {'tot tok/s':>10} "
        f"{'TTFT med':>9} {'TTFT p99':>9} {'TPOT med':>9} {'TPOT p99':>9} {'ITL p99':>9}"
    )
    lines = [header, "-" * len(header)]
    for concurrency, m in results:
        good = f" {m.request_goodput or 0.0:>8.2f}" if goodput else ""
        lines.append(
            f"{concurrency:>6} {m.num_completed:>6} {m.num_failed:>5} {m.request_throughput:>8.2f}{good} "
            f"{m.output_throughput:>10.1f} {m.total_token_throughput:>10.1f} "
            f"{m.ttft.median:>9.1f} {m.ttft.percentiles.get('p99', m.ttft.median):>9.1f} "
            f"{m.tpot.median:>9.2f} {m.tpot.percentiles.get('p99', m.tpot.median):>9.2f} "
            f"{m.itl.percentiles.get('p99', m.itl.median):>9.2f}"
        )
    lines.append("(latencies in ms)")
    return "\n".join(lines)
