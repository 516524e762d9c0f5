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
