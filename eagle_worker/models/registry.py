"""HF config -> our model class, by `architectures` first and `model_type` as a fallback."""
from __future__ import annotations

from torch import nn

from eagle_worker.models.gemma3 import Gemma3ForCausalLM, Gemma3ForConditionalGeneration
from eagle_worker.models.llama import LlamaForCausalLM
from eagle_worker.models.qwen3 import Qwen3ForCausalLM

_BY_ARCH: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Gemma3ForConditionalGeneration": Gemma3ForConditionalGeneration,
}

_BY_MODEL_TYPE: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "gemma3_text": Gemma3ForCausalLM,
    "gemma3": Gemma3ForConditionalGeneration,
}


def supported_architectures() -> list[str]:
    return sorted(_BY_ARCH)


def model_class_for(hf_config) -> type[nn.Module]:
    archs = list(getattr(hf_config, "architectures", None) or [])
    for arch in archs:
        if arch in _BY_ARCH:
            return _BY_ARCH[arch]
    model_type = getattr(hf_config, "model_type", None)
    if not archs and model_type in _BY_MODEL_TYPE:
        return _BY_MODEL_TYPE[model_type]
    name = ", ".join(archs) or f"model_type={model_type!r}"
    raise ValueError(f"unsupported model architecture {name}; supported: {', '.join(supported_architectures())}")
