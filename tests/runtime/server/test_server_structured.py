"""Structured output and tool calling through the official `openai` client, against the real server and model.

Outputs are validated with `jsonschema`; unconstrained requests served beside constrained ones must equal
their solo greedy output; streamed answers (content and tool-call deltas) must equal the whole ones.
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

from tests.runtime.server.serving import MODEL, ServerThread, serve

pytestmark = pytest.mark.e2e
KEY = "test-key"
MAX_TOKENS = 120
ENUMS = [["red", "green", "blue"], ["low", "medium", "high"], ["cat", "dog"], ["yes", "no", "maybe"],
         ["north", "south", "east", "west"]]
NAMES = ["user", "order", "city", "book", "device", "team", "recipe", "ticket", "planet", "song"]


def schema(i: int) -> dict[str, Any]:
    """The i-th of 20 distinct schemas: nested objects, arrays, enums and required fields, bounded in size."""
    name, enum = NAMES[i % len(NAMES)], ENUMS[i % len(ENUMS)]
    text = {"type": "string", "maxLength": 6 + i % 5}
    count = {"type": "integer", "minimum": 0, "maximum": 10 ** (1 + i % 3)}
    inner: dict[str, Any] = {"label": {"enum": enum}, "size": count}
    if i % 2:
        inner["flag"] = {"type": "boolean"}
    item = text if i % 3 else {"type": "object", "properties": {"id": count, "kind": {"enum": enum}},
                               "required": ["id", "kind"], "additionalProperties": False}
    properties: dict[str, Any] = {
        "name": text,
        f"{name}_info": {"type": "object", "properties": inner, "required": sorted(inner),
                         "additionalProperties": False},
        "items": {"type": "array", "items": item, "minItems": 1, "maxItems": 1 + i % 2},
    }
    if i >= 10:
        properties["status"] = {"enum": ENUMS[(i + 1) % len(ENUMS)]}
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


SCHEMAS = [schema(i) for i in range(20)]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The current weather in a city.",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The local time in a time zone.",
                                           "parameters": {"type": "object", "properties": {
                                               "zone": {"type": "string", "maxLength": 20}},
                                               "required": ["zone"], "additionalProperties": False}}}]
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris right now?"}]


def ask(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Describe a {NAMES[i % len(NAMES)]} as a JSON record."}]


def json_schema_format(i: int) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": f"record_{i}", "schema": SCHEMAS[i], "strict": True}}


@pytest.fixture(scope="module")
def server(smollm2_artifact: Path) -> Iterator[ServerThread]:
    with serve(smollm2_artifact,
               kv_cache={"num_blocks": 512},
               scheduler={"max_model_len": 512},
               server={"api_key": KEY, "max_concurrent_requests": 32}) as thread:
        yield thread


@pytest.fixture
def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)


def aclient(server: ServerThread) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)


def test_twenty_json_schemas_validate(server: ServerThread) -> None:
    async def one(client: openai.AsyncOpenAI, i: int) -> Any:
        return await client.chat.completions.create(model=MODEL, messages=ask(i), response_format=json_schema_format(i),
                                                    max_tokens=MAX_TOKENS, temperature=0)

    async def all_of_them() -> list[Any]:
        client = aclient(server)
        return await asyncio.gather(*(one(client, i) for i in range(len(SCHEMAS))))

    for i, response in enumerate(asyncio.run(all_of_them())):
        choice = response.choices[0]
        assert choice.finish_reason == "stop", (i, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), SCHEMAS[i])


def test_streamed_and_n3_outputs_validate(server: ServerThread) -> None:
    args: dict[str, Any] = {"model": MODEL, "messages": ask(3), "response_format": json_schema_format(3),
                            "max_tokens": MAX_TOKENS}

    async def streamed(client: openai.AsyncOpenAI) -> str:
        stream = await client.chat.completions.create(temperature=0, stream=True, **args)
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async def all_of_them() -> tuple[Any, str, Any]:  # served together
        client = aclient(server)
        return await asyncio.gather(client.chat.completions.create(temperature=0, **args), streamed(client),
                                    client.chat.completions.create(temperature=1.0, seed=11, n=3, **args))

    whole, text, sampled = asyncio.run(all_of_them())
    assert text == whole.choices[0].message.content
    jsonschema.validate(json.loads(text), SCHEMAS[3])
    texts = [c.message.content for c in sampled.choices]
    assert len(texts) == 3 and len(set(texts)) > 1
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMAS[3])


def test_constrained_and_unconstrained_requests_share_batches(server: ServerThread, client: openai.OpenAI) -> None:
    plain = [f"Write one short sentence about the number {i}." for i in range(8)]
    solo = [client.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0).choices[0].text
            for p in plain]

    async def constrained(c: openai.AsyncOpenAI, i: int) -> str:
        response = await c.chat.completions.create(model=MODEL, messages=ask(i), response_format=json_schema_format(i),
                                                   max_tokens=MAX_TOKENS, temperature=0)
        return response.choices[0].message.content

    async def free(c: openai.AsyncOpenAI, prompt: str) -> str:
        response = await c.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
        return response.choices[0].text

    async def all_of_them() -> list[str]:
        c = aclient(server)
        return await asyncio.gather(*(constrained(c, i) for i in range(8)), *(free(c, p) for p in plain))

    results = asyncio.run(all_of_them())
    for i, text in enumerate(results[:8]):
        jsonschema.validate(json.loads(text), SCHEMAS[i])
    assert results[8:] == solo
    metrics = httpx.get(f"{server.url}/metrics").text
    seconds = re.search(r'pagedgraph_logits_processor_seconds_total\{processor="structured_output"\} (\S+)', metrics)
    assert seconds is not None and float(seconds.group(1)) > 0


def test_vllm_structured_outputs_fields(client: openai.OpenAI) -> None:
    choice = client.completions.create(model=MODEL, prompt="My favourite colour is", max_tokens=8, temperature=0,
                                       extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}})
    assert choice.choices[0].text in ("red", "green", "blue")
    regex = client.chat.completions.create(model=MODEL, messages=ask(0), max_tokens=16, temperature=0,
                                           extra_body={"structured_outputs": {"regex": "[A-Z][a-z]{2,8} [0-9]{2}"}})
    assert re.fullmatch("[A-Z][a-z]{2,8} [0-9]{2}", regex.choices[0].message.content)
    grammar = 'root ::= "The answer is " ("yes" | "no") "."'  # GBNF, as vLLM's xgrammar backend takes it
    answer = client.chat.completions.create(model=MODEL, messages=ask(1), max_tokens=16, temperature=0,
                                            extra_body={"structured_outputs": {"grammar": grammar}})
    assert answer.choices[0].message.content in ("The answer is yes.", "The answer is no.")
    question = [{"role": "user", "content": 'What is 2+2? Answer in JSON with one key, "answer".'}]
    obj = client.chat.completions.create(model=MODEL, messages=question, max_tokens=40, temperature=0,
                                         response_format={"type": "json_object"})
    assert isinstance(json.loads(obj.choices[0].message.content), dict)


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format.json_schema.schema"),
    ({"structured_outputs": {"regex": "(("}}, "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": "root ::= undefined_rule"}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"choice": "red"}}, "structured_outputs.choice"),
    ({"structured_outputs": {"regex": "a", "json_object": True}}, "structured_outputs"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
])
def test_a_bad_constraint_is_a_400_naming_the_field(client: openai.OpenAI, body: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=ask(0), max_tokens=4, extra_body=body)
    error = info.value.response.json()["error"]
    assert error["param"] == param, error
    assert error["message"].startswith(param)


def _arguments(call: Any, tools: list[dict[str, Any]] = TOOLS) -> dict[str, Any]:
    schema = next(t["function"]["parameters"] for t in tools if t["function"]["name"] == call.function.name)
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, schema)
    return arguments


def test_required_tool_choice_returns_a_valid_call_and_streams_the_same(server: ServerThread) -> None:
    args: dict[str, Any] = {"model": MODEL, "messages": ASK_WEATHER, "tools": TOOLS, "tool_choice": "required",
                            "parallel_tool_calls": False, "max_tokens": 60, "temperature": 0}

    async def streamed(client: openai.AsyncOpenAI) -> list[Any]:
        return [chunk async for chunk in await client.chat.completions.create(stream=True, **args)]

    async def both() -> tuple[Any, list[Any]]:  # served together
        client = aclient(server)
        return await asyncio.gather(client.chat.completions.create(**args), streamed(client))

    whole, chunks = asyncio.run(both())
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    _arguments(call)

    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or ()]
    assert deltas and {d.index for d in deltas} == {0} and deltas[0].id and deltas[0].type == "function"
    assert "".join(d.function.name or "" for d in deltas) == call.function.name
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]


def test_a_named_function_is_called(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, tools=TOOLS, max_tokens=40,
                                              temperature=0, tool_choice={"type": "function",
                                                                          "function": {"name": "get_time"}})
    calls = response.choices[0].message.tool_calls
    assert calls and all(c.function.name == "get_time" for c in calls)
    for call in calls:
        _arguments(call)


def test_the_tool_result_goes_back_and_gets_an_answer(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=60, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    history = [*ASK_WEATHER, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 18, "sky": "clear"})}]
    second = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=24, temperature=0)
    answer = second.choices[0]
    assert answer.message.tool_calls is None and answer.message.content
    assert answer.finish_reason in ("stop", "length")
    with pytest.raises(openai.BadRequestError) as info:  # a tool message must say which call it answers
        client.chat.completions.create(model=MODEL, messages=[*history[:2], {"role": "tool", "content": "18"}],
                                       max_tokens=4)
    assert info.value.response.json()["error"]["param"].startswith("messages.2")


TOOLS_TEMPLATE = ("{% if tools %}TOOLS {{ tools | tojson }}\n{% endif %}{% for m in messages %}{{ m.role }}: "
                  "{{ m.content }}{% for c in m.tool_calls or [] %} CALL {{ c.function.name }} "
                  "{{ c.function.arguments | tojson }}{% endfor %}\n{% endfor %}")


def _tool_request(tool_choice: Any) -> Any:
    from pagedgraph.runtime.server.protocol import ChatCompletionRequest
    from pagedgraph.runtime.server.tool_calls import HermesParser, ToolRequest

    body = ChatCompletionRequest.model_validate({"messages": ASK_WEATHER, "tools": TOOLS, "tool_choice": tool_choice})
    return ToolRequest([t.model_dump(exclude_none=True) for t in body.tools or ()], body.tool_choice, True,
                       HermesParser())


def test_tools_reach_a_template_that_reads_them_and_the_system_prompt_otherwise() -> None:
    from pagedgraph.runtime.server.tool_calls import template_takes_tools

    assert template_takes_tools(TOOLS_TEMPLATE) and not template_takes_tools("{{ messages[0].content }}")
    history = [*ASK_WEATHER, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
               {"role": "tool", "content": '{"celsius": 18}', "tool_call_id": "call_1"}]
    tools = _tool_request("auto")
    messages, variables = tools.render(history, takes_tools=True)
    assert variables == {"tools": TOOLS}
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris", "unit": "celsius"}
    assert messages[2] == history[2]

    messages, variables = tools.render(history, takes_tools=False)
    assert variables == {} and messages[0]["role"] == "system"
    assert all(json.dumps(t) in messages[0]["content"] for t in TOOLS) and "<tool_call>" in messages[0]["content"]
    assert messages[2]["content"] == ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
                                      '"unit": "celsius"}}\n</tool_call>')
    assert messages[3] == {"role": "user", "content": '<tool_response>\n{"celsius": 18}\n</tool_response>'}

    none_messages, none_variables = _tool_request("none").render(ASK_WEATHER, takes_tools=True)
    assert none_variables == {} and none_messages == ASK_WEATHER


@pytest.mark.parametrize("text, content, calls", [
    ("Just text.  ", "Just text.", []),
    ('Sure. <tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n<tool_call>\n{"name": "g", '
     '"arguments": "{\\"b\\": 2}"}\n</tool_call>', "Sure.", [("f", '{"a": 1}'), ("g", '{"b": 2}')]),
    ("text <tool_call> not json </tool_call> more", "text <tool_call> not json </tool_call> more", []),
    ('<tool_call>\n{"name": "f", "arg', '<tool_call>\n{"name": "f", "arg', []),
    ("a <tool_ca", "a <tool_ca", []),
])
def test_the_call_splitter_gives_the_same_answer_in_any_pieces(text: str, content: str,
                                                              calls: list[tuple[str, str]]) -> None:
    from pagedgraph.runtime.server.tool_calls import CallSplitter, HermesParser

    for size in (len(text), 1, 2, 3, 7):
        splitter, got, parsed = CallSplitter(HermesParser()), "", []
        for start in range(0, len(text), size):
            piece, new = splitter.push(text[start:start + size])
            got, parsed = got + piece, parsed + new
        got += splitter.finish()
        assert (got, [(c.name, c.arguments) for c in parsed]) == (content, calls), size
