"""Checkpoint loading: safetensors shards, PyTorch .bin files or a GGUF file into our model.

Tensors stream file by file (safetensors shard by shard, lazily) and each goes through its
parameter's `weight_loader`, which keeps only this rank's slice, so a checkpoint never has to
fit in memory at once. Every tensor of the model must be found exactly once; anything missing,
unexpected, misshapen or unreadable raises `CheckpointError` naming the tensor and the file.
"""
from __future__ import annotations

import json
import os
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from eagle_worker.layers.linear import default_weight_loader

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # saved by old Llama checkpoints, recomputed by us


class CheckpointError(ValueError):
    """A checkpoint that does not match the model or cannot be read."""


def resolve_model_path(name_or_path: str) -> str:
    """A local folder / .gguf file as is; otherwise a Hugging Face Hub id from the local cache
    (downloaded only when EAGLE_ALLOW_DOWNLOAD=1)."""
    p = Path(name_or_path).expanduser()
    if p.exists():
        return str(p)
    if name_or_path.startswith(("/", "./", "../", "~")) or name_or_path.endswith(".gguf"):
        raise ValueError(f"model {name_or_path!r}: no such file or folder")
    allow = os.environ.get("EAGLE_ALLOW_DOWNLOAD") == "1"
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(
            name_or_path, local_files_only=not allow,
            ignore_patterns=["original/*", "consolidated*", "*.pth", "*.pt", "*.msgpack", "*.h5", "*.onnx*", "*.gguf"])
    except Exception as e:  # not cached, bad id, offline, ...
        if allow:    # the hub's own reason (no such repo, gated, offline) is the one to read
            raise ValueError(f"model {name_or_path!r} could not be downloaded: {e}") from e
        raise ValueError(f"model {name_or_path!r} is not a folder here nor in the Hugging Face cache (set "
                         "EAGLE_ALLOW_DOWNLOAD=1 to download it from the Hugging Face Hub)") from e


def _index_files(folder: Path, index_name: str) -> list[Path] | None:
    index = folder / index_name
    if not index.exists():
        return None
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (ValueError, KeyError) as e:
        raise CheckpointError(f"unreadable checkpoint index {index}: {e}") from e
    files = [folder / f for f in sorted(set(weight_map.values()))]
    for f in files:
        if not f.exists():
            raise CheckpointError(f"checkpoint file {f} listed in {index} does not exist")
    return files


def safetensors_tensors(file: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    try:
        handle = safe_open(str(file), framework="pt", device="cpu")
    except Exception as e:
        raise CheckpointError(f"corrupted or truncated safetensors file {file}: {e}") from e
    with handle:
        for name in list(handle.keys()):
            try:
                tensor = handle.get_tensor(name)
            except Exception as e:
                raise CheckpointError(f"corrupted or truncated safetensors file {file} (tensor {name!r}): {e}") from e
            yield name, tensor


def bin_tensors(file: Path) -> Iterator[tuple[str, torch.Tensor]]:
    try:
        try:
            state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:
            if "mmap" not in str(e):
                raise
            state = torch.load(file, map_location="cpu", weights_only=True)  # legacy (non-zip) format
    except Exception as e:
        raise CheckpointError(f"corrupted or unreadable PyTorch checkpoint {file}: {e}") from e
    if not isinstance(state, dict):
        raise CheckpointError(f"PyTorch checkpoint {file} does not hold a state dict")
    yield from state.items()
    del state


def _gguf_tensors(file: Path, model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Dequantize through transformers, which maps llama.cpp names back to HF names, undoes the
    q/k permutation of llama-family files and Gemma's norm +1."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = getattr(model, "config", None)
    if config is None:
        raise CheckpointError(f"loading {file} needs model.config (the HF config) to map GGUF names")
    with torch.device("meta"):
        reference = AutoModelForCausalLM.from_config(config)  # names only, no memory
    dtype = next(model.parameters()).dtype
    try:
        parsed = load_gguf_checkpoint(str(file), return_tensors=True, model_to_load=reference, torch_dtype=dtype)
    except Exception as e:
        raise CheckpointError(f"corrupted or unsupported GGUF file {file}: {e}") from e
    tensors = parsed["tensors"]
    while tensors:
        name = next(iter(tensors))
        yield name, tensors.pop(name)


def checkpoint_files(source: str | os.PathLike) -> tuple[str, list[Path]]:
    """(format, files) for a folder or a single file; format is safetensors, bin or gguf.
    Every file is a regular file: a FIFO or device under a checkpoint's name would block the read."""
    kind, files = _checkpoint_files(Path(source))
    for f in files:
        if not f.is_file():
            raise CheckpointError(f"checkpoint file {f} is not a regular file")
    return kind, files


def _checkpoint_files(path: Path) -> tuple[str, list[Path]]:
    if path.exists() and not path.is_dir():
        kinds = {".safetensors": "safetensors", ".bin": "bin", ".gguf": "gguf"}
        if path.suffix not in kinds:
            raise CheckpointError(f"unknown checkpoint file type {path}")
        return kinds[path.suffix], [path]
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist")
    files = _index_files(path, "model.safetensors.index.json")
    if files is None:
        files = sorted(path.glob("model*.safetensors")) or sorted(path.glob("*.safetensors"))
    if files:
        return "safetensors", files
    files = _index_files(path, "pytorch_model.bin.index.json") or sorted(path.glob("pytorch_model*.bin"))
    if files:
        return "bin", files
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return "gguf", ggufs
    if len(ggufs) > 1:
        raise CheckpointError(f"{path} holds several .gguf files; pass the one to load")
    raise CheckpointError(f"no *.safetensors, pytorch_model*.bin or .gguf checkpoint in {path}")


class _Loading:
    """Routes checkpoint tensors to parameters (unpacking q/k/v and gate/up) and tracks coverage."""

    def __init__(self, model: nn.Module):
        self.params = dict(model.named_parameters())
        all_names = dict(model.named_parameters(remove_duplicate=False))
        self.aliases = set(all_names) - set(self.params)  # e.g. a tied lm_head.weight
        self.packed = getattr(model, "packed_modules_mapping", {})
        self.remap = getattr(model, "remap_checkpoint_name", None)
        self.loaded: dict[str, set] = defaultdict(set)

    def _route(self, name: str) -> tuple[str, object]:
        parts = name.split(".")
        for i, part in enumerate(parts):
            if part in self.packed:
                packed, shard = self.packed[part]
                return ".".join(parts[:i] + [packed] + parts[i + 1:]), shard
        return name, None

    def load(self, name: str, tensor: torch.Tensor, file: Path) -> None:
        if name.endswith(_IGNORED_SUFFIXES):
            return
        if self.remap is not None:
            name = self.remap(name)
            if name is None:
                return
        target, shard = self._route(name)
        if target in self.aliases:
            return
        param = self.params.get(target)
        if param is None:
            raise CheckpointError(f"unexpected tensor {name!r} in {file}: the model has no parameter {target!r}")
        loader = getattr(param, "weight_loader", default_weight_loader)
        try:
            if shard is None:
                loader(param, tensor)
            else:
                loader(param, tensor, shard)
        except ValueError as e:
            raise CheckpointError(f"tensor {name!r} in {file}: {e}") from e
        if shard in self.loaded[target]:
            raise CheckpointError(f"tensor {name!r} appears twice in the checkpoint (again in {file})")
        self.loaded[target].add(shard)

    def missing(self) -> list[str]:
        out = []
        for target in self.params:
            got = self.loaded.get(target, set())
            parts = target.split(".")
            shards = {k: s for k, (v, s) in self.packed.items() if v in parts}
            if not shards or None in got:
                if not got:
                    out.append(target)
                continue
            for original, s in shards.items():
                if s not in got:
                    out.append(".".join(original if p == self.packed[original][0] else p for p in parts))
        return out


def load_weights(model: nn.Module, source: str | os.PathLike) -> None:
    """Fill every parameter of `model` (this rank's shards) from the checkpoint at `source`."""
    kind, files = checkpoint_files(source)
    state = _Loading(model)
    with torch.no_grad():
        for file in files:
            if kind == "safetensors":
                tensors = safetensors_tensors(file)
            elif kind == "bin":
                tensors = bin_tensors(file)
            else:
                tensors = _gguf_tensors(file, model)
            for name, tensor in tensors:
                state.load(name, tensor, file)
    missing = state.missing()
    if missing:
        shown = ", ".join(missing[:8]) + (f" (+{len(missing) - 8} more)" if len(missing) > 8 else "")
        raise CheckpointError(f"checkpoint {source} is missing tensors: {shown}")
