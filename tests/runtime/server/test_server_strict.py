"""What a client gets for schemas and tools the project's other tests have not seen, and for inputs past the caps,
through the official `openai` client against the real server and model.

Strict schemas and forced tool calls are checked key by key against the schema as written (a walk of the output
beside it, not the server's own schema rewrite) and with `jsonschema` against the schema closed by hand.
"""
from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any, Iterator

import httpx
import jsonschema
import openai
import pytest

from pagedgraph.runtime.request_limits import (MAX_LOGIT_BIAS, MAX_SCHEMA_CHARS, MAX_STOP, MAX_STOP_CHARS,
                                               MAX_STOP_TOKEN_IDS, MAX_TOOLS)
from tests.runtime.server.serving import MODEL, ServerThread, serve

pytestmark = pytest.mark.e2e
TEXT = {"type": "string", "maxLength": 24}
# Objects that leave additionalProperties out, as clients write them; prompts that invite more keys.
PERSON = {"type": "object", "properties": {
    "first": TEXT, "last": TEXT, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "address": {"type": "object", "properties": {"street": TEXT, "zip": TEXT}}}}
ORDER = {"type": "object", "required": ["id", "items"], "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 99999},
    "customer": {"type": "object", "properties": {"name": TEXT, "email": TEXT}},
    "items": {"type": "array", "minItems": 1, "maxItems": 2, "items": {"type": "object", "required": ["sku"],
              "properties": {"sku": TEXT, "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                             "options": {"type": "object", "properties": {"colour": TEXT, "size": TEXT}}}}}}}
ROUTE = {"$defs": {"place": {"type": "object", "required": ["name"], "properties": {
    "name": TEXT, "country": TEXT, "position": {"type": "object", "properties": {
        "lat": {"type": "number"}, "lon": {"type": "number"}}}}}},
    "type": "object", "required": ["start", "end"], "properties": {
        "start": {"$ref": "#/$defs/place"}, "end": {"$ref": "#/$defs/place"},
        "stops": {"type": "array", "maxItems": 2, "items": {"$ref": "#/$defs/place"}}}}
CONTACT = {"type": "object", "required": ["name", "reach"], "properties": {
    "name": TEXT, "reach": {"anyOf": [{"type": "object", "required": ["phone"], "properties": {"phone": TEXT}},
                                      {"type": "object", "required": ["email"], "properties": {"email": TEXT}}]}}}
HELD_OUT = {"person": PERSON, "order": ORDER, "route": ROUTE, "contact": CONTACT}


def ask(what: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Describe a {what} as JSON. Give every detail you can: names, dates, "
                                        "places, numbers, notes, history, anything at all."}]


def extra_keys(value: Any, schema: dict[str, Any], root: dict[str, Any]) -> list[str]:
    """Keys of `value` that `schema` (as written: properties, items, $ref, anyOf) does not name, with their paths."""
    while "$ref" in schema:
        schema = root["$defs"][schema["$ref"].rsplit("/", 1)[1]]
    if "anyOf" in schema:  # the branch with the fewest unknown keys is the one the value took
        return min((extra_keys(value, branch, root) for branch in schema["anyOf"]), key=len)
    if isinstance(value, dict):
        known = schema.get("properties", {})
        return [k for k in value if k not in known] + [
            f"{k}.{e}" for k, v in value.items() if k in known for e in extra_keys(v, known[k], root)]
    if isinstance(value, list):
        return [f"[{i}].{e}" for i, v in enumerate(value) for e in extra_keys(v, schema.get("items", {}), root)]
    return []


def closed_by_hand(schema: Any) -> Any:
    """`schema` with additionalProperties false written into every object (the test's own, for jsonschema)."""
    if isinstance(schema, list):
        return [closed_by_hand(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: ({n: closed_by_hand(s) for n, s in v.items()} if k in ("properties", "$defs") else closed_by_hand(v))
           for k, v in schema.items()}
    if "properties" in schema:
        out.setdefault("additionalProperties", False)
    return out


def schema_format(name: str, strict: bool | None) -> dict[str, Any]:
    json_schema: dict[str, Any] = {"name": name, "schema": HELD_OUT[name]}
    if strict is not None:
        json_schema["strict"] = strict
    return {"type": "json_schema", "json_schema": json_schema}


@pytest.fixture(scope="module")
def server(smollm2_artifact: Path) -> Iterator[ServerThread]:
    with serve(smollm2_artifact, kv_cache={"num_blocks": 512}, scheduler={"max_model_len": 1280}) as thread:
        yield thread


@pytest.fixture
def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def _together(server: ServerThread, calls: list[dict[str, Any]]) -> list[Any]:
    """Chat completions sent at once (so they share batches); each dict holds one request's arguments."""
    async def all_of_them() -> list[Any]:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        return await asyncio.gather(*(client.chat.completions.create(model=MODEL, temperature=0, **c) for c in calls))
    return asyncio.run(all_of_them())


def test_strict_schemas_never_produce_a_key_outside_the_schema(server: ServerThread) -> None:
    calls = [{"messages": ask(name), "response_format": schema_format(name, True), "max_tokens": 200}
             for name in HELD_OUT]
    calls.append({"messages": ask("person"), "max_tokens": 200,  # vLLM's spelling of the same rule
                  "extra_body": {"structured_outputs": {"json": PERSON, "disable_additional_properties": True}}})
    for name, response in zip([*HELD_OUT, "person"], _together(server, calls)):
        choice = response.choices[0]
        assert choice.finish_reason == "stop", (name, choice.message.content)
        value = json.loads(choice.message.content)
        assert extra_keys(value, HELD_OUT[name], HELD_OUT[name]) == [], (name, value)
        jsonschema.validate(value, closed_by_hand(HELD_OUT[name]))


def test_without_strict_a_schema_allows_other_keys(server: ServerThread) -> None:
    loose, absent = _together(server, [{"messages": ask("person"), "response_format": schema_format("person", s),
                                        "max_tokens": 60} for s in (False, None)])
    text = loose.choices[0].message.content
    assert absent.choices[0].message.content == text  # strict left out is JSON Schema's default, as false
    keys = set(re.findall(r'"(\w+)": ', text))
    assert keys - {"first", "last", "age", "address", "street", "zip"}, text


WEATHER = {"type": "object", "required": ["city", "unit"], "properties": {
    "city": {"type": "string", "maxLength": 20}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}
FLIGHT = {"type": "object", "required": ["to", "passenger"], "properties": {
    "to": {"type": "string", "maxLength": 20}, "date": {"type": "string", "maxLength": 12},
    "passenger": {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0, "maximum": 120}}}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The current weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "book_flight", "description": "Book a flight for a passenger",
                                           "parameters": FLIGHT}}]
TOOL_ASKS = {"get_weather": "What is the weather in Oslo? Tell me everything about it.",
             "book_flight": "Book me, Ada Lovelace, 36, on a flight to Lisbon next Friday, window seat, vegetarian."}


def _check_call(call: Any) -> None:
    parameters = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call.function.name)
    jsonschema.validate(json.loads(call.function.arguments), closed_by_hand(parameters))


FORCED = [(name, choice) for name in TOOL_ASKS for choice in ("required", "named")]


def test_forced_tool_calls_follow_the_parameters_and_finish_as_tool_calls(server: ServerThread) -> None:
    def args(name: str, choice: str) -> dict[str, Any]:
        return {"model": MODEL, "temperature": 0, "max_tokens": 160, "tools": TOOLS,
                "messages": [{"role": "user", "content": TOOL_ASKS[name]}],
                "tool_choice": "required" if choice == "required" else {"type": "function", "function": {"name": name}}}

    async def streamed(client: openai.AsyncOpenAI, name: str, choice: str) -> list[Any]:
        return [chunk async for chunk in await client.chat.completions.create(stream=True, **args(name, choice))]

    async def all_of_them() -> list[Any]:  # every answer whole and streamed, served together
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        return await asyncio.gather(*(client.chat.completions.create(**args(*case)) for case in FORCED),
                                    *(streamed(client, *case) for case in FORCED))

    results = asyncio.run(all_of_them())
    for (name, choice), whole, chunks in zip(FORCED, results, results[len(FORCED):]):
        answer = whole.choices[0]
        assert answer.finish_reason == "tool_calls" and len(answer.message.tool_calls) == 1, (name, choice, answer)
        call = answer.message.tool_calls[0]
        if choice == "named":
            assert call.function.name == name
        _check_call(call)
        deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or ()]
        assert [(d.function.name, d.function.arguments) for d in deltas] == [(call.function.name,
                                                                              call.function.arguments)]
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
            ["tool_calls"]


def _error(exc: openai.APIStatusError) -> dict[str, Any]:
    return exc.response.json()["error"]


def _schema_of(chars: int) -> dict[str, Any]:
    """A JSON schema of exactly `chars` characters as JSON text."""
    base = {"type": "object", "properties": {"note": {"type": "string", "maxLength": 4, "description": ""}}}
    pad = chars - len(json.dumps(base))
    base["properties"]["note"]["description"] = "x" * pad
    assert len(json.dumps(base)) == chars
    return base


def _tools(count: int) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": f"f{i}"}} for i in range(count)]


HI = [{"role": "user", "content": "Hi"}]
CAPS = [  # (field, endpoint arguments just under the cap or at it, the same just over it, the cap quoted)
    ("stop", {"stop": [f"#{i}#" for i in range(MAX_STOP)]}, {"stop": [f"#{i}#" for i in range(MAX_STOP + 1)]},
     MAX_STOP),
    ("stop", {"stop": ["y" * MAX_STOP_CHARS]}, {"stop": ["y" * (MAX_STOP_CHARS + 1)]}, MAX_STOP_CHARS),
    ("stop_token_ids", {"extra_body": {"stop_token_ids": list(range(1000, 1000 + MAX_STOP_TOKEN_IDS))}},
     {"extra_body": {"stop_token_ids": list(range(1000, 1001 + MAX_STOP_TOKEN_IDS))}}, MAX_STOP_TOKEN_IDS),
    ("logit_bias", {"logit_bias": {str(1000 + i): 0.5 for i in range(MAX_LOGIT_BIAS)}},
     {"logit_bias": {str(1000 + i): 0.5 for i in range(MAX_LOGIT_BIAS + 1)}}, MAX_LOGIT_BIAS),
    ("tools", {"tools": _tools(MAX_TOOLS), "tool_choice": "none"},
     {"tools": _tools(MAX_TOOLS + 1), "tool_choice": "none"}, MAX_TOOLS),
    ("tools.0.function.parameters",  # tool_choice none: the tools stay out of the prompt, the cap still holds
     {"tools": [{"type": "function", "function": {"name": "f", "parameters": _schema_of(MAX_SCHEMA_CHARS)}}],
      "tool_choice": "none"},
     {"tools": [{"type": "function", "function": {"name": "f", "parameters": _schema_of(MAX_SCHEMA_CHARS + 1)}}],
      "tool_choice": "none"}, MAX_SCHEMA_CHARS),
    ("response_format.json_schema.schema",
     {"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": _schema_of(MAX_SCHEMA_CHARS)}}},
     {"response_format": {"type": "json_schema", "json_schema": {"name": "n",
                                                                 "schema": _schema_of(MAX_SCHEMA_CHARS + 1)}}},
     MAX_SCHEMA_CHARS),
    ("structured_outputs.json", {"extra_body": {"structured_outputs": {"json": _schema_of(MAX_SCHEMA_CHARS)}}},
     {"extra_body": {"structured_outputs": {"json": _schema_of(MAX_SCHEMA_CHARS + 1)}}}, MAX_SCHEMA_CHARS),
]


@pytest.mark.parametrize("param, under, over, cap", CAPS, ids=[f"{c[0]}-{c[3]}" for c in CAPS])
def test_each_cap_accepts_up_to_it_and_refuses_past_it_naming_the_field(
        client: openai.OpenAI, server: ServerThread, param: str, under: dict[str, Any], over: dict[str, Any],
        cap: int) -> None:
    accepted = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=4, temperature=0, **under)
    assert accepted.choices[0].finish_reason in ("stop", "length", "tool_calls")
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=HI, max_tokens=4, temperature=0, **over)
    error = _error(refused.value)
    assert error["param"] == param and f"{cap:,}" in error["message"], error
    assert len(error["message"]) < 500, error["message"]  # the refusal quotes no thousand-item list back
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}


def test_the_server_still_answers_after_the_refusals(client: openai.OpenAI) -> None:
    answer = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0)
    assert "Paris" in answer.choices[0].text
