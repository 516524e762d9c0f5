"""EAGLE speculative-decoding serving engine: what one replica runs.

Names are imported lazily so that light modules (sampling params, block manager) load without
pulling in transformers and the model code. The names below are what the fleet needs of an engine
module (eagle_worker/engine_api.py: `EngineModule`), plus `LLM` and `RequestOutput`.
"""
import importlib

_EXPORTS = {
    "LLM": "eagle_worker.llm",
    "LLMEngine": "eagle_worker.engine",
    "EngineConfig": "eagle_worker.config",
    "SamplingParams": "eagle_worker.sampling_params",
    "StructuredOutputs": "eagle_worker.structured_output",
    "SpecConfig": "eagle_worker.speculative.config",
    "choose_draft": "eagle_worker.speculative.config",
    "resolve_draft": "eagle_worker.speculative.config",
    "RequestOutput": "eagle_worker.outputs",
    "run_tp_worker": "eagle_worker.tp_worker",
    "init_tensor_parallel": "eagle_worker.parallel",
    "load_prompt_tokenizer": "eagle_worker.prompt_tokenizer",
}
__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'eagle_worker' has no attribute {name!r}")
