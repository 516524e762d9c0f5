"""`eaglectl generate`: one completion from the engine (eagle_worker), printed."""
from __future__ import annotations

import dataclasses
import json

import click

from eaglectl.common import fail, given_flags


@click.command("generate")
@click.option("--model", default="gemma-3-270m", show_default=True, help="Built-in name, local folder or hub id.")
@click.option("--prompt", required=True, help="Prompt text.")
@click.option("--max-tokens", default=64, show_default=True, type=int)
@click.option("--temperature", default=0.0, show_default=True, type=float)
@click.option("--top-p", default=1.0, show_default=True, type=float)
@click.option("--top-k", default=-1, show_default=True, type=int)
@click.option("--seed", default=None, type=int)
@click.option("--dtype", default="float32", show_default=True, type=click.Choice(["float32", "bfloat16", "float16"]))
@click.option("--device", default="cpu", show_default=True)
@click.option("--draft", default="auto", show_default=True,
              help="'auto' (the hybrid with the model's built-in head, or prompt lookup), a head folder, "
                   "'default' (the built-in head) or 'none' (no speculation).")
@click.option("--tree", default="dynamic", show_default=True, type=click.Choice(["dynamic", "static", "chain"]))
@click.option("--num-draft-tokens", default=16, show_default=True, type=int)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the text.")
@click.pass_context
def generate(ctx, model, prompt, max_tokens, temperature, top_p, top_k, seed, dtype, device, draft, tree,
             num_draft_tokens, as_json):
    """Generate a completion for one prompt."""
    from eagle_worker import LLM, SamplingParams
    from eagle_worker.speculative.config import default_spec

    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
        spec = default_spec(draft, model)
        given = given_flags(ctx, "tree", "num_draft_tokens")
        if spec is None and given:     # not silently ignored
            fail(f"{' and '.join(given)} size a draft tree; with --draft none nothing is drafted")
        if spec is not None:
            spec = dataclasses.replace(spec, tree=tree, num_draft_tokens=num_draft_tokens)
        llm = LLM(model=model, dtype=dtype, device=device, spec=spec)
        out = llm.generate([prompt], params)[0]
    except ValueError as e:
        fail(str(e))
    if as_json:
        click.echo(json.dumps({"text": out.text, "token_ids": out.token_ids, "finish_reason": out.finish_reason,
                               "error": out.error, "metrics": out.metrics}))
    else:
        click.echo(out.text)
    if out.finish_reason == "error":      # the engine failed the request: not a completion, whatever printed
        fail(out.error or "the engine failed the request", code=1)
