"""Draft trees: their shapes (chain, EAGLE-1 static, EAGLE-2 dynamic) and the batched tensors
that tree verification needs (ancestor masks, position offsets, paths, children).

Node order convention — every builder here produces it, every consumer relies only on (1)-(3):
  1. node 0 is the root: the last sampled token, not yet in the KV cache, depth 0, parent -1;
  2. parents come before children: `parents[i] < i` for every node i >= 1;
  3. siblings are in rank order: among the children of one node, a lower index is a better rank
     (rank 0 = the drafter's most likely token), so "children in rank order" = "in index order".
  Builders also make the order depth-major (all of depth d before depth d+1) with the children of
  a node contiguous, which is what EAGLE's own code produces.

A node at depth d is verified at position `root_position + d` (`position_offsets` = depth) and
attends to the committed context plus its ancestors and itself (`ancestor_mask`).

Batches are padded to M = max nodes: `valid[b, i]` is False for padding, which has parent -1.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# EAGLE-1's default static tree (`mc_sim_7b_63` in SafeAILab/EAGLE eagle/model/choices.py): each
# entry is the path of child ranks from the root; 25 draft nodes, depth 5.
MC_SIM_7B_63: list[list[int]] = [
    [0], [1], [2], [3], [0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [2, 0], [2, 1], [3, 0],
    [0, 0, 0], [0, 0, 1], [0, 0, 2], [0, 1, 0], [0, 1, 1], [0, 2, 0], [0, 2, 1], [1, 0, 0],
    [0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 0, 0], [0, 0, 0, 0, 1],
]


@dataclass
class TreeShape:
    """A token-free tree (static trees): who is whose parent and at which child rank."""

    parents: list[int]   # [N+1], parents[0] = -1
    depth: list[int]     # [N+1]
    rank: list[int]      # [N+1], rank of the node among its parent's children (root: 0)

    @property
    def num_nodes(self) -> int:
        return len(self.parents)

    @property
    def max_depth(self) -> int:
        return max(self.depth)

    def level(self, d: int) -> list[int]:
        """Node indices at depth d, in index order."""
        return [i for i, x in enumerate(self.depth) if x == d]


def static_tree(choices: list[list[int]]) -> TreeShape:
    """EAGLE-1 static tree from child-rank paths (e.g. `MC_SIM_7B_63`); every prefix of a path
    must itself be a path. Nodes are sorted by (depth, path), as EAGLE does."""
    paths = sorted({tuple(c) for c in choices}, key=lambda p: (len(p), p))
    index = {(): 0}
    parents, depth, rank = [-1], [0], [0]
    for p in paths:
        if not p or any(r < 0 for r in p):
            raise ValueError(f"tree path {list(p)} must be non-empty with ranks >= 0")
        if p[:-1] not in index:
            raise ValueError(f"tree path {list(p)} has no parent path {list(p[:-1])}")
        index[p] = len(parents)
        parents.append(index[p[:-1]])
        depth.append(len(p))
        rank.append(p[-1])
    return TreeShape(parents, depth, rank)


def chain(depth: int) -> TreeShape:
    """A single chain of `depth` drafts (classic speculative decoding)."""
    return static_tree([[0] * d for d in range(1, depth + 1)])


@dataclass
class TreeBatch:
    """B trees padded to M nodes (root included). Tensors live on one device."""

    parents: torch.Tensor    # [B, M] int64, -1 for the root and padding
    depth: torch.Tensor      # [B, M] int64, 0 for the root and padding
    tokens: torch.Tensor     # [B, M] int64, tokens[:, 0] = root token (the last sampled one)
    logprobs: torch.Tensor   # [B, M] float32, drafter log-prob of the node's token given its parent
    num_nodes: torch.Tensor  # [B] int64, nodes per tree, root included

    @property
    def batch_size(self) -> int:
        return self.parents.shape[0]

    @property
    def max_nodes(self) -> int:
        return self.parents.shape[1]

    @property
    def valid(self) -> torch.Tensor:
        return torch.arange(self.max_nodes, device=self.parents.device)[None, :] < self.num_nodes[:, None]

    @staticmethod
    def from_shape(shape: TreeShape, batch_size: int, device: torch.device | str = "cpu") -> "TreeBatch":
        """B copies of a static shape with tokens still to fill (-1) and log-probs 0."""
        M = shape.num_nodes
        t = lambda x: torch.tensor(x, dtype=torch.long, device=device).expand(batch_size, M).clone()  # noqa: E731
        return TreeBatch(t(shape.parents), t(shape.depth), torch.full((batch_size, M), -1, dtype=torch.long, device=device),
                         torch.zeros(batch_size, M, device=device),
                         torch.full((batch_size,), M, dtype=torch.long, device=device))

    @staticmethod
    def stack(parents: list[list[int]], tokens: list[list[int]], logprobs: list[list[float]] | None = None,
              device: torch.device | str = "cpu") -> "TreeBatch":
        """Pad host-side trees (lists per tree) into a batch; depth is derived from parents."""
        B, M = len(parents), max(len(p) for p in parents)
        P = torch.full((B, M), -1, dtype=torch.long)
        D = torch.zeros(B, M, dtype=torch.long)
        T = torch.full((B, M), -1, dtype=torch.long)
        L = torch.zeros(B, M)
        for b, (par, tok) in enumerate(zip(parents, tokens)):
            _check_parents(par)
            n = len(par)
            P[b, :n] = torch.tensor(par)
            T[b, :n] = torch.tensor(tok)
            for i in range(1, n):
                D[b, i] = D[b, par[i]] + 1
            if logprobs is not None:
                L[b, :n] = torch.tensor(logprobs[b], dtype=torch.float32)
        n = torch.tensor([len(p) for p in parents], dtype=torch.long)
        return TreeBatch(P.to(device), D.to(device), T.to(device), L.to(device), n.to(device))

    def tree(self, b: int) -> tuple[list[int], list[int]]:
        """(parents, tokens) of tree b as host lists, padding removed."""
        n = int(self.num_nodes[b])
        return self.parents[b, :n].tolist(), self.tokens[b, :n].tolist()


def _check_parents(parents: list[int]) -> None:
    if not parents or parents[0] != -1:
        raise ValueError("node 0 must be the root (parent -1)")
    for i, p in enumerate(parents[1:], start=1):
        if not 0 <= p < i:
            raise ValueError(f"node {i} has parent {p}; parents must come before their children")


def ancestor_mask(parents: torch.Tensor, max_depth: int | None = None) -> torch.Tensor:
    """[B, M, M] bool: mask[b, i, j] is True iff node j is node i or one of its ancestors.

    Vectorised fixed point: row(i) = e_i | row(parent(i)), iterated max_depth times (each pass
    completes one more level). Padding rows see only themselves, so they stay finite in SDPA.
    """
    squeeze = parents.dim() == 1
    if squeeze:
        parents = parents[None]
    B, M = parents.shape
    eye = torch.eye(M, dtype=torch.bool, device=parents.device).expand(B, M, M)
    if max_depth is None:
        max_depth = M - 1
    has_parent = (parents >= 0)[..., None]
    rows = parents.clamp(min=0)[..., None].expand(B, M, M)
    mask = eye.clone()
    for _ in range(max_depth):
        mask = eye | (torch.gather(mask, 1, rows) & has_parent)
    return mask[0] if squeeze else mask


def position_offsets(batch: TreeBatch) -> torch.Tensor:
    """[B, M] position of each node relative to the root = its depth."""
    return batch.depth


def children_index(parents: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """[B, M, K] node indices of each node's children in rank (= index) order, -1 padded;
    K = the largest number of children of any node in the batch (at least 1)."""
    B, M = parents.shape
    dev = parents.device
    if valid is None:
        valid = torch.ones(B, M, dtype=torch.bool, device=dev)
    is_child = valid & (parents >= 0)
    same = (parents[:, :, None] == parents[:, None, :]) & is_child[:, None, :] & is_child[:, :, None]
    earlier = torch.ones(M, M, dtype=torch.bool, device=dev).tril(-1)
    sib_rank = (same & earlier).sum(-1)                    # [B, M] rank among siblings
    K = max(1, int(sib_rank.masked_fill(~is_child, -1).max()) + 1)
    out = torch.full((B, M, K), -1, dtype=torch.long, device=dev)
    flat = torch.where(is_child, parents * K + sib_rank, M * K)  # padding goes to a spill slot
    spill = torch.full((B, M * K + 1), -1, dtype=torch.long, device=dev)
    spill.scatter_(1, flat, torch.arange(M, device=dev).expand(B, M))
    out.copy_(spill[:, : M * K].view(B, M, K))
    return out


def root_to_leaf_paths(parents: torch.Tensor, depth: torch.Tensor, valid: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(paths [B, L, D+1], num_leaves [B]): node indices from the root to each leaf (leaves in
    index order), -1 padded both past a leaf's depth and past a tree's last leaf."""
    B, M = parents.shape
    dev = parents.device
    if valid is None:
        valid = torch.ones(B, M, dtype=torch.bool, device=dev)
    D = int(depth.masked_fill(~valid, 0).max())
    anc = ancestor_mask(parents, D) & valid[:, None, :]
    node_ids = torch.arange(M, device=dev).expand(B, M, M)
    full = torch.full((B, M, D + 1), -1, dtype=torch.long, device=dev)
    # Every ancestor has a distinct depth, so scattering by depth lays the path out in order.
    full.scatter_reduce_(2, depth[:, None, :].expand(B, M, M), torch.where(anc, node_ids, -1), reduce="amax")
    has_child = torch.zeros(B, M + 1, dtype=torch.bool, device=dev)
    has_child.scatter_(1, torch.where(valid & (parents >= 0), parents, M), True)
    leaf = valid & ~has_child[:, :M]
    num_leaves = leaf.sum(-1)
    L = max(1, int(num_leaves.max()))
    order = torch.sort((~leaf).to(torch.int8), dim=1, stable=True).indices[:, :L]   # leaves first, index order
    paths = torch.gather(full, 1, order[..., None].expand(B, L, D + 1))
    paths = paths.masked_fill((torch.arange(L, device=dev)[None, :] >= num_leaves[:, None])[..., None], -1)
    return paths, num_leaves


# ---------------------------------------------------------------------------------------------
# EAGLE-2 dynamic tree: expand the top-k frontier by cumulative log-prob, then keep the best
# `num_draft_tokens` nodes globally. Candidates get global ids in creation order:
#   step 0 (depth 1): id = rank                        (K of them, children of the root)
#   step s (depth s+1): id = K + (s-1)K^2 + slot*K + rank   (children of frontier slot `slot`)
# so ascending id order is depth-major with siblings contiguous and in rank order.
# ---------------------------------------------------------------------------------------------


def topk_sorted(logprobs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k (values, ids) along the last dim, ordered by (value desc, token id asc), and with
    ties at the k-th value resolved to the lowest ids — bf16 logits tie often, and torch.topk
    leaves the choice to the kernel. On a CPU, torch.topk's k + 1 best say which rows tie at the
    k-th value; elsewhere its k best are the set and only their order is fixed here, far cheaper
    than the passes over the vocabulary that the tied rows take."""
    if logprobs.device.type != "cpu" or logprobs.shape[-1] <= k:
        return _topk_sorted_by_passes(logprobs, k)
    if logprobs.dim() == 1:
        vals, ids = topk_sorted(logprobs[None], k)
        return vals[0], ids[0]
    vals, ids = torch.topk(logprobs, k + 1, dim=-1)
    tied = vals[..., k] == vals[..., k - 1]
    ids, by_id = torch.sort(ids[..., :k], dim=-1)
    vals, perm = torch.sort(torch.gather(vals[..., :k], -1, by_id), dim=-1, descending=True, stable=True)
    ids = torch.gather(ids, -1, perm)
    if bool(tied.any()):
        rows = tied.nonzero(as_tuple=True)
        vals[rows], ids[rows] = _topk_sorted_by_passes(logprobs[rows], k)
    return vals, ids


def _topk_sorted_by_passes(logprobs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_sorted by elementwise passes over the vocabulary: no full sort, no host sync (GPUs)."""
    kth = torch.topk(logprobs, k, dim=-1).values[..., -1:]
    above = logprobs > kth
    tied = logprobs == kth
    take = above | (tied & (tied.cumsum(-1) <= k - above.sum(-1, keepdim=True)))
    slot = torch.where(take, take.cumsum(-1) - 1, k)               # ascending ids, spill at k
    ids = torch.zeros(*logprobs.shape[:-1], k + 1, dtype=torch.long, device=logprobs.device)
    ids.scatter_(-1, slot, torch.arange(logprobs.shape[-1], device=logprobs.device).expand_as(slot))
    ids = ids[..., :k]
    vals, perm = torch.sort(torch.gather(logprobs, -1, ids), dim=-1, descending=True, stable=True)
    return vals, torch.gather(ids, -1, perm)


@dataclass
class DynamicTree:
    """State of an EAGLE-2 expansion for B sequences. The draft loop feeds the head the
    `frontier_tokens` (hidden state: the head output of `frontier_parent_slot` of the previous
    forward; the root's output for the first), with attention `frontier_mask` over every frontier
    node forwarded so far plus the current ones, at position offset `frontier_depth - 1` from the
    head's root position."""

    topk: int
    root_tokens: torch.Tensor            # [B]
    cand_scores: list[torch.Tensor]      # per step [B, C_s] cumulative log-probs
    cand_logprobs: list[torch.Tensor]    # per step [B, C_s] own log-probs
    cand_tokens: list[torch.Tensor]      # per step [B, C_s]
    cand_parents: list[torch.Tensor]     # per step [B, C_s] global id of the parent, -1 = root
    frontier: torch.Tensor               # [B, K] global ids of the current frontier
    frontier_scores: torch.Tensor        # [B, K]
    frontier_tokens: torch.Tensor        # [B, K]
    frontier_parent_slot: torch.Tensor   # [B, K] slot of the parent in the previous frontier
    frontier_mask: torch.Tensor          # [B, K, F] bool over all frontier nodes forwarded, these last
    frontier_depth: int

    @property
    def num_candidates(self) -> int:
        return sum(s.shape[1] for s in self.cand_scores)


def _clamp_lp(logprobs: torch.Tensor) -> torch.Tensor:
    # A log-prob above 0 (low-precision rounding) would let a child outrank its parent.
    return logprobs.float().clamp(max=0.0)


def dynamic_tree_start(root_tokens: torch.Tensor, root_logprobs: torch.Tensor, topk: int) -> DynamicTree:
    """Depth-1 candidates: the top-k children of the root. `root_logprobs` [B, V] is the head's
    log-softmax after (context features, root token)."""
    B = root_tokens.shape[0]
    dev = root_logprobs.device
    vals, ids = topk_sorted(_clamp_lp(root_logprobs), topk)
    gid = torch.arange(topk, device=dev).expand(B, topk)
    return DynamicTree(
        topk=topk, root_tokens=root_tokens, cand_scores=[vals], cand_logprobs=[vals], cand_tokens=[ids],
        cand_parents=[torch.full((B, topk), -1, dtype=torch.long, device=dev)],
        frontier=gid.clone(), frontier_scores=vals, frontier_tokens=ids,
        frontier_parent_slot=torch.zeros(B, topk, dtype=torch.long, device=dev),
        frontier_mask=torch.eye(topk, dtype=torch.bool, device=dev).expand(B, topk, topk).clone(),
        frontier_depth=1)


def dynamic_tree_step(state: DynamicTree, frontier_logprobs: torch.Tensor) -> DynamicTree:
    """Expand every frontier node by its top-k children ([B, K, V] head log-softmax at the
    frontier), keep all K*K as candidates and the best K (cumulative log-prob, ties to the lower
    id) as the next frontier."""
    K = state.topk
    B = frontier_logprobs.shape[0]
    dev = frontier_logprobs.device
    vals, ids = topk_sorted(_clamp_lp(frontier_logprobs), K)          # [B, K, K]
    scores = (state.frontier_scores[:, :, None] + vals).reshape(B, K * K)
    offset = state.num_candidates
    parents = state.frontier[:, :, None].expand(B, K, K).reshape(B, K * K)
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :K]
    order = torch.sort(order, dim=1).values           # keep the next frontier in creation order
    slot = order // K
    mask = torch.cat([torch.gather(state.frontier_mask, 1, slot[..., None].expand(-1, -1, state.frontier_mask.shape[2])),
                      torch.eye(K, dtype=torch.bool, device=dev).expand(B, K, K)], dim=2)
    flat_ids = ids.reshape(B, K * K)
    return DynamicTree(
        topk=K, root_tokens=state.root_tokens,
        cand_scores=state.cand_scores + [scores], cand_logprobs=state.cand_logprobs + [vals.reshape(B, K * K)],
        cand_tokens=state.cand_tokens + [flat_ids], cand_parents=state.cand_parents + [parents],
        frontier=offset + order, frontier_scores=torch.gather(scores, 1, order),
        frontier_tokens=torch.gather(flat_ids, 1, order), frontier_parent_slot=slot,
        frontier_mask=mask, frontier_depth=state.frontier_depth + 1)


def dynamic_tree_finish(state: DynamicTree, num_draft_tokens: int) -> TreeBatch:
    """Keep the `num_draft_tokens` best candidates of the whole expansion by cumulative log-prob
    (ties: lower global id first). A child never scores above its parent and ties favour the
    parent's lower id, so the kept set is closed under ancestors; sorting it by id gives the
    node order convention."""
    scores = torch.cat(state.cand_scores, 1)
    B, C = scores.shape
    N = min(num_draft_tokens, C)
    dev = scores.device
    best = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :N]
    sel = torch.sort(best, dim=1).values                                      # [B, N] global ids
    cand_depth = torch.cat([torch.full((s.shape[1],), d + 1, dtype=torch.long, device=dev)
                            for d, s in enumerate(state.cand_scores)])
    par_gid = torch.gather(torch.cat(state.cand_parents, 1), 1, sel)
    par_node = torch.searchsorted(sel, par_gid.clamp(min=0)) + 1
    par_node = torch.where(par_gid < 0, 0, par_node)
    cat = lambda xs, root: torch.cat([root[:, None], torch.gather(torch.cat(xs, 1), 1, sel)], 1)  # noqa: E731
    return TreeBatch(
        parents=torch.cat([torch.full((B, 1), -1, dtype=torch.long, device=dev), par_node], 1),
        depth=torch.cat([torch.zeros(B, 1, dtype=torch.long, device=dev), cand_depth[sel]], 1),
        tokens=cat(state.cand_tokens, state.root_tokens.to(dev).long()),
        logprobs=cat(state.cand_logprobs, torch.zeros(B, device=dev)),
        num_nodes=torch.full((B,), N + 1, dtype=torch.long, device=dev))


def static_tree_level_tokens(shape: TreeShape, d: int, parent_logprobs: torch.Tensor
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and log-probs [B, n_d] of the depth-d nodes of a static tree, given the head's
    log-softmax [B, n_{d-1}, V] at the depth-(d-1) nodes (in index order): child of rank r takes
    its parent's r-th best token."""
    prev, cur = shape.level(d - 1), shape.level(d)
    pos = {n: i for i, n in enumerate(prev)}
    k = max(shape.rank[n] for n in cur) + 1
    vals, ids = topk_sorted(_clamp_lp(parent_logprobs), k)              # [B, n_{d-1}, k]
    dev = parent_logprobs.device
    pi = torch.tensor([pos[shape.parents[n]] for n in cur], device=dev)
    ri = torch.tensor([shape.rank[n] for n in cur], device=dev)
    return ids[:, pi, ri], vals[:, pi, ri]
