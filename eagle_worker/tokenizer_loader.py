"""A model folder's tokenizer, loaded once per process and kept ready on disk for the next process.

transformers 5 reads a large `tokenizer.json` in Python and converts it: 5-11 s on 2 CPU cores for
Gemma 3's 262K-token vocabulary, paid by every engine, ingress, replica and CLI call. Unpickling the
loaded tokenizer takes about 2.5 s. So the first load of a folder writes a pickle to the cache
(`$EAGLE_CACHE_DIR/.tokenizers/`, keyed by the folder, its tokenizer files' size and mtime, and the
transformers/tokenizers/Python versions), later processes read it, and anything wrong with it
(unreadable, another version, a failed write) falls back to `AutoTokenizer.from_pretrained`.
Within a process every caller shares one object: nothing here mutates a tokenizer; a caller that does
(padding side, added tokens) loads its own copy with `AutoTokenizer.from_pretrained`.
"""
from __future__ import annotations

import hashlib
import logging
import os
import pickle
import sys
import tempfile
import threading
from collections import OrderedDict
from pathlib import Path

from eagle_worker import default_models

logger = logging.getLogger(__name__)

TOKENIZER_FILES = (".json", ".model", ".jinja", ".txt")   # what a tokenizer reads besides the weights
# one of these holds a vocabulary (fast, sentencepiece, GPT-2 BPE, WordPiece): a folder without any has no tokenizer
VOCABULARY_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model", "sentencepiece.bpe.model",
                    "vocab.txt", "tekken.json")
KEEP_IN_MEMORY = 4
_loaded: OrderedDict[str, object] = OrderedDict()
_lock = threading.Lock()


def load_tokenizer(path: str | Path):
    """The tokenizer of the model folder at `path` (see the module docstring)."""
    folder = Path(path).resolve()
    check_has_vocabulary(folder)
    key = _key(folder)
    with _lock:   # one load at a time: engines starting together read it once
        tokenizer = _loaded.get(key)
        if tokenizer is None:
            tokenizer = _loaded[key] = _read_cached(key) or _load_and_cache(folder, key)
            while len(_loaded) > KEEP_IN_MEMORY:
                _loaded.popitem(last=False)
        _loaded.move_to_end(key)
        return tokenizer


def check_has_vocabulary(folder: Path) -> None:
    """ValueError for a model folder without tokenizer files: transformers would build a stand-in of a
    few tokens from the config, and every prompt would be one unknown token."""
    if folder.is_dir() and not any((folder / name).is_file() for name in VOCABULARY_FILES):
        raise ValueError(f"model folder {folder} has no tokenizer ({', '.join(VOCABULARY_FILES[:3])}, ...); "
                         "put the model's tokenizer files beside its weights")


def disk_cache_path(key: str) -> Path:
    return default_models.cache_root() / ".tokenizers" / f"{key}.pkl"


def _key(folder: Path) -> str:
    import tokenizers
    import transformers

    files = sorted(f for f in folder.iterdir() if f.suffix in TOKENIZER_FILES and f.is_file())
    stamp = [str(folder), transformers.__version__, tokenizers.__version__, sys.version]
    stamp += [f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files]
    return hashlib.sha256("\n".join(stamp).encode()).hexdigest()[:32]


def _read_cached(key: str):
    path = disk_cache_path(key)
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            if hasattr(os, "getuid") and (st.st_uid not in (os.getuid(), 0) or st.st_mode & 0o022):
                logger.warning("tokenizer cache %s ignored: not this user's, or writable by others", path)
                return None
            return pickle.load(f)   # a pickle only this user (or root) could have written
    except FileNotFoundError:
        return None
    except Exception as e:   # noqa: BLE001 - a bad cache entry is only a slower start
        logger.warning("tokenizer cache %s unreadable (%s: %s); loading the tokenizer files", path, type(e).__name__, e)
        return None


def _load_and_cache(folder: Path, key: str):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    path = disk_cache_path(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{key}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                pickle.dump(tokenizer, f, protocol=pickle.HIGHEST_PROTOCOL)
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)   # readers see the whole file or none
        except BaseException:
            os.unlink(tmp)
            raise
    except Exception as e:   # noqa: BLE001 - a read-only cache is only a slower next start
        logger.info("tokenizer cache not written to %s (%s: %s)", path, type(e).__name__, e)
    return tokenizer
