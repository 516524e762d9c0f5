"""Engine configuration: which model, which device, how much KV memory, how big a step may be."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from eagle_worker.sampling_params import MAX_SEED, is_int
from eagle_worker.speculative.config import SpecConfig, choose_draft, default_spec

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def check_device(device: str) -> None:
    """Refuse a device this engine does not run on (`cpu`, `cuda`, `cuda:N`), or a CUDA device on a
    machine without one, before anything loads."""
    if not re.fullmatch(r"cpu|cuda(:\d+)?", str(device)):
        raise ValueError(f"device {device!r}: expected cpu, cuda or cuda:N")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: CUDA is not available on this machine")


@dataclass
class EngineConfig:
    model: str = "gemma-3-270m"
    dtype: str = "float32"
    device: str = "cpu"
    draft: str | None = "auto"         # EAGLE head folder, "default" (built-in head), "auto" (the built-in
                                       # head when the model has one), or None/"none": no speculation
    spec: SpecConfig | None | str = "auto"   # full speculation settings; "auto": default_spec(draft);
                                             # None: no speculation
    tp_size: int = 1
    block_size: int = 16
    kv_cache_gb: float = 1.0           # KV memory budget; blocks = budget / bytes per block
    num_kv_blocks: int | None = None   # overrides kv_cache_gb (tests)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024 # token budget per step (prefill chunks + decodes)
    max_model_len: int | None = None   # default: the model's context length, capped at 8192
    chat_template: str | None = None   # Jinja template overriding the tokenizer's
    seed: int = 0                      # seeds the seeds drawn for requests that bring none
    enable_prefix_caching: bool = True # reuse full KV blocks of shared prefixes (vLLM's name; prefix_cache.py)
    offline_slowdown: float | None = 0.25  # while online (priority 0) requests run, offline (priority > 0) work
                                       # may make a step at most this much slower (background_cap.py); None: no cap

    def __post_init__(self) -> None:
        self._check_types()
        if self.dtype not in DTYPES:
            raise ValueError(f"EngineConfig.dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        check_device(self.device)
        if self.spec is not None and not isinstance(self.spec, (SpecConfig, str)):
            raise ValueError(f"EngineConfig.spec must be a SpecConfig, None or 'auto', got {type(self.spec).__name__} "
                             f"(build one: SpecConfig(**settings))")
        if isinstance(self.spec, str):
            if self.spec != "auto":
                raise ValueError(f"EngineConfig.spec must be a SpecConfig, None or 'auto', got {self.spec!r}")
            self.spec = default_spec(self.draft, self.model)
        elif self.draft not in ("auto", None, "", "none") \
                and choose_draft(self.draft, self.model) != (self.spec.draft if self.spec else None):
            # a head named beside a spec that does not use it (draft=None beside a spec: the spec decides)
            raise ValueError(f"EngineConfig: draft={self.draft!r} and spec={self.spec!r} disagree; give the head "
                             f"in one of them (spec's draft field)")
        self.draft = self.spec.draft if self.spec is not None else None   # as resolved
        if self.tp_size < 1:
            raise ValueError(f"EngineConfig.tp_size must be at least 1, got {self.tp_size!r}")
        if not 0 <= self.seed < MAX_SEED:
            raise ValueError(f"EngineConfig.seed must be an integer in [0, 2**63), got {self.seed!r}")
        if self.offline_slowdown is not None and (isinstance(self.offline_slowdown, bool)
                                                  or not isinstance(self.offline_slowdown, (int, float))):
            raise ValueError(f"EngineConfig.offline_slowdown must be a number or None, got {self.offline_slowdown!r}")
        if self.offline_slowdown is not None and not 0 <= self.offline_slowdown <= 1000:   # also refuses NaN
            raise ValueError(f"EngineConfig.offline_slowdown must be between 0 and 1000 or None, got {self.offline_slowdown!r}")
        if self.block_size <= 0 or self.max_num_seqs <= 0 or self.max_num_batched_tokens <= 0:
            raise ValueError("EngineConfig.block_size, max_num_seqs and max_num_batched_tokens must be positive")
        if not (math.isfinite(self.kv_cache_gb) and self.kv_cache_gb > 0):
            raise ValueError(f"EngineConfig.kv_cache_gb must be a positive number, got {self.kv_cache_gb!r}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"EngineConfig.num_kv_blocks must be a positive integer or None, got {self.num_kv_blocks!r}")
        if self.max_model_len is not None and self.max_model_len < 2:   # a prompt token and one generated
            raise ValueError(f"EngineConfig.max_model_len must be at least 2 (a prompt token and one generated) "
                             f"or None, got {self.max_model_len!r}")

    def _check_types(self) -> None:
        """Wrong types fail here naming the field, not deep in the model runner (`max_model_len=2.5`,
        `enable_prefix_caching="no"`, which Python would read as true)."""
        ints = ("tp_size", "block_size", "max_num_seqs", "max_num_batched_tokens", "seed")
        optional_ints = ("num_kv_blocks", "max_model_len")
        bad = [n for n in ints if not is_int(getattr(self, n))]
        bad += [n for n in optional_ints if getattr(self, n) is not None and not is_int(getattr(self, n))]
        bad += [n for n in ("kv_cache_gb",)
                if isinstance(self.kv_cache_gb, bool) or not isinstance(self.kv_cache_gb, (int, float))]
        bad += [n for n in ("enable_prefix_caching",) if not isinstance(self.enable_prefix_caching, bool)]
        bad += [n for n in ("model", "dtype", "device") if not isinstance(getattr(self, n), str) or not getattr(self, n)]
        bad += [n for n in ("draft", "chat_template") if getattr(self, n) is not None and not isinstance(getattr(self, n), str)]
        if bad:
            raise ValueError("EngineConfig: wrong type or empty: " + ", ".join(f"{n}={getattr(self, n)!r}" for n in bad))


    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

