"""`eaglectl`: the command line. Heavy imports happen inside commands so `--help` stays fast."""
from __future__ import annotations

import json
import sys

import click


@click.group()
@click.version_option(package_name="eagle-serve")
def main() -> None:
    """Serve and batch-run LLMs with EAGLE speculative decoding."""


def _fail(msg: str) -> None:
    click.echo(f"error: {msg}", err=True)
    sys.exit(2)


@main.command()
@click.option("--model", default="gemma-3-270m", show_default=True, help="Built-in name, local folder or hub id.")
@click.option("--prompt", required=True, help="Prompt text.")
@click.option("--max-tokens", default=64, show_default=True, type=int)
@click.option("--temperature", default=0.0, show_default=True, type=float)
@click.option("--top-p", default=1.0, show_default=True, type=float)
@click.option("--top-k", default=-1, show_default=True, type=int)
@click.option("--seed", default=None, type=int)
@click.option("--dtype", default="float32", show_default=True, type=click.Choice(["float32", "bfloat16", "float16"]))
@click.option("--device", default="cpu", show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the text.")
def generate(model, prompt, max_tokens, temperature, top_p, top_k, seed, dtype, device, as_json):
    """Generate a completion for one prompt."""
    from eagle_worker import LLM, SamplingParams

    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
        llm = LLM(model=model, dtype=dtype, device=device)
        out = llm.generate([prompt], params)[0]
    except ValueError as e:
        _fail(str(e))
    if as_json:
        click.echo(json.dumps({"text": out.text, "token_ids": out.token_ids,
                               "finish_reason": out.finish_reason, "metrics": out.metrics}))
    else:
        click.echo(out.text)


@main.group()
def bench() -> None:
    """Benchmarks (results printed as a table and written as JSON)."""


@bench.command("decode")
@click.option("--model", default="gemma-3-270m", show_default=True)
@click.option("--dtypes", default="float32,bfloat16", show_default=True)
@click.option("--batch-sizes", default="1,8", show_default=True)
@click.option("--max-tokens", default=64, show_default=True, type=int)
@click.option("--json", "json_out", default="bench/results/decode.json", show_default=True)
def bench_decode(model, dtypes, batch_sizes, max_tokens, json_out):
    """Tokens/s of this engine vs transformers generate, same model and dtype, one run."""
    from bench.decode import run

    run(model=model, dtypes=dtypes.split(","), batch_sizes=[int(b) for b in batch_sizes.split(",")],
        max_tokens=max_tokens, json_out=json_out)


if __name__ == "__main__":
    main()
