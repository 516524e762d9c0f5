"""End to end, speculation samples from the target's distribution: thousands of seeded samples of the
first three tokens through the engine (no head, and the hybrid: head and prompt lookup) follow the
joint distribution computed from `transformers`' own forward of the target, with temperature,
top-k and top-p applied here by hand (not by our sampler). The third token comes from a verify
step's non-root rows whenever a draft was accepted, so a wrong row, position key or filter there
shows as a wrong distribution, not just as a wrong token."""
from __future__ import annotations

import pytest
import torch

from eagle_worker import LLM, SamplingParams, SpecConfig

PROMPT = "The quick brown fox jumps over the lazy dog. The quick"
FILTERS = dict(temperature=0.7, top_k=4, top_p=0.8)
N = 2000


def _filtered(logits: torch.Tensor, filters: dict) -> torch.Tensor:
    """softmax(logits / T), then keep the top-k, then the smallest set reaching top-p; renormalised."""
    p = torch.softmax(logits.double() / filters["temperature"], -1)
    vals, idx = p.sort(descending=True)
    vals[filters["top_k"]:] = 0
    vals = vals / vals.sum()
    before = vals.cumsum(0) - vals              # mass of the tokens ranked above each
    vals[before >= filters["top_p"]] = 0
    out = torch.zeros_like(p)
    out[idx] = vals / vals.sum()
    return out


def _reference(target, filters: dict) -> dict[tuple[int, ...], float]:
    """P(t1, t2, t3) over every sequence the filters allow, from transformers' forward."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    prompt = AutoTokenizer.from_pretrained(target)(PROMPT)["input_ids"]
    dist: dict[tuple[int, ...], float] = {(): 1.0}
    with torch.no_grad():
        for _ in range(3):
            grown = {}
            for seq, mass in dist.items():
                p = _filtered(model(torch.tensor([prompt + list(seq)])).logits[0, -1], filters)
                for tok in p.nonzero().flatten().tolist():
                    grown[seq + (tok,)] = mass * float(p[tok])
            dist = grown
    return dist


def _chi_square_p(counts: dict[tuple[int, ...], int], ref: dict[tuple[int, ...], float], n: int) -> float:
    """Pearson's test, outcomes expected fewer than 5 times pooled into one bin."""
    observed, expected, rare_obs, rare_exp = [], [], 0, 0.0
    for seq, prob in ref.items():
        if prob * n >= 5:
            observed.append(counts.get(seq, 0))
            expected.append(prob * n)
        else:
            rare_obs, rare_exp = rare_obs + counts.get(seq, 0), rare_exp + prob * n
    if rare_exp > 0:
        observed.append(rare_obs)
        expected.append(rare_exp)
    obs, exp = torch.tensor(observed, dtype=torch.float64), torch.tensor(expected, dtype=torch.float64)
    stat = float(((obs - exp) ** 2 / exp).sum())
    df = len(observed) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2)))


@pytest.fixture(scope="module")
def reference(copying_target):
    ref = _reference(copying_target[0], FILTERS)
    assert abs(sum(ref.values()) - 1) < 1e-9 and len(ref) >= 8     # a real spread, not one likely text
    return ref


def _methods(head: str) -> dict[str, SpecConfig | None]:
    return {"plain": None,
            "hybrid": SpecConfig(draft=head, lookup=True, lookup_ngram=(1, 3), adaptive=False, depth=3, top_k=3,
                                 num_draft_tokens=6)}


@pytest.mark.parametrize("method", ["plain", "hybrid"])
def test_samples_follow_the_targets_joint_distribution(method, copying_target, reference):
    target, head = copying_target
    llm = LLM(model=str(target), spec=_methods(str(head))[method], block_size=4, num_kv_blocks=2048,
              max_num_seqs=256)
    params = [SamplingParams(max_tokens=3, ignore_eos=True, seed=s, **FILTERS) for s in range(N)]
    outs = llm.generate([PROMPT] * N, params)
    counts: dict[tuple[int, ...], int] = {}
    for o in outs:
        counts[tuple(o.token_ids)] = counts.get(tuple(o.token_ids), 0) + 1
    assert set(counts) <= set(reference), set(counts) - set(reference)   # nothing the filters forbid
    assert _chi_square_p(counts, reference, N) > 1e-4
    if method != "plain":          # the third token came through verify steps that accepted drafts
        stats = llm.engine.stats()
        assert stats["spec_steps"] > 0 and stats["acceptance_rate_per_depth"][0] > 0.1, stats


def test_the_check_sees_a_sampler_slip(copying_target, reference):
    """The test above can fail: counts exactly as expected pass; counts as a sampler that ignored the
    temperature, top-k or top-p (or applied the temperature twice) would give them do not."""
    assert _chi_square_p({seq: round(p * N) for seq, p in reference.items()}, reference, N) > 0.5
    t = FILTERS["temperature"]
    for slip in ({**FILTERS, "temperature": 1.0}, {**FILTERS, "temperature": t * t}, {**FILTERS, "top_k": 5},
                 {**FILTERS, "top_p": 1.0}):
        wrong = _reference(copying_target[0], slip)
        forbidden = sum(p for seq, p in wrong.items() if seq not in reference)   # the subset check refuses these
        assert forbidden * N > 5 or _chi_square_p({seq: round(p * N) for seq, p in wrong.items()}, reference, N) < 1e-4, slip
