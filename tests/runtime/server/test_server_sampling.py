"""The sampling fields, echo, the tokenizer endpoints, /metrics and what-ran reports, through the real
server on the real model with the official `openai` client; greedy answers are checked against the offline
`LLM` on the same artifact (whose sampler tests/runtime/test_sampling.py checks against numpy references)."""
from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagedgraph.runtime.engine import LLM
from pagedgraph.runtime.sampling_params import SamplingParams
from tests.runtime.server.serving import MODEL, ServerThread, serve

pytestmark = pytest.mark.e2e
KEY = "sampling-key"
PROMPT = "one two three one two three one two three one two"
PENALTIES = {"presence_penalty": 1.5, "frequency_penalty": 0.8, "logit_bias": {"1167": 8}}
VLLM_EXTRAS = {"repetition_penalty": 1.3, "min_p": 0.1, "min_tokens": 3}


@pytest.fixture(scope="module")
def server(smollm2_artifact: Path) -> Iterator[ServerThread]:
    with serve(smollm2_artifact,
               kv_cache={"num_blocks": 256},
               scheduler={"max_model_len": 512},
               sampling={"max_tokens": 16},
               server={"api_key": KEY}) as thread:
        yield thread


@pytest.fixture(scope="module")
def llm(smollm2_artifact: Path) -> LLM:
    return LLM(smollm2_artifact, num_blocks=256, threads=2)


@pytest.fixture
def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)


def _post(server: ServerThread, path: str, body: dict[str, Any], key: str = KEY) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60)


def _params(**fields: Any) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 16, "temperature": 0, **fields})


def test_penalties_and_vllm_extras_equal_the_offline_api(client: openai.OpenAI, llm: LLM) -> None:
    completion = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0,
                                           extra_body=VLLM_EXTRAS, **PENALTIES)  # type: ignore[arg-type]
    offline = llm.generate(PROMPT, _params(**PENALTIES, **VLLM_EXTRAS))[0]
    plain = llm.generate(PROMPT, _params())[0]
    assert completion.choices[0].text == offline.text != plain.text
    messages = [{"role": "user", "content": "Count: one two one two one two"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16,  # type: ignore[arg-type]
                                          temperature=0, extra_body=VLLM_EXTRAS, **PENALTIES)  # type: ignore[arg-type]
    assert chat.choices[0].message.content == llm.generate({"messages": messages},
                                                           _params(**PENALTIES, **VLLM_EXTRAS))[0].text


def test_a_concurrent_batch_mixes_penalized_and_plain_requests(client: openai.OpenAI, llm: LLM) -> None:
    prompts = [f"{PROMPT} {i}" for i in range(8)]

    def ask(i: int) -> str:
        extra = PENALTIES if i % 2 else {}
        answer = client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=12, temperature=0, **extra)
        return answer.choices[0].text

    with ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(ask, range(8)))
    solo = [llm.generate(p, _params(max_tokens=12, **(PENALTIES if i % 2 else {})))[0].text
            for i, p in enumerate(prompts)]
    assert texts == solo


def test_min_tokens_holds_back_eos_and_ignore_eos_does_not_end_at_it(client: openai.OpenAI, llm: LLM) -> None:
    eos = llm.engine.tokenizer.eos_token_ids[0]
    bias = {str(eos): 100}  # EOS is the top token at every step
    held = client.completions.create(model=MODEL, prompt="Hello", max_tokens=10, temperature=0, logit_bias=bias,
                                     extra_body={"min_tokens": 5})
    assert (held.usage.completion_tokens, held.choices[0].finish_reason) == (6, "stop")  # 5, then EOS
    offline = llm.generate("Hello", _params(max_tokens=10, logit_bias={eos: 100}, min_tokens=5))[0]
    assert eos not in offline.token_ids[:5] and held.choices[0].text == offline.text
    at_once = client.completions.create(model=MODEL, prompt="Hello", max_tokens=10, temperature=0, logit_bias=bias)
    assert at_once.usage.completion_tokens == 1
    ignored = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0, logit_bias=bias,
                                        extra_body={"ignore_eos": True})
    assert (ignored.usage.completion_tokens, ignored.choices[0].finish_reason, ignored.choices[0].text) == \
        (4, "length", "")


def test_echo_puts_the_prompt_first_streamed_or_not(client: openai.OpenAI) -> None:
    prompt = "The capital of France is"
    args: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0}
    plain = client.completions.create(**args).choices[0].text
    echoed = client.completions.create(echo=True, **args).choices[0].text
    assert echoed == prompt + plain
    streamed = "".join(c.choices[0].text for c in client.completions.create(echo=True, stream=True, **args))
    assert streamed == echoed
    scored = client.completions.create(echo=True, logprobs=2, **args)
    logprobs = scored.choices[0].logprobs
    n_prompt = scored.usage.prompt_tokens
    assert len(logprobs.tokens) == n_prompt + scored.usage.completion_tokens
    assert "".join(logprobs.tokens[:n_prompt]) == prompt
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert all(lp < 0 and math.isfinite(lp) for lp in logprobs.token_logprobs[1:])
    assert all(len(top) >= 2 for top in logprobs.top_logprobs[1:])


def test_tokenize_and_detokenize_in_vllms_shape(server: ServerThread, client: openai.OpenAI, llm: LLM) -> None:
    tokenizer = llm.engine.tokenizer
    text = "Hello, world! Paged attention."
    answer = _post(server, "/tokenize", {"model": MODEL, "prompt": text}).json()
    assert answer == {"count": len(answer["tokens"]), "max_model_len": 512, "tokens": tokenizer.encode(text)}
    bare = _post(server, "/tokenize", {"prompt": text, "add_special_tokens": False, "return_token_strs": True}).json()
    assert bare["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    assert len(bare["token_strs"]) == bare["count"]
    messages = [{"role": "user", "content": "Name three colours."}]
    chat = _post(server, "/tokenize", {"messages": messages}).json()
    used = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)  # type: ignore[arg-type]
    assert chat["count"] == used.usage.prompt_tokens
    assert _post(server, "/detokenize", {"tokens": answer["tokens"]}).json() == {"prompt": tokenizer.decode(
        answer["tokens"])}
    assert tokenizer.decode(bare["tokens"]) == text

    vocab = llm.engine.model.vocab_size
    for path, body, param in [("/detokenize", {"tokens": [1, vocab]}, "tokens"), ("/tokenize", {}, None),
                              ("/tokenize", {"prompt": "a", "messages": messages}, None),
                              ("/tokenize", {"prompt": "a", "frobnicate": 1}, "frobnicate"),
                              ("/tokenize", {"prompt": "a", "model": "gpt-4"}, "model")]:
        response = _post(server, path, body)
        assert response.status_code in (400, 404), (path, body, response.text)
        assert response.json()["error"]["param"] == param
    assert _post(server, "/tokenize", {"prompt": "a"}, key="wrong").status_code == 401


def test_models_and_version_say_what_runs(server: ServerThread, client: openai.OpenAI, llm: LLM) -> None:
    info = llm.runtime_info
    assert info.executor == "onnxruntime" and info.dtype == "float32" and info.kv_cache_dtype == "float32"
    assert info.custom_ops == llm.engine.runner.executor.custom_ops and info.quantization is None
    assert info.weight_formats == llm.engine.manifest.weight_formats
    card = client.models.list().data[0]
    assert card.model_extra is not None and card.model_extra["runtime"] == info.to_dict()
    version = httpx.get(f"{server.url}/version").json()
    assert version["version"] and {k: version[k] for k in info.to_dict()} == info.to_dict()


def _scrape(server: ServerThread) -> dict[str, float]:
    """Sample name with its labels -> value, parsed by prometheus_client's own parser."""
    samples = {}
    for family in text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k not in ("model_name", "engine"))
            samples[f"{s.name}{{{labels}}}"] = s.value
    return samples


def test_metrics_have_vllms_names_and_count_each_request(server: ServerThread, client: openai.OpenAI) -> None:
    before = _scrape(server)
    answer = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=7, temperature=0, presence_penalty=0.5,
                                       extra_body={"ignore_eos": True})
    after = _scrape(server)
    tokens = answer.usage.completion_tokens
    assert tokens == 7

    def grew(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_prompt_tokens", "request_generation_tokens"):
        assert grew(f"vllm:{name}_count{{}}") == 1, name
    assert grew("vllm:inter_token_latency_seconds_count{}") == tokens - 1
    assert grew("vllm:time_per_output_token_seconds_count{}") == tokens - 1
    assert grew("vllm:request_generation_tokens_sum{}") == tokens
    assert grew("vllm:request_prompt_tokens_sum{}") == answer.usage.prompt_tokens
    assert grew("vllm:generation_tokens_total{}") == tokens
    assert grew("vllm:prompt_tokens_total{}") == answer.usage.prompt_tokens
    assert grew("vllm:request_success_total{finished_reason=length}") == 1
    assert 0 < grew("vllm:e2e_request_latency_seconds_sum{}") < 60
    assert grew("pagedgraph_logits_processor_seconds_total{processor=penalties}") > 0
    assert 0 <= after["vllm:kv_cache_usage_perc{}"] <= 1
    assert after["vllm:num_requests_running{}"] == 0 and after["vllm:num_requests_waiting{}"] == 0
    for kept in ("pagedgraph_kv_blocks_total{}", "pagedgraph_requests_running{}", "pagedgraph_steps_total{}",
                 "pagedgraph_http_requests_in_flight{}"):
        assert kept in after
