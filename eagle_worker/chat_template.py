"""Chat templates: the tokenizer's own, one set in the config, or the family's documented format.

The default GGUF checkpoint ships no template, so Gemma models fall back to Gemma's documented
turn format (`<start_of_turn>user ... <end_of_turn>`); a model with neither is refused clearly.
"""
from __future__ import annotations

# Gemma's documented prompt format; a system message is prepended to the first user turn.
GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{% set ns = namespace(system='') %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{% set ns.system = m['content'] | trim + '\n\n' %}"
    "{% else %}"
    "<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{% if m['role'] == 'user' %}{{ ns.system }}{% set ns.system = '' %}{% endif %}"
    "{{ m['content'] | trim }}<end_of_turn>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)

FAMILY_TEMPLATES = {"gemma3_text": GEMMA_TEMPLATE, "gemma3": GEMMA_TEMPLATE, "gemma2": GEMMA_TEMPLATE, "gemma": GEMMA_TEMPLATE}


def resolve_chat_template(tokenizer, hf_config, override: str | None) -> str | None:
    if override:
        return override
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.chat_template
    return FAMILY_TEMPLATES.get(getattr(hf_config, "model_type", ""))


def render_chat(tokenizer, template: str | None, messages: list[dict], model_name: str) -> str:
    if template is None:
        raise ValueError(f"model {model_name!r} has no chat template; set `chat_template` in the config "
                         "or send a plain completion prompt")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"messages[{i}] must be an object with 'role' and 'content'")
    return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False, add_generation_prompt=True)
