"""The one reader of YAML config files (serve, deploy, RayJob): a duplicate key is an error."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from cluster.config_base import ConfigError


def read_yaml(path: str | os.PathLike, empty_ok: bool = False) -> dict[str, Any]:
    """The one reader of YAML config files (serve, deploy, RayJob): the top-level mapping, or
    ConfigError naming the file. An empty file is {} when `empty_ok`."""
    path = Path(path)
    try:
        data = yaml.load(path.read_text(), Loader=_UniqueKeyLoader)
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not a text file (byte {e.start} is not UTF-8)") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML: {e}") from None
    except RecursionError:
        raise ConfigError(f"{path}: invalid YAML: nested too deeply") from None
    if data is None and empty_ok:
        return {}
    if not isinstance(data, dict):
        got = "an empty file" if data is None else type(data).__name__
        raise ConfigError(f"{path}: expected a mapping at the top level, got {got}")
    return data


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
