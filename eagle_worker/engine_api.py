"""The engine contract: what the serving fleet (cluster/, jobs/) calls on an engine, written once.

`ServeConfig.engine` names an *engine module* (default `eagle_worker`; the cluster tests use
`tests.cluster.fake_engine`). The module provides the names of `EngineModule`, and its
`LLMEngine(config)` objects are `Engine`s. The fleet reaches an engine only through
`load_engine_module(path)`, which imports the module and checks it against these protocols, so a
module that drifts from the contract fails at load time with a message naming what is wrong (and
tests/eagle_worker/test_engine_api.py checks both engines in this repository).

Light on purpose: no torch at module level, so the cluster side can import it anywhere.
"""
from __future__ import annotations

import importlib
import inspect
import keyword
import sys
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from eagle_worker.chat_template import echoed_empty, join_text_parts, normalize_messages  # noqa: F401  (chat as the engine renders it)
from eagle_worker.default_models import is_builtin, local_context  # noqa: F401  (built-in names; a job's context check)
from eagle_worker.malloc_tuning import GLIBC_TUNABLES  # noqa: F401  (the env of the engine processes the fleet starts)
from eagle_worker.prefix_hash import block_hashes  # noqa: F401  (the fleet's prefix-aware routing hashes as engines cache)
from eagle_worker.sampling_params import kept_prompt_tokens, prompt_chars_limit  # noqa: F401  (prompt bounds, as engines cut)
from eagle_worker.speculative.config import SPEC_LIMITS  # noqa: F401  (the configs' bounds on tree sizes)
from eagle_worker.structured_output import MAX_CHOICES, StructuredOutputs, loads_strict  # noqa: F401  (grammars; request JSON)

# Keys of `Engine.stats()` the fleet reads (routing, metrics); an engine may report more.
STATS_KEYS = ("num_running", "num_waiting", "num_free_blocks", "kv_usage")


@runtime_checkable
class Engine(Protocol):
    """One engine instance. Not thread-safe: one thread owns it (cluster/replica.py's engine loop)."""

    max_model_len: int  # prompt + output tokens one request may use

    def add_request(self, request_id: str, prompt: str | list[int], params: Any, priority: int = 0) -> None:
        """Queue a request (`params`: the module's SamplingParams); ValueError when it is refused."""

    def abort(self, request_id: str) -> Any:
        """Drop a request; its final output (finish_reason "abort") comes from the next `step`."""

    def step(self) -> list[Any]:
        """Run one scheduling step; the RequestOutputs (deltas and finals) it produced."""

    def has_unfinished_requests(self) -> bool:
        """Whether `step` has anything to do."""

    def stats(self) -> dict[str, Any]:
        """Load figures, at least `STATS_KEYS`."""

    def apply_chat_template(self, messages: list[dict]) -> str:
        """Chat messages -> prompt text; raises when there is no template or the messages are bad."""

    def shutdown(self) -> None:
        """Release what the engine holds (with tp_size > 1: tell ranks 1..n-1 to stop)."""

    def keep_alive(self) -> None:
        """With tp_size > 1, called every TP_KEEPALIVE_S (cluster/replica.py) while the engine has no
        work: ranks 1..n-1 wait for rank 0 in a collective that times out with the process group."""


class EngineModule(Protocol):
    """The names an engine module provides (checked by `load_engine_module`)."""

    LLMEngine: Callable[[Any], Engine]
    """`LLMEngine(EngineConfig)` -> an `Engine`."""

    EngineConfig: Callable[..., Any]
    """Takes the keywords of `ServeConfig.engine_kwargs()`; exposes `draft` (as resolved) and `spec`."""

    SamplingParams: Callable[..., Any]
    """Takes a request's sampling fields as keywords; ValueError / TypeError on bad values."""

    SpecConfig: Callable[..., Any]
    """Speculation settings: `draft` plus the fields of the config's `speculation` section."""

    choose_draft: Callable[[str | None, str], str | None]
    """`(draft setting, model)`: what the setting means (None: no head; "auto": the model's built-in
    head or none); the one rule the engine and every config that names a draft use."""

    resolve_draft: Callable[[str | None, str], str | None]
    """`(chosen draft, model)`: the head folder to load, or ValueError saying why there is none."""

    load_prompt_tokenizer: Callable[[Any], Any]
    """`(EngineConfig)`: the model's prompt side without its weights (`tokenize(text)`,
    `apply_chat_template(messages)`, `decode(ids)`, `token_text(id)`, `max_chars_per_token`), so the
    serving ingress tokenizes and templates off the engine thread; replicas then get token ids."""

    init_tensor_parallel: Callable[[int, int], None]
    """`(rank, world_size)`: every rank of a TP group calls it once torch.distributed is up."""

    run_tp_worker: Callable[[Any], None] | None
    """`(EngineConfig)`: the loop of ranks 1..n-1 (returns when rank 0's engine shuts down);
    None when the engine has no tensor parallelism, so tp_size > 1 is refused."""


ENGINE_METHODS = tuple(n for n, v in vars(Engine).items() if callable(v) and not n.startswith("_"))
ENGINE_ATTRS = tuple(Engine.__annotations__)
MODULE_NAMES = tuple(EngineModule.__annotations__)


def signature_mismatches(impl: Any, proto: type) -> list[str]:
    """How `impl` (a class or object) differs from the methods of `proto`: a missing method, or a
    parameter of the protocol's method it lacks (by name and order) or must be passed that the
    protocol does not pass."""
    problems = []
    for name, want_fn in vars(proto).items():
        if name.startswith("_") or not callable(want_fn):
            continue
        have_fn = getattr(impl, name, None)
        if not callable(have_fn):
            problems.append(f"{name}: missing")
            continue
        want = list(inspect.signature(want_fn).parameters.values())[1:]  # without self
        have = list(inspect.signature(have_fn).parameters.values())
        if have and have[0].name == "self":  # looked up on the class
            have = have[1:]
        for i, p in enumerate(want):
            q = have[i] if i < len(have) else None
            if q is None or q.name != p.name or q.kind != p.kind:
                problems.append(f"{name}: parameter {i + 1} should be {p}, got {q}")
            elif p.default is not inspect.Parameter.empty and q.default is inspect.Parameter.empty:
                problems.append(f"{name}: parameter {p.name!r} needs a default")
        problems += [f"{name}: extra parameter {q} needs a default" for q in have[len(want):]
                     if q.default is inspect.Parameter.empty and q.kind not in (q.VAR_POSITIONAL, q.VAR_KEYWORD)]
    return problems


def import_engine_module(path: str) -> Any:
    """The module `path` names, imported; ImportError saying why not. A config's `engine` is imported
    while the config is validated, so what is no engine module is refused before anything runs it: a
    name that is not a dotted Python module name (`.x`, `a b`), a standard-library module (importing
    `this` prints, `antigravity` opens a browser), and a module whose import raises anything."""
    parts = path.split(".")
    if not all(p.isidentifier() and not keyword.iskeyword(p) for p in parts):
        raise ImportError(f"{path!r} is not a dotted Python module name (e.g. eagle_worker, my_package.engine)")
    if parts[0] in sys.stdlib_module_names:
        raise ImportError(f"{path!r} is a Python standard-library module")
    try:
        return importlib.import_module(path)
    except ImportError as e:
        raise ImportError(f"cannot import {path!r}: {e}") from e
    except (Exception, SystemExit) as e:     # the module's own code failed: a config error, not a traceback
        raise ImportError(f"importing {path!r} failed: {type(e).__name__}: {e}") from e


def draft_rules(path: str) -> tuple[Callable, Callable]:
    """The engine module's `choose_draft` and `resolve_draft`, for configs that read a `draft`
    setting (light: the rest of the engine is not imported); ImportError when `path` is no such module."""
    module = import_engine_module(path)
    try:
        return module.choose_draft, module.resolve_draft
    except AttributeError:
        raise ImportError(f"{path!r} lacks choose_draft / resolve_draft (see eagle_worker/engine_api.py)") from None


def load_engine_module(path: str) -> EngineModule:
    """Import the engine module `path` and check it provides `EngineModule`; TypeError if not."""
    module = import_engine_module(path)
    missing = [n for n in MODULE_NAMES if not hasattr(module, n)]  # hasattr: lazy module __getattr__ counts
    if missing:
        raise TypeError(f"engine module {path!r} lacks {', '.join(missing)} (see eagle_worker/engine_api.py)")
    problems = signature_mismatches(module.LLMEngine, Engine)
    if problems:
        raise TypeError(f"{path}.LLMEngine does not match the engine contract (eagle_worker/engine_api.py): "
                        + "; ".join(problems))
    return module
