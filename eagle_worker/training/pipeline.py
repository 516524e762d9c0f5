"""`train-head` end to end: samples -> (self-distilled) examples -> draft vocabulary -> feature
shards -> training -> a published head + config.json + training record.

Everything lands in the work folder and is reused on a rerun of the same command (distilled
responses, vocabulary, feature shards, checkpoints), so a killed run resumes where it stopped.
A rerun whose samples or example settings differ is refused (workdir.py); the training record
says "complete": false on the heads exported at checkpoints, true once training finished.
"""
from __future__ import annotations

import gc
import json
import os
import random
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from eagle_worker.config import EngineConfig
from eagle_worker.training.data import Sample, load_data, prompt_key
from eagle_worker.training.distill import self_distill
from eagle_worker.training.features import Extractor, FeatureSpec, FeatureStore, OnlineFeatures, extract
from eagle_worker.training.preflight import check_folder, check_init_head, check_max_tokens, local_context, native_context
from eagle_worker.training.render import Example, prompt_ids, render
from eagle_worker.training.trainer import TrainConfig, Trainer
from eagle_worker.training.vocab import coverage, draft_vocab, token_counts
from eagle_worker.training.workdir import check_stamp, examples_stamp, write_json, write_stamp


@dataclass
class PipelineConfig:
    target: str
    out: str
    data: list[str]
    format: str = "eagle3"                 # "eagle3" | "eagle1"
    work_dir: str | None = None            # features, checkpoints; default <out>/work
    dtype: str = "float32"                 # target dtype for distillation and features (fp32 was faster on our CPU)
    device: str = "cpu"                    # where the target and the head run: "cpu", "cuda", "cuda:N"
    prompt_format: str = "chat"            # "chat" | a frame with {prompt} | "{prompt}"
    max_tokens: int = 512                  # per example (prompt + response)
    draft_vocab_size: int = 16384
    self_distill: int = 0                  # prompts whose response the target regenerates
    distill_tokens: int = 128
    distill_batch: int = 64                # prompts per self-distillation generate() call
    distill_seconds: float | None = None   # stop starting new distillation batches after this long
    fixed_text: int | None = None          # cap on the other training samples kept as fixed text (None: all)
    drop_responses: bool = False           # ignore given responses (prompt-only prefill or distill)
    heldout: int = 16                      # held-out samples (acceptance is reported on them)
    topk: int = 8
    full_vocab_labels: bool = False        # score the whole vocabulary at extraction (slower on CPU)
    extract_batch_tokens: int = 2048
    shard_tokens: int = 16384
    init_from_target: bool = True         # EAGLE-3: the draft LM head starts from the target's rows
    init_head: str | None = None           # continue training this head (its weights and draft vocabulary)
    online: bool = False                   # compute train features per chunk, store nothing (large targets)
    eval_prompts: int = 8                  # engine tau on this many held-out prompts at the end
    eval_new_tokens: int = 64
    seed: int = 0
    train: TrainConfig = field(default_factory=TrainConfig)
    command: str = ""

    @property
    def kind(self) -> str:
        return {"eagle3": "eagle3", "eagle1": "eagle", "eagle": "eagle"}[self.format]

    def check(self) -> None:
        """What the options cannot say alone, refused before anything loads or is written."""
        for opt, folder in (("--out", self.out), ("--work-dir", self.work_dir)):
            if folder:
                check_folder(opt, folder)
        if self.fixed_text == 0 and not self.self_distill:
            raise ValueError("--fixed-text 0 without --self-distill leaves nothing to train on")
        if self.self_distill and self.max_tokens <= self.distill_tokens:
            raise ValueError(f"--max-tokens {self.max_tokens} leaves no room for the prompt of a self-distilled "
                             f"example (prompt + --distill-tokens {self.distill_tokens})")
        if self.kind == "eagle3" and not self.init_head and self.draft_vocab_size < self.topk:
            raise ValueError(f"--draft-vocab-size {self.draft_vocab_size} is below the {self.topk} target "
                             "tokens kept per position")
        if self.init_head:
            check_init_head(self.init_head)
        check_max_tokens(self.max_tokens, local_context(self.target), self.target)


@torch.no_grad()
def init_output_from_target(head, model, vocab_ids: torch.Tensor) -> None:
    """Start the draft LM head from the target's rows for the draft vocabulary (SpecForge does the
    same): the head then learns where to point its hidden state, not the whole output geometry.
    The norm stays at 1: Gemma's final-norm gains (mean 26, max 301) on a random initial state
    gave logits in the hundreds and a loss that took most of a CPU budget to come down (measured)."""
    head.lm_head.weight.copy_(model.lm_head.weight[vocab_ids.to(model.lm_head.weight.device)].float())


def _initial_head(cfg: PipelineConfig, model, hf_config):
    """The head to continue from; it must be of the format being trained."""
    from eagle_worker.speculative.head_loader import load_draft_head

    head = load_draft_head(cfg.init_head, model, hf_config)
    if head.kind != cfg.kind:
        raise ValueError(f"--init-head {cfg.init_head} is an {head.kind} head, but --format is {cfg.format}")
    return head


def _head_vocab_ids(head, V: int) -> torch.Tensor:
    """Target ids of the head's draft vocabulary (ascending); the whole vocabulary for EAGLE-1."""
    if head.kind != "eagle3":
        return torch.arange(V)
    d2t = head.d2t.long().cpu()
    return torch.arange(len(d2t)) + d2t


def _log(msg: str) -> None:
    print(f"[train-head {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _examples_file(path: Path, make, seal=None) -> list[Example]:
    if path.exists():
        return [Example(**json.loads(line)) for line in path.read_text().split("\n") if line.strip()]
    exs = make()
    if seal:
        seal()
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(asdict(e)) + "\n" for e in exs))
    tmp.replace(path)
    return exs


def chat_template(cfg: PipelineConfig, llm) -> str | None:
    """The target's template for `--prompt-format chat`; a target without one is refused by name."""
    if cfg.prompt_format != "chat":
        return None
    if llm.engine.chat_template is None:
        raise ValueError(f"--prompt-format chat: model {cfg.target!r} has no chat template; "
                         "give a frame with {prompt} instead, e.g. 'Question: {prompt}\\nAnswer:'")
    return llm.engine.chat_template


def split_samples(cfg: PipelineConfig, samples: list[Sample]) -> tuple[list[Sample], list[Sample]]:
    """(held-out, train), seeded, by prompt (`prompt_key`): one sample of each of `--heldout`
    prompts (at most a tenth of them) is held out, and no sample of a held-out prompt is trained
    on -- a question asked twice (OpenAssistant's several replies, ShareGPT repeats) would
    otherwise be measured on what was trained. Refused when nothing is left to train on."""
    groups: dict[str, list[Sample]] = {}
    for s in samples:
        groups.setdefault(prompt_key(s.prompt), []).append(s)
    order = list(groups.values())
    random.Random(cfg.seed).shuffle(order)
    n_held = min(cfg.heldout, max(1, len(order) // 10))
    if n_held == len(order):
        raise ValueError(f"no training examples: the {len(samples)} sample(s) in {', '.join(cfg.data)} "
                         f"have {len(order)} distinct prompt(s), all held out (--heldout)")
    return [g[0] for g in order[:n_held]], [s for g in order[n_held:] for s in g]


def build_examples(cfg: PipelineConfig, llm, work: Path, held_s: list[Sample], train_s: list[Sample], seal=None,
                   progress: bool = True) -> tuple[list[Example], list[Example], list[list[int]]]:
    """(train, held-out, held-out prompt ids); cached in the work folder. `seal()` is called before
    the first file made from them is written (the work folder's record of what built them)."""
    tok = llm.tokenizer
    template = chat_template(cfg, llm)
    _log(f"{len(held_s) + len(train_s)} samples from {len(cfg.data)} source(s); {len(held_s)} held out")
    n_distill = min(cfg.self_distill, len(train_s))
    max_prompt = cfg.max_tokens - cfg.distill_tokens

    def distilled(ss, tag, seconds=None):
        ps = [prompt_ids(tok, s, cfg.prompt_format, template) for s in ss]
        keep = [(p if len(p) <= max_prompt else p[:1] + p[len(p) - max_prompt + 1:], s.source) for p, s in zip(ps, ss)]
        _log(f"self-distilling {len(keep)} {tag} prompts x {cfg.distill_tokens} tokens")
        if seal:
            seal()
        return self_distill(llm, [k[0] for k in keep], [k[1] for k in keep], cfg.distill_tokens,
                            batch=cfg.distill_batch, progress=progress, partial=work / f"distill_{tag}.partial.jsonl",
                            seconds=seconds)

    def fixed(ss):
        return [e for s in ss if (e := render(tok, s, cfg.prompt_format, template, cfg.max_tokens)) is not None]

    def train_make():   # raises before caching, so a rerun with other options is not stuck on an empty set
        rest = train_s[n_distill:] if cfg.fixed_text is None else train_s[n_distill:n_distill + cfg.fixed_text]
        exs = (distilled(train_s[:n_distill], "train", cfg.distill_seconds) if n_distill else []) + fixed(rest)
        if not exs:
            raise ValueError(f"no training examples: of {n_distill} self-distilled and {len(rest)} fixed-text "
                             f"sample(s), none left a response to train on within --max-tokens {cfg.max_tokens}")
        return exs

    def held_make():   # the held-out set is what serving sees: the target's own continuations
        return distilled(held_s, "held-out") if cfg.self_distill else fixed(held_s)

    train = _examples_file(work / "train_examples.jsonl", train_make, seal)
    held = _examples_file(work / "heldout_examples.jsonl", held_make, seal)
    # what the engine is given: the prompt; all of a prompt-only example (trained from its first token: render)
    held_prompts = [e.ids if e.loss_start <= 1 else e.ids[:e.loss_start] for e in held]
    return train, held, held_prompts


def _export(head, out: Path, record: dict) -> None:
    """The head as trained, with its own config (an --init-head's aux layers, rope, sizes), in bf16
    (halves the file), plus the record. Each file is written whole in a staging folder and renamed
    into --out, config.json last: a kill never leaves a half-written file there. (Not the folder
    at once: --out holds the work folder by default.)"""
    from eagle_worker.speculative.head_loader import build_head_like_target
    from eagle_worker.speculative.head_saver import save_draft_head

    pub = build_head_like_target(head.config, head.target, head.vocab, dtype=torch.bfloat16)
    pub.load_state_dict(head.state_dict())
    stage = out / ".export.tmp"
    shutil.rmtree(stage, ignore_errors=True)
    save_draft_head(pub, stage)
    write_json(stage / "training_record.json", record)
    for name in ("model.safetensors", "training_record.json", "config.json"):
        os.replace(stage / name, out / name)
    shutil.rmtree(stage)


def engine_tau(target: str, dtype: str, head_dir: str | Path, prompts: list[list[int]], new_tokens: int,
               depth: int = 5, tree: str = "chain", device: str = "cpu") -> dict:
    """Mean accepted tokens per target forward with the head, measured by our engine (greedy)."""
    from eagle_worker.llm import LLM
    from eagle_worker.sampling_params import SamplingParams
    from eagle_worker.speculative.config import SpecConfig

    llm = LLM(model=target, dtype=dtype, device=device,
              spec=SpecConfig(draft=str(head_dir), lookup=False, tree=tree, depth=depth, adaptive=False))
    outs = llm.generate(prompts, SamplingParams(max_tokens=new_tokens, temperature=0.0))
    taus = [o.metrics.get("mean_accepted_tokens", 1.0) for o in outs]
    return {"engine_tau": sum(taus) / len(taus), "engine_tau_per_prompt": taus, "tree": tree, "depth": depth,
            "acceptance_rate_per_depth": llm.engine.stats().get("acceptance_rate_per_depth")}


def _distill_engine_args(cfg: PipelineConfig) -> dict:
    """The training engine holds a whole distillation batch at once (KV for every sequence, prefill
    chunks to match) and does not speculate: batches are large, where drafting pays least, and a
    head being (re)trained for this target must not need one to exist."""
    block = EngineConfig.block_size
    return {"spec": None, "max_num_seqs": cfg.distill_batch,
            "max_num_batched_tokens": max(1024, 16 * cfg.distill_batch),
            "num_kv_blocks": cfg.distill_batch * (-(-cfg.max_tokens // block) + 1)}


def run(cfg: PipelineConfig, progress: bool = True) -> dict:
    cfg.check()
    held_s, train_s = split_samples(cfg, load_data(cfg.data, drop_responses=cfg.drop_responses))
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    out = Path(cfg.out)
    work = Path(cfg.work_dir) if cfg.work_dir else out / "work"
    stamp = examples_stamp(cfg, held_s, train_s)
    check_stamp(work, stamp, "--work-dir" if cfg.work_dir else "work folder")
    t_start = time.time()
    record, held_prompts = _train(cfg, out, work, held_s, train_s, stamp, progress)
    # the training state (target, engine, head, optimizer, stores) is gone with _train's frame, but
    # the trainer and its checkpoint hook hold each other: collect them before a second target loads
    gc.collect()
    if torch.cuda.is_available() and str(cfg.device).startswith("cuda"):
        torch.cuda.empty_cache()
    prompts = held_prompts[:cfg.eval_prompts]
    if prompts:      # none with --heldout 0
        record["engine"] = engine_tau(cfg.target, cfg.dtype, out, prompts, cfg.eval_new_tokens,
                                      depth=max(2, cfg.train.ttt_steps + 1), device=cfg.device)
        _log(f"engine tau on {len(prompts)} held-out prompts: {record['engine']['engine_tau']:.3f}")
    record["wall_s"] = time.time() - t_start
    write_json(out / "training_record.json", record)
    return record


def _train(cfg: PipelineConfig, out: Path, work: Path, held_s: list[Sample], train_s: list[Sample], stamp: dict,
           progress: bool) -> tuple[dict, list[list[int]]]:
    """Examples, vocabulary, features, training and the finished head's export: (record, held-out prompts)."""
    from eagle_worker.llm import LLM
    from eagle_worker.speculative.head_init import new_head

    llm = LLM(model=cfg.target, dtype=cfg.dtype, device=cfg.device, **_distill_engine_args(cfg))
    runner = llm.engine.runner
    model, hf_config = runner.model, runner.hf_config
    chat_template(cfg, llm)      # before anything is written
    context = native_context(hf_config)     # rotary rows for the feature forward; the engine's limit when it distils
    check_max_tokens(cfg.max_tokens, min(context, llm.engine.max_model_len) if cfg.self_distill else context, cfg.target)
    work.mkdir(parents=True, exist_ok=True)
    train_ex, held_ex, held_prompts = build_examples(cfg, llm, work, held_s, train_s, lambda: write_stamp(work, stamp),
                                                     progress=progress)
    n_train = sum(len(e.ids) for e in train_ex)
    _log(f"{len(train_ex)} train examples, {n_train} tokens; {len(held_ex)} held-out")

    V = int(model.vocab_size)
    counts = token_counts(train_ex, V)
    start = _initial_head(cfg, model, hf_config) if cfg.init_head else None
    if start is not None:
        vocab_ids = _head_vocab_ids(start, V)
        cov, aux = coverage(counts, vocab_ids), start.aux_layers
        _log(f"continuing {cfg.init_head}: draft vocabulary {len(vocab_ids)} tokens covers {cov:.3f} of response tokens")
    elif cfg.kind == "eagle3":
        vocab_ids = draft_vocab(counts, cfg.draft_vocab_size)
        cov = coverage(counts, vocab_ids)
        _log(f"draft vocabulary {len(vocab_ids)} tokens covers {cov:.3f} of response tokens")
        aux = (2, model.num_layers // 2, model.num_layers - 3)
    else:
        vocab_ids, cov, aux = torch.arange(V), 1.0, ()
    label_ids = None if cfg.full_vocab_labels or cfg.kind != "eagle3" else vocab_ids
    spec = FeatureSpec(cfg.kind, aux, cfg.topk, label_ids)
    extract(model, held_ex, work / "features" / "heldout", spec, cfg.target, cfg.extract_batch_tokens, progress=False)
    held_store = FeatureStore(work / "features" / "heldout")
    # training streams its first epoch from the train shards as they are extracted
    if cfg.online:
        train_store, produce = OnlineFeatures(model, train_ex, spec, cfg.extract_batch_tokens, cfg.shard_tokens), None
    else:
        extractor = Extractor(model, train_ex, work / "features" / "train", spec, cfg.target, cfg.extract_batch_tokens,
                              cfg.shard_tokens, progress=progress)
        train_store, produce = FeatureStore(work / "features" / "train", require_complete=False), extractor.next_shard

    if start is not None:
        head = start.float()
    else:
        head = new_head(cfg.kind, model, hf_config, vocab_ids if cfg.kind == "eagle3" else None, seed=cfg.seed).float()
        if cfg.kind == "eagle3" and cfg.init_from_target:
            init_output_from_target(head, model, vocab_ids)
    t2d_index = torch.full((V,), -1, dtype=torch.long)
    t2d_index[vocab_ids] = torch.arange(len(vocab_ids))
    record = {"target": cfg.target, "format": cfg.format, "command": cfg.command, "data": cfg.data,
              "prompt_format": cfg.prompt_format, "train_examples": len(train_ex), "train_tokens": n_train,
              "heldout_examples": len(held_ex), "self_distilled": cfg.self_distill, "online": cfg.online,
              "draft_vocab_size": len(vocab_ids), "draft_vocab_coverage": cov, "train_config": asdict(cfg.train),
              "complete": False}    # checkpoints exported mid-training say so; true once training finished

    def on_checkpoint(step, metrics):
        record.update({"steps": step, "epochs_seen": trainer.epochs_seen, "metrics": metrics})
        _export(head, out, record)

    trainer = Trainer(head, train_store, held_store, cfg.train, work, t2d_index, on_checkpoint, produce, log=_log)
    if trainer.resume():
        _log(f"resumed at step {trainer.step} (epoch {trainer.epoch})")
    # only now: a run refused for a mismatch above leaves the folder's record of the run it holds
    (work / "pipeline_config.json").write_text(json.dumps(asdict(cfg), indent=1) + "\n")
    t0 = time.time()
    if trainer.done():
        why = (f"its {cfg.train.seconds:g} s budget (--train-seconds) is spent" if trainer.step < trainer.total
               else f"{trainer.total} steps were planned")
        _log(f"training finished at step {trainer.step}: {why}; nothing left to train")
        metrics = trainer.evaluate()
    else:
        budget = f" at most, in what is left of {cfg.train.seconds:g} s" if cfg.train.seconds else ""
        _log(f"training {trainer.total} steps{budget} (~{trainer.spe}/epoch), bf16 autocast: {trainer.autocast}")
        metrics = trainer.fit(progress=progress)
    record.update({"steps": trainer.step, "epochs_seen": trainer.epochs_seen, "metrics": metrics,
                   "train_s": time.time() - t0, "complete": True})
    _export(head, out, record)
    return record, held_prompts
