"""Priority scheduling (`--scheduling-policy priority`, vLLM's v1 rules): the scheduler on its own with a tiny
block pool shows the admission order and the preemption victim under both policies; on the demo model (CPU)
greedy outputs are the same whatever the policy and the priorities, with preemptions, prefix caching and
speculative decoding; under fcfs a priority other than 0 is refused."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from nibble.engine.block_manager import BlockManager
from nibble.engine.config import EngineConfig, EngineConfigError
from nibble.engine.llm import LLM
from nibble.engine.request import Request, RequestStatus
from nibble.engine.sampling_params import SamplingParams, SamplingParamsError
from nibble.engine.scheduler import ScheduledBatch, Scheduler

BLOCK = 4


def _request(name: str, priority: int, arrival: float, prompt_len: int = 2 * BLOCK) -> Request:
    return Request(name, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=8, priority=priority),
                   arrival_time=arrival)


def _scheduler(policy: str, num_blocks: int = 64, max_num_seqs: int = 8) -> Scheduler:
    blocks = BlockManager(num_blocks=num_blocks, block_size=BLOCK, num_state_slots=max_num_seqs + 1)
    return Scheduler(blocks, max_num_seqs=max_num_seqs, max_num_batched_tokens=256, policy=policy)


def _run(sched: Scheduler) -> ScheduledBatch:
    """One round, with the model step's effect on the requests: their fed tokens become computed."""
    out = sched.schedule()
    for req, n in zip(out.requests, out.num_new_tokens):
        req.num_computed_tokens += n
    return out


def _names(reqs: object) -> list[str]:
    return [r.request_id for r in reqs]  # type: ignore[attr-defined]


@pytest.mark.parametrize(("policy", "expected"), [("fcfs", ["a", "c", "b", "d", "e"]),
                                                  ("priority", ["b", "d", "c", "a", "e"])])
def test_admission_order(policy: str, expected: list[str]) -> None:
    """One sequence at a time: each round admits the first waiting request; under priority that is the lowest
    value, ties going to the earlier arrival, whatever the order they were added in."""
    sched = _scheduler(policy, max_num_seqs=1)
    for name, priority, arrival in (("a", 5, 0.0), ("c", 3, 2.0), ("b", 1, 1.0), ("d", 1, 3.0), ("e", 5, 4.0)):
        sched.add(_request(name, priority, arrival))
    admitted = []
    while sched.waiting:
        out = _run(sched)
        assert len(out.requests) == 1
        admitted.append(out.requests[0].request_id)
        sched.finish(out.requests[0], RequestStatus.FINISHED_STOPPED)
    assert admitted == expected
    assert sched.blocks.all_free()


def _full_pool(policy: str) -> tuple[Scheduler, dict[str, Request]]:
    """Three running requests of 8 prompt tokens (two blocks each) filling a pool of six blocks, each with one
    generated token, so that each one's next token needs a third block."""
    sched = _scheduler(policy, num_blocks=7)
    reqs = {name: _request(name, priority, arrival)
            for name, priority, arrival in (("a", 0, 0.0), ("b", 2, 1.0), ("c", 1, 2.0))}
    for req in reqs.values():
        sched.add(req)
    assert sorted(_names(_run(sched).requests)) == ["a", "b", "c"]
    assert sched.blocks.num_free_blocks == 0
    for req in reqs.values():
        req.output_token_ids.append(7)
    return sched, reqs


@pytest.mark.parametrize(("policy", "victim"), [("fcfs", "c"), ("priority", "b")])
def test_preemption_victim(policy: str, victim: str) -> None:
    """When a's next token needs a block, fcfs preempts the latest arrival (c), priority the largest (priority,
    arrival) (b, though it arrived before c); the victim goes back to waiting with its tokens kept."""
    sched, reqs = _full_pool(policy)
    out = _run(sched)
    assert out.num_preempted == 1
    assert _names(sched.waiting) == [victim]
    assert reqs[victim].status == RequestStatus.WAITING and reqs[victim].num_computed_tokens == 0
    assert reqs[victim].output_token_ids == [7]
    assert _names(out.requests) == [n for n in "abc" if n != victim]


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_a_request_scheduled_earlier_in_the_round_gives_its_tokens_back(policy: str) -> None:
    """w (priority 5) comes first in the running list and takes the last free block; then a (priority 0) needs
    one. fcfs preempts a itself (the latest arrival not yet scheduled). Priority preempts w, which gives back
    the tokens and blocks it had been given this round; that round admits no waiting request (n would fit),
    and w goes back to waiting behind n, which has the lower priority value."""
    sched = _scheduler(policy, num_blocks=6)
    w, a = _request("w", 5, 0.0), _request("a", 0, 1.0)
    sched.add(w)
    sched.add(a)
    _run(sched)
    for req in (w, a):
        req.output_token_ids.append(7)
    n = _request("n", 0, 2.0, prompt_len=BLOCK)
    sched.add(n)
    out = _run(sched)
    assert out.num_preempted == 1
    if policy == "fcfs":
        assert _names(out.requests) == ["w"] and out.num_new_tokens == [1]
        assert _names(sched.waiting) == ["a", "n"]  # a cannot fit again, so n (behind it) waits as well
    else:
        assert _names(out.requests) == ["a"] and out.num_new_tokens == [1]
        assert w.block_ids == [] and w.num_computed_tokens == 0
        assert _names(sched.waiting) == ["n", "w"]
        a.output_token_ids.append(8)
        assert _names(_run(sched).requests) == ["a", "n"]  # w's 3 blocks do not fit any more
    assert out.num_tokens == 1


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_a_waiting_request_never_preempts_a_running_one(policy: str) -> None:
    """As vLLM's v1 scheduler: with the batch full (max_num_seqs) or blocks short, a waiting request waits,
    however high its priority."""
    for sched in (_scheduler(policy, max_num_seqs=1), _scheduler(policy, num_blocks=3)):
        low = _request("low", 9, 0.0, prompt_len=2 * BLOCK - 1)  # its next token still fits its two blocks
        sched.add(low)
        _run(sched)
        low.output_token_ids.append(7)
        sched.add(_request("high", -1, 1.0))
        out = _run(sched)
        assert _names(out.requests) == ["low"] and out.num_preempted == 0 and _names(sched.waiting) == ["high"]


def test_priority_is_validated() -> None:
    with pytest.raises(EngineConfigError, match="--scheduling-policy"):
        EngineConfig(model="demo", scheduling_policy="lifo")
    with pytest.raises(SamplingParamsError, match="priority"):
        SamplingParams(priority=1.5)  # type: ignore[arg-type]
    with pytest.raises(SamplingParamsError, match="priority"):
        SamplingParams(priority=True)


GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
PRIORITIES = [3, 0, 2, 0, -1, 5]


def _prompts(lens: list[int], shared: int = 0, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, 990, (shared,), generator=gen).tolist()
    return [prefix + torch.randint(0, 990, (n,), generator=gen).tolist() for n in lens]


def _tokens(llm: LLM, prompts: list[list[int]], **kwargs: object) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, **kwargs)]  # type: ignore[arg-type]


@pytest.mark.parametrize("settings", [
    # a 16-token budget chunks the prefills, 14 blocks of 16 tokens force preemptions
    {"max_num_batched_tokens": 16, "enable_prefix_caching": False, "extra": {"num_kv_blocks": 14}},
    # prompts sharing a 300-token prefix: cuts, requests waiting for them, hits, evictions and preemptions
    {"max_num_batched_tokens": 40, "extra": {"num_kv_blocks": 48}, "shared": 300, "max_model_len": 512},
    # speculative decoding: verify steps preempt too
    {"max_num_batched_tokens": 32, "num_speculative_tokens": 2, "enable_prefix_caching": False,
     "extra": {"num_kv_blocks": 16}},
])
def test_greedy_outputs_do_not_depend_on_the_policy(settings: dict[str, object]) -> None:
    settings = {"max_model_len": 160, **settings}
    shared = int(settings.pop("shared", 0))  # type: ignore[call-overload]
    prompts = _prompts([5, 40, 17, 3, 64, 29], shared=shared)
    fcfs = LLM(device="cpu", **settings)  # type: ignore[arg-type]
    ref = _tokens(fcfs, prompts)
    assert fcfs.engine.num_preemptions > 0
    by_priority = LLM(device="cpu", scheduling_policy="priority", **settings)  # type: ignore[arg-type]
    assert _tokens(by_priority, prompts, priority=PRIORITIES) == ref
    assert _tokens(by_priority, prompts, priority=PRIORITIES[::-1]) == ref
    engine = by_priority.engine
    assert engine.num_preemptions > 0
    assert engine.stats()["prefix_cache_hits"] > 0 or not shared
    assert engine.blocks.all_free() and not engine.has_unfinished_requests()


def test_engine_admits_by_priority_and_fcfs_refuses_priorities() -> None:
    """One sequence at a time, so requests finish in the order they are admitted."""
    prompts = _prompts([6, 6, 6, 6], seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    for policy, priority, order in (("priority", [2, 0, 1, 0], [1, 3, 2, 0]), ("fcfs", [0, 0, 0, 0], [0, 1, 2, 3])):
        llm = LLM(device="cpu", max_model_len=64, max_num_seqs=1, scheduling_policy=policy)
        engine = llm.engine
        for i, (p, prio) in enumerate(zip(prompts, priority)):
            engine.add_request(f"r{i}", p, dataclasses.replace(params, priority=prio))
        finished = []
        while engine.has_unfinished_requests():
            finished += [int(o.request_id[1:]) for o in engine.step() if o.finished]
        assert finished == order
    with pytest.raises(SamplingParamsError, match=r"^priority .*--scheduling-policy priority"):
        llm.generate(prompts[:2], params, priority=[0, 1])
    assert not llm.engine.has_unfinished_requests()  # the first prompt was not left queued
    with pytest.raises(Exception, match=r"max_model_len|context|exceed"):
        llm.generate([prompts[0], [1] * 200], params)  # the second prompt does not fit
    assert not llm.engine.has_unfinished_requests() and llm.engine.blocks.all_free()
    with pytest.raises(ValueError, match="2 priorities for 1 prompts"):
        llm.generate(prompts[:1], params, priority=[0, 1])
    assert [o.outputs[0].token_ids for o in llm.generate(prompts[:1], params, priority=[0])] == \
        [o.outputs[0].token_ids for o in llm.generate(prompts[:1], params)]
