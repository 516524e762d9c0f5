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
@click.option("--draft", default="none", show_default=True, help="EAGLE head: a folder, 'default' (the built-in head) or 'none'.")
@click.option("--tree", default="dynamic", show_default=True, type=click.Choice(["dynamic", "static", "chain"]))
@click.option("--num-draft-tokens", default=16, show_default=True, type=int)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the text.")
def generate(model, prompt, max_tokens, temperature, top_p, top_k, seed, dtype, device, draft, tree, num_draft_tokens, as_json):
    """Generate a completion for one prompt."""
    from eagle_worker import LLM, SamplingParams
    from eagle_worker.speculative.config import SpecConfig

    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
        spec = None if draft == "none" else SpecConfig(draft=draft, tree=tree, num_draft_tokens=num_draft_tokens)
        llm = LLM(model=model, dtype=dtype, device=device, spec=spec)
        out = llm.generate([prompt], params)[0]
    except ValueError as e:
        _fail(str(e))
    if as_json:
        click.echo(json.dumps({"text": out.text, "token_ids": out.token_ids,
                               "finish_reason": out.finish_reason, "metrics": out.metrics}))
    else:
        click.echo(out.text)


@main.command()
@click.option("--config", "config_path", type=click.Path(exists=True, dir_okay=False),
              help="serve.yaml (a ServeConfig, or a deploy file with a `serve:` section).")
@click.option("--host", default=None, help="Bind address [default: the config's, 127.0.0.1].")
@click.option("--port", default=None, type=int, help="HTTP port [default: the config's, 8000].")
@click.option("--address", default=None, help="Ray cluster to join [default: RAY_ADDRESS, else a local Ray].")
def serve(config_path, host, port, address):
    """Serve the OpenAI-compatible HTTP API on Ray Serve (default model when no config)."""
    import os

    from cluster.config import ServeConfig
    from cluster.serve_app import run_serve
    from deploy.kuberay import load_serve_config

    try:
        cfg = load_serve_config(config_path) if config_path else ServeConfig()
        overrides = {k: v for k, v in (("host", host), ("port", port)) if v is not None}
        if overrides:
            cfg = cfg.model_copy(update=overrides)
    except ValueError as e:
        _fail(str(e))
    run_serve(cfg, address=address or os.environ.get("RAY_ADDRESS"), blocking=True)


@main.group()
def bench() -> None:
    """Benchmarks (results printed as a table and written as JSON)."""


@bench.command("decode")
@click.option("--model", default="gemma-3-270m", show_default=True)
@click.option("--dtypes", default="float32,bfloat16", show_default=True)
@click.option("--batch-sizes", default="1,8", show_default=True)
@click.option("--max-tokens", default=64, show_default=True, type=int)
@click.option("--json", "json_out", default="bench/results/decode.json", show_default=True)
@click.option("--threads", default=None, type=int, help="torch intra-op threads for both engines [default: torch's].")
@click.option("--rounds", default=3, show_default=True, type=click.IntRange(min=1),
              help="Runs per measurement, the engines taking turns; the median counts.")
def bench_decode(model, dtypes, batch_sizes, max_tokens, json_out, threads, rounds):
    """Tokens/s of this engine vs transformers generate, same model and dtype."""
    from bench.decode import run

    run(model=model, dtypes=dtypes.split(","), batch_sizes=[int(b) for b in batch_sizes.split(",")],
        max_tokens=max_tokens, json_out=json_out, threads=threads, rounds=rounds)


@bench.command("spec")
@click.option("--model", default="gemma-3-270m", show_default=True)
@click.option("--prompts", "prompts_file", default=None, help="Spec-Bench-format JSONL [default: the bundled Spec-Bench].")
@click.option("--per-category", default=2, show_default=True, type=int)
@click.option("--max-tokens", default=128, show_default=True, type=int)
@click.option("--dtype", default="bfloat16", show_default=True, type=click.Choice(["float32", "bfloat16"]))
@click.option("--draft", default="default", show_default=True, help="Head folder, 'default', or 'random' (cost only).")
@click.option("--methods", default="vanilla,hf,hf_lookup,lookup,chain,static,dynamic,hybrid", show_default=True)
@click.option("--sweep", default="1,2,4,8,16,32", show_default=True, help="Batch sizes for the head/no-head sweep ('' to skip).")
@click.option("--json", "json_out", default="bench/results/spec.json", show_default=True)
@click.option("--threads", default=None, type=int, help="torch intra-op threads [default: torch's].")
@click.option("--temperature", default=0.0, show_default=True, type=float, help="0 = greedy; > 0 samples.")
@click.option("--num-draft-tokens", default=None, type=int, help="Node budget of the dynamic tree, the hybrid and lookup [default: SpecConfig's].")
@click.option("--depth", default=None, type=int, help="Dynamic tree / hybrid draft levels [default: SpecConfig's].")
@click.option("--top-k", default=None, type=int, help="Dynamic tree / hybrid expansion width [default: SpecConfig's].")
@click.option("--rounds", default=1, show_default=True, type=click.IntRange(min=1), help="Passes over the prompts; each prompt's median time counts.")
@click.option("--device", default="cpu", show_default=True, help="cpu, cuda or cuda:N (every method runs there).")
@click.option("--warmup", default=4, show_default=True, type=click.IntRange(min=0),
              help="Prompts each engine serves first, from outside the measured set (adaptive state settles).")
def bench_spec(model, prompts_file, per_category, max_tokens, dtype, draft, methods, sweep, json_out, threads,
               temperature, num_draft_tokens, depth, top_k, rounds, device, warmup):
    """Vanilla, transformers (plain, prompt lookup), our lookup, EAGLE chain/static/dynamic, hybrid."""
    from bench.prompts import SPEC_BENCH
    from bench.spec import MethodsError, run
    from eagle_worker.config import check_device

    try:
        check_device(device)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--device") from None
    try:
        run(model=model, prompts_file=prompts_file or SPEC_BENCH, per_category=per_category, max_tokens=max_tokens,
            dtype=dtype, draft=draft, methods=tuple(methods.split(",")),
            sweep=tuple(int(b) for b in sweep.split(",") if b), json_out=json_out, threads=threads,
            temperature=temperature, tree={k: v for k, v in (("num_draft_tokens", num_draft_tokens), ("depth", depth),
                                                             ("top_k", top_k)) if v is not None},
            rounds=rounds, device=device, warmup=warmup)
    except MethodsError as e:
        raise click.BadParameter(str(e), param_hint="--methods") from None


@bench.command("job")
@click.option("--model", default="gemma-3-270m", show_default=True)
@click.option("--rows", default=200, show_default=True, type=int)
@click.option("--max-tokens", default=64, show_default=True, type=int)
@click.option("--json", "json_out", default="bench/results/job.json", show_default=True)
def bench_job(model, rows, max_tokens, json_out):
    """An offline job over Spec-Bench prompts, with and without the draft head."""
    from bench.job import run

    run(model=model, rows=rows, max_tokens=max_tokens, json_out=json_out)


@bench.command("serve")
@click.option("--url", default=None, help="An already running endpoint [default: start one on this machine].")
@click.option("--model", default="gemma-3-270m", show_default=True)
@click.option("--concurrencies", default="1,4,16", show_default=True)
@click.option("--num-prompts", default=8, show_default=True, type=int)
@click.option("--max-tokens", default=32, show_default=True, type=int)
@click.option("--draft", default="default", show_default=True, help="Head for the with-head run: folder or 'default'.")
@click.option("--json", "json_out", default="bench/results/serve.json", show_default=True)
def bench_serve(url, model, concurrencies, num_prompts, max_tokens, draft, json_out):
    """HTTP load: request throughput, output tok/s, TTFT, TPOT, ITL at several concurrencies."""
    from bench.serve import run

    run(url=url, model=model, concurrencies=tuple(int(c) for c in concurrencies.split(",")),
        num_prompts=num_prompts, max_tokens=max_tokens, draft=draft, json_out=json_out)


def _register() -> None:
    from eaglectl.jobs import job, submit_job
    from deploy.kuberay import deploy
    from eaglectl.train import train_head

    main.add_command(train_head)
    main.add_command(submit_job)
    main.add_command(job)
    main.add_command(deploy)


_register()

if __name__ == "__main__":
    main()
