"""The offline Python API, in vLLM's shape: `LLM(model=...).generate(prompts, SamplingParams(...))`."""
from __future__ import annotations

import contextlib
import itertools

from eagle_worker.config import EngineConfig
from eagle_worker.engine import LLMEngine
from eagle_worker.outputs import RequestOutput
from eagle_worker.sampling_params import SamplingParams, is_token_id


class LLM:
    """`draft` (via kwargs): "auto" (default: the hybrid with the model's built-in EAGLE head, or
    prompt lookup where it has none), a head folder, "default", or None (no speculation);
    `spec=SpecConfig(...)` for full control of speculation, `spec=None` for none
    (speculative/config.py `default_spec`)."""

    def __init__(self, model: str = "gemma-3-270m", dtype: str = "float32", device: str = "cpu", **kwargs):
        self.engine = LLMEngine(EngineConfig(model=model, dtype=dtype, device=device, **kwargs))
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: str | list[str] | list[list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Run all prompts to completion with continuous batching; outputs in prompt order."""
        if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts and is_token_id(prompts[0])):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise ValueError(f"prompts must be a string, a list of strings or a list of token-id lists, "
                             f"got {type(prompts).__name__}")
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        ids = [f"llm-{next(self._ids)}" for _ in prompts]
        finished: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm
            bar = tqdm(total=len(ids), desc="generate")
        try:
            for rid, prompt, p in zip(ids, prompts, params):
                self.engine.add_request(rid, prompt, p)
            prompt_logprobs = {}       # the engine sends them with a request's first output only
            while len(finished) < len(ids):
                for out in self.engine.step():
                    if out.prompt_logprobs is not None:
                        prompt_logprobs[out.request_id] = out.prompt_logprobs
                    if out.finished and out.request_id in ids:
                        out.prompt_logprobs = prompt_logprobs.pop(out.request_id, None)
                        finished[out.request_id] = out
                        if bar:
                            bar.update(1)
        except BaseException:    # a refused prompt, an error, Ctrl-C: none of this call's requests stays queued
            for rid in ids:
                if rid not in finished:
                    self.engine.abort(rid)
            with contextlib.suppress(Exception):
                self.engine.step()           # drain the abort notices (no request of ours is left to run)
            raise
        finally:
            if bar:
                bar.close()
        return [finished[rid] for rid in ids]

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = False) -> list[RequestOutput]:
        """One conversation or a list of them, rendered with the model's chat template."""
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list of messages (or of conversations)")
        if not isinstance(messages[0], (dict, list)):
            raise ValueError(f"messages[0] must be a message ({{'role': ..., 'content': ...}}) or a conversation "
                             f"(a list of them), got {type(messages[0]).__name__}")
        conversations = [messages] if isinstance(messages[0], dict) else messages
        prompts = [self.engine.apply_chat_template(c) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)
