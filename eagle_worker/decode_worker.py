"""Plain decoding worker: one target forward per step, one sampled token per finished chunk.

The EAGLE worker (eagle_worker/speculative/worker.py) has the same `execute` signature and drafts and verifies
trees instead; the engine does not know which one it drives.
"""
from __future__ import annotations

import torch

from eagle_worker.block_manager import BlockManager
from eagle_worker.model_runner import ForwardItem, ForwardResult, ModelRunner
from eagle_worker.outputs import TokenLogprob
from eagle_worker.sampler import argmax_suffices, screenable
from eagle_worker.scheduler import ScheduledSeq

NewTokens = dict[str, list[tuple[int, TokenLogprob | None]]]


def forward_item(block_manager: BlockManager, item: ScheduledSeq) -> ForwardItem:
    """The forward description of a scheduled chunk (its slots are already allocated); with
    prompt_logprobs, the prompt tokens this chunk's rows predict are scored too."""
    seq, n = item.seq, item.num_tokens
    start = seq.num_computed_tokens
    slots = block_manager.slots(seq, 0, start + n)
    scored = seq.prompt_logprobs
    score = None
    # the chunk's rows predict tokens start+1 .. start+n; score them where the next unscored prompt token
    # is among them (a recompute after preemption cuts other chunks: it scores only what is missing)
    if scored is not None and start + 1 <= len(scored) <= start + n and len(scored) < seq.num_prompt_tokens:
        score = seq.token_ids[start + 1:min(start + n + 1, seq.num_prompt_tokens)]
    return ForwardItem(token_ids=seq.token_ids[start:start + n], positions=torch.arange(start, start + n),
                       new_slots=slots[start:], ctx_slots=slots[:start],
                       logit_rows=[n - 1] if item.completes else [],
                       score_tokens=score, score_top=seq.params.prompt_logprobs or 0,
                       full_logits=not screenable(seq.params))


def record_prompt_logprobs(batch: list[ScheduledSeq], result: ForwardResult) -> None:
    """Keep the prompt logprobs a forward scored (delivered with the request's first output); before
    the chunk's commit, so `num_computed_tokens` is still where its rows start."""
    for it, scores in zip(batch, result.scores):
        if scores:
            seq = it.seq
            already = len(seq.prompt_logprobs) - (seq.num_computed_tokens + 1)   # scored before a preemption
            seq.prompt_logprobs.extend(scores[already:])


class DecodeWorker:
    num_lookahead_slots = 0            # no draft tree: the scheduler reserves nothing past a decode

    def __init__(self, runner: ModelRunner, block_manager: BlockManager):
        self.runner = runner
        self.block_manager = block_manager

    def release(self, seq) -> None:
        """Nothing to forget: plain decoding keeps no per-request state."""

    def flush_head_kv(self, seqs) -> None:
        """No head KV to write."""

    def head_kv_done(self, seq) -> int | None:
        """No draft head, so no head KV for cached blocks to carry."""
        return None

    def stats(self) -> dict:
        return {}

    def execute(self, batch: list[ScheduledSeq]) -> NewTokens:
        """Run one forward; return the new (token, logprob) list of each sequence that sampled."""
        sampling = [it for it in batch if it.completes]
        result = self.runner.forward([forward_item(self.block_manager, it) for it in batch],
                                     argmax_only=argmax_suffices([it.seq.params for it in sampling]))
        record_prompt_logprobs(batch, result)
        for it in batch:
            if it.completes and it.num_tokens == 1:
                it.seq.metrics.num_target_forwards += 1
                it.seq.metrics.num_decode_tokens += 1
            self.block_manager.commit(it.seq, it.num_tokens)
        if not sampling:
            return {}
        if result.rows is None:
            return {it.seq.request_id: [(t, None)] for it, t in zip(sampling, result.argmax.tolist())}
        drawn = result.rows.sample(list(range(len(sampling))), [it.seq.sample_row() for it in sampling])
        return {it.seq.request_id: [d] for it, d in zip(sampling, drawn)}
