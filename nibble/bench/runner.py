"""The engine of `nibble bench serve`: load generation against any OpenAI-compatible server.

It follows the convention of `vllm bench serve` / `sglang.bench_serving`: a dataset of prompts (random
fixed-length ones by default; also ShareGPT conversations, a custom JSONL file, or repeated prefixes that
exercise a prefix cache), requests streamed with `ignore_eos` so every request generates exactly its output
budget, load shaped by a concurrency cap and/or a Poisson (or gamma) arrival rate, fixed or ramping up (see
arrivals.py), and a report of throughput, goodput, TTFT, TPOT, ITL and end-to-end latency. `nibble.bench.serve`
re-exports the public API next to the CLI glue.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Callable, Sequence

import aiohttp
from tokenizers import Tokenizer
from tqdm import tqdm

from nibble.bench.arrivals import arrival_offsets, paced
from nibble.bench.backends import (
    RequestSettings,
    ServerError,
    fetch_first_model,
    send_request,
)
from nibble.bench.bench_config import (  # noqa: F401  (re-exported)
    DATASETS,
    BenchError,
    BenchResult,
    BenchServeConfig,
)
from nibble.bench.datasets import (
    SampleRequest,
    load_tokenizer,
    sample_prefix_repetition_requests,
    sample_random_requests,
)
from nibble.bench.datasets_files import (
    load_chat_template,
    load_custom,
    load_sharegpt,
    sample_custom_requests,
    sample_sharegpt_requests,
)
from nibble.bench.metrics import RequestOutput, compute_metrics


def _load_tokenizer(cfg: BenchServeConfig) -> Tokenizer:
    if not cfg.tokenizer:
        raise BenchError(f"the {cfg.dataset_name} dataset needs a tokenizer: pass --tokenizer or --model-path")
    try:
        return load_tokenizer(cfg.tokenizer)
    except ValueError as e:
        raise BenchError(str(e)) from e


def build_requests(
    cfg: BenchServeConfig, num_prompts: int | None = None, tokenizer: Tokenizer | None = None
) -> list[SampleRequest]:
    """The dataset `cfg` describes (`num_prompts` overrides its count; `tokenizer` saves reloading it).

    File datasets may come back shorter than asked when `cfg.no_oversample` is set.
    """
    tok = tokenizer or _load_tokenizer(cfg)
    num = num_prompts or cfg.num_prompts
    shuffle = not cfg.disable_shuffle
    oversample = not cfg.no_oversample
    try:
        if cfg.dataset_name == "sharegpt":
            return sample_sharegpt_requests(
                load_sharegpt(cfg.dataset_path or ""),
                tok,
                num,
                seed=cfg.seed,
                output_len=cfg.sharegpt_output_len,
                oversample=oversample,
                shuffle=shuffle,
                as_token_ids=cfg.prompt_token_ids,
            )
        if cfg.dataset_name == "custom":
            # The file first: a broken line is the more basic problem than a missing template.
            data = load_custom(cfg.dataset_path or "")
            template = load_chat_template(cfg.tokenizer or "") if cfg.applies_chat_template else None
            return sample_custom_requests(
                data,
                tok,
                num,
                output_len=cfg.custom_output_len,
                seed=cfg.seed,
                chat_template=template,
                oversample=oversample,
                shuffle=shuffle,
                as_token_ids=cfg.prompt_token_ids,
            )
        if cfg.dataset_name == "prefix_repetition":
            return sample_prefix_repetition_requests(
                tok,
                num,
                prefix_len=cfg.prefix_repetition_prefix_len,
                suffix_len=cfg.prefix_repetition_suffix_len,
                num_prefixes=cfg.prefix_repetition_num_prefixes,
                output_len=cfg.prefix_repetition_output_len,
                seed=cfg.seed,
                as_token_ids=cfg.prompt_token_ids,
                shuffle=shuffle,
            )
        return sample_random_requests(
            tok,
            num_prompts=num,
            input_len=cfg.random_input_len,
            output_len=cfg.random_output_len,
            range_ratio=cfg.random_range_ratio,
            seed=cfg.seed,
            as_token_ids=cfg.prompt_token_ids,
            prefix_len=cfg.random_prefix_len,
        )
    except ValueError as e:
        raise BenchError(str(e)) from e


# 409 answers of /reset_prefix_cache (requests still running) before a pass starts without the reset
RESET_TRIES = 10


class _Session:
    """A connection pool plus the resolved request settings, shared by the passes of one invocation."""

    def __init__(self, cfg: BenchServeConfig) -> None:
        self.cfg = cfg
        timeout = aiohttp.ClientTimeout(total=cfg.request_timeout_s)
        # limit=0: the pool must never become a hidden concurrency cap below --max-concurrency.
        self.http = aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0))
        self.settings: RequestSettings | None = None

    async def close(self) -> None:
        await self.http.close()

    async def connect(self, probe: SampleRequest) -> RequestSettings:
        """Resolve the model and send one short request, so that a dead server or a refused request
        stops the run with the server's reason instead of a table of failures."""
        cfg = self.cfg
        try:
            model = cfg.model or await fetch_first_model(self.http, cfg.base_url, cfg.api_key)
        except ServerError as e:
            raise BenchError(str(e)) from e
        self.settings = RequestSettings(
            backend=cfg.backend,
            url=cfg.url,
            model=model,
            api_key=cfg.api_key,
            ignore_eos=cfg.ignore_eos,
            temperature=cfg.temperature,
            sampling=cfg.sampling_params(),
            extra_body=dict(cfg.extra_body),
        )
        short = dataclasses.replace(probe, output_len=min(probe.output_len, 4))
        out = await send_request(self.http, self.settings, short)
        if not out.success:
            # Network errors already name the URL; HTTP errors need it added.
            where = "" if cfg.url in out.error else f" to {cfg.url}"
            raise BenchError(f"test request{where} failed: {out.error}")
        return self.settings

    async def reset_prefix_cache(self) -> str:
        """POST /reset_prefix_cache (nibble's and vLLM's dev-mode route): "reset", "busy" when the server still
        runs requests after a few tries, or "unsupported" when it has no such route."""
        cfg = self.cfg
        headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
        url = cfg.base_url.rstrip("/") + "/reset_prefix_cache"
        for _ in range(RESET_TRIES):
            try:
                async with self.http.post(url, headers=headers) as resp:
                    if resp.status == 200:
                        return "reset"
                    if resp.status != 409:
                        return "unsupported"
            except (aiohttp.ClientError, TimeoutError):
                return "unsupported"
            # 409: requests of the warm-up or of another client are still running
            await asyncio.sleep(0.5)
        return "busy"

    async def run_pass(
        self, requests: Sequence[SampleRequest], max_concurrency: int | None, desc: str = ""
    ) -> tuple[list[RequestOutput], float, int]:
        """Send `requests` under the pass's load shape; returns outputs, duration and peak in-flight."""
        assert self.settings is not None, "connect() first"
        settings = self.settings
        cfg = self.cfg
        limit = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
        in_flight = 0
        peak = 0
        bar = tqdm(total=len(requests), disable=cfg.disable_tqdm, desc=desc or None)

        async def one(req: SampleRequest) -> RequestOutput:
            nonlocal in_flight, peak
            async with limit:
                in_flight += 1
                peak = max(peak, in_flight)
                try:
                    return await send_request(self.http, settings, req)
                finally:
                    in_flight -= 1
                    bar.update(1)

        offsets = arrival_offsets(len(requests), cfg.request_rate, cfg.burstiness, cfg.seed, cfg.ramp_up)
        start = time.perf_counter()
        tasks = []
        async for req in paced(requests, offsets.tolist()):
            tasks.append(asyncio.create_task(one(req)))
        outputs = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - start
        bar.close()
        return outputs, duration, peak

    async def warm_up(self, requests: Sequence[SampleRequest], max_concurrency: int | None) -> None:
        """Send `cfg.num_warmups` requests (cycling through the dataset) whose timings are discarded."""
        num = self.cfg.num_warmups
        if num == 0:
            return
        assert self.settings is not None, "connect() first"
        settings = self.settings
        limit = asyncio.Semaphore(max_concurrency or num)

        async def one(req: SampleRequest) -> None:
            async with limit:
                await send_request(self.http, settings, req)

        await asyncio.gather(*(one(requests[i % len(requests)]) for i in range(num)))


async def _run_passes(
    cfg: BenchServeConfig,
    passes: Sequence[tuple[int | None, int]],
    requests: Sequence[SampleRequest] | None,
    on_result: Callable[[BenchResult], None] | None = None,
) -> list[BenchResult]:
    """Run one pass per (max_concurrency, num_prompts), all from the same dataset and connection pool."""
    cfg.validate()
    if requests is not None and not requests:
        raise BenchError("no requests to send")
    tokenizer = _load_tokenizer(cfg) if requests is None else None
    session = _Session(cfg)
    try:
        # The server is checked with a one-prompt dataset first: building a large dataset takes seconds
        # and is wasted when the server is down.
        probe = requests[0] if requests is not None else build_requests(cfg, 1, tokenizer)[0]
        settings = await session.connect(probe)
        needed = max(n for _, n in passes)
        pool = list(requests) if requests is not None else build_requests(cfg, needed, tokenizer)
        results = []
        noted: set[str] = set()
        for concurrency, wanted in passes:
            # Without oversampling a short file dataset is sent once, as it is, rather than cycled.
            num_prompts = min(wanted, len(pool)) if cfg.no_oversample else wanted
            # A sweep reuses the dataset's first prompts so every pass sees the same shapes.
            batch = [pool[i % len(pool)] for i in range(num_prompts)]
            await session.warm_up(batch, concurrency)
            if cfg.reset_prefix_cache:
                state = await session.reset_prefix_cache()
                if state != "reset" and state not in noted:
                    noted.add(state)
                    print(f"note: the server's prefix cache was not reset before the pass ({state}): prompts "
                          "repeated from the test request, warm-ups or earlier passes may be served from it")
            desc = f"concurrency {concurrency}" if concurrency else ""
            outputs, duration, peak = await session.run_pass(batch, concurrency, desc)
            metrics = compute_metrics(
                outputs,
                duration,
                cfg.percentiles,
                concurrency,
                peak,
                percentile_metrics=cfg.percentile_metrics,
                goodput=cfg.goodput,
            )
            pass_cfg = dataclasses.replace(cfg, max_concurrency=concurrency, num_prompts=num_prompts)
            results.append(BenchResult(pass_cfg, settings.model, metrics, outputs))
            if on_result is not None:
                on_result(results[-1])
        return results
    finally:
        await session.close()


async def run_benchmark(cfg: BenchServeConfig, requests: Sequence[SampleRequest] | None = None) -> BenchResult:
    """Run one benchmark pass as `cfg` describes; `requests` replaces the dataset built from `cfg`.

    Raises `BenchError` when the settings are invalid or the server is unreachable or rejects the
    first (test) request; failures of individual requests during the pass are counted, not raised.
    """
    passes = [(cfg.max_concurrency, len(requests) if requests is not None else cfg.num_prompts)]
    return (await _run_passes(cfg, passes, requests))[0]


async def run_sweep(
    cfg: BenchServeConfig,
    concurrencies: Sequence[int],
    prompts_per_concurrency: int | None = None,
    requests: Sequence[SampleRequest] | None = None,
    on_result: Callable[[BenchResult], None] | None = None,
) -> list[BenchResult]:
    """One pass per max-concurrency level; each sends `prompts_per_concurrency` x level prompts, or
    `cfg.num_prompts` when that is None. `on_result` sees each pass as soon as it ends."""
    if not concurrencies or any(c < 1 for c in concurrencies):
        raise BenchError(f"sweep concurrencies must be >= 1, got {list(concurrencies)}")
    if prompts_per_concurrency is not None and prompts_per_concurrency < 1:
        raise BenchError(f"prompts per concurrency must be >= 1, got {prompts_per_concurrency}")
    passes = [(c, prompts_per_concurrency * c if prompts_per_concurrency else cfg.num_prompts) for c in concurrencies]
    return await _run_passes(cfg, passes, requests, on_result)
