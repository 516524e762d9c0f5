"""End to end: `train-head` on a tiny random target learns a head that accepts far more than a
random one, writes the published format, and resumes from its checkpoint."""
from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from eaglectl.train import train_head

PROMPTS = ["The quick brown fox", "Question: what is two plus two?", "def add(a, b):", "Bonjour, comment",
           "Speculative decoding drafts", "The lazy dog", "Answer: four.", "return a + b", "Très bien, merci",
           "verifies them in one pass", "jumps over the", "what is two", "comment ça va", "drafts tokens and",
           "The quick", "over the lazy", "plus two?", "a + b", "merci beaucoup", "in one pass"]


@pytest.fixture(scope="module")
def sharp_model(tiny_model_dir, tmp_path_factory):
    """The tiny random target with its layers muted: its next token is a function of the
    current one, a target a few dozen steps can learn, so 'trained beats random' is a sharp test."""
    import shutil

    from safetensors.torch import load_file, save_file

    src = tiny_model_dir("llama")
    dst = tmp_path_factory.mktemp("sharp")
    for f in src.iterdir():
        shutil.copy(f, dst / f.name)
    sd = load_file(str(src / "model.safetensors"))
    for k in sd:
        if k.endswith(("o_proj.weight", "down_proj.weight")):
            sd[k] = sd[k] * 0.0
    save_file(sd, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("data") / "prompts.jsonl"
    p.write_text("".join(json.dumps({"prompt": x}) + "\n" for x in PROMPTS * 3))
    return p


def _tau(model_dir, head_dir, prompts):
    from eagle_worker.llm import LLM
    from eagle_worker.sampling_params import SamplingParams
    from eagle_worker.speculative.config import SpecConfig

    llm = LLM(model=str(model_dir), spec=SpecConfig(draft=str(head_dir), lookup=False, tree="chain", depth=4, adaptive=False))
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0))
    return sum(o.metrics["mean_accepted_tokens"] for o in outs) / len(outs)


def test_train_head_end_to_end_and_resume(sharp_model, data_file, tmp_path):
    from eagle_worker.llm import LLM
    from eagle_worker.speculative.head_init import new_head
    from eagle_worker.speculative.head_saver import save_draft_head

    model = sharp_model
    out = tmp_path / "head"
    args = ["--target", str(model), "--format", "eagle3", "--data", str(data_file), "--out", str(out),
            "--prompt-format", "{prompt}", "--draft-vocab-size", "256", "--self-distill", "1000",
            "--distill-tokens", "40", "--max-tokens", "64", "--batch-tokens", "512", "--steps", "30",
            "--lr", "1e-2", "--warmup-steps", "5", "--checkpoint-every", "15", "--eval-every", "15",
            "--heldout", "4", "--eval-prompts", "0", "--dtype", "float32", "--no-progress", "--seed", "0"]
    r = CliRunner().invoke(train_head, args, catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert (out / "config.json").exists() and (out / "model.safetensors").exists()
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == 256
    rec = json.loads((out / "training_record.json").read_text())
    assert rec["steps"] == 30 and rec["metrics"]["heldout_acc"][0] > 0.3
    ckpts = sorted((out / "work" / "checkpoints").glob("step-*.pt"))
    assert [c.name for c in ckpts] == ["step-0000015.pt", "step-0000030.pt"]

    # acceptance on its own training prompts, by the engine: trained head vs a random head
    llm = LLM(model=str(model))
    rand_dir = tmp_path / "random"
    save_draft_head(new_head("eagle3", llm.engine.runner.model, llm.engine.runner.hf_config,
                             torch.arange(256), seed=1), rand_dir)
    del llm
    prompts = PROMPTS[:8]
    tau_trained, tau_random = _tau(model, out, prompts), _tau(model, rand_dir, prompts)
    assert tau_trained > tau_random + 0.8, (tau_trained, tau_random)
    assert tau_trained > 2.0

    # resume: the same command with more steps continues from step 30 without redoing features
    (ckpts[-1]).rename(ckpts[-1])   # the latest checkpoint stays in place
    r = CliRunner().invoke(train_head, [*args[:args.index("--steps")], "--steps", "36",
                                        *args[args.index("--steps") + 2:]], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    rec2 = json.loads((out / "training_record.json").read_text())
    assert rec2["steps"] == 36
    log = [json.loads(line) for line in (out / "work" / "train_log.jsonl").read_text().split("\n") if line]
    assert [x["step"] for x in log] == list(range(1, 37))

    # --init-head continues that head: its weights and draft vocabulary (not a new one of --draft-vocab-size)
    out2 = tmp_path / "continued"
    cont = [*args[:args.index("--out")], "--out", str(out2), "--init-head", str(out),
            *args[args.index("--out") + 2:]]
    i = cont.index("--draft-vocab-size")
    r = CliRunner().invoke(train_head, [*cont[:i + 1], "128", *cont[i + 2:]])     # a size it would not use: refused
    assert r.exit_code == 2 and "--init-head keeps that head's draft vocabulary" in r.output, r.output
    del cont[i:i + 2]
    cont[cont.index("--steps") + 1] = "2"
    cont[cont.index("--lr") + 1] = "1e-6"
    r = CliRunner().invoke(train_head, cont, catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert json.loads((out2 / "config.json").read_text())["draft_vocab_size"] == 256
    from safetensors.torch import load_file
    assert torch.equal(load_file(str(out2 / "model.safetensors"))["d2t"], load_file(str(out / "model.safetensors"))["d2t"])
    rec3 = json.loads((out2 / "training_record.json").read_text())
    assert rec3["metrics"]["heldout_acc"][0] > rec["metrics"]["heldout_acc"][0] - 0.05
    wrong = [*cont[:cont.index("--format") + 1], "eagle1", *cont[cont.index("--format") + 2:]]
    wrong[wrong.index("--out") + 1] = str(tmp_path / "wrong")
    r = CliRunner().invoke(train_head, wrong)
    assert r.exit_code != 0 and "--init-head" in r.output and "eagle3" in r.output


def test_train_head_eagle1_online(sharp_model, data_file, tmp_path):
    """EAGLE-1 format with features computed on the fly (nothing stored): a loadable head that
    the engine speculates with, losslessly, and that learned something."""
    from eagle_worker.llm import LLM
    from eagle_worker.sampling_params import SamplingParams
    from eagle_worker.speculative.config import SpecConfig

    out = tmp_path / "h1"
    args = ["--target", str(sharp_model), "--format", "eagle1", "--data", str(data_file), "--out", str(out),
            "--prompt-format", "{prompt}", "--self-distill", "1000", "--distill-tokens", "40", "--max-tokens", "64",
            "--batch-tokens", "512", "--steps", "16", "--lr", "1e-2", "--warmup-steps", "4", "--ttt-steps", "2",
            "--checkpoint-every", "8", "--eval-every", "16", "--heldout", "4", "--eval-prompts", "0",
            "--online", "--distill-batch", "7", "--feature-batch-tokens", "100", "--train-seconds", "1e6",
            "--device", "cpu", "--no-progress"]
    r = CliRunner().invoke(train_head, args, catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert not (out / "work" / "features" / "train").exists()
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    rec = json.loads((out / "training_record.json").read_text())
    assert rec["online"] and rec["metrics"]["heldout_acc"][0] > 0.3
    params = SamplingParams(max_tokens=16, temperature=0.0)
    plain = LLM(model=str(sharp_model)).generate(PROMPTS[:4], params)
    spec = LLM(model=str(sharp_model), spec=SpecConfig(draft=str(out), lookup=False, tree="chain", depth=3, adaptive=False))
    outs = spec.generate(PROMPTS[:4], params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert sum(o.metrics["mean_accepted_tokens"] for o in outs) / 4 > 1.3


def test_self_distill_batches_and_time_budget(sharp_model, tmp_path):
    """Batches of any size give the same continuations; a spent time budget starts no batch, and
    a budget left open distils every prompt."""
    from eagle_worker.llm import LLM
    from eagle_worker.training.distill import self_distill

    llm = LLM(model=str(sharp_model))
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS[:5]]
    whole = self_distill(llm, prompts, ["s"] * 5, 6, batch=64, progress=False)
    assert [e.ids[:e.loss_start] for e in whole] == prompts and all(len(e.ids) == e.loss_start + 6 for e in whole)
    assert self_distill(llm, prompts, ["s"] * 5, 6, batch=2, progress=False, seconds=1e9) == whole
    assert self_distill(llm, prompts, ["s"] * 5, 6, batch=2, progress=False, seconds=0) == []


def test_a_distillation_file_cut_mid_line_resumes(sharp_model, tmp_path):
    """A kill during the append leaves a last line without its newline: it is dropped (from the
    file too) and its prompt distilled again; a broken line elsewhere is named with its file."""
    from eagle_worker.llm import LLM
    from eagle_worker.training.distill import self_distill

    llm = LLM(model=str(sharp_model))
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS[:5]]
    whole = self_distill(llm, prompts, ["s"] * 5, 6, batch=2, progress=False)
    partial = tmp_path / "distill_train.partial.jsonl"
    self_distill(llm, prompts[:3], ["s"] * 3, 6, batch=3, progress=False, partial=partial)
    text = partial.read_text()
    partial.write_text(text[:len(text) - len(text.split("\n")[-2]) // 2 - 1])     # the third record cut
    assert self_distill(llm, prompts, ["s"] * 5, 6, batch=2, progress=False, partial=partial) == whole
    lines = partial.read_text().split("\n")
    assert len(lines) == 6 and lines[-1] == "" and all(json.loads(x)["example"] for x in lines[:-1])
    partial.write_text(text.replace("\n", "\nnot json\n", 1))
    with pytest.raises(ValueError, match=f"{partial}: line 2: not a self-distillation record"):
        self_distill(llm, prompts, ["s"] * 5, 6, batch=2, progress=False, partial=partial)


def test_no_progress_reaches_self_distillation(sharp_model, data_file, tmp_path, monkeypatch):
    from eagle_worker.training import pipeline

    seen = []
    distill = pipeline.self_distill
    monkeypatch.setattr(pipeline, "self_distill", lambda *a, **k: seen.append(k.get("progress", True)) or distill(*a, **k))
    args = ["--target", str(sharp_model), "--data", str(data_file), "--out", str(tmp_path / "h"), "--prompt-format",
            "{prompt}", "--draft-vocab-size", "64", "--self-distill", "8", "--distill-tokens", "4", "--max-tokens", "32",
            "--steps", "1", "--heldout", "2", "--eval-prompts", "0", "--no-progress"]
    r = CliRunner().invoke(train_head, args, catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert seen == [False, False]        # the training and the held-out prompts


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_train_head_on_a_missing_gpu_says_so(sharp_model, data_file, tmp_path):
    args = ["--target", str(sharp_model), "--data", str(data_file), "--out", str(tmp_path / "h"),
            "--device", "cuda", "--no-progress"]
    r = CliRunner().invoke(train_head, args)
    assert r.exit_code == 2 and "'cuda'" in r.output and "CUDA is not available" in r.output
    assert not (tmp_path / "h" / "model.safetensors").exists()
