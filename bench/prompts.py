"""Benchmark prompts: Spec-Bench-format JSONL files, rendered in a format a base model continues."""
from __future__ import annotations

import json
from pathlib import Path

SPEC_BENCH = Path(__file__).parent / "data" / "spec_bench" / "question.jsonl"
# The default model is a base model: a plain Q/A frame is what it continues sensibly.
PROMPT_FORMAT = "Question: {question}\nAnswer:"


def load_questions(path: str | Path = SPEC_BENCH, per_category: int | None = None, limit: int | None = None) -> list[dict]:
    """Records `{"question_id", "category", "turns"}`; first `per_category` of each category, in file order."""
    records, counts = [], {}
    text = Path(path).read_text(encoding="utf-8")
    for line in text.split("\n"):          # not splitlines(): records may hold U+2028
        if not line.strip():
            continue
        rec = json.loads(line)
        cat = rec.get("category", "default")
        if per_category is not None and counts.get(cat, 0) >= per_category:
            continue
        counts[cat] = counts.get(cat, 0) + 1
        records.append(rec)
        if limit is not None and len(records) >= limit:
            break
    return records


def render(record: dict) -> str:
    return PROMPT_FORMAT.format(question=record["turns"][0].strip())
