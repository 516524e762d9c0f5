"""Token texts and bytes as OpenAI's logprobs report them, and echoed offsets, on real tokenizers:
the tiny byte-level BPE one (Llama 3 / Qwen style) and the default model's sentencepiece one with
byte fallback (Gemma): a token that is part of a character has its own bytes, not U+FFFD's."""
from __future__ import annotations

from cluster.openai_render import CompletionRender
from cluster.openai_requests import CompletionRequest
from eagle_worker.outputs import RequestOutput, TokenLogprob
from eagle_worker.prompt_tokenizer import PromptTokenizer
from tests.conftest import make_tokenizer

TEXT = "Très bien 🫨 你好"


def _pieces_rebuild_the_text(prompts: PromptTokenizer, text: str) -> list[int]:
    ids = prompts.tokenize(text)
    body = [t for t in ids if prompts.token_text(t) != prompts.bos_token]
    assert b"".join(bytes(prompts.token_bytes(t)) for t in body) == text.encode()
    return body


def test_byte_level_bpe_tokens_have_their_own_bytes():
    prompts = PromptTokenizer(make_tokenizer(), None, "tiny")
    body = _pieces_rebuild_the_text(prompts, TEXT)
    partial = [t for t in body if "\ufffd" in prompts.token_text(t)]
    assert partial, "the tiny tokenizer should split some character across tokens"
    assert all(prompts.token_bytes(t) != list("\ufffd".encode()) for t in partial)


def test_byte_fallback_tokens_of_the_default_model_have_their_own_bytes(default_model_dir):
    prompts = PromptTokenizer.load("gemma-3-270m")
    body = _pieces_rebuild_the_text(prompts, TEXT)
    emoji = [prompts.token_bytes(t) for t in body if prompts.tokenizer.convert_ids_to_tokens(t).startswith("<0x")]
    assert emoji == [[0xF0], [0x9F], [0xAB], [0xA8]]


def test_echoed_offsets_index_the_echoed_text(default_model_dir):
    """The BOS the tokenizer adds is a token of the echo but not of its text: it takes no width, so
    `text[offset[i]:offset[i + 1]]` is token i's text (as OpenAI's `text_offset` means)."""
    prompts = PromptTokenizer.load("gemma-3-270m")
    for prompt in ("Hello world", "<bos>Hello world"):
        ids = prompts.tokenize(prompt)
        req = CompletionRequest.model_validate({"model": "m", "prompt": prompt, "echo": True, "logprobs": 0,
                                                "max_tokens": 2})
        gen = prompts.tokenize(" again")[1:]
        out = RequestOutput("r", ids, gen, prompts.decode(gen), gen, prompts.decode(gen), True, "length",
                            logprobs=[TokenLogprob(t, -0.5, []) for t in gen])
        choice = CompletionRender("m", prompts, req, [prompt], [ids]).full("id", [out], [None]).choices[0]
        text, lp = choice.text, choice.logprobs
        ends = [*lp["text_offset"][1:], len(text)]
        assert [text[a:b] for a, b in zip(lp["text_offset"], ends)][1:] == lp["tokens"][1:], (text, lp)
        assert text.startswith(prompt) and lp["tokens"][0] == "<bos>"


def test_job_logprobs_carry_each_tokens_own_bytes():
    """Offline jobs write OpenAI Batch logprobs through `jobs.openai_batch.openai_logprobs` (both row
    backends): the bytes of a text's tokens rebuild the text."""
    from jobs.openai_batch import openai_logprobs

    prompts = PromptTokenizer(make_tokenizer(), None, "tiny")
    ids = prompts.tokenize(TEXT)[1:]
    content = openai_logprobs([TokenLogprob(t, -0.5, [(t, -0.5)]) for t in ids], ids, prompts, chat=True)["content"]
    assert b"".join(bytes(c["bytes"]) for c in content) == TEXT.encode()
    assert all(c["top_logprobs"][0]["bytes"] == c["bytes"] for c in content)


def test_generated_offsets_count_a_character_split_over_tokens_once():
    """A token that holds part of a character reads as U+FFFD alone; each token advances the offset by
    the characters its bytes complete, also when the pieces of a character come in different chunks,
    so every offset indexes the choice's text (they ran 7 characters past a 10-character text)."""
    prompts = PromptTokenizer(make_tokenizer(), None, "tiny")
    text = " ça 你好🫨 ok"
    gen = prompts.tokenize(text)[1:]
    assert any("\ufffd" in prompts.token_text(t) for t in gen)
    req = CompletionRequest.model_validate({"model": "m", "prompt": "x", "logprobs": 0, "max_tokens": 20})
    lps = [TokenLogprob(t, -0.5, []) for t in gen]
    out = RequestOutput("r", [1], gen, text, gen, text, True, "length", logprobs=lps)
    full = CompletionRender("m", prompts, req, ["x"], [[1]]).full("id", [out], [None]).choices[0].logprobs["text_offset"]
    chars = [len(prompts.decode(gen[:k]).rstrip("\ufffd")) for k in range(len(gen))]
    assert full == chars and full[-1] < len(text)
    render, streamed = CompletionRender("m", prompts, req, ["x"], [[1]]), []
    for k, t in enumerate(gen):       # one token a chunk
        step = RequestOutput("r", [1], gen[:k + 1], "", [t], "", k == len(gen) - 1, None, new_logprobs=[lps[k]])
        streamed += render.chunk("id", 0, step).choices[0].logprobs["text_offset"]
    assert streamed == full
