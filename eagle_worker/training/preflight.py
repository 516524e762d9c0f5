"""What `train-head` can refuse from the options and the file system alone, before the target loads:
folders that cannot be written, an --init-head that is no head folder, a --max-tokens past the
target's context. Each refusal is a ValueError naming the option (the command exits 2 on it).

Why up front: loading the target, distilling and extracting take minutes to hours; a path or a
length that cannot work should cost none of that, and leave nothing behind.
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path


def check_folder(opt: str, folder: str | Path) -> None:
    """`folder` is (or can be made) a folder we can write: probed by creating it and a file in it,
    then undone, so a refusal that comes later still leaves nothing behind."""
    p = Path(folder)
    for f in [p, *p.parents]:
        if f.exists() and not f.is_dir():
            raise ValueError(f"{opt} {folder}: {f} is a file, not a folder")
    created: list[Path] = []
    try:
        for q in reversed([q for q in [p, *p.parents] if not q.exists()]):
            q.mkdir()
            created.append(q)
        with tempfile.NamedTemporaryFile(dir=p, prefix=".write-probe-"):
            pass
    except OSError as e:
        raise ValueError(f"{opt} {folder}: cannot create or write it ({e.strerror or e})") from None
    finally:
        for q in reversed(created):
            try:
                q.rmdir()
            except OSError:
                pass


def config_object(folder: Path, what: str, kind: str) -> dict:
    """A model or head folder's config.json as a dict, or ValueError starting with `what` (no file,
    not JSON, not an object): the one check before anything loads the folder."""
    try:
        raw = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{what}: no config.json; not a {kind} folder") from None
    except (OSError, ValueError, RecursionError) as e:
        raise ValueError(f"{what}: config.json is not readable JSON ({type(e).__name__})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{what}: config.json is not a JSON object")
    return raw


def check_init_head(path: str | Path) -> None:
    """A head folder: config.json of a one-layer draft model, and its weights. Whether it fits the
    target is checked when it loads (that needs the target)."""
    p = Path(path)
    if not p.exists():
        raise ValueError(f"--init-head {path}: no such folder")
    if not p.is_dir():
        raise ValueError(f"--init-head {path}: a file, not a head folder (config.json + model.safetensors)")
    raw = config_object(p, f"--init-head {path}", "head")
    layers = raw.get("num_hidden_layers") or 1      # what the loader refuses too (refuse_multilayer)
    if isinstance(layers, (int, float)) and layers > 1:
        raise ValueError(f"--init-head {path}: num_hidden_layers={layers}: a full model, not a draft head "
                         "(one decoder layer)")
    if not [*p.glob("*.safetensors"), *p.glob("pytorch_model*.bin")]:
        raise ValueError(f"--init-head {path}: no model.safetensors (or pytorch_model.bin)")


def native_context(hf_config) -> int:
    """Positions the target's model code has rotary rows for (what our models build)."""
    return getattr(hf_config, "max_position_embeddings", None) or 8192


def local_context(target: str) -> int | None:
    """The context of a target whose config.json is on disk (a folder, a built-in already built);
    None when it is not known before loading (hub id, .gguf): then it is checked after loading."""
    from eagle_worker import default_models

    folder = default_models.model_dir(target) if default_models.is_builtin(target) else Path(target)
    try:
        raw = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(raw, dict):
        return None
    n = raw.get("max_position_embeddings")
    if n is None and isinstance(raw.get("text_config"), dict):
        n = raw["text_config"].get("max_position_embeddings")
    return n if isinstance(n, int) and n > 0 else None


def check_max_tokens(max_tokens: int, context: int | None, target: str) -> None:
    if context is not None and max_tokens > context:
        raise ValueError(f"--max-tokens {max_tokens} is over the context of model {target!r} "
                         f"({context} tokens); give at most {context}")
