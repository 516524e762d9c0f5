"""What every config (serve, job, deploy) shares: `ConfigError`, `StrictModel`, errors as dotted field paths."""
from __future__ import annotations

from typing import Any, get_args

from pydantic import BaseModel, ConfigDict, ValidationError, ValidationInfo, field_validator


class ConfigError(ValueError):
    """A config that cannot be served; the message lists each bad field and why."""


MAX_COUNT = 2**31 - 1     # Kubernetes' int32: a count or size past it is a typo (and fails the CRDs)


class StrictModel(BaseModel):
    # Unknown keys are almost always typos in hand-written YAML: reject them; so are inf/NaN, a YAML
    # boolean (`yes`, `true`) where a number belongs, which pydantic would read as 1, a string or number
    # where a boolean belongs ("false" would read as false, "no" too), and counts past int32 (unless the
    # field states its own upper bound: a seed's is 2**63, a toleration's seconds int64).
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _plain_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        annotation = cls.model_fields[info.field_name].annotation
        kinds = _numeric(annotation)
        if isinstance(value, bool) and kinds:
            raise ValueError(f"expected a number, got {str(value).lower()}")
        if value is not None and not isinstance(value, bool) and _boolean(annotation):   # "yes", 0: pydantic reads them
            raise ValueError(f"expected true or false, got {value!r}")
        if isinstance(value, int) and kinds == {int} and value > MAX_COUNT and not _own_upper_bound(cls, info.field_name):
            raise ValueError(f"must be at most {MAX_COUNT}, got {value}")
        return value


def _own_upper_bound(cls, name: str) -> bool:
    """Whether field `name` declares its own upper bound (`le`/`lt`), which then replaces the int32 cap."""
    return any(getattr(m, "le", None) is not None or getattr(m, "lt", None) is not None
               for m in cls.model_fields[name].metadata)


def _boolean(annotation: Any) -> bool:
    """A bool field (optional or not), where a string or a number is a mistake."""
    args = get_args(annotation) or (annotation,)
    return bool in args and all(a in (bool, type(None)) for a in args)


def _numeric(annotation: Any) -> set:
    """The number types of an int or float field (optional or not), where a YAML boolean is a mistake."""
    args = get_args(annotation) or (annotation,)
    return set() if bool in args else {a for a in args if a in (int, float)}


def format_validation_error(err: ValidationError, source: str = "config", what: str = "serve config",
                            at: str = "", key_lines: dict | None = None) -> str:
    """One line per problem, with a dotted field path: `config: limits.max_tokens: ...`; `at`
    prefixes the paths with the section the data came from; with the file's `key_lines`
    (cluster/config_yaml.YamlDoc), each path also names its line."""
    from cluster.config_yaml import line_of

    lines = []
    for e in err.errors():
        path = ((at,) if at else ()) + tuple(e["loc"])
        loc = ".".join(str(p) for p in path) or "(top level)"
        line = line_of(key_lines, path)
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown field"
        lines.append(f"{f'line {line}: ' if line else ''}{loc}: {msg}")
    return f"{source}: invalid {what}:\n  " + "\n  ".join(lines)
