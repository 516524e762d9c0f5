"""Continuous batching: which sequences run this step and how many tokens each feeds.

Every step: running sequences first (decodes before prefill chunks, so long prompts never starve
them), then waiting requests by (priority, arrival) while the token budget, the sequence limit
and free KV blocks allow. Long prompts are split into chunks. When KV blocks run out, the
least urgent, most recently arrived running sequence is preempted: its blocks are freed and it
is recomputed later (vLLM's recompute preemption), so a full cache never crashes the engine. A
waiting request more urgent than a running one (online before offline) preempts it the same way
when the batch is full or memory is short, so it never waits for less urgent work to finish.
While online work runs beside offline work, the online part of a step is planned first and offline
work joins it only within `offline_slowdown` of its modelled time (background_cap.py).

With prefix caching, a request admitted takes its longest cached prefix first and is fed only the
rest. One whose next block another running request is computing right now waits a step for it
(`n` samples of a prompt, a system prompt many requests share), unless that request is less urgent.

The scheduler owns every KV slot, speculative ones included: with a speculative worker, each
decode also gets up to `num_lookahead_slots` slots after its token for the draft tree (vLLM's
lookahead slots), from the blocks left once every scheduled token has its own; where memory or
the context is short it gets fewer (the worker drafts a smaller tree, or none). Speculation never
preempts a request and never delays one's admission. Slots a step does not keep are freed when it
commits.
"""
from __future__ import annotations

import bisect
import sys
import time
from dataclasses import dataclass

from eagle_worker.background_cap import ONLINE_GRACE_S, BackgroundCap, step_work
from eagle_worker.block_manager import BlockManager
from eagle_worker.config import EngineConfig
from eagle_worker.sequence import Sequence, SequenceStatus
from eagle_worker.speculative.step_cost import StepCost


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_tokens: int          # tokens fed from seq.num_computed_tokens on
    num_lookahead: int = 0   # reserved slots after them, for a draft tree (decodes only)
    admitted: bool = False   # the first chunk since (re)admission: the worker starts its state afresh

    @property
    def completes(self) -> bool:
        """True when this chunk reaches the sequence's end, so the step samples a token for it."""
        return self.seq.num_computed_tokens + self.num_tokens == len(self.seq)


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, num_lookahead_slots: int = 0,
                 max_model_len: int | None = None, need_head_kv: bool = False, step_cost: StepCost | None = None):
        self.config = config
        self.step_cost = step_cost           # the engine's measured step time, for the offline cap
        self.need_head_kv = need_head_kv     # cached blocks must carry the EAGLE head's KV too
        self.block_manager = block_manager
        self.num_lookahead_slots = num_lookahead_slots
        self.max_model_len = max_model_len or sys.maxsize     # lookahead never reaches past the context
        self.waiting: list[tuple[tuple[int, float], Sequence]] = []   # sorted by (priority, arrival)
        self.running: list[Sequence] = []
        self.preemptions: dict[int, int] = {}   # priority -> sequences preempted (for memory or for a more urgent one)
        self.offline_held = 0                   # offline items the cap left out of a step or cut short
        self._online_limit: tuple[float, float] | None = None   # the last online step's cap: (seconds, when)

    def add(self, seq: Sequence) -> None:
        key = (seq.priority, seq.metrics.arrival_time)
        bisect.insort(self.waiting, (key, seq), key=lambda item: item[0])

    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Drop a sequence (finished or aborted) from the queues and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        self.waiting = [(k, s) for k, s in self.waiting if s is not seq]
        self.block_manager.free(seq)

    def schedule(self) -> list[ScheduledSeq]:
        """Plan one step and allocate the KV slots of every scheduled token."""
        budget = self.config.max_num_batched_tokens
        batch: list[ScheduledSeq] = []
        self.running.sort(key=lambda s: (s.num_pending_tokens > 1, s.priority, s.metrics.arrival_time))
        cap = self._background_cap()
        if cap is None:
            budget = self._schedule_running(self.running, batch, budget)
            self._admit_waiting(batch, budget)
        else:          # online work first, then offline work as far as the cap allows
            budget = self._schedule_running([s for s in self.running if s.priority <= 0], batch, budget)
            budget = self._admit_waiting(batch, budget, online_only=True)
            cap.start([(item.num_tokens, item.completes) for item in batch])
            if cap.recent_limit_s is None:
                self._online_limit = (cap.limit_s, time.monotonic())
            budget = self._schedule_running([s for s in self.running if s.priority > 0], batch, budget, cap)
            self._admit_waiting(batch, budget, cap=cap)
            self.offline_held += cap.held
        if self.num_lookahead_slots:
            self._reserve_lookahead(batch)
        return batch

    def planned_work(self, batch: list[ScheduledSeq]) -> list[tuple[int, bool]] | None:
        """Each item's (tokens, completes) for the cost model the offline cap prices steps with, taken
        before the step runs (it commits them: after it, no item completes); None without the cap."""
        if self.step_cost is None or self.config.offline_slowdown is None:
            return None
        return [(item.num_tokens, item.completes) for item in batch]

    def observe(self, work: list[tuple[int, bool]] | None, seconds: float) -> None:
        """A step's measured time and its `planned_work`, for the cost model."""
        if work is not None:
            self.step_cost.observe(step_work(work), seconds)

    def _background_cap(self) -> BackgroundCap | None:
        """The cap for this step: only with a slowdown set and offline work beside online work
        running or waiting, or beside online work a moment ago (`ONLINE_GRACE_S`)."""
        if self.config.offline_slowdown is None or self.step_cost is None:
            return None
        online = any(s.priority <= 0 for s in self.running) or any(k[0] <= 0 for k, _ in self.waiting)
        offline = any(s.priority > 0 for s in self.running) or any(k[0] > 0 for k, _ in self.waiting)
        if not offline:
            return None
        if online:
            return BackgroundCap(self.step_cost, self.config.offline_slowdown, self.block_manager.block_size)
        if self._online_limit is not None and time.monotonic() - self._online_limit[1] < ONLINE_GRACE_S:
            return BackgroundCap(self.step_cost, self.config.offline_slowdown, self.block_manager.block_size,
                                 recent_limit_s=self._online_limit[0])
        return None

    def _schedule_running(self, seqs: list[Sequence], batch: list[ScheduledSeq], budget: int,
                          cap: BackgroundCap | None = None) -> int:
        """Feed running sequences (in the order given); preempt the least urgent where KV is
        short. Returns the token budget left."""
        for seq in list(seqs):
            if seq not in self.running:        # preempted by an earlier sequence in this loop
                continue
            if budget <= 0:
                break
            n = min(seq.num_pending_tokens, budget)
            if cap is not None:
                n = cap.tokens(seq.num_pending_tokens, budget, True)
                if n == 0:
                    continue                   # keeps its KV; runs in a step with room
            while not self.block_manager.can_append(seq, n):
                victim = self._least_urgent()
                budget += self._preempt_scheduled(victim, batch)
                if victim is seq:
                    break
            if seq not in self.running:
                continue
            self.block_manager.append_slots(seq, n)
            batch.append(ScheduledSeq(seq, n))
            if cap is not None:
                cap.take(n, batch[-1].completes)
            budget -= n
        return budget

    def _admit_waiting(self, batch: list[ScheduledSeq], budget: int, online_only: bool = False,
                       cap: BackgroundCap | None = None) -> int:
        """Admit waiting requests by (priority, arrival) while budget, sequence limit and KV allow
        (`online_only`: priority <= 0 only). Returns the token budget left."""
        i = 0
        while i < len(self.waiting) and budget > 0:
            seq = self.waiting[i][1]
            if online_only and seq.priority > 0:
                break
            if self._wait_for_prefix(seq):
                i += 1
                continue
            if len(self.running) >= self.config.max_num_seqs:
                if not self._outranks(seq):
                    self.block_manager.free(seq)
                    break
                budget += self._preempt_scheduled(self._least_urgent(), batch)
            while not self.block_manager.can_append(seq, min(seq.num_pending_tokens, budget)) and self._outranks(seq):
                budget += self._preempt_scheduled(self._least_urgent(), batch)
            n = min(seq.num_pending_tokens, budget)
            if cap is not None:
                n = cap.tokens(seq.num_pending_tokens, budget, True)
            if n == 0 or not self.block_manager.can_append(seq, n):
                self.block_manager.free(seq)
                break                          # admission by KV memory (or the cap): wait
            self.waiting.pop(i)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._admit_prefix(seq)
            self.block_manager.append_slots(seq, n)
            batch.append(ScheduledSeq(seq, n, admitted=True))
            if cap is not None:
                cap.take(n, batch[-1].completes)
            budget -= n
        return budget

    def _least_urgent(self) -> Sequence:
        return max(self.running, key=lambda s: (s.priority, s.metrics.arrival_time))

    def _outranks(self, seq: Sequence) -> bool:
        """A running sequence is less urgent than waiting `seq` (a larger priority value): it may be
        preempted for it, so an online request never waits for offline work to finish."""
        return bool(self.running) and self._least_urgent().priority > seq.priority

    def _preempt_scheduled(self, victim: Sequence, batch: list[ScheduledSeq]) -> int:
        """Preempt `victim`, dropping it from this step's batch; returns the token budget it frees."""
        freed = 0
        for item in batch:
            if item.seq is victim:
                batch.remove(item)
                freed = item.num_tokens
                break
        self.preempt(victim)
        return freed

    def _wait_for_prefix(self, seq: Sequence) -> bool:
        """Take `seq`'s cached prefix; True (and nothing taken) when it should wait for a running
        request now computing its next block."""
        cache = self.block_manager.prefix_cache
        if cache is None or seq.params.prompt_logprobs is not None:    # prompt logprobs need every row
            return False
        blocks = self.block_manager.take_cached(seq, self.need_head_kv) // self.block_manager.block_size
        owner = cache.next_block_inflight(seq, blocks)
        if owner is not None and owner.priority <= seq.priority:
            self.block_manager.free(seq)
            return True
        return False

    def _admit_prefix(self, seq: Sequence) -> None:
        cache = self.block_manager.prefix_cache
        if cache is None:
            return
        cached = seq.num_computed_tokens
        if seq.metrics.num_preemptions == 0:      # the prompt's first admission: what the cache saved it
            seq.metrics.num_cached_tokens = cached
            cache.count_query(seq.num_prompt_tokens, cached)
        cache.mark_inflight(seq, cached // self.block_manager.block_size)

    def _reserve_lookahead(self, batch: list[ScheduledSeq]) -> None:
        """Draft-tree slots after each decode's token, most urgent first, from what is left."""
        bm = self.block_manager
        for item in batch:
            seq = item.seq
            if item.num_tokens != 1 or not item.completes:
                continue
            end = seq.num_computed_tokens + 1                      # slots allocated so far
            spare = len(seq.block_table) * bm.block_size - end + bm.num_free_blocks * bm.block_size
            item.num_lookahead = max(0, min(self.num_lookahead_slots, self.max_model_len - end, spare))
            bm.append_slots(seq, 1 + item.num_lookahead)

    def preempt(self, seq: Sequence) -> None:
        self.preemptions[seq.priority] = self.preemptions.get(seq.priority, 0) + 1
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.metrics.num_preemptions += 1
        self.add(seq)
