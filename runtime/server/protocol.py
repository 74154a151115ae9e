"""OpenAI request bodies and the OpenAI error shape.

Unknown fields are errors (400 naming the field), like unknown YAML keys, and so are NaN and Infinity
(which Python's JSON parser accepts). OpenAI fields this server
does not implement are accepted only at their neutral value, so clients that always send them
(`best_of: 1`, `suffix: ""`) still work while a real use of them is refused clearly. Value rules
(ranges, logit_bias ids) are SamplingParams' and the engine's, so the API, `LLM` and the JSONL of
`pagedgraph generate` refuse the same values with the same message; `SamplingFields.params` is the one
place a body becomes SamplingParams.
"""
from __future__ import annotations

import json
from typing import Any, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from ..constraints import Constraint, ConstraintError
from ..request_limits import MAX_SCHEMA_CHARS, MAX_TOOLS
from ..sampling_params import RequestError, SamplingParams

NEUTRAL: dict[str, tuple[Any, ...]] = {
    "suffix": (None, ""),
    "best_of": (None, 1),
    # SGLang's request extras, which vllm-router and sglang-router write into every body they forward (at
    # these values) when a fleet's router re-serializes a request (docs/scale-out.md).
    "no_stop_trim": (None, False),
    "skip_special_tokens": (None, True),
    "return_hidden_states": (None, False),
    "continue_final_message": (None, False),
    "separate_reasoning": (None, True),
    "stream_reasoning": (None, True),
    "include_reasoning": (None, True),
}


class APIError(Exception):
    """An error answered as {"error": {message, type, param, code}} with `status`."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    @field_validator(*NEUTRAL, check_fields=False)
    @classmethod
    def _neutral(cls, value: Any, info: ValidationInfo) -> Any:
        if not any(value == v and type(value) is type(v) for v in NEUTRAL[info.field_name]):
            raise ValueError(f"{value!r} is not supported by this server; leave the field out")
        return value


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = False


class _Part(BaseModel):
    """A nested object of a request body: unknown fields are errors there too."""

    model_config = ConfigDict(extra="forbid", strict=True)


class JSONSchemaFormat(BaseModel):
    """OpenAI's response_format.json_schema; `schema` is held as `schema_` (pydantic reserves the name)."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Part):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> "ResponseFormat":
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError('json_schema is given exactly when type is "json_schema"')
        return self

    def constraint(self) -> Constraint | None:
        if self.type == "json_object":
            return Constraint("json_object", "", "response_format")
        if self.json_schema is not None:
            strict = self.json_schema.strict
            return Constraint.json_schema(self.json_schema.schema_, "response_format.json_schema.schema",
                                          strict=strict is not False, closed=strict is True)
        return None


class SamplingFields(_Body):
    """Fields shared by both endpoints; None means "use the deployment's default"."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = Field(None, ge=0, lt=1 << 64)
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token id (a decimal string, as JSON keys are) -> bias
    # vLLM's extra sampling fields, under vLLM's names.
    repetition_penalty: float | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    # vLLM's StructuredOutputsParams: one of json | regex | choice | grammar | json_object (+ its options)
    structured_outputs: dict[str, Any] | None = None
    response_format: ResponseFormat | None = None  # OpenAI's (chat); vLLM takes it on completions too
    # Neutral only (NEUTRAL): what a fleet's router adds to the bodies it forwards.
    no_stop_trim: bool | None = None
    skip_special_tokens: bool | None = None
    return_hidden_states: bool | None = None

    def constraint(self) -> Constraint | None:
        """What the output must match; raises ConstraintError naming the field."""
        given = [c for c in (self.response_format.constraint() if self.response_format else None,
                             Constraint.from_vllm(self.structured_outputs) if self.structured_outputs else None)
                 if c is not None]
        if len(given) > 1:
            raise ConstraintError("structured_outputs", "give either response_format or structured_outputs, not both")
        return given[0] if given else None

    def params(self, defaults: Mapping[str, Any], constraint: Constraint | None = None) -> SamplingParams:
        """The request's SamplingParams over the deployment's `defaults`, with `constraint` (the request's
        structured output, if any); refused values are a 400 naming the field."""
        given = {**self.sampling(), **({"structured_outputs": constraint} if constraint is not None else {})}
        try:
            return SamplingParams(**{**defaults, **given})
        except RequestError as exc:
            raise APIError(400, str(exc), param=exc.field) from None

    def sampling(self) -> dict[str, Any]:
        """The fields SamplingParams takes as they are; None ones are left to the deployment's defaults."""
        given = {"max_tokens": self.max_tokens, "temperature": self.temperature, "top_p": self.top_p,
                 "top_k": self.top_k, "min_p": self.min_p, "seed": self.seed, "stop": self.stop,
                 "stop_token_ids": self.stop_token_ids, "n": self.n,
                 "ignore_eos": self.ignore_eos, "min_tokens": self.min_tokens,
                 "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
                 "repetition_penalty": self.repetition_penalty, "logit_bias": self.logit_bias}
        return {k: v for k, v in given.items() if v is not None}


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False  # the prompt's text before the completion's (with logprobs: the prompt tokens' too)
    suffix: str | None = None
    best_of: int | None = None
    prompt_logprobs: int | None = None  # vLLM's field: top-k logprobs per prompt token, in each choice

    @property
    def listed(self) -> bool:
        """`prompt` is a list of prompts (strings or token-id lists), not one: errors name a position."""
        prompt = self.prompt
        return isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)

    @property
    def prompts(self) -> list[str | list[int]]:
        """Each prompt of the body, in order: the one it holds, or those of its list."""
        return list(self.prompt) if self.listed else [self.prompt]  # type: ignore[list-item]

    def sampling(self) -> dict[str, Any]:
        """echo with logprobs reports the prompt tokens' log-probabilities as well, as OpenAI does; with
        prompt_logprobs too, the prompt entries carry the larger of the two top-k counts."""
        wanted = [k for k in (self.prompt_logprobs, self.logprobs if self.echo else None) if k is not None]
        given = {"logprobs": self.logprobs, "prompt_logprobs": max(wanted) if wanted else None}
        return {**super().sampling(), **{k: v for k, v in given.items() if v is not None}}


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text"]
    text: str


class FunctionCall(_Part):
    name: str
    arguments: str  # JSON text


class ToolCall(_Part):
    """A call the assistant made earlier in the conversation, sent back by the client."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant messages
    tool_call_id: str | None = None  # tool messages: the call this is the result of

    @model_validator(mode="after")
    def _tool_fields(self) -> "ChatMessage":
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("tool_calls belong to assistant messages")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError('tool messages need tool_call_id (the id of the call they answer), and only they take it')
        return self

    def plain(self) -> dict[str, Any]:
        """The message as the chat template sees it: content parts joined into one string."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class FunctionDefinition(_Part):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _bounded(cls, schema: dict[str, Any] | None) -> dict[str, Any] | None:
        size = len(json.dumps(schema)) if schema is not None else 0
        if size > MAX_SCHEMA_CHARS:
            raise ValueError(f"{size:,} characters as JSON text; at most {MAX_SCHEMA_CHARS:,} are accepted")
        return schema


class Tool(_Part):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Part):
    name: str


class NamedToolChoice(_Part):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # default: auto with tools
    parallel_tool_calls: bool = True
    # Neutral only (NEUTRAL): what a fleet's router adds to the chat bodies it forwards.
    continue_final_message: bool | None = None
    separate_reasoning: bool | None = None
    stream_reasoning: bool | None = None
    include_reasoning: bool | None = None

    @property
    def num_logprobs(self) -> int | None:
        """logprobs + top_logprobs as SamplingParams counts them: None (off) or the top-k count."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def sampling(self) -> dict[str, Any]:
        """max_completion_tokens stands in for max_tokens (OpenAI's newer name); logprobs as `num_logprobs`."""
        given = {"max_tokens": self.max_tokens if self.max_tokens is not None else self.max_completion_tokens,
                 "logprobs": self.num_logprobs}
        return {**super().sampling(), **{k: v for k, v in given.items() if v is not None}}

    @field_validator("tools")
    @classmethod
    def _distinct_names(cls, tools: list[Tool] | None) -> list[Tool] | None:
        if len(tools or ()) > MAX_TOOLS:
            raise ValueError(f"{len(tools or ()):,} tools; at most {MAX_TOOLS} are accepted per request")
        names = [t.function.name for t in tools or ()]
        if len(set(names)) != len(names):
            raise ValueError("two tools have the same name")
        return tools

    @field_validator("tool_choice")
    @classmethod
    def _choice_among_tools(cls, choice: Any, info: ValidationInfo) -> Any:
        names = [t.function.name for t in info.data.get("tools") or ()]
        if choice not in (None, "none") and not names:
            raise ValueError("tool_choice needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"names {choice.function.name!r}, which is not among the tools ({', '.join(names)})")
        return choice


class TokenizeRequest(_Body):
    """vLLM's /tokenize body: a `prompt` (completions) or `messages` (chat, rendered by the chat template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default as vLLM's: true for a prompt, false for messages
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]
