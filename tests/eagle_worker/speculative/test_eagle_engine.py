"""EAGLE inside the engine: greedy output identical to plain decoding for every family and head
format, in continuous batches with prefill chunks and plain decodes beside the trees; a head that
really accepts (tau > 2) with the KV cache holding exactly what plain decoding holds. (Sampling:
tests/eagle_worker/test_keyed_sampling.py.)"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from eagle_worker import LLM, SamplingParams
from eagle_worker.engine import LLMEngine
from eagle_worker.speculative.config import SpecConfig
from eagle_worker.speculative.head_init import new_head
from eagle_worker.speculative.head_saver import save_draft_head
from eagle_worker.speculative.policy import SpecPolicy
from tests.conftest import assert_no_leaks

PROMPTS = ["The quick brown fox", "Question: what is two plus two?\nAnswer:", "def add(a, b):\n", "x",
           "Speculative decoding drafts tokens and verifies them in one pass.", "Bonjour"]


def random_head(llm: LLM, kind: str, path: Path) -> Path:
    runner = llm.engine.runner
    vocab = torch.arange(0, runner.model.vocab_size, 2) if kind == "eagle3" else None
    save_draft_head(new_head(kind, runner.model, runner.hf_config, vocab, std=0.2), path)
    return path


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gemma3"])
@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_greedy_with_random_head_equals_plain(family, kind, tiny_model_dir, tmp_path):
    path = tiny_model_dir(family)
    plain = LLM(model=str(path), block_size=4, num_kv_blocks=256)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    expected = [o.token_ids for o in plain.generate(PROMPTS, params)]
    head = random_head(plain, kind, tmp_path / "head")
    spec = LLM(model=str(path), block_size=4, num_kv_blocks=256,
               spec=SpecConfig(draft=str(head), lookup=False, depth=3, top_k=3, num_draft_tokens=5, adaptive=False))
    assert spec.generate(PROMPTS[0], params)[0].token_ids == expected[0]
    assert [o.token_ids for o in spec.generate(PROMPTS, params)] == expected
    assert spec.engine.stats()["spec_steps"] > 0
    assert_no_leaks(spec.engine)


@pytest.mark.parametrize("head_dtype", ["float32", "bfloat16"])
def test_head_runs_in_its_own_dtype_beside_a_float32_target(head_dtype, copying_target):
    """A bf16 head (what "auto" picks under a float32 target on hardware with bf16 arithmetic)
    drafts from the target's float32 features into its own bf16 KV: still exact and still accepting."""
    target, head = copying_target
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    expected = [o.token_ids for o in LLM(model=str(target), block_size=4, num_kv_blocks=512).generate(PROMPTS, params)]
    spec = LLM(model=str(target), block_size=4, num_kv_blocks=512,
               spec=SpecConfig(draft=str(head), lookup=False, adaptive=False, head_dtype=head_dtype))
    worker, want = spec.engine.worker, getattr(torch, head_dtype)
    assert next(spec.engine.runner.model.parameters()).dtype == torch.float32
    assert {p.dtype for p in worker.head.parameters()} == {want}
    assert {layer.k_cache.dtype for layer in worker.head.attention_layers()} == {want}
    outs = spec.generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == expected
    assert min(o.metrics["mean_accepted_tokens"] for o in outs) > 2.0


@pytest.mark.parametrize("tree", ["dynamic", "static", "chain"])
def test_accepting_head_is_lossless_and_fast_in_mixed_batches(tree, copying_target):
    target, head = copying_target
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    expected = [o.token_ids for o in LLM(model=str(target), block_size=4, num_kv_blocks=512).generate(PROMPTS, params)]
    # a 7-token step budget chunks prompts, so prefill chunks, plain decodes and trees share steps
    spec = LLM(model=str(target), block_size=4, num_kv_blocks=512, max_num_batched_tokens=7,
               spec=SpecConfig(draft=str(head), lookup=False, tree=tree, adaptive=False))
    outs = spec.generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == expected
    taus = [o.metrics["mean_accepted_tokens"] for o in outs]
    assert min(taus) > 2.0, taus
    assert sum(outs[0].metrics["accepted_per_depth"]) > 0
    assert spec.engine.stats()["acceptance_rate_per_depth"][0] > 0.5
    assert_no_leaks(spec.engine)


@pytest.mark.parametrize("lookup", [False, True])
def test_tight_kv_shrinks_trees_and_stays_exact(lookup, copying_target):
    """A KV budget too small for every sequence's tree: the scheduler gives each decode only the
    draft slots memory leaves, the worker drafts smaller trees (or none) inside them, the output is
    plain greedy decoding's, and the metrics say how often memory shrank a tree."""
    target, head = copying_target
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    expected = [o.token_ids for o in LLM(model=str(target), block_size=4, num_kv_blocks=512).generate(PROMPTS, params)]
    spec = LLM(model=str(target), block_size=4, num_kv_blocks=40,
               spec=SpecConfig(draft=str(head), lookup=lookup, adaptive=False))
    assert spec.engine.worker.num_lookahead_slots == 32     # 16 nodes, a 5-level dynamic tree forwards 1 + 4 x 8
    outs = spec.generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == expected
    stats = spec.engine.stats()
    assert stats["spec_trees_shrunk_for_memory"] > 0 and stats["spec_steps"] > 0
    assert sum(o.metrics["num_trees_shrunk_for_memory"] for o in outs) == stats["spec_trees_shrunk_for_memory"]
    assert max(o.metrics["mean_accepted_tokens"] for o in outs) > 1.5        # trees still drafted and accepted
    assert_no_leaks(spec.engine)
    roomy = LLM(model=str(target), block_size=4, num_kv_blocks=512,
                spec=SpecConfig(draft=str(head), lookup=False, adaptive=False))
    roomy.generate(PROMPTS, params)
    assert roomy.engine.stats()["spec_trees_shrunk_for_memory"] == 0


def test_kv_cache_holds_exactly_the_committed_tokens(copying_target):
    target, head = copying_target
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    plain = LLMEngine(_config(target))
    spec = LLMEngine(_config(target, SpecConfig(draft=str(head), lookup=False, adaptive=False)))
    for e in (plain, spec):
        for i, p in enumerate(PROMPTS[:3]):
            e.add_request(str(i), p, params)
    for _ in range(12):
        spec.step()
    drafted, accepted = spec.worker.totals["drafted_at_depth"], spec.worker.totals["accepted_at_depth"]
    assert 0 < sum(accepted) < sum(drafted)       # acceptances and rejections both happened
    for rid in ("0", "1", "2"):
        s = spec.requests[rid]
        while plain.requests[rid].num_computed_tokens < s.num_computed_tokens:
            plain.step()
        p = plain.requests[rid]
        c = s.num_computed_tokens
        assert p.token_ids[:c] == s.token_ids[:c]
        s_slots = spec.block_manager.slots(s, 0, c)
        p_slots = plain.block_manager.slots(p, 0, c)
        torch.testing.assert_close(spec.runner.kv_cache[:, :, s_slots], plain.runner.kv_cache[:, :, p_slots],
                                   rtol=1e-4, atol=1e-5)
        assert len(s.block_table) == spec.block_manager.blocks_for(c)  # rejected draft blocks were returned


def _config(target, spec=None):
    from eagle_worker.config import EngineConfig
    return EngineConfig(model=str(target), block_size=4, num_kv_blocks=512, spec=spec)


def test_policy_drops_speculation_where_it_loses():
    policy = SpecPolicy(num_draft_tokens=16)
    tried = {1: set(), 32: set()}
    for _ in range(30):
        for bs, rate in ((1, {0: 10, 2: 12, 4: 14, 8: 18, 16: 25}), (32, {0: 300, 2: 250, 4: 200, 8: 150, 16: 90})):
            n = policy.choose(bs)
            tried[bs].add(n)
            policy.observe(bs, n, int(rate[n] * 0.1), 0.1)
    assert policy.choose(1) == 16
    assert policy.choose(32) == 0
    assert tried[32] == {0, 2}          # a losing budget stops the climb: the big trees are never paid for
    # while the best holds, re-checks of a losing neighbour back off (40, 80, 160, ... decisions apart)
    rechecks = 0
    for _ in range(3000):
        n = policy.choose(32)
        rechecks += n != 0
        policy.observe(32, n, int({0: 300, 2: 250, 4: 200, 8: 150, 16: 90}[n] * 0.1), 0.1)
    assert 3 <= rechecks <= 10
    assert SpecPolicy(num_draft_tokens=16, adaptive=False).choose(64) == 16


def test_the_step_cost_sees_prefill_tokens_only_where_prompts_were_fed(tiny_model_dir):
    """What the hybrid's cost fit learns from: a step of decodes alone has no prefill tokens, and
    the steps' prefill tokens add up to the prompts' (a decode must not look like a prompt chunk,
    which it does once the step has committed it)."""
    llm = LLM(model=str(tiny_model_dir("llama")), block_size=4, num_kv_blocks=256, max_num_batched_tokens=7,
              spec=SpecConfig(draft=None, lookup=True))
    seen = []
    observe = llm.engine.worker.hybrid.observe
    llm.engine.worker.hybrid.observe = lambda work, seconds: (seen.append(work), observe(work, seconds))
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    llm.generate(PROMPTS, params)
    prompt_tokens = sum(len(llm.tokenizer.encode(p)) for p in PROMPTS)
    assert sum(w.prefill_tokens for w in seen) == prompt_tokens
    decode_only = [w for w in seen if w.prefill_tokens == 0]
    assert len(decode_only) >= 10 and all(w.target_rows >= w.sequences for w in decode_only)
