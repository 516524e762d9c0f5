"""The engine one replica runs: requests in, one scheduled step at a time, incremental outputs out.

step() = schedule (continuous batching over the paged cache) -> worker runs the target (and, with
a draft head, drafts and verifies) -> append the new tokens, applying stop rules token by token
-> register the blocks the step filled for prefix caching -> report what changed. Everything a
request can get wrong is refused in add_request; a step that still raises fails only its own
requests (finish_reason "error", with the cause), and the engine goes on with the rest.
"""
from __future__ import annotations

import dataclasses
import logging
import random
import time

from eagle_worker.block_manager import BlockManager
from eagle_worker.chat_template import check_template, resolve_chat_template
from eagle_worker.config import EngineConfig
from eagle_worker.decode_worker import DecodeWorker
from eagle_worker.detokenizer import detokenize_incrementally, finalize_text
from eagle_worker.grammar import GrammarCompiler
from eagle_worker.model_runner import ModelRunner
from eagle_worker.outputs import RequestOutput, TokenLogprob
from eagle_worker.prompt_tokenizer import PromptTokenizer
from eagle_worker.sampling_params import SamplingParams, is_token_id, kept_prompt_tokens, prompt_chars_limit
from eagle_worker.scheduler import Scheduler
from eagle_worker.sequence import Sequence, SequenceStatus
from eagle_worker.speculative.config import resolve_draft
from eagle_worker.speculative.step_cost import StepCost

logger = logging.getLogger(__name__)


CONTEXT_LENGTH = "This model's maximum context length is"     # OpenAI's and vLLM's words


class ContextLengthError(ValueError):
    """A prompt with no room left for one generated token: OpenAI's `context_length_exceeded`,
    the code callers (clients that trim and retry) look for."""

    code = "context_length_exceeded"


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        if config.spec is not None:      # a head that is not there fails before the model loads
            config.spec.draft = resolve_draft(config.spec.draft, config.model)
        self.runner = ModelRunner(config)
        self.tokenizer = self.runner.tokenizer
        self.max_model_len = self.runner.max_model_len
        self.block_manager = BlockManager(self.runner.num_kv_blocks, config.block_size, config.enable_prefix_caching)
        self.worker = self._make_worker(config)
        self.scheduler = Scheduler(config, self.block_manager, self.worker.num_lookahead_slots, self.max_model_len,
                                   need_head_kv=getattr(self.worker, "head", None) is not None, step_cost=StepCost())
        if hasattr(self.worker, "queue_depth"):        # the hybrid prices a finished slot by who waits for it
            self.worker.queue_depth = self.scheduler.num_waiting   # no closure over the engine: no cycle
        self.chat_template = resolve_chat_template(self.tokenizer, self.runner.hf_config, config.chat_template)
        check_template(self.chat_template)
        self.prompts = PromptTokenizer(self.tokenizer, self.chat_template, config.model)  # as the ingress has it
        self.grammars = GrammarCompiler(self.tokenizer, self.runner.model.vocab_size, self.runner.eos_token_ids)
        self.requests: dict[str, Sequence] = {}
        self._aborted: list[RequestOutput] = []
        self._seed_source = random.Random(config.seed)    # the seed of each request that brings none
        self._last_step = {"batch_size": 0, "num_tokens": 0}
        self.totals = {"steps": 0, "generated_tokens": 0, "prompt_tokens": 0, "finished_requests": 0,
                       "failed_steps": 0}

    def _make_worker(self, config: EngineConfig):
        if config.spec is None:
            return DecodeWorker(self.runner, self.block_manager)
        from eagle_worker.speculative.worker import EagleWorker

        return EagleWorker(self.runner, self.block_manager, config.spec)

    # ---- requests -------------------------------------------------------------------------
    def tokenize(self, prompt: str) -> list[int]:
        return self.prompts.tokenize(prompt)

    def apply_chat_template(self, messages: list[dict]) -> str:
        return self.prompts.apply_chat_template(messages)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    priority: int = 0) -> None:
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        params = dataclasses.replace(params)    # checked again (a field set after building) and the request's own
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already running")
        if not is_token_id(priority) or priority < 0:   # an integer, as the scheduler orders by it
            raise ValueError(f"priority must be an integer >= 0 (0 online, 1 and above offline), got {priority!r}"[:200])
        priority = int(priority)
        if isinstance(prompt, str):
            if not prompt:          # whitespace is a prompt (OpenAI and vLLM take it): its tokens
                raise ValueError("prompt is empty")
            truncating = params.truncate_prompt_tokens is not None    # tokenized whole, then cut: bounded all the same
            limit = prompt_chars_limit(self.max_model_len, self.prompts.max_chars_per_token, truncating)
            if truncating and len(prompt) > limit:
                raise ValueError(f"prompt has {len(prompt)} characters; a prompt cut by truncate_prompt_tokens "
                                 f"may have at most {limit}")
            if len(prompt) > limit:     # a 50 MB row is refused without tokenizing it on the engine thread
                raise ContextLengthError(f"{CONTEXT_LENGTH} {self.max_model_len} tokens. However, your prompt has "
                                         f"{len(prompt)} characters, more than that many tokens hold (at most "
                                         f"{limit}). Please reduce the length of the prompt.")
            token_ids = self.tokenize(prompt)
        elif isinstance(prompt, (list, tuple)):
            odd = next(((i, t) for i, t in enumerate(prompt) if not is_token_id(t)), None)
            if odd is not None:
                raise ValueError(f"prompt token ids must be integers; position {odd[0]} is {type(odd[1]).__name__} "
                                 f"{odd[1]!r}"[:200])
            token_ids = [int(t) for t in prompt]
        else:
            raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not token_ids:
            raise ValueError("prompt is empty")
        keep = kept_prompt_tokens(params.truncate_prompt_tokens, len(token_ids), self.max_model_len, params.max_tokens)
        token_ids = token_ids[len(token_ids) - keep:]
        vocab = self.runner.model.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]   # also a text's: a tokenizer may hold more ids than the model
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
        for name, ids in (("logit_bias", params.logit_bias or {}), ("stop_token_ids", params.stop_token_ids),
                          ("allowed_token_ids", params.allowed_token_ids or [])):
            bad = [t for t in ids if t >= vocab]
            if bad:
                raise ValueError(f"{name} token ids out of range [0, {vocab}): {bad[:5]}")
        if len(token_ids) >= self.max_model_len:
            raise ContextLengthError(f"{CONTEXT_LENGTH} {self.max_model_len} tokens. However, your prompt has "
                                     f"{len(token_ids)} tokens, and at least one token is generated. Please reduce "
                                     "the length of the prompt.")
        seed = params.seed if params.seed is not None else self._seed_source.getrandbits(63)
        eos = set() if params.ignore_eos else {t for t in self.runner.eos_token_ids if t < vocab}
        stop_ids = eos | params.stop_id_set
        if params.min_tokens and params.allowed_token_ids and set(params.allowed_token_ids) <= stop_ids:
            raise ValueError(f"allowed_token_ids: every allowed token ends the output (EOS or a stop id), which "
                             f"min_tokens={params.min_tokens} forbids for the first tokens")
        grammar = (self.grammars.matcher(params.structured_outputs, params.ignore_eos)
                   if params.structured_outputs else None)
        bad_words = self.prompts.bad_word_token_ids(params.bad_words) if params.bad_words else ()
        seq = Sequence(request_id, token_ids, params, priority, seed, stop_ids, grammar, bad_words)
        self.scheduler.add(seq)
        self.requests[request_id] = seq       # after the scheduler took it: never a request no step runs
        self.totals["prompt_tokens"] += len(token_ids)

    def abort(self, request_id: str) -> bool:
        seq = self.requests.get(request_id)
        if seq is None:
            return False
        self._finish(seq, "abort")
        self._retire([seq])
        self._aborted.append(self._output(seq))
        del self.requests[request_id]
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self._aborted)

    # ---- the step loop ----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs, self._aborted = self._aborted, []
        batch = self.scheduler.schedule()
        if not batch:
            return outputs
        self._last_step = {"batch_size": len(batch), "num_tokens": sum(b.num_tokens for b in batch)}
        work = self.scheduler.planned_work(batch)
        started = time.perf_counter()
        try:
            new_tokens = self.worker.execute(batch)
        except Exception as e:
            if self.config.tp_size > 1:
                raise                 # the other ranks may be inside a collective: the replica must go
            return outputs + self._fail_step(batch, e)
        self.scheduler.observe(work, time.perf_counter() - started)
        now = time.monotonic()
        finished = []
        for item in batch:
            seq = item.seq
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = now
            tokens = new_tokens.get(seq.request_id)
            if not tokens:
                continue                          # a prefill chunk that did not reach the end
            try:
                self._append(seq, tokens)
                outputs.append(self._output(seq))
            except Exception as e:                # its own output (detokenizing, stop checks) fails it alone
                logger.exception("request %s failed after its step", seq.request_id)
                self._finish(seq, "error", flush=False)
                outputs.append(self._output(seq, error=f"the request's output failed: {type(e).__name__}: {e}"))
            if seq.is_finished:
                finished.append(seq)
                del self.requests[seq.request_id]
        for item in batch:
            if not item.seq.is_finished:
                self._register(item.seq)
        self._retire(finished)
        self.totals["steps"] += 1
        return outputs

    def _append(self, seq: Sequence, tokens: list[tuple[int, TokenLogprob | None]]) -> None:
        """Add accepted tokens one at a time so EOS, stop ids, stop strings and limits hold exactly.
        Nothing stops a request within its first `min_tokens` tokens (the sampler keeps the stop
        tokens out of them; a stop string must end in text after them, as in vLLM)."""
        p = seq.params
        for token, logprob in tokens:
            if seq.grammar is not None:
                seq.grammar.advance(token)          # a token the grammar refuses fails the request (not kept)
            seq.token_ids.append(token)
            if p.logprobs is not None:
                seq.logprobs.append(logprob)
            self.totals["generated_tokens"] += 1
            if seq.metrics.first_token_time is None:
                seq.metrics.first_token_time = time.monotonic()
            stop_id = token in p.stop_id_set
            hidden = stop_id and not p.include_stop_str_in_output   # vLLM: a stop token's text is not output
            new_text = "" if hidden else detokenize_incrementally(self.tokenizer, seq)
            early = seq.num_output_tokens <= p.min_tokens
            if not early and ((token in self.runner.eos_token_ids and not p.ignore_eos) or stop_id):
                return self._finish(seq, "stop", drop_last=hidden)
            if p.stop and new_text and not early and self._hit_stop_string(seq, len(new_text)):
                return self._finish(seq, "stop", flush=False)
            if seq.grammar is not None and seq.grammar.is_finished:
                return self._finish(seq, "stop")    # the match is complete: only EOS could follow
            if seq.num_output_tokens >= p.max_tokens or len(seq) >= self.max_model_len:
                return self._finish(seq, "length")

    def _hit_stop_string(self, seq: Sequence, new_chars: int) -> bool:
        """Whether the new text completes a stop string; the text is cut at the one it completes first
        (as if it had come a character at a time), whatever the order of the `stop` list."""
        start = len(seq.text) - new_chars + 1       # each string may begin before the new text, and must end in it
        hits = [(at + len(s), at) for s in seq.params.stop if (at := seq.text.find(s, max(0, start - len(s)))) >= 0]
        if not hits:
            return False
        end, at = min(hits)
        seq.text = seq.text[:end] if seq.params.include_stop_str_in_output else seq.text[:at]
        return True

    def _fail_step(self, batch: list, error: Exception) -> list[RequestOutput]:
        """A step that raised fails its own requests, not the engine: their KV blocks and draft state
        are freed (half-updated, so not retried here) and requests outside the step go on."""
        logger.exception("engine step failed; failing its %d requests", len(batch))
        message = f"the engine step failed: {type(error).__name__}: {error}"
        outputs = []
        for item in batch:
            seq = item.seq
            self._finish(seq, "error", flush=False)
            outputs.append(self._output(seq, error=message))
            del self.requests[seq.request_id]
        self._retire([it.seq for it in batch])
        self.totals["failed_steps"] += 1
        return outputs

    def _finish(self, seq: Sequence, reason: str, flush: bool = True, drop_last: bool = False) -> None:
        """Mark `seq` finished; its caller retires it (`_retire`) once its step's outputs are made.
        `drop_last`: the last token's text stays out of the output (a stop token id)."""
        if flush and reason not in ("abort", "error"):
            flushed = finalize_text(self.tokenizer, seq, drop_last)
            if flushed and seq.params.stop and seq.num_output_tokens > seq.params.min_tokens \
                    and self._hit_stop_string(seq, len(flushed)):
                reason = "stop"               # the held-back end completed a stop string
        seq.finish_reason = reason
        seq.status = SequenceStatus.FINISHED
        seq.metrics.finished_time = time.monotonic()

    def _retire(self, seqs: list[Sequence]) -> None:
        """Give finished requests' blocks to the prefix cache and their slots back. Those that ended
        normally first write the head KV they still owe (prefix_cache.py), in one head pass for the
        whole step."""
        if not seqs:
            return
        if self.block_manager.prefix_cache is not None:
            self.worker.flush_head_kv([s for s in seqs if s.finish_reason in ("stop", "length")])
        for seq in seqs:
            if seq.finish_reason != "error":      # a failed step may have left its KV half-written
                self._register(seq)
            self.scheduler.remove(seq)
            self.worker.release(seq)
            self.totals["finished_requests"] += 1

    def _register(self, seq: Sequence) -> None:
        """Offer `seq`'s filled blocks to later requests (with what the head has written of them)."""
        self.block_manager.register(seq, self.worker.head_kv_done(seq))

    def _output(self, seq: Sequence, error: str | None = None) -> RequestOutput:
        out_ids = seq.output_token_ids
        emitted = seq.num_emitted_tokens
        shown = len(seq.text)
        if seq.params.stop and not seq.is_finished:   # a stop string may be completed by later tokens:
            shown -= max(len(s) for s in seq.params.stop) - 1   # hold back what could be its start
        shown = max(shown, seq.num_emitted_chars)
        delta = seq.text[seq.num_emitted_chars:shown]
        seq.num_emitted_tokens, seq.num_emitted_chars = len(out_ids), shown
        want_lp = seq.params.logprobs is not None
        prompt_lp = None
        if seq.prompt_logprobs is not None and not seq.prompt_logprobs_sent:   # with the first output only
            prompt_lp, seq.prompt_logprobs_sent = list(seq.prompt_logprobs), True
        return RequestOutput(
            request_id=seq.request_id, prompt_token_ids=seq.prompt_token_ids, token_ids=list(out_ids),
            text=seq.text, new_token_ids=out_ids[emitted:], delta_text=delta, finished=seq.is_finished,
            finish_reason=seq.finish_reason, logprobs=list(seq.logprobs) if want_lp else None,
            new_logprobs=seq.logprobs[emitted:] if want_lp else None, prompt_logprobs=prompt_lp,
            error=error, metrics=seq.metrics.as_dict(seq.num_output_tokens, seq.num_prompt_tokens))

    def shutdown(self) -> None:
        """Release the other tensor-parallel ranks (a no-op with tp_size=1)."""
        self.runner.shutdown()

    def keep_alive(self) -> None:
        """Keep idle tensor-parallel ranks from timing out in their wait (a no-op with tp_size=1)."""
        self.runner.keep_alive()

    # ---- introspection ----------------------------------------------------------------------
    def stats(self) -> dict:
        total = self.block_manager.num_blocks
        free = self.block_manager.num_free_blocks
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_free_blocks": free,
            "num_total_blocks": total,
            "kv_usage": 1.0 - free / total,
            "batch_size_last_step": self._last_step["batch_size"],
            "tokens_last_step": self._last_step["num_tokens"],
            **self.totals,
            "num_preemptions_total": sum(self.scheduler.preemptions.values()),
            "num_preemptions_by_priority": {str(k): v for k, v in sorted(self.scheduler.preemptions.items())},
            "num_offline_held": self.scheduler.offline_held,
            **self._prefix_cache_stats(),
            **self.worker.stats(),
        }

    def _prefix_cache_stats(self) -> dict:
        cache = self.block_manager.prefix_cache
        if cache is None:
            return {}
        return {**cache.stats, "prefix_cache_blocks": self.block_manager.num_cached_blocks}
