"""Prefix caching (nibble/engine/prefix_cache.py): the digests, the index, the reference-counted blocks,
and the engine end to end on the demo model (CPU), where every output must equal the same engine's output
with prefix caching off: sequential and batched requests sharing a prefix, chunked prefill around the
split point, preemption and eviction on a tiny KV pool, seeded sampling, several requests for one prompt."""

from __future__ import annotations

import pytest
import torch

from nibble.engine.block_manager import BlockManager
from nibble.engine.llm import LLM
from nibble.engine.prefix_cache import PrefixIndex, block_digests
from nibble.engine.request import Request
from nibble.engine.sampling_params import SamplingParams
from nibble.layers.forward_batch import GDNState, KVCache, ModelCaches

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
BLOCK = 16


def _ids(n: int, gen: torch.Generator) -> list[int]:
    return torch.randint(0, 990, (n,), generator=gen).tolist()


def test_block_digests_identify_whole_prefixes() -> None:
    gen = torch.Generator().manual_seed(0)
    a = _ids(70, gen)
    b = a[:40] + _ids(30, gen)
    da, db = block_digests(a, BLOCK), block_digests(b, BLOCK)
    assert len(da) == 70 // BLOCK  # the partial last block has no digest
    assert da[:2] == db[:2] and all(x != y for x, y in zip(da[2:], db[2:]))
    # a change in the first block changes every digest after it: digests are chains, not per-block
    c = [a[0] + 1, *a[1:]]
    assert all(x != y for x, y in zip(block_digests(c, BLOCK), da))
    assert block_digests(a[:48], BLOCK) == da[:3]
    assert len(set(da)) == len(da)


def test_index_splits_where_prompts_were_shared_and_matches_leaving_a_token() -> None:
    gen = torch.Generator().manual_seed(1)
    index = PrefixIndex(BLOCK, min_split_tokens=32)
    first = _ids(60, gen)
    second = first[:50] + _ids(20, gen)
    d1, d2 = block_digests(first, BLOCK), block_digests(second, BLOCK)
    assert index.split_point(d1, len(first), 0) is None  # nothing seen yet
    index.record(d1)
    assert index.split_point(d2, len(second), 0) == 48  # 3 shared full blocks
    assert index.split_point(d2, len(second), 32) is None  # only 16 more than a cached 32: not worth a cut
    assert PrefixIndex(BLOCK, min_split_tokens=64).split_point(d2, len(second), 0) is None
    index.add_split(d2[2])  # another request is already cut there
    assert index.split_point(d2, len(second), 0) is None
    index.remove_split(d2[2])
    assert index.match(d2, second) is None
    # an exact repeat splits at its last full block that leaves a token to compute
    assert index.split_point(d1, 48, 0) == 32


def test_index_version_changes_with_every_answer_that_can_change() -> None:
    """BlockManager.awaits_cut keeps a waiting request's answer until the index version moves: every change
    to entries, cuts under way or the recorded blocks must move it, and a removed entry must stop matching."""
    from nibble.engine.prefix_cache import PrefixEntry

    gen = torch.Generator().manual_seed(2)
    index = PrefixIndex(BLOCK, min_split_tokens=32)
    prompt = _ids(70, gen)
    d = block_digests(prompt, BLOCK)
    seen = []

    def moved() -> bool:
        seen.append(index.version)
        return len(seen) < 2 or seen[-1] != seen[-2]

    assert moved()
    index.record(d)
    assert moved()
    index.record(d[:2])  # nothing new
    assert not moved()
    index.add_split(d[3])  # the deepest block the prompt shares with what was recorded
    assert moved() and index.awaits_split(d, len(prompt), 0)
    index.remove_split(d[3])
    assert moved() and not index.awaits_split(d, len(prompt), 0)
    entry = PrefixEntry(d[1], 2 * BLOCK, [1, 2], 3, 0)
    tailed = PrefixEntry(d[1], 2 * BLOCK + 3, [1, 2, 4], 5, 0, tail=tuple(prompt[32:35]))
    index.add(entry)
    assert moved() and index.match(d, prompt, touch=False) is entry
    index.add(tailed)
    assert moved() and index.match(d, prompt, touch=False) is tailed
    index.remove(tailed)
    assert moved() and index.match(d, prompt, touch=False) is entry
    index.remove(entry)
    assert moved() and index.match(d, prompt, touch=False) is None and not index.digests
    small = PrefixIndex(BLOCK, max_seen=2)
    small.record(d[:2])
    v = small.version
    small.record(d[2:3])  # evicts the oldest record
    assert small.version > v + 1


def test_blocks_are_shared_by_reference_and_evicted_least_recently_used_first() -> None:
    manager = BlockManager(num_blocks=9, block_size=4, num_state_slots=4, prefix_caching=True)
    prompt = list(range(20))
    req = Request("a", prompt, GREEDY)
    manager.begin_round()
    assert manager.allocate_slot(req)
    manager.allocate(req, 12)
    req.num_computed_tokens = 12
    src, dst = manager.add_prefix(req)  # type: ignore[misc]
    assert src == req.state_slot and dst != src
    shared = req.block_ids[:3]
    other = Request("b", [*prompt[:16], 99, 98], GREEDY)
    entry = manager.match_prefix(other)
    assert entry is not None and entry.num_tokens == 12 and entry.block_ids == shared
    assert manager.attach_prefix(other, entry) is None  # block-aligned: nothing to copy
    assert other.num_computed_tokens == 12 and other.block_ids == shared
    assert all(manager.ref_counts[b] == 3 for b in shared)
    manager.free(req)
    manager.free(other)
    assert all(manager.ref_counts[b] == 1 for b in shared)  # the entry still holds them
    assert manager.all_free() and manager.usage == 0.0
    # entries created or used in this round stay; from the next round on, shortage evicts them
    assert manager.num_free_blocks == 5
    assert not manager.can_allocate(Request("c", list(range(40)), GREEDY), 24)
    assert len(manager.prefix or ()) == 1
    manager.begin_round()
    assert manager.can_allocate(Request("d", list(range(40)), GREEDY), 24)
    assert len(manager.prefix or ()) == 0 and all(manager.ref_counts[b] == 0 for b in shared)
    assert manager.num_free_blocks == 8


SHARED = 300  # tokens of the shared prefix; cached up to its last full block, 288


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(2)
    system = _ids(SHARED, gen)
    prompts = [system + _ids(n, gen) for n in (5, 9, 1, 30, 18)]
    prompts.append(list(prompts[0]))  # an exact repeat
    prompts.append(_ids(40, gen))  # unrelated
    return prompts


@pytest.fixture(scope="module")
def uncached() -> list[list[int]]:
    llm = LLM(device="cpu", max_model_len=512, enable_prefix_caching=False)
    return [llm.generate([p], GREEDY)[0].outputs[0].token_ids for p in _prompts()]


def test_sequential_requests_reuse_the_shared_prefix(uncached: list[list[int]]) -> None:
    llm = LLM(device="cpu", max_model_len=512)
    prompts = _prompts()
    outs = [llm.generate([p], GREEDY)[0] for p in prompts]
    assert [o.outputs[0].token_ids for o in outs] == uncached
    # the first request has nobody to share with, the second discovers the shared prefix (cut at its last
    # full block) and computes it, the later ones start from there
    boundary = SHARED // BLOCK * BLOCK
    cached = [o.num_cached_tokens for o in outs]
    assert cached[:2] == [0, 0] and cached[2:6] == [boundary] * 4 and cached[6] == 0
    stats = llm.engine.stats()
    assert stats["prefix_cache_hits"] == 4 * boundary
    assert stats["prefix_cache_queries"] == sum(len(p) for p in prompts)
    assert llm.engine.blocks.all_free()


def test_batched_chunked_and_preempted_runs_match(uncached: list[list[int]]) -> None:
    prompts = _prompts()
    warm = LLM(device="cpu", max_model_len=512)
    warm.generate(prompts[:2], GREEDY)
    assert [o.outputs[0].token_ids for o in warm.generate(prompts, GREEDY)] == uncached
    # a 40-token budget cuts prefills into chunks around the split point; 48 blocks of 16 tokens (two
    # prompts' worth) force evictions and preemptions while entries share blocks with running requests
    tight = LLM(device="cpu", max_model_len=512, max_num_batched_tokens=40, extra={"num_kv_blocks": 48})
    for _ in range(2):
        outs = tight.generate(prompts, GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == uncached
    assert tight.engine.num_preemptions > 0
    assert tight.engine.stats()["prefix_cache_hits"] > 0
    assert tight.engine.blocks.all_free()
    tight.engine.reset()
    blocks = tight.engine.blocks
    assert blocks.num_free_blocks == blocks.num_usable_blocks and len(blocks.free_slots) == blocks.num_state_slots - 1


def test_seeded_sampling_is_the_same_with_a_cached_prefix() -> None:
    prompts = _prompts()
    params = SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=10, ignore_eos=True, logprobs=2)
    plain = LLM(device="cpu", max_model_len=512, enable_prefix_caching=False)
    cached = LLM(device="cpu", max_model_len=512)
    cached.generate(prompts[:2], GREEDY)
    a = plain.generate(prompts[2:4], params)
    b = cached.generate(prompts[2:4], params)
    boundary = SHARED // BLOCK * BLOCK
    assert [o.num_cached_tokens for o in b] == [boundary, boundary]
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    for x, y in zip(a, b):
        lx = [t.logprob for t in x.outputs[0].logprobs or []]
        ly = [t.logprob for t in y.outputs[0].logprobs or []]
        assert lx == pytest.approx(ly, abs=1e-5)


def test_prefix_cache_slots_are_part_of_the_state_pool() -> None:
    on = LLM(device="cpu", max_model_len=64, max_num_seqs=4, prefix_cache_slots=3)
    off = LLM(device="cpu", max_model_len=64, max_num_seqs=4, enable_prefix_caching=False)
    assert on.engine.blocks.num_state_slots == 4 + 1 + 3
    assert off.engine.blocks.num_state_slots == 4 + 1 and off.engine.blocks.prefix is None


def test_requests_for_one_prompt_at_once_are_not_all_cut() -> None:
    prompts = _prompts()
    llm = LLM(device="cpu", max_model_len=512)
    llm.generate(prompts[:1], GREEDY)
    cuts: list[int | None] = []
    admit = llm.engine.scheduler._admit

    def spy(req, budget, out):  # type: ignore[no-untyped-def]
        ok = admit(req, budget, out)
        if ok:
            cuts.append(req.cache_split_at)
        return ok

    llm.engine.scheduler._admit = spy  # type: ignore[method-assign]
    outs = llm.generate([prompts[1]] * 4, GREEDY)
    # the first is cut where it meets the earlier prompt, the second where it meets the first (its last full
    # block), the others are not cut at all: those places are already being cut for
    last = (len(prompts[1]) - 1) // BLOCK * BLOCK
    assert cuts == [SHARED // BLOCK * BLOCK, last, None, None]
    # and the last two waited for the second's cut instead of computing the prompt again
    assert [o.num_cached_tokens for o in outs] == [0, 0, last, last]
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1
    assert [o.num_cached_tokens for o in llm.generate([prompts[1]], GREEDY)] == [last]
    assert not llm.engine.blocks.prefix.splitting  # type: ignore[union-attr]


def test_an_ended_request_leaves_its_whole_text_for_the_next_turn(uncached: list[list[int]]) -> None:
    """An agent loop: each prompt is the previous prompt, the previous answer and a little more. The ended
    request's entry (prompt plus output, ending inside a block) hands the next turn everything but the new
    tokens; outputs equal the engine's without caching, the partial block's KV copied into the new request."""
    gen = torch.Generator().manual_seed(4)
    llm = LLM(device="cpu", max_model_len=512)
    plain = LLM(device="cpu", max_model_len=512, enable_prefix_caching=False)
    prompt = _ids(SHARED, gen)
    for _ in range(3):
        out = llm.generate([prompt], GREEDY)[0]
        assert out.outputs[0].token_ids == plain.generate([prompt], GREEDY)[0].outputs[0].token_ids
        answer = out.outputs[0].token_ids
        cached = out.num_cached_tokens
        prompt = prompt + answer + _ids(7, gen)
        # the last output token was sampled but never fed, so the entry ends one short of the answer
        nxt = llm.generate([prompt], GREEDY)[0]
        assert nxt.num_cached_tokens == len(prompt) - 7 - 1 and nxt.num_cached_tokens % BLOCK != 0
        assert nxt.outputs[0].token_ids == plain.generate([prompt], GREEDY)[0].outputs[0].token_ids
        assert cached <= nxt.num_cached_tokens
    assert llm.engine.blocks.all_free()
    # a continuation that differs inside the cached answer falls back to the longest block-aligned entry
    fork = prompt[:SHARED + 3] + _ids(40, gen)
    assert llm.generate([fork], GREEDY)[0].num_cached_tokens <= SHARED


def test_ended_requests_entries_are_evicted_before_cut_ones() -> None:
    manager = BlockManager(num_blocks=70, block_size=BLOCK, num_state_slots=4, prefix_caching=True)
    gen = torch.Generator().manual_seed(5)
    cut = Request("cut", _ids(300, gen), GREEDY)
    done = Request("done", _ids(300, gen), GREEDY)
    for req in (cut, done):
        manager.begin_round()
        assert manager.allocate_slot(req)
        manager.allocate(req, 300)
    cut.num_computed_tokens = 288
    assert manager.add_prefix(cut) is not None
    done.num_computed_tokens = 300
    done.output_token_ids = []
    manager.cache_finished(done)
    manager.free(done)
    assert done.state_slot is None and len(manager.prefix or ()) == 2
    finished = [e for e in (manager.prefix or {}).entries.values() if e.finished]
    assert len(finished) == 1 and finished[0].num_tokens == 300 and len(finished[0].tail) == 300 % BLOCK
    manager.free(cut)
    manager.begin_round()
    # 70 blocks: 18 held by the cut entry, 19 by the ended request's: 32 free
    assert manager.num_free_blocks == 69 - 18 - 19
    assert manager.can_allocate(Request("x", _ids(600, gen), GREEDY), 600)  # needs 38: one eviction
    assert [e.finished for e in (manager.prefix or {}).entries.values()] == [False]


def test_a_burst_sharing_a_new_prefix_computes_it_twice_not_n_times(uncached: list[list[int]]) -> None:
    """Six requests with one new 300-token prompt prefix arrive together: the first computes it (nothing to
    share yet), the second is cut at its end, the other four wait for that entry and start from it."""
    prompts = _prompts()
    burst = [prompts[0][:SHARED] + tail for tail in ([1, 2], [3], [4, 5, 6], [7], [8, 9], [10])]
    llm = LLM(device="cpu", max_model_len=512)
    plain = LLM(device="cpu", max_model_len=512, enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
    outs = llm.generate(burst, params)
    boundary = SHARED // BLOCK * BLOCK
    assert [o.num_cached_tokens for o in outs] == [0, 0] + [boundary] * 4
    # the waiting four were admitted in the round that made the entry: its state copy and theirs ran in the
    # same step, in order (log-probs, not just tokens: this model's greedy tokens barely feel a wrong state)
    for a, b in zip(outs, plain.generate(burst, params)):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert [t.logprob for t in a.outputs[0].logprobs or []] == \
            pytest.approx([t.logprob for t in b.outputs[0].logprobs or []], abs=1e-5)
    assert llm.engine.blocks.all_free()


def test_state_and_block_copies_run_in_order() -> None:
    """A copy may read what an earlier copy of the same step wrote (an entry made and used in one round)."""
    gen = torch.Generator().manual_seed(6)
    conv, ssm = torch.randn(8, 3, 5, generator=gen), torch.randn(8, 2, 4, 4, generator=gen)
    k, v = torch.randn(6, 4, 1, 8, generator=gen), torch.randn(6, 4, 1, 8, generator=gen)
    caches = ModelCaches(kv=[KVCache(k.clone(), v.clone()), None], gdn=[None, GDNState(conv.clone(), ssm.clone())])
    pairs = [(2, 3), (3, 4), (3, 5), (6, 7)]
    caches.copy_state_slots(pairs)
    st = caches.gdn[1]
    assert st is not None
    for dst, src in ((3, 2), (4, 2), (5, 2), (7, 6), (2, 2), (1, 1)):
        assert torch.equal(st.conv[dst], conv[src]) and torch.equal(st.ssm[dst], ssm[src])
    caches.copy_kv_blocks([(1, 2), (2, 3)])
    kv = caches.kv[0]
    assert kv is not None and torch.equal(kv.k[3], k[1]) and torch.equal(kv.v[2], v[1])


def test_a_failed_step_leaves_nothing_in_the_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step that raises after the round made a cut entry (its state copy never ran): the cache forgets
    everything, the requests of that step leave no entry, and later requests compute what they need."""
    prompts = _prompts()
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1)
    llm = LLM(device="cpu", max_model_len=512)
    plain = LLM(device="cpu", max_model_len=512, enable_prefix_caching=False)
    engine = llm.engine
    llm.generate(prompts[:1], params)
    engine.add_request("cut", prompts[1], params)
    run = engine.runner.run
    calls = []

    def failing(step, inflight_tokens=None, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(step)
        if step.state_copies:
            raise RuntimeError("injected failure")
        return run(step, inflight_tokens, **kwargs)

    monkeypatch.setattr(engine.runner, "run", failing)
    with pytest.raises(RuntimeError, match="injected"):
        while engine.has_unfinished_requests():
            engine.step()
    assert len(engine.blocks.prefix or ()) == 0
    engine.abort_request("cut")
    assert len(engine.blocks.prefix or ()) == 0 and engine.blocks.all_free()
    monkeypatch.setattr(engine.runner, "run", run)
    for p in prompts[2:4]:
        a, b = llm.generate([p], params)[0], plain.generate([p], params)[0]
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert [t.logprob for t in a.outputs[0].logprobs or []] == \
            pytest.approx([t.logprob for t in b.outputs[0].logprobs or []], abs=1e-5)


def test_cache_salt_keeps_tenants_apart(uncached: list[list[int]]) -> None:
    """Requests share cached prefixes (cut ones and ended requests' whole texts) only with requests of the same
    cache_salt; outputs stay those of the engine without caching."""
    llm = LLM(device="cpu", max_model_len=512)
    prompts = _prompts()

    def run(i: int, salt: str | None):
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, cache_salt=salt)
        out = llm.generate([prompts[i]], params)[0]
        assert out.outputs[0].token_ids == uncached[i]
        return out.num_cached_tokens

    boundary = SHARED // BLOCK * BLOCK
    assert [run(0, "a"), run(1, "a"), run(2, "a")] == [0, 0, boundary]
    # the exact repeat of prompt 0 starts from a's cut prefix, but not under another salt or none
    assert run(5, "b") == 0 and run(5, None) == 0
    # b's second request with the shared prefix cuts it, as a's did; b's third starts from there
    assert [run(3, "b"), run(4, "b")] == [0, boundary]
    assert run(5, "a") == boundary
    # an agent's next turn starts from its ended request's whole text, under its salt only
    turn = prompts[5] + uncached[5] + [7, 8, 9]
    for salt, cached in (("c", 0), ("a", len(turn) - 4)):
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, cache_salt=salt)
        assert llm.generate([turn], params)[0].num_cached_tokens == cached
    assert llm.engine.blocks.all_free()
    with pytest.raises(ValueError, match="cache_salt"):
        SamplingParams(cache_salt="")


def test_reset_prefix_cache_drops_every_entry_only_when_idle(uncached: list[list[int]]) -> None:
    """vLLM's reset_prefix_cache: the next prompts are computed cold (same outputs, no cached tokens); refused
    (False, nothing dropped) while a request is waiting or running."""
    llm = LLM(device="cpu", max_model_len=512)
    prompts = _prompts()
    for p in prompts[:3]:
        llm.generate([p], GREEDY)
    assert llm.generate([prompts[3]], GREEDY)[0].num_cached_tokens > 0
    llm.engine.add_request("busy", prompts[4], GREEDY)
    assert not llm.reset_prefix_cache()
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    assert llm.reset_prefix_cache() and llm.engine.blocks.all_free()
    cold = llm.generate([prompts[3]], GREEDY)[0]
    assert cold.num_cached_tokens == 0 and cold.outputs[0].token_ids == uncached[3]
