"""When `nibble bench serve` sends each request: gamma-distributed gaps at a fixed request rate, or at a rate
that ramps up over the pass (`vllm bench serve --ramp-up-strategy`).

A ramp-up sets the rate request by request, as vLLM does: the i-th of n requests is sent at
`start + (end - start) * i / (n - 1)` requests/s (linear) or `start * (end / start) ** (i / (n - 1))`
(exponential), so the rate moves from start to end in request order, not in wall time. The gap before a request
is drawn at that request's rate; the first request goes out at once.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Sequence
from typing import TypeVar

import numpy as np

RAMP_UP_STRATEGIES = ("linear", "exponential")

T = TypeVar("T")


def ramp_up_rates(strategy: str, start_rps: float, end_rps: float, num: int) -> np.ndarray:
    """The request rate (requests/s) of each of `num` requests along a ramp from `start_rps` to `end_rps`."""
    if strategy not in RAMP_UP_STRATEGIES:
        raise ValueError(f"unknown ramp-up strategy {strategy!r} (choose from {', '.join(RAMP_UP_STRATEGIES)})")
    progress = np.arange(num, dtype=np.float64) / max(num - 1, 1)
    if strategy == "linear":
        return start_rps + (end_rps - start_rps) * progress
    return start_rps * (end_rps / start_rps) ** progress


def arrival_offsets(
    num: int,
    rate: float,
    burstiness: float,
    seed: int,
    ramp_up: tuple[str, float, float] | None = None,
) -> np.ndarray:
    """Send times of `num` requests in seconds from the start of the pass, non-decreasing, the first 0.

    Gaps are gamma-distributed with shape `burstiness` (1 = Poisson arrivals) and mean 1/rate, where the rate
    is `rate` for every request, or follows `ramp_up` = (strategy, start_rps, end_rps) when that is given.
    An infinite fixed rate sends everything at once.
    """
    if num <= 0:
        return np.zeros(0)
    if ramp_up is None:
        if math.isinf(rate):
            return np.zeros(num)
        rates = np.full(num, float(rate))
    else:
        rates = ramp_up_rates(*ramp_up, num)
    rng = np.random.default_rng(seed)
    # Gap i separates request i - 1 from request i, drawn at request i's rate; request 0's own rate is never
    # used, which keeps a linear ramp that starts at 0 requests/s well defined.
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rates[1:] * burstiness))
    return np.concatenate(([0.0], np.cumsum(gaps)))


async def paced(items: Sequence[T], offsets: Sequence[float]) -> AsyncIterator[T]:
    """Yield `items[i]` once `offsets[i]` seconds have passed since the first was yielded.

    The offsets are absolute from the start, so a late wake-up of the event loop delays one request and is
    not carried into the following gaps (which would lower the rate below the one asked for).
    """
    start = time.perf_counter()
    for item, offset in zip(items, offsets):
        delay = start + float(offset) - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        yield item
