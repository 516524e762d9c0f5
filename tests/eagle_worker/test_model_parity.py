"""Our model implementations against transformers on tiny random checkpoints (fp32, CPU).

Each family is saved with `save_pretrained` and loaded through our loader, then compared on
(a) a packed prefill of sequences of different lengths, (b) chunked prefill + step-by-step
decode through a real paged KV cache with non-contiguous blocks, (c) `aux_layers` against HF
`output_hidden_states`, and (d) Gemma 3 at tensor-parallel size 2 with one replicated KV head.
"""
from __future__ import annotations

import os

import pytest
import torch
import transformers

from eagle_worker.attention import SeqAttention, attention_context, build_context, causal_context
from eagle_worker.loader import load_weights
from eagle_worker.models.registry import model_class_for

VOCAB = 96
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
              rms_norm_eps=1e-6)


def tiny_config(family: str):
    if family == "llama3":
        return transformers.LlamaConfig(
            **COMMON, tie_word_embeddings=False, architectures=["LlamaForCausalLM"],
            rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
    if family == "mistral":
        return transformers.MistralConfig(**COMMON, sliding_window=5, architectures=["MistralForCausalLM"])
    if family == "qwen2":
        return transformers.Qwen2Config(**COMMON, tie_word_embeddings=True, architectures=["Qwen2ForCausalLM"])
    if family == "qwen3":
        return transformers.Qwen3Config(**COMMON, head_dim=24, architectures=["Qwen3ForCausalLM"])
    if family == "gemma3":
        return transformers.Gemma3TextConfig(
            **{**COMMON, "num_hidden_layers": 4, "num_key_value_heads": 1}, head_dim=32, query_pre_attn_scalar=24,
            sliding_window=4, final_logit_softcapping=5.0, architectures=["Gemma3ForCausalLM"],
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})
    raise KeyError(family)


FAMILIES = ["llama3", "mistral", "qwen2", "qwen3", "gemma3"]


def _randomize(model: torch.nn.Module, gemma: bool) -> None:
    """HF zero-initialises biases and sets norms to identity; randomise so both are exercised."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "norm" in name:
                p.copy_(noise * 0.3 + (0.0 if gemma else 1.0))
            else:
                p.copy_(noise * (0.3 if "embed" in name else 0.08))


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request, tmp_path_factory):
    """(reference HF model, our model, hf_config) sharing the same saved checkpoint."""
    torch.manual_seed(0)
    config = tiny_config(request.param)
    config._attn_implementation = "eager"
    ref = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    _randomize(ref, gemma=request.param == "gemma3")
    path = tmp_path_factory.mktemp(request.param)
    ref.save_pretrained(path, safe_serialization=True)
    hf_config = transformers.AutoConfig.from_pretrained(path)
    ours = model_class_for(hf_config)(hf_config).float().eval()
    load_weights(ours, path)
    return ref, ours, hf_config


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def _ref_logits(ref, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ref(torch.tensor([tokens])).logits[0].float()


def test_prefill_packed_batch(pair):
    ref, ours, _ = pair
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (7, 13, 3)]
    ids = torch.tensor(sum(seqs, []))
    pos = torch.cat([torch.arange(len(s)) for s in seqs])
    with torch.no_grad(), attention_context(causal_context([len(s) for s in seqs], ids.device)):
        logits = ours.compute_logits(ours(ids, pos))
    assert logits.shape == (len(ids), VOCAB)
    start = 0
    for s in seqs:
        assert rel_err(logits[start:start + len(s)], _ref_logits(ref, s)) <= 1e-4
        start += len(s)


def test_aux_layers_match_hidden_states(pair):
    ref, ours, cfg = pair
    L = cfg.num_hidden_layers
    seqs = [[5, 9, 2, 77, 31, 4], [8, 1, 60]]
    ids = torch.tensor(sum(seqs, []))
    pos = torch.cat([torch.arange(len(s)) for s in seqs])
    wanted = (L - 1, 0, 1, L)
    with torch.no_grad(), attention_context(causal_context([len(s) for s in seqs], ids.device)):
        hidden, aux = ours(ids, pos, aux_layers=wanted)
        emb = ours.embed(ids)
    start = 0
    for s in seqs:
        with torch.no_grad():
            hs = ref(torch.tensor([s]), output_hidden_states=True).hidden_states
        rows = slice(start, start + len(s))
        for i, h in zip(wanted, aux):
            assert rel_err(h[rows], hs[i][0]) <= 1e-4, f"aux layer {i}"
        assert rel_err(hidden[rows], hs[L][0]) <= 1e-4
        assert rel_err(emb[rows], hs[0][0]) <= 1e-6
        start += len(s)


def _attach_cache(model, num_slots: int) -> None:
    for a in model.attention_layers():
        a.k_cache = torch.zeros(num_slots, a.num_kv_heads, a.head_dim)
        a.v_cache = torch.zeros(num_slots, a.num_kv_heads, a.head_dim)


def test_paged_chunked_prefill_then_decode(pair):
    """Prompts arrive in chunks, then one token per step; every step's logits match HF."""
    ref, ours, _ = pair
    block_size = 4
    tables = [[5, 2, 9, 14, 0], [7, 3, 11, 1, 12], [6, 13, 4, 8, 10]]  # scattered, disjoint blocks
    _attach_cache(ours, 16 * block_size)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (6, 9, 2)]
    # Per step, how many new tokens each sequence feeds (prompt chunks first, then decodes).
    plan = [[4, 9, 2], [2, 1, 1], [1, 1, 1], [1, 1, 1], [1, 1, 1], [1, 1, 1], [1, 1, 1]]
    done = [[] for _ in prompts]           # tokens already in the cache
    pending = [list(p) for p in prompts]   # prompt tokens not yet fed
    slot = lambda b, p: tables[b][p // block_size] * block_size + p % block_size  # noqa: E731
    try:
        for step in plan:
            seqs, slots, ids, pos, fed = [], [], [], [], []
            for b, n in enumerate(step):
                if pending[b]:
                    new, pending[b] = pending[b][:n], pending[b][n:]
                else:  # decode: feed the greedy token of the reference
                    new = [int(_ref_logits(ref, done[b])[-1].argmax())]
                p0 = len(done[b])
                seqs.append(SeqAttention(q_start=len(ids), q_positions=list(range(p0, p0 + len(new))),
                                         kv_slots=[slot(b, p) for p in range(p0 + len(new))],
                                         kv_positions=list(range(p0 + len(new)))))
                slots += [slot(b, p) for p in range(p0, p0 + len(new))]
                ids += new
                pos += list(range(p0, p0 + len(new)))
                fed.append(new)
            ctx = build_context(seqs, slots, torch.device("cpu"))
            with torch.no_grad(), attention_context(ctx):
                logits = ours.compute_logits(ours(torch.tensor(ids), torch.tensor(pos)))
            start = 0
            for b, new in enumerate(fed):
                done[b] += new
                expect = _ref_logits(ref, done[b])[-len(new):]
                assert rel_err(logits[start:start + len(new)], expect) <= 1e-4, f"seq {b} at len {len(done[b])}"
                start += len(new)
    finally:
        for a in ours.attention_layers():
            a.k_cache = a.v_cache = None
    assert [len(d) for d in done] == [11, 15, 8]


# ----------------------------------------------------------------------------- tensor parallel

def _tp_worker(rank: int, world: int, path: str, port: int, out: str) -> None:
    import torch.distributed as dist

    from eagle_worker.parallel import init_tensor_parallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    init_tensor_parallel(rank, world)
    torch.set_num_threads(1)
    cfg = transformers.AutoConfig.from_pretrained(path)
    model = model_class_for(cfg)(cfg).float().eval()
    load_weights(model, path)
    ids = torch.tensor([3, 17, 42, 8, 8, 90, 1, 64, 5, 33])
    with torch.no_grad(), attention_context(causal_context([6, 4], ids.device)):
        logits = model.compute_logits(model(ids, torch.tensor([0, 1, 2, 3, 4, 5, 0, 1, 2, 3])))
    if rank == 0:
        torch.save(logits, out)
    dist.destroy_process_group()


def test_gemma3_tensor_parallel_2_with_one_kv_head(tmp_path):
    import socket

    import torch.multiprocessing as mp

    config = tiny_config("gemma3")
    config.vocab_size = VOCAB + 1  # odd: the last rank's vocab shard is padded
    assert config.num_key_value_heads == 1
    ref = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    _randomize(ref, gemma=True)
    ref.save_pretrained(tmp_path / "ckpt")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = str(tmp_path / "logits.pt")
    mp.spawn(_tp_worker, args=(2, str(tmp_path / "ckpt"), port, out), nprocs=2, join=True)
    tp_logits = torch.load(out)
    expect = torch.cat([_ref_logits(ref, [3, 17, 42, 8, 8, 90]), _ref_logits(ref, [1, 64, 5, 33])])
    assert rel_err(tp_logits, expect) <= 1e-4


def test_rope_config_reads_legacy_and_nested_configs():
    from types import SimpleNamespace

    from eagle_worker.layers.rotary import rope_config

    legacy = SimpleNamespace(rope_theta=5e5, rope_scaling={"type": "linear", "factor": 2.0})
    assert rope_config(legacy) == (5e5, {"type": "linear", "factor": 2.0})
    assert rope_config(SimpleNamespace(rope_theta=1e4, rope_scaling=None)) == (1e4, None)
    old_gemma = SimpleNamespace(rope_theta=1e6, rope_local_base_freq=1e4, rope_scaling=None)
    assert rope_config(old_gemma, "sliding_attention") == (1e4, None)
    assert rope_config(old_gemma, "full_attention") == (1e6, None)
    g = tiny_config("gemma3")
    assert rope_config(g, "sliding_attention") == (10000.0, None)
    theta, scaling = rope_config(g, "full_attention")
    assert theta == 100000.0 and scaling["rope_type"] == "linear" and scaling["factor"] == 2.0
    theta, scaling = rope_config(tiny_config("llama3"))
    assert theta == 10000.0 and scaling["rope_type"] == "llama3"
    assert rope_config(tiny_config("mistral"))[1] is None


@pytest.mark.parametrize("rows", [1, 2, 3, 9])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_f_linear_at_every_kernel_choice(rows, bias):
    """`linear` picks a kernel by dtype, device and row count; every choice computes x @ W.T + b."""
    from eagle_worker.layers.linear import linear

    g = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, 64, generator=g), torch.randn(96, 64, generator=g)
    b = torch.randn(96, generator=g) if bias else None
    with torch.inference_mode():
        got = linear(x[:, None], w, b)                    # a leading batch shape is kept
    assert got.shape == (rows, 1, 96)
    torch.testing.assert_close(got[:, 0], torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_a_llama_config_with_a_sliding_window_key_attends_to_everything_as_transformers_does(tmp_path):
    """Only Mistral applies a global `sliding_window`; transformers' Llama ignores the key, so a Llama
    checkpoint that carries one must not get windowed attention (it did, on every layer)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**COMMON, sliding_window=4, architectures=["LlamaForCausalLM"])
    config._attn_implementation = "eager"
    ref = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    _randomize(ref, gemma=False)
    ref.save_pretrained(tmp_path, safe_serialization=True)
    ours = model_class_for(config)(config).float().eval()
    load_weights(ours, tmp_path)
    assert {m.sliding_window for m in ours.modules() if hasattr(m, "sliding_window")} == {None}
    tokens = torch.randint(0, VOCAB, (20,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.no_grad(), attention_context(causal_context([len(tokens)], torch.device("cpu"))):
        logits = ours.compute_logits(ours(torch.tensor(tokens), torch.arange(len(tokens))))
    assert rel_err(logits, _ref_logits(ref, tokens)) <= 1e-4
    mistral = tiny_config("mistral")
    assert {m.sliding_window for m in model_class_for(mistral)(mistral).modules() if hasattr(m, "sliding_window")} == {5}


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_an_unknown_layer_type_is_refused_not_run_as_full_attention(family):
    config = tiny_config(family)
    config.layer_types = ["full_attention", "chunked_attention", *config.layer_types[2:]]
    with pytest.raises(ValueError, match=r"layer_types\[1\] = 'chunked_attention' is not supported"):
        model_class_for(config)(config)


def test_a_multimodal_gemma3_checkpoint_takes_its_context_from_the_text_config():
    """Gemma3ForConditionalGeneration keeps `max_position_embeddings` in `text_config`; the top level
    has none, so the limit read 8192 and a longer context than the rope table was accepted."""
    from types import SimpleNamespace

    from eagle_worker.model_runner import ModelRunner

    text = tiny_config("gemma3").to_dict()
    hf_config = transformers.Gemma3Config(text_config=text, vision_config={"hidden_size": 32, "intermediate_size": 64,
                                          "num_hidden_layers": 1, "num_attention_heads": 2, "image_size": 28, "patch_size": 14})
    runner = SimpleNamespace(hf_config=hf_config, num_kv_blocks=1000, config=SimpleNamespace(max_model_len=None, block_size=4))
    assert ModelRunner._max_model_len(runner) == 128
    runner.config.max_model_len = 1000
    with pytest.raises(ValueError, match="exceeds the model's context of 128 tokens"):
        ModelRunner._max_model_len(runner)


@pytest.mark.parametrize("bias", [False, True])
def test_a_packed_gate_up_checkpoint_is_split_per_projection_on_every_rank(monkeypatch, bias):
    """`mlp.gate_up_proj` stored packed as [gate; up]: each rank takes its slice of gate and of up (as
    from separate gate_proj / up_proj tensors), not rows r*n..(r+1)*n of the pack (at tp 2 rank 0 got
    all of gate and rank 1 all of up: silently wrong outputs)."""
    import eagle_worker.layers.linear as linear_mod

    g = torch.Generator().manual_seed(0)
    gate, up = torch.randn(6, 4, generator=g), torch.randn(6, 4, generator=g)
    gate_b, up_b = torch.randn(6, generator=g), torch.randn(6, generator=g)
    for rank in (0, 1):
        monkeypatch.setattr(linear_mod, "tp_size", lambda: 2)
        monkeypatch.setattr(linear_mod, "tp_rank", lambda r=rank: r)
        packed = linear_mod.MergedColumnParallelLinear(4, [6, 6], bias=bias)
        separate = linear_mod.MergedColumnParallelLinear(4, [6, 6], bias=bias)
        packed.weight_loader(packed.weight, torch.cat([gate, up]))
        separate.weight_loader(separate.weight, gate, 0)
        separate.weight_loader(separate.weight, up, 1)
        assert torch.equal(packed.weight, separate.weight)
        assert torch.equal(packed.weight, torch.cat([gate[3 * rank:3 * rank + 3], up[3 * rank:3 * rank + 3]]))
        if bias:
            packed.weight_loader(packed.bias, torch.cat([gate_b, up_b]))
            assert torch.equal(packed.bias, torch.cat([gate_b[3 * rank:3 * rank + 3], up_b[3 * rank:3 * rank + 3]]))


def test_a_vocabulary_too_small_to_split_over_the_ranks_is_refused(monkeypatch):
    import eagle_worker.layers.embedding as embedding_mod

    monkeypatch.setattr(embedding_mod, "tp_size", lambda: 4)
    monkeypatch.setattr(embedding_mod, "tp_rank", lambda: 3)
    with pytest.raises(ValueError, match="a vocabulary of 6 tokens cannot be split over 4 ranks"):
        embedding_mod.VocabParallelEmbedding(6, 8)
    assert embedding_mod.VocabParallelEmbedding(7, 8).vocab_end == 7    # shards of 2: rank 3 holds token 6
