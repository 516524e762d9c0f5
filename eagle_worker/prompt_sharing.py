"""Identical prompts are prefilled once while one of them holds the prompt's KV.

`n` samples of one prompt (the ingress sends them as n requests), the same row twice in a job, a
chat client resending a request: the first request with a prompt (the holder) prefills it; one that
arrives while the holder's prompt KV is in the cache copies the KV of every prompt token but the
last into blocks of its own at once and feeds only that last token, which gives it its own
first-token distribution; one that arrives while the holder is still prefilling waits for it (a
follower). Under EAGLE the head's inputs for the prompt come along (its KV, or its pending pairs).
When the holder goes (finished, aborted, failed) its followers elect a new holder among themselves.
Block-level prefix caching would share blocks instead of copying them and match prefixes, not only
whole prompts; until then a copy costs one memory pass where a prefill costs a forward.
"""
from __future__ import annotations

from eagle_worker.sequence import Sequence, SequenceStatus


class PromptSharing:
    def __init__(self):
        self._holders: dict[tuple[int, ...], Sequence] = {}    # prompt -> the request holding its KV
        self._followers: dict[str, list[Sequence]] = {}         # holder id -> requests waiting for its prefill

    @property
    def empty(self) -> bool:
        return not self._holders and not self._followers

    def join(self, seq: Sequence) -> tuple[str, Sequence | None]:
        """("copy", holder): take the holder's prompt KV now; ("wait", holder): `seq` became its
        follower; ("prefill", None): `seq` computes its own prompt (and may hold it for others)."""
        if len(seq.prompt_token_ids) < 2 or seq.params.prompt_logprobs is not None:
            return "prefill", None         # nothing to share, or it must score its own prompt rows
        key = tuple(seq.prompt_token_ids)
        holder = self._holders.get(key)
        if holder is None:
            self._holders[key] = seq
            return "prefill", None
        if self.holds_prompt(holder):
            return "copy", holder
        if holder.priority > seq.priority:
            return "prefill", None         # never wait on a less urgent request's prefill
        self._followers.setdefault(holder.request_id, []).append(seq)
        return "wait", holder

    @staticmethod
    def holds_prompt(seq: Sequence) -> bool:
        """The KV of all prompt tokens but the last is in `seq`'s blocks."""
        return seq.status == SequenceStatus.RUNNING and seq.num_computed_tokens >= seq.num_prompt_tokens - 1

    def ready_followers(self, holder: Sequence) -> list[Sequence]:
        """The followers of `holder` once its prompt KV is there (after a step), else none."""
        if holder.request_id in self._followers and self.holds_prompt(holder):
            return self._followers.pop(holder.request_id)
        return []

    def leave(self, seq: Sequence) -> list[Sequence]:
        """`seq` finished: it holds nothing and waits for nothing any more. Returns its followers,
        who must now prefill (the first of them holds the prompt for the rest)."""
        key = tuple(seq.prompt_token_ids)
        if self._holders.get(key) is seq:
            del self._holders[key]
        for followers in self._followers.values():
            if seq in followers:
                followers.remove(seq)
                break
        return self._followers.pop(seq.request_id, [])
