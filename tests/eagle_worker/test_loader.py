"""Checkpoint loading: sharded safetensors (one shard at a time), .bin, GGUF, tied embeddings,
and clear errors for corrupted files and missing / unexpected / misshapen tensors."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import eagle_worker.loader as loader_mod
from eagle_worker.attention import attention_context, causal_context
from eagle_worker.loader import CheckpointError, load_weights, resolve_model_path
from eagle_worker.models.registry import model_class_for

TOKENS = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38]


def tiny_llama(tie: bool = False) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tie,
        architectures=["LlamaForCausalLM"])


def make_reference(config):
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return ref


def build(path_or_config):
    cfg = path_or_config if not isinstance(path_or_config, str) else transformers.AutoConfig.from_pretrained(path_or_config)
    return model_class_for(cfg)(cfg).float().eval()


def assert_same_logits(ours, ref) -> None:
    ids = torch.tensor(TOKENS)
    with torch.no_grad(), attention_context(causal_context([len(TOKENS)], ids.device)):
        got = ours.compute_logits(ours(ids, torch.arange(len(TOKENS))))
        expect = ref(ids[None]).logits[0]
    assert ((got - expect).abs().max() / expect.abs().max()).item() <= 1e-4


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A reference Llama saved as one safetensors file."""
    ref = make_reference(tiny_llama())
    path = tmp_path_factory.mktemp("single")
    ref.save_pretrained(path)
    return ref, path


def test_sharded_safetensors_are_loaded_one_shard_at_a_time(tmp_path, monkeypatch):
    ref = make_reference(tiny_llama())
    ref.save_pretrained(tmp_path, max_shard_size="20KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2

    opened, active = [], []
    real = loader_mod.safetensors_tensors

    def tracking(file):
        assert not active, f"{file} opened while {active[0]} is still being read"
        active.append(file.name)
        opened.append(file.name)
        yield from real(file)
        active.pop()

    monkeypatch.setattr(loader_mod, "safetensors_tensors", tracking)
    ours = build(str(tmp_path))
    load_weights(ours, tmp_path)
    assert opened == shards
    assert_same_logits(ours, ref)


def test_index_naming_a_missing_shard(tmp_path):
    ref = make_reference(tiny_llama())
    ref.save_pretrained(tmp_path, max_shard_size="20KB")
    victim = sorted(tmp_path.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=victim.name):
        load_weights(build(str(tmp_path)), tmp_path)


def test_pytorch_bin(tmp_path, saved):
    ref, src = saved
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    torch.save(ref.state_dict(), tmp_path / "pytorch_model.bin")
    ours = build(str(tmp_path))
    load_weights(ours, tmp_path)
    assert_same_logits(ours, ref)


def test_tied_embeddings_without_lm_head_in_checkpoint(tmp_path):
    ref = make_reference(tiny_llama(tie=True))
    ref.save_pretrained(tmp_path)
    names = set(load_file(tmp_path / "model.safetensors"))
    assert "lm_head.weight" not in names
    ours = build(str(tmp_path))
    load_weights(ours, tmp_path)
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    assert_same_logits(ours, ref)


@pytest.mark.parametrize("damage", ["truncate", "garbage_header"])
def test_corrupted_safetensors_names_the_file(tmp_path, saved, damage):
    _, src = saved
    data = (src / "model.safetensors").read_bytes()
    bad = tmp_path / "model.safetensors"
    bad.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\xff" * 64 + data[64:])
    with pytest.raises(CheckpointError, match="model.safetensors") as e:
        load_weights(build(str(src)), tmp_path)
    assert str(tmp_path) in str(e.value)


def _rewrite(src, dst, edit):
    state = load_file(src / "model.safetensors")
    edit(state)
    save_file(state, dst / "model.safetensors", metadata={"format": "pt"})


def test_missing_tensor_is_named(tmp_path, saved):
    _, src = saved
    _rewrite(src, tmp_path, lambda s: s.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight"):
        load_weights(build(str(src)), tmp_path)


def test_missing_plain_tensor_is_named(tmp_path, saved):
    _, src = saved
    _rewrite(src, tmp_path, lambda s: s.pop("model.norm.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensors: model\.norm\.weight"):
        load_weights(build(str(src)), tmp_path)


def test_unexpected_tensor_is_named(tmp_path, saved):
    _, src = saved
    _rewrite(src, tmp_path, lambda s: s.__setitem__("model.layers.0.mlp.extra.weight", torch.zeros(2)))
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.extra\.weight.*model\.safetensors"):
        load_weights(build(str(src)), tmp_path)


def test_shape_mismatch_names_tensor_and_file(tmp_path, saved):
    _, src = saved

    def shrink(s):
        s["model.layers.0.mlp.up_proj.weight"] = s["model.layers.0.mlp.up_proj.weight"][:1]

    _rewrite(src, tmp_path, shrink)
    with pytest.raises(CheckpointError, match=r"up_proj\.weight.*model\.safetensors.*shape mismatch"):
        load_weights(build(str(src)), tmp_path)


def test_gguf_llama_unpermutes_q_and_k(tmp_path):
    """A float32 llama GGUF written the llama.cpp way (q/k rows permuted) loads back exactly."""
    gguf = pytest.importorskip("gguf")
    cfg = tiny_llama()
    ref = make_reference(cfg)
    sd = {k: v.numpy() for k, v in ref.state_dict().items()}

    def permute(w, n_head):  # llama.cpp convert_hf_to_gguf.py LlamaModel.permute
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    writer = gguf.GGUFWriter(str(tmp_path / "tiny.gguf"), "llama")
    writer.add_name("tiny")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    writer.add_tensor("output_norm.weight", sd["model.norm.weight"])
    writer.add_tensor("output.weight", sd["lm_head.weight"])
    gguf_names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
                  "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                  "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                  "mlp.down_proj": "ffn_down"}
    for i in range(cfg.num_hidden_layers):
        for hf, gg in gguf_names.items():
            w = sd[f"model.layers.{i}.{hf}.weight"]
            if gg == "attn_q":
                w = permute(w, cfg.num_attention_heads)
            elif gg == "attn_k":
                w = permute(w, cfg.num_key_value_heads)
            writer.add_tensor(f"blk.{i}.{gg}.weight", np.ascontiguousarray(w))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    ours = build(cfg)
    load_weights(ours, tmp_path / "tiny.gguf")
    assert_same_logits(ours, ref)


def test_resolve_model_path(tmp_path, monkeypatch):
    assert resolve_model_path(str(tmp_path)) == str(tmp_path)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("EAGLE_ALLOW_DOWNLOAD", raising=False)
    with pytest.raises(ValueError, match="no-such-org/no-such-model.*EAGLE_ALLOW_DOWNLOAD") as ei:
        resolve_model_path("no-such-org/no-such-model")
    assert "local_files_only" not in str(ei.value)     # the hub's advice, which a user here cannot follow
    with pytest.raises(ValueError, match="does-not-exist"):
        resolve_model_path(str(tmp_path / "does-not-exist"))


def test_unsupported_architecture_is_named():
    cfg = transformers.GPT2Config(architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        model_class_for(cfg)
