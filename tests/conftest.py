"""Shared fixtures: tiny random models with a real (tiny, byte-level BPE) tokenizer, and the default model."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.", "Question: what is two plus two?\nAnswer: four.",
    "def add(a, b):\n    return a + b\n", "Bonjour, comment ça va ? Très bien, merci. 你好 🙂",
    "Speculative decoding drafts tokens and verifies them in one pass.",
] * 20


def make_tokenizer(vocab_size: int = 320):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<bos>", "<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS, trainer)
    from tokenizers.processors import TemplateProcessing
    tok.post_processor = TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")


def tiny_config(family: str, vocab_size: int = 320):
    from transformers import AutoConfig

    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if family == "llama":
        return AutoConfig.for_model("llama", **common, rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    if family == "qwen2":
        return AutoConfig.for_model("qwen2", **common)
    if family == "qwen3":
        return AutoConfig.for_model("qwen3", **common, head_dim=16)
    if family == "gemma3":
        return AutoConfig.for_model("gemma3_text", **common, head_dim=16, sliding_window=8,
                                    layer_types=["sliding_attention", "full_attention"] * 2, query_pre_attn_scalar=16)
    raise ValueError(family)


def save_tiny_model(family: str, path: Path, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    return save_random_model(tiny_config(family), path)


def save_random_model(cfg, path: Path) -> Path:
    """A model of `cfg` with sharp random weights (seed the RNG first) and the tiny tokenizer, saved to `path`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():   # sharper logits than the default init, so greedy paths are not all ties
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    model.save_pretrained(path)
    make_tokenizer(cfg.vocab_size).save_pretrained(path)
    return path


def assert_no_leaks(engine) -> None:
    """Nothing of a finished request is left in an LLMEngine: every KV block is free (cached prefixes
    are free too: evictable), no block is referenced, the scheduler
    queues and the request table are empty, and so is a speculative worker's per-request state."""
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not any(bm.ref_counts)
    assert not engine.scheduler.running and not engine.scheduler.waiting and not engine.requests
    assert bm.prefix_cache is None or not bm.prefix_cache.inflight
    from eagle_worker.speculative.worker import EagleWorker

    if isinstance(engine.worker, EagleWorker):  # the only worker that keeps per-request state
        assert not engine.worker.states


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A factory: tiny_model_dir("llama") -> folder with config, safetensors and tokenizer."""
    cache: dict[str, Path] = {}

    def get(family: str = "llama") -> Path:
        if family not in cache:
            cache[family] = save_tiny_model(family, tmp_path_factory.mktemp(f"tiny-{family}"))
        return cache[family]
    return get


@pytest.fixture(scope="session")
def copying_target(tmp_path_factory):
    """A tiny Qwen2 whose next token depends mostly on the current one (attention is weak, MLPs are
    off) and an EAGLE-1 head that forwards the token embedding: it drafts the target's own bigram
    argmax, so it accepts a lot, while attention still makes the KV cache matter.
    Returns (target folder, head folder)."""
    from transformers import AutoModelForCausalLM

    from eagle_worker import LLM
    from eagle_worker.speculative.head_init import new_head
    from eagle_worker.speculative.head_saver import save_draft_head

    torch.manual_seed(0)
    cfg = tiny_config("qwen2")
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
            if "o_proj" in name:
                p.mul_(0.01)
            if "down_proj" in name:
                p.zero_()
            if "norm" in name:
                p.fill_(1.0)
    target = tmp_path_factory.mktemp("copying-target")
    model.save_pretrained(target)
    make_tokenizer(cfg.vocab_size).save_pretrained(target)
    llm = LLM(model=str(target), block_size=4, num_kv_blocks=64, draft=None)
    head = new_head("eagle", llm.engine.runner.model, llm.engine.runner.hf_config, std=0.0)
    with torch.no_grad():
        hidden = head.config.hidden_size
        head.fc.weight[:, :hidden] = torch.eye(hidden)
    head_dir = tmp_path_factory.mktemp("copying-head")
    save_draft_head(head, head_dir)
    return target, head_dir


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The built-in default model (gemma-3-270m) materialised into the cache: slow (see below)."""
    import time

    from eagle_worker import default_models

    t0 = time.perf_counter()
    path = default_models.materialize("gemma-3-270m")
    print(f"\nmaterialize('gemma-3-270m') took {time.perf_counter() - t0:.1f}s -> {path}")
    return path


# ---------------------------------------------------------------------------------------------
# Test tiers. `python -m pytest` runs everything (CI); `python -m pytest -m "not slow"` is the fast
# tier for development (unit tests and tiny random models, a few minutes on 2 cores).
# `slow` = loads the real default model (gemma-3-270m), starts Ray (a local `ray.init`, a
# multi-node `ray start` cluster, Serve apps) or runs the CLI/jobs/servers in subprocesses (TP 2 rank
# processes too, but for one family's parity and the copying-target cases, kept fast for engine work).
# Tests that use one of the fixtures below are marked slow here, in one place; tests that start
# such things themselves carry `pytestmark = pytest.mark.slow` (whole module) or `@pytest.mark.slow`.
# ---------------------------------------------------------------------------------------------

SLOW_FIXTURES = frozenset({
    "ray_cluster",        # tests/cluster/conftest.py: a local Ray + Serve (also behind `serve_port`, `deploy`)
    "local_ray",          # tests/jobs/conftest.py: an embedded Ray for in-process jobs
    "default_model_dir",  # tests/eagle_worker/test_default_model.py: the materialised gemma-3-270m
})


def pytest_collection_modifyitems(config, items):
    for item in items:
        if SLOW_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def _torch_threads_restored():
    """Code under test may set torch's thread count in this process (a replica, a bench, training):
    later tests get the count back, or they would run on fewer cores."""
    n = torch.get_num_threads()
    yield
    if torch.get_num_threads() != n:     # e.g. tests/cluster/test_replica.py's in-process replicas (cpu: 1)
        torch.set_num_threads(n)
