"""`eaglectl train-head`: train an EAGLE draft head for a target (registered in `eaglectl/main.py`).

Example (the shipped gemma-3-270m head; see eagle_worker/heads/gemma-3-270m/TRAINING.md):
    eaglectl train-head --target gemma-3-270m --format eagle3 --data data/train/gsm8k/train_2500.jsonl:2000 \\
        --out heads/g270 --prompt-format 'Question: {prompt}\\nAnswer:' --self-distill 200
Rerunning the same command resumes (distilled data, feature shards and checkpoints are reused); a
work folder whose examples came from other data or example settings is refused, not reused.
Checkpoints are exported to --out while training runs: training_record.json says "complete": false
until training finished (an interrupted run leaves a usable but unfinished head).
"""
from __future__ import annotations

import shlex
import sys

import click

from eaglectl.common import COUNT, POSITIVE, FiniteFloat


def _frames_a_prompt(frame: str) -> bool:
    """Whether `frame.format(prompt=...)` works and uses the prompt: other fields or a stray brace
    would fail on the first sample, after the target loaded."""
    try:
        return frame.format(prompt="\0") != frame.format(prompt="")
    except (AttributeError, KeyError, IndexError, ValueError):
        return False


def _given_options(ctx: click.Context) -> set[str]:
    """The options typed on the command line (not defaults): what a refusal may blame."""
    return {name for name in ctx.params if ctx.get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE}


def _command_line() -> str:
    argv = sys.argv[1:]
    if "train-head" in argv:
        argv = argv[argv.index("train-head") + 1:]
    return "eaglectl train-head " + " ".join(shlex.quote(a) for a in argv)


@click.command("train-head")
@click.option("--target", required=True, help="Target model: built-in name, local folder or hub id.")
@click.option("--format", "fmt", default="eagle3", show_default=True, type=click.Choice(["eagle3", "eagle1"]))
@click.option("--data", multiple=True, required=True,
              help="Prompt/response file or folder (.json/.jsonl/.parquet); PATH:N takes the first N. Repeatable.")
@click.option("--out", required=True, help="Output folder: config.json + model.safetensors + training_record.json "
                   "(\"complete\": false while training).")
@click.option("--work-dir", default=None, help="Features and checkpoints (default OUT/work); reused to resume.")
@click.option("--prompt-format", default="chat", show_default=True,
              help="'chat' (the target's template), or a frame with {prompt}, e.g. 'Question: {prompt}\\nAnswer:'.")
@click.option("--init-head", default=None,
              help="Continue training this head folder (its weights and draft vocabulary) instead of a fresh one.")
@click.option("--draft-vocab-size", default=16384, show_default=True, type=POSITIVE, help="EAGLE-3 draft vocabulary.")
@click.option("--steps", default=None, type=POSITIVE, help="Optimizer steps (default: --epochs over the data).")
@click.option("--epochs", default=1.0, show_default=True, type=FiniteFloat(min=0, min_open=True))
@click.option("--train-seconds", default=None, type=FiniteFloat(min=0, min_open=True),
              help="Time budget for training: the planned steps are cut to what the measured pace fits.")
@click.option("--lr", default=3e-4, show_default=True, type=FiniteFloat(min=0, min_open=True))
@click.option("--warmup-steps", default=50, show_default=True, type=COUNT)
@click.option("--batch-tokens", default=4096, show_default=True, type=POSITIVE,
              help="Tokens per optimizer step (at least one row: --max-tokens; the default grows to one row).")
@click.option("--max-tokens", default=512, show_default=True, type=click.IntRange(min=3),
              help="Max tokens per example (prompt + response; at least 3: a prompt token and 2 to train on).")
@click.option("--ttt-steps", default=3, show_default=True, type=POSITIVE, help="Unrolled draft steps (training-time test).")
@click.option("--self-distill", default=0, show_default=True, type=COUNT,
              help="Prompts whose responses the target regenerates.")
@click.option("--distill-tokens", default=128, show_default=True, type=click.IntRange(min=2),
              help="New tokens per self-distilled response (a shorter one is dropped).")
@click.option("--distill-batch", default=64, show_default=True, type=POSITIVE,
              help="Prompts per self-distillation batch (larger on a GPU).")
@click.option("--distill-seconds", default=None, type=FiniteFloat(min=0),
              help="Time budget for self-distilling the training prompts; those not reached are left out.")
@click.option("--feature-batch-tokens", default=2048, show_default=True, type=POSITIVE,
              help="Tokens per target forward when computing training features (larger on a GPU).")
@click.option("--fixed-text", default=None, type=COUNT,
              help="Keep at most this many of the other samples as fixed text (default: all).")
@click.option("--drop-responses", is_flag=True, help="Ignore responses in the data (prompt-only text or self-distill).")
@click.option("--heldout", default=16, show_default=True, type=COUNT, help="Held-out samples for acceptance reporting.")
@click.option("--checkpoint-every", default=200, show_default=True, type=POSITIVE)
@click.option("--eval-every", default=200, show_default=True, type=POSITIVE)
@click.option("--eval-prompts", default=8, show_default=True, type=COUNT,
              help="Held-out prompts for the final engine tau (0: skip).")
@click.option("--online", is_flag=True, help="Compute training features on the fly, store none (targets too large to store).")
@click.option("--full-vocab-labels", is_flag=True, help="Score the full vocabulary when extracting (exact argmax mask; slower).")
@click.option("--dtype", default="float32", show_default=True, type=click.Choice(["bfloat16", "float32"]),
              help="Target dtype for distillation and features.")
@click.option("--bf16", default="auto", show_default=True, type=click.Choice(["auto", "on", "off"]),
              help="bf16 autocast for training; auto = on CUDA only (slower than fp32 on our CPUs, measured).")
@click.option("--device", default="cpu", show_default=True,
              help="Where the target and the head run: cpu, cuda or cuda:N (features are kept on the host either way).")
@click.option("--threads", default=None, type=POSITIVE, help="torch threads.")
@click.option("--seed", default=0, show_default=True, type=click.IntRange(0, 2**63 - 1))
@click.option("--no-progress", is_flag=True)
def train_head(target, fmt, data, out, work_dir, prompt_format, init_head, draft_vocab_size, steps, epochs, train_seconds,
               lr, warmup_steps, batch_tokens, max_tokens, ttt_steps, self_distill, distill_tokens, distill_batch,
               distill_seconds, feature_batch_tokens, fixed_text, drop_responses, heldout, checkpoint_every, eval_every,
               eval_prompts, online, full_vocab_labels, dtype, bf16, device, threads, seed, no_progress):
    """Train an EAGLE-3 (or EAGLE-1) draft head for TARGET on prompts/responses from --data."""
    import json

    from eagle_worker.training.pipeline import PipelineConfig, run
    from eagle_worker.training.trainer import TrainConfig

    if prompt_format != "chat" and not _frames_a_prompt(prompt_format):
        click.echo(f"error: --prompt-format must be 'chat' or a frame with {{prompt}} (and no other {{...}}), "
                   f"not {prompt_format!r}", err=True)
        sys.exit(2)
    row_len = max(64, max_tokens)
    given = _given_options(click.get_current_context())
    if "batch_tokens" in given and batch_tokens < row_len:
        click.echo(f"error: --batch-tokens {batch_tokens} is less than one packed row of {row_len} tokens "
                   f"(--max-tokens, at least 64); give at least {row_len}", err=True)
        sys.exit(2)
    if "draft_vocab_size" in given and (fmt == "eagle1" or init_head):
        why = "an EAGLE-1 head decodes with the target's vocabulary" if fmt == "eagle1" else \
            "--init-head keeps that head's draft vocabulary"
        click.echo(f"error: --draft-vocab-size is not used here ({why}); drop it", err=True)
        sys.exit(2)
    tc = TrainConfig(steps=steps, epochs=epochs, seconds=train_seconds, lr=lr, warmup_steps=warmup_steps,
                     batch_tokens=max(batch_tokens, row_len),
                     row_len=row_len, ttt_steps=ttt_steps, bf16=bf16, checkpoint_every=checkpoint_every,
                     eval_every=eval_every, seed=seed, threads=threads)
    cfg = PipelineConfig(target=target, out=out, data=list(data), format=fmt, work_dir=work_dir, dtype=dtype, device=device,
                         prompt_format=prompt_format.replace("\\n", "\n"), max_tokens=max_tokens,
                         draft_vocab_size=draft_vocab_size, init_head=init_head, self_distill=self_distill,
                         distill_tokens=distill_tokens, distill_batch=distill_batch, distill_seconds=distill_seconds,
                         extract_batch_tokens=feature_batch_tokens, fixed_text=fixed_text,
                         drop_responses=drop_responses, heldout=heldout, full_vocab_labels=full_vocab_labels, online=online,
                         eval_prompts=eval_prompts, seed=seed, train=tc,
                         command=_command_line())
    try:
        record = run(cfg, progress=not no_progress)
    except ValueError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    except OSError as e:      # disk full, a folder made read-only mid-run: one line, not a traceback
        where = f"{e.filename}: " if e.filename else ""
        click.echo(f"error: {where}{e.strerror or e}", err=True)
        sys.exit(1)
    click.echo(json.dumps({k: record.get(k) for k in ("steps", "train_tokens", "metrics", "engine")}, default=str))


if __name__ == "__main__":     # `python -m eaglectl.train ...` = `eaglectl train-head ...`
    train_head()
