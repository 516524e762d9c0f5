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


def test_gemma_fallback_template_matches_gemma_format():
    from jinja2 import Template
    text = Template(GEMMA_TEMPLATE).render(bos_token="<bos>", add_generation_prompt=True, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"}])
    assert text == ("<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello<end_of_turn>\n"
                    "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n")


def test_cli_generate_text_and_json(tiny_model_dir):
    path = str(tiny_model_dir("llama"))
    runner = CliRunner()
    res = runner.invoke(main, ["generate", "--model", path, "--prompt", "The quick", "--max-tokens", "6", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output.strip().splitlines()[-1])
    assert set(out) == {"text", "token_ids", "finish_reason", "metrics"}
    llm = LLM(model=path)
    expected = llm.generate("The quick", SamplingParams(max_tokens=6, temperature=0.0))[0]
    assert out["token_ids"] == expected.token_ids and out["text"] == expected.text
    res = runner.invoke(main, ["generate", "--model", path, "--prompt", "The quick", "--max-tokens", "6"])
    assert res.exit_code == 0 and res.output.rstrip("\n").endswith(expected.text.rstrip("\n"))


@pytest.mark.parametrize("args, needle", [
    (["--max-tokens", "0"], "max_tokens"), (["--temperature", "-1"], "temperature"), (["--top-p", "1.5"], "top_p"),
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
