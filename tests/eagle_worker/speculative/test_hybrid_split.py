"""The hybrid's per-request choice: sources, lookup's depth and the head's nodes, priced by the
device's cost of a step's rows at the step's batch size (the costs are given, not measured)."""
from __future__ import annotations

from eagle_worker.speculative.draft_tree import StepMode
from eagle_worker.speculative.hybrid import Choice, HybridSplit, HybridState, StepContext, trie_nodes
from eagle_worker.speculative.step_cost import StepCost, StepWork

# seconds: a step's fixed cost, a sequence, a verified row, a head row with logits, a head pass. A
# plain step at batch 1 costs 32 ms, the head alone 52 ms with 2 nodes (3 rows, 3 head rows, 2
# passes) and 41 ms with its first guess alone (2 rows, 1 head row, 1 pass; 0.67 of the gain).
CPU = (0.030, 0.0, 0.002, 0.002, 0.005)


def _split(costs=CPU) -> HybridSplit:
    return HybridSplit(cost=StepCost(coefficients=costs))


def _state(outcome: str = "new", **gains: float) -> HybridState:
    return HybridState(gains={"extra": 1.0, "head": 1.0, **gains}, lookup_outcome=outcome)


def _expect(split: HybridSplit, **means: float) -> None:
    """Lookup's expected accepted tokens after each outcome (`n + f` as n sure tokens and a share f)."""
    for outcome, m in means.items():
        split.lookup_reach[outcome] = [1.0] * int(m) + ([m - int(m)] if m % 1 else [])


def _mode(split, st, branches, step=1, **kw) -> str:
    return split.choose(st, branches, step, **kw).mode


def test_head_drafts_only_where_its_trees_pay():
    split = _split()
    weak, strong = _state(head=0.3), _state(head=2.0)          # 41 ms / 1.2 tokens > 32 ms / 1 token
    weak_choices = [_mode(split, weak, None) for _ in range(60)]
    assert [i for i, c in enumerate(weak_choices) if c == "head"] == [15, 47]   # probes after 16, then 32 skips
    assert set(weak_choices) == {"plain", "head"}
    assert all(split.choose(strong, None, 1) == Choice(StepMode.HEAD, 0, 2) for _ in range(40))
    # a head that hits half the time pays with its first guess alone (41 ms / 1.34 tokens), not with
    # two nodes (52 ms / 1.5)
    assert all(split.choose(_state(head=0.5), None, 1) == Choice(StepMode.HEAD, 0, 1) for _ in range(10))
    # the same head pays on a device where its rows and passes are cheap
    cheap = _split((0.030, 0.0, 0.002, 0.0005, 0.001))
    assert all(_mode(cheap, _state(head=0.5), None) == "head" for _ in range(10))


def test_at_a_large_batch_only_a_confident_source_keeps_its_nodes():
    """Batch 64 on a device where a row costs 2 ms and a step's fixed cost 30 ms: a request's share
    of the fixed cost is under half a millisecond, so a draft node must be likely to pay its row."""
    split = _split()
    _expect(split, miss=0.3, complete=8.0)
    unsure = _state("miss", head=0.3)                            # a weak head, lookup after a miss
    copying = _state("complete", head=0.3)                       # lookup after a whole branch came true
    branch = [list(range(10, 18))]
    assert split.choose(unsure, branch, 64) == Choice(StepMode.PLAIN)
    assert split.choose(unsure, None, 64) == Choice(StepMode.PLAIN)
    assert split.choose(copying, branch, 64) == Choice(StepMode.LOOKUP, 8, 0)   # its whole branch
    # at batch 1 the fixed cost dominates: the unsure lookup's one node is worth its row
    assert split.choose(unsure, branch, 1) == Choice(StepMode.LOOKUP, 1, 0)


def test_a_sampled_request_prices_its_rows_at_what_sampling_them_costs():
    """At temperature 1 a row needs the full LM head and the sampler (8 ms here against 2 ms for an
    argmax): at batch 8 a lookup node that pays its greedy row does not pay a sampled one, while a
    copy lookup is certain of keeps its branch either way."""
    split = _split((0.030, 0.0, 0.002, 0.002, 0.005, 0.0, 0.006))
    _expect(split, partial=0.6, complete=8.0)
    branch = [list(range(10, 18))]
    greedy, sampled = _state("partial", head=0.0), _state("partial", head=0.0)
    sampled.sampled = True
    assert split.choose(greedy, branch, 8) == Choice(StepMode.LOOKUP, 1, 0)   # 7.75 ms / 1.6 tokens < 5.75 ms
    assert split.choose(sampled, branch, 8) == Choice(StepMode.PLAIN)        # 19.75 ms / 1.6 tokens > 11.75 ms
    copying = _state("complete", head=0.0)
    copying.sampled = True
    assert split.choose(copying, branch, 8) == Choice(StepMode.LOOKUP, 8, 0)
    # the fit learns the extra cost from steps that sample: a row sampled costs 6 ms more here
    cost = StepCost(window=64)
    for rows, sampled_rows in [(8, 0), (8, 8), (12, 0), (12, 12), (8, 4), (16, 8)] * 8:
        work = StepWork(8, rows, sampled_rows=sampled_rows)
        cost.observe(work, 0.030 + 0.002 * rows + 0.006 * sampled_rows)
    assert abs(cost.coefficient("per_sampled_row") - 0.006) < 0.0015
    assert abs(cost.coefficient("per_row") - 0.002) < 0.0015


def test_a_tree_is_priced_beyond_its_rows():
    """Verifying a tree costs a sequence more than its rows (its mask, the acceptance walk, KV
    compaction): at batch 8 a lookup node that pays its 2 ms row does not pay 3 ms more for being a
    tree, while a longer copy still does; the fit learns that cost from steps' tree counts."""
    split = _split((0.030, 0.0, 0.002, 0.002, 0.005, 0.0, 0.0, 0.003))
    _expect(split, partial=0.6, complete=4.0)
    branch = [list(range(10, 18))]
    assert split.choose(_state("partial", head=0.0), branch, 8) == Choice(StepMode.PLAIN)   # 10.75 ms / 1.6 > 5.75 ms
    assert _split().choose(_state("partial", head=0.0), branch, 8) == Choice(StepMode.LOOKUP, 1, 0)
    assert split.choose(_state("complete", head=0.0), branch, 8).mode == "lookup"
    cost = StepCost(window=64)
    for seqs, rows, trees in [(8, 8, 0), (8, 16, 1), (8, 16, 8), (8, 12, 2), (4, 12, 4), (8, 24, 4)] * 8:
        cost.observe(StepWork(seqs, rows, trees=trees), 0.030 + 0.002 * rows + 0.003 * trees)
    assert abs(cost.coefficient("per_tree") - 0.003) < 0.001
    assert abs(cost.coefficient("per_row") - 0.002) < 0.001


def test_lookup_is_cut_to_the_depth_that_pays_at_this_batch_size():
    split = _split()
    split.lookup_reach["partial"] = [1.0, 0.9, 0.5, 0.2, 0.1, 0.05, 0.02, 0.01]
    _expect(split, miss=0.3)
    st, branch = _state("partial", head=0.0), [list(range(8))]
    assert split.choose(st, branch, 1) == Choice(StepMode.LOOKUP, 4, 0)    # 40 ms / 3.6 tokens
    assert split.choose(st, branch, 64) == Choice(StepMode.LOOKUP, 2, 0)   # 6.5 ms / 2.9 tokens
    assert trie_nodes([[1, 2, 3], [1, 2, 4], [5]], 2) == 3 and trie_nodes([[1, 2, 3], [1, 2, 4]], 3) == 4
    # without a head the same rule sizes prompt lookup alone
    assert split.choose(st, branch, StepContext(64, head=False)) == Choice(StepMode.LOOKUP, 2, 0)
    assert split.choose(_state("miss"), branch, StepContext(64, head=False)).mode == "plain"


def test_head_joins_lookup_only_when_the_merged_tree_is_faster():
    split = _split()
    _expect(split, complete=3.0)                              # after a whole branch was accepted
    copying = _state("complete", extra=0.2)                   # lookup: 36 ms / 3 tokens; merged: 56 ms / 3.2
    copying.ema_lookup, copying.ema_head = 7.0, 1.0           # the head takes 2 of 16 nodes
    # a probe is expected to lose 56 - 3.2 * 12 = 17.6 ms: due after 16 skipped steps, it waits
    # until that is a fiftieth of the time sat out (25 steps of 36 ms: 18 ms)
    assert [_mode(split, copying, [[5, 6]]) for _ in range(25)] == ["lookup"] * 24 + ["merged"]
    assert [_mode(split, copying, [[5, 6]]) for _ in range(10)] == ["lookup"] * 10
    copying.gains["extra"] = 2.0                              # 56 ms / 5 tokens < 12 ms a token: the head joins
    assert split.choose(copying, [[5, 6]], 1) == Choice(StepMode.MERGED, 2, 2)
    assert copying.probe_every == split.PROBE_EVERY
    copying.gains["extra"] = 0.2                              # probing starts over
    assert [_mode(split, copying, [[5, 6]]) for _ in range(25)] == ["lookup"] * 24 + ["merged"]


def test_lookup_sits_out_after_a_miss_and_its_proposals_are_still_scored():
    split = _split()
    _expect(split, miss=0.05, partial=4.0, complete=6.0)
    missed = _state("miss", head=0.3)                         # lookup 34 ms / 1.05, head 41 ms / 1.2 > plain 32 ms / 1
    assert _mode(split, missed, [[7, 8, 9]]) == "plain"
    split.shadow(missed, 3, [[7, 8, 9], [7, 5]], budget=8)    # proposed after tokens [1, 2, 3]
    split.score_shadow(missed, [1, 2, 3])                     # nothing followed yet
    assert missed.shadow is not None and missed.lookup_outcome == "miss"
    split.score_shadow(missed, [1, 2, 3, 7])                  # [7, 8, 9] may still match: not settled,
    assert missed.shadow is not None and missed.lookup_outcome == "partial"   # but copying has resumed
    assert _mode(split, missed, [[8, 9]]) == "lookup"
    missed.lookup_outcome = "miss"
    split.score_shadow(missed, [1, 2, 3, 7, 8, 9])            # the whole branch came true
    assert missed.shadow is None and missed.lookup_outcome == "complete"
    assert split.expected_lookup("miss") > 0.05                  # a miss was followed by 3 tokens
    assert _mode(split, missed, [[4, 4]]) == "lookup"         # copying resumed
    split.shadow(missed, 6, [[4, 4]], budget=8)
    split.score_shadow(missed, [1, 2, 3, 7, 8, 9, 5])
    assert missed.lookup_outcome == "miss"
    split.shadow(missed, 2, [[9, 9, 9]], budget=2)            # branches are scored as the budget cuts them
    split.score_shadow(missed, [1, 2, 9, 9])
    assert missed.lookup_outcome == "complete"


def test_new_requests_start_from_the_worker_average():
    split = _split()
    assert _mode(split, HybridState(), None) == "head"         # nothing seen yet: the head is trusted (1 token)
    for _ in range(200):                                       # earlier requests: the head's trees missed
        split.observe_accepted(HybridState(), "head", 0, 1)
    assert split.new_gains()["head"] < 0.01
    assert _mode(split, HybridState(), None) == "plain"         # a new request starts from that
    st = HybridState()
    for _ in range(10):                                        # ... until its own head steps say otherwise
        split.observe_accepted(st, "head", 3, 4)
    assert _mode(split, st, None) == "head"


def test_the_step_cost_is_fitted_from_every_steps_rows():
    """No step explores: the rows each step happened to run are enough to price a row."""
    cost = StepCost()
    assert not cost.measured
    truth = lambda w: (0.030 + 0.001 * w.sequences + 0.002 * w.target_rows + 0.001 * w.head_rows   # noqa: E731
                       + 0.004 * w.head_passes)
    works = [StepWork(*w) for w in ((1, 1, 0, 0), (1, 9, 3, 2), (4, 4, 0, 0), (8, 17, 33, 5), (4, 8, 2, 2),
                                    (64, 64, 0, 0), (32, 70, 0, 0), (8, 8, 0, 0))]
    cost.observe(works[0], 1.0)                                # the first step runs cold: not counted
    assert not cost.measured
    for _ in range(40):
        for w in works:
            cost.observe(w, truth(w))
    assert cost.measured
    got = cost.snapshot()
    assert abs(got["per_row"] - 0.002) < 2e-4 and abs(got["per_seq"] - 0.001) < 2e-4 and abs(got["fixed"] - 0.030) < 3e-3
    assert abs(cost.seconds(StepWork(16, 32, 6, 2)) - truth(StepWork(16, 32, 6, 2))) < 2e-3


def test_a_head_that_sat_out_rejoins_only_if_the_rest_of_the_request_repays_its_catch_up():
    split = _split()                                   # 1.8 tokens / 52 ms beat 1 / 32 ms: 3.1 ms saved a token
    for _ in range(3):
        split.observe_catch_up(100, 0.010)            # 0.1 ms per token the head catches up on
    assert split.catch_up_seconds(600) == 0.060
    st = _state(head=0.8)
    assert _mode(split, st, None, remaining=100, stretch=600) == "plain"   # a new request's first step
    st.free_tokens = (0.5, 1.0)                                           # a step later: 50 tokens left to it
    assert _mode(split, st, None, remaining=100, stretch=600) == "head"    # 155 ms saved > 60 ms
    assert _mode(split, st, None, remaining=4, stretch=600) == "plain"     # 6 ms saved < 60 ms
    assert _mode(split, st, None, remaining=4, stretch=0) == "head"        # nothing to catch up: it pays
    assert _mode(split, st, None, stretch=600) == "head"                   # no end in sight: it pays


def test_a_probe_spends_at_most_a_fiftieth_of_the_time_sat_out_and_of_the_remaining_time():
    split = _split()
    for _ in range(3):
        split.observe_catch_up(100, 0.010)
    st = _state(head=0.3)                              # plain: 32 ms a token; the head's first guess: 41 ms / 1.2
    st.free_tokens = (1.0, 1.0)                        # all remaining tokens the head's to help with
    # a probe catching up on 500 tokens is expected to lose 50 ms + 41 ms - 1.2 * 32 ms = 52.6 ms:
    # due after 16 skipped steps, it waits for 83 steps of 32 ms (2.66 s, a fiftieth: 53.1 ms)
    modes = [_mode(split, st, None, remaining=1000, stretch=500) for _ in range(83)]
    assert modes == ["plain"] * 82 + ["head"]
    # 80 tokens left (2.56 s): 52.6 ms is more than a fiftieth of it -> the head stays out however long
    assert {_mode(split, st, None, remaining=80, stretch=500) for _ in range(400)} == {"plain"}
    # and a probe never catches up beside lookup's branches
    assert {_mode(split, st, [[5, 6]], remaining=1000, stretch=500) for _ in range(400)} == {"lookup"}


def test_a_sampled_request_probes_a_weak_head_later_than_a_greedy_one():
    """This CPU's costs at batch 8 (a 48 ms step, a 0.9 ms row, 5 ms more when it is sampled, a 3.3
    ms head pass): a probe of a head accepting 0.44 tokens (its first guess alone: 0.29) loses 1.8 ms
    for a greedy request (8.1 ms a step) and 5.3 ms for a sampled one (13.1 ms a step): the greedy
    one is due at the 16th skipped step (the first a probe may come), the sampled one at the 21st."""
    split = _split((0.048, 0.0012, 0.0009, 0.0, 0.0033, 0.0, 0.005))
    greedy, sampled = _state(head=0.44), _state(head=0.44)
    sampled.sampled = True
    greedy_modes = [_mode(split, greedy, None, step=8) for _ in range(16)]
    sampled_modes = [_mode(split, sampled, None, step=8) for _ in range(21)]
    assert greedy_modes == ["plain"] * 15 + ["head"]
    assert sampled_modes == ["plain"] * 20 + ["head"]


def test_a_head_that_sat_out_does_not_catch_up_beside_lookups_branches():
    split = _split()
    copying = _state("complete", extra=3.0)                   # merged would win on its merits ...
    copying.ema_lookup, copying.ema_head = 7.0, 1.0
    _expect(split, complete=3.0)
    assert _mode(split, copying, [[5, 6]], stretch=0) == "merged"
    assert _mode(split, copying, [[5, 6]], stretch=600) == "lookup"      # ... but not with a catch-up


def test_catch_up_is_repaid_only_on_the_steps_lookup_leaves_to_the_head():
    split = _split()                                          # head: 3.1 ms saved a token
    for _ in range(3):
        split.observe_catch_up(100, 0.010)
    st = _state("new", head=0.8)
    st.free_tokens = (1.0, 1.0)                               # lookup carries nothing: 100 tokens repay 60 ms
    assert _mode(split, st, None, remaining=100, stretch=600) == "head"
    st.free_tokens = (0.04, 1.0)                              # lookup carries 96% of the tokens: 4 do not
    assert _mode(split, st, None, remaining=100, stretch=600) == "plain"
    copying = _state("complete", head=0.8)            # a request lookup keeps carrying ...
    for _ in range(30):
        split.observe_accepted(copying, "lookup", 0, 7)
    assert split.free_share(copying) < 0.01
    assert split.free_share() < 0.5                   # ... and the worker's prior for new requests follow
    assert _mode(split, copying, None, remaining=100, stretch=600) == "plain"


def test_the_share_lookup_leaves_counts_tokens_not_steps():
    """One step in three left to the head, but lookup's steps make 7 tokens and the others 1: the
    head has about 1 token in 15 to speed up, not 1 in 3, and 100 remaining tokens do not repay a
    60-ms catch-up (7 tokens at 3.1 ms saved each; 20 would)."""
    split = _split()
    for _ in range(3):
        split.observe_catch_up(100, 0.010)
    st = _state("complete", head=0.8)
    for _ in range(30):
        for mode, tokens in (("lookup", 7), ("lookup", 7), ("plain", 1)):
            split.observe_accepted(st, mode, 0, tokens)
    assert 0.04 < split.free_share(st) < 0.1
    assert _mode(split, st, None, remaining=100, stretch=600) == "plain"
    assert _mode(split, st, None, remaining=100, stretch=0) == "head"     # nothing to catch up: it pays


def test_step_modes():
    assert [StepMode.of(h, lk) for h in (False, True) for lk in (False, True)] == ["plain", "lookup", "head", "merged"]


def test_a_skipped_proposal_that_copying_resumed_on_counts_for_the_outcome_it_followed():
    """After a miss, lookup's next proposal often has a new, right match: when the following tokens
    take it up and lookup is then verified, the miss is credited with the whole run (matched while
    sitting out plus accepted after), not left to the proposals that broke at once."""
    split = _split()
    _expect(split, miss=0.05, partial=4.0)
    missed = _state("miss", head=0.3)
    assert _mode(split, missed, [[7, 8, 9, 10, 11]]) == "plain"
    split.shadow(missed, 3, [[7, 8, 9, 10, 11]], budget=8)
    split.score_shadow(missed, [1, 2, 3, 7])                     # the plain step's token follows it
    assert missed.lookup_outcome == "partial" and split.expected_lookup("miss") == 0.05
    assert _mode(split, missed, [[8, 9, 10, 11]]) == "lookup"
    split.observe_lookup(missed, 3, False)                       # verified: 3 more of its tokens
    assert missed.shadow is None and missed.lookup_outcome == "partial"
    assert abs(split.expected_lookup("miss") - (0.95 * 0.05 + 0.05 * 4)) < 1e-9    # 1 matched + 3 accepted
    assert abs(split.expected_lookup("partial") - (0.95 * 4.0 + 0.05 * 3)) < 1e-9
    # a kept proposal that broke at once counts as nothing, as before
    split.shadow(missed, 7, [[5, 5]], budget=8)
    split.observe_lookup(missed, 2, True)
    assert abs(split.expected_lookup("miss") - (0.95 * 0.05 + 0.05 * 4)) < 1e-9


def test_a_merged_tree_is_charged_for_the_lookup_tokens_its_shorter_branches_give_up():
    split = _split((0.030, 0.0, 0.002, 0.0001, 0.0001))             # a cheap head
    copying = _state("complete", extra=1.0)
    copying.ema_lookup, copying.ema_head = 7.0, 1.0
    assert HybridSplit.head_nodes(copying, 8) == 1             # the head would take 1 of 8 nodes
    _expect(split, complete=8.0)                               # after a complete copy lookup accepts 8
    # with room for all 8 lookup nodes the merged tree adds the head's token: 52.5 ms / 10 < 48 ms / 9;
    # in 8 nodes lookup keeps 7 and the merged tree gains nothing: 48.2 ms / 9 > 48 ms / 9
    assert split.choose(copying, [[5] * 8], 1, budget=16) == Choice(StepMode.MERGED, 8, 2)
    assert split.choose(copying, [[5] * 8], 1, budget=8) == Choice(StepMode.LOOKUP, 8, 0)
    _expect(split, complete=2.5)                               # copies that end early lose nothing to the cut
    assert _mode(split, copying, [[5] * 8], budget=8) == "merged"


def test_lookup_reach_is_learned_per_depth():
    split = HybridSplit()
    split._learn("miss", 3)
    assert split.lookup_reach["miss"] == [1.0, 0.05, 0.05]
    assert abs(split.expected_lookup("miss") - (0.95 * 1.0 + 0.05 * 3)) < 1e-9
    assert abs(split.expected_lookup("miss", 2) - 1.05) < 1e-9
    split._learn("miss", 0)
    assert split.lookup_reach["miss"] == [0.95, 0.0475, 0.0475]


def test_with_no_request_waiting_a_sequence_ahead_of_the_slowest_saves_less_of_the_fixed_cost():
    """While requests wait, finishing sooner frees a slot: every sequence saves its whole share.
    With none waiting the batch runs until its slowest sequence is done: one with half the slowest's
    expected remaining steps saves half its share."""
    from types import SimpleNamespace

    from eagle_worker.speculative.worker import EagleWorker

    worker = EagleWorker.__new__(EagleWorker)
    worker.hybrid = HybridSplit()
    fast, slow, new = HybridState(free_tokens=(0.0, 4.0)), HybridState(free_tokens=(1.0, 1.0)), HybridState()
    worker.states = {i: SimpleNamespace(hybrid=st) for i, st in enumerate((fast, slow, new))}

    def cand(i, remaining):
        return SimpleNamespace(seq=SimpleNamespace(request_id=i, num_output_tokens=0,
                                                   params=SimpleNamespace(max_tokens=remaining)))

    cands = [cand(0, 80), cand(1, 40), cand(2, 40)]        # 20, 40 and 40 steps left (a new one: 1 token a step)
    worker.queue_depth = lambda: 3
    assert worker._fixed_shares(cands) == [1.0, 1.0, 1.0]
    worker.queue_depth = lambda: 0
    assert worker._fixed_shares(cands) == [0.5, 1.0, 1.0]
    assert worker._fixed_shares(cands[:1]) == [1.0]         # alone, a sequence is its batch's slowest


def test_the_cost_fit_over_a_sliding_window_is_the_fit_of_the_window():
    """The fit keeps running sums as steps enter and leave its window: it must equal a least-squares
    fit of the steps in the window, also after a feature (prefill chunks) has left it entirely."""
    import numpy as np

    cost = StepCost(window=32)
    rng = np.random.default_rng(0)
    for i in range(200):
        work = StepWork(int(rng.integers(1, 33)), int(rng.integers(1, 100)), int(rng.integers(0, 20)),
                        int(rng.integers(0, 5)), 300 if i < 100 and i % 3 == 0 else 0,
                        int(rng.integers(0, 10)), int(rng.integers(0, 8)))
        cost.observe(work, 0.03 + 0.002 * work.target_rows + 0.0005 * work.prefill_tokens + 0.004 * work.trees)
        if not cost.window:                  # the first step runs cold and is not measured
            continue
        X = np.array([x for x, _ in cost.window])
        y = np.array([s for _, s in cost.window])
        w = cost.prior_weight * np.maximum((X ** 2).mean(axis=0), 1e-9)
        ref = np.maximum(np.linalg.solve(X.T @ X + np.diag(w), X.T @ y + w * cost._prior), 1e-3 * cost._prior)
        assert np.allclose(cost.theta, ref, rtol=1e-6, atol=1e-12), i
    assert len(cost.window) == 32
    assert cost.coefficient("per_prefill_token") == cost._prior[5]     # gone from the window: the prior
    assert abs(cost.coefficient("per_tree") - 0.004) < 0.001


def test_a_one_node_head_step_counts_for_the_share_of_the_usual_trees_gain_it_makes():
    """The head's gain is kept in units of its usual (2-node) tree: a first guess alone that hits
    every time stands for 1 / FIRST_NODE_SHARE of those, and is priced back to 1 token a step."""
    split = _split()
    one, two = HybridState(), HybridState()
    for _ in range(30):
        split.observe_accepted(one, "head", 1, 2, head_nodes=1)
        split.observe_accepted(two, "head", 1, 2, head_nodes=2)
    assert abs(one.gains["head"] * HybridSplit.FIRST_NODE_SHARE - 1.0) < 0.01
    assert abs(two.gains["head"] - 1.0) < 0.01
    assert split.head_size_share(1) == HybridSplit.FIRST_NODE_SHARE and split.head_size_share(3) == 1.0


def test_the_worker_learns_what_the_heads_first_guess_alone_makes_from_its_multi_node_steps():
    """A multi-node head step says what a 1-node tree would have made there (its first guess
    accepted or not: the target's token does not depend on the tree). Where the head's tokens come
    from its other nodes, its first guess alone is not worth a step and the head keeps its 2-node
    tree; where the first guess makes them all, the 1-node tree makes the whole gain for less."""
    split, st = _split(), _state(head=1.0)
    assert split.choose(st, [], 1).head_nodes == 1                 # the prior share (0.67): one node
    for _ in range(300):                                            # hits come from the second node only
        split.observe_accepted(HybridState(), "head", 1, 2, head_nodes=2, first_node=False)
    assert split.head_size_share(1) < 0.1
    assert split.choose(_state(head=1.0), [], 1).head_nodes == 2
    for _ in range(300):                                            # the first guess makes every token
        split.observe_accepted(HybridState(), "head", 1, 2, head_nodes=2, first_node=True)
    assert split.head_size_share(1) > 0.95
    assert split.choose(_state(head=1.0), [], 1).head_nodes == 1
    one = HybridState()
    for _ in range(30):                                             # a 1-node step's gain, scaled by the learned share
        split.observe_accepted(one, "head", 1, 2, head_nodes=1)
    assert abs(one.gains["head"] - 1 / split.head_size_share(1)) < 0.01
    before = split.first_node
    split.observe_accepted(HybridState(), "merged", 1, 2, head_nodes=2, first_node=True)   # not the head alone
    split.observe_accepted(HybridState(), "head", 1, 2, head_nodes=1, first_node=True)     # no other nodes
    assert split.first_node == before
