"""Builds tasks.jsonl (prompts that ask the model to work over a passage: summarize, answer from
it, extract, rewrite, translate) and copies.jsonl (such prompts with answers that copy from them),
from the long texts of the other training sources.

Why: the base model copies a lot from its context when it summarizes, answers from a passage or
translates (prompt lookup alone reaches tau 4-7 on those Spec-Bench categories), and a head learns
to copy only from continuations that do. Passages come only from data/train (OpenAssistant replies,
ShareGPT first turns); no evaluation set is read. Deterministic: `python data/train/tasks/build.py`.
"""
from __future__ import annotations

import json
import random
import re
from pathlib import Path

HERE = Path(__file__).resolve().parent
TRAIN = HERE.parent
TEMPLATES = [
    "Summarize: {passage}",
    "Summarize the following text in a few sentences.\n{passage}",
    "Extract the main facts from the following text, one per line:\n{passage}",
    "Rewrite the following text more concisely: {passage}",
    "List the key terms in the following text and explain each briefly.\n{passage}",
]
TRANSLATE = ["Translate English to German: {s}", "Translate English to French: {s}",
             "Translate English to Spanish: {s}"]


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().split("\n") if line.strip()]


def oasst_pairs() -> list[tuple[str, str]]:
    """(question, long assistant reply) from the OpenAssistant trees."""
    out = []

    def walk(msg):
        for r in msg.get("replies", []):
            if r["role"] == "assistant" and msg["role"] == "prompter":
                out.append((msg["text"], r["text"]))
            walk(r)
    for tree in _jsonl(TRAIN / "oasst" / "en_100_tree.jsonl"):
        walk(tree["prompt"])
    return out


def sharegpt_long(min_chars: int) -> list[str]:
    seen, out = set(), []
    for f in sorted((TRAIN / "sharegpt").glob("*.json")):
        for rec in json.loads(f.read_text()):
            turns = rec.get("conversations") or []
            text = turns[0]["value"].strip() if turns else ""
            if len(text) >= min_chars and text not in seen:
                seen.add(text)
                out.append(text)
    return out


def sentences(text: str) -> list[str]:
    return [s.strip() for s in re.split(r"(?<=[.!?])\s+", text) if 50 <= len(s.strip()) <= 250 and "\n" not in s]


def _passages(max_chars: int) -> tuple[list[tuple[str, str]], list[str], list[str]]:
    """(question, long reply) pairs, every long text cut to `max_chars`, and the replies' sentences."""
    pairs = [(q, a) for q, a in oasst_pairs() if len(a) >= 600]
    passages = [a[:max_chars] for _, a in pairs] + [t[:max_chars] for t in sharegpt_long(800)]
    return pairs, passages, [s for _, a in pairs for s in sentences(a)]


def build(seed: int = 0, max_chars: int = 3500) -> list[dict]:
    rng = random.Random(seed)
    pairs, passages, reply_sents = _passages(max_chars)
    rng.shuffle(passages)
    out = [{"prompt": TEMPLATES[i % len(TEMPLATES)].format(passage=p), "source": "tasks/passage"}
           for i, p in enumerate(passages[:600])]
    # answer a question from a passage placed before it (the RAG layout)
    out += [{"prompt": f"{a[:max_chars]} {q}", "source": "tasks/rag"} for q, a in rng.sample(pairs, min(150, len(pairs)))]
    out += [{"prompt": TRANSLATE[i % len(TRANSLATE)].format(s=s), "source": "tasks/translate"}
            for i, s in enumerate(rng.sample(reply_sents, min(150, len(reply_sents))))]
    rng.shuffle(out)
    return out


def build_copies(seed: int = 1, max_chars: int = 1800) -> list[dict]:
    """Prompt + response pairs whose response copies from the prompt, as the base model's own
    answers to such prompts do: a passage and its first sentences, its sentences as a list, a
    sentence repeated for a translation. Trained as fixed text, the labels are still the target's
    own next-token distribution at every position (prefill self-distillation), so the head learns
    where the target copies at the cost of a prefill instead of a generation."""
    rng = random.Random(seed)
    _, passages, reply_sents = _passages(max_chars)
    rng.shuffle(passages)
    out = []
    for i, p in enumerate(passages[:500]):
        sents = sentences(p) or [p[:300]]
        k = rng.randint(2, 6)
        kind = i % 4
        if kind == 0:
            out.append({"prompt": f"Summarize: {p}", "response": " ".join(sents[:k])})
        elif kind == 1:
            out.append({"prompt": f"Extract the main facts from the following text, one per line:\n{p}",
                        "response": "\n".join(f"- {s}" for s in sents[:k])})
        elif kind == 2:
            out.append({"prompt": f"Rewrite the following text more concisely: {p}", "response": p[:1200]})
        else:
            s = rng.choice(sents)
            out.append({"prompt": f"{p} What does the text say about this: {s[:60]}?", "response": " ".join([s] + sents[:k])})
    out += [{"prompt": TRANSLATE[i % len(TRANSLATE)].format(s=s), "response": s}
            for i, s in enumerate(rng.sample(reply_sents, min(100, len(reply_sents))))]
    for r in out:
        r["source"] = "tasks/copy"
    rng.shuffle(out)
    return out


def _write(name: str, rows: list[dict]) -> None:
    (HERE / name).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    print(f"{len(rows)} records -> {HERE / name}")


if __name__ == "__main__":
    _write("tasks.jsonl", build())
    _write("copies.jsonl", build_copies())
