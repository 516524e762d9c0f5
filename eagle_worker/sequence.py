"""One request as the engine tracks it: its tokens, its KV blocks, its progress and its metrics."""
from __future__ import annotations

import enum
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from eagle_worker.outputs import TokenLogprob
from eagle_worker.sampler import SampleRow
from eagle_worker.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class SequenceMetrics:
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_target_forwards: int = 0     # decode steps that ran the target for this sequence (prefill excluded)
    num_decode_tokens: int = 0       # tokens those steps produced (accepted drafts + bonus)
    num_preemptions: int = 0
    num_cached_tokens: int = 0       # prompt tokens taken from the prefix cache (not computed)
    accepted_per_depth: list[int] = field(default_factory=list)  # speculative: accepted drafts at depth d
    accepted_from_head: int = 0      # accepted draft tokens the EAGLE head proposed
    accepted_from_lookup: int = 0    # accepted draft tokens prompt lookup proposed (both: counted in both)
    steps_by_source: dict[str, int] = field(default_factory=dict)   # hybrid: decode steps per StepMode
    num_trees_shrunk_for_memory: int = 0   # decode steps whose draft tree was smaller for want of KV slots

    def as_dict(self, num_output_tokens: int, prompt_tokens: int) -> dict:
        forwards = self.num_target_forwards
        out = {
            "num_prompt_tokens": prompt_tokens,
            "num_output_tokens": num_output_tokens,
            "num_target_forwards": forwards,
            "mean_accepted_tokens": (self.num_decode_tokens / forwards) if forwards else 1.0,
            "num_preemptions": self.num_preemptions,
            "num_cached_tokens": self.num_cached_tokens,
        }
        if self.first_token_time is not None:
            out["ttft_s"] = self.first_token_time - self.arrival_time
        if self.finished_time is not None:
            out["latency_s"] = self.finished_time - self.arrival_time
            if num_output_tokens > 1 and self.first_token_time is not None:
                out["tpot_s"] = (self.finished_time - self.first_token_time) / (num_output_tokens - 1)
        if self.accepted_per_depth:
            out["accepted_per_depth"] = list(self.accepted_per_depth)
            drafted = sum(self.accepted_per_depth)
            out["accepted_share_head"] = self.accepted_from_head / drafted if drafted else 0.0
            out["accepted_share_lookup"] = self.accepted_from_lookup / drafted if drafted else 0.0
        if self.accepted_per_depth or self.num_trees_shrunk_for_memory:
            out["num_trees_shrunk_for_memory"] = self.num_trees_shrunk_for_memory
        if self.steps_by_source:
            out["steps_by_source"] = dict(self.steps_by_source)
        return out


class Sequence:
    """Token ids are prompt + output; `num_computed_tokens` of them have committed KV in the cache.

    The engine feeds tokens [num_computed_tokens, len) each step (a prefill chunk or the one
    newest token) and samples when that reaches the end.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 priority: int, seed: int, stop_ids: Iterable[int] = (), grammar=None,
                 bad_words: Iterable[tuple[int, ...]] = ()):
        """`stop_ids`: the tokens that would end it (EOS unless ignore_eos, stop_token_ids), which its
        first `params.min_tokens` tokens cannot be; `grammar`: a structured output's GrammarMatcher;
        `bad_words`: token sequences the output cannot hold (`params.bad_words` tokenized)."""
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)
        self.params = params
        self.priority = priority
        self.seed = seed               # every request has one: its text is a function of it
        self.early_banned = tuple(sorted(set(stop_ids))) if params.min_tokens else ()
        self.grammar = grammar         # fed every output token (engine._append)
        self.bad_words = tuple(bad_words)
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.num_computed_tokens = 0
        self.block_hashes: list[int] = []   # chained hashes of full blocks of token_ids (prefix_cache.py)
        self.finish_reason: str | None = None
        self.logprobs: list[TokenLogprob] = []
        # prompt logprobs scored so far (entry 0 is None: nothing predicts the first token)
        self.prompt_logprobs: list[TokenLogprob | None] | None = [None] if params.prompt_logprobs is not None else None
        self.prompt_logprobs_sent = False
        self.metrics = SequenceMetrics()
        # incremental detokenization state
        self.text = ""
        self.prefix_offset = 0
        self.read_offset = 0
        self.num_emitted_tokens = 0   # output tokens already reported
        self.num_emitted_chars = 0    # text chars already reported

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    def sample_row(self, draft: list[int] = ()) -> SampleRow:
        """The draw context of the next token, or of the token after `draft` (a tree node's path
        below the root) when verifying a tree."""
        p = self.params
        output = self.output_token_ids + list(draft) if p.processes_logits else ()
        prompt = self.prompt_token_ids if p.repetition_penalty != 1.0 else ()
        position = self.num_output_tokens + len(draft)
        banned = self.early_banned if position < p.min_tokens else ()
        if self.bad_words:
            banned = (*banned, *bad_word_ends(self.bad_words, output))
        allowed = self.grammar.allowed(draft) if self.grammar is not None else None
        return SampleRow(p, self.seed, position, prompt, output, banned, allowed)

    @property
    def num_pending_tokens(self) -> int:
        """Tokens not yet in the KV cache (the whole prompt at first, then the newest token)."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED


def bad_word_ends(bad_words: tuple[tuple[int, ...], ...], output: list[int]) -> list[int]:
    """The tokens that would complete a bad word after `output`: a one-token word's always, a longer
    word's last token where the output ends with the rest of it (vLLM's rule, over output tokens)."""
    ends = []
    for w in bad_words:
        rest = len(w) - 1
        if rest == 0 or (rest <= len(output) and tuple(output[len(output) - rest:]) == w[:-1]):
            ends.append(w[-1])
    return ends
