"""Which drafted tokens the target accepts: walk the tree from the root with the target's token at
each node.

Row i of the target's logits is its next-token distribution after node i (the root row is the
distribution of the first new token). At the current node the walk asks for the target's token
there (greedy: the argmax; sampling: the keyed draw of `eagle_worker.sampler.draw_tokens` for that
output position); if a child carries that token the walk descends into it (the first such child
in rank order), otherwise that token is the bonus and the walk stops.

Lossless by construction, for any draft: every output token IS the token plain decoding would
produce at its position given the accepted prefix (the same keyed draw from the same
distribution), so the text is a function of (seed, the target) alone, whichever drafter ran, and
the output distribution is the target's. For deterministic drafts (EAGLE's top-k, prompt lookup) a
child is accepted with exactly the probability of the classic rule (p(x) for a chain, the sum over
siblings for a tree), so the mean accepted length is unchanged.

The token at a node is either precomputed for every node (integer ids, or logits whose argmax is
taken: the fast greedy path) or a callable evaluated only on the nodes the walk visits, one batched
call per depth level (a 262k vocabulary: no processed distribution for rows the walk skips).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from eagle_worker.speculative.tree import TreeBatch, children_index

# (tree index [A], node index [A]) -> the target's token after that node [A]
TokenFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class Acceptance:
    path: list[int]      # accepted node indices, starting with the root (0)
    tokens: list[int]    # tokens to append: the accepted drafts (nodes path[1:]) then the bonus
    bonus: int

    @property
    def num_accepted(self) -> int:
        return len(self.path) - 1


def accept(parents: list[int], tokens: list[int], targets: torch.Tensor | TokenFn) -> Acceptance:
    """One tree. `targets`: [N+1] token ids, [N+1, V] logits (argmax), or a TokenFn."""
    dev = targets.device if isinstance(targets, torch.Tensor) else "cpu"
    batch = TreeBatch.stack([parents], [tokens], device=dev)
    return accept_batch(batch, targets[None] if isinstance(targets, torch.Tensor) else targets)[0]


def accept_batch(batch: TreeBatch, targets: torch.Tensor | TokenFn,
                 row_offsets: torch.Tensor | None = None) -> list[Acceptance]:
    """Accept over B trees at once.

    targets: the target's token after every node, as integer ids [B, M] or logits [B, M, V]
        (argmax), or flat [R] / [R, V] with `row_offsets` [B] (tree b's node i is row
        row_offsets[b] + i, the packed layout of the verify forward); or a TokenFn called once per
        depth level on the (tree, node) pairs the walk visits.
    """
    B, M, dev = batch.batch_size, batch.max_nodes, batch.parents.device
    ids = _node_ids(targets, row_offsets, M, dev) if isinstance(targets, torch.Tensor) else None
    children = children_index(batch.parents, batch.valid)          # [B, M, K]
    cur = torch.zeros(B, dtype=torch.long, device=dev)
    bonus = torch.zeros(B, dtype=torch.long, device=dev)
    active = torch.arange(B, device=dev)
    while len(active):
        node = cur[active]
        want = ids[active, node] if ids is not None else targets(active, node).to(dev)
        c = children[active, node]                                  # [A, K]
        hit = (c >= 0) & (batch.tokens[active[:, None], c.clamp(min=0)] == want[:, None])
        found = hit.any(1)
        nxt = c.gather(1, hit.int().argmax(1, keepdim=True)).squeeze(1)
        cur[active[found]] = nxt[found]
        bonus[active[~found]] = want[~found]
        active = active[found]
    parents, toks, last, bon = batch.parents.tolist(), batch.tokens.tolist(), cur.tolist(), bonus.tolist()
    out = []
    for b in range(B):
        path = [last[b]]
        while path[-1] != 0:
            path.append(parents[b][path[-1]])
        path.reverse()
        out.append(Acceptance(path, [toks[b][i] for i in path[1:]] + [bon[b]], bon[b]))
    return out


def _node_ids(targets: torch.Tensor, row_offsets: torch.Tensor | None, M: int, dev) -> torch.Tensor:
    """[B, M] target token at every node (padding rows clamped into range)."""
    ids = targets.argmax(-1) if targets.is_floating_point() else targets
    if row_offsets is not None:
        nodes = torch.arange(M, device=ids.device)
        ids = ids[(row_offsets.to(ids.device)[:, None] + nodes[None]).clamp(max=ids.shape[0] - 1)]
    return ids.to(dev)
