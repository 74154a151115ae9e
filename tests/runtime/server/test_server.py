"""The OpenAI-compatible server on the real model, driven by the official `openai` client over loopback.

One server (one engine loop) serves the whole module; greedy answers are checked against the offline
`LLM.generate` on the same artifact.
"""
from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import openai
import pytest

from pagedgraph.artifact.manifest import Manifest
from pagedgraph.runtime.engine import LLM, RequestOutput
from pagedgraph.runtime.sampling_params import SamplingParams
from tests.runtime.server.serving import (MODEL, ServerThread, fail_the_next_step, idle, metrics, serve,
                                          wait_for)

pytestmark = pytest.mark.e2e
KEY = "test-key"
MAX_CONCURRENT = 32
PROMPTS = [f"Write one short sentence about the number {i}." for i in range(MAX_CONCURRENT)]
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def server(smollm2_artifact: Path) -> Iterator[ServerThread]:
    with serve(smollm2_artifact,
               kv_cache={"num_blocks": 256},
               scheduler={"max_model_len": 512},
               sampling={"max_tokens": 16},
               server={"api_key": KEY, "max_concurrent_requests": MAX_CONCURRENT}) as thread:
        yield thread


@pytest.fixture(scope="module")
def reference(smollm2_artifact: Path) -> dict[str, RequestOutput]:
    """Greedy outputs of the offline API for every prompt the tests send (16 tokens each)."""
    llm = LLM(smollm2_artifact, num_blocks=256, threads=2)
    prompts: list[Any] = [*PROMPTS, {"messages": CHAT}]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0))
    del llm
    return {"chat" if isinstance(p, dict) else p: out for p, out in zip(prompts, outputs)}


@pytest.fixture
def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)


def _error(exc: openai.APIStatusError) -> dict[str, Any]:
    body = exc.response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def test_models_and_health(client: openai.OpenAI, server: ServerThread) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}


def test_completion_matches_offline_greedy(client: openai.OpenAI, reference: dict[str, RequestOutput]) -> None:
    prompt = PROMPTS[0]
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
    want = reference[prompt]
    assert response.choices[0].text == want.text
    assert response.choices[0].finish_reason == want.finish_reason
    usage = response.usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(want.prompt_token_ids), len(want.token_ids))
    # 10 prompt tokens, less than one 16-token block: nothing of it can come from the prefix cache.
    assert usage.prompt_tokens_details is not None and usage.prompt_tokens_details.cached_tokens == 0


def test_a_repeated_prompt_reports_its_cached_tokens(client: openai.OpenAI, smollm2_artifact: Path) -> None:
    """The second request is served from the first one's full blocks; the last prompt token is always computed."""
    block_size = Manifest.load(smollm2_artifact, verify=False).block_size
    prompt = " ".join(PROMPTS[1:5])
    first, again = (client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
                    for _ in range(2))
    n = first.usage.prompt_tokens
    assert n > 2 * block_size
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == (n - 1) // block_size * block_size


def test_chat_uses_the_chat_template(client: openai.OpenAI, reference: dict[str, RequestOutput]) -> None:
    response = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16, temperature=0)
    want = reference["chat"]
    assert response.choices[0].message.content == want.text
    assert response.choices[0].message.role == "assistant"
    assert response.usage.prompt_tokens == len(want.prompt_token_ids)


@pytest.mark.parametrize("stop", [None, ["."], ["e", "ou"]])
def test_streamed_text_equals_non_streamed_text(client: openai.OpenAI, stop: list[str] | None) -> None:
    args: dict[str, Any] = {"model": MODEL, "max_tokens": 24, "temperature": 0, "stop": stop}
    whole = client.completions.create(prompt=PROMPTS[1], **args)
    chunks = list(client.completions.create(prompt=PROMPTS[1], stream=True, stream_options={"include_usage": True},
                                            **args))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
        [whole.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens

    chat_whole = client.chat.completions.create(messages=CHAT, **args)
    chat_chunks = list(client.chat.completions.create(messages=CHAT, stream=True, **args))
    assert chat_chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chat_chunks)
    assert streamed == chat_whole.choices[0].message.content


def test_logprobs_report_the_sampled_token_and_the_top_k(client: openai.OpenAI) -> None:
    completion = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=6, temperature=0, logprobs=2)
    lp = completion.choices[0].logprobs
    assert lp is not None and len(lp.tokens) == len(lp.token_logprobs) == completion.usage.completion_tokens
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top[token] == value and value == max(top.values())  # greedy picks the most likely token
        assert 2 <= len(top) <= 3
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=0, logprobs=True,
                                          top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert "".join(t.token for t in content) == chat.choices[0].message.content
    assert all(len(t.top_logprobs) == 3 and t.top_logprobs[0].logprob == t.logprob for t in content)


def test_n_choices_with_a_seed_are_reproducible(client: openai.OpenAI) -> None:
    args: dict[str, Any] = {"model": MODEL, "prompt": PROMPTS[3], "max_tokens": 8, "temperature": 1.0, "seed": 7,
                            "n": 3, "extra_body": {"ignore_eos": True}}
    first, second = client.completions.create(**args), client.completions.create(**args)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    assert len({c.text for c in first.choices}) > 1
    assert first.usage.completion_tokens == 3 * 8


def test_concurrent_streaming_clients_share_the_engine(server: ServerThread,
                                                      reference: dict[str, RequestOutput]) -> None:
    async def one(client: openai.AsyncOpenAI, prompt: str) -> str:
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
                                                 stream=True)
        return "".join([chunk.choices[0].text async for chunk in stream])

    async def all_of_them() -> list[str]:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
        return await asyncio.gather(*(one(client, p) for p in PROMPTS))

    before = metrics(server)
    texts = asyncio.run(all_of_them())
    assert texts == [reference[p].text for p in PROMPTS]
    after = metrics(server)
    batched = re.findall(r'family="decode",gear="T(\d+)xB\d+xM\d+"\} (\d+)', str(after["raw"]))
    assert any(int(b) == 16 for b, _ in batched), "no decode step ran 16 requests together"
    assert after["pagedgraph_steps_total"] - before["pagedgraph_steps_total"] < 16 * MAX_CONCURRENT / 4
    assert after["pagedgraph_kv_blocks_used"] == 0


def test_cancelled_streams_free_their_blocks_and_overload_gets_429(client: openai.OpenAI,
                                                                   server: ServerThread) -> None:
    streams = [client.completions.create(model=MODEL, prompt=p, max_tokens=400, temperature=0, stream=True,
                                         extra_body={"ignore_eos": True}) for p in PROMPTS]
    try:
        for stream in streams[:4]:
            next(iter(stream))
        busy = wait_for(server, lambda m: m["pagedgraph_http_requests_in_flight"] == MAX_CONCURRENT)
        assert busy["pagedgraph_kv_blocks_used"] > 0
        with pytest.raises(openai.RateLimitError) as err:
            client.completions.create(model=MODEL, prompt="one too many", max_tokens=4)
        assert _error(err.value)["code"] == "rate_limit_exceeded"
    finally:
        for stream in streams:
            stream.close()
    start = time.monotonic()
    now = idle(server)
    assert time.monotonic() - start < 5, "aborts should free the blocks within a step or two"
    assert now["pagedgraph_kv_blocks_free"] == now["pagedgraph_kv_blocks_total"]
    assert 'reason="abort"' in str(now["raw"])
    still = client.completions.create(model=MODEL, prompt="still serving?", max_tokens=2, temperature=0)
    assert still.choices[0].finish_reason in ("stop", "length") and still.usage.completion_tokens >= 1


def test_a_client_that_gives_up_on_a_non_streamed_request_frees_its_blocks(server: ServerThread) -> None:
    body = {"prompt": PROMPTS[6], "max_tokens": 400, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=1.0)
    start = time.monotonic()
    wait_for(server, lambda m: m["pagedgraph_kv_blocks_used"] == 0 and m["pagedgraph_http_requests_in_flight"] == 0)
    assert time.monotonic() - start < 5


def test_api_key_is_required(server: ServerThread) -> None:
    wrong = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as err:
        wrong.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert _error(err.value)["code"] == "invalid_api_key"
    response = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi"})
    assert response.status_code == 401 and response.json()["error"]["type"] == "authentication_error"


@pytest.mark.parametrize("body, status, param, code", [
    ({"prompt": "hi", "temperature": -1}, 400, "temperature", None),
    ({"prompt": "hi", "top_p": 2}, 400, "top_p", None),
    ({"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens", None),
    ({"prompt": "hi", "frobnicate": 1}, 400, "frobnicate", None),
    ({"prompt": "hi", "presence_penalty": 2.5}, 400, "presence_penalty", None),
    ({"prompt": "hi", "logit_bias": {"49152": 1}}, 400, "logit_bias", None),
    ({"prompt": "hi", "logit_bias": {"x": 1}}, 400, "logit_bias", None),
    ({"prompt": "hi", "min_tokens": 20, "max_tokens": 4}, 400, "min_tokens", None),
    ({"prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty", None),
    ({"prompt": "hi", "min_p": 2}, 400, "min_p", None),
    ({"prompt": "hi", "stop_token_ids": [-1]}, 400, "stop_token_ids", None),
    ({"prompt": "hi", "echo": True, "logprobs": 1, "stream": True}, 400, "echo", None),
    ({"prompt": ["a", ""]}, 400, "prompt[1]", None),
    ({"prompt": 5}, 400, "prompt", None),
    ({"prompt": "hi", "stop": 5}, 400, "stop", None),
    ({"prompt": [], "max_tokens": 2}, 400, "prompt", None),
    ({"prompt": "hi", "model": "gpt-4"}, 404, "model", "model_not_found"),
    ({"prompt": "word " * 600}, 400, "prompt", "context_length_exceeded"),
])
def test_bad_completion_requests_get_openai_errors(server: ServerThread, body: dict, status: int, param: str,
                                                   code: str | None) -> None:
    response = httpx.post(f"{server.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"]) == (param, code)
    assert error["type"] == "invalid_request_error" and error["message"]


def test_bad_chat_requests_and_bodies(client: openai.OpenAI, server: ServerThread) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[], max_tokens=2)
    assert _error(err.value)["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=CHAT, top_logprobs=2)
    assert _error(err.value)["param"] == "top_logprobs"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=CHAT)
    response = httpx.post(f"{server.url}/v1/chat/completions", content=b"{not json",
                          headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert response.status_code == 400 and "not valid JSON" in response.json()["error"]["message"]
    assert httpx.get(f"{server.url}/v1/nothing-here", headers={"Authorization": f"Bearer {KEY}"}).status_code == 404


def test_a_failing_step_fails_its_requests_and_the_server_keeps_serving(client: openai.OpenAI,
                                                                         server: ServerThread) -> None:
    fail_the_next_step(server)
    with pytest.raises(openai.InternalServerError) as err:
        client.completions.create(model=MODEL, prompt=PROMPTS[4], max_tokens=4)
    assert _error(err.value)["message"] == "engine step failed: injected"
    assert client.completions.create(model=MODEL, prompt=PROMPTS[4], max_tokens=4).choices[0].finish_reason
    assert metrics(server)["pagedgraph_kv_blocks_used"] == 0


def test_requests_past_the_timeout_are_aborted(client: openai.OpenAI, server: ServerThread) -> None:
    frontend = server.app.state.frontend
    limits = frontend.limits
    frontend.limits = limits.model_copy(update={"request_timeout_s": 0.5})
    try:
        args: dict[str, Any] = {"model": MODEL, "prompt": PROMPTS[5], "max_tokens": 400, "temperature": 0,
                                "extra_body": {"ignore_eos": True}}
        with pytest.raises(openai.APIStatusError) as err:
            client.completions.create(**args)
        assert err.value.status_code == 408 and _error(err.value)["code"] == "request_timeout"
        with pytest.raises(openai.APIError, match="request_timeout_s"):
            for _ in client.completions.create(stream=True, **args):
                pass
    finally:
        frontend.limits = limits
    assert wait_for(server, lambda m: m["pagedgraph_kv_blocks_used"] == 0)


def test_pagedgraph_serve_starts_and_logs_what_it_loaded(smollm2_artifact: Path, tmp_path: Path) -> None:
    config = tmp_path / "deploy.yaml"
    config.write_text(f"model: {{artifact: {smollm2_artifact}}}\nkv_cache: {{num_blocks: 64}}\n"
                      "scheduler: {max_model_len: 256}\nbuckets: {decode_batch: [1, 4]}\nserver: {port: 0}\n")
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "pagedgraph.cli", "serve", "--config", str(config)],
                            stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            if "Application startup complete" in line:
                break
        log = "".join(lines)
        started = time.monotonic() - start
        url = re.search(r"listening on (http://127\.0\.0\.1:\d+)", log)
        assert url, log
        assert "decode B=[1, 4]" in log and "KV pool: 64 blocks x 16 tokens" in log
        assert httpx.get(f"{url.group(1)}/health").json() == {"status": "ok"}
        assert started < 60, f"took {started:.1f} s to start"
    finally:
        proc.terminate()
        proc.wait(30)
