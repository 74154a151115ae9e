"""What a request's output must match: the structured-output part of `SamplingParams` (runtime/structured_output.py
compiles and enforces it)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping, Sequence

from .request_limits import MAX_SCHEMA_CHARS

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

    def __post_init__(self) -> None:
        if self.kind != "lark" and len(self.spec) > MAX_SCHEMA_CHARS:  # "lark": the server's own tool grammar
            raise ConstraintError(self.field, f"{len(self.spec):,} characters as JSON text; at most "
                                              f"{MAX_SCHEMA_CHARS:,} are accepted")

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any] | bool, field_name: str, strict: bool = True,
                    whitespace_pattern: str | None = None, closed: bool = False) -> "Constraint":
        """`closed`: no property outside the schema (`closed_schema`), as OpenAI's strict mode means."""
        return cls("json", json.dumps(closed_schema(schema) if closed else schema), field_name, strict,
                   whitespace_pattern)

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
            return cls.json_schema(value, where, whitespace_pattern=pattern,
                                   closed=fields_.get("disable_additional_properties") is True)
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


# Keywords whose values are subschemas: by name (a mapping of them), as a list, or one.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_ONES = ("items", "additionalItems", "contains", "not", "if", "then", "else", "additionalProperties",
                "propertyNames", "unevaluatedItems", "unevaluatedProperties")


def closed_schema(schema: Any, close: bool = True) -> Any:
    """`schema` with `additionalProperties: false` on every object schema that does not say otherwise.

    OpenAI's strict mode (and xgrammar's strict_mode, vLLM's disable_additional_properties) means no property
    outside the schema; JSON Schema's own default allows any. Applied throughout: nested properties, array
    items, $defs, the alternatives of anyOf / oneOf. An object schema is one with `properties` or type "object";
    one that sets `additionalProperties` or `unevaluatedProperties` keeps it. JSON Schema's additionalProperties
    sees only its own object's `properties`, so an object composed with allOf / anyOf / oneOf beside them is
    left open (closed, it would refuse the composed keys), and so are allOf's parts and the alternatives that
    add to such properties; alternatives that stand alone are closed.
    """
    if isinstance(schema, list):  # items as a list (a tuple schema)
        return [closed_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            value = {name: closed_schema(s) for name, s in value.items()}
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            whole = key == "prefixItems" or (key != "allOf" and "properties" not in schema)
            value = [closed_schema(s, close=whole) for s in value]
        elif key in _SCHEMA_ONES:
            value = closed_schema(value)
        out[key] = value
    types = schema.get("type")
    is_object = "properties" in schema or types == "object" or (isinstance(types, list) and "object" in types)
    composed = any(k in schema for k in ("allOf", "anyOf", "oneOf"))
    if close and is_object and not composed and not {"additionalProperties", "unevaluatedProperties"} & set(schema):
        out["additionalProperties"] = False
    return out
