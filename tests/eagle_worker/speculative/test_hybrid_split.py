"""The hybrid's per-request choice of sources: the mode with the most expected tokens per second."""
from __future__ import annotations

from eagle_worker.speculative.draft_tree import StepMode
from eagle_worker.speculative.hybrid import HybridSplit, HybridState


def _measured(**seconds: float) -> HybridSplit:
    split = HybridSplit()
    for _ in range(3):
        for mode, s in seconds.items():
            split.observe(1, mode, s)
    return split


def _state(outcome: str = "new", **gains: float) -> HybridState:
    return HybridState(gains={"extra": 1.0, "head": 1.0, **gains}, lookup_outcome=outcome)


def _expect(split: HybridSplit, **means: float) -> None:
    """Lookup's expected accepted tokens after each outcome (`n + f` as n sure tokens and a share f)."""
    for outcome, m in means.items():
        split.lookup_reach[outcome] = [1.0] * int(m) + ([m - int(m)] if m % 1 else [])


ALL = dict(merged=0.100, lookup=0.080, head=0.090, plain=0.040)


def test_head_drafts_only_where_its_trees_pay():
    split = _measured(head=0.090, plain=0.040)                # a head step costs 2.25 plain steps
    weak, strong = _state(head=0.8), _state(head=2.0)
    weak_choices = [split.choose(weak, None, 1) for _ in range(60)]
    assert [i for i, c in enumerate(weak_choices) if c == "head"] == [15, 47]   # probes after 16, then 32 skips
    assert set(weak_choices) == {"plain", "head"}
    assert all(split.choose(strong, None, 1) == "head" for _ in range(40))
    # the same head pays on a machine where drafting and verifying are cheap
    cheap = _measured(head=0.050, plain=0.040)
    assert all(cheap.choose(_state(head=0.8), None, 1) == "head" for _ in range(10))


def test_head_joins_lookup_only_when_the_merged_tree_is_faster():
    split = _measured(**ALL)
    _expect(split, complete=3.0)                      # after a whole branch was accepted
    copying = _state("complete", extra=0.2)                   # merged 4.2 / 0.10 s < lookup 4.0 / 0.08 s
    assert [split.choose(copying, [[5, 6]], 1) for _ in range(16)] == ["lookup"] * 15 + ["merged"]
    assert [split.choose(copying, [[5, 6]], 1) for _ in range(10)] == ["lookup"] * 10
    copying.gains["extra"] = 1.5                              # 5.5 / 0.10 > 4.0 / 0.08: the head joins
    assert split.choose(copying, [[5, 6]], 1) == "merged" and copying.probe_every == split.PROBE_EVERY
    copying.gains["extra"] = 0.2                              # the next probe is 16 skipped steps away
    assert [split.choose(copying, [[5, 6]], 1) for _ in range(16)] == ["lookup"] * 15 + ["merged"]


def test_lookup_sits_out_after_a_miss_and_its_proposals_are_still_scored():
    split = _measured(**ALL)
    _expect(split, miss=0.3, partial=4.0, complete=6.0)
    missed = _state("miss", head=0.5)                         # lookup 1.3 / 0.08 s, head 1.5 / 0.09 s < plain 1 / 0.04 s
    assert split.choose(missed, [[7, 8, 9]], 1) == "plain"
    split.shadow(missed, 3, [[7, 8, 9], [7, 5]], budget=8)    # proposed after tokens [1, 2, 3]
    split.score_shadow(missed, [1, 2, 3])                     # nothing followed yet
    assert missed.shadow is not None and missed.lookup_outcome == "miss"
    split.score_shadow(missed, [1, 2, 3, 7])                  # [7, 8, 9] may still match: not settled,
    assert missed.shadow is not None and missed.lookup_outcome == "partial"   # but copying has resumed
    assert split.choose(missed, [[8, 9]], 1) == "lookup"
    missed.lookup_outcome = "miss"
    split.score_shadow(missed, [1, 2, 3, 7, 8, 9])            # the whole branch came true
    assert missed.shadow is None and missed.lookup_outcome == "complete"
    assert split.expected_lookup("miss") > 0.3                   # a miss was followed by 3 tokens
    assert split.choose(missed, [[4, 4]], 1) == "lookup"      # copying resumed: 7 / 0.08 s
    split.shadow(missed, 6, [[4, 4]], budget=8)
    split.score_shadow(missed, [1, 2, 3, 7, 8, 9, 5])
    assert missed.lookup_outcome == "miss"
    split.shadow(missed, 2, [[9, 9, 9]], budget=2)            # branches are scored as the budget cuts them
    split.score_shadow(missed, [1, 2, 9, 9])
    assert missed.lookup_outcome == "complete"


def test_unmeasured_modes_are_tried_and_new_requests_start_from_the_worker_average():
    split = HybridSplit()
    fresh = HybridState()
    assert split.choose(fresh, None, 1) == "head"              # nothing measured yet: draft
    split.observe(1, "head", 0.50)                             # the first step of a mode runs cold: ignored
    split.observe(1, "head", 0.09)
    assert split.choose(fresh, None, 1) == "head"              # one measurement is not enough
    split.observe(1, "head", 0.09)
    assert split.choose(fresh, None, 1) == "plain"             # now measure what a plain step costs
    assert split.choose(fresh, [[1, 2]], 1) == "merged"        # and, with branches, the modes with lookup
    for _ in range(3):
        split.observe(1, "plain", 0.04)
    assert split.steps.means[(1, "head")] == (0.09,)
    for _ in range(200):                                       # earlier requests: the head's trees paid
        split.observe_accepted(HybridState(), "head", 2, 3)
    assert split.new_gains()["head"] > 1.9
    assert split.choose(HybridState(), None, 1) == "head"       # a new request trusts that at once
    st = HybridState()
    for _ in range(10):                                        # ... until its own head steps say otherwise
        split.observe_accepted(st, "head", 0, 1)
    assert split.choose(st, None, 1) == "plain"


def test_a_head_that_sat_out_rejoins_only_if_the_rest_of_the_request_repays_its_catch_up():
    split = _measured(head=0.050, plain=0.040)       # 1.8 tokens / 50 ms beat 1 / 40 ms: 12.2 ms saved a token
    for _ in range(3):
        split.observe_catch_up(100, 0.010)            # 0.1 ms per token the head catches up on
    assert split.catch_up_seconds(600) == 0.060
    st = _state(head=0.8)
    assert split.choose(st, None, 1, remaining=100, stretch=600) == "plain"   # a new request's first step
    st.free_tokens = (0.5, 1.0)                                                       # a step later
    assert split.choose(st, None, 1, remaining=100, stretch=600) == "head"    # 1.2 s saved > 60 ms
    assert split.choose(st, None, 1, remaining=4, stretch=600) == "plain"     # 49 ms saved < 60 ms
    assert split.choose(st, None, 1, remaining=4, stretch=0) == "head"        # nothing to catch up: it pays
    assert split.choose(st, None, 1, stretch=600) == "head"                   # no end in sight: it pays


def test_no_probe_when_its_catch_up_outweighs_a_twentieth_of_the_remaining_time():
    split = _measured(**ALL)
    _expect(split, complete=3.0)
    for _ in range(3):
        split.observe_catch_up(100, 0.010)
    copying = _state("complete", extra=0.2)           # lookup alone: 20 ms a token
    assert [split.choose(copying, [[5, 6]], 1, remaining=100, stretch=600) for _ in range(15)] == ["lookup"] * 15
    # 100 tokens left (2 s), all of them the head's to help with: a probe catching up on 600
    # tokens (60 ms) costs 3% -> probed, but not beside lookup's branches: at the next step lookup
    # leaves free
    copying.free_tokens = (1.0, 1.0)
    assert split.choose(copying, [[5, 6]], 1, remaining=100, stretch=600) == "lookup"
    copying.free_tokens = (1.0, 1.0)
    assert split.choose(copying, None, 1, remaining=100, stretch=600) == "head"
    # 20 tokens left (0.4 s): 60 ms is 15% -> the head stays out
    assert [split.choose(copying, [[5, 6]], 1, remaining=20, stretch=600) for _ in range(15)] == ["lookup"] * 15
    copying.free_tokens = (1.0, 1.0)
    assert {split.choose(copying, None, 1, remaining=20, stretch=600) for _ in range(80)} == {"plain"}


def test_a_head_that_sat_out_does_not_catch_up_beside_lookups_branches():
    split = _measured(**ALL)
    copying = _state("complete", extra=3.0)                   # merged would win on its merits ...
    _expect(split, complete=3.0)
    assert split.choose(copying, [[5, 6]], 1, stretch=0) == "merged"
    assert split.choose(copying, [[5, 6]], 1, stretch=600) == "lookup"      # ... but not with a catch-up


def test_catch_up_is_repaid_only_on_the_steps_lookup_leaves_to_the_head():
    split = _measured(head=0.050, plain=0.040, lookup=0.060, merged=0.080)   # head: 12.2 ms saved a token
    for _ in range(3):
        split.observe_catch_up(100, 0.010)
    st = _state("new", head=0.8)
    st.free_tokens = (1.0, 1.0)                               # lookup carries nothing: 100 tokens repay 60 ms
    assert split.choose(st, None, 1, remaining=100, stretch=600) == "head"
    st.free_tokens = (0.04, 1.0)                              # lookup carries 96% of the steps: 4 tokens do not
    assert split.choose(st, None, 1, remaining=100, stretch=600) == "plain"
    copying = _state("complete")                      # a request lookup keeps carrying ...
    for _ in range(30):
        split.observe_accepted(copying, "lookup", 0, 7)
    assert split.free_share(copying) < 0.01
    assert split.free_share() < 0.5                   # ... and the worker's prior for new requests follow
    assert split.choose(copying, None, 1, remaining=100, stretch=600) == "plain"


def test_the_share_lookup_leaves_counts_tokens_not_steps():
    """One step in three left to the head, but lookup's steps make 7 tokens and the others 1: the
    head has about 1 token in 11 to speed up, not 1 in 3, and 40 remaining tokens do not repay a
    60-ms catch-up (4 tokens at 12.2 ms saved each; 13 would)."""
    split = _measured(head=0.050, plain=0.040, lookup=0.060, merged=0.080)
    for _ in range(3):
        split.observe_catch_up(100, 0.010)
    st = _state("complete", head=0.8)
    for _ in range(30):
        for mode, tokens in (("lookup", 7), ("lookup", 7), ("plain", 1)):
            split.observe_accepted(st, mode, 0, tokens)
    assert 0.04 < split.free_share(st) < 0.1
    assert split.choose(st, None, 1, remaining=40, stretch=600) == "plain"
    assert split.choose(st, None, 1, remaining=40, stretch=0) == "head"     # nothing to catch up: it pays


def test_step_modes():
    assert [StepMode.of(h, lk) for h in (False, True) for lk in (False, True)] == ["plain", "lookup", "head", "merged"]


def test_a_skipped_proposal_that_copying_resumed_on_counts_for_the_outcome_it_followed():
    """After a miss, lookup's next proposal often has a new, right match: when the following tokens
    take it up and lookup is then verified, the miss is credited with the whole run (matched while
    sitting out plus accepted after), not left to the proposals that broke at once."""
    split = _measured(**ALL)
    _expect(split, miss=0.3, partial=4.0)
    missed = _state("miss", head=0.5)
    assert split.choose(missed, [[7, 8, 9, 10, 11]], 1) == "plain"
    split.shadow(missed, 3, [[7, 8, 9, 10, 11]], budget=8)
    split.score_shadow(missed, [1, 2, 3, 7])                     # the plain step's token follows it
    assert missed.lookup_outcome == "partial" and split.expected_lookup("miss") == 0.3
    assert split.choose(missed, [[8, 9, 10, 11]], 1) == "lookup"
    split.observe_lookup(missed, 3, False)                       # verified: 3 more of its tokens
    assert missed.shadow is None and missed.lookup_outcome == "partial"
    assert abs(split.expected_lookup("miss") - (0.95 * 0.3 + 0.05 * 4)) < 1e-9    # 1 matched + 3 accepted
    assert abs(split.expected_lookup("partial") - (0.95 * 4.0 + 0.05 * 3)) < 1e-9
    # a kept proposal that broke at once counts as nothing, as before
    split.shadow(missed, 7, [[5, 5]], budget=8)
    split.observe_lookup(missed, 2, True)
    assert abs(split.expected_lookup("miss") - (0.95 * 0.3 + 0.05 * 4)) < 1e-9


def test_a_merged_tree_is_charged_for_the_lookup_tokens_its_shorter_branches_give_up():
    split = _measured(lookup=0.048, merged=0.050)
    for _ in range(3):
        split.observe(1, "head", 0.09)
        split.observe(1, "plain", 0.04)
    copying = _state("complete", extra=1.0)
    copying.ema_lookup, copying.ema_head = 7.0, 1.0
    assert HybridSplit.head_nodes(copying, 8) == 1             # the head would take 1 of 8 nodes
    _expect(split, complete=8.0)                               # after a complete copy lookup accepts 8
    # uncut, the merged tree would add the head's token: 10 / 50 ms > 9 / 48 ms; with 7 lookup
    # nodes it adds one and loses one: 9 / 50 ms < 9 / 48 ms
    assert split.choose(copying, [[5] * 8], 1) == "merged"
    assert split.choose(copying, [[5] * 8], 1, budget=8) == "lookup"
    _expect(split, complete=2.5)                               # copies that end early lose nothing to the cut
    assert split.choose(copying, [[5] * 8], 1, budget=8) == "merged"


def test_lookup_reach_is_learned_per_depth():
    split = HybridSplit()
    split._learn("miss", 3)
    assert split.lookup_reach["miss"] == [1.0, 0.05, 0.05]
    assert abs(split.expected_lookup("miss") - (0.95 * 1.0 + 0.05 * 3)) < 1e-9
    assert abs(split.expected_lookup("miss", 2) - 1.05) < 1e-9
    split._learn("miss", 0)
    assert split.lookup_reach["miss"] == [0.95, 0.0475, 0.0475]
