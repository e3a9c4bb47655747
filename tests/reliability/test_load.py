"""A bounded load test through the real HTTP server on the CPU demo model: 200 requests, 32 at a time, mixed
streaming / non-streaming, completions / chat, random sampling settings and max_tokens, about 20% of them
cancelled by the client at a random point. Every request must either complete with a finish_reason or have
been cancelled by the client (none lost, none hung: each has a hard timeout), and afterwards the engine must
hold no request and every KV block and state slot must be free; the server must still serve. The same
traffic also goes straight into the AsyncEngine on a cache small enough to force preemptions."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from nibble.engine.async_engine import AsyncEngine
from nibble.engine.llm_engine import LLMEngine
from nibble.engine.sampling_params import SamplingParams

from .conftest import ServerHandle, engine_config, served, wait_idle

NUM_REQUESTS = 200
CONCURRENCY = 32
CANCEL_FRACTION = 0.2
HARD_TIMEOUT_S = 90.0
WORDS = ("alpha beta gamma delta nibble model server token batch stream cache kernel expert router "
         "the a of and to in is it you that he was for on are with as I his they be at").split()


@dataclass
class Outcome:
    kind: str  # completed | cancelled | failed | hung
    detail: str = ""
    finish: list[str] = field(default_factory=list)


@pytest.fixture(scope="module")
def server() -> Iterator[ServerHandle]:
    with served(LLMEngine(engine_config(max_num_seqs=CONCURRENCY, max_num_batched_tokens=1024))) as handle:
        yield handle


def _sampling(rng: random.Random) -> dict[str, Any]:
    body: dict[str, Any] = {"max_tokens": rng.randint(1, 10)}
    if rng.random() < 0.5:
        body["temperature"] = 0
    else:
        body.update(temperature=rng.choice([0.5, 1.0, 1.5]), top_p=rng.choice([1.0, 0.9, 0.5]),
                    top_k=rng.choice([-1, 5, 50]), seed=rng.randint(0, 2**31))
    extras = [("presence_penalty", 0.5), ("frequency_penalty", -0.3), ("repetition_penalty", 1.2),
              ("min_tokens", 1), ("stop", [" the", "a"]), ("ignore_eos", True)]
    for name, value in rng.sample(extras, rng.randint(0, 2)):
        body[name] = value
    return body


def _request(rng: random.Random, i: int) -> tuple[str, dict[str, Any]]:
    body = _sampling(rng)
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 60)))
    body["stream"] = rng.random() < 0.5
    if rng.random() < 0.5:
        if rng.random() < 0.3:
            body["messages"] = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}]
        else:
            body["messages"] = [{"role": "user", "content": text}]
        body["chat_template_kwargs"] = {"enable_thinking": rng.random() < 0.5}
        if rng.random() < 0.3:
            body["logprobs"], body["top_logprobs"] = True, rng.randint(0, 3)
        return "/v1/chat/completions", body
    roll = rng.random()
    body["prompt"] = ([rng.randint(0, 900) for _ in range(rng.randint(1, 40))] if roll < 0.2
                      else [text, f"request {i}"] if roll < 0.3 else text)
    if rng.random() < 0.3:
        body["logprobs"] = rng.randint(0, 3)
    return "/v1/completions", body


def _check_final(body: dict[str, Any], choices: list[dict[str, Any]], usage: dict[str, Any] | None) -> list[str]:
    finish = [c.get("finish_reason") for c in choices]
    assert finish and all(f in ("stop", "length") for f in finish), finish
    if usage is not None:
        n = len(body["prompt"]) if isinstance(body.get("prompt"), list) and isinstance(body["prompt"][0], str) else 1
        assert usage["completion_tokens"] <= body["max_tokens"] * n, (usage, body)
    return finish  # type: ignore[return-value]


async def _stream(http: httpx.AsyncClient, path: str, body: dict[str, Any], cancel_after: int | None) -> Outcome:
    async with http.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            return Outcome("failed", f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        events: list[Any] = []
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            events.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
            if cancel_after is not None and len(events) >= cancel_after:
                return Outcome("cancelled", f"after {len(events)} events")
    if not events or events[-1] != "[DONE]":
        return Outcome("failed", f"stream ended without [DONE]: {events[-2:]}")
    if any("error" in e for e in events[:-1]):
        return Outcome("failed", f"error event: {events[-2]}")
    finals: dict[int, dict[str, Any]] = {}
    for e in events[:-1]:
        for c in e["choices"]:
            assert c["index"] not in finals, f"chunk after the final one of choice {c['index']}"
            if c.get("finish_reason") is not None:
                finals[c["index"]] = c
    expected = len(body["prompt"]) if isinstance(body.get("prompt"), list) and isinstance(body["prompt"][0], str) \
        else 1
    assert len(finals) == expected, (finals, body)
    return Outcome("completed", finish=_check_final(body, list(finals.values()), None))


async def _one(http: httpx.AsyncClient, path: str, body: dict[str, Any], cancel: tuple[str, float] | None
               ) -> Outcome:
    if body["stream"]:
        cancel_after = int(cancel[1] * 8) + 1 if cancel else None
        return await _stream(http, path, body, cancel_after)
    call = http.post(path, json=body)
    if cancel is not None:
        try:
            r = await asyncio.wait_for(call, timeout=cancel[1])
        except asyncio.TimeoutError:
            return Outcome("cancelled", f"after {cancel[1]:.2f} s")
    else:
        r = await call
    if r.status_code != 200:
        return Outcome("failed", f"HTTP {r.status_code}: {r.text[:300]}")
    data = r.json()
    return Outcome("completed", finish=_check_final(body, data["choices"], data.get("usage")))


async def _run_load(url: str, seed: int) -> list[tuple[str, dict[str, Any], Outcome]]:
    rng = random.Random(seed)
    plans = []
    for i in range(NUM_REQUESTS):
        path, body = _request(rng, i)
        cancel = ("client", rng.uniform(0.02, 1.0)) if rng.random() < CANCEL_FRACTION else None
        plans.append((path, body, cancel))
    gate = asyncio.Semaphore(CONCURRENCY)
    limits = httpx.Limits(max_connections=CONCURRENCY * 2, max_keepalive_connections=CONCURRENCY)
    async with httpx.AsyncClient(base_url=url, timeout=HARD_TIMEOUT_S, limits=limits) as http:

        async def guarded(path: str, body: dict[str, Any], cancel: Any) -> Outcome:
            async with gate:
                try:
                    return await asyncio.wait_for(_one(http, path, body, cancel), HARD_TIMEOUT_S)
                except asyncio.TimeoutError:
                    return Outcome("hung", f"no answer within {HARD_TIMEOUT_S} s")
                except AssertionError as e:
                    return Outcome("failed", f"bad response: {e}")
                except httpx.HTTPError as e:
                    return Outcome("failed", f"{type(e).__name__}: {e}")

        outcomes = await asyncio.gather(*(guarded(*p) for p in plans))
    return [(p[0], p[1], o) for p, o in zip(plans, outcomes)]


def test_load_mixed_with_cancellations(server: ServerHandle) -> None:
    t0 = time.monotonic()
    results = asyncio.run(_run_load(server.url, seed=20261202))
    elapsed = time.monotonic() - t0
    kinds = Counter(o.kind for _, _, o in results)
    bad = [(path, body, o) for path, body, o in results if o.kind in ("failed", "hung")]
    assert not bad, f"{len(bad)} bad requests, e.g. {bad[:3]}"
    assert kinds["completed"] + kinds["cancelled"] == NUM_REQUESTS
    assert kinds["cancelled"] >= NUM_REQUESTS * CANCEL_FRACTION / 3, kinds
    finishes = Counter(f for _, _, o in results for f in o.finish)
    print(f"\nload: {NUM_REQUESTS} requests in {elapsed:.1f} s: {dict(kinds)}, finish reasons {dict(finishes)}")

    assert wait_idle(server.engine, timeout=15), server.engine.stats()
    core = server.engine.engine
    assert not core.requests and core.blocks.all_free()
    # every slot is free again, apart from those of cached prefixes (the load shares chat-template prefixes)
    num_entries = len(core.blocks.prefix or ())
    assert len(core.blocks.free_slots) + num_entries == core.blocks.num_state_slots - 1
    with httpx.Client(base_url=server.url, timeout=30) as http:
        assert http.get("/health").status_code == 200
        r = http.post("/v1/completions", json={"prompt": "still there?", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length")


async def _churn(engine: AsyncEngine, seed: int) -> Counter[str]:
    """200 requests straight into the AsyncEngine, 32 at a time; about 20% dropped by their consumer after
    a random number of outputs (0 = right after admission)."""
    rng = random.Random(seed)
    gate = asyncio.Semaphore(CONCURRENCY)

    async def one(i: int) -> str:
        prompt: str | list[int] = (" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 60)))
                                   if rng.random() < 0.7 else [rng.randint(0, 900) for _ in range(rng.randint(1, 60))])
        body = _sampling(rng)
        params = SamplingParams(max_tokens=body["max_tokens"], temperature=body.get("temperature", 1.0),
                                top_p=body.get("top_p", 1.0), top_k=body.get("top_k", -1), seed=body.get("seed"),
                                presence_penalty=body.get("presence_penalty", 0.0),
                                repetition_penalty=body.get("repetition_penalty", 1.0),
                                min_tokens=body.get("min_tokens", 0), stop=body.get("stop", []),
                                logprobs=rng.choice([None, 0, 2]))
        drop_after = rng.randint(0, 4) if rng.random() < CANCEL_FRACTION else None
        async with gate:
            seen = 0
            async with contextlib.aclosing(engine.generate(prompt, params, request_id=f"churn-{i}")) as outputs:
                async for out in outputs:
                    if drop_after is not None and seen >= drop_after:
                        return "cancelled"
                    seen += 1
                    if out.finished:
                        reason = out.outputs[0].finish_reason
                        assert reason in ("stop", "length"), (reason, out.error)
                        assert len(out.outputs[0].token_ids) <= params.max_tokens
                        return "completed"
            return "lost"

    async def guarded(i: int) -> str:
        try:
            return await asyncio.wait_for(one(i), HARD_TIMEOUT_S)
        except asyncio.TimeoutError:
            return "hung"

    return Counter(await asyncio.gather(*(guarded(i) for i in range(NUM_REQUESTS))))


def test_engine_churn_with_preemption() -> None:
    """The same traffic without HTTP, on a KV cache far too small for 32 sequences, so requests are
    preempted, recomputed and aborted in every state (waiting, prefilling, decoding, preempted); on a GPU
    decode steps go through CUDA graphs."""
    core = LLMEngine(engine_config(max_num_seqs=CONCURRENCY, max_model_len=160, extra={"num_kv_blocks": 12}))
    engine = AsyncEngine(core)
    try:
        kinds = asyncio.run(_churn(engine, seed=7))
        assert kinds["completed"] + kinds["cancelled"] == NUM_REQUESTS, kinds
        assert kinds["cancelled"] >= NUM_REQUESTS * CANCEL_FRACTION / 3, kinds
        assert wait_idle(engine, timeout=15), engine.stats()
        assert not core.requests and core.blocks.all_free()
        assert core.num_preemptions > 0, "the cache was meant to be too small: no preemption happened"
    finally:
        engine.shutdown()
