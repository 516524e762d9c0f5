"""data/train/tasks: the passage-task prompts are rebuilt exactly from the training sources and
share no text with the benchmark prompts."""
import importlib.util
import json
from pathlib import Path

from bench.prompts import load_questions
from eagle_worker.training.data import load_samples

ROOT = Path(__file__).resolve().parents[3]
TASKS = ROOT / "data" / "train" / "tasks"


def _builder():
    spec = importlib.util.spec_from_file_location("tasks_build", TASKS / "build.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _committed(name):
    return [json.loads(line) for line in (TASKS / name).read_text().split("\n") if line.strip()]


def test_committed_tasks_are_what_the_builder_writes():
    builder = _builder()
    built, copies = builder.build(), builder.build_copies()
    assert built == _committed("tasks.jsonl") and copies == _committed("copies.jsonl")
    assert {r["source"] for r in built} == {"tasks/passage", "tasks/rag", "tasks/translate"}
    samples = load_samples(TASKS / "tasks.jsonl")
    assert len(samples) == len(built) and all(s.response is None and s.prompt for s in samples)
    pairs = load_samples(TASKS / "copies.jsonl")
    assert len(pairs) == len(copies) and all(s.response for s in pairs)
    # every response copies from its prompt (its first 40 characters appear there, list markers aside)
    assert all(r["response"].lstrip("- ")[:40] in r["prompt"] for r in copies)


def test_no_benchmark_text_in_training_tasks():
    prompts = [r[k] for name in ("tasks.jsonl", "copies.jsonl") for r in _committed(name)
               for k in ("prompt", "response") if k in r]
    probes = []
    for rec in load_questions():
        q = " ".join(rec["turns"][0].split())
        probes += [q[i:i + 80] for i in range(0, max(1, len(q) - 80), 400) if len(q) >= 80]
    flat = " ".join(" ".join(p.split()) for p in prompts)
    assert len(probes) > 100
    leaked = [p for p in probes if p in flat]
    assert not leaked, leaked[:3]
