"""Chat templates: the tokenizer's own, one set in the config, or the family's documented format.

The default GGUF checkpoint ships no template, so Gemma models fall back to Gemma's documented
turn format (`<start_of_turn>user ... <end_of_turn>`); a model with neither is refused clearly.
"""
from __future__ import annotations

import functools

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
    "{% if ns.system %}<start_of_turn>user\n{{ ns.system | trim }}<end_of_turn>\n{% endif %}"   # no user turn took it
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)

FAMILY_TEMPLATES = {"gemma3_text": GEMMA_TEMPLATE, "gemma3": GEMMA_TEMPLATE, "gemma2": GEMMA_TEMPLATE, "gemma": GEMMA_TEMPLATE}


def resolve_chat_template(tokenizer, hf_config, override: str | None) -> str | None:
    if override:
        return override
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.chat_template
    return FAMILY_TEMPLATES.get(getattr(hf_config, "model_type", ""))


def check_template(template: str | None) -> None:
    """ValueError at start for a template that cannot compile, instead of at the first chat request."""
    if template is None:
        return
    import jinja2

    try:
        jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"chat_template is not a valid Jinja template: line {e.lineno}: {e.message}") from None


def normalize_messages(messages) -> list[dict]:
    """Messages as the templates expect them: a string role and string content, OpenAI's text parts
    joined (`[{"type": "text", "text": ...}]`), null content as ""; ValueError naming the message."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"messages must be a non-empty list of {{role, content}} objects, got {_kind(messages)}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not m["role"].strip():
            raise ValueError(f"messages[{i}] must be an object with a string `role` and `content`, got {_kind(m)}")
        extra = sorted(k for k, v in m.items() if k not in MESSAGE_FIELDS and not echoed_empty(k, v))
        if extra:      # a field the template never sees is refused, not dropped (a response's empty ones pass)
            raise ValueError(f"messages[{i}]: unsupported field(s) {', '.join(map(repr, extra))}; "
                             f"a message has {', '.join(MESSAGE_FIELDS)}")
        if m.get("name") is not None and not isinstance(m["name"], str):
            raise ValueError(f"messages[{i}].name must be a string")
        content = m.get("content")
        if isinstance(content, list):
            if any(not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str)
                   or set(p) - {"type", "text"} for p in content):
                raise ValueError(f"messages[{i}].content: only text parts ({{\"type\": \"text\", \"text\": ...}}, "
                                 "nothing else) are supported")
            content = join_text_parts(content)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string or a list of text parts")
        out.append({"role": m["role"], "content": content, **({"name": m["name"]} if m.get("name") else {})})
    return out


MESSAGE_FIELDS = ("role", "content", "name")     # `name` goes to a template that reads it, refused by one that does not
# a response's message fields beyond those (OpenAI's ChatCompletionMessage): a client that sends the
# message back carries them empty (`refusal: null`, `tool_calls: []`), which is dropped; anything else is refused
RESPONSE_MESSAGE_FIELDS = frozenset({"refusal", "tool_calls", "function_call", "audio", "annotations"})


def echoed_empty(key: str, value) -> bool:
    """A response message's own field, empty, as a client sends the message back: dropped, not refused."""
    return key in RESPONSE_MESSAGE_FIELDS and value in (None, [], {}, "")


def join_text_parts(parts: list[dict]) -> str:
    """A message's text parts as one text: joined by a line break, as vLLM joins them."""
    return "\n".join(p["text"] for p in parts)


def _kind(x) -> str:
    return repr(x)[:60] if isinstance(x, str) else type(x).__name__


@functools.lru_cache(maxsize=16)
def reads_name(template: str) -> bool:
    """Whether a Jinja chat template reads a message's `name` (`m.name`, `m['name']`, `m.get('name')`):
    most do not, and a name they would drop is refused instead."""
    import jinja2
    from jinja2 import nodes

    for node in jinja2.Environment().parse(template).find_all((nodes.Getattr, nodes.Getitem, nodes.Call)):
        if isinstance(node, nodes.Getattr) and node.attr == "name":
            return True
        if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const) and node.arg.value == "name":
            return True
        if isinstance(node, nodes.Call) and any(isinstance(a, nodes.Const) and a.value == "name" for a in node.args):
            return True
    return False


def render_chat(tokenizer, template: str | None, messages: list[dict], model_name: str) -> str:
    if template is None:
        raise ValueError(f"model {model_name!r} has no chat template; set `chat_template` in the config "
                         "or send a plain completion prompt")
    import jinja2

    messages = normalize_messages(messages)
    named = next((i for i, m in enumerate(messages) if "name" in m), None)
    if named is not None and not reads_name(template):
        raise ValueError(f"messages[{named}].name: this model's chat template does not use a participant's "
                         "name (it would be dropped); leave `name` out")
    try:
        return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                             add_generation_prompt=True)
    except jinja2.TemplateError as e:     # the template itself refuses these messages (raise_exception, ...)
        raise ValueError(f"the chat template cannot render these messages: {e}") from None
