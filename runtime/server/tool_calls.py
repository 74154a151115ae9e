"""Tool calling for chat completions: tool definitions into the prompt, the model's calls out of its text.

- **Prompt.** A chat template that reads `tools` gets them (OpenAI's shape) and renders them its own way;
  any other template gets `TOOLS_SYSTEM_PROMPT` (the tool signatures and the call format) added to the
  system message. Past assistant `tool_calls` and `role: "tool"` results are passed on as OpenAI shapes
  them to a template that reads `tools`, and written in the family's call format otherwise.
- **Calls.** A `ToolParser` per model family splits the generated text into content and calls; the first
  is Hermes/Qwen's `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`. One incremental splitter
  serves the streamed and the whole response, so streamed `delta.tool_calls` concatenate to the whole
  response's `message.tool_calls`.
- **Enforced calls.** `tool_choice: "required"` or a named function becomes a grammar of the family's call
  format with each function's `parameters` as the arguments' JSON schema, closed as OpenAI's strict mode
  closes it (no key outside `parameters`, unless the function sets `strict: false`), so even a small model
  returns a parseable call with schema-valid arguments. A forced call is one call, and generation ends when
  it closes: given room for more, a small model repeats its call until `max_tokens` (parallel calls come
  with `tool_choice: "auto"`).
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

import jinja2
import jinja2.meta

from ..constraints import Constraint, ConstraintError, closed_schema
from .protocol import ChatCompletionRequest, SamplingFields
from .responses import ChatFormat
from ..structured_output import JSON_OPTIONS
from ..tokenizer import Tokenizer

TOOLS_SYSTEM_PROMPT = """# Tools

You can call functions to answer the user. Their signatures, one JSON object per line:
<tools>
{tools}
</tools>

To call a function, answer with one block per call, each holding a JSON object with the function's name
and its arguments:
<tool_call>
{{"name": <function name>, "arguments": <arguments as a JSON object>}}
</tool_call>"""


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolParser(Protocol):
    """One model family's call format: how a call is written, and where calls start and end in the text."""

    start: str
    end: str

    def parse(self, block: str) -> ParsedCall | None:
        """The call written between `start` and `end`, or None if it is not one."""

    def write(self, name: str, arguments: Any) -> str:
        """A call as the model would write it (for past calls in the conversation), markers included."""

    def grammar(self, functions: Sequence[dict[str, Any]]) -> str:
        """A Lark grammar (llguidance's dialect) of one call to one of these functions."""


class HermesParser:
    """Hermes / Qwen 2.5: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`."""

    start = "<tool_call>"
    end = "</tool_call>"

    def parse(self, block: str) -> ParsedCall | None:
        try:
            call = json.loads(block)
        except json.JSONDecodeError:
            return None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return None
        arguments = call.get("arguments", call.get("parameters", {}))
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                return None
        if not isinstance(arguments, dict):
            return None
        return ParsedCall(call["name"], json.dumps(arguments, ensure_ascii=False))

    def write(self, name: str, arguments: Any) -> str:
        return f"{self.start}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n{self.end}"

    def grammar(self, functions: Sequence[dict[str, Any]]) -> str:
        rules = []
        for i, function in enumerate(functions):
            schema = {**function["parameters"], "x-guidance": JSON_OPTIONS}
            head = json.dumps(f'{{"name": {json.dumps(function["name"])}, "arguments": ')
            rules.append(f'f{i}: {head} a{i} "}}"\na{i}: %json {json.dumps(schema)}')
        calls = " | ".join(f"f{i}" for i in range(len(functions)))
        call = f'start: {json.dumps(self.start + chr(10))} ({calls}) {json.dumps(chr(10) + self.end)}'
        return "\n".join([call, *rules]) + "\n"


PARSERS: dict[str, ToolParser] = {"hermes": HermesParser()}


def parser_for(tokenizer: Tokenizer) -> ToolParser:
    """The model family's parser: Hermes/Qwen's format is the only one so far, and the default prompt's."""
    return PARSERS["hermes"]


def template_takes_tools(template: str | None) -> bool:
    """Whether the chat template reads a `tools` variable (else the tools go into the system prompt)."""
    if template is None:
        return False
    return "tools" in jinja2.meta.find_undeclared_variables(jinja2.Environment().parse(template))


@dataclass
class ToolRequest:
    """A chat request's tools, as the server acts on them."""

    tools: list[dict[str, Any]]  # OpenAI's [{"type": "function", "function": {...}}]
    choice: str | dict[str, Any]  # "none" | "auto" | "required" | {"type": "function", "function": {"name"}}
    parallel: bool  # false: only the first call the model writes is answered
    parser: ToolParser

    @property
    def active(self) -> bool:
        return bool(self.tools) and self.choice != "none"

    def functions(self) -> list[dict[str, Any]]:
        """The functions a call may name: all, or the named one."""
        functions = [t["function"] for t in self.tools]
        if isinstance(self.choice, dict):
            return [f for f in functions if f["name"] == self.choice["function"]["name"]]
        return functions

    def constraint(self) -> Constraint | None:
        """The grammar that forces a call (`required`, a named function); None lets the model choose.

        The arguments follow `parameters` under OpenAI's strict rule, its default for a forced call; a function
        with `strict: false` keeps JSON Schema's default (other keys allowed). One call, then the answer ends."""
        if not self.active or self.choice == "auto":
            return None
        functions = [{**f, "parameters": _arguments_schema(f)} for f in self.functions()]
        return Constraint("lark", self.parser.grammar(functions), "tools")

    def render(self, messages: list[dict[str, Any]], takes_tools: bool) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The messages and extra template variables for the chat template."""
        tools = self.tools if self.active else None
        if takes_tools:
            return [_for_template(m) for m in messages], ({"tools": tools} if tools else {})
        messages = [self._written(m) for m in messages]
        if tools:
            lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
            prompt = TOOLS_SYSTEM_PROMPT.format(tools=lines)
            if messages and messages[0]["role"] == "system":
                messages[0] = {**messages[0], "content": f"{messages[0]['content']}\n\n{prompt}"}
            else:
                messages.insert(0, {"role": "system", "content": prompt})
        return messages, {}

    def _written(self, message: dict[str, Any]) -> dict[str, Any]:
        """A past call or tool result as plain text, for templates that know nothing of tools."""
        if message["role"] == "tool":
            return {"role": "user", "content": f"<tool_response>\n{message['content']}\n</tool_response>"}
        calls = message.get("tool_calls")
        if not calls:
            return message
        written = [self.parser.write(c["function"]["name"], _arguments(c["function"]["arguments"])) for c in calls]
        content = "\n".join([message["content"], *written] if message["content"] else written)
        return {"role": message["role"], "content": content}


def tool_request(body: ChatCompletionRequest, tokenizer: Tokenizer) -> ToolRequest:
    """The request's tools; OpenAI's default tool_choice is "auto" with tools, "none" without."""
    choice = body.tool_choice if body.tool_choice is not None else ("auto" if body.tools else "none")
    return ToolRequest([t.model_dump(exclude_none=True) for t in body.tools or ()],
                       choice if isinstance(choice, str) else choice.model_dump(), body.parallel_tool_calls,
                       parser_for(tokenizer))


def structured_output(body: SamplingFields, tools: ToolRequest | None) -> Constraint | None:
    """The request's one constraint: response_format, structured_outputs, or a forced tool call."""
    given = body.constraint()
    forced = tools.constraint() if tools is not None else None
    if given is not None and forced is not None:
        raise ConstraintError("tool_choice", f"a {tools.choice if isinstance(tools.choice, str) else 'named'} tool "
                                             f"call cannot also follow {given.field.split('.')[0]}; drop one")
    return given or forced


def _arguments_schema(function: dict[str, Any]) -> dict[str, Any]:
    """The JSON schema a forced call's arguments follow: `parameters` (no arguments when left out), closed
    unless the function says `strict: false`."""
    schema = function.get("parameters") or {"type": "object", "properties": {}}
    return schema if function.get("strict") is False else closed_schema(schema)


def _arguments(text: str) -> Any:
    """A past call's arguments as JSON data when they parse (templates write them with `tojson`)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _for_template(message: dict[str, Any]) -> dict[str, Any]:
    calls = message.get("tool_calls")
    if not calls:
        return message
    return {**message, "tool_calls": [{**c, "function": {**c["function"], "arguments": _arguments(
        c["function"]["arguments"])}} for c in calls]}


@dataclass
class CallSplitter:
    """Splits one completion's text, pushed in pieces, into content and calls.

    Content is the text before the first call marker, without leading or trailing whitespace; after the
    marker only calls count. Text that may still turn out to be a marker, or trailing whitespace, is held
    back. If no call parses by the end, the text from the first marker on is content after all.
    """

    parser: ToolParser
    pending: str = ""  # text not yet given out
    in_calls: bool = False
    content_started: bool = False
    calls: list[ParsedCall] = field(default_factory=list)
    held: str = ""  # the text from the first marker on, given out as content if no call parses

    def push(self, text: str) -> tuple[str, list[ParsedCall]]:
        """New content, and the calls completed by `text`."""
        self.pending += text
        start, end = self.parser.start, self.parser.end
        content = ""
        if not self.in_calls:
            at = self.pending.find(start)
            if at < 0:
                cut = len(self.pending) - _partial_suffix(self.pending, start)
                return self._emit(len(self.pending[:cut].rstrip())), []
            content = self._emit(len(self.pending[:at].rstrip()))
            at = self.pending.find(start)  # the whitespace before the marker waits with the calls
            self.held, self.pending = self.pending[:at], self.pending[at:]
            self.in_calls = True
        calls = []
        while (close := self.pending.find(end)) >= 0:
            block, self.pending = self.pending[:close + len(end)], self.pending[close + len(end):]
            self.held += block
            at = block.find(start)
            call = self.parser.parse(block[at + len(start):close].strip()) if at >= 0 else None
            if call is not None:
                calls.append(call)
        self.calls.extend(calls)
        return content, calls

    def finish(self) -> str:
        """The content still held at the end."""
        if not self.in_calls:
            return self._emit(len(self.pending.rstrip()))
        if self.calls:
            return ""
        rest, self.pending, self.held = (self.held + self.pending).rstrip(), "", ""
        return rest if self.content_started else rest.lstrip()

    def _emit(self, cut: int) -> str:
        out, self.pending = self.pending[:cut], self.pending[cut:]
        if not self.content_started:
            out = out.lstrip()
            self.content_started = bool(out)
        return out


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that begins `marker`."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def _call_json(call: ParsedCall, index: int) -> dict[str, Any]:
    return {"index": index, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


class ToolChatFormat(ChatFormat):
    """Chat responses with `message.tool_calls` / streamed `delta.tool_calls`, `finish_reason: "tool_calls"`."""

    def __init__(self, model: str, tokenizer: Tokenizer, top_logprobs: int | None, parser: ToolParser,
                 parallel: bool = True) -> None:
        super().__init__(model, tokenizer, top_logprobs)
        self.parser = parser
        self.most = None if parallel else 1  # calls answered (parallel_tool_calls: false: the first only)
        self._streams: dict[int, CallSplitter] = {}

    def choice(self, index: int, text: str, token_ids: list[int], logprobs: list[dict[int, float]],
               finish_reason: str | None) -> dict[str, Any]:
        splitter = CallSplitter(self.parser)
        content, calls = splitter.push(text)
        content += splitter.finish()
        calls = calls[:self.most]
        body = super().choice(index, content, token_ids, logprobs, finish_reason)
        if calls:
            body["message"] = {"role": "assistant", "content": content or None,
                               "tool_calls": [{k: v for k, v in _call_json(c, i).items() if k != "index"}
                                              for i, c in enumerate(calls)]}
            body["finish_reason"] = "tool_calls" if finish_reason == "stop" else finish_reason
        return body

    def delta(self, index: int, text: str, token_ids: list[int], logprobs: list[dict[int, float]],
              finish_reason: str | None) -> dict[str, Any]:
        splitter = self._streams.setdefault(index, CallSplitter(self.parser))
        before = len(splitter.calls)
        content, calls = splitter.push(text)
        if finish_reason is not None:
            content += splitter.finish()
        calls = calls[:max(0, self.most - before)] if self.most is not None else calls
        body = super().delta(index, content, token_ids, logprobs, finish_reason)
        if calls:
            body["delta"]["tool_calls"] = [_call_json(c, before + i) for i, c in enumerate(calls)]
        if finish_reason == "stop" and splitter.calls:
            body["finish_reason"] = "tool_calls"
        return body
