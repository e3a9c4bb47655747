"""`LLM(..., tensor_parallel_size=2)`: the engine process is rank 0 and spawns rank 1. Greedy generations
(batched, chunked prefill, then decode) match the single-process engine, with experts tensor-split or
expert-parallel; the worker processes go away cleanly on shutdown, when a worker dies (the engine then
fails fast instead of hanging in a collective) and when rank 0 dies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from nibble.engine.llm import LLM
from nibble.engine.parallel import WorkerError
from nibble.engine.sampling_params import SamplingParams
from tests.parallel.launch import REPO_ROOT

PROMPT_LENS = [9, 3, 17, 1, 6]
MAX_TOKENS = 12
ENGINE_ARGS = dict(device="cpu", block_size=4, max_num_batched_tokens=16, max_model_len=64, max_num_seqs=4)


def _prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def _generate(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(_prompts(llm.engine.model_config.vocab_size), params)
    return [o.outputs[0].token_ids for o in outs]


def _gone(pid: int, timeout: float) -> bool:
    """Whether process `pid` exits (or is a zombie) within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.1)
    return False


@pytest.fixture(scope="module")
def expected(checkpoints: dict[str, Path]) -> list[list[int]]:
    """Greedy generations of the single-process engine."""
    return _generate(LLM(model=str(checkpoints["fp32"]), **ENGINE_ARGS))


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_engine_tp2_matches_single_process(expert_parallel: bool, checkpoints: dict[str, Path],
                                           expected: list[list[int]]) -> None:
    model = str(checkpoints["fp32"])
    llm = LLM(model=model, tensor_parallel_size=2, enable_expert_parallel=expert_parallel, **ENGINE_ARGS)
    workers = llm.engine.workers
    assert workers is not None
    try:
        assert _generate(llm) == expected
        assert llm.engine.blocks.all_free()
        if expert_parallel:
            # A worker that dies makes the next step fail at once, not hang in a collective.
            os.kill(workers.procs[0].pid, signal.SIGKILL)
            time.sleep(1.5)
            with pytest.raises(WorkerError, match="rank 1 exited"):
                _generate(llm)
    finally:
        llm.engine.shutdown()
    if not expert_parallel:
        assert [p.returncode for p in workers.procs] == [0]


def test_priority_scheduling_tp2_matches_single_process(checkpoints: dict[str, Path],
                                                       expected: list[list[int]]) -> None:
    """Priority scheduling decides on rank 0 alone: with a cache small enough to preempt, rank 1 follows the
    other order and the generations are unchanged."""
    llm = LLM(model=str(checkpoints["fp32"]), tensor_parallel_size=2, scheduling_policy="priority",
              extra={"num_kv_blocks": 18}, **ENGINE_ARGS)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    try:
        outs = llm.generate(_prompts(llm.engine.model_config.vocab_size), params, priority=[2, 0, 1, 0, 3])
        assert [o.outputs[0].token_ids for o in outs] == expected
        assert llm.engine.num_preemptions > 0 and llm.engine.blocks.all_free()
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("method", ["mtp", "ngram"])
def test_speculative_decoding_tp2_matches_single_process(checkpoints: dict[str, Path], expected: list[list[int]],
                                                         method: str) -> None:
    """Speculative decoding under tensor parallelism: rank 1 follows every prefill and verify step; with MTP
    drafts it receives what rank 0 sampled or accepted and drafts with its share of the head, with n-gram
    drafts (found by rank 0's engine) it runs the target passes alone. Drafts are the expected continuation
    (so that verify steps accept some: rank 0 sets them in the step inputs both ranks get), every third one
    corrupted; the generations equal the single-process engine's without speculation."""
    model = str(checkpoints["fp32"])
    llm = LLM(model=model, tensor_parallel_size=2, num_speculative_tokens=2, speculative_method=method,
              **ENGINE_ARGS)
    engine = llm.engine
    refs = {tuple(p): p + e for p, e in zip(_prompts(engine.model_config.vocab_size), expected)}
    real = engine.runner.execute_spec
    count = [0]

    def oracle(sched, *args):  # type: ignore[no-untyped-def]
        if sched.spec_verify:
            for req in sched.requests:
                ref = refs[tuple(req.prompt_token_ids)]
                start = req.num_computed_tokens + 1
                count[0] += 1
                req.draft_token_ids = [(ref[p] if p < len(ref) else 0) + (count[0] % 3 == 0 and j == 0)
                                       for j, p in enumerate(range(start, start + 2))]
        return real(sched, *args)

    engine.runner.execute_spec = oracle  # type: ignore[method-assign]
    try:
        assert _generate(llm) == expected
        stats = engine.stats()
        assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]
        assert engine.blocks.all_free()
    finally:
        engine.shutdown()


def _head_drafts(llm: LLM) -> tuple[list[list[int]], list[list[list[int]]]]:
    """Generations with the MTP head's own drafts, and the drafts each verify step checked."""
    runner = llm.engine.runner
    real = runner.execute_spec
    drafts: list[list[list[int]]] = []

    def spy(sched, *args):  # type: ignore[no-untyped-def]
        if sched.spec_verify:
            drafts.append([list(r.draft_token_ids) for r in sched.requests])
        return real(sched, *args)

    runner.execute_spec = spy  # type: ignore[method-assign]
    return _generate(llm), drafts


def test_mtp_head_drafts_the_same_under_tensor_parallelism(checkpoints: dict[str, Path],
                                                           expected: list[list[int]]) -> None:
    """The head's own drafts (its layer split over the ranks like the model's) are those of one process."""
    model = str(checkpoints["fp32"])
    single, single_drafts = _head_drafts(LLM(model=model, num_speculative_tokens=2, **ENGINE_ARGS))
    llm = LLM(model=model, tensor_parallel_size=2, num_speculative_tokens=2, **ENGINE_ARGS)
    try:
        tp, tp_drafts = _head_drafts(llm)
    finally:
        llm.engine.shutdown()
    assert single == tp == expected
    assert len(tp_drafts) > 5 and tp_drafts == single_drafts


def test_prompt_logprobs_under_tensor_parallelism(checkpoints: dict[str, Path]) -> None:
    """Rank 1 computes its share of the head's logits for every prompt position too (a collective); rank 0's
    prompt log-probabilities equal the single-process engine's."""
    model = str(checkpoints["fp32"])
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=2)
    prompts = _prompts(254)

    def values(llm: LLM) -> list[list]:
        return [[None if e is None else (e.token_id, e.logprob, sorted(e.top)) for e in o.prompt_logprobs or []]
                for o in llm.generate(prompts, params)]

    want = values(LLM(model=model, **ENGINE_ARGS))
    llm = LLM(model=model, tensor_parallel_size=2, **ENGINE_ARGS)
    try:
        got = values(llm)
    finally:
        llm.engine.shutdown()
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert len(g) == len(w) and g[0] is None
        for x, y in zip(g[1:], w[1:]):
            assert x[0] == y[0] and x[2] == y[2] and abs(x[1] - y[1]) < 1e-3


def test_prefix_cache_state_copies_reach_every_rank(checkpoints: dict[str, Path]) -> None:
    """Requests starting from a cached prefix under tensor parallelism: the GDN state and KV block copies
    travel in the step inputs to rank 1 as well, so the generations equal the single-process engine's
    without caching."""
    model = str(checkpoints["fp32"])
    gen = torch.Generator().manual_seed(5)
    shared = torch.randint(0, 250, (20,), generator=gen).tolist()
    prompts = [shared + torch.randint(0, 250, (n,), generator=gen).tolist() for n in (3, 5, 2, 7)]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    plain = LLM(model=model, enable_prefix_caching=False, **ENGINE_ARGS)
    expected = [plain.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    llm = LLM(model=model, tensor_parallel_size=2, **ENGINE_ARGS)
    try:
        assert llm.engine.blocks.prefix is not None
        llm.engine.blocks.prefix.min_split_tokens = 8  # the test's prompts are short
        outs = [llm.generate([p], params)[0] for p in prompts]
        assert [o.outputs[0].token_ids for o in outs] == expected
        assert [o.num_cached_tokens for o in outs] == [0, 0, 20, 20]
        # the next turn continues the last one: its entry ends inside a block, whose KV is copied on both ranks
        turn = prompts[-1] + expected[-1] + [5, 6]
        out = llm.generate([turn], params)[0]
        assert out.num_cached_tokens == len(turn) - 3
        assert out.outputs[0].token_ids == plain.generate([turn], params)[0].outputs[0].token_ids
        assert llm.engine.blocks.all_free()
    finally:
        llm.engine.shutdown()


def test_workers_exit_when_rank0_dies(checkpoints: dict[str, Path]) -> None:
    script = (
        "import sys\n"
        "from nibble.engine.llm import LLM\n"
        f"llm = LLM(model={str(checkpoints['fp32'])!r}, tensor_parallel_size=2, **{ENGINE_ARGS!r})\n"
        "print(llm.engine.workers.procs[0].pid, flush=True)\n"
        "sys.stdin.read()\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    rank0 = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             env=env, cwd=REPO_ROOT, text=True)
    try:
        assert rank0.stdout is not None
        worker_pid = int(rank0.stdout.readline())
        rank0.kill()
        rank0.wait()
        assert _gone(worker_pid, timeout=20), f"worker {worker_pid} outlived rank 0"
    finally:
        if rank0.poll() is None:
            rank0.kill()


def test_a_step_failing_on_rank_0_stops_the_workers(checkpoints: dict[str, Path]) -> None:
    """A step that fails on rank 0 after the workers got it (they wait in the forward's collectives for a rank
    that never comes): the engine stops the workers and raises WorkerError at once, and every later step too,
    instead of hanging at the next broadcast."""
    llm = LLM(model=str(checkpoints["fp32"]), tensor_parallel_size=2, **ENGINE_ARGS)
    workers = llm.engine.workers
    assert workers is not None
    model = llm.engine.runner.model

    def broken(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise RuntimeError("injected failure")

    model.forward = broken  # type: ignore[method-assign]
    try:
        t0 = time.monotonic()
        with pytest.raises(WorkerError, match=r"step failed on rank 0 .*injected failure"):
            _generate(llm)
        assert time.monotonic() - t0 < 30
        assert _gone(workers.procs[0].pid, 10) and workers.failed
        with pytest.raises(WorkerError, match="injected failure"):
            _generate(llm)
    finally:
        llm.engine.shutdown()
