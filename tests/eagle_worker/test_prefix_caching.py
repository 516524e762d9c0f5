"""Automatic prefix caching through the engine: outputs are the same with the cache on and off
(greedy and seeded sampling; no head, head, lookup, hybrid; hits and misses in one batch; whole
prompts cached; chunked prefill; evicted prefixes recomputed; preemption), hits are counted where
they happened, the head accepts as much on a hit, and no block is left referenced. The real
default model: test_prefix_caching_270m.py. The block-level rules: test_prefix_cache_blocks.py."""
from __future__ import annotations

import pytest
import torch

from eagle_worker import LLM, SamplingParams, SpecConfig
from tests.conftest import assert_no_leaks

SYSTEM = "You are a careful assistant. Answer briefly and exactly, and say when you do not know. "
QUESTIONS = ["What is two plus two?", "Name a prime number.", "def add(a, b):", "Bonjour", "x",
             "The quick brown fox jumps over the lazy dog."]
SHARED = [SYSTEM + q for q in QUESTIONS]
NOVEL = ["Completely different text here", "1 2 3 4 5 6 7 8 9", "Speculative decoding verifies trees."]
KV = dict(block_size=4, num_kv_blocks=1024)


def methods(head: str) -> dict[str, SpecConfig | None]:
    fixed = dict(adaptive=False, depth=3, top_k=3, num_draft_tokens=6)
    return {"plain": None,
            "head": SpecConfig(draft=head, lookup=False, **fixed),
            "lookup": SpecConfig(lookup=True, lookup_ngram=(1, 3), adaptive=False),
            "hybrid": SpecConfig(draft=head, lookup=True, lookup_ngram=(1, 3), **fixed)}


def greedy(n: int = 12) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def tokens(outs) -> list[list[int]]:
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("method", ["plain", "head", "lookup", "hybrid"])
def test_greedy_identical_with_and_without_caching(method, copying_target):
    target, head = copying_target
    spec = methods(str(head))[method]
    on = LLM(model=str(target), spec=spec, **KV)
    off = LLM(model=str(target), spec=methods(str(head))[method], enable_prefix_caching=False, **KV)
    assert on.engine.block_manager.prefix_cache is not None and off.engine.block_manager.prefix_cache is None
    warm = on.generate(SHARED[:1], greedy())                       # a miss that fills the cache
    assert warm[0].metrics["num_cached_tokens"] == 0
    mixed = SHARED[1:] + NOVEL + SHARED[:1]                        # hits, misses, and a whole prompt cached
    outs = on.generate(mixed, greedy())
    assert tokens(outs) == tokens(off.generate(mixed, greedy()))
    assert tokens(warm) == tokens(off.generate(SHARED[:1], greedy()))
    system_blocks = len(on.tokenizer.encode(SYSTEM)) // 4 - 1      # blocks of the system prompt, short of a boundary
    for prompt, out in zip(mixed, outs):
        cached = out.metrics["num_cached_tokens"]
        if prompt in NOVEL:
            assert cached == 0, prompt
        else:
            assert cached >= 4 * system_blocks and cached % 4 == 0, (prompt, cached)
            assert cached < len(out.prompt_token_ids)              # the last prompt token is always computed
    whole = outs[-1]
    assert whole.metrics["num_cached_tokens"] == 4 * ((len(whole.prompt_token_ids) - 1) // 4)
    st = on.engine.stats()
    assert st["prefix_cache_hit_requests"] == len(SHARED) and st["prefix_cache_queried_requests"] == 1 + len(mixed)
    assert st["prefix_cache_hit_tokens"] == sum(o.metrics["num_cached_tokens"] for o in outs)
    if spec is not None:
        assert st["spec_steps"] > 0
    assert_no_leaks(on.engine)
    assert on.engine.block_manager.num_cached_blocks > 0               # kept for later, evictable


@pytest.mark.parametrize("method", ["plain", "head", "hybrid"])
def test_seeded_sampling_identical_with_and_without_caching(method, copying_target):
    """Keyed sampling draws each token from (seed, position, the target's distribution): the cache
    must leave that distribution alone, so the same seeds give the same text."""
    target, head = copying_target
    params = [SamplingParams(max_tokens=12, temperature=1.0, seed=50 + i, ignore_eos=True) for i in range(len(SHARED))]
    on = LLM(model=str(target), spec=methods(str(head))[method], **KV)
    off = LLM(model=str(target), spec=methods(str(head))[method], enable_prefix_caching=False, **KV)
    on.generate(SHARED[:2], params[:2])
    outs = on.generate(SHARED, params)
    assert sum(o.metrics["num_cached_tokens"] > 0 for o in outs) >= len(SHARED) - 1
    assert tokens(outs) == tokens(off.generate(SHARED, params))
    assert len({tuple(t) for t in tokens(outs)}) > 3
    assert_no_leaks(on.engine)


def test_n_samples_compute_the_prompt_once_and_sample_as_alone(copying_target):
    """Identical prompts submitted together: the first computes the prompt, the others wait a step
    for its blocks and take them; each samples exactly what it would alone."""
    target, head = copying_target
    for spec in (None, methods(str(head))["head"]):
        llm = LLM(model=str(target), spec=spec, **KV)
        params = [SamplingParams(max_tokens=10, temperature=1.0, seed=100 + i, ignore_eos=True) for i in range(4)]
        alone = [tokens(LLM(model=str(target), spec=spec, enable_prefix_caching=False, **KV).generate(SHARED[0], p))[0]
                 for p in params]
        outs = llm.generate([SHARED[0]] * 4, params)
        assert tokens(outs) == alone
        n = 4 * ((len(outs[0].prompt_token_ids) - 1) // 4)
        assert [o.metrics["num_cached_tokens"] for o in outs] == [0, n, n, n]
        assert_no_leaks(llm.engine)


def test_waiting_for_a_prefix_and_its_owner_aborted(copying_target):
    """A request whose next block a running request is computing waits a step for it; when that
    request is aborted the next one computes the rest itself (from the blocks already cached)."""
    target, _ = copying_target
    llm = LLM(model=str(target), max_num_batched_tokens=64, **KV)
    eng = llm.engine
    n_prompt = len(llm.engine.tokenize(SHARED[0]))
    assert 64 < n_prompt < 100
    for i in range(3):
        eng.add_request(f"r{i}", SHARED[0], greedy())
    eng.step()                                     # r0 prefills 64 tokens (16 blocks, now cached)
    eng.step()                                     # r0 finishes its prompt; r1, r2 wait for its last blocks
    assert [s.request_id for s in eng.scheduler.running] == ["r0"] and len(eng.scheduler.waiting) == 2
    assert eng.requests["r1"].num_computed_tokens == 0 and not eng.requests["r1"].block_table
    eng.abort("r0")
    eng.add_request("r3", SHARED[0], greedy())
    eng.abort("r3")                                # aborted while waiting: holds nothing
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    expected = tokens(llm.generate(SHARED[0], greedy()))[0]
    assert done["r1"].token_ids == done["r2"].token_ids == expected
    full = 4 * ((n_prompt - 1) // 4)
    assert done["r1"].metrics["num_cached_tokens"] == full        # r0 registered its blocks before it went
    assert done["r2"].metrics["num_cached_tokens"] == full
    assert done["r3"].finish_reason == "abort"
    assert_no_leaks(eng)


def test_chunked_prefill_and_a_prefix_evicted_and_recomputed(copying_target):
    """A small cache: later prompts evict the system prompt's blocks, which is then computed again;
    prompts longer than the step's token budget are prefilled in chunks. Outputs never change."""
    target, head = copying_target
    small = dict(block_size=4, num_kv_blocks=48, max_num_batched_tokens=16, max_num_seqs=4)
    spec = methods(str(head))["head"]
    on = LLM(model=str(target), spec=spec, **small)
    off = LLM(model=str(target), spec=methods(str(head))["head"], enable_prefix_caching=False, **small)
    filler = [f"Filler text number {i} that fills the cache with other blocks." for i in range(6)]
    order = [SHARED[0], SHARED[1], *filler, SHARED[2]]
    got = [tokens(on.generate(p, greedy(6)))[0] for p in order]
    assert got == [tokens(off.generate(p, greedy(6)))[0] for p in order]
    st = on.engine.stats()
    assert st["prefix_cache_evictions"] > 0
    assert on.engine.stats()["prefix_cache_hit_requests"] >= 1       # SHARED[1] hit SHARED[0]'s blocks
    last = on.generate(SHARED[2], greedy(6))[0]                      # its own blocks are the newest: cached
    assert last.metrics["num_cached_tokens"] > 0
    assert_no_leaks(on.engine)


def test_memory_pressure_evicts_cached_blocks_before_preempting(copying_target):
    target, _ = copying_target
    llm = LLM(model=str(target), block_size=4, num_kv_blocks=40)
    llm.generate(NOVEL, greedy(4))                                   # their blocks stay cached
    bm = llm.engine.block_manager
    assert bm.num_cached_blocks > 0 and bm.num_free_blocks == bm.num_blocks
    prompts = [f"Row {i} of a batch that needs most of the memory" for i in range(3)]
    outs = llm.generate(prompts, greedy(12))
    assert all(o.metrics["num_preemptions"] == 0 for o in outs)
    assert llm.engine.stats()["prefix_cache_evictions"] > 0
    assert_no_leaks(llm.engine)


def test_preemption_recomputes_from_the_cache_and_stays_exact(copying_target):
    target, head = copying_target
    tight = dict(block_size=4, num_kv_blocks=30)
    params = greedy(24)
    on = LLM(model=str(target), spec=methods(str(head))["head"], **tight)
    off = LLM(model=str(target), spec=methods(str(head))["head"], enable_prefix_caching=False, **tight)
    outs = on.generate(SHARED[:4], params)
    assert tokens(outs) == tokens(off.generate(SHARED[:4], params))
    assert sum(o.metrics["num_preemptions"] for o in outs) > 0
    assert_no_leaks(on.engine)


def test_prompt_logprobs_are_scored_in_full_on_a_hit(copying_target):
    target, _ = copying_target
    llm = LLM(model=str(target), **KV)
    off = LLM(model=str(target), enable_prefix_caching=False, **KV)
    llm.generate(SHARED[0], greedy())
    p = SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=2)
    out, ref = llm.generate(SHARED[0], p)[0], off.generate(SHARED[0], p)[0]
    assert out.metrics["num_cached_tokens"] == 0                      # scoring the prompt needs every row
    assert [x and x.token_id for x in out.prompt_logprobs] == [x and x.token_id for x in ref.prompt_logprobs]
    assert_no_leaks(llm.engine)


def test_the_head_accepts_as_much_on_a_hit(copying_target):
    """The head's KV comes with the cached blocks: a hit drafts from the same context as a miss."""
    target, head = copying_target
    spec = methods(str(head))["head"]
    miss = LLM(model=str(target), spec=spec, enable_prefix_caching=False, **KV).generate(SHARED, greedy(24))
    llm = LLM(model=str(target), spec=methods(str(head))["head"], **KV)
    llm.generate(SHARED, greedy(24))
    hit = llm.generate(SHARED, greedy(24))
    assert all(o.metrics["num_cached_tokens"] > 0 for o in hit)
    assert tokens(hit) == tokens(miss)
    tau = [sum(o.metrics["mean_accepted_tokens"] for o in outs) / len(outs) for outs in (miss, hit)]
    assert tau[0] > 1.5                                              # the head does accept here
    assert abs(tau[1] - tau[0]) < 0.1, tau


def test_requests_sharing_blocks_never_write_into_them(copying_target):
    """Trees, drafts and catch-up write only past a request's committed tokens, so the target's and
    the head's KV in shared blocks stay bit for bit what their first request computed."""
    target, head = copying_target
    llm = LLM(model=str(target), spec=methods(str(head))["hybrid"], **KV)
    llm.generate(SHARED[:1], greedy(4))
    bm, runner = llm.engine.block_manager, llm.engine.runner
    cached = sorted(bm.prefix_cache.blocks)
    slots = torch.tensor([b * 4 + i for b in cached for i in range(4)])
    caches = [runner.kv_cache] + [t for layer in llm.engine.worker.head.attention_layers()
                                   for t in (layer.k_cache, layer.v_cache)]
    before = [c[..., slots, :, :].clone() if c.dim() == 5 else c[slots].clone() for c in caches]
    outs = llm.generate(SHARED[1:] + [SHARED[0]] * 2, greedy(24))
    assert all(o.metrics["num_cached_tokens"] > 0 for o in outs)
    assert llm.engine.stats()["spec_steps"] > 0
    after = [c[..., slots, :, :] if c.dim() == 5 else c[slots] for c in caches]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert_no_leaks(llm.engine)


@pytest.mark.parametrize("method", ["plain", "head", "hybrid"])
def test_a_batch_on_one_long_cached_prefix_reads_it_once_and_stays_exact(method, copying_target, monkeypatch):
    """Every request of the batch starts with the same cached blocks: attention reads them once for
    the whole batch (decodes, trees and the head's drafts), and the tokens are those of no caching."""
    from eagle_worker.attention import MIN_SHARED_KEYS, Attention

    target, head = copying_target
    calls = []
    split = Attention._cascade
    monkeypatch.setattr(Attention, "_cascade", lambda self, *a: calls.append(a[0].shape[0]) or split(self, *a))
    prompts = [SYSTEM * 5 + q for q in QUESTIONS]
    on = LLM(model=str(target), spec=methods(str(head))[method], **KV)
    assert len(on.tokenizer.encode(SYSTEM * 5)) > MIN_SHARED_KEYS + 8
    on.generate(prompts[:1], greedy(4))                                   # fills the cache
    outs = on.generate(prompts, greedy(16))
    assert all(o.metrics["num_cached_tokens"] > MIN_SHARED_KEYS for o in outs)
    assert calls, "the shared-prefix path never ran"
    monkeypatch.undo()
    off = LLM(model=str(target), spec=methods(str(head))[method], enable_prefix_caching=False, **KV)
    assert tokens(outs) == tokens(off.generate(prompts, greedy(16)))
    assert_no_leaks(on.engine)


def test_blocks_the_head_sat_out_carry_its_kv_once_their_requests_end(copying_target, monkeypatch):
    """A head that drafted nothing for a request owes the head KV of its generated tokens; the
    requests ending in a step write it in one head pass, so a follow-up over prompt + output (a
    conversation's next turn) takes those blocks too, with the same tokens as no caching."""
    from eagle_worker.speculative.draft_tree import StepMode
    from eagle_worker.speculative.hybrid import Choice, HybridSplit

    target, head = copying_target
    monkeypatch.setattr(HybridSplit, "choose", lambda self, *a, **k: Choice(StepMode.PLAIN))   # the head sits out
    spec = dict(draft=str(head), lookup=True, lookup_ngram=(1, 3))
    llm = LLM(model=str(target), spec=SpecConfig(**spec), **KV)
    off = LLM(model=str(target), spec=SpecConfig(**spec), enable_prefix_caching=False, **KV)
    passes = []
    drafter = llm.engine.worker.drafter
    write = drafter.write_ahead
    monkeypatch.setattr(drafter, "write_ahead", lambda batch: passes.append(len(batch)) or write(batch))
    first = llm.generate(NOVEL, greedy(16))
    assert tokens(first) == tokens(off.generate(NOVEL, greedy(16)))
    assert llm.engine.stats()["spec_steps"] == 0
    assert passes == [len(NOVEL), len(NOVEL)]      # the prompts' head KV, then the three that ended together
    follow = [o.prompt_token_ids + o.token_ids for o in first]
    outs = llm.generate(follow, greedy(8))
    assert tokens(outs) == tokens(off.generate(follow, greedy(8)))
    for f, o, prev in zip(follow, outs, first):
        assert o.metrics["num_cached_tokens"] >= 4 * ((len(f) - 1) // 4) - 4 > len(prev.prompt_token_ids) + 4
    assert llm.engine.stats()["prefix_cache_blocks_without_head_kv"] == 0
    assert_no_leaks(llm.engine)
