"""Tree acceptance: greedy walks; keyed sampling, whose output is exactly plain keyed sampling's
(same seed, same tokens, whatever the tree) and whose distribution is checked statistically against
the exact target distribution, with a deliberately wrong variant as the negative control."""
from __future__ import annotations

import itertools
import random

import pytest
import torch

from eagle_worker.sampler import keyed_choice
from eagle_worker.speculative.acceptance import accept, accept_batch
from eagle_worker.speculative.tree import TreeBatch


def onehot_logits(argmaxes: list[int], V: int = 8) -> torch.Tensor:
    x = torch.randn(len(argmaxes), V) * 0.1
    x[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 5.0
    return x


# ------------------------------------------------------------------------------------ greedy

def test_greedy_chain_fully_accepted_bonus_from_leaf():
    parents, tokens = [-1, 0, 1, 2], [7, 3, 4, 5]
    logits = onehot_logits([3, 4, 5, 6])        # row i: argmax after node i
    a = accept(parents, tokens, logits)
    assert a.path == [0, 1, 2, 3] and a.bonus == 6 and a.tokens == [3, 4, 5, 6]


def test_greedy_rejects_at_root():
    a = accept([-1, 0, 1], [7, 3, 4], onehot_logits([2, 4, 1]))
    assert a.path == [0] and a.tokens == [2] and a.num_accepted == 0


def test_greedy_takes_matching_sibling_and_stops_mid_tree():
    # root -> {1:tok 3, 2:tok 5}; 1 -> {3: tok 1}; 2 -> {4: tok 2, 5: tok 6}
    parents, tokens = [-1, 0, 0, 1, 2, 2], [0, 3, 5, 1, 2, 6]
    logits = onehot_logits([5, 0, 6, 0, 0, 0])
    a = accept(parents, tokens, logits)
    assert a.path == [0, 2, 5] and a.tokens == [5, 6, 0]
    logits = onehot_logits([5, 0, 7, 0, 0, 0])  # neither child of node 2 matches
    a = accept(parents, tokens, logits)
    assert a.path == [0, 2] and a.tokens == [5, 7]


def test_greedy_duplicate_siblings_take_the_first():
    a = accept([-1, 0, 0, 2], [0, 4, 4, 1], onehot_logits([4, 2, 1, 3]))
    assert a.path == [0, 1] and a.tokens == [4, 2]


def test_greedy_flat_rows_match_padded_batch():
    trees = [([-1, 0, 0, 1], [0, 3, 5, 1]), ([-1, 0], [0, 2]), ([-1, 0, 1, 2, 2], [0, 1, 2, 3, 4])]
    batch = TreeBatch.stack([p for p, _ in trees], [t for _, t in trees])
    torch.manual_seed(0)
    V = 6
    flat = torch.randn(sum(len(p) for p, _ in trees), V)
    flat[0, 3] = flat[1, 1] = flat[4, 2] = 9.0      # make some drafts the argmax
    offsets = torch.tensor([0, 4, 6])
    padded = torch.full((3, batch.max_nodes, V), -1e9)
    for b, (p, _) in enumerate(trees):
        padded[b, : len(p)] = flat[offsets[b]: offsets[b] + len(p)]
    a = accept_batch(batch, flat, row_offsets=offsets)
    b = accept_batch(batch, padded)
    assert a == accept_batch(batch, flat.argmax(-1), row_offsets=offsets)   # integer ids: the same walk
    assert a == b
    singles = [accept(p, t, flat[offsets[i]: offsets[i] + len(p)]) for i, (p, t) in enumerate(trees)]
    assert a == singles
    assert a[0].path == [0, 1, 3]


def test_token_fn_is_asked_only_about_visited_nodes():
    # root -> {1: 3, 2: 5}; 1 -> {3: 1}; 2 -> {4: 2, 5: 6}; the target says 5, then 6, then 9
    parents, tokens = [-1, 0, 0, 1, 2, 2], [0, 3, 5, 1, 2, 6]
    answer = {0: 5, 2: 6, 5: 9}
    asked = []

    def fn(b, node):
        asked.extend(node.tolist())
        return torch.tensor([answer[n] for n in node.tolist()])

    a = accept(parents, tokens, fn)
    assert a.path == [0, 2, 5] and a.tokens == [5, 6, 9] and sorted(asked) == [0, 2, 5]


# ------------------------------------------------------------------------- keyed sampling

V, POS = 6, 3   # vocabulary, number of generated tokens whose joint distribution is checked


def _target_tables(seed: int) -> dict[tuple, torch.Tensor]:
    """p(next | prefix) for every prefix of length < POS, plus one shared tail distribution.
    Mixes sharp (one token ~0.9) and flat distributions, with some exact zeros (top-k-like)."""
    g = torch.Generator().manual_seed(seed)
    table = {}
    for n in range(POS):
        for prefix in itertools.product(range(V), repeat=n):
            scale = 3.0 if (len(prefix) + sum(prefix)) % 3 else 0.5      # sharp or flat
            p = torch.softmax(torch.randn(V, generator=g) * scale, 0)
            if sum(prefix) % 4 == 1:
                p[torch.randint(V, (1,), generator=g)] = 0.0   # a token the request can never emit
            table[prefix] = p / p.sum()
    table["tail"] = torch.full((V,), 1.0 / V)
    return table


def _p(table, ctx: tuple) -> torch.Tensor:
    return table[ctx] if len(ctx) < POS else table["tail"]


def _adversarial_tree(table, prefix: tuple, rng: random.Random) -> tuple[list[int], list[int], list[tuple]]:
    """A drafted tree for this prefix: root children include the target's most and least likely
    tokens, a random one and a duplicate; deeper levels random-ish, including zero-prob tokens."""
    parents, tokens, ctxs = [-1], [prefix[-1] if prefix else 0], [prefix]
    frontier = [0]
    for depth in range(1, 4):
        nxt = []
        for node in frontier:
            p = _p(table, ctxs[node])
            order = torch.argsort(p, descending=True).tolist()
            if depth == 1:
                kids = [order[0], order[-1], rng.randrange(V), order[0]]
                rng.shuffle(kids)
            else:
                kids = rng.sample(range(V), rng.randint(0, 3))
            for t in kids:
                parents.append(node)
                tokens.append(t)
                ctxs.append(ctxs[node] + (t,))
                nxt.append(len(parents) - 1)
        frontier = [n for n in nxt if rng.random() < 0.6]
    return parents, tokens, ctxs


def _plain(table, seed: int, n: int = POS) -> list[int]:
    """Plain keyed sampling: position t's token is the keyed draw of (seed, t)."""
    out = []
    for t in range(n):
        out.append(int(keyed_choice(_p(table, tuple(out))[None], [seed], [t])[0]))
    return out


def _simulate(n_trials: int, seed: int, key=lambda out_len, depth: out_len + depth) -> tuple[list[list[int]], dict]:
    """The first POS tokens of trials 0..n-1 (trial i has seed i), generated by repeated
    draft-and-accept rounds over adversarial trees, all trials' trees walked as one batch.
    `key(output length, node depth)` is the output position a node's draw is keyed by."""
    table = _target_tables(seed)
    rng = random.Random(seed)
    prefixes = [p for p in table if p != "tail"]
    pid = {p: i for i, p in enumerate(prefixes)}
    trees = [_adversarial_tree(table, p, rng) for p in prefixes]
    batch_all = TreeBatch.stack([t[0] for t in trees], [t[1] for t in trees])
    out = [[] for _ in range(n_trials)]
    active = list(range(n_trials))
    while active:
        ids = torch.tensor([pid[tuple(out[t])] for t in active])
        batch = TreeBatch(batch_all.parents[ids], batch_all.depth[ids], batch_all.tokens[ids],
                          batch_all.logprobs[ids], batch_all.num_nodes[ids])

        def fn(b, node, active=active, ids=ids):
            trial = [active[i] for i in b.tolist()]
            ctxs = [trees[int(ids[i])][2][n] for i, n in zip(b.tolist(), node.tolist())]
            probs = torch.stack([_p(table, c) for c in ctxs])
            return keyed_choice(probs, trial, [key(len(out[t]), len(c) - len(out[t])) for t, c in zip(trial, ctxs)])

        for t, a in zip(active, accept_batch(batch, fn)):
            out[t].extend(a.tokens)
        active = [t for t in active if len(out[t]) < POS]
    return out, table


def _counts(outs: list[list[int]]) -> torch.Tensor:
    counts = torch.zeros([V] * POS)
    for o in outs:
        counts[tuple(o[:POS])] += 1
    return counts


def _exact(table) -> torch.Tensor:
    joint = torch.zeros([V] * POS)
    for seq in itertools.product(range(V), repeat=POS):
        pr = 1.0
        for i in range(POS):
            pr *= float(table[seq[:i]][seq[i]])
        joint[seq] = pr
    return joint


def _chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, float]:
    """(p-value, total variation): cells with expected count < 5 are pooled into one."""
    n = counts.sum()
    exp, obs = (probs * n).flatten().double(), counts.flatten().double()
    small = exp < 5
    exp = torch.cat([exp[~small], exp[small].sum()[None]])
    obs = torch.cat([obs[~small], obs[small].sum()[None]])
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    df = torch.tensor(float(keep.sum() - 1), dtype=torch.float64)
    p = torch.special.gammaincc(df / 2, stat / 2)
    tv = 0.5 * (counts / n - probs).abs().sum()
    return float(p), float(tv)


N_TRIALS = 6000


def test_tree_acceptance_gives_exactly_plain_keyed_sampling():
    """Same seed, same tokens: the trees only change how many forwards it takes."""
    outs, table = _simulate(400, 3)
    assert all(o[:POS] == _plain(table, i) for i, o in enumerate(outs))


@pytest.mark.parametrize("seed", [0, 1])
def test_sampling_is_lossless(seed):
    outs, table = _simulate(N_TRIALS, seed)
    p, tv = _chi2_pvalue(_counts(outs), _exact(table))
    assert p > 1e-3, f"chi-square rejects losslessness (p={p:.2e}, TV={tv:.3f})"


def test_negative_control_draws_keyed_by_tree_depth_are_rejected():
    """Same harness and threshold with each node's draw keyed by its depth in this step's tree
    instead of its output position (uniforms reused across steps): must be caught."""
    outs, table = _simulate(N_TRIALS, 0, key=lambda out_len, depth: depth)
    p, tv = _chi2_pvalue(_counts(outs), _exact(table))
    assert p < 1e-3, f"the statistical test failed to catch a lossy acceptance rule (p={p:.2e}, TV={tv:.3f})"
