"""A tiny stand-in engine honouring the engine contract (eagle_worker/engine_api.py).

Used with `ServeConfig(engine="tests.cluster.fake_engine")` to test what the real engine cannot be
made to do on cue. Byte-level "tokenizer"; tokens are a hash of the context so greedy output is
reproducible. Markers in a prompt inject faults, so each test controls its own requests:
  [slow:S]             every step sleeps S seconds while this request runs
  [die-once:PATH:N]    after N output tokens the whole process exits, unless PATH exists (created first)
  [crash-once:PATH:N]  same, but step() raises instead (the engine loop dies, the actor lives)
  [hang-once:PATH:N]   same, but step() never returns (sleeps an hour: a hung kernel or collective)
  [die-always:N], [crash-always:N]  the same on every replica the request runs on (a poison request)
  [fail-step:N]        after N output tokens the engine fails this request alone (finish_reason
                       "error"), as the real engine does when a step raises
Logprobs follow the contract (TokenLogprob per token, a fixed made-up distribution), a logit_bias of
at least +50 forces its token, and `stats()["text_prompts"]` counts prompts that arrived as text
(the ingress sends token ids, so the serving tests expect 0).
Prefix caching is emulated (`enable_prefix_caching` like the real EngineConfig): every full 16-token
block of every admitted prompt is remembered, unbounded; a prompt's leading remembered blocks are its
`num_cached_tokens`, and `stats()` has the real engine's `prefix_cache_*` keys.
"""
from __future__ import annotations

import hashlib
import os
import random
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from eagle_worker.engine_api import block_hashes, kept_prompt_tokens

ALPHABET = b"abcdefghij klmnopqrstuvwxyz"
EOS = 0


class ByteTokenizer:
    eos_token_id = EOS

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode())

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(i for i in ids if i != EOS).decode(errors="replace")

    def apply_chat_template(self, messages, chat_template=None, tokenize=False, add_generation_prompt=True):
        tpl = chat_template or "{role}: {content}\n"
        out = "".join(tpl.format(role=m["role"], content=m["content"]) for m in messages)
        return out + ("assistant:" if add_generation_prompt else "")


@dataclass
class EngineConfig:
    model: str = "fake"
    dtype: str = "float32"
    device: str = "cpu"
    draft: str | None = None
    tp_size: int = 1
    max_num_seqs: int = 64
    max_model_len: int = 512
    kv_cache_gb: float = 1.0
    chat_template: str | None = None
    spec: Any = None
    enable_prefix_caching: bool = True


class SpecConfig:
    """Accepts any speculation settings; the fake engine never speculates."""

    def __init__(self, draft: str | None = None, **settings):
        self.draft, self.settings = draft, settings


def choose_draft(draft: str | None, model: str) -> str | None:
    """No built-in heads: "auto" means none."""
    return None if draft in (None, "", "none", "auto") else draft


def resolve_draft(draft: str | None, model: str) -> str | None:
    return draft


def init_tensor_parallel(rank: int, world_size: int) -> None:
    """Nothing to shard; the TP group's own collectives are tested with this engine."""


run_tp_worker = None  # no tensor-parallel worker loop: a tp_size > 1 replica is refused


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


def _logprob(tok: int, k: int | None) -> TokenLogprob:
    """Made-up but consistent: the chosen token at -0.5, alternatives the next letters lower."""
    top = [(ALPHABET[(ALPHABET.index(tok) + j) % len(ALPHABET)] if tok in ALPHABET else tok, -0.5 - j)
           for j in range(k or 0)]
    return TokenLogprob(tok, -0.5, top)


class PromptTokenizer:
    """The prompt side of the fake model (engine_api's load_prompt_tokenizer)."""

    max_chars_per_token = 1

    def __init__(self, chat_template: str | None = None):
        self.tokenizer, self.chat_template = ByteTokenizer(), chat_template

    def tokenize(self, prompt: str) -> list[int]:
        return self.tokenizer.encode(prompt)

    def apply_chat_template(self, messages: list[dict]) -> str:
        if any("content" not in m for m in messages):
            raise ValueError("messages must have content")
        return self.tokenizer.apply_chat_template(messages, chat_template=self.chat_template)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def token_bytes(self, token_id: int) -> list[int]:
        return [token_id] if token_id < 256 else list(self.token_text(token_id).encode())   # a token is a byte


def load_prompt_tokenizer(config: EngineConfig) -> PromptTokenizer:
    return PromptTokenizer(config.chat_template)


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    allowed_token_ids: list[int] | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    truncate_prompt_tokens: int | None = None
    bad_words: list[str] | None = None       # taken, not applied: the real engine's tests check the ban

    def __post_init__(self):
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    new_token_ids: list[int] = field(default_factory=list)
    delta_text: str = ""
    finished: bool = False
    finish_reason: str | None = None
    metrics: dict = field(default_factory=dict)
    logprobs: list[TokenLogprob] | None = None
    error: str | None = None
    new_logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass
class _Seq:
    rid: str
    prompt: list[int]
    params: SamplingParams
    priority: int
    arrival: float
    rng: random.Random
    out: list[int] = field(default_factory=list)
    first_token_t: float | None = None
    slow: float = 0.0
    fault: tuple[str, str, int] | None = None
    fail_at: int | None = None
    lps: list[TokenLogprob] = field(default_factory=list)
    cached: int = 0


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.tokenizer = ByteTokenizer()
        self.step_s = float(os.environ.get("FAKE_ENGINE_STEP_S", "0"))
        self.waiting: list[_Seq] = []
        self.running: list[_Seq] = []
        self.aborted: list[_Seq] = []
        self.last_batch = 0
        self.max_model_len = config.max_model_len
        self.text_prompts = 0  # prompts that arrived as text: tokenized here, on the engine thread
        self.blocks: set[int] = set()   # the emulated prefix cache: hashes of every full prompt block seen
        self.prefix = dict.fromkeys(("queried_tokens", "hit_tokens", "queried_requests", "hit_requests"), 0)
        self.built_on = threading.get_ident()   # the thread that built the engine, and those that stepped it
        self.stepped_on: set[int] = set()

    def apply_chat_template(self, messages: list[dict]) -> str:
        if any("content" not in m for m in messages):
            raise ValueError("messages must have content")
        return self.tokenizer.apply_chat_template(messages, chat_template=self.config.chat_template)

    def add_request(self, request_id, prompt, params, priority: int = 0) -> None:
        self.text_prompts += isinstance(prompt, str)
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        bad = [t for t in (params.logit_bias or {}) if not 0 <= t < 256]
        if bad:
            raise ValueError(f"logit_bias: token ids out of range [0, 256): {bad[:5]}")
        if not ids:
            raise ValueError("prompt must not be empty")
        ids = ids[len(ids) - kept_prompt_tokens(params.truncate_prompt_tokens, len(ids), self.config.max_model_len,
                                                params.max_tokens):]
        if len(ids) + params.max_tokens > self.config.max_model_len:
            raise ValueError(
                f"prompt is too long: {len(ids)} prompt tokens + max_tokens {params.max_tokens} "
                f"exceeds max_model_len {self.config.max_model_len}"
            )
        seed = params.seed if params.seed is not None else random.getrandbits(32)
        seq = _Seq(request_id, ids, params, priority, time.monotonic(), random.Random(seed))
        if self.config.enable_prefix_caching:
            seq.cached = self._lookup(ids)
        text = self.tokenizer.decode(ids)
        if m := re.search(r"\[slow:([\d.]+)\]", text):
            seq.slow = float(m.group(1))
        if m := re.search(r"\[(die|crash|hang)-once:([^:\]]+):(\d+)\]", text):
            seq.fault = (m.group(1), m.group(2), int(m.group(3)))
        if m := re.search(r"\[(die|crash)-always:(\d+)\]", text):
            seq.fault = (m.group(1), "", int(m.group(2)))
        if m := re.search(r"\[fail-step:(\d+)\]", text):
            seq.fail_at = int(m.group(1))
        self.waiting.append(seq)

    def _lookup(self, ids: list[int]) -> int:
        """Prompt tokens found in the emulated cache (at least one is left to compute); remembers the rest."""
        hashes = block_hashes(ids, 16)
        hit = 0
        while hit < len(hashes) and hashes[hit] in self.blocks and (hit + 1) * 16 < len(ids):
            hit += 1
        self.blocks.update(hashes)
        self.prefix["queried_tokens"] += len(ids)
        self.prefix["hit_tokens"] += hit * 16
        self.prefix["queried_requests"] += 1
        self.prefix["hit_requests"] += hit > 0
        return hit * 16

    def abort(self, request_id: str) -> None:
        for q in (self.waiting, self.running):
            for s in list(q):
                if s.rid == request_id:
                    q.remove(s)
                    self.aborted.append(s)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.aborted)

    def _next_token(self, s: _Seq) -> int:
        forced = [t for t, b in (s.params.logit_bias or {}).items() if b >= 50]
        if forced:
            return max(forced, key=lambda t: s.params.logit_bias[t])
        if s.params.temperature == 0:
            h = hashlib.sha256(bytes(s.prompt + s.out)).digest()[0]
            return ALPHABET[h % len(ALPHABET)]
        return ALPHABET[s.rng.randrange(len(ALPHABET))]

    def _maybe_fault(self, s: _Seq) -> None:
        if s.fault and len(s.out) >= s.fault[2] and not (s.fault[1] and os.path.exists(s.fault[1])):
            if s.fault[1]:
                open(s.fault[1], "w").close()
            if s.fault[0] == "die":
                os._exit(1)
            if s.fault[0] == "hang":
                time.sleep(3600)
            raise RuntimeError("injected engine crash")

    def step(self) -> list[RequestOutput]:
        self.stepped_on.add(threading.get_ident())
        outs = [RequestOutput(s.rid, s.prompt, list(s.out), self.tokenizer.decode(s.out),
                              finished=True, finish_reason="abort") for s in self.aborted]
        self.aborted.clear()
        self.waiting.sort(key=lambda s: (s.priority, s.arrival))
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            self.running.append(self.waiting.pop(0))
        delay = max([self.step_s] + [s.slow for s in self.running])
        if delay:
            time.sleep(delay)
        for s in self.running:
            self._maybe_fault(s)
        for s in [s for s in self.running if s.fail_at is not None and len(s.out) >= s.fail_at]:
            self.running.remove(s)
            outs.append(RequestOutput(s.rid, s.prompt, list(s.out), self.tokenizer.decode(s.out), finished=True,
                                      finish_reason="error", error="the engine step failed: injected fault"))
        self.last_batch = len(self.running)
        for s in list(self.running):
            tok = self._next_token(s)
            s.out.append(tok)
            if s.first_token_t is None:
                s.first_token_t = time.monotonic()
            text = self.tokenizer.decode(s.out)
            prev = self.tokenizer.decode(s.out[:-1])
            reason = None
            if len(s.out) >= s.params.max_tokens:
                reason = "length"
            for stop in s.params.stop or []:
                if stop in text:
                    text = text[: text.index(stop)]
                    reason = "stop"
            if reason:
                self.running.remove(s)
            lp, k = None, s.params.logprobs
            if k is not None:
                s.lps.append(_logprob(tok, k))
                lp = list(s.lps)
            pk, first = s.params.prompt_logprobs, len(s.out) == 1
            prompt_lp = [None] + [_logprob(t, pk) for t in s.prompt[1:]] if pk is not None and first else None
            outs.append(RequestOutput(
                s.rid, s.prompt, list(s.out), text, [tok], text[len(prev):] if len(text) > len(prev) else "",
                reason is not None, reason,
                {"num_output_tokens": len(s.out), "num_target_forwards": len(s.out),
                 "mean_accepted_tokens": 1.0, "ttft_s": s.first_token_t - s.arrival, "num_cached_tokens": s.cached},
                logprobs=lp, new_logprobs=lp[-1:] if lp else None, prompt_logprobs=prompt_lp,
            ))
        return outs

    def shutdown(self) -> None:
        pass

    def keep_alive(self) -> None:
        self.keep_alives = getattr(self, "keep_alives", 0) + 1
        if self.has_unfinished_requests():
            self.keep_alives_while_busy = getattr(self, "keep_alives_while_busy", 0) + 1

    def stats(self) -> dict:
        total = 1024
        used = sum(len(s.prompt) + len(s.out) for s in self.running) // 16
        return dict(num_running=len(self.running), num_waiting=len(self.waiting),
                    num_free_blocks=total - used, num_total_blocks=total, kv_usage=used / total,
                    batch_size_last_step=self.last_batch, tokens_per_step=1.0, text_prompts=self.text_prompts,
                    prefix_cache_blocks=len(self.blocks), prefix_cache_evictions=0,
                    **{f"prefix_cache_{k}": v for k, v in self.prefix.items()})
