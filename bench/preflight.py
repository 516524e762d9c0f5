"""What `eaglectl bench` checks of `--model` and `--draft` before anything loads.

Loading engines takes seconds to minutes; a model folder without a readable config.json, weights
or tokenizer, or a draft that is no head folder, should fail in the first second with the option named, not as a
traceback from the engine (or a Serve deploy, or a job replica) once the others have loaded. The
rules are the engine's own (eagle_worker.model_runner.resolve_model, choose_draft/resolve_draft,
as `bench job` and the job config use them), applied without loading any weights.
"""
from __future__ import annotations

import os
from pathlib import Path


def check_model(model: str) -> None:
    """ValueError unless the engine can find `model`: a built-in name (nothing is built or loaded
    here), a folder with a config.json holding a JSON object, a checkpoint and a tokenizer, a .gguf
    file, or a hub id in the local cache. Whether the config describes a model the engine can build
    is known only when it loads."""
    from eagle_worker import default_models

    if default_models.is_builtin(model):          # resolve_model's first rule: no local folder needed
        return
    p = Path(model).expanduser()
    if not p.exists():
        if os.environ.get("EAGLE_ALLOW_DOWNLOAD") == "1":      # a hub id the engine may fetch: not fetched twice
            return
        from eagle_worker.loader import resolve_model_path  # no such path, or a hub id not cached: its error

        resolve_model_path(model)
        return
    if p.is_file():
        if p.suffix.lower() == ".gguf":
            return
        raise ValueError(f"model {model!r} is a file but no .gguf; give a model folder (config.json + weights), "
                         "a .gguf file or a built-in name")
    from eagle_worker.loader import CheckpointError, checkpoint_files
    from eagle_worker.tokenizer_loader import check_has_vocabulary
    from eagle_worker.training.preflight import config_object

    config_object(p, f"model {model!r}", "model")
    try:
        kind, _ = checkpoint_files(p)
    except CheckpointError as e:
        raise ValueError(f"model {model!r}: {e}") from None
    if kind != "gguf":     # a GGUF carries its own vocabulary
        check_has_vocabulary(p.resolve())


def check_draft(draft: str | None, model: str) -> str | None:
    """The head folder `draft` names for `model`, by the engine's rule ('none', or 'auto' for a model
    that ships no head: None); ValueError if there is none where one is named, or the folder has no
    config.json."""
    from eagle_worker.engine_api import draft_rules

    choose, resolve = draft_rules("eagle_worker")
    head = resolve(choose(draft, model), model)
    if head is not None and not (Path(head) / "config.json").is_file():
        raise ValueError(f"draft head {draft!r} is not a head folder (no config.json)")
    return head
