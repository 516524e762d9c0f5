"""Prompt-lookup drafting and merging its branches into the EAGLE tree.

`NgramIndex` maps every n-gram of a request's tokens (prompt and output, n in a range) to the
positions right after its occurrences, updated incrementally as tokens are committed, so a lookup
costs one dict probe per n and never rescans the context. `propose` matches the longest suffix
first and returns the continuations that followed its most recent occurrences (several matches,
several branches). `merge_branches` inserts branches into a draft tree as a trie: a branch that
agrees with nodes already there reuses them for free, and only new nodes spend the budget.
"""
from __future__ import annotations

from collections import defaultdict

from eagle_worker.speculative.draft_tree import DraftTree


class NgramIndex:
    def __init__(self, n_min: int = 2, n_max: int = 5, max_positions: int = 4):
        if not 1 <= n_min <= n_max:
            raise ValueError(f"lookup n-gram range must satisfy 1 <= min <= max, got ({n_min}, {n_max})")
        self.n_min, self.n_max, self.max_positions = n_min, n_max, max_positions
        self.tokens: list[int] = []
        self.table: dict[tuple[int, ...], list[int]] = defaultdict(list)

    def extend(self, tokens: list[int]) -> None:
        """Index the tokens past those already seen (the request's full token list is passed)."""
        start = len(self.tokens)
        self.tokens.extend(tokens[start:])
        for end in range(max(start, 1), len(self.tokens)):   # n-grams ending at end-1, continued by `end`
            for n in range(self.n_min, min(self.n_max, end) + 1):
                slots = self.table[tuple(self.tokens[end - n:end])]
                slots.append(end)
                if len(slots) > self.max_positions:
                    del slots[0]

    def propose(self, max_tokens: int, max_branches: int) -> list[list[int]]:
        """Continuations after the longest matching suffix, most recent occurrence first."""
        toks = self.tokens
        branches: list[list[int]] = []
        for n in range(min(self.n_max, len(toks)), self.n_min - 1, -1):
            for start in reversed(self.table.get(tuple(toks[-n:]), ())):
                cont = toks[start:start + max_tokens]
                if cont and cont not in branches:
                    branches.append(cont)
                if len(branches) >= max_branches:
                    return branches
            if branches:
                return branches
        return branches


def merge_branches(tree: DraftTree, branches: list[list[int]], budget: int) -> DraftTree:
    """Insert lookup branches (each starting below the root) into `tree`, at most `budget` new nodes.

    New nodes are appended, so parents still come before children; nodes a branch passes through
    are marked as lookup's. No branches: `tree` itself (trees are never modified after drafting).
    """
    if not branches:
        return tree
    parents, tokens, depth = list(tree.parents), list(tree.tokens), list(tree.depth)
    from_head, from_lookup = list(tree.from_head), list(tree.from_lookup)
    child = {(p, t): i for i, (p, t) in enumerate(zip(parents, tokens)) if i > 0}
    added = 0
    for branch in branches:
        cur = 0
        for t in branch:
            node = child.get((cur, t))
            if node is None:
                if added >= budget:
                    break
                node = len(tokens)
                parents.append(cur)
                tokens.append(t)
                depth.append(depth[cur] + 1)
                from_head.append(False)
                from_lookup.append(False)
                child[(cur, t)] = node
                added += 1
            from_lookup[node] = True
            cur = node
    return DraftTree(parents, tokens, depth, from_head, from_lookup)


def prune_to_best(parents: list[int], tokens: list[int], depth: list[int], logprobs: list[float],
                  keep: int) -> tuple[list[int], list[int], list[int]]:
    """Keep the root and the `keep` draft nodes of highest cumulative log-prob (closed under ancestors)."""
    if len(tokens) - 1 <= keep:
        return parents, tokens, depth
    cum = [0.0] * len(tokens)
    for i in range(1, len(tokens)):
        cum[i] = cum[parents[i]] + logprobs[i]
    order = sorted(range(1, len(tokens)), key=lambda i: (-cum[i], i))
    kept = set()
    for i in order:
        if len(kept) >= keep:
            break
        chain, j = [], i
        while j > 0 and j not in kept:
            chain.append(j)
            j = parents[j]
        if len(kept) + len(chain) <= keep:
            kept.update(chain)
    nodes = [0] + sorted(kept)
    remap = {old: new for new, old in enumerate(nodes)}
    return ([-1] + [remap[parents[i]] for i in nodes[1:]], [tokens[i] for i in nodes], [depth[i] for i in nodes])
