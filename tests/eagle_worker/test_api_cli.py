"""The user-facing surface: `LLM.chat` with templates, and `eaglectl generate` (text and --json)."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from eagle_worker import LLM, SamplingParams
from eagle_worker.chat_template import GEMMA_TEMPLATE
from eaglectl.main import main


def test_chat_without_template_is_a_clear_error(tiny_model_dir):
    llm = LLM(model=str(tiny_model_dir("llama")), block_size=4, num_kv_blocks=64)
    with pytest.raises(ValueError, match="no chat template"):
        llm.chat([{"role": "user", "content": "hi"}])


def test_chat_with_configured_template_renders_and_generates(tiny_model_dir):
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    llm = LLM(model=str(tiny_model_dir("llama")), block_size=4, num_kv_blocks=64, chat_template=template)
    msgs = [{"role": "user", "content": "two plus two?"}]
    assert llm.engine.apply_chat_template(msgs) == "user: two plus two?\nassistant:"
    chat = llm.chat(msgs, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))[0]
    plain = llm.generate("user: two plus two?\nassistant:", SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))[0]
    assert chat.token_ids == plain.token_ids
    with pytest.raises(ValueError, match=r"messages\[0\]"):
        llm.chat([{"content": "no role"}])


def test_chat_takes_openai_text_parts_and_refuses_what_it_cannot_render(tiny_model_dir):
    """`LLM.chat` reads messages as the HTTP endpoint does: text parts joined by a line break (vLLM's
    join), null content empty, a response's empty fields dropped and any other unknown field refused; a
    bad role or a non-text part is a ValueError naming the message, and a template that cannot compile
    is refused when the engine starts."""
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    llm = LLM(model=str(tiny_model_dir("llama")), block_size=4, num_kv_blocks=64, chat_template=template)
    parts = [{"role": "user", "content": [{"type": "text", "text": "two plus "}, {"type": "text", "text": "two?"}]},
             {"role": "assistant", "content": None}]
    assert llm.engine.apply_chat_template(parts) == "user: two plus \ntwo?\nassistant: \nassistant:"
    named = "{% for m in messages %}{{ m.get('name', m['role']) }}: {{ m['content'] }}\n{% endfor %}"
    llm_named = LLM(model=str(tiny_model_dir("llama")), block_size=4, num_kv_blocks=64, chat_template=named)
    echoed = {"role": "user", "content": "hi", "name": "bob", "refusal": None, "tool_calls": []}   # empty extras pass
    assert llm_named.engine.apply_chat_template([echoed]) == "bob: hi\n"       # the name reaches the template
    for bad, needle in (([{"role": None, "content": "x"}], r"messages\[0\]"),
                        ([{"role": "user", "content": [{"type": "image_url"}]}], "only text parts"),
                        ([{"role": "user", "content": 5}], r"messages\[0\].content"), ([], "non-empty"),
                        (["hi"], r"messages\[0\] must be a message .* got str"),
                        ([{"role": "user", "content": "hi", "foo": 1}], r"messages\[0\]: unsupported field\(s\) 'foo'"),
                        ([{"role": "user", "content": "hi", "foo": ""}], r"unsupported field\(s\) 'foo'"),
                        ([{"role": "user", "content": "hi", "name": 5}], r"messages\[0\].name must be a string"),
                        ([{"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {}}]}],
                         "only text parts"),
                        ([{"role": "user", "content": "hi"}, {"role": "user", "content": "yo", "name": "bob"}],
                         r"messages\[1\].name: this model's chat template does not use")):
        with pytest.raises(ValueError, match=needle):
            llm.chat(bad)
    with pytest.raises(ValueError, match="chat_template is not a valid Jinja template"):
        LLM(model=str(tiny_model_dir("llama")), block_size=4, num_kv_blocks=64, chat_template="{{")


def test_cli_generate_exits_1_when_the_engine_fails_the_request(tiny_model_dir, monkeypatch):
    import eagle_worker.engine as engine_module

    def broken(tokenizer, seq):
        raise RuntimeError("injected output failure")

    monkeypatch.setattr(engine_module, "detokenize_incrementally", broken)
    res = CliRunner().invoke(main, ["generate", "--model", str(tiny_model_dir("llama")), "--prompt", "hi", "--json"])
    assert res.exit_code == 1 and "injected output failure" in res.output, res.output


def test_speculation_sizes_past_their_limits_are_refused_not_run():
    from eagle_worker.speculative.config import SPEC_LIMITS, SpecConfig

    for kwargs, needle in ((dict(lookup="no"), "SpecConfig.lookup must be true or false"),
                           (dict(lookup=True, adaptive="no"), "SpecConfig.adaptive must be true or false"),
                           (dict(lookup=True, lookup_ngram=5), "lookup_ngram must be"),
                           (dict(lookup=True, lookup_ngram=(True, True)), "lookup_ngram must be"),
                           (dict(lookup=True, static_choices="x"), "static_choices must be"),
                           (dict(draft=5), "SpecConfig.draft must be")):
        with pytest.raises(ValueError, match=needle):
            SpecConfig(**kwargs)

    for name, most in SPEC_LIMITS.items():
        SpecConfig(lookup=True, **{name: most})
        for bad in (most + 1, 0, True, 2.0):
            with pytest.raises(ValueError, match=f"SpecConfig.{name} must be an integer from 1 to {most}"):
                SpecConfig(lookup=True, **{name: bad})
    res = CliRunner().invoke(main, ["generate", "--model", "x", "--prompt", "hi", "--num-draft-tokens", "1000000000"])
    assert res.exit_code == 2 and "num_draft_tokens" in res.output, res.output


def test_gemma_fallback_template_matches_gemma_format():
    from jinja2 import Template
    text = Template(GEMMA_TEMPLATE).render(bos_token="<bos>", add_generation_prompt=True, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"}])
    assert text == ("<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello<end_of_turn>\n"
                    "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n")
    alone = Template(GEMMA_TEMPLATE).render(bos_token="<bos>", add_generation_prompt=True,
                                            messages=[{"role": "system", "content": "Be brief."}])
    assert alone == "<bos><start_of_turn>user\nBe brief.<end_of_turn>\n<start_of_turn>model\n"   # never dropped


def test_cli_generate_text_and_json(tiny_model_dir):
    path = str(tiny_model_dir("llama"))
    runner = CliRunner()
    res = runner.invoke(main, ["generate", "--model", path, "--prompt", "The quick", "--max-tokens", "6", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output.strip().splitlines()[-1])
    assert set(out) == {"text", "token_ids", "finish_reason", "error", "metrics"} and out["error"] is None
    llm = LLM(model=path)
    expected = llm.generate("The quick", SamplingParams(max_tokens=6, temperature=0.0))[0]
    assert out["token_ids"] == expected.token_ids and out["text"] == expected.text
    res = runner.invoke(main, ["generate", "--model", path, "--prompt", "The quick", "--max-tokens", "6"])
    assert res.exit_code == 0 and res.output.rstrip("\n").endswith(expected.text.rstrip("\n"))


@pytest.mark.parametrize("args, needle", [
    (["--max-tokens", "0"], "max_tokens"), (["--temperature", "-1"], "temperature"), (["--top-p", "1.5"], "top_p"),
    (["--draft", "none", "--num-draft-tokens", "-7"], "--num-draft-tokens size a draft tree; with --draft none"),
    (["--draft", "none", "--tree", "static"], "--tree size a draft tree"),
])
def test_cli_generate_bad_input_names_the_field(tiny_model_dir, args, needle):
    res = CliRunner().invoke(main, ["generate", "--model", str(tiny_model_dir("llama")), "--prompt", "hi", *args])
    assert res.exit_code == 2 and needle in res.output


def test_cli_generate_unknown_model():
    res = CliRunner().invoke(main, ["generate", "--model", "no-such-model", "--prompt", "hi"])
    assert res.exit_code == 2 and "no-such-model" in res.output


def test_auto_draft_only_picks_heads_shipped_for_builtin_names(tiny_model_dir):
    from eagle_worker.config import EngineConfig
    from eagle_worker.speculative.config import HEADS_DIR, has_builtin_head

    path = str(tiny_model_dir("llama"))            # a model folder is never its own "built-in head"
    assert not has_builtin_head(path) and EngineConfig(model=path).draft is None
    assert EngineConfig(model=path, draft="none").spec is None
    assert has_builtin_head("gemma-3-270m") == (HEADS_DIR / "gemma-3-270m" / "config.json").exists()
