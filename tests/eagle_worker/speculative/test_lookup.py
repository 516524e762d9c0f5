"""Prompt lookup and hybrid trees: the incremental n-gram index, trie merging under a budget, and in
the engine: greedy identical to plain decoding, lookup really accepted, per-source shares, lossless
sampling with a negative control."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from eagle_worker import LLM, SamplingParams
from eagle_worker.speculative.config import SpecConfig
from eagle_worker.speculative.draft_tree import DraftTree, StepMode
from eagle_worker.speculative.head_init import new_head
from eagle_worker.speculative.head_saver import save_draft_head
from eagle_worker.speculative.lookup import NgramIndex, merge_branches, prune_to_best
from eagle_worker.speculative.step_cost import StepCost


def test_index_is_incremental_and_matches_longest_suffix_first():
    toks = [1, 2, 3, 4, 9, 1, 2, 3, 5, 7, 2, 3]
    whole = NgramIndex(2, 4)
    whole.extend(toks)
    step = NgramIndex(2, 4)
    for i in range(1, len(toks) + 1):
        step.extend(toks[:i])
    assert dict(step.table) == dict(whole.table)
    # suffix (2, 3): occurrences continue with 5 7 2 3 (most recent) and 4 9 1 2
    assert whole.propose(max_tokens=4, max_branches=3) == [[5, 7, 2, 3], [4, 9, 1, 2]]
    longer = NgramIndex(2, 4)
    longer.extend([1, 2, 3, 4, 8, 2, 3, 6, 1, 2, 3])       # (1,2,3) beats the shorter (2,3) match
    assert longer.propose(max_tokens=2, max_branches=3) == [[4, 8]]    # (2,3) alone would add [6, 1]
    assert NgramIndex(2, 4).propose(4, 3) == []


def test_merge_shares_prefixes_and_respects_the_budget():
    parents, tokens, depth = [-1, 0, 0, 1], [7, 10, 11, 12], [0, 1, 1, 2]
    head_tree = DraftTree(parents, tokens, depth, [False, True, True, True], [False] * 4)
    tree = merge_branches(head_tree, [[10, 12, 13], [11, 20], [30, 31]], budget=2)
    p, t, d, head, look = tree.parents, tree.tokens, tree.depth, tree.from_head, tree.from_lookup
    assert t[:4] == tokens and p[:4] == parents           # existing nodes untouched
    assert t[4:] == [13, 20] and p[4:] == [3, 2] and d[4:] == [3, 2]   # only new nodes cost budget
    assert look == [False, True, True, True, True, True] and head == [False, True, True, True, False, False]
    assert all(pp < i for i, pp in enumerate(p) if i)
    assert tree.mode == StepMode.MERGED and tree.lookup_leaf(4) and tree.lookup_leaf(5) and not tree.lookup_leaf(3)


def test_prune_keeps_best_cumulative_nodes_closed_under_ancestors():
    parents, tokens, depth, lp = [-1, 0, 0, 1, 3], [5, 1, 2, 3, 4], [0, 1, 1, 2, 3], [0.0, -0.1, -2.0, -0.1, -0.1]
    p, t, d = prune_to_best(parents, tokens, depth, lp, keep=3)
    assert t == [5, 1, 3, 4] and p == [-1, 0, 1, 2] and d == [0, 1, 2, 3]


def test_lookup_and_hybrid_are_exact_and_lookup_is_used(copying_target, tmp_path):
    target, head = copying_target
    base = LLM(model=str(target), block_size=4, num_kv_blocks=512)
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    first = base.generate("def add(a, b):\n", params)[0]
    # a prompt that contains its own continuation: lookup can copy it
    prompts = ["def add(a, b):\n" + first.text + "\ndef add(a, b):\n", "The quick brown fox", "x"]
    expected = [o.token_ids for o in base.generate(prompts, params)]
    rand_head = tmp_path / "random-head"
    save_draft_head(new_head("eagle3", base.engine.runner.model, base.engine.runner.hf_config,
                             torch.arange(0, base.engine.runner.model.vocab_size, 2), std=0.2), rand_head)
    configs = {"lookup": SpecConfig(lookup=True, adaptive=False),
               "hybrid": SpecConfig(draft=str(head), lookup=True, adaptive=False),
               "hybrid-random-head": SpecConfig(draft=str(rand_head), lookup=True, adaptive=False)}
    for name, spec in configs.items():
        llm = LLM(model=str(target), block_size=4, num_kv_blocks=512, max_num_batched_tokens=9, spec=spec)
        outs = llm.generate(prompts, params)
        assert [o.token_ids for o in outs] == expected, name
        assert outs[0].metrics["mean_accepted_tokens"] > 1.5, (name, outs[0].metrics)
        assert outs[0].metrics["accepted_share_lookup"] > 0.5, name
        assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
    assert outs[0].metrics["accepted_share_lookup"] > outs[0].metrics["accepted_share_head"]


@pytest.mark.slow
@pytest.mark.slow  # the real gemma-3-270m and its shipped head
def test_hybrid_skips_the_head_while_lookup_carries_the_request():
    """gemma-3-270m with its shipped head on a prompt it continues by repeating itself: once lookup
    carries the request the head drafts only on probe steps (without the rule it drafts on every
    step), and the output stays plain greedy decoding's. The step costs the chooser weighs are
    given, not measured, so the choices do not depend on how loaded the machine is."""
    prompt = "Question: Repeat the list.\nAnswer: " + "red, green, blue, yellow, black, white, " * 6
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    expected = LLM(model="gemma-3-270m", draft=None).generate(prompt, params)[0].token_ids
    llm = LLM(model="gemma-3-270m")                      # the default: the hybrid, sized per step
    worker = llm.engine.worker
    split = worker.hybrid
    split.cost = StepCost(coefficients=(0.030, 0.0, 0.002, 0.002, 0.005))   # this CPU's, roughly
    for _ in range(3):
        split.observe_catch_up(100, 0.05)
    split.observe_catch_up = lambda *a, **k: None
    grown = []
    grow = worker.drafter.grow_dynamic
    worker.drafter.grow_dynamic = lambda batch, *a, **k: grown.append(len(batch)) or grow(batch, *a, **k)
    out = llm.generate(prompt, params)[0]
    assert out.token_ids == expected
    steps = worker.stats()["spec_steps"]
    assert out.metrics["accepted_share_lookup"] > 0.8, out.metrics
    assert 0 < len(grown) <= steps // 2 + 1, (len(grown), steps)
    by_source = out.metrics["steps_by_source"]       # every decode step counted once, by who drafted
    assert sum(by_source.values()) == out.metrics["num_target_forwards"] and set(by_source) <= {m.value for m in StepMode}
    assert by_source.get("head", 0) + by_source.get("merged", 0) == len(grown)
    assert by_source["lookup"] > by_source.get("plain", 0)


def test_hybrid_sampling_same_seed_same_tokens(copying_target):
    """Keyed sampling: the hybrid samples exactly plain decoding's tokens, seed for seed."""
    target, head = copying_target
    n = 48
    kw = dict(block_size=4, num_kv_blocks=2048, max_num_seqs=64)
    params = [SamplingParams(max_tokens=12, temperature=1.0, top_k=3, seed=i, ignore_eos=True) for i in range(n)]
    prompts = ["The quick brown fox", "def add(a, b):\n"] * (n // 2)
    plain = [o.token_ids for o in LLM(model=str(target), **kw).generate(prompts, params)]
    spec = SpecConfig(draft=str(head), lookup=True, lookup_ngram=(1, 3), top_k=3, depth=3, num_draft_tokens=8)
    assert [o.token_ids for o in LLM(model=str(target), spec=spec, **kw).generate(prompts, params)] == plain
    # which sources draft follows measured step costs; with both drafting at every step (the fixed
    # tree) the trees hold head and lookup siblings wherever they can
    llm = LLM(model=str(target), spec=dataclasses.replace(spec, adaptive=False), **kw)
    assert [o.token_ids for o in llm.generate(prompts, params)] == plain
    assert llm.engine.stats()["acceptance_rate_per_depth"][0] > 0.3


def test_hybrid_head_trees_are_small_where_lookup_has_nothing(copying_target):
    """Where lookup proposes nothing the head drafts an eighth-budget tree (cheap to be wrong);
    beside lookup branches it drafts only its share of the budget, no deeper or wider than that
    share; the output stays greedy decoding's. Rows cost next to nothing here, so both draft."""
    target, head = copying_target
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    prompts = ["x", "The quick brown fox"]
    expected = [o.token_ids for o in LLM(model=str(target), block_size=4, num_kv_blocks=512).generate(prompts, params)]
    llm = LLM(model=str(target), block_size=4, num_kv_blocks=512,
              spec=SpecConfig(draft=str(head), lookup=True, num_draft_tokens=8, depth=4))
    worker = llm.engine.worker
    worker.hybrid.cost = StepCost(coefficients=(0.030, 1e-6, 1e-6, 1e-6, 1e-6))
    calls, shares = [], []
    grow = worker.drafter.grow_dynamic
    worker.drafter.grow_dynamic = (lambda batch, h, lp, n, k, levels:
                                   calls.append((n, k, levels)) or grow(batch, h, lp, n, k, levels))
    head_nodes = worker.hybrid.head_nodes
    worker.hybrid.head_nodes = lambda st, budget: shares.append(head_nodes(st, budget)) or shares[-1]
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    assert (1, 1, 1) in calls, calls                        # lone head trees: 8 // 8 nodes, 1 wide, 1 deep
    assert shares and max(shares) < 8, shares               # beside lookup: a share of the budget
    assert all(k == n and levels == min(4, n) for n, k, levels in calls), calls
    assert {n for n, _, _ in calls} - {1} <= set(shares), (calls, shares)


def test_hybrid_with_the_adaptive_budget_in_continuous_batches(copying_target):
    """More requests than batch slots, so requests join and leave mid-run while the hybrid sizes
    each request's tree from the device's measured costs: outputs stay plain greedy decoding's
    and every KV block comes back."""
    target, head = copying_target
    base = LLM(model=str(target), block_size=4, num_kv_blocks=512)
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    first = base.generate("def add(a, b):\n", params)[0]
    prompts = ["def add(a, b):\n" + first.text + "\ndef add(a, b):\n", "The quick brown fox", "x", "hello world",
               "def add(a, b):\n", "1 2 3 4"]
    expected = [o.token_ids for o in base.generate(prompts, params)]
    llm = LLM(model=str(target), block_size=4, num_kv_blocks=512, max_num_seqs=3,
              spec=SpecConfig(draft=str(head), lookup=True, num_draft_tokens=8))
    split = llm.engine.worker.hybrid
    choices = []
    choose = split.choose
    split.choose = lambda *a, **k: choices.append(choose(*a, **k)) or choices[-1]
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == expected
    assert split.cost.measured and len(split.cost.window) > 10        # every pure-decode step priced rows
    assert {c.mode for c in choices} - {StepMode.PLAIN}, choices      # trees were drafted
    assert llm.engine.worker.stats()["spec_steps"] > 0
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
