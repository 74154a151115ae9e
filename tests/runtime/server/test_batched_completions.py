"""/v1/completions with a list of prompts, on the real model: each prompt is answered as if it came alone.

One server serves the module. The answers of a batched request are checked against the same prompts sent one
by one to the same server (greedy), its refusals against the engine's state (nothing left queued or holding
blocks), and its stream against its whole answer.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import httpx
import openai
import pytest

from tests.runtime.server.serving import (MODEL, ServerThread, assert_refused_before_running, fail_the_next_step,
                                          idle, metrics, serve)

pytestmark = pytest.mark.e2e
MAX_PROMPTS = 6
PROMPTS = ["The capital of France is", "One, two, three,", "My favourite colour is", "Water boils at"]
VOCAB = 49152


@pytest.fixture(scope="module")
def server(smollm2_artifact: Path) -> Iterator[ServerThread]:
    with serve(smollm2_artifact, kv_cache={"num_blocks": 128}, scheduler={"max_model_len": 256},
               sampling={"max_tokens": 8}, server={"max_prompts_per_request": MAX_PROMPTS}) as thread:
        yield thread


@pytest.fixture(scope="module")
def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0)


@pytest.fixture(scope="module")
def alone(client: openai.OpenAI) -> dict[str, Any]:
    """Each prompt sent by itself: greedy, 8 tokens."""
    return {p: client.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0) for p in PROMPTS}


def test_a_list_of_prompts_is_answered_prompt_by_prompt_as_if_each_came_alone(client: openai.OpenAI,
                                                                              alone: dict[str, Any]) -> None:
    both = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=8, temperature=0, n=2)
    assert [c.index for c in both.choices] == list(range(2 * len(PROMPTS)))
    assert [c.text for c in both.choices] == [alone[p].choices[0].text for p in PROMPTS for _ in range(2)]
    assert both.usage.prompt_tokens == sum(alone[p].usage.prompt_tokens for p in PROMPTS)
    assert both.usage.completion_tokens == 2 * sum(alone[p].usage.completion_tokens for p in PROMPTS)
    assert both.usage.total_tokens == both.usage.prompt_tokens + both.usage.completion_tokens


def test_token_id_lists_are_prompts_too(client: openai.OpenAI, server: ServerThread, alone: dict[str, Any]) -> None:
    ids = [httpx.post(f"{server.url}/tokenize", json={"prompt": p}).json()["tokens"] for p in PROMPTS[:3]]
    answer = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0, echo=True)
    assert [c.text for c in answer.choices] == [p + alone[p].choices[0].text for p in PROMPTS[:3]]


def test_echo_with_logprobs_scores_every_prompt_as_alone(client: openai.OpenAI) -> None:
    """lm-evaluation-harness's loglikelihood request: echo, logprobs 1, one token generated, several prompts."""
    args: dict[str, Any] = {"model": MODEL, "max_tokens": 1, "temperature": 0, "echo": True, "logprobs": 1}
    batched = client.completions.create(prompt=PROMPTS, **args)
    for prompt, choice in zip(PROMPTS, batched.choices):
        single = client.completions.create(prompt=prompt, **args).choices[0]
        assert choice.text == single.text and choice.text.startswith(prompt)
        assert choice.logprobs.tokens == single.logprobs.tokens
        assert choice.logprobs.token_logprobs == pytest.approx(single.logprobs.token_logprobs, abs=1e-6)
        assert choice.logprobs.token_logprobs[0] is None
        assert len(choice.logprobs.token_logprobs) == len(choice.logprobs.top_logprobs)


def test_the_stream_of_several_prompts_equals_their_whole_answer(client: openai.OpenAI) -> None:
    args: dict[str, Any] = {"model": MODEL, "prompt": PROMPTS[:3], "max_tokens": 12, "temperature": 0, "n": 2,
                            "stop": [".", "\n"], "echo": True}
    whole = client.completions.create(**args)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **args))
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason is not None:
                assert choice.index not in reasons, "a choice finished twice"
                reasons[choice.index] = choice.finish_reason
    assert texts == {c.index: c.text for c in whole.choices}
    assert reasons == {c.index: c.finish_reason for c in whole.choices}
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (whole.usage.prompt_tokens, whole.usage.completion_tokens)


def test_more_prompts_than_the_cap_are_refused_naming_the_setting(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=["Hi"] * (MAX_PROMPTS + 1), max_tokens=2)
    error = err.value.response.json()["error"]
    assert error["param"] == "prompt"
    assert f"{MAX_PROMPTS + 1} prompts" in error["message"]
    assert f"server.max_prompts_per_request = {MAX_PROMPTS}" in error["message"]


@pytest.mark.parametrize("bad, param, words", [
    ("", "prompt[2]", "prompt[2]: is empty"),  # the engine's check
    ("a\ud800b", "prompt[2]", "prompt[2]: the prompt is not valid Unicode"),  # the tokenizer's
    (" word" * 300, "prompt[2]", "prompt[2]: the prompt is"),  # longer than max_model_len
    ([5, VOCAB], "prompt[2]", f"prompt[2]: token ids must be integers in [0, {VOCAB})"),
], ids=["empty", "surrogate", "too-long", "out-of-vocabulary"])
def test_one_bad_prompt_fails_the_request_by_its_position_and_nothing_runs(server: ServerThread, bad: Any,
                                                                           param: str, words: str) -> None:
    same_kind = PROMPTS if isinstance(bad, str) else [[1, 2, 3]] * 4
    prompts = [*same_kind[:2], bad, same_kind[3]]
    assert_refused_before_running(server, lambda: httpx.post(
        f"{server.url}/v1/completions", content=json.dumps({"prompt": prompts, "max_tokens": 8}),
        headers={"Content-Type": "application/json"}), param, words)


def test_a_max_tokens_that_fits_no_prompt_is_named_with_the_prompt(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=[PROMPTS[0], " word" * 200], max_tokens=60)
    error = err.value.response.json()["error"]
    assert error["param"] == "max_tokens" and error["message"].startswith("prompt[1]: max_tokens"), error
    assert error["code"] == "context_length_exceeded"


def test_a_client_that_leaves_a_batched_stream_aborts_every_prompt(server: ServerThread) -> None:
    body = {"prompt": PROMPTS, "max_tokens": 200, "ignore_eos": True, "stream": True, "n": 2}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        busy = metrics(server)
        assert busy["pagedgraph_http_requests_in_flight"] == len(PROMPTS)
        assert busy["pagedgraph_kv_blocks_used"] > 0
    idle(server)
    finished = metrics(server)["raw"]
    assert 'pagedgraph_requests_finished_total{reason="abort"}' in str(finished)


def test_prompts_count_one_by_one_against_max_concurrent_requests(server: ServerThread,
                                                                  client: openai.OpenAI) -> None:
    frontend = server.app.state.frontend
    limits = frontend.limits
    frontend.limits = limits.model_copy(update={"max_concurrent_requests": 3})
    try:
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=2)
        assert "server.max_concurrent_requests = 3" in err.value.response.json()["error"]["message"]
        stream = client.completions.create(model=MODEL, prompt=PROMPTS[:2], max_tokens=200, stream=True,
                                           extra_body={"ignore_eos": True})
        try:
            next(iter(stream))
            with pytest.raises(openai.RateLimitError):
                client.completions.create(model=MODEL, prompt=PROMPTS[2:], max_tokens=2)
            assert client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=2).choices
        finally:
            stream.close()
    finally:
        frontend.limits = limits
    idle(server)


def test_a_failed_step_fails_the_whole_request_and_frees_every_prompt(server: ServerThread,
                                                                     client: openai.OpenAI) -> None:
    fail_the_next_step(server)
    with pytest.raises(openai.InternalServerError) as err:
        client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=4)
    assert err.value.response.json()["error"]["message"] == "engine step failed: injected"
    idle(server)
    assert len(client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=2).choices) == len(PROMPTS)
