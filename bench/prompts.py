"""Benchmark prompts: Spec-Bench-format JSONL files, rendered in a format a base model continues."""
from __future__ import annotations

import json
from pathlib import Path

SPEC_BENCH = Path(__file__).parent / "data" / "spec_bench" / "question.jsonl"
# The default model is a base model: a plain Q/A frame is what it continues sensibly.
PROMPT_FORMAT = "Question: {question}\nAnswer:"


def load_questions(path: str | Path = SPEC_BENCH, per_category: int | None = None, limit: int | None = None) -> list[dict]:
    """Records `{"question_id", "category", "turns"}`; first `per_category` of each category, in file order.
    ValueError naming the file (and line) if it cannot be read, or holds no prompt or a line that is
    no Spec-Bench record: `eaglectl bench spec --prompts` reads it before any model loads."""
    records, counts = [], {}
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: cannot read it ({getattr(e, 'strerror', None) or type(e).__name__})") from None
    for n, line in enumerate(text.split("\n"), 1):          # not splitlines(): records may hold U+2028
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except (ValueError, RecursionError):
            raise ValueError(f"{path} line {n}: not JSON; expected Spec-Bench JSONL, one record a line") from None
        turns = rec.get("turns") if isinstance(rec, dict) else None
        if not (isinstance(turns, list) and turns and isinstance(turns[0], str)
                and isinstance(rec.get("category", ""), str)):
            raise ValueError(f"{path} line {n}: not a Spec-Bench record (a JSON object with \"turns\": [\"...\"] "
                             "and a text \"category\")")
        cat = rec.get("category", "default")
        if per_category is not None and counts.get(cat, 0) >= per_category:
            continue
        counts[cat] = counts.get(cat, 0) + 1
        records.append(rec)
        if limit is not None and len(records) >= limit:
            break
    if not records:
        raise ValueError(f"{path}: no prompts in it")
    return records


def render(record: dict) -> str:
    return PROMPT_FORMAT.format(question=record["turns"][0].strip())
