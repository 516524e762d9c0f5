"""The real default model: logits parity with transformers (prefill and paged decode) and greedy
generation identical to `transformers` generate, alone and inside a mixed batch of 8."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from eagle_worker import LLM, SamplingParams
from eagle_worker.attention import SeqAttention, attention_context, build_context, causal_context

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Question: What is 12 times 7?\nAnswer:",
           "Once upon a time", "The three primary colors are"]
FILLERS = ["Translate to German: good morning", "Write a haiku about autumn leaves falling on a quiet pond at dusk",
           "1, 2, 3, 4,"]


@pytest.fixture(scope="module")
def llm():
    return LLM(model="gemma-3-270m", dtype="float32", draft=None)


@pytest.fixture(scope="module")
def reference(llm):
    return AutoModelForCausalLM.from_pretrained(llm.engine.runner.model_path, dtype=torch.float32).eval()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@torch.inference_mode()
def test_logits_match_transformers_prefill_and_paged_decode(llm, reference):
    runner = llm.engine.runner
    model, tok = runner.model, llm.tokenizer
    ids = [tok(p).input_ids for p in PROMPTS[:3]]
    # prefill of three different-length prompts packed together
    flat = torch.tensor(sum(ids, []))
    pos = torch.cat([torch.arange(len(x)) for x in ids])
    with attention_context(causal_context([len(x) for x in ids], runner.device)):
        ours = model.compute_logits(model(flat, pos))
    start = 0
    for x in ids:
        ref = reference(torch.tensor([x])).logits[0]
        assert rel_err(ours[start:start + len(x)], ref) <= 1e-4
        start += len(x)
    # token-by-token decode of one prompt through the paged cache (blocks deliberately scattered)
    x = ids[1] + reference.generate(torch.tensor([ids[1]]), max_new_tokens=6, do_sample=False)[0, len(ids[1]):].tolist()
    ref = reference(torch.tensor([x])).logits[0]
    bs = runner.config.block_size
    blocks = [7, 3, 11, 5]
    slot = lambda p: blocks[p // bs] * bs + p % bs  # noqa: E731
    for p in range(len(x)):
        seq = SeqAttention(q_start=0, q_positions=[p], kv_slots=[slot(i) for i in range(p + 1)], kv_positions=list(range(p + 1)))
        with attention_context(build_context([seq], [slot(p)], runner.device)):
            step = model.compute_logits(model(torch.tensor([x[p]]), torch.tensor([p])))
        assert rel_err(step[0], ref[p]) <= 1e-4, f"position {p}"


def test_greedy_equals_transformers_generate_alone_and_in_batch(llm, reference):
    params = SamplingParams(max_tokens=20, temperature=0.0)
    expected = []
    for p in PROMPTS:
        ids = llm.tokenizer(p, return_tensors="pt").input_ids
        out = reference.generate(ids, max_new_tokens=20, do_sample=False)[0, ids.shape[1]:].tolist()
        expected.append(out)
    alone = [llm.generate(p, params)[0].token_ids for p in PROMPTS]
    assert alone == expected
    mixed = FILLERS[:1] + PROMPTS[:3] + FILLERS[1:] + PROMPTS[3:]          # 8 requests, mixed lengths
    mixed_params = [SamplingParams(max_tokens=n, temperature=0.0) for n in (5, 20, 20, 20, 12, 16, 20, 20)]
    outs = {p: o.token_ids for p, o in zip(mixed, llm.generate(mixed, mixed_params))}
    assert [outs[p] for p in PROMPTS] == expected
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_default_model_text_and_metrics(llm):
    out = llm.generate("The capital of France is", SamplingParams(max_tokens=8, temperature=0.0))[0]
    assert "Paris" in out.text or "capital" in out.text
    m = out.metrics
    assert m["num_output_tokens"] == 8 and m["num_target_forwards"] == 7 and m["mean_accepted_tokens"] == 1.0
