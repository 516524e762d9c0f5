"""The README's first command on the real default model: a 50-row Parquet job, end to end.

`eaglectl submit-job prompts.parquet` (here `python -m eaglectl.main`, same command) with no model
flag: every id comes out once and each text equals `LLM.generate` (or `LLM.chat` for `messages`
rows) for the same prompt and the same per-row overrides at temperature 0 (structured outputs too).
"""
from __future__ import annotations

import json
import re

import pytest

from bench.prompts import load_questions, render

from .conftest import cli, read_manifest, read_rows, write_parquet

pytestmark = pytest.mark.slow


def test_50_row_job_equals_llm_generate(tmp_path):
    from eagle_worker import LLM, SamplingParams

    n = 50
    questions = [render(q) for q in load_questions(limit=n)]
    ids = [f"sb-{i:03d}" for i in range(n)]
    prompts: list = list(questions)
    messages: list = [None] * n
    for i in (5, 17, 33):                                            # chat rows, Gemma's template
        prompts[i], messages[i] = None, [{"role": "user", "content": load_questions(limit=n)[i]["turns"][0]}]
    max_tokens = [None if i % 5 == 0 else 1 + i % 8 for i in range(n)]   # None: the --max-tokens flag (6)
    stop = [["\n"] if i % 7 == 3 else None for i in range(n)]
    formats = {2: {"choice": ["yes", "no"]}, 8: {"regex": "[0-9]{1,3}"}, 17: {"json_object": True}}   # 17: chat
    structured = [json.dumps(formats[i % 12]) if i % 12 in formats else None for i in range(n)]
    inp = write_parquet(tmp_path / "prompts.parquet", id=ids, prompt=prompts, messages=messages,
                        max_tokens=max_tokens, stop=stop, structured_outputs=structured)

    res = cli("submit-job", inp, "--max-tokens", "6", "--rows-per-file", "20", timeout=900)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "job completed: 50/50 rows" in res.stdout
    rows = read_rows(tmp_path / "prompts.out")
    assert sorted(r["id"] for r in rows) == ids                      # every id exactly once
    by_id = {r["id"]: r for r in rows}
    m = read_manifest(tmp_path / "prompts.out")
    assert m["complete"] and m["error_rows"] == 0 and m["config"]["model"] == "gemma-3-270m"

    llm = LLM(model="gemma-3-270m")
    params = [SamplingParams(max_tokens=max_tokens[i] or 6, temperature=0.0, stop=stop[i],
                             structured_outputs=formats.get(i % 12)) for i in range(n)]
    plain = [i for i in range(n) if messages[i] is None]
    outs = llm.generate([prompts[i] for i in plain], [params[i] for i in plain])
    chat = [i for i in range(n) if messages[i] is not None]
    outs += llm.chat([messages[i] for i in chat], [params[i] for i in chat])
    for i, out in zip(plain + chat, outs):
        r = by_id[ids[i]]
        assert r["text"] == out.text, (i, r, out.text)
        assert r["completion_tokens"] == len(out.token_ids) and r["finish_reason"] == out.finish_reason
        assert r["prompt_tokens"] == len(out.prompt_token_ids)
        if i % 12 == 2:
            assert r["text"] in ("yes", "no") and r["finish_reason"] == "stop", r
        if i % 12 == 8:
            assert re.fullmatch("[0-9]{1,3}", r["text"]), r
        if stop[i] is None:                                          # per-row max_tokens applied
            assert r["completion_tokens"] == (max_tokens[i] or 6) or r["finish_reason"] == "stop"
        else:
            assert "\n" not in r["text"]
