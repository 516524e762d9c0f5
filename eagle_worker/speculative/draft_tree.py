"""One sequence's draft tree for a step, and which sources drafted it.

A tree is parents-first: node 0 is the root (the newest committed token, already sampled), and
every other node's parent comes before it. Nodes remember whether the EAGLE head proposed them,
prompt lookup did, or both (a lookup branch that agrees with the head's nodes reuses them).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass


class StepMode(str, enum.Enum):
    """Which sources drafted a step's tree (the hybrid's choice per request and step)."""

    PLAIN = "plain"        # no tree: one token from the target
    LOOKUP = "lookup"      # prompt-lookup branches only
    HEAD = "head"          # the EAGLE head's tree only
    MERGED = "merged"      # both, under one node budget

    @classmethod
    def of(cls, from_head: bool, from_lookup: bool) -> StepMode:
        if from_head:
            return cls.MERGED if from_lookup else cls.HEAD
        return cls.LOOKUP if from_lookup else cls.PLAIN


@dataclass
class DraftTree:
    parents: list[int]        # parent node of each node (-1 for the root)
    tokens: list[int]         # target vocabulary ids; tokens[0] is the root
    depth: list[int]          # 0 for the root
    from_head: list[bool]     # the head proposed this node
    from_lookup: list[bool]   # a lookup branch passes through this node

    @classmethod
    def root_only(cls, token: int) -> DraftTree:
        return cls([-1], [token], [0], [False], [False])

    @property
    def num_draft_nodes(self) -> int:
        return len(self.tokens) - 1

    @property
    def mode(self) -> StepMode:
        return StepMode.of(any(self.from_head[1:]), any(self.from_lookup[1:]))

    def path_tokens(self, node: int) -> list[int]:
        """The draft tokens from below the root down to `node`: its context after the root."""
        out = []
        while node > 0:
            out.append(self.tokens[node])
            node = self.parents[node]
        return out[::-1]

    def lookup_leaf(self, node: int) -> bool:
        """True when `node` ends a lookup branch (no lookup node below it)."""
        return self.from_lookup[node] and not any(
            self.from_lookup[i] and self.parents[i] == node for i in range(1, len(self.parents)))
