"""The one reader of YAML config files (serve, deploy, RayJob): a duplicate key is an error."""
from __future__ import annotations

import os
from pathlib import Path

import yaml

from cluster.config_base import ConfigError


class YamlDoc(dict):
    """A YAML file's top-level mapping, with `lines`: the line (1-based) each key and list item
    starts on, by its path (`("limits", "max_tokens")`, `("tolerations", "0")`), so that a
    validation error can say where the value it refuses is."""
    lines: dict[tuple[str, ...], int]


def read_yaml(path: str | os.PathLike, empty_ok: bool = False) -> YamlDoc:
    """The one reader of YAML config files (serve, deploy, RayJob): the top-level mapping, or
    ConfigError naming the file. An empty file is {} when `empty_ok`."""
    path = Path(path)
    try:
        loader = _UniqueKeyLoader(path.read_text())
        try:
            node = loader.get_single_node()
            lines = _key_lines(node) if node is not None else {}   # before constructing: merges rewrite nodes
            data = loader.construct_document(node) if node is not None else None
        finally:
            loader.dispose()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not a text file (byte {e.start} is not UTF-8)") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML: {e}") from None
    except RecursionError:
        raise ConfigError(f"{path}: invalid YAML: nested too deeply") from None
    if data is None and empty_ok:
        data = {}
    if not isinstance(data, dict):
        got = "an empty file" if data is None else type(data).__name__
        raise ConfigError(f"{path}: expected a mapping at the top level, got {got}")
    doc = YamlDoc(data)
    doc.lines = lines
    return doc


def line_of(lines: dict[tuple[str, ...], int] | None, path: tuple) -> int | None:
    """The line of the longest prefix of `path` that the file has (a missing field: its section's)."""
    parts = tuple(str(p) for p in path)
    for n in range(len(parts), 0, -1):
        if lines and parts[:n] in lines:
            return lines[parts[:n]]
    return None


def _key_lines(root) -> dict[tuple[str, ...], int]:
    """Each key's and list item's line by path, walked in document order. A node reached again
    through an alias is not walked again (an alias bomb stays linear); `<<` merge keys are skipped
    (the mapping's own keys are what an error names)."""
    out: dict[tuple[str, ...], int] = {}
    seen: set[int] = set()
    todo = [((), root)]
    while todo:
        path, node = todo.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.MappingNode):
            items = [((k.value,), k, v) for k, v in node.value
                     if isinstance(k, yaml.ScalarNode) and k.tag != "tag:yaml.org,2002:merge"]
        elif isinstance(node, yaml.SequenceNode):
            items = [((str(i),), v, v) for i, v in enumerate(node.value)]
        else:
            continue
        for key, at, value in items:
            out.setdefault(path + key, at.start_mark.line + 1)
        todo.extend((path + key, value) for key, _, value in reversed(items))   # popped first to last
    return out


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.safe_load, but a key given twice in one mapping is an error: silently keeping the last
    one hides an edit that did not take."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":    # `<<: *anchor`: the base constructor merges it
                continue
            if not isinstance(key_node, yaml.ScalarNode):     # `? [a]`: a list or mapping as a key
                raise yaml.constructor.ConstructorError(None, None, "a key must be a plain value, not a list or "
                                                        "mapping", key_node.start_mark)
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)
