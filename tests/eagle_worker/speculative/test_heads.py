"""Draft heads from synthetic checkpoints laid out exactly like the published ones (key names,
config fields, dtypes), scaled down to a tiny target; forward checked against a plain-torch
re-implementation written from the published architecture, not from our modules."""
from __future__ import annotations

import json
import math
import os

import pytest
import torch
import transformers

from eagle_worker.attention import SeqAttention, attention_context, build_context, causal_context
from eagle_worker.models.registry import model_class_for
from eagle_worker.speculative.head_loader import load_draft_head
from eagle_worker.speculative.head_saver import save_draft_head
from eagle_worker.speculative.heads import Eagle1Head, Eagle3Head

V, H, L, DRAFT_V = 128, 64, 8, 48


def make_target(family: str = "llama", hidden: int = H, seed: int = 0):
    if family == "qwen2":
        cfg = transformers.Qwen2Config(vocab_size=V, hidden_size=hidden, intermediate_size=96, num_hidden_layers=L,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                       architectures=["Qwen2ForCausalLM"])
    else:
        cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=hidden, intermediate_size=96, num_hidden_layers=L,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                       tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
    model = model_class_for(cfg)(cfg).float().eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if "embed" in name else 0.08) + (1.0 if "norm" in name else 0.0))
    return model, cfg


def rnd(g, *shape, dtype=torch.float32, scale=0.08):
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


# Published config.json files, with the sizes scaled down (H 4096 -> 64, V -> 128, ...).
def cfg_llama2_chat_7b():   # yuhuili/EAGLE-llama2-chat-7B: MHA, no `bias` key (fc bias on), fp32 weights
    return {"architectures": ["LlamaForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
            "hidden_size": H, "initializer_range": 0.02, "intermediate_size": 112, "max_position_embeddings": 4096,
            "model_type": "llama", "num_attention_heads": 4, "num_hidden_layers": 1, "num_key_value_heads": 4,
            "pretraining_tp": 1, "rms_norm_eps": 1e-06, "rope_scaling": None, "tie_word_embeddings": False,
            "torch_dtype": "float16", "transformers_version": "4.32.0.dev0", "use_cache": True, "vocab_size": V}


def cfg_llama3_instruct_8b():   # yuhuili/EAGLE-LLaMA3-Instruct-8B: GQA, rope 500000, "bias": false
    return {"architectures": ["LlamaForCausalLM"], "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu",
            "hidden_size": H, "initializer_range": 0.02, "intermediate_size": 112, "max_position_embeddings": 2048,
            "model_type": "llama", "num_attention_heads": 8, "num_key_value_heads": 2, "num_hidden_layers": 1,
            "pad_token_id": 0, "rms_norm_eps": 1e-05, "tie_word_embeddings": False, "torch_dtype": "float16",
            "transformers_version": "4.28.1", "use_cache": True, "vocab_size": V, "rope_theta": 500000.0, "bias": False}


def cfg_eagle3_llama31_8b():   # yuhuili/EAGLE3-LLaMA3.1-Instruct-8B: no rope_theta (-> 10000), draft vocab
    return {"architectures": ["LlamaForCausalLMEagle3"], "bos_token_id": 128000, "eos_token_id": 128001,
            "hidden_act": "silu", "hidden_size": H, "initializer_range": 0.02, "intermediate_size": 112,
            "max_position_embeddings": 2048, "model_type": "llama", "num_attention_heads": 8,
            "num_key_value_heads": 2, "num_hidden_layers": 1, "pad_token_id": 0, "rms_norm_eps": 1e-05,
            "tie_word_embeddings": False, "torch_dtype": "float16", "transformers_version": "4.28.1",
            "use_cache": True, "vocab_size": V, "draft_vocab_size": DRAFT_V}


def eagle1_state(cfg: dict, target, fc_bias: bool, qkv_bias: bool, dtype, with_embed=True, seed=1):
    g = torch.Generator().manual_seed(seed)
    h, nh, nkv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd, i = h // nh, cfg["intermediate_size"]
    sd = {"fc.weight": rnd(g, h, 2 * h, dtype=dtype)}
    if fc_bias:
        sd["fc.bias"] = rnd(g, h, dtype=dtype)
    for n, rows in (("q_proj", nh * hd), ("k_proj", nkv * hd), ("v_proj", nkv * hd)):
        sd[f"layers.0.self_attn.{n}.weight"] = rnd(g, rows, h, dtype=dtype)
        if qkv_bias:
            sd[f"layers.0.self_attn.{n}.bias"] = rnd(g, rows, dtype=dtype)
    sd["layers.0.self_attn.o_proj.weight"] = rnd(g, h, nh * hd, dtype=dtype)
    sd["layers.0.mlp.gate_proj.weight"] = rnd(g, i, h, dtype=dtype)
    sd["layers.0.mlp.up_proj.weight"] = rnd(g, i, h, dtype=dtype)
    sd["layers.0.mlp.down_proj.weight"] = rnd(g, h, i, dtype=dtype)
    sd["layers.0.post_attention_layernorm.weight"] = (1 + rnd(g, h)).to(dtype)
    if with_embed:   # the published EAGLE-1 heads carry a frozen copy of the target's table
        sd["embed_tokens.weight"] = target.model.embed_tokens.weight.detach().clone().to(dtype)
    return sd


def eagle3_state(cfg: dict, dtype, prefix="midlayer.", seed=2):
    g = torch.Generator().manual_seed(seed)
    h, nh, nkv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd, i = h // nh, cfg["intermediate_size"]
    sd = {"fc.weight": rnd(g, h, 3 * h, dtype=dtype)}
    for n, rows in (("q_proj", nh * hd), ("k_proj", nkv * hd), ("v_proj", nkv * hd)):
        sd[f"{prefix}self_attn.{n}.weight"] = rnd(g, rows, 2 * h, dtype=dtype)
    sd[f"{prefix}self_attn.o_proj.weight"] = rnd(g, h, nh * hd, dtype=dtype)
    sd[f"{prefix}mlp.gate_proj.weight"] = rnd(g, i, h, dtype=dtype)
    sd[f"{prefix}mlp.up_proj.weight"] = rnd(g, i, h, dtype=dtype)
    sd[f"{prefix}mlp.down_proj.weight"] = rnd(g, h, i, dtype=dtype)
    for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        sd[f"{prefix}{n}.weight"] = (1 + rnd(g, h)).to(dtype)
    sd["norm.weight"] = (1 + rnd(g, h)).to(dtype)
    sd["lm_head.weight"] = rnd(g, cfg["draft_vocab_size"], h, dtype=dtype, scale=0.3)
    hot = torch.sort(torch.randperm(V, generator=g)[: cfg["draft_vocab_size"]]).values
    sd["d2t"] = hot - torch.arange(cfg["draft_vocab_size"])                   # int64 offsets
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[hot] = True
    sd["t2d"] = t2d
    return sd


def write_head(path, cfg: dict, sd: dict, fmt: str):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    if fmt == "bin":
        torch.save(sd, path / "pytorch_model.bin")
    else:
        from safetensors.torch import save_file
        save_file(sd, str(path / "model.safetensors"))
    return path


# ---------------------------------------------------------------- plain-torch reference

def rms(x, w, eps):
    xf = x.float()
    return w.float() * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps))


def rope(x, positions, theta):
    hd = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2).float() / hd))
    ang = positions.float()[:, None] * inv[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def ref_attn(x, sd, pre, nh, nkv, theta, positions):
    f = lambda n: sd[f"{pre}self_attn.{n}.weight"].float()  # noqa: E731
    b = lambda n: sd.get(f"{pre}self_attn.{n}.bias", torch.zeros(1)).float()  # noqa: E731
    T = x.shape[0]
    q = (x @ f("q_proj").T + b("q_proj")).view(T, nh, -1)
    k = (x @ f("k_proj").T + b("k_proj")).view(T, nkv, -1)
    v = (x @ f("v_proj").T + b("v_proj")).view(T, nkv, -1)
    hd = q.shape[-1]
    q, k = rope(q, positions, theta), rope(k, positions, theta)
    k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
    s = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)
    s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    o = torch.einsum("hqk,khd->qhd", s.softmax(-1), v).reshape(T, -1)
    return o @ f("o_proj").T


def ref_mlp(x, sd, pre):
    f = lambda n: sd[f"{pre}mlp.{n}.weight"].float()  # noqa: E731
    return (torch.nn.functional.silu(x @ f("gate_proj").T) * (x @ f("up_proj").T)) @ f("down_proj").T


def ref_eagle1(sd, cfg, emb, feat, positions):
    theta = cfg.get("rope_theta", 10000.0)
    h = torch.cat([emb, feat], -1) @ sd["fc.weight"].float().T + sd.get("fc.bias", torch.zeros(1)).float()
    h = h + ref_attn(h, sd, "layers.0.", cfg["num_attention_heads"], cfg["num_key_value_heads"], theta, positions)
    return h + ref_mlp(rms(h, sd["layers.0.post_attention_layernorm.weight"], cfg["rms_norm_eps"]), sd, "layers.0.")


def ref_eagle3(sd, cfg, emb, feat, positions):
    eps, pre = cfg["rms_norm_eps"], "midlayer."
    h = feat @ sd["fc.weight"].float().T if feat.shape[-1] != cfg["hidden_size"] else feat
    x = torch.cat([rms(emb, sd[pre + "input_layernorm.weight"], eps), rms(h, sd[pre + "hidden_norm.weight"], eps)], -1)
    h = h + ref_attn(x, sd, pre, cfg["num_attention_heads"], cfg["num_key_value_heads"], 10000.0, positions)
    h = h + ref_mlp(rms(h, sd[pre + "post_attention_layernorm.weight"], eps), sd, pre)
    return h, rms(h, sd["norm.weight"], eps) @ sd["lm_head.weight"].float().T


def run(head, feats, ids, pos):
    with torch.no_grad(), attention_context(causal_context([len(ids)], torch.device("cpu"))):
        return head(feats, ids, pos)


def target_pass(target, ids, aux=()):
    pos = torch.arange(len(ids))
    with torch.no_grad(), attention_context(causal_context([len(ids)], torch.device("cpu"))):
        return target(ids, pos, aux_layers=aux)


def close(a, b, tol=2e-4):
    assert ((a - b).abs().max() / b.abs().max()).item() < tol


# -------------------------------------------------------------------------------- tests

@pytest.mark.parametrize("name,cfg_fn,fc_bias,dtype,fmt", [
    ("EAGLE-llama2-chat-7B", cfg_llama2_chat_7b, True, torch.float32, "bin"),
    ("EAGLE-LLaMA3-Instruct-8B", cfg_llama3_instruct_8b, False, torch.float16, "bin"),
    ("EAGLE-LLaMA3 as safetensors", cfg_llama3_instruct_8b, False, torch.float16, "st"),
])
def test_eagle1_heads_load_and_match_reference(tmp_path, name, cfg_fn, fc_bias, dtype, fmt):
    target, tcfg = make_target()
    cfg = cfg_fn()
    sd = eagle1_state(cfg, target, fc_bias, qkv_bias=False, dtype=dtype)
    head = load_draft_head(write_head(tmp_path / "h", cfg, sd, fmt), target, tcfg)
    assert isinstance(head, Eagle1Head) and head.aux_layers == ()
    assert head.config.fc_bias == fc_bias and (head.fc.bias is not None) == fc_bias
    assert not head.config.own_embedding           # the stored table equals the target's: shared
    assert head.fc.weight.dtype == torch.float32   # built in the target's dtype
    assert len(head.attention_layers()) == 1
    ids = torch.randint(0, V, (9,), generator=torch.Generator().manual_seed(3))
    feats = target_pass(target, ids)                               # final-norm features
    pos = torch.arange(9) + 40
    out = run(head, feats, ids, pos)
    emb = target.model.embed_tokens.weight[ids]
    close(out, ref_eagle1(sd, cfg, emb, feats, pos))
    close(head.logits(out), out @ target.lm_head.weight.T)          # through the TARGET's LM head
    assert torch.equal(head.to_target_ids(ids), ids)


def test_eagle1_qwen2_head_with_qkv_bias_and_own_embedding(tmp_path):
    target, tcfg = make_target("qwen2")
    cfg = {**cfg_llama2_chat_7b(), "qkv_bias": True, "num_key_value_heads": 2}
    sd = eagle1_state(cfg, target, fc_bias=True, qkv_bias=True, dtype=torch.float32)
    sd["embed_tokens.weight"] = sd["embed_tokens.weight"] + 0.01     # differs: the head keeps its own
    head = load_draft_head(write_head(tmp_path / "h", cfg, sd, "bin"), target, tcfg)
    assert head.config.qkv_bias and head.config.own_embedding
    ids = torch.arange(6) * 7
    feats = torch.randn(6, H)
    pos = torch.arange(6)
    close(run(head, feats, ids, pos), ref_eagle1(sd, cfg, sd["embed_tokens.weight"][ids], feats, pos))


@pytest.mark.parametrize("variant", ["published", "vllm-names"])
def test_eagle3_head_loads_and_matches_reference(tmp_path, variant):
    target, tcfg = make_target()
    cfg = cfg_eagle3_llama31_8b()
    sd = eagle3_state(cfg, torch.float16)
    disk = dict(sd)
    if variant == "vllm-names":   # layers.0. for midlayer., draft_id_to_target_id, "model." prefix
        disk = {("model." + k.replace("midlayer.", "layers.0.")): v for k, v in sd.items() if k != "d2t"}
        disk["draft_id_to_target_id"] = sd["d2t"]
        cfg["architectures"] = ["Eagle3LlamaForCausalLM"]
    head = load_draft_head(write_head(tmp_path / "h", cfg, disk, "st" if variant != "published" else "bin"), target, tcfg)
    assert isinstance(head, Eagle3Head)
    assert head.aux_layers == (2, L // 2, L - 3) == (2, 4, 5)
    assert head.config.rope_theta == 10000.0
    ids = torch.randint(0, V, (7,), generator=torch.Generator().manual_seed(5))
    out = target_pass(target, ids, head.aux_layers)
    feats = head.target_features(out)
    assert feats.shape == (7, 3 * H)
    pos = torch.arange(7)
    hid = run(head, feats, ids, pos)
    emb = target.model.embed_tokens.weight[ids]
    ref_h, ref_logits = ref_eagle3(sd, cfg, emb, feats, pos)
    close(hid, ref_h)
    close(head.logits(hid), ref_logits)
    assert head.logits(hid).shape == (7, DRAFT_V)
    # feeding back its own output: H wide, no fc
    hid2 = run(head, hid, ids, pos + 1)
    close(hid2, ref_eagle3(sd, cfg, emb, hid, pos + 1)[0])
    draft_ids = torch.tensor([0, 5, DRAFT_V - 1])
    assert torch.equal(head.to_target_ids(draft_ids), draft_ids + sd["d2t"][draft_ids])
    assert bool(head.t2d[head.to_target_ids(torch.arange(DRAFT_V))].all())


def test_aux_layer_conventions(tmp_path):
    target, tcfg = make_target()
    sd = eagle3_state(cfg_eagle3_llama31_8b(), torch.float32)
    vllm = {**cfg_eagle3_llama31_8b(), "eagle_aux_hidden_state_layer_ids": [1, 3, 6]}
    sglang = {**cfg_eagle3_llama31_8b(), "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 2, 5]}}
    assert load_draft_head(write_head(tmp_path / "a", vllm, sd, "st"), target, tcfg).aux_layers == (1, 3, 6)
    assert load_draft_head(write_head(tmp_path / "b", sglang, sd, "st"), target, tcfg).aux_layers == (1, 3, 6)
    # listed out of order: fused in layer order all the same (vLLM and SGLang collect them layer by layer)
    unsorted = {**cfg_eagle3_llama31_8b(), "eagle_aux_hidden_state_layer_ids": [6, 1, 3]}
    assert load_draft_head(write_head(tmp_path / "c", unsorted, sd, "st"), target, tcfg).aux_layers == (1, 3, 6)


def test_eagle3_head_without_t2d_loads_and_norm_output_is_refused(tmp_path):
    """`t2d` is never read (vLLM and SGLang skip it): a head without it loads. `norm_output` (vLLM:
    the normed output is the next step's input) would draft wrongly from the second step: refused."""
    target, tcfg = make_target()
    sd = eagle3_state(cfg_eagle3_llama31_8b(), torch.float32)
    sd.pop("t2d")
    head = load_draft_head(write_head(tmp_path / "a", cfg_eagle3_llama31_8b(), sd, "st"), target, tcfg)
    assert head.kind == "eagle3" and head.config.draft_vocab_size < head.config.vocab_size
    with pytest.raises(ValueError, match="norm_output .* is not supported"):
        load_draft_head(write_head(tmp_path / "b", {**cfg_eagle3_llama31_8b(), "norm_output": True}, sd, "st"), target, tcfg)


def test_head_runs_on_a_paged_kv_cache(tmp_path):
    """Prefill then a 3-token step through the cache equals one cache-free forward."""
    target, tcfg = make_target()
    cfg = cfg_eagle3_llama31_8b()
    head = load_draft_head(write_head(tmp_path / "h", cfg, eagle3_state(cfg, torch.float32), "st"), target, tcfg)
    attn = head.attention_layers()[0]
    attn.k_cache = torch.zeros(64, attn.num_kv_heads, attn.head_dim)
    attn.v_cache = torch.zeros(64, attn.num_kv_heads, attn.head_dim)
    g = torch.Generator().manual_seed(0)
    ids, feats = torch.randint(0, V, (8,), generator=g), torch.randn(8, 3 * H, generator=g)
    slots = [17, 18, 19, 20, 40, 41, 42, 43]                   # two non-contiguous blocks
    with torch.no_grad():
        full = run(head, feats, ids, torch.arange(8))
        ctx = build_context([SeqAttention(0, list(range(5)), slots[:5], list(range(5)))], slots[:5], torch.device("cpu"))
        with attention_context(ctx):
            a = head(feats[:5], ids[:5], torch.arange(5))
        ctx = build_context([SeqAttention(0, [5, 6, 7], slots, list(range(8)))], slots[5:], torch.device("cpu"))
        with attention_context(ctx):
            b = head(feats[5:], ids[5:], torch.arange(5, 8))
    close(torch.cat([a, b]), full, 1e-5)


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_write_kv_writes_the_kv_a_full_pass_writes_and_nothing_else(tmp_path, kind):
    """Rows whose hidden state is not wanted (a prompt, a stretch the head sat out) write their K/V
    alone: the same cache contents as the full forward, other slots untouched, and a later step
    through that cache drafts as after the full pass."""
    target, tcfg = make_target()
    if kind == "eagle":
        cfg = cfg_llama2_chat_7b()
        sd, width = eagle1_state(cfg, target, fc_bias=True, qkv_bias=False, dtype=torch.float32), H
    else:
        cfg = cfg_eagle3_llama31_8b()
        sd, width = eagle3_state(cfg, torch.float32), 3 * H
    head = load_draft_head(write_head(tmp_path / "h", cfg, sd, "st"), target, tcfg)
    attn = head.attention_layers()[0]
    g = torch.Generator().manual_seed(3)
    ids, feats = torch.randint(0, V, (8,), generator=g), torch.randn(8, width, generator=g)
    slots = torch.tensor([17, 18, 19, 20, 40, 41, 42, 43])
    caches = []
    for kv_only in (False, True):
        attn.k_cache = torch.full((64, attn.num_kv_heads, attn.head_dim), 7.0)
        attn.v_cache = torch.full((64, attn.num_kv_heads, attn.head_dim), 7.0)
        with torch.no_grad():
            if kv_only:
                head.write_kv(feats[:5], ids[:5], torch.arange(5), slots[:5])
            else:
                ctx = build_context([SeqAttention(0, list(range(5)), slots[:5], list(range(5)))], slots[:5], torch.device("cpu"))
                with attention_context(ctx):
                    head(feats[:5], ids[:5], torch.arange(5))
            ctx = build_context([SeqAttention(0, [5, 6, 7], slots, list(range(8)))], slots[5:], torch.device("cpu"))
            with attention_context(ctx):
                step = head(feats[5:], ids[5:], torch.arange(5, 8))
        caches.append((attn.k_cache.clone(), attn.v_cache.clone(), step))
    (k0, v0, s0), (k1, v1, s1) = caches
    assert torch.allclose(k0, k1, atol=1e-6) and torch.allclose(v0, v1, atol=1e-6)
    untouched = torch.ones(64, dtype=torch.bool)
    untouched[slots] = False
    assert bool((k1[untouched] == 7.0).all()) and bool((v1[untouched] == 7.0).all())
    assert not torch.allclose(k1[slots[:5]], torch.full_like(k1[slots[:5]], 7.0))
    close(s1, s0, 1e-5)


def test_a_long_catch_up_writes_its_stretch_kv_alone_and_drafts_as_one_full_pass(tmp_path, monkeypatch):
    """A catch-up over more than Drafter.STRETCH pending pairs writes all but the root's pair K/V-only,
    then runs the root through the head: the same cache and root log-probs as one full pass."""
    from eagle_worker.speculative.drafter import Drafter, DraftSeq, DraftState

    target, tcfg = make_target()
    cfg = cfg_eagle3_llama31_8b()
    head = load_draft_head(write_head(tmp_path / "h", cfg, eagle3_state(cfg, torch.float32), "st"), target, tcfg)
    attn = head.attention_layers()[0]
    g = torch.Generator().manual_seed(4)
    n = Drafter.STRETCH + 5
    feats, ids = torch.randn(n, 3 * H, generator=g), torch.randint(0, V, (n,), generator=g).tolist()
    slots = torch.arange(3, 3 + n + 4)
    drafter = Drafter(head, torch.device("cpu"))
    written, out = [], []
    write = drafter.write_ahead
    monkeypatch.setattr(drafter, "write_ahead", lambda batch: written.append(len(batch[0][1].tokens)) or write(batch))
    for stretch in (10 ** 6, Drafter.STRETCH):        # one full pass, then the split
        monkeypatch.setattr(Drafter, "STRETCH", stretch)
        attn.k_cache = torch.zeros(64, attn.num_kv_heads, attn.head_dim)
        attn.v_cache = torch.zeros(64, attn.num_kv_heads, attn.head_dim)
        st = DraftState(start=0)
        st.add(feats, ids)
        hidden, lp = drafter.catch_up([DraftSeq(committed=n, slots=slots, root_token=ids[-1], state=st)])
        assert (st.start, st.tokens) == (n, [])
        out.append((attn.k_cache.clone(), attn.v_cache.clone(), hidden, lp))
    assert written == [n]                              # only the long stretch took the K/V-only pass
    (k0, v0, h0, lp0), (k1, v1, h1, lp1) = out
    assert torch.allclose(k0, k1, atol=1e-6) and torch.allclose(v0, v1, atol=1e-6)
    close(h1, h0, 1e-5)
    close(lp1, lp0, 1e-4)


def test_mismatched_head_is_refused_naming_the_tensor(tmp_path):
    target, tcfg = make_target(hidden=32)
    big, _ = make_target()
    cfg = cfg_llama3_instruct_8b()
    sd = eagle1_state(cfg, big, fc_bias=False, qkv_bias=False, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"'fc\.weight' has shape \(64, 128\), expected \(32, 64\)"):
        load_draft_head(write_head(tmp_path / "a", cfg, sd, "bin"), target, tcfg)
    # right hidden size, wrong vocabulary: EAGLE-3's t2d names it
    small_vocab, _ = make_target()
    cfg3 = cfg_eagle3_llama31_8b()
    sd3 = eagle3_state(cfg3, torch.float16)
    sd3["t2d"] = torch.zeros(V + 16, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"'t2d' has shape \(144,\), expected \(128,\)"):
        load_draft_head(write_head(tmp_path / "b", cfg3, sd3, "st"), small_vocab, tcfg)
    sd3 = eagle3_state(cfg3, torch.float16)
    del sd3["midlayer.hidden_norm.weight"]
    with pytest.raises(ValueError, match="missing tensor"):
        load_draft_head(write_head(tmp_path / "c", cfg3, sd3, "st"), small_vocab, tcfg)


def test_bin_is_loaded_with_weights_only(tmp_path):
    target, tcfg = make_target()
    cfg = cfg_llama2_chat_7b()
    sd = eagle1_state(cfg, target, True, False, torch.float32)
    sd["extra"] = {"not": "a tensor", "obj": object()}
    with pytest.raises(ValueError, match="weights_only"):
        load_draft_head(write_head(tmp_path / "h", cfg, sd, "bin"), target, tcfg)


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_save_load_round_trip(tmp_path, kind):
    target, tcfg = make_target()
    if kind == "eagle":
        cfg, sd = cfg_llama2_chat_7b(), None
        sd = eagle1_state(cfg, target, fc_bias=True, qkv_bias=False, dtype=torch.float32)
        feats = torch.randn(5, H)
    else:
        cfg = {**cfg_eagle3_llama31_8b(), "eagle_aux_hidden_state_layer_ids": [1, 3, 6]}
        sd = eagle3_state(cfg, torch.float32)
        feats = torch.randn(5, 3 * H)
    head = load_draft_head(write_head(tmp_path / "src", cfg, sd, "bin"), target, tcfg)
    out = save_draft_head(head, tmp_path / "out")
    saved_cfg = json.loads((out / "config.json").read_text())
    from safetensors.torch import load_file
    saved = load_file(str(out / "model.safetensors"))
    published = set(sd) - {"embed_tokens.weight"}        # shared with the target: not re-saved
    assert set(saved) == published
    for k in published:
        assert torch.equal(saved[k], sd[k].to(saved[k].dtype)), k
    if kind == "eagle":
        assert saved_cfg["architectures"] == ["LlamaForCausalLM"] and "bias" not in saved_cfg
    else:
        assert saved_cfg["architectures"] == ["LlamaForCausalLMEagle3"]
        assert saved_cfg["draft_vocab_size"] == DRAFT_V
        assert saved_cfg["eagle_aux_hidden_state_layer_ids"] == [1, 3, 6]
        assert saved_cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 5]
    again = load_draft_head(out, target, tcfg)
    assert again.aux_layers == head.aux_layers
    ids, pos = torch.arange(5) * 3, torch.arange(5)
    assert torch.equal(run(again, feats, ids, pos), run(head, feats, ids, pos))
    with pytest.raises(ValueError):
        save_draft_head(head, tmp_path / "x", "eagle3" if kind == "eagle" else "eagle")


def test_config_promising_qkv_bias_without_tensors_is_refused(tmp_path):
    target, tcfg = make_target("qwen2")
    cfg = {**cfg_llama2_chat_7b(), "qkv_bias": True}
    sd = eagle1_state(cfg, target, fc_bias=True, qkv_bias=False, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"missing tensor.*q_proj\.bias"):
        load_draft_head(write_head(tmp_path / "h", cfg, sd, "bin"), target, tcfg)


def test_auto_head_dtype_is_bf16_under_a_float32_target_only_where_bf16_is_fast(monkeypatch):
    from eagle_worker.layers import argmax_screen
    from eagle_worker.speculative import head_loader
    from eagle_worker.speculative.config import SpecConfig

    cpu = torch.device("cpu")
    monkeypatch.setattr(argmax_screen, "native_bf16", lambda: True)
    assert head_loader.head_dtype("auto", torch.float32, cpu) == torch.bfloat16
    assert head_loader.head_dtype("auto", torch.bfloat16, cpu) == torch.bfloat16
    assert head_loader.head_dtype("auto", torch.float16, cpu) == torch.float16      # never widened or changed
    assert head_loader.head_dtype("float32", torch.float32, cpu) == torch.float32    # asked for: kept
    monkeypatch.setattr(argmax_screen, "native_bf16", lambda: False)                   # bf16 emulated: no gain
    assert head_loader.head_dtype("auto", torch.float32, cpu) == torch.float32
    assert head_loader.head_dtype("bfloat16", torch.float32, cpu) == torch.bfloat16
    assert head_loader.head_dtype("target", torch.float32, cpu) == torch.float32       # the default
    assert SpecConfig(draft="default").head_dtype == "target"
    with pytest.raises(ValueError, match="head_dtype"):
        SpecConfig(draft="default", head_dtype="int8")


def _poison(file):
    """One tensor of a head all NaN, as a diverged training run saves it."""
    from safetensors.torch import load_file, save_file

    sd = load_file(file)
    sd["fc.weight"] = torch.full_like(sd["fc.weight"], float("nan"))
    save_file(sd, file)


@pytest.mark.parametrize("damage, needle", [
    (lambda d: (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:-1]),
     "corrupted or truncated safetensors file"),
    (lambda d: (d / "model.safetensors").write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{}"),
     "corrupted or truncated safetensors file"),
    (lambda d: (d / "config.json").write_text("[1, 2]"), "config.json: expected a JSON object, got list"),
    (lambda d: (d / "config.json").write_text("{not json"), "config.json: not a readable JSON file"),
    (lambda d: (d / "config.json").write_text(""), "config.json: not a readable JSON file"),
    (lambda d: ((d / "model.safetensors").unlink(), os.mkfifo(d / "model.safetensors")), "not a regular file"),
    (lambda d: _poison(d / "model.safetensors"), "NaN or infinite values in fc.weight"),
])
def test_a_damaged_head_folder_is_one_error_naming_the_file(tmp_path, damage, needle):
    """As the target's loader answers a damaged checkpoint: a ValueError naming the file, never a
    library's own exception type (eaglectl prints ValueErrors as one line)."""
    target, tcfg = make_target()
    cfg3 = cfg_eagle3_llama31_8b()
    head = write_head(tmp_path / "h", cfg3, eagle3_state(cfg3, torch.float16), "st")
    load_draft_head(head, target, tcfg)                       # intact: loads
    damage(head)
    with pytest.raises(ValueError, match=needle) as e:
        load_draft_head(head, target, tcfg)
    assert str(head) in str(e.value)
