"""What a `train-head` run leaves: the head as trained (an --init-head's own config kept), written
so that a kill mid-export leaves the previous head whole; engine tau measured on the held-out
prompts themselves, after the training state is freed."""
from __future__ import annotations

import gc
import json
import weakref

import pytest
import torch

from tests.eagle_worker.training.train_cli import ROWS, train, write_rows


def _data(tmp_path, rows=ROWS):
    return write_rows(tmp_path / "d.jsonl", rows)


def _train(target, data, out, *args):
    return train("--target", target, "--data", data, "--out", out, "--max-tokens", "32", "--steps", "1", *args)


@pytest.fixture(scope="module")
def target(tiny_model_dir):
    from eagle_worker.llm import LLM

    path = tiny_model_dir("llama")
    llm = LLM(model=str(path))
    yield path, llm.engine.runner.model, llm.engine.runner.hf_config
    del llm


def test_an_init_heads_own_config_is_exported(target, tmp_path):
    """Aux layers, norm placement, rope and MLP width other than a fresh head's survive training."""
    from safetensors.torch import load_file, save_file

    from eagle_worker.speculative.head_init import new_head
    from eagle_worker.speculative.head_saver import save_draft_head

    path, model, hf_config = target
    init = tmp_path / "init"
    save_draft_head(new_head("eagle3", model, hf_config, torch.arange(64)), init)
    cfg = json.loads((init / "config.json").read_text())
    cfg.update({"eagle_aux_hidden_state_layer_ids": [1, 2, 3], "norm_before_residual": True, "rope_theta": 500000.0,
                "intermediate_size": 256})
    (init / "config.json").write_text(json.dumps(cfg))
    sd = load_file(str(init / "model.safetensors"))
    for k in ("gate_proj", "up_proj"):
        sd[f"midlayer.mlp.{k}.weight"] = torch.randn(256, 64) * 0.02
    sd["midlayer.mlp.down_proj.weight"] = torch.randn(64, 256) * 0.02
    save_file(sd, str(init / "model.safetensors"))

    out = tmp_path / "out"
    r = _train(path, _data(tmp_path), out, "--init-head", str(init), "--eval-prompts", "0")
    assert r.exit_code == 0, r.output
    got = json.loads((out / "config.json").read_text())
    assert got["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3] and got["norm_before_residual"] is True
    assert got["rope_theta"] == 500000.0 and got["intermediate_size"] == 256
    assert load_file(str(out / "model.safetensors"))["midlayer.mlp.down_proj.weight"].shape == (64, 256)


def test_a_kill_during_the_export_leaves_the_previous_head_whole(target, tmp_path, monkeypatch):
    import safetensors.torch

    from eagle_worker.speculative.head_init import new_head
    from eagle_worker.training.pipeline import _export

    _, model, hf_config = target
    head = new_head("eagle3", model, hf_config, torch.arange(64)).float()
    out = tmp_path / "out"
    out.mkdir()
    _export(head, out, {"steps": 1})
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    save = safetensors.torch.save_file

    def killed_while_writing(tensors, filename, *a, **k):
        save(tensors, filename, *a, **k)
        with open(filename, "r+b") as f:
            f.truncate(100)                       # half written
        raise KeyboardInterrupt

    monkeypatch.setattr(safetensors.torch, "save_file", killed_while_writing)
    with torch.no_grad():
        head.fc.weight.add_(1.0)
    with pytest.raises(KeyboardInterrupt):
        _export(head, out, {"steps": 2})
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before


def _engine_tau_sees(monkeypatch, check):
    """Replace engine tau by `check(prompts)`, called where it would run."""
    from eagle_worker.training import pipeline

    def fake_engine_tau(target, dtype, head_dir, prompts, new_tokens, **k):
        check(prompts)
        return {"engine_tau": 1.0}

    monkeypatch.setattr(pipeline, "engine_tau", fake_engine_tau)


def test_engine_tau_measures_the_held_out_prompts_not_bos(target, tmp_path, monkeypatch):
    """Held-out samples without a response and no --self-distill: measured on their prompt."""
    from transformers import AutoTokenizer

    seen = []
    _engine_tau_sees(monkeypatch, seen.extend)
    r = _train(target[0], _data(tmp_path, [{"prompt": r["prompt"]} for r in ROWS]), tmp_path / "out",
               "--heldout", "4", "--eval-prompts", "4", "--max-tokens", "128")
    assert r.exit_code == 0, r.output
    tok = AutoTokenizer.from_pretrained(str(target[0]))
    framed = {tuple(tok(f"Q: {r['prompt']}\nA:")["input_ids"]) for r in ROWS}
    assert len(seen) == 4 and all(tuple(p) in framed for p in seen), seen


def test_the_training_state_is_freed_before_engine_tau(target, tmp_path, monkeypatch):
    """By then nothing holds the training target, head or optimizer (a GPU would hold two targets)."""
    from eagle_worker.training import pipeline

    alive = []

    class Watched(pipeline.Trainer):
        def __init__(self, head, *a, **k):
            super().__init__(head, *a, **k)
            alive.extend(weakref.ref(x) for x in (self, head, head.target, self.opt))

    left = []

    def check(prompts):
        gc.collect()
        left.extend(r for r in alive if r() is not None)

    monkeypatch.setattr(pipeline, "Trainer", Watched)
    _engine_tau_sees(monkeypatch, check)
    r = _train(target[0], _data(tmp_path), tmp_path / "out", "--heldout", "4", "--eval-prompts", "2")
    assert r.exit_code == 0, r.output
    assert len(alive) == 4 and left == []
