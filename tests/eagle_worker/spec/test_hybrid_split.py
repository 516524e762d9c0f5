"""The hybrid's per-request choice: the head drafts only in steps where it buys more tokens per second."""
from __future__ import annotations

from eagle_worker.spec.drafter import DraftState
from eagle_worker.spec.hybrid import HybridSplit, step_mode


def _measured(**seconds: float) -> HybridSplit:
    split = HybridSplit()
    for _ in range(3):
        for mode, s in seconds.items():
            split.observe(1, mode, s)
    return split


def _state(**gains: float) -> DraftState:
    return DraftState(gains={"lookup": 1.0, "extra": 1.0, "head": 1.0, **gains})


def test_head_drafts_only_where_its_trees_pay():
    split = _measured(head=0.090, plain=0.040)                # a head step costs 2.25 plain steps
    weak, strong = _state(head=0.8), _state(head=2.0)
    weak_choices = [split.use_head(weak, None, 1) for _ in range(60)]
    assert [i for i, c in enumerate(weak_choices) if c] == [15, 47]      # probed after 16, then 32 skips
    assert all(split.use_head(strong, None, 1) for _ in range(40))
    # the same head pays on a machine where drafting and verifying are cheap
    cheap = _measured(head=0.050, plain=0.040)
    assert all(cheap.use_head(_state(head=0.8), None, 1) for _ in range(10))


def test_head_joins_lookup_only_when_the_merged_tree_is_faster():
    split = _measured(merged=0.100, lookup=0.080)
    copying = _state(lookup=3.0, extra=0.2)                   # 4.2 tokens / 0.10 s < 4.0 / 0.08 s
    assert [split.use_head(copying, [[5, 6]], 1) for _ in range(16)] == [False] * 15 + [True]
    copying.gains["extra"] = 1.5                              # 5.5 / 0.10 > 4.0 / 0.08: the head joins
    assert split.use_head(copying, [[5, 6]], 1) and copying.probe_every == split.PROBE_EVERY


def test_unmeasured_modes_are_tried_and_new_requests_start_from_the_worker_average():
    split = HybridSplit()
    fresh = DraftState()
    assert split.use_head(fresh, None, 1)                     # nothing measured yet: draft
    split.observe(1, "head", 0.50)                            # the first step of a mode runs cold: ignored
    split.observe(1, "head", 0.09)
    assert split.use_head(fresh, None, 1)                     # one measurement is not enough
    split.observe(1, "head", 0.09)
    assert not split.use_head(fresh, None, 1)                 # now measure what a plain step costs
    for _ in range(3):
        split.observe(1, "plain", 0.04)
    assert split.steps.means[(1, "head")] == (0.09,)
    for _ in range(200):                                      # earlier requests: the head's trees paid
        split.observe_accepted(DraftState(), "head", 0, 2)
    assert split.new_gains()["head"] > 1.9
    assert split.use_head(DraftState(), None, 1)              # a new request trusts that at once
    st = DraftState()
    for _ in range(10):                                       # ... until its own head steps say otherwise
        split.observe_accepted(st, "head", 0, 0)
    assert not split.use_head(st, None, 1)


def test_step_modes():
    assert [step_mode(h, lk) for h in (False, True) for lk in (False, True)] == ["plain", "lookup", "head", "merged"]


def test_a_head_that_sat_out_rejoins_only_if_the_rest_of_the_request_repays_its_catch_up():
    split = _measured(head=0.050, plain=0.040)       # 1.8 tokens / 50 ms beat 1 / 40 ms: 12.2 ms saved a token
    for _ in range(3):
        split.observe_catch_up(100, 0.010)            # 0.1 ms per token the head catches up on
    assert split.catch_up_seconds(600) == 0.060
    st = _state(head=0.8)
    assert split.use_head(st, None, 1, remaining=100, stretch=600)      # 1.2 s saved > 60 ms
    assert not split.use_head(st, None, 1, remaining=4, stretch=600)    # 49 ms saved < 60 ms
    assert split.use_head(st, None, 1, remaining=4, stretch=0)          # nothing to catch up: it pays
    assert split.use_head(st, None, 1, stretch=600)                     # no end in sight: it pays


def test_no_probe_when_its_catch_up_outweighs_a_twentieth_of_the_remaining_time():
    split = _measured(merged=0.100, lookup=0.080)
    for _ in range(3):
        split.observe_catch_up(100, 0.010)
    copying = _state(lookup=3.0, extra=0.2)           # lookup alone: 20 ms a token
    # 100 tokens left (2 s): a probe catching up on 600 tokens (60 ms) costs 3% -> probed
    assert [split.use_head(copying, [[5, 6]], 1, remaining=100, stretch=600) for _ in range(16)] == [False] * 15 + [True]
    # 20 tokens left (0.4 s): 60 ms is 15% -> the head stays out
    assert not any(split.use_head(copying, [[5, 6]], 1, remaining=20, stretch=600) for _ in range(80))
