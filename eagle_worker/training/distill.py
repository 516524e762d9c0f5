"""Self-distillation: the target writes the responses with our batched engine (greedy).

Why: the head must predict what *this* target says next; training on its own continuations
(EAGLE-3, HASS) matches the serving distribution, where every accepted token is the target's.
"""
from __future__ import annotations

from eagle_worker.training.render import Example


def self_distill(llm, prompts: list[list[int]], sources: list[str], max_new_tokens: int,
                 batch: int = 64, progress: bool = True) -> list[Example]:
    """Greedy continuations of `prompts` (token ids) by the engine; examples = prompt + output."""
    from eagle_worker.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_new_tokens, temperature=0.0)
    out: list[Example] = []
    for i in range(0, len(prompts), batch):
        chunk = prompts[i:i + batch]
        for p, src, r in zip(chunk, sources[i:i + batch], llm.generate(chunk, params, use_tqdm=progress)):
            if len(r.token_ids) >= 2:
                out.append(Example(list(p) + list(r.token_ids), len(p), src + "+distill"))
    return out
