"""Hybrid drafting: per request and step, which sources draft and how the node budget is split.

Prompt lookup is nearly free to draft; the head costs a drafting pass and a bigger tree to verify.
So, per request: while lookup carries it (it matched, and recently accepted at least as much as
the head), the head sits the step out. When lookup has nothing, the head drafts only if its trees
pay for themselves on this machine: its recent accepted tokens per step against the measured cost
of a head step relative to a plain one (both measured per batch-size bucket). Skipped heads still
draft every few steps, so their estimates stay current. When both draft, the budget is split by
each source's recent acceptance.
"""
from __future__ import annotations

from collections import defaultdict

from eagle_worker.spec.drafter import DraftState
from eagle_worker.spec.policy import bucket


class HybridSplit:
    PROBE_EVERY = 4            # a skipped head still drafts on every 4th such step

    def __init__(self, ema: float = 0.2):
        self.ema = ema
        self.seconds: dict[tuple[int, str], float] = {}      # (bucket, "head" | "plain") -> step seconds
        self.samples: dict[tuple[int, str], int] = defaultdict(int)

    def use_head(self, st: DraftState, branches, batch_size: int) -> bool:
        if branches:                     # lookup matched: skip the head while lookup carries the request
            st.lookup_steps += 1
            return st.lookup_steps % self.PROBE_EVERY == 0 or st.ema_lookup < st.ema_head
        b = bucket(batch_size)
        if self.samples[(b, "head")] < 2:
            return True
        if self.samples[(b, "plain")] < 2:               # measure a couple of plain steps once head steps exist
            return False
        pays = (1.0 + st.ema_head) * self.seconds[(b, "plain")] > self.seconds[(b, "head")]
        if pays:
            return True
        st.skipped_steps += 1
        return st.skipped_steps % self.PROBE_EVERY == 0

    @staticmethod
    def head_nodes(st: DraftState, budget: int) -> int:
        """Nodes the head keeps when lookup branches share the tree (the rest go to lookup)."""
        share = (st.ema_lookup + 0.1) / (st.ema_head + st.ema_lookup + 0.2)
        return budget - max(1, round(budget * share))

    def observe(self, batch_size: int, kind: str, seconds: float) -> None:
        """One pure-decode step: `kind` "head" (the head drafted) or "plain" (no tree at all)."""
        key = (bucket(batch_size), kind)
        self.samples[key] += 1
        ema = max(self.ema, 1.0 / self.samples[key])
        self.seconds[key] = seconds if key not in self.seconds else (1 - ema) * self.seconds[key] + ema * seconds
