"""`eaglectl bench prefix`: automatic prefix caching on shared prefixes, caching off vs on, without and with the head.

Scenarios (prompts built from the bundled Spec-Bench text, deterministic, no network):
  a  `requests` requests sharing a `system_tokens`-token system prompt, each with its own
     `question_tokens`-token question;
  b  `conversations` conversations x `turns` turns resending their history: turn t's prompt is turn
     t-1's prompt + its answer + a new user line; the first turn is a `history_tokens`-token document
     and a question;
  c  a `rows`-row offline job whose prompts share a `preamble_tokens`-token few-shot preamble (then
     each row's `question_tokens`-token question), as text (a job's input), run
     through the jobs runner (`jobs.runner.run_job`, as `eaglectl bench job` does) with the job config's
     `enable_prefix_caching` off and on.
Every scenario runs with the engine's `enable_prefix_caching` off and on, without the head (draft
None) and with it (`draft`), greedy, `max_tokens` new tokens each.

How it is measured: a and b submit all their requests at once through the engine API
(`LLM.generate`: one burst, continuous batching; b one burst per turn), so TTFT (the engine's
`ttft_s`, arrival to first token) includes the queueing a burst sees, the same with caching off and
on. Total tok/s = (prompt + generated tokens) / wall time of the burst(s), as `vllm bench` reports
"total token throughput". Hit rate = cached prompt tokens / prompt tokens (`num_cached_tokens` /
`num_prompt_tokens` summed over requests; c: the job manifest's `prefix_cache`). "same" = the
fraction of requests whose tokens equal the caching-off run's (c: texts by row id). tau (tokens per
target forward) is split into requests that hit the cache and those that missed, with the head.
c's TTFT is each row's `ttft_s` in the job output (sent to the replica -> first token).

Rounds: the off and on engines of one draft are loaded side by side and take turns, the order
alternating; each round uses its own system prompt / documents / preamble (a distinct first line),
so every round starts with a cold cache; the median over rounds is reported.
Usage: `eaglectl bench prefix [--dtype bfloat16] [--scenarios a,b,c] [--rounds 3]`.
"""
from __future__ import annotations

import dataclasses
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.job import completed_run
from bench.methods import PREFIX_SCENARIOS as SCENARIOS
from bench.prompts import load_questions
from bench.report_file import run_meta, write_json


@dataclasses.dataclass
class Sizes:
    requests: int = 32           # a
    system_tokens: int = 512     # a
    question_tokens: int = 20    # a and b
    conversations: int = 8       # b
    turns: int = 4               # b
    history_tokens: int = 256    # b: the first turn's document
    rows: int = 200              # c
    preamble_tokens: int = 400   # c
    max_tokens: int = 64


# ---- prompts ----------------------------------------------------------------------------------
class Text:
    """Token ids of the bundled Spec-Bench text, cut to exact lengths, from a deterministic offset."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.questions = [q["turns"][0].strip() for q in load_questions()]

    def ids(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def span(self, tag: str, start: int, n: int) -> list[int]:
        """`n` token ids: a line naming `tag` (distinct prefixes per scenario and round), then the
        questions from `start` on, joined."""
        out = self.ids(f"[{tag}]\n")
        i = start
        while len(out) < n:
            out += self.ids(self.questions[i % len(self.questions)] + "\n")
            i += 1
        return out[:n]

    def question(self, i: int, n: int) -> list[int]:
        q = self.ids("\nQuestion: " + self.questions[(7 * i + 3) % len(self.questions)])[:n]
        return q + self.ids("\nAnswer:")


def prompts_a(text: Text, sizes: Sizes, rnd: int) -> list[list[int]]:
    system = text.span(f"a{rnd} system", 11 * rnd, sizes.system_tokens)
    return [system + text.question(100 * rnd + i, sizes.question_tokens) for i in range(sizes.requests)]


def first_turns_b(text: Text, sizes: Sizes, rnd: int) -> list[list[int]]:
    return [text.span(f"b{rnd} document {c}", 200 + 37 * c + 13 * rnd, sizes.history_tokens)
            + text.question(1000 + 10 * c + rnd, sizes.question_tokens) for c in range(sizes.conversations)]


def next_turn_b(text: Text, sizes: Sizes, prompt: list[int], answer: list[int], conv: int, turn: int) -> list[int]:
    return prompt + answer + text.question(2000 + 31 * conv + turn, sizes.question_tokens)


def rows_c(text: Text, sizes: Sizes, rnd: int) -> list[str]:
    """Text prompts (a job's input column): one few-shot preamble, then each row's question."""
    preamble = text.tok.decode(text.span(f"c{rnd} examples", 300 + 17 * rnd, sizes.preamble_tokens))
    return [preamble + text.tok.decode(text.question(3000 + 5 * i + rnd, sizes.question_tokens)) for i in range(sizes.rows)]


# ---- one measured burst -----------------------------------------------------------------------
def _burst(llm, prompts: list, max_tokens: int) -> tuple[list, float]:
    from eagle_worker import SamplingParams

    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    return outs, time.perf_counter() - t0


def _record(outs: list, wall_s: float) -> dict:
    """A run's raw figures (summed over its bursts by `_merge`)."""
    m = [o.metrics or {} for o in outs]
    return {"wall_s": wall_s, "ttft_s": [x.get("ttft_s", 0.0) for x in m],
            "prompt_tokens": sum(int(x.get("num_prompt_tokens") or len(o.prompt_token_ids)) for x, o in zip(m, outs)),
            "cached_tokens": sum(int(x.get("num_cached_tokens") or 0) for x in m),
            "output_tokens": sum(len(o.token_ids) for o in outs),
            "tau": [(int(x.get("num_cached_tokens") or 0) > 0, float(x.get("mean_accepted_tokens") or 1.0),
                     len(o.token_ids)) for x, o in zip(m, outs)],
            "tokens": [list(o.token_ids) for o in outs]}


def _merge(parts: list[dict]) -> dict:
    out = {k: 0 for k in ("wall_s", "prompt_tokens", "cached_tokens", "output_tokens")}
    out.update(ttft_s=[], tau=[], tokens=[])
    for p in parts:
        for k, v in p.items():
            out[k] = out[k] + v
    return out


def run_a(llm, text: Text, sizes: Sizes, rnd: int) -> dict:
    return _record(*_burst(llm, prompts_a(text, sizes, rnd), sizes.max_tokens))


def run_b(llm, text: Text, sizes: Sizes, rnd: int) -> dict:
    prompts, parts = first_turns_b(text, sizes, rnd), []
    for turn in range(sizes.turns):
        outs, wall = _burst(llm, prompts, sizes.max_tokens)
        parts.append(_record(outs, wall))
        prompts = [next_turn_b(text, sizes, p, list(o.token_ids), c, turn) for c, (p, o) in enumerate(zip(prompts, outs))]
    return _merge(parts)


def run_c_engine(llm, text: Text, sizes: Sizes, rnd: int) -> dict:
    """c without the jobs runner (a job config without `enable_prefix_caching`): the rows as one burst."""
    return _record(*_burst(llm, rows_c(text, sizes, rnd), sizes.max_tokens))


def run_c_job(model: str, dtype: str, draft: str | None, caching: bool, text: Text, sizes: Sizes, rnd: int,
              tmp: Path) -> dict:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from jobs.job_config import JobConfig
    from jobs.runner import run_job

    prompts = rows_c(text, sizes, rnd)
    inp = tmp / f"c{rnd}.parquet"
    if not inp.exists():
        pq.write_table(pa.table({"id": [f"r{i}" for i in range(len(prompts))], "prompt": prompts}), inp)
    out = tmp / f"c{rnd}-{draft is not None}-{caching}.out"
    cfg = JobConfig(input=str(inp), output=str(out), model=model, dtype=dtype, draft=draft or "none",
                    max_tokens=sizes.max_tokens, temperature=0.0, overwrite=True, enable_prefix_caching=caching)
    m = run_job(cfg)
    run = completed_run(m, out.stem)
    cache = m.get("prefix_cache") or {}
    table = pq.read_table(out)
    texts = {r["id"]: r["text"] for r in table.select(["id", "text"]).to_pylist()}
    ttft = [t for t in table.column("ttft_s").to_pylist() if t is not None] if "ttft_s" in table.column_names else []
    return {"wall_s": run.get("generation_s") or run["wall_s"], "ttft_s": ttft,
            "prompt_tokens": int(cache.get("prompt_tokens") or m.get("prompt_tokens") or 0),
            "cached_tokens": int(cache.get("cached_prompt_tokens") or 0),
            "output_tokens": int(run["completion_tokens"]), "tau": [(None, float(run.get("tau") or 1.0), 1)],
            "tokens": [texts[k] for k in sorted(texts)]}


def job_has_caching_switch() -> bool:
    from jobs.job_config import JobConfig

    return "enable_prefix_caching" in JobConfig.model_fields


# ---- summary ----------------------------------------------------------------------------------
def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def _tau(pairs: list[tuple[bool, float, int]], hit: bool | None) -> float | None:
    sel = [(t, n) for h, t, n in pairs if hit is None or h == hit]
    weight = sum(n for _, n in sel)
    return sum(t * n for t, n in sel) / weight if weight else None


def summarise(runs: dict[tuple[str, bool, bool], list[dict]]) -> list[dict]:
    """One row per (scenario, head, caching): medians over rounds; `same` and speedups against
    the caching-off run of the same round."""
    rows = []
    for (scn, head, caching), recs in runs.items():
        offs = runs.get((scn, head, False), [])
        per = []
        for i, r in enumerate(recs):
            off = offs[i] if i < len(offs) else None
            per.append({
                "ttft_p50_ms": None if not r["ttft_s"] else 1000 * _pct(r["ttft_s"], 0.5),
                "ttft_p99_ms": None if not r["ttft_s"] else 1000 * _pct(r["ttft_s"], 0.99),
                "total_tok_s": (r["prompt_tokens"] + r["output_tokens"]) / r["wall_s"],
                "output_tok_s": r["output_tokens"] / r["wall_s"],
                "hit_rate": r["cached_tokens"] / max(1, r["prompt_tokens"]),
                "same": None if off is None else sum(a == b for a, b in zip(r["tokens"], off["tokens"]))
                / max(1, len(off["tokens"])),
            })

        def med(k):
            vals = [p[k] for p in per if p[k] is not None]
            return statistics.median(vals) if vals else None
        taus = [x for r in recs for x in r["tau"]]
        rows.append({"scenario": scn, "head": head, "caching": caching, "rounds": len(recs),
                     **{k: med(k) for k in per[0]}, "same": min((p["same"] for p in per if p["same"] is not None),
                                                                default=None),
                     "tau": _tau(taus, None), "tau_hit": _tau(taus, True), "tau_miss": _tau(taus, False),
                     "requests": len(recs[0]["tokens"]), "prompt_tokens": recs[0]["prompt_tokens"]})
    by = {(r["scenario"], r["head"], r["caching"]): r for r in rows}
    for r in rows:
        off = by.get((r["scenario"], r["head"], False))
        r["speedup"] = r["total_tok_s"] / off["total_tok_s"] if off else None
        r["ttft_p50_gain"] = (off["ttft_p50_ms"] / r["ttft_p50_ms"]
                              if off and off["ttft_p50_ms"] and r["ttft_p50_ms"] else None)
    return rows


def table(rows: list[dict]) -> str:
    def f(v, fmt):
        return "-" if v is None else format(v, fmt)
    lines = ["| scenario | head | caching | TTFT p50 ms | TTFT p99 ms | total tok/s | output tok/s | hit rate | "
             "tau hit / miss | same as off | total tok/s vs off | TTFT p50 gain |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in sorted(rows, key=lambda r: (r["scenario"], r["head"], r["caching"])):
        tau = "-" if not r["head"] else f"{f(r['tau_hit'], '.2f')} / {f(r['tau_miss'], '.2f')}"
        lines.append(f"| {r['scenario']} | {'yes' if r['head'] else 'no'} | {'on' if r['caching'] else 'off'} | "
                     f"{f(r['ttft_p50_ms'], '.0f')} | {f(r['ttft_p99_ms'], '.0f')} | {r['total_tok_s']:.1f} | "
                     f"{r['output_tok_s']:.1f} | {r['hit_rate']:.0%} | {tau} | "
                     f"{'-' if r['same'] is None else format(r['same'], '.0%')} | "
                     f"{f(r['speedup'], '.2f')}{'x' if r['speedup'] else ''} | "
                     f"{f(r['ttft_p50_gain'], '.2f')}{'x' if r['ttft_p50_gain'] else ''} |")
    return "\n".join(lines)


# ---- the run ----------------------------------------------------------------------------------
def _engine(model: str, dtype: str, draft: str | None, caching: bool):
    """An engine with the defaults serving and jobs use (KV budget, step token budget, context)."""
    from eagle_worker import LLM
    from eagle_worker.config import EngineConfig

    if "enable_prefix_caching" not in {f.name for f in dataclasses.fields(EngineConfig)}:
        raise RuntimeError("this engine has no enable_prefix_caching setting: nothing to compare")
    llm = LLM(model=model, dtype=dtype, draft=draft, enable_prefix_caching=caching)
    llm.generate("Warm-up: the first forwards of an engine are slow.", None)   # not measured
    return llm


def run(model: str = "gemma-3-270m", dtype: str = "float32", draft: str = "auto", scenarios=SCENARIOS,
        rounds: int = 3, sizes: Sizes | None = None, json_out: str | None = None, c_runner: str = "job") -> dict:
    """Every scenario x head (none, `draft`) x caching (off, on); the table printed, JSON written."""
    from eagle_worker.engine_api import draft_rules

    sizes = sizes or Sizes()
    bad = [s for s in scenarios if s not in SCENARIOS]
    if bad or not scenarios:
        raise ValueError(f"scenarios must be among {', '.join(SCENARIOS)}; got {','.join(scenarios) or 'none'}")
    choose, _ = draft_rules("eagle_worker")
    head = choose(draft, model) if draft not in (None, "none") else None
    notes = []
    if head is None:
        notes.append(f"no EAGLE head for {model} ({draft!r}): only the runs without the head")
    if "c" in scenarios and c_runner == "job" and not job_has_caching_switch():
        c_runner = "engine"
        notes.append("c ran through LLM.generate (the job config has no enable_prefix_caching yet), not the jobs runner")
    runs: dict[tuple[str, bool, bool], list[dict]] = {}
    drafts = [None] + ([head] if head is not None else [])
    with tempfile.TemporaryDirectory(prefix="bench-prefix-") as tmp:
        for d in drafts:
            engines = {c: _engine(model, dtype, d, c) for c in (False, True)}
            text = Text(engines[False].tokenizer)
            for rnd in range(rounds):
                order = (False, True) if rnd % 2 == 0 else (True, False)
                for scn in scenarios:
                    for caching in order:
                        llm = engines[caching]
                        if scn == "a":
                            rec = run_a(llm, text, sizes, rnd)
                        elif scn == "b":
                            rec = run_b(llm, text, sizes, rnd)
                        elif c_runner == "job":
                            rec = run_c_job(model, dtype, d, caching, text, sizes, rnd, Path(tmp))
                        else:
                            rec = run_c_engine(llm, text, sizes, rnd)
                        runs.setdefault((scn, d is not None, caching), []).append(rec)
                        print(f"{scn} {'head' if d else 'no head'} caching {'on ' if caching else 'off'} round {rnd + 1}: "
                              f"{rec['wall_s']:.1f}s, hit {rec['cached_tokens'] / max(1, rec['prompt_tokens']):.0%}",
                              flush=True)
            del engines
    rows = summarise(runs)
    print("\n" + table(rows))
    for n in notes:
        print(f"\n{n}")
    report = {"meta": _meta(model, dtype, head, rounds, sizes, c_runner, notes), "rows": rows}
    if json_out:
        write_json(json_out, report)
    return report


def _meta(model, dtype, head, rounds, sizes, c_runner, notes) -> dict[str, Any]:
    import torch

    return {"model": model, "dtype": dtype, "draft": head, "rounds": rounds, "sizes": dataclasses.asdict(sizes),
            "temperature": 0.0, "c_runner": c_runner, "notes": notes,
            "measure": "a, b: all requests of a burst submitted at once through LLM.generate (b: one burst per turn)",
            "threads": torch.get_num_threads(), "machine": platform.processor() or platform.machine(),
            "torch": torch.__version__, **run_meta()}
