"""YAML -> typed settings with one error style: the field path, the value, and what is allowed.

Each schema is the one source of its settings: a field's default, its allowed values and its meaning (the field's
description) are read from it by everything else: the runtime's EngineConfig, the CLI's flags, and the docs' tables
(`settings_table`, written by `python -m pagedgraph.settings_docs --write`).
"""
from __future__ import annotations

import json
import re
import types
import typing
from pathlib import Path
from typing import Any, Iterator, Literal, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError
from pydantic.fields import FieldInfo

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


def replace_block(document: str, begin: str, end: str, body: str) -> str:
    """`document` with the text between the marker lines `begin` and `end` replaced by `body` (a generated table)."""
    pattern = re.compile(re.escape(begin) + ".*?" + re.escape(end), re.S)
    if not pattern.search(document):
        raise ValueError(f"the document has no such markers: add the lines {begin!r} and {end!r}")
    return pattern.sub(lambda _: f"{begin}\n{body}{end}", document)


SHOWN = "shown_default"


def shown(default: str) -> dict[str, str]:
    """`Field(..., json_schema_extra=shown("the artifact's"))`: how the docs state a default that the schema leaves
    None because something else decides it (the artifact, the machine)."""
    return {SHOWN: default}


def _section(annotation: Any) -> type[BaseModel] | None:
    """The settings class a field holds (directly or optionally), else None."""
    for candidate in (annotation, *typing.get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def field_at(model: type[BaseModel], key: str) -> FieldInfo:
    """The field of dotted `key` (`kv_cache.dtype`) in `model`, through its sections."""
    *sections, name = key.split(".")
    for section in sections:
        inner = _section(model.model_fields[section].annotation)
        assert inner is not None, f"{section} in {key} is not a section"
        model = inner
    return model.model_fields[name]


def choices(model: type[BaseModel], key: str) -> tuple[Any, ...]:
    """The values a Literal field allows (of a list's items for a list of them; None left out)."""
    def literals(annotation: Any) -> Iterator[Any]:
        if typing.get_origin(annotation) is Literal:
            yield from typing.get_args(annotation)
        elif typing.get_origin(annotation) in (typing.Union, types.UnionType, list):
            for arg in typing.get_args(annotation):
                yield from literals(arg)
    return tuple(literals(field_at(model, key).annotation))


def default(model: type[BaseModel], key: str) -> Any:
    return field_at(model, key).get_default(call_default_factory=True)


def _shown(info: FieldInfo) -> str:
    extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
    if SHOWN in extra:
        return str(extra[SHOWN])
    if info.is_required():
        return "required"
    value = info.get_default(call_default_factory=True)
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return f"`[{', '.join(map(str, value))}]`"
    if isinstance(value, float):
        return f"{value:g}"
    return f"`{value or chr(34) * 2}`" if isinstance(value, str) else str(value)


def _meaning(model: type[BaseModel], name: str, info: FieldInfo) -> str:
    """The field's description, then the values a Literal allows (read from the type, so never stale)."""
    text = (info.description or "").rstrip(".")
    allowed = choices(model, name)
    return text + (f". One of: {', '.join(f'`{v}`' for v in allowed)}" if allowed else "")


def settings_rows(model: type[BaseModel], prefix: str = "",
                  elsewhere: frozenset[str] = frozenset()) -> Iterator[tuple[str, str, str]]:
    """(dotted key, default as the docs show it, meaning) for every setting of `model`, sections flattened. An
    optional section (null: off) gets a row of its own before its keys; the sections in `elsewhere` (dotted keys,
    listed by another table) get that row only."""
    for name, info in model.model_fields.items():
        key, inner = f"{prefix}{name}", _section(info.annotation)
        optional = not info.is_required() and info.get_default() is None
        if inner is None:
            yield key, _shown(info), _meaning(model, name, info)
            continue
        if optional:
            yield key, _shown(info), info.description or ""
        if key not in elsewhere:
            yield from settings_rows(inner, f"{key}.", elsewhere)


def settings_table(model: type[BaseModel], prefix: str = "", elsewhere: frozenset[str] = frozenset()) -> str:
    """The markdown table of `settings_rows`."""
    rows = [f"| `{key}` | {shown_default} | {meaning.replace('|', chr(92) + '|')} |"
            for key, shown_default, meaning in settings_rows(model, prefix, elsewhere)]
    return "| key | default | meaning |\n|---|---|---|\n" + "\n".join(rows) + "\n"


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
