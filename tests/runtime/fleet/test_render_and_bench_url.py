"""What a fleet's router needs from one server (render endpoints, the fields it adds), and `bench --url`."""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import httpx
import pytest

from pagedgraph.runtime.bench.http import UrlOptions, alternating_ttft, run_url_bench, url_table
from pagedgraph.runtime.workloads import shared_prefix_workload
from tests.runtime.server.serving import MODEL, ServerThread, serve

pytestmark = pytest.mark.e2e
# What vllm-router 0.1.17 writes into every chat body it forwards (SGLang's extras, at their neutral values).
ROUTER_FIELDS = {"no_stop_trim": False, "skip_special_tokens": True, "return_hidden_states": False,
                 "continue_final_message": False, "separate_reasoning": True, "stream_reasoning": True,
                 "include_reasoning": True}


@pytest.fixture(scope="module")
def server(smollm2_artifact: Path) -> Iterator[ServerThread]:
    with serve(smollm2_artifact, kv_cache={"num_blocks": 96}, scheduler={"max_model_len": 512}) as thread:
        yield thread


def test_render_returns_the_token_ids_generation_would_use(server: ServerThread) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    with httpx.Client(base_url=server.url, timeout=60) as client:
        rendered = client.post("/v1/chat/completions/render", json={"model": MODEL, "messages": messages}).json()
        tokens = client.post("/tokenize", json={"model": MODEL, "messages": messages}).json()["tokens"]
        assert rendered["token_ids"] == tokens and rendered["request_id"]
        plain = client.post("/v1/completions/render", json={"model": MODEL, "prompt": [5, 6, 7]}).json()
        assert plain["token_ids"] == [5, 6, 7]
        body = {"model": MODEL, "messages": messages, "max_tokens": 2, "temperature": 0}
        alone = client.post("/v1/chat/completions", json=body).json()
        assert alone["usage"]["prompt_tokens"] == len(tokens)
        # A router renders, then sends the same body: the kept ids serve it, with the same answer.
        kept = server.app.state.frontend._rendered
        kept.clear()
        assert client.post("/v1/chat/completions/render", json=body).json()["token_ids"] == tokens
        assert len(kept) == 1
        after = client.post("/v1/chat/completions", json=body).json()
        assert not kept  # taken by the generation
        assert after["choices"][0]["message"] == alone["choices"][0]["message"]
        assert after["usage"]["prompt_tokens"] == len(tokens)
        refused = client.post("/v1/chat/completions/render", json={"model": "other", "messages": messages})
        assert refused.status_code == 404


def test_the_fields_a_router_adds_are_accepted_at_their_neutral_values_only(server: ServerThread) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}
    with httpx.Client(base_url=server.url, timeout=60) as client:
        assert client.post("/v1/chat/completions", json={**body, **ROUTER_FIELDS}).status_code == 200
        completion = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "no_stop_trim": False,
                      "skip_special_tokens": True, "return_hidden_states": False}
        assert client.post("/v1/completions", json=completion).status_code == 200
        refused = client.post("/v1/chat/completions", json={**body, "return_hidden_states": True})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "return_hidden_states"


def test_bench_over_http_counts_cached_tokens_and_loses_nothing(server: ServerThread) -> None:
    results = run_url_bench(UrlOptions(server.url, requests=6, prefixes=2, prefix_words=120, max_tokens=3, seed=1))
    assert (results["completed"], results["lost"]) == (6, 0)
    assert 0 < results["cached_tokens"] < results["prompt_tokens"] and 0 < results["prefix_hit_rate"] < 1
    assert results["ttft_p99_s"] >= results["ttft_p50_s"] > 0 and "prefix hit rate" in url_table(results)


def test_alternating_ttft_times_each_chat_once_per_url_in_turn(server: ServerThread) -> None:
    results = alternating_ttft({"a": server.url, "b": server.url}, 3, prefix_words=120, max_tokens=3, seed=4)
    assert {name: len(values) for name, values in results["ttft_s"].items()} == {"a": 3, "b": 3}
    assert all(v > 0 for values in results["ttft_s"].values() for v in values)
    assert min(results["cached_tokens"]["a"] + results["cached_tokens"]["b"]) > 0  # each hit the system prompt
    assert results["ttft_p50_s"]["a"] > 0 and results["load_avg_1m"]["max"] >= results["load_avg_1m"]["min"]


def test_shared_prefix_draws_among_its_prefixes_and_one_prefix_is_unchanged() -> None:
    many = shared_prefix_workload(32, prefix_words=40, prefixes=4, seed=2)
    systems = [item["messages"][0]["content"] for item in many]
    assert len(set(systems)) == 4
    assert any(systems[i] != systems[i % 4] for i in range(32))  # drawn at random: no router gets them in turn
    one = shared_prefix_workload(8, prefix_words=40, seed=2)
    assert len({item["messages"][0]["content"] for item in one}) == 1
