"""/health, /version, /v1/models and the Prometheus /metrics endpoint."""

from __future__ import annotations

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from nibble import __version__
from nibble.server.api_server import build_app
from nibble.server.metrics import VLLM_NAMES

from .conftest import ServerHandle, metric_value, wait_idle

METRIC_NAMES = (
    "nibble:num_requests_running",
    "nibble:num_requests_waiting",
    "nibble:kv_cache_usage_perc",
    "nibble:prompt_tokens_total",
    "nibble:generation_tokens_total",
    "nibble:request_success_total",
    "nibble:time_to_first_token_seconds_bucket",
    "nibble:time_per_output_token_seconds_bucket",
    "nibble:e2e_request_latency_seconds_bucket",
    "nibble:model_steps_total",
)


def test_health_and_version(http: httpx.Client) -> None:
    assert http.get("/health").status_code == 200
    assert http.get("/version").json() == {"version": __version__}


def test_models(client: openai.OpenAI, server: ServerHandle) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [server.model]
    card = models.data[0]
    assert card.object == "model" and card.owned_by == "nibble"
    assert card.model_extra["max_model_len"] == server.engine.engine.max_model_len
    assert client.models.retrieve(server.model).id == server.model


def test_metrics_count_requests(http: httpx.Client, server: ServerHandle) -> None:
    before = http.get("/metrics").text
    for name in METRIC_NAMES:
        assert name in before, name
    r = http.post("/v1/completions", json={"prompt": "count me", "max_tokens": 5, "ignore_eos": True})
    assert r.status_code == 200
    http.post("/v1/completions", json={"prompt": "bad", "temperature": -1})
    after = http.get("/metrics").text
    assert http.get("/metrics").headers["content-type"].startswith("text/plain")

    def delta(name: str, **labels: str) -> float:
        return metric_value(after, name, **labels) - metric_value(before, name, **labels)

    assert delta("nibble:request_success_total", finished_reason="length") == 1
    assert delta("nibble:prompt_tokens_total") == r.json()["usage"]["prompt_tokens"]
    assert delta("nibble:generation_tokens_total") == 5
    assert delta("nibble:e2e_request_latency_seconds_count") == 1
    assert delta("nibble:time_to_first_token_seconds_count") == 1
    assert delta("nibble:time_per_output_token_seconds_count") == 1
    assert delta("nibble:request_generation_tokens_sum") == 5
    assert delta("nibble:http_errors_total", status="400") == 1
    # a CPU engine has no CUDA graphs: the prefill and the decode steps all ran eagerly
    assert delta("nibble:model_steps_total", mode="eager") >= 5
    assert all(metric_value(after, "nibble:model_steps_total", mode=m) == 0
               for m in ("decode_graph", "mixed_graph", "verify_graph"))
    assert metric_value(after, "nibble:num_requests_running") == 0
    assert 0 <= metric_value(after, "nibble:kv_cache_usage_perc") <= 1


def test_metrics_registry_is_per_app(server: ServerHandle) -> None:
    a, b = build_app(server.engine), build_app(server.engine)
    assert a.state.metrics.registry is not b.state.metrics.registry


def test_vllm_names_mirror_the_nibble_series(http: httpx.Client) -> None:
    """Every metric vLLM also has is exposed under its vLLM name with the same samples (labels, buckets,
    values), for dashboards and autoscalers written for vLLM; nibble-only metrics are not."""
    http.post("/v1/completions", json={"prompt": "mirror", "max_tokens": 3, "ignore_eos": True})
    families = {f.name: f for f in text_string_to_metric_families(http.get("/metrics").text)}
    for base in VLLM_NAMES:
        ours, theirs = families[f"nibble:{base}"], families[f"vllm:{base}"]
        assert theirs.type == ours.type and theirs.documentation == ours.documentation
        assert [(s.name.removeprefix("vllm:"), s.labels, s.value) for s in theirs.samples] == \
            [(s.name.removeprefix("nibble:"), s.labels, s.value) for s in ours.samples]
    assert "vllm:model_steps" not in families and "vllm:http_errors" not in families
    for name in ("vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:request_success"):
        assert name in families


def test_reset_prefix_cache_route(http: httpx.Client, server: ServerHandle) -> None:
    """POST /reset_prefix_cache (vLLM's): a repeated long prompt is served from the cache, after a reset it
    is computed again."""
    prompt = list(range(10, 10 + 300))

    def cached() -> int:
        r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    cached()
    cached()
    assert cached() > 0
    assert wait_idle(server.engine)
    r = http.post("/reset_prefix_cache")
    assert r.status_code == 200 and r.json() == {"reset": True}
    assert cached() == 0
