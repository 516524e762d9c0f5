"""The hybrid's per-request source choice: lookup carries, and the head drafts only where it pays."""
from __future__ import annotations

from eagle_worker.spec.drafter import DraftState
from eagle_worker.spec.hybrid import HybridSplit


def _measured(head_s: float, plain_s: float) -> HybridSplit:
    split = HybridSplit()
    for _ in range(3):
        split.observe(1, "head", head_s)
        split.observe(1, "plain", plain_s)
    return split


def test_head_drafts_only_where_its_trees_pay():
    split = _measured(head_s=0.090, plain_s=0.040)           # a head step costs 2.25 plain steps
    weak, strong = DraftState(ema_head=0.8), DraftState(ema_head=2.0)
    weak_choices = [split.use_head(weak, None, 1) for _ in range(40)]
    assert [i for i, c in enumerate(weak_choices) if c] == [3, 11, 27]   # probed after 4, 8, 16 skips
    assert all(split.use_head(strong, None, 1) for _ in range(40))
    # the same head pays on a machine where drafting and verifying are cheap
    cheap = _measured(head_s=0.050, plain_s=0.040)
    assert all(cheap.use_head(DraftState(ema_head=0.8), None, 1) for _ in range(10))


def test_lookup_carries_and_plain_steps_are_measured_first():
    split = HybridSplit()
    st = DraftState(ema_head=1.0, ema_lookup=3.0)
    assert [split.use_head(st, [[5, 6]], 1) for _ in range(8)] == [False] * 3 + [True] + [False] * 4
    st.ema_head = 4.0                                        # the head now beats lookup: it drafts
    assert split.use_head(st, [[5, 6]], 1) and st.probe_every == 4
    fresh = DraftState()
    assert split.use_head(fresh, None, 1)                    # nothing measured yet: draft
    split.observe(1, "head", 0.09)
    split.observe(1, "head", 0.09)
    assert not split.use_head(fresh, None, 1)                # now measure what a plain step costs
    split.observe(1, "plain", 0.04)
    split.observe(1, "plain", 0.04)
    assert split.use_head(DraftState(ema_head=2.0), None, 1)
