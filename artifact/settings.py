"""YAML -> typed settings with one error style: the field path, the value, and what is allowed."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

M = TypeVar("M", bound=BaseModel)


class Settings(BaseModel):
    """Base of every YAML section: unknown keys are errors, values are never coerced silently."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class ConfigError(ValueError):
    pass


def describe(exc: ValidationError, source: str) -> str:
    lines = [f"invalid configuration in {source}:"]
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "(top level)"
        value = err.get("input")
        shown = "" if isinstance(value, dict) else f" = {value!r}"
        message = "unknown key (remove it or check its spelling)" if err["type"] == "extra_forbidden" else err["msg"]
        lines.append(f"  {where}{shown}: {message}")
    return "\n".join(lines)


def validate(cls: type[M], data: Any, source: str) -> M:
    try:
        return cls.model_validate(data if data is not None else {})
    except ValidationError as exc:
        raise ConfigError(describe(exc, source)) from None


def load_yaml(cls: type[M], path: str | Path, overrides: dict[str, Any] | None = None) -> M:
    """Load `path`, apply dotted-key overrides (CLI flags) and validate."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping of sections at the top level")
    return validate(cls, with_overrides(data, overrides), str(path))


def with_overrides(data: dict[str, Any], overrides: dict[str, Any] | None) -> dict[str, Any]:
    """`data` with dotted-key overrides (CLI flags) set in place; None values are not given."""
    for dotted, value in (overrides or {}).items():
        if value is None:
            continue
        node = data
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return data


def json_lines(path: Path, error: type[ValueError] = ConfigError) -> Iterator[tuple[str, dict[str, Any]]]:
    """Each non-blank line of a JSON Lines file as (`path:line`, its object); `error` names the line otherwise."""
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise error(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(item, dict):
            raise error(f"{where}: each line must be a JSON object")
        yield where, item
