"""Identical prompts in flight are prefilled once.

`n` samples of one prompt (the ingress sends them as n requests with one prompt) or the same row
twice in a job: the first request (the leader) prefills; the others (followers) wait until the
leader's prompt KV is committed, then copy the KV of every prompt token but the last into blocks
of their own and feed only that last token, which gives each its own first-token distribution
(and under EAGLE its own first draft tree, from the leader's pending head inputs). A follower
whose leader goes away before its prefill ends (aborted, failed) prefills by itself; so does one
for which memory is short at the fork. Block-level prefix caching would share the blocks instead
of copying them; until then a copy costs one memory pass where a prefill costs a forward.
"""
from __future__ import annotations

from eagle_worker.sequence import Sequence


class PromptSharing:
    def __init__(self):
        self._leaders: dict[tuple[int, tuple[int, ...]], Sequence] = {}   # (priority, prompt) -> leader
        self._followers: dict[str, list[Sequence]] = {}                   # leader id -> its followers

    @property
    def empty(self) -> bool:
        return not self._leaders and not self._followers

    def follow(self, seq: Sequence) -> bool:
        """Make `seq` wait for a leader with the same prompt and priority (True), or become a leader."""
        if len(seq.prompt_token_ids) < 2 or seq.params.prompt_logprobs is not None:
            return False                   # nothing to share, or it must score its own prompt rows
        key = (seq.priority, tuple(seq.prompt_token_ids))
        leader = self._leaders.get(key)
        if leader is None:
            self._leaders[key] = seq
            return False
        self._followers.setdefault(leader.request_id, []).append(seq)
        return True

    def is_leader_prefilling(self, seq: Sequence) -> bool:
        return self._leaders.get((seq.priority, tuple(seq.prompt_token_ids))) is seq

    def release(self, leader: Sequence) -> list[Sequence]:
        """The leader's prefill is done, or it is gone: its followers, now free to run."""
        key = (leader.priority, tuple(leader.prompt_token_ids))
        if self._leaders.get(key) is leader:
            del self._leaders[key]
        return self._followers.pop(leader.request_id, [])

    def forget(self, seq: Sequence) -> None:
        """A follower that finished while waiting (aborted) leaves its leader's list."""
        for followers in self._followers.values():
            if seq in followers:
                followers.remove(seq)
                return
