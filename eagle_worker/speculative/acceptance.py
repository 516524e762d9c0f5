"""Which drafted tokens the target accepts: walk the tree from the root with the target's logits.

Row i of the target's logits is its next-token distribution after node i (the root row is the
distribution of the first new token). Greedy: descend into the child whose token is the target's
argmax; the bonus token is the argmax at the last accepted node.

Sampling (lossless for deterministic drafts, i.e. EAGLE's top-k proposals): at the current node
with target distribution p, try the children in rank order; accept child x with probability
p(x) / (mass of p not yet tried). On a rejection x is removed from p (which renormalises it) and
the next sibling is tried; if every child is rejected the bonus token is drawn from what is left
of p. Proof sketch: with one child x, P(out = x) = p(x) and for y != x P(out = y) =
(1 - p(x)) * p(y) / (1 - p(x)) = p(y); induct over siblings, then over depth. A duplicate sibling
has no mass left and is always rejected.

p is the distribution the engine's sampler draws from (`eagle_worker.sampler.target_probs`:
temperature, top-k, top-p, min-p), passed either as precomputed probabilities or as a callable
applied only to the rows the walk visits. Randomness: one uniform per node (used the one time
that node is tried; node 0's draws the bonus), from the request's own `torch.Generator`, so a
seeded request's draws depend only on its own tree size, never on the rest of the batch.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from eagle_worker.speculative.tree import TreeBatch, children_index

ProbsFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]   # (logits rows [R, V], tree idx [R]) -> probs


@dataclass
class Acceptance:
    path: list[int]      # accepted node indices, starting with the root (0)
    tokens: list[int]    # tokens to append: the accepted drafts (nodes path[1:]) then the bonus
    bonus: int

    @property
    def num_accepted(self) -> int:
        return len(self.path) - 1


def accept_greedy(parents: list[int], tokens: list[int], target_logits: torch.Tensor) -> Acceptance:
    """One tree, greedy. `target_logits` [N+1, V] (or anything whose argmax is the target's), or
    the target's argmax itself as integer ids [N+1]."""
    batch = TreeBatch.stack([parents], [tokens], device=target_logits.device)
    return accept_batch(batch, target_logits[None], greedy=True)[0]


def accept_sampling(parents: list[int], tokens: list[int], target_probs: torch.Tensor | ProbsFn,
                    generator: torch.Generator | None = None, target_logits: torch.Tensor | None = None
                    ) -> Acceptance:
    """One tree, sampling. `target_probs` [N+1, V] processed probabilities, or a callable applied
    to rows of `target_logits` [N+1, V]."""
    dev = target_logits.device if target_logits is not None else target_probs.device
    batch = TreeBatch.stack([parents], [tokens], device=dev)
    probs = target_probs[None] if isinstance(target_probs, torch.Tensor) else target_probs
    logits = target_logits[None] if target_logits is not None else None
    return accept_batch(batch, logits, greedy=False, probs=probs, generators=[generator])[0]


def accept_batch(batch: TreeBatch, target_logits: torch.Tensor | None, greedy: torch.Tensor | bool,
                 probs: torch.Tensor | ProbsFn | None = None,
                 generators: torch.Generator | Sequence[torch.Generator | None] | None = None,
                 row_offsets: torch.Tensor | None = None) -> list[Acceptance]:
    """Accept over B trees at once.

    target_logits: [B, M, V] per tree, or flat [R, V] with `row_offsets` [B] (row of tree b's
        node i = row_offsets[b] + i, the packed layout of the verify forward). Only needed for
        greedy trees and for a callable `probs`; all-greedy batches may pass integer argmax ids
        ([B, M] or flat [R]) instead.
    greedy: [B] bool (or one bool for all); greedy trees use the argmax and no randomness.
    probs: for sampling trees, processed probabilities laid out like target_logits, or a callable
        (logits rows, tree index per row) -> probabilities.
    generators: one per tree (None entries use the global RNG), or one for the whole batch.
    """
    B, dev = batch.batch_size, batch.parents.device
    greedy_t = torch.full((B,), bool(greedy), dtype=torch.bool) if isinstance(greedy, bool) else greedy.bool().cpu()
    rows = _Rows(target_logits, probs, row_offsets, batch.max_nodes)
    children = children_index(batch.parents, batch.valid)
    tokens = batch.tokens
    paths = [[0] for _ in range(B)]
    bonus = [0] * B

    g_idx = greedy_t.nonzero().flatten().tolist()
    if g_idx:
        _walk_greedy(batch, children, rows, g_idx, paths, bonus)
    s_idx = (~greedy_t).nonzero().flatten().tolist()
    if s_idx:
        u = _uniforms(batch, s_idx, generators, dev)
        _walk_sampling(batch, children, rows, s_idx, u, paths, bonus)
    tok_h = tokens.tolist()
    return [Acceptance(paths[b], [tok_h[b][i] for i in paths[b][1:]] + [bonus[b]], bonus[b]) for b in range(B)]


class _Rows:
    """Gathers target rows (logits or processed probs) for (tree, node) pairs."""

    def __init__(self, logits, probs, row_offsets, M):
        self.logits, self.probs, self.offsets, self.M = logits, probs, row_offsets, M

    def _take(self, t: torch.Tensor, b: torch.Tensor, node: torch.Tensor) -> torch.Tensor:
        if t.dim() == 3:
            return t[b.to(t.device), node.to(t.device)]
        if self.offsets is None:
            raise ValueError("flat [R, V] target rows need row_offsets")
        return t[(self.offsets.to(t.device)[b.to(t.device)] + node.to(t.device))]

    def argmax_all(self, b: torch.Tensor) -> torch.Tensor:
        """[len(b), M] target argmax at every node of the given trees (padding rows clamped)."""
        t = self.logits if self.logits is not None else self.probs
        if not isinstance(t, torch.Tensor):
            raise ValueError("greedy acceptance needs target_logits or a probability tensor")
        ids = t.argmax(-1) if t.is_floating_point() else t     # integer rows are the argmax already
        if ids.dim() == 2:
            return ids[b.to(t.device)]
        nodes = torch.arange(self.M, device=t.device)
        idx = (self.offsets.to(t.device)[b.to(t.device)][:, None] + nodes[None]).clamp(max=t.shape[0] - 1)
        return ids[idx]

    def probs_at(self, b: torch.Tensor, node: torch.Tensor) -> torch.Tensor:
        if isinstance(self.probs, torch.Tensor):
            return self._take(self.probs, b, node).float()
        if self.probs is None or self.logits is None:
            raise ValueError("sampling acceptance needs probs (a tensor, or a callable with target_logits)")
        return self.probs(self._take(self.logits, b, node), b).float()


def _walk_greedy(batch, children, rows, idx, paths, bonus) -> None:
    dev = batch.parents.device
    b = torch.tensor(idx, device=dev)
    am = rows.argmax_all(b).to(dev)                               # [G, M]
    ch = children[b]                                              # [G, M, K]
    tok = batch.tokens[b]
    cur = torch.zeros(len(idx), dtype=torch.long, device=dev)
    trail = [cur]
    for _ in range(int(batch.depth[b].max()) if len(idx) else 0):
        c = ch[torch.arange(len(idx), device=dev), cur]           # [G, K]
        want = am.gather(1, cur[:, None])                         # [G, 1]
        hit = (c >= 0) & (tok.gather(1, c.clamp(min=0)) == want)
        first = torch.where(hit.any(1), hit.int().argmax(1), -1)  # first matching child in rank order
        nxt = torch.where(first >= 0, c.gather(1, first.clamp(min=0)[:, None]).squeeze(1), -1)
        cur = torch.where(nxt >= 0, nxt, cur)
        trail.append(torch.where(nxt >= 0, nxt, -1))
    trail_h = torch.stack(trail, 1).tolist()
    last = am.gather(1, cur[:, None]).squeeze(1).tolist()
    for j, bb in enumerate(idx):
        p = [0]
        for n in trail_h[j][1:]:
            if n < 0:
                break
            p.append(n)
        paths[bb], bonus[bb] = p, last[j]


def _uniforms(batch: TreeBatch, idx: list[int], generators, dev) -> torch.Tensor:
    """[S, M] float64 uniforms in [0, 1): column i for trying node i, column 0 for the bonus.
    Drawn on each generator's own device (no host round trip), then padded."""
    n = batch.num_nodes[idx].tolist()
    if generators is None or isinstance(generators, torch.Generator):
        gdev = generators.device if generators is not None else dev
        flat = torch.rand(sum(n), generator=generators, dtype=torch.float64, device=gdev).to(dev)
    else:
        flat = torch.cat([torch.rand(k, generator=generators[bb], dtype=torch.float64,
                                     device=generators[bb].device if generators[bb] is not None else dev).to(dev)
                          for k, bb in zip(n, idx)])
    u = torch.zeros(len(idx), batch.max_nodes, dtype=torch.float64, device=dev)
    u[torch.arange(batch.max_nodes, device=dev)[None, :] < torch.tensor(n, device=dev)[:, None]] = flat
    return u


def _walk_sampling(batch, children, rows, idx, u, paths, bonus, zero_rejected: bool = True) -> None:
    """`zero_rejected=False` is a deliberately wrong variant kept only as the negative control of
    the losslessness test: the bonus is drawn from p without removing the rejected children."""
    dev = batch.parents.device
    S = len(idx)
    b = torch.tensor(idx, device=dev)
    ch_all, tok_all = children[b], batch.tokens[b]
    cur = torch.zeros(S, dtype=torch.long, device=dev)
    active = torch.ones(S, dtype=torch.bool, device=dev)
    out_bonus = torch.zeros(S, dtype=torch.long, device=dev)
    trail = []
    for _ in range(int(batch.depth[b].max()) + 1):
        if not bool(active.any()):
            break
        a = active.nonzero().flatten()
        p = rows.probs_at(b[a], cur[a]).to(dev).double()         # [A, V]
        c = ch_all[a, cur[a]]                                      # [A, K]
        ok = c >= 0
        t = tok_all[a[:, None], c.clamp(min=0)].masked_fill(~ok, 0)
        pv = p.gather(1, t) * ok
        K = c.shape[1]
        dup = (t[:, :, None] == t[:, None, :]) & ok[:, None, :] & torch.ones(K, K, dtype=torch.bool, device=dev).tril(-1)
        pv = pv.masked_fill(dup.any(-1), 0.0)
        remaining = p.sum(-1)
        chosen = torch.full((len(a),), -1, dtype=torch.long, device=dev)
        for k in range(K):
            uk = u[a, c[:, k].clamp(min=0)]
            undecided = chosen < 0
            acc = ok[:, k] & undecided & (uk * remaining < pv[:, k])
            chosen = torch.where(acc, k, chosen)
            remaining = torch.where(ok[:, k] & undecided & ~acc, remaining - pv[:, k], remaining)
        nxt = torch.where(chosen >= 0, c.gather(1, chosen.clamp(min=0)[:, None]).squeeze(1), -1)
        rejected_all = nxt < 0
        if bool(rejected_all.any()):
            pr, tr, okr = p[rejected_all], t[rejected_all], ok[rejected_all]
            r = pr
            if zero_rejected:   # remove every tried child; padded slots go to a spill column
                spill = torch.where(okr, tr, pr.shape[1])
                r = torch.cat([pr, pr.new_zeros(len(pr), 1)], 1).scatter(1, spill, 0.0)[:, :-1]
            out_bonus[a[rejected_all]] = _inverse_cdf(r, pr, u[a[rejected_all], 0])
        step = torch.full((S,), -1, dtype=torch.long, device=dev)
        step[a] = nxt
        trail.append(step)
        cur = torch.where(step >= 0, step, cur)
        active = active & (step >= 0)
    trail_h = torch.stack(trail, 1).tolist() if trail else [[] for _ in range(S)]
    bon = out_bonus.tolist()
    for j, bb in enumerate(idx):
        pth = [0]
        for n in trail_h[j]:
            if n < 0:
                break
            pth.append(n)
        paths[bb], bonus[bb] = pth, bon[j]


def _inverse_cdf(r: torch.Tensor, p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Draw one token per row of the unnormalised residual r with the uniform u (float64 cumsum
    so a 150k vocabulary adds no visible bias); rows with no mass left fall back to argmax p."""
    cdf = r.cumsum(-1)
    total = cdf[:, -1:]
    tok = torch.searchsorted(cdf, u[:, None] * total, right=True).squeeze(1).clamp(max=r.shape[1] - 1)
    tok = torch.where(r.gather(1, tok[:, None]).squeeze(1) > 0, tok, (r > 0).int().cumsum(-1).argmax(-1))
    return torch.where(total.squeeze(1) > 0, tok, p.argmax(-1))
