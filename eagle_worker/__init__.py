"""EAGLE speculative-decoding serving engine: what one replica runs."""
from eagle_worker.config import EngineConfig
from eagle_worker.engine import LLMEngine
from eagle_worker.llm import LLM
from eagle_worker.outputs import RequestOutput
from eagle_worker.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "RequestOutput"]
