"""The methods `eaglectl bench spec` compares (and the scenarios of `eaglectl bench prefix`), in a
module light enough for the CLI to check `--methods` (`--scenarios`) against before torch, numpy or
pyarrow loads (`eaglectl --help` imports none of them)."""
from __future__ import annotations

# batch 1 (bench/spec.py), every one, in order
SPEC_METHODS = ("vanilla", "hf", "hf_lookup", "lookup", "chain", "static", "dynamic", "hybrid")
# at every batch size (bench/spec_batch.py)
BATCH_METHODS = ("vanilla", "default", "head", "lookup", "hybrid")
# the methods that draft with the head `--draft` names
HEAD_METHODS = ("chain", "static", "dynamic", "hybrid", "head")
# `bench prefix --scenarios` (bench/prefix.py): a shared system prompt, multi-turn conversations, a job
PREFIX_SCENARIOS = ("a", "b", "c")


def check_methods(methods, allowed: tuple[str, ...]) -> None:
    """ValueError unless `methods` are vanilla and others of `allowed`, each once: every speedup is
    measured against vanilla, and a method given twice would run twice per prompt."""
    unknown = [m for m in methods if m not in allowed]
    if unknown:
        raise ValueError(f"unknown method(s) {', '.join(map(repr, unknown))}; choose from {', '.join(allowed)}")
    repeated = sorted({m for m in methods if list(methods).count(m) > 1})
    if repeated:
        raise ValueError(f"{', '.join(repeated)} given more than once")
    if "vanilla" not in methods:
        raise ValueError("must include vanilla: every speedup is measured against it")
