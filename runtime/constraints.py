"""What a request's output must match: the structured-output part of `SamplingParams` (runtime/structured_output.py
compiles and enforces it)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping, Sequence

ConstraintKind = Literal["json", "json_object", "regex", "choice", "grammar", "lark"]
# vLLM's StructuredOutputsParams: exactly one of these; the options below it are also accepted
VLLM_KINDS = ("json", "regex", "choice", "grammar", "json_object")
VLLM_OPTIONS = ("disable_any_whitespace", "disable_additional_properties", "whitespace_pattern", "disable_fallback")


class ConstraintError(ValueError):
    """A malformed constraint; `field` names the request field, `problem` says what is wrong with it."""

    def __init__(self, field_name: str, problem: str) -> None:
        super().__init__(f"{field_name}: {problem}")
        self.field, self.problem = field_name, problem


@dataclass(frozen=True)
class Constraint:
    """What a request's output must match; `spec` is its text, so equal constraints share a compiled grammar.

    kinds: "json" (a JSON schema), "json_object" (any JSON object), "regex", "choice" (a JSON list of
    strings), "grammar" (GBNF or Lark, as vLLM accepts), "lark" (llguidance's Lark, built by the server
    for tool calls). `field` names the request field it came from, for errors; `strict` false lets a
    schema use keywords llguidance does not implement (they are then ignored).
    """

    kind: ConstraintKind
    spec: str
    field: str = field(default="structured_outputs", compare=False)
    strict: bool = True
    whitespace_pattern: str | None = None

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any] | bool, field_name: str, strict: bool = True,
                    whitespace_pattern: str | None = None) -> "Constraint":
        return cls("json", json.dumps(schema), field_name, strict, whitespace_pattern)

    @classmethod
    def choice(cls, options: Sequence[str], field_name: str) -> "Constraint":
        return cls("choice", json.dumps(list(options)), field_name)

    @classmethod
    def from_vllm(cls, fields_: Mapping[str, Any], field_name: str = "structured_outputs") -> "Constraint":
        """vLLM's `structured_outputs` object ({"json": schema} | {"regex": ...} | {"choice": [...]} |
        {"grammar": ...} | {"json_object": true}); raises ConstraintError naming the sub-field."""
        unknown = sorted(set(fields_) - set(VLLM_KINDS) - set(VLLM_OPTIONS))
        if unknown:
            raise ConstraintError(f"{field_name}.{unknown[0]}", f"unknown field; known: {', '.join(VLLM_KINDS + VLLM_OPTIONS)}")
        given = [k for k in VLLM_KINDS if fields_.get(k) not in (None, False)]
        if len(given) != 1:
            raise ConstraintError(field_name, f"give exactly one of {', '.join(VLLM_KINDS)} (got "
                             f"{', '.join(given) or 'none'})")
        kind, value = given[0], fields_[given[0]]
        where = f"{field_name}.{kind}"
        pattern = fields_.get("whitespace_pattern")
        if pattern is not None and not isinstance(pattern, str):
            raise ConstraintError(f"{field_name}.whitespace_pattern", "must be a string (a regex)")
        if kind == "json":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except json.JSONDecodeError as exc:
                    raise ConstraintError(where, f"the schema string is not JSON ({exc})") from None
            if not isinstance(value, (dict, bool)):
                raise ConstraintError(where, f"must be a JSON schema (an object)")
            return cls.json_schema(value, where, whitespace_pattern=pattern)
        if kind == "json_object":
            if value is not True:
                raise ConstraintError(where, f"must be true")
            return cls("json_object", "", where, whitespace_pattern=pattern)
        if kind == "choice":
            if not isinstance(value, list) or not value or not all(isinstance(o, str) and o for o in value):
                raise ConstraintError(where, f"must be a non-empty list of non-empty strings")
            return cls.choice(value, where)
        if not isinstance(value, str) or not value:
            raise ConstraintError(where, f"must be a non-empty string")
        return cls(kind, value, where)  # type: ignore[arg-type]
