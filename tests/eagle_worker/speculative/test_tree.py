"""Draft tree shapes and their batched tensors, checked against naive per-node references."""
from __future__ import annotations

import random

import pytest
import torch

from eagle_worker.speculative.tree import (
    MC_SIM_7B_63,
    TreeBatch,
    ancestor_mask,
    chain,
    children_index,
    dynamic_tree_finish,
    dynamic_tree_start,
    dynamic_tree_step,
    position_offsets,
    root_to_leaf_paths,
    static_tree,
    static_tree_level_tokens,
)


def random_tree(rng: random.Random, n: int) -> list[int]:
    return [-1] + [rng.randrange(i) for i in range(1, n)]


def ancestors(parents: list[int], i: int) -> set[int]:
    out = {i}
    while parents[i] >= 0:
        i = parents[i]
        out.add(i)
    return out


def assert_order_convention(parents: list[int], depth: list[int], rank_key: list | None = None):
    assert parents[0] == -1 and depth[0] == 0
    for i in range(1, len(parents)):
        assert 0 <= parents[i] < i
        assert depth[i] == depth[parents[i]] + 1
    assert depth == sorted(depth), "depth-major"
    for p in set(parents[1:]):
        kids = [i for i in range(1, len(parents)) if parents[i] == p]
        assert kids == list(range(kids[0], kids[0] + len(kids))), "siblings contiguous"
        if rank_key is not None:
            keys = [rank_key[i] for i in kids]
            assert keys == sorted(keys), "siblings in rank order"


def test_chain():
    s = chain(4)
    assert s.parents == [-1, 0, 1, 2, 3] and s.depth == [0, 1, 2, 3, 4] and s.rank == [0] * 5


def test_static_default_tree():
    s = static_tree(MC_SIM_7B_63)
    assert s.num_nodes == 26 and s.max_depth == 5
    assert [len(s.level(d)) for d in range(6)] == [1, 4, 8, 8, 3, 2]
    assert_order_convention(s.parents, s.depth, s.rank)
    # path of each node, rebuilt from parents/rank, is exactly one of the choices
    paths = []
    for i in range(1, s.num_nodes):
        p, j = [], i
        while j:
            p.append(s.rank[j])
            j = s.parents[j]
        paths.append(p[::-1])
    assert sorted(paths) == sorted(MC_SIM_7B_63)


def test_static_tree_rejects_orphans():
    with pytest.raises(ValueError, match="no parent path"):
        static_tree([[0], [1, 0, 0]])


def _random_batch(seed: int) -> TreeBatch:
    rng = random.Random(seed)
    trees = [random_tree(rng, rng.randint(1, 14)) for _ in range(6)]
    return TreeBatch.stack(trees, [[rng.randrange(50) for _ in t] for t in trees])


@pytest.mark.parametrize("seed", range(4))
def test_ancestor_mask_children_paths_match_naive(seed):
    batch = _random_batch(seed)
    mask = ancestor_mask(batch.parents, int(batch.depth.max()))
    children = children_index(batch.parents, batch.valid)
    paths, num_leaves = root_to_leaf_paths(batch.parents, batch.depth, batch.valid)
    assert torch.equal(position_offsets(batch), batch.depth)
    for b in range(batch.batch_size):
        parents, _ = batch.tree(b)
        n = len(parents)
        for i in range(n):
            want = torch.zeros(batch.max_nodes, dtype=torch.bool)
            want[list(ancestors(parents, i))] = True
            assert torch.equal(mask[b, i], want)
            kids = [j for j in range(n) if parents[j] == i]
            got = [c for c in children[b, i].tolist() if c >= 0]
            assert got == kids
        for i in range(n, batch.max_nodes):   # padding sees only itself
            assert mask[b, i].nonzero().flatten().tolist() == [i]
        leaves = [i for i in range(n) if i not in parents]
        assert int(num_leaves[b]) == len(leaves)
        for k, leaf in enumerate(leaves):
            path = [x for x in paths[b, k].tolist() if x >= 0]
            assert path == sorted(ancestors(parents, leaf)) and path[-1] == leaf
        assert (paths[b, len(leaves):] == -1).all()


def test_ancestor_mask_unbatched_and_default_depth():
    s = static_tree(MC_SIM_7B_63)
    p = torch.tensor(s.parents)
    assert torch.equal(ancestor_mask(p), ancestor_mask(p[None], s.max_depth)[0])


def test_static_tree_level_tokens_take_ranked_topk():
    s = static_tree(MC_SIM_7B_63)
    B, V = 2, 30
    g = torch.Generator().manual_seed(0)
    batch = TreeBatch.from_shape(s, B)
    batch.tokens[:, 0] = torch.tensor([5, 6])
    for d in range(1, s.max_depth + 1):
        prev = s.level(d - 1)
        lp = torch.log_softmax(torch.randn(B, len(prev), V, generator=g), -1)
        toks, vals = static_tree_level_tokens(s, d, lp)
        for j, node in enumerate(s.level(d)):
            parent_row = lp[:, prev.index(s.parents[node])]
            ranked = torch.argsort(parent_row, dim=-1, descending=True)
            assert torch.equal(toks[:, j], ranked[:, s.rank[node]])
            assert torch.allclose(vals[:, j], parent_row.gather(1, toks[:, j:j + 1]).squeeze(1))
        batch.tokens[:, s.level(d)] = toks
    assert (batch.tokens >= 0).all()


# ---------------------------------------------------------------------------- EAGLE-2 dynamic

def reference_dynamic(root_lp: torch.Tensor, step_lps: list[torch.Tensor], K: int, N: int):
    """Plain-Python EAGLE-2 for one sequence: candidates (score, id, parent id, token, own lp)."""
    def topk(lp):
        pairs = sorted(((float(v), t) for t, v in enumerate(lp.tolist())), key=lambda x: (-x[0], x[1]))
        return pairs[:K]
    cands = []
    for r, (v, t) in enumerate(topk(root_lp)):
        cands.append((v, r, -1, t, v, 1))
    frontier = [c for c in cands]
    for s, lps in enumerate(step_lps):
        new = []
        base = len(cands)
        for slot, f in enumerate(frontier):
            for r, (v, t) in enumerate(topk(lps[slot])):
                new.append((f[0] + v, base + slot * K + r, f[1], t, v, s + 2))
        cands += new
        frontier = sorted(sorted(new, key=lambda c: (-c[0], c[1]))[:K], key=lambda c: c[1])
    keep = sorted(sorted(cands, key=lambda c: (-c[0], c[1]))[:N], key=lambda c: c[1])
    node_of = {c[1]: i + 1 for i, c in enumerate(keep)}
    parents = [-1] + [0 if c[2] < 0 else node_of[c[2]] for c in keep]
    return parents, [c[3] for c in keep], [c[4] for c in keep], [c[5] for c in keep]


def run_dynamic(root_lp, step_lps, K, N):
    st = dynamic_tree_start(torch.arange(root_lp.shape[0]), root_lp, K)
    for lps in step_lps:
        st = dynamic_tree_step(st, lps)
    return st, dynamic_tree_finish(st, N)


@pytest.mark.parametrize("K,depth,N,V,quantise", [(4, 5, 20, 40, False), (3, 4, 12, 10, True), (2, 6, 9, 5, True)])
def test_dynamic_tree_matches_reference(K, depth, N, V, quantise):
    g = torch.Generator().manual_seed(K * 100 + depth)
    B = 3
    lp = lambda *s: torch.log_softmax(torch.randn(*s, V, generator=g) * 2, -1)  # noqa: E731
    root = lp(B)
    steps = [lp(B, K) for _ in range(depth - 1)]
    if quantise:   # many exact ties, including log-prob 0 children (score equal to the parent's)
        root = (root * 2).round() / 2
        steps = [((s * 2).round() / 2).clamp(max=0) for s in steps]
        steps[0][:, 0, 3] = 0.0
    _, tb = run_dynamic(root, steps, K, N)
    assert tb.parents.shape == (B, N + 1) and (tb.num_nodes == N + 1).all()
    for b in range(B):
        parents, tokens = tb.tree(b)
        ref = reference_dynamic(root[b], [s[b] for s in steps], K, N)
        assert parents == ref[0]
        assert tokens[1:] == ref[1]
        assert tokens[0] == b
        assert torch.allclose(tb.logprobs[b, 1:], torch.tensor(ref[2]))
        assert tb.depth[b, 1:].tolist() == ref[3]
        assert max(ref[3]) <= depth
        assert_order_convention(parents, tb.depth[b].tolist(), [-x for x in tb.logprobs[b].tolist()])
    _, again = run_dynamic(root, steps, K, N)
    assert torch.equal(again.parents, tb.parents) and torch.equal(again.tokens, tb.tokens)


def test_dynamic_tree_frontier_bookkeeping():
    """frontier_mask is the ancestor relation over forwarded frontier nodes; parent slots point
    at the previous frontier; the final tree contains every kept frontier node's ancestors."""
    K, V, B = 3, 12, 2
    g = torch.Generator().manual_seed(7)
    st = dynamic_tree_start(torch.zeros(B, dtype=torch.long), torch.log_softmax(torch.randn(B, V, generator=g), -1), K)
    forwarded = [st.frontier]           # global ids, in forward order
    for _ in range(3):
        prev = st.frontier
        st = dynamic_tree_step(st, torch.log_softmax(torch.randn(B, K, V, generator=g), -1))
        parents_gid = torch.cat(st.cand_parents, 1)
        assert torch.equal(torch.gather(prev, 1, st.frontier_parent_slot), torch.gather(parents_gid, 1, st.frontier))
        forwarded.append(st.frontier)
        allf = torch.cat(forwarded, 1)                      # [B, F]
        assert st.frontier_mask.shape == (B, K, allf.shape[1])
        for b in range(B):
            par = parents_gid[b].tolist()
            for k in range(K):
                anc, x = set(), int(st.frontier[b, k])
                while x >= 0:
                    anc.add(x)
                    x = par[x]
                want = [int(f) in anc for f in allf[b]]
                assert st.frontier_mask[b, k].tolist() == want
    assert st.frontier_depth == 4


def test_dynamic_tree_budget_larger_than_candidates():
    K, V = 2, 6
    root = torch.log_softmax(torch.randn(1, V), -1)
    st, tb = run_dynamic(root, [torch.log_softmax(torch.randn(1, K, V), -1)], K, 100)
    assert tb.num_nodes.tolist() == [1 + K + K * K]


def test_topk_sorted_breaks_ties_by_token_id():
    from eagle_worker.speculative.tree import topk_sorted
    lp = torch.tensor([[-1.0, -1, 0, -2, -1, -1], [-3.0, -3, -3, -3, -3, -3]])
    vals, ids = topk_sorted(lp, 3)
    assert ids.tolist() == [[2, 0, 1], [0, 1, 2]]
    assert vals.tolist() == [[0, -1, -1], [-3, -3, -3]]
    lp = torch.full((2, 4, 50), -5.0)
    lp[..., 7] = -1.0
    assert topk_sorted(lp, 4)[1].tolist() == [[[7, 0, 1, 2]] * 4] * 2


def test_topk_sorted_is_the_same_with_and_without_ties_at_the_kth_value():
    """The CPU path (torch.topk's k + 1 best, when no row ties at the k-th value) gives exactly what
    the passes over the vocabulary give, whichever way a batch goes."""
    from eagle_worker.speculative.tree import _topk_sorted_by_passes, topk_sorted
    g = torch.Generator().manual_seed(0)
    for coarse in (1.0, 8.0, 64.0):           # coarser rounding: more ties, in the set and at its edge
        lp = (torch.randn(6, 8, 300, generator=g) * coarse).round() / coarse - 4
        for k in (1, 3, 8):
            want = _topk_sorted_by_passes(lp, k)
            got = topk_sorted(lp, k)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (coarse, k)
            for row in lp.reshape(-1, 300)[:8]:                  # one row at a time: each takes its own path
                assert torch.equal(topk_sorted(row, k)[1], _topk_sorted_by_passes(row, k)[1])
