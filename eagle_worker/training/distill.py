"""Self-distillation: the target writes the responses with our batched engine (greedy).

Why: the head must predict what *this* target says next; training on its own continuations
(EAGLE-3, HASS) matches the serving distribution, where every accepted token is the target's.
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path

from eagle_worker.training.render import Example


def _read_partial(path: Path) -> list[dict]:
    """The finished prompts' records. A last line without its newline was cut by a kill during the
    append: it is dropped, from the file too, so the next append starts a line of its own."""
    data = path.read_bytes()
    whole = data[:data.rfind(b"\n") + 1]
    if len(whole) < len(data):
        with open(path, "r+b") as f:
            f.truncate(len(whole))
    out = []
    for n, line in enumerate(whole.decode("utf-8", errors="replace").split("\n"), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            if not isinstance(rec, dict) or "example" not in rec:
                raise ValueError("no 'example'")
        except ValueError as e:
            raise ValueError(f"{path}: line {n}: not a self-distillation record ({e}); delete the file to "
                             "distil its prompts again") from None
        out.append(rec)
    return out


def self_distill(llm, prompts: list[list[int]], sources: list[str], max_new_tokens: int,
                 batch: int = 64, progress: bool = True, partial: str | Path | None = None,
                 seconds: float | None = None) -> list[Example]:
    """Greedy continuations of `prompts` (token ids) by the engine; examples = prompt + output.
    With `partial`, each finished batch is appended there and a rerun skips those prompts. With
    `seconds`, no new batch starts after that long: the prompts not reached are left out (a time
    budget for a machine whose decoding speed is not known in advance)."""
    from eagle_worker.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_new_tokens, temperature=0.0)
    done = _read_partial(Path(partial)) if partial and Path(partial).exists() else []
    out = [Example(**d["example"]) for d in done if d["example"]]
    start, t0 = len(done), time.monotonic()
    for i in range(start, len(prompts), batch):
        if seconds is not None and time.monotonic() - t0 >= seconds:
            break
        chunk = prompts[i:i + batch]
        recs = []
        for p, src, r in zip(chunk, sources[i:i + batch], llm.generate(chunk, params, use_tqdm=progress)):
            ex = Example(list(p) + list(r.token_ids), len(p), src + "+distill") if len(r.token_ids) >= 2 else None
            if ex:
                out.append(ex)
            recs.append({"example": asdict(ex) if ex else None})
        if partial:
            with open(partial, "a") as f:
                f.write("".join(json.dumps(x) + "\n" for x in recs))
    return out
