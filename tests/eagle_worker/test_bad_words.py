"""vLLM's `bad_words`: each word is tokenized as it starts a text and, where a leading space gives it
another first token of as many tokens, as it follows a space; a word's last token is banned wherever
the output ends with the rest of it (one-token words everywhere). Output tokens only, as in vLLM.
Part of the draw at each output position, so speculation gives plain decoding's tokens."""
from __future__ import annotations

from dataclasses import replace

import pytest

from eagle_worker import LLM, SamplingParams
from eagle_worker.sequence import bad_word_ends
from tests.eagle_worker.test_token_restrictions import KV, PROMPTS, outputs_by_method


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(model=str(tiny_model_dir("llama")), draft=None, **KV)


def _holds(ids: list[int], word: tuple[int, ...]) -> bool:
    return any(tuple(ids[i:i + len(word)]) == word for i in range(len(ids) - len(word) + 1))


def _first_hit(ids: list[int], words: list[tuple[int, ...]]) -> int | None:
    """The first output position a bad word would end at (where its ban changes the draw)."""
    return next((i for i in range(len(ids)) if ids[i] in bad_word_ends(tuple(words), ids[:i])), None)


def _words_in(llm, ids: list[int], n: int) -> list[str]:
    """Texts of n output tokens that tokenize back to those tokens (so banning them bans that spot)."""
    words = []
    for k in range(len(ids) - n + 1):
        text = llm.tokenizer.decode(ids[k:k + n])
        if text.strip() and tuple(ids[k:k + n]) in llm.engine.prompts.bad_word_token_ids([text]):
            words.append(text)
    return words


@pytest.mark.parametrize("n", [1, 2])
def test_a_bad_word_never_comes_and_the_output_before_it_is_unchanged(llm, n):
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    checked = 0
    for prompt in PROMPTS:
        base = llm.generate(prompt, greedy)[0].token_ids
        for word in _words_in(llm, base, n)[:3]:
            seqs = llm.engine.prompts.bad_word_token_ids([word])
            hit = _first_hit(base, seqs)
            out = llm.generate(prompt, replace(greedy, bad_words=[word]))[0].token_ids
            assert hit is not None and out[:hit] == base[:hit] and out[hit] != base[hit], (word, base, out)
            assert not any(_holds(out, s) for s in seqs), (word, seqs, out)
            checked += 1
    assert checked >= 3, "too few words found in the outputs: the test checks little"


def test_the_token_sequences_follow_vllms_rule(llm):
    prompts = llm.engine.prompts
    enc = lambda t: tuple(llm.tokenizer.encode(t, add_special_tokens=False))    # noqa: E731
    assert prompts.bad_word_token_ids(["fox"])[0] == enc("fox")
    spaced = enc(" fox")
    assert (spaced in prompts.bad_word_token_ids(["fox"])) == (len(spaced) == len(enc("fox")) and spaced[0] != enc("fox")[0])
    assert prompts.bad_word_token_ids(["  fox"]) == prompts.bad_word_token_ids(["fox"])    # leading space stripped
    assert bad_word_ends(((5,), (7, 8, 9)), [1, 7, 8]) == [5, 9] and bad_word_ends(((7, 8, 9),), [8]) == []


@pytest.mark.parametrize("bad", [[""], ["  "], "fox", [3], ("a", None)])
def test_bad_words_that_are_not_words_are_refused_naming_the_field(bad):
    with pytest.raises(ValueError, match=r"SamplingParams\.bad_words must be None or a list of words"):
        SamplingParams(bad_words=bad)


def test_speculation_gives_plain_decodings_tokens_under_bad_words(copying_target):
    """The head and lookup draft a banned word's last token where it is likely; verification must
    refuse it exactly where plain decoding cannot draw it."""
    target, head = copying_target
    plain = LLM(model=str(target), draft=None, **KV)
    params = []
    for i, prompt in enumerate(PROMPTS):
        base = plain.generate(prompt, SamplingParams(max_tokens=14, temperature=0, ignore_eos=True))[0].token_ids
        words = _words_in(plain, base, 1)[:1] + _words_in(plain, base, 2)[:1]
        params.append(SamplingParams(max_tokens=14, temperature=0.0 if i % 2 else 0.8, seed=300 + i, ignore_eos=True,
                                     bad_words=words or None))
    assert sum(p.bad_words is not None for p in params) >= 4
    runs = {name: [o.token_ids for o in outs] for name, outs in outputs_by_method(target, head, PROMPTS, params).items()}
    assert runs["head"] == runs["plain"] and runs["lookup"] == runs["plain"] and runs["hybrid"] == runs["plain"]
    for ids, p in zip(runs["plain"], params):
        assert not any(_holds(ids, s) for s in plain.engine.prompts.bad_word_token_ids(p.bad_words or []))
