"""The built-in `gemma-3-270m`: materialised from the packaged GGUF into an HF folder.

The first run builds the cache (the concurrency test builds a second copy into a temp dir), loads
the GGUF directly once more for the reference logits, and runs a short greedy generation: minutes
on a small CPU, less with a warm cache (the slow tier; the fixtures print how long each part took).
"""
from __future__ import annotations

import filecmp
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from eagle_worker import default_models

NAME = "gemma-3-270m"
REPO_ROOT = Path(__file__).resolve().parents[2]


def test_registry():
    assert default_models.builtin_names() == [NAME]
    assert default_models.is_builtin(NAME)
    for other in ("google/gemma-3-270m", "gemma-3-270M", "gemma-3-1b", "", None):
        assert not default_models.is_builtin(other)
    with pytest.raises(ValueError, match="not a built-in model"):
        default_models.materialize("google/gemma-3-270m")


def test_cache_root_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv("EAGLE_CACHE_DIR", str(tmp_path))
    assert default_models.model_dir(NAME) == tmp_path / NAME
    monkeypatch.delenv("EAGLE_CACHE_DIR")
    assert default_models.model_dir(NAME) == Path.home() / ".cache" / "eagle-serve" / "models" / NAME


def test_incomplete_folder_is_not_complete(tmp_path):
    folder = tmp_path / NAME
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"")
    assert not default_models._is_complete(folder)  # no manifest: a half-built or foreign folder
    (folder / default_models.MANIFEST).write_text(json.dumps({"format_version": -1}))
    assert not default_models._is_complete(folder)  # an older build format


# ---------------------------------------------------------------------------------------------
# Real model (slow)
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def model_dir(default_model_dir) -> Path:
    return default_model_dir  # tests/conftest.py; using it marks a test slow


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="session")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def gguf_file(tmp_path_factory) -> Path:
    return default_models.assemble_gguf(NAME, tmp_path_factory.mktemp("gguf"))


@pytest.fixture(scope="session")
def gguf_reader(gguf_file):
    from gguf import GGUFReader

    # parsing the 262k-token vocabulary is slow: once a session, over a plain array (the same
    # values as gguf's own reader gives: test_plain_array_reader_reads_what_gguf_reads)
    return default_models._plain_array_reader(GGUFReader)(str(gguf_file))


@pytest.fixture(scope="session")
def gguf_model(gguf_file, gguf_reader):
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    with default_models._shared_gguf_reader(gguf_file, gguf_reader):  # parse once, not twice
        m = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32)
    print(f"\nloading the GGUF directly took {time.perf_counter() - t0:.1f}s")
    return m.eval()


def test_plain_array_reader_reads_what_gguf_reads(tmp_path):
    """The build's GGUF reader (gguf's, over a plain ndarray instead of a memmap) gives every field
    and tensor gguf's own reader gives: strings, string and number arrays, scalars, quantized and
    float tensors."""
    import gguf
    import numpy as np

    path = tmp_path / "small.gguf"
    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_block_count(2)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("llama")
    writer.add_token_list([f"tok{i}" for i in range(300)] + ["▁日本", "🤖", ""])
    writer.add_token_scores([float(-i) for i in range(303)])
    writer.add_token_types([1] * 303)
    writer.add_bool("test.flag", True)
    rng = np.random.default_rng(0)
    writer.add_tensor("norm.weight", rng.standard_normal(64).astype(np.float32))
    q8 = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("blk.0.q8.weight", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    ours, theirs = default_models._plain_array_reader(gguf.GGUFReader)(str(path)), gguf.GGUFReader(str(path))
    assert ours.fields.keys() == theirs.fields.keys() and "tokenizer.ggml.tokens" in ours.fields
    for key, field in theirs.fields.items():
        got = ours.fields[key]
        assert (got.data, got.types, got.offset) == (field.data, field.types, field.offset), key
        assert len(got.parts) == len(field.parts) and all(np.array_equal(a, b) for a, b in zip(got.parts, field.parts)), key
    tokens = ours.fields["tokenizer.ggml.tokens"]
    assert [bytes(tokens.parts[i]).decode() for i in tokens.data[-3:]] == ["▁日本", "🤖", ""]
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors] == ["norm.weight", "blk.0.q8.weight"]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert a.tensor_type == b.tensor_type and np.array_equal(a.data, b.data)
        assert np.array_equal(gguf.quants.dequantize(a.data, a.tensor_type), gguf.quants.dequantize(b.data, b.tensor_type))
    assert type(ours.tensors[0].data) is np.ndarray    # the point: no memmap subclass to slice through


def test_folder_layout_and_config(model_dir):
    from transformers import AutoConfig, GenerationConfig

    files = {p.name for p in model_dir.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json", default_models.MANIFEST} <= files
    assert not any(f.endswith(".gguf") or f.startswith(".") for f in files), files
    assert not list(model_dir.parent.glob(f".{NAME}.tmp-*"))

    cfg = AutoConfig.from_pretrained(model_dir)
    assert cfg.architectures == ["Gemma3ForCausalLM"]
    assert cfg.model_type == "gemma3_text"
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers) == (262144, 640, 18)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 1, 256)
    assert cfg.intermediate_size == 2048 and cfg.sliding_window == 512
    assert cfg.layer_types.count("full_attention") == 3 and cfg.layer_types[5] == "full_attention"
    assert cfg.tie_word_embeddings
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (2, 1, 0)
    gen = GenerationConfig.from_pretrained(model_dir)
    assert gen.bos_token_id == 2 and gen.eos_token_id == [1, 106]

    manifest = json.loads((model_dir / default_models.MANIFEST).read_text())
    assert manifest["has_chat_template"] is False and manifest["tokenizer_adds_bos"] is True
    print(f"\nbuild timings (s): {manifest['build_seconds']}")

    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        assert {f.get_slice(k).get_dtype() for k in keys} == {"F32"}
    assert "model.embed_tokens.weight" in keys and "model.layers.17.mlp.down_proj.weight" in keys
    assert len(keys) == 236  # lm_head is tied to the embedding, not stored


def test_tokenizer_round_trip(model_dir, tokenizer):
    assert tokenizer.bos_token_id == 2 and tokenizer.eos_token_id == 1 and tokenizer.pad_token_id == 0
    assert len(tokenizer) == 262144
    for s in ["Hello world", "The capital of France is", "héllo wörld — naïve café",
              "日本語のテキスト、中文、한국어", "emoji 🤖👍🏽 👨‍👩‍👧 🇫🇷", "  two spaces\n\ttab\n\n",
              "def f(x):\n    return x ** 2"]:
        ids = tokenizer(s).input_ids
        assert ids[0] == tokenizer.bos_token_id, "Gemma needs BOS; the tokenizer must add it"
        assert ids.count(tokenizer.bos_token_id) == 1 and tokenizer.eos_token_id not in ids
        assert tokenizer.decode(ids, skip_special_tokens=True) == s
        assert tokenizer.decode(ids[1:]) == s
    assert tokenizer("Hello world").input_ids == [2, 9259, 1902]
    # Gemma's turn markers are single special tokens; there is no chat template (the GGUF has none)
    assert tokenizer("<start_of_turn>user\nhi<end_of_turn>", add_special_tokens=False).input_ids[0] == 105
    assert tokenizer.convert_tokens_to_ids(["<start_of_turn>", "<end_of_turn>"]) == [105, 106]
    assert not tokenizer.chat_template
    assert "chat_template" not in json.loads((model_dir / "tokenizer_config.json").read_text())
    assert not (model_dir / "chat_template.jinja").exists()


def test_norm_weights_are_gguf_minus_one(model_dir, gguf_reader):
    """llama.cpp stores Gemma RMSNorm weights as w+1; the folder must hold w."""
    import numpy as np
    from safetensors import safe_open

    raw = {t.name: np.array(t.data, dtype=np.float32) for t in gguf_reader.tensors if t.name.endswith("norm.weight")}
    pairs = {"output_norm.weight": "model.norm.weight"}
    for i in (0, 5, 17):
        pairs.update({
            f"blk.{i}.attn_norm.weight": f"model.layers.{i}.input_layernorm.weight",
            f"blk.{i}.post_attention_norm.weight": f"model.layers.{i}.post_attention_layernorm.weight",
            f"blk.{i}.ffn_norm.weight": f"model.layers.{i}.pre_feedforward_layernorm.weight",
            f"blk.{i}.post_ffw_norm.weight": f"model.layers.{i}.post_feedforward_layernorm.weight",
            f"blk.{i}.attn_q_norm.weight": f"model.layers.{i}.self_attn.q_norm.weight",
            f"blk.{i}.attn_k_norm.weight": f"model.layers.{i}.self_attn.k_norm.weight",
        })
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        for g, h in pairs.items():
            torch.testing.assert_close(f.get_tensor(h), torch.from_numpy(raw[g]) - 1.0, rtol=0, atol=0)
    assert len(raw) == 1 + 18 * 6


def test_logits_match_gguf_loaded_directly(tokenizer, hf_model, gguf_model):
    enc = tokenizer(["The capital of France is", "Speculative decoding 🤖 verifies draft tokens"],
                    return_tensors="pt", padding=True)
    with torch.no_grad():
        a = hf_model(**enc).logits
        b = gguf_model(**enc).logits
    mask = enc.attention_mask.bool()
    a, b = a[mask], b[mask]
    rel = ((a - b).abs().max() / b.abs().max()).item()
    assert rel <= 1e-4, rel
    sd_hf, sd_gguf = hf_model.state_dict(), gguf_model.state_dict()
    assert sd_hf.keys() == sd_gguf.keys()
    for k in sd_hf:
        assert torch.equal(sd_hf[k], sd_gguf[k]), k


def _greedy(tokenizer, model, prompt: str, n: int) -> str:
    enc = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**enc, do_sample=False, max_new_tokens=n)
    return tokenizer.decode(out[0, enc.input_ids.shape[1]:], skip_special_tokens=True)


def test_greedy_generation_is_sensible_and_deterministic(tokenizer, hf_model):
    # a 270M base model quantized to 4 bits: "The capital of France is" -> " the capital of the
    # country of France. It is the largest city in France ..." (no "Paris"); easier prompts:
    text = _greedy(tokenizer, hf_model, "The capital of France is", 12)
    assert text == _greedy(tokenizer, hf_model, "The capital of France is", 12)
    print(f"\ngreedy continuation: {text!r}")
    assert "France" in text, text
    assert _greedy(tokenizer, hf_model, "The Eiffel Tower is located in the city of", 3).startswith(" Paris")
    assert _greedy(tokenizer, hf_model, "1, 2, 3, 4, 5,", 10).startswith(" 6, 7, 8")
    assert _greedy(tokenizer, hf_model, "Monday, Tuesday, Wednesday,", 6).startswith(" Thursday, Friday")


def test_second_call_is_fast_and_same(model_dir):
    t0 = time.perf_counter()
    again = default_models.materialize(NAME)
    dt = time.perf_counter() - t0
    assert again == model_dir
    assert dt < 0.5, dt


_CHILD = textwrap.dedent("""
    import json, logging, sys, time
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    from eagle_worker import default_models
    t0 = time.perf_counter()
    path = default_models.materialize(sys.argv[1])
    print(json.dumps({"path": str(path), "seconds": time.perf_counter() - t0}))
""")


def _unstamped(path: Path) -> dict:
    config = json.loads(path.read_text())
    config.pop("transformers_version", None)
    return config




def test_concurrent_materialize_into_empty_cache(tmp_path, model_dir):
    cache = tmp_path / "cache"
    cache.mkdir()
    # debris of a crashed build: an orphaned temp folder and a half-written final folder
    (cache / f".{NAME}.tmp-99999-dead").mkdir()
    (cache / f".{NAME}.tmp-99999-dead" / "model.safetensors").write_bytes(b"partial")
    (cache / NAME).mkdir()
    (cache / NAME / "config.json").write_text("{}")

    env = {**os.environ, "EAGLE_CACHE_DIR": str(cache), "PYTHONPATH": str(REPO_ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", _CHILD, NAME], env=env, cwd=REPO_ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=900)
        assert p.returncode == 0, err[-3000:]
        results.append((json.loads(out.strip().splitlines()[-1]), err))
    paths = {r["path"] for r, _ in results}
    assert paths == {str(cache / NAME)}
    builds = sum("building" in err for _, err in results)
    assert builds == 1, [err[-2000:] for _, err in results]
    print(f"\nconcurrent materialize: {[round(r['seconds'], 1) for r, _ in results]} s")

    built = cache / NAME
    assert default_models._is_complete(built)
    assert sorted(p.name for p in cache.iterdir()) == [f".{NAME}.lock", NAME]
    # the same content as the session's folder: the build is deterministic (the configs carry the
    # transformers version that wrote them, which differs when the session's cache is older)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        assert (built / f).read_bytes() == (model_dir / f).read_bytes(), f
    for f in ("config.json", "generation_config.json"):
        assert _unstamped(built / f) == _unstamped(model_dir / f), f
    assert filecmp.cmp(built / "model.safetensors", model_dir / "model.safetensors", shallow=False)   # byte for byte
