"""The held-out split is by prompt: a prompt that appears several times (OpenAssistant's replies,
ShareGPT repeats, spelled with other case or spacing) is never both trained on and held out."""
from __future__ import annotations

import random

import pytest

from eagle_worker.training.data import Sample
from eagle_worker.training.pipeline import PipelineConfig, split_samples


def prompt_key(prompt):
    return " ".join(prompt.split()).casefold()


def _cfg(heldout, seed=0):
    return PipelineConfig(target="x", out="/nonexistent", data=["d.jsonl"], heldout=heldout, seed=seed)


@pytest.mark.parametrize("seed", range(5))
def test_no_prompt_is_on_both_sides(seed):
    rnd = random.Random(seed)
    samples = []
    for i in range(200):
        for j in range(rnd.choice([1, 1, 2, 4])):      # replies to one prompt, spelled a little differently
            prompt = f"Question {i}: what  now?" if j % 2 else f"question {i}: What now? "
            samples.append(Sample(prompt, f"reply {j}", "oasst"))
    held, train = split_samples(_cfg(16, seed), samples)
    assert len(held) == 16 and len({prompt_key(s.prompt) for s in held}) == 16
    assert not {prompt_key(s.prompt) for s in held} & {prompt_key(s.prompt) for s in train}
    assert len(train) == len(samples) - sum(sum(prompt_key(t.prompt) == prompt_key(h.prompt) for t in samples)
                                            for h in held)


def test_distinct_prompts_split_as_before():
    """Each prompt once: the same split as the seeded shuffle of the samples (work folders stay valid)."""
    samples = [Sample(f"prompt {i}", None, "s") for i in range(100)]
    shuffled = list(samples)
    random.Random(3).shuffle(shuffled)
    assert split_samples(_cfg(8, 3), samples) == (shuffled[:8], shuffled[8:])


def test_one_prompt_asked_three_times_is_all_held_out():
    with pytest.raises(ValueError, match="3 sample.* have 1 distinct prompt.*all held out"):
        split_samples(_cfg(4), [Sample("same", f"r{i}", "s") for i in range(3)])
