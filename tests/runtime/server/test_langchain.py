"""LangChain (`langchain-openai`, the `clients` extra) against the real server, as its users call it.

The chat model's invoke, stream and batch, a forced tool call answered with a tool message, structured output
(json_schema and function_calling), and the completions LLM, whose `.generate` sends its prompts as one list.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import openai
import pytest
from pydantic import BaseModel, Field

from tests.runtime.server.serving import MODEL, ServerThread, client_library, serve

pytestmark = pytest.mark.e2e
langchain_openai = client_library("langchain_openai")
messages = client_library("langchain_core.messages")
tools = client_library("langchain_core.tools")


class City(BaseModel):
    """A city and its country."""

    name: str = Field(max_length=24)
    country: str = Field(max_length=24)


@pytest.fixture(scope="module")
def server(smollm2_artifact: Path) -> Iterator[ServerThread]:
    with serve(smollm2_artifact, kv_cache={"num_blocks": 128}, scheduler={"max_model_len": 512}) as thread:
        yield thread


def _chat(server: ServerThread, max_tokens: int = 16) -> Any:
    return langchain_openai.ChatOpenAI(model=MODEL, base_url=f"{server.url}/v1", api_key="-", temperature=0,
                                       max_tokens=max_tokens, max_retries=0)


def test_chat_invoke_stream_and_batch_agree(server: ServerThread) -> None:
    chat = _chat(server)
    question = "Name three colours."
    whole = chat.invoke(question)
    assert whole.content and whole.usage_metadata["output_tokens"] == 16
    chunks = list(chat.stream(question, stream_usage=True))
    assert "".join(chunk.content for chunk in chunks) == whole.content
    assert sum((chunk.usage_metadata or {}).get("output_tokens", 0) for chunk in chunks) == 16
    batch = chat.batch([question, "Name a fruit."])
    assert batch[0].content == whole.content and batch[1].content != whole.content


def test_a_tool_call_and_its_result_round_trip(server: ServerThread) -> None:
    @tools.tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        return json.dumps({"city": city, "celsius": 18})

    history: list[Any] = [messages.HumanMessage("What is the weather in Paris?")]
    call = _chat(server, 60).bind_tools([get_weather], tool_choice="get_weather").invoke(history)
    assert [c["name"] for c in call.tool_calls] == ["get_weather"] and isinstance(call.tool_calls[0]["args"]["city"], str)
    history += [call, get_weather.invoke(call.tool_calls[0])]
    assert isinstance(history[-1], messages.ToolMessage) and history[-1].tool_call_id == call.tool_calls[0]["id"]
    answer = _chat(server, 24).bind_tools([get_weather]).invoke(history)
    assert answer.content or answer.tool_calls


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_structured_output_is_parsed_into_the_schema(server: ServerThread, method: str) -> None:
    city = _chat(server, 60).with_structured_output(City, method=method).invoke("Name a city in Italy.")
    assert isinstance(city, City) and city.name and city.country


def test_the_completions_llm_generates_a_list_of_prompts_as_each_alone(server: ServerThread) -> None:
    prompts = ["The capital of France is", "One, two, three,", "The opposite of hot is"]
    llm = langchain_openai.OpenAI(model=MODEL, base_url=f"{server.url}/v1", api_key="-", temperature=0,
                                  max_tokens=12, max_retries=0)
    result = llm.generate(prompts)
    assert [len(generations) for generations in result.generations] == [1, 1, 1]
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0)
    alone = [client.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0) for p in prompts]
    assert [g[0].text for g in result.generations] == [a.choices[0].text for a in alone]
    assert result.llm_output["token_usage"]["prompt_tokens"] == sum(a.usage.prompt_tokens for a in alone)
