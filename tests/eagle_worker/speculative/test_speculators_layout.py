"""Draft heads in the `speculators` layout (Red Hat / Neural Magic; what vLLM reads when config.json
has `speculators_model_type`): the same head written in our (EAGLE-official) layout and rewritten
the way speculators stores it loads to the same head (same hidden states, logits and draft ids),
speculates losslessly in the engine, and what our heads cannot run is refused by name."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle_worker import LLM, SamplingParams
from eagle_worker.attention import attention_context, causal_context
from eagle_worker.speculative.config import SpecConfig
from eagle_worker.speculative.head_init import new_head
from eagle_worker.speculative.head_loader import load_draft_head
from eagle_worker.speculative.head_saver import save_draft_head
from tests.conftest import assert_no_leaks

PROMPTS = ["The quick brown fox", "Question: what is two plus two?\nAnswer:", "def add(a, b):\n", "x"]
LAYER_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
              "rms_norm_eps", "rope_theta", "rope_scaling", "max_position_embeddings", "vocab_size", "hidden_act")


def to_speculators(src: Path, dst: Path, target, *, nbr: bool | None = False, **top) -> Path:
    """Rewrite a head saved in our layout as speculators saves it: LlamaConfig settings nested in
    transformer_layer_config, speculators_config block, speculators tensor names. `nbr=None` leaves
    norm_before_residual out of the config; `top` adds or overrides top-level fields."""
    cfg = json.loads((src / "config.json").read_text())
    sd = load_file(str(src / "model.safetensors"))
    eagle3 = cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    stype = "eagle3" if eagle3 else "eagle"
    layer = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 1,
             "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
             **{k: cfg[k] for k in LAYER_KEYS}}
    out = {"speculators_model_type": stype, "speculators_version": "0.2.0", "torch_dtype": "float32",
           "transformer_layer_config": layer,
           "speculators_config": {"algorithm": stype, "default_proposal_method": "greedy",
                                  "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3,
                                                        "accept_tolerance": 0.0, "verifier_accept_k": 1}],
                                  "verifier": {"architectures": ["LlamaForCausalLM"], "name_or_path": "tiny"}}}
    emb = target.model.embed_tokens.weight.detach().clone()
    if eagle3:
        out.update(architectures=["Eagle3Speculator"], draft_vocab_size=cfg["draft_vocab_size"],
                   target_hidden_size=None)
        if nbr is not None:
            out["norm_before_residual"] = nbr
        if "eagle_aux_hidden_state_layer_ids" in cfg:
            out["eagle_aux_hidden_state_layer_ids"] = cfg["eagle_aux_hidden_state_layer_ids"]
        tensors = {k.replace("midlayer.", "layers.0."): v for k, v in sd.items()}
        tensors["embed_tokens.weight"] = emb          # speculators stores the verifier's (frozen) table
        tensors["verifier_norm.weight"] = torch.ones(cfg["hidden_size"])            # training-only copies
        tensors["verifier_lm_head.weight"] = torch.zeros(cfg["draft_vocab_size"], cfg["hidden_size"])
    else:
        out.update(architectures=["EagleSpeculator", "LlamaDecoderLayer"], transformer_layer_architecture="LlamaDecoderLayer",
                   layernorms=False, fusion_bias="fc.bias" in sd)
        tensors = {k.replace("layers.0.", "transformer.").replace("fc.", "fusion_fc."): v for k, v in sd.items()}
    out.update(top)
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(json.dumps(out, indent=2))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"))
    return dst


def rewrite(folder: Path, cfg_fn=None, sd_fn=None) -> Path:
    if cfg_fn:
        cfg = json.loads((folder / "config.json").read_text())
        cfg_fn(cfg)
        (folder / "config.json").write_text(json.dumps(cfg))
    if sd_fn:
        sd = load_file(str(folder / "model.safetensors"))
        sd_fn(sd)
        save_file(sd, str(folder / "model.safetensors"))
    return folder


def our_head(llm: LLM, kind: str, path: Path, *, fc_bias: bool = True, aux=None, rope=None) -> Path:
    """A random head (sharp weights, norms ~1) saved in our layout, optionally edited on disk."""
    runner = llm.engine.runner
    vocab = torch.arange(0, runner.model.vocab_size, 3) if kind == "eagle3" else None
    head = new_head(kind, runner.model, runner.hf_config, vocab, std=0.2)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if "norm" in name or name.endswith("bias"):   # not all ones / zeros: a dropped tensor shows
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.1)
    save_draft_head(head, path)

    def edit(cfg):
        if aux is not None:
            cfg["eagle_aux_hidden_state_layer_ids"] = list(aux)
            cfg.pop("eagle_config", None)
        if rope is not None:
            cfg.update(rope)
        if not fc_bias:
            cfg["bias"] = False
    return rewrite(path, edit, None if fc_bias else (lambda sd: sd.pop("fc.bias")))


def run_head(head, feats, ids, pos):
    with torch.no_grad(), attention_context(causal_context([len(ids)], torch.device("cpu"))):
        return head(feats, ids, pos)


def outputs(head, n: int = 9, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, head.config.vocab_size, (n,), generator=g)
    feats = torch.randn(n, head.feature_size, generator=g)
    pos = torch.arange(n) + 70                   # past the llama3 rope's original context (64)
    hid = run_head(head, feats, ids, pos)
    out = {"hidden": hid, "logits": head.logits(hid)}
    if head.kind == "eagle3":                    # later steps feed back the head's own output
        out["hidden2"] = run_head(head, hid, ids, pos + 1)
        out["target_ids"] = head.to_target_ids(torch.arange(head.config.draft_vocab_size))
    return out


def assert_same_head(a, b):
    assert type(a) is type(b)
    ca, cb = dict(vars(a.config)), dict(vars(b.config))
    ca.pop("raw"), cb.pop("raw")
    assert ca == cb
    oa, ob = outputs(a), outputs(b)
    for k in oa:
        assert torch.equal(oa[k], ob[k]), k


@pytest.fixture(scope="module")
def plain_llms(tiny_model_dir):
    cache = {}

    def get(family):
        if family not in cache:
            cache[family] = LLM(model=str(tiny_model_dir(family)), block_size=4, num_kv_blocks=256, draft=None)
        return cache[family]
    return get


def load(llm: LLM, path: Path):
    runner = llm.engine.runner
    return load_draft_head(path, runner.model, runner.hf_config)


LLAMA31_ROPE = {"rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}


# ------------------------------------------------------------------------------ equivalence

@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gemma3"])
def test_eagle3_speculator_equals_the_same_head_in_our_layout(family, plain_llms, tmp_path):
    llm = plain_llms(family)
    ours = our_head(llm, "eagle3", tmp_path / "ours", aux=[0, 1, 3], rope=LLAMA31_ROPE if family == "llama" else None)
    spec = to_speculators(ours, tmp_path / "spec", llm.engine.runner.model)
    a, b = load(llm, ours), load(llm, spec)
    assert b.aux_layers == (0, 1, 3)
    assert b.config.draft_vocab_size < b.config.vocab_size and not b.config.lm_head_from_target
    assert not b.config.own_embedding                 # the stored table equals the target's: shared
    if family == "llama":
        assert b.config.rope_theta == 500000.0 and b.config.rope_scaling["rope_type"] == "llama3"
    assert_same_head(a, b)


def test_eagle3_speculator_norm_before_residual_follows_vllm(plain_llms, tmp_path):
    """Absent -> true (how vLLM reads speculators configs); true differs from false (the negative
    control: outputs() tells two heads apart) and equals our layout with the flag set."""
    llm = plain_llms("llama")
    ours = our_head(llm, "eagle3", tmp_path / "ours")
    target = llm.engine.runner.model
    off = load(llm, to_speculators(ours, tmp_path / "off", target, nbr=False))
    absent = load(llm, to_speculators(ours, tmp_path / "absent", target, nbr=None))
    assert not off.config.norm_before_residual and absent.config.norm_before_residual
    assert not torch.equal(outputs(off)["hidden"], outputs(absent)["hidden"])
    ours_on = rewrite(ours, lambda c: c.update(norm_before_residual=True))
    assert_same_head(load(llm, ours_on), absent)


@pytest.mark.parametrize("fusion_bias", [True, False])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_eagle_speculator_equals_the_same_head_in_our_layout(family, fusion_bias, plain_llms, tmp_path):
    llm = plain_llms(family)
    ours = our_head(llm, "eagle", tmp_path / "ours", fc_bias=fusion_bias)
    spec = to_speculators(ours, tmp_path / "spec", llm.engine.runner.model)
    b = load(llm, spec)
    assert b.kind == "eagle" and b.config.fc_bias == fusion_bias and (b.fc.bias is not None) == fusion_bias
    assert_same_head(load(llm, ours), b)
    # a stored copy of the verifier's lm_head (the head logits through the target's) is accepted
    lm = llm.engine.runner.model.lm_head.weight.detach().clone()
    assert_same_head(load(llm, rewrite(spec, sd_fn=lambda sd: sd.update({"lm_head.weight": lm}))), b)


def test_eagle_speculator_fusion_bias_promised_but_missing_is_refused(plain_llms, tmp_path):
    llm = plain_llms("llama")
    spec = to_speculators(our_head(llm, "eagle", tmp_path / "ours", fc_bias=False), tmp_path / "s",
                          llm.engine.runner.model, fusion_bias=True)
    with pytest.raises(ValueError, match=r"missing tensor.*fc\.bias"):
        load(llm, spec)


# ------------------------------------------------------------------------------ in the engine

def test_greedy_with_speculators_eagle3_head_equals_plain_and_our_layout(plain_llms, tiny_model_dir, tmp_path):
    llm = plain_llms("llama")
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    expected = [o.token_ids for o in llm.generate(PROMPTS, params)]
    ours = our_head(llm, "eagle3", tmp_path / "ours", aux=[0, 1, 3])
    spec_dir = to_speculators(ours, tmp_path / "spec", llm.engine.runner.model)
    stats = {}
    for name, head in (("ours", ours), ("speculators", spec_dir)):
        spec = LLM(model=str(tiny_model_dir("llama")), block_size=4, num_kv_blocks=256,
                   spec=SpecConfig(draft=str(head), lookup=False, depth=3, top_k=3, num_draft_tokens=5, adaptive=False))
        assert [o.token_ids for o in spec.generate(PROMPTS, params)] == expected
        stats[name] = spec.engine.stats()
        assert stats[name]["spec_steps"] > 0
        assert_no_leaks(spec.engine)
    # the same head drafts the same trees: identical acceptance, step for step
    for k in ("spec_steps", "acceptance_rate_per_depth"):
        assert stats["ours"][k] == stats["speculators"][k], k


def test_accepting_head_in_speculators_layout_is_lossless_and_accepts(copying_target, tmp_path):
    """The copying EAGLE-1 head (fc bias -> fusion_bias) rewritten as an EagleSpeculator: greedy
    output is plain decoding's and it still accepts (a mangled load would not)."""
    target, head = copying_target
    plain = LLM(model=str(target), block_size=4, num_kv_blocks=512, draft=None)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    expected = [o.token_ids for o in plain.generate(PROMPTS, params)]
    spec_dir = to_speculators(head, tmp_path / "spec", plain.engine.runner.model)
    assert json.loads((spec_dir / "config.json").read_text())["fusion_bias"] is True
    spec = LLM(model=str(target), block_size=4, num_kv_blocks=512,
               spec=SpecConfig(draft=str(spec_dir), lookup=False, adaptive=False))
    outs = spec.generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == expected
    assert min(o.metrics["mean_accepted_tokens"] for o in outs) > 2.0
    assert_no_leaks(spec.engine)


# ------------------------------------------------------------------------------ refusals

@pytest.fixture
def eagle3_spec(plain_llms, tmp_path):
    llm = plain_llms("llama")
    ours = our_head(llm, "eagle3", tmp_path / "ours")
    return llm, ours, to_speculators(ours, tmp_path / "spec", llm.engine.runner.model)


def _layer(cfg, **kw):
    cfg["transformer_layer_config"].update(kw)


def test_multi_layer_heads_are_refused(eagle3_spec):
    llm, ours, spec = eagle3_spec
    with pytest.raises(ValueError, match=r"multi-layer heads are not supported \(num_hidden_layers=2"):
        load(llm, rewrite(spec, lambda c: _layer(c, num_hidden_layers=2)))
    rewrite(spec, lambda c: _layer(c, num_hidden_layers=1),
            lambda sd: sd.update({k.replace("layers.0.", "layers.1."): v.clone() for k, v in sd.items()
                                    if k.startswith("layers.0.")}))
    with pytest.raises(ValueError, match=r"multi-layer heads are not supported.*layers \['1'\]"):
        load(llm, spec)
    # the same in our (vLLM-named) layout
    with pytest.raises(ValueError, match=r"multi-layer heads are not supported \(num_hidden_layers=3"):
        load(llm, rewrite(ours, lambda c: c.update(num_hidden_layers=3)))


@pytest.mark.parametrize("key", ["rope_type", "type"])
def test_yarn_rope_is_refused(eagle3_spec, key):
    llm, ours, spec = eagle3_spec
    yarn = {key: "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    with pytest.raises(ValueError, match="yarn rope scaling is not supported for draft heads"):
        load(llm, rewrite(spec, lambda c: _layer(c, rope_scaling=yarn)))
    with pytest.raises(ValueError, match="yarn rope scaling is not supported for draft heads"):
        load(llm, rewrite(ours, lambda c: c.update(rope_scaling=yarn)))


def test_hass_layernorms_are_refused(plain_llms, tmp_path):
    llm = plain_llms("llama")
    h = llm.engine.runner.model.hidden_size
    spec = to_speculators(our_head(llm, "eagle", tmp_path / "ours"), tmp_path / "spec", llm.engine.runner.model)
    with pytest.raises(ValueError, match=r"`layernorms: true` \(HASS extra norms .*is not supported"):
        load(llm, rewrite(spec, lambda c: c.update(layernorms=True)))
    rewrite(spec, lambda c: c.update(layernorms=False),
            lambda sd: sd.update({"embedding_layernorm.weight": torch.ones(h), "pre_lm_head_layernorm.weight": torch.ones(h)}))
    with pytest.raises(ValueError, match=r"layernorms.*found \['embedding_layernorm\.weight', 'pre_lm_head_layernorm"):
        load(llm, spec)


def test_other_unsupported_speculators_heads_are_refused(eagle3_spec, plain_llms, tmp_path):
    llm, ours, spec = eagle3_spec
    h = llm.engine.runner.model.hidden_size
    with pytest.raises(ValueError, match=r"speculators_model_type 'mlp' is not supported \(eagle, eagle3\)"):
        load(llm, rewrite(spec, lambda c: c.update(speculators_model_type="mlp")))
    rewrite(spec, lambda c: c.update(speculators_model_type="eagle3"))
    with pytest.raises(ValueError, match="norm_before_fc .* is not supported"):
        load(llm, rewrite(spec, lambda c: c.update(norm_before_fc=True),
                          lambda sd: sd.update({"input_norm.weight": torch.ones(3 * h)})))
    rewrite(spec, lambda c: c.update(norm_before_fc=False), lambda sd: sd.pop("input_norm.weight"))
    with pytest.raises(ValueError, match="target_hidden_size 128 != the head's hidden_size 64 is not supported"):
        load(llm, rewrite(spec, lambda c: c.update(target_hidden_size=128)))
    rewrite(spec, lambda c: c.update(target_hidden_size=h))
    load(llm, spec)                                              # equal sizes are fine
    with pytest.raises(ValueError, match="norm_output .* is not supported"):
        load(llm, rewrite(spec, lambda c: c.update(norm_output=True)))
    load(llm, rewrite(spec, lambda c: c.update(norm_output=False)))
    with pytest.raises(ValueError, match="q_norm/k_norm .* is not supported"):
        load(llm, rewrite(spec, sd_fn=lambda sd: sd.update({"layers.0.self_attn.q_norm.weight": torch.ones(16)})))
    # EAGLE-1 with its own lm_head: our EAGLE-1 head logits through the target's
    eagle = to_speculators(our_head(llm, "eagle", tmp_path / "e"), tmp_path / "es", llm.engine.runner.model)
    lm = llm.engine.runner.model.lm_head.weight.detach().clone() + 0.05
    with pytest.raises(ValueError, match="own lm_head .* is not supported"):
        load(llm, rewrite(eagle, sd_fn=lambda sd: sd.update({"lm_head.weight": lm})))
