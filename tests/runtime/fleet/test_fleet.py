"""A real fleet: `pagedgraph serve` with 2 replicas of SmolLM2 behind vllm-router, over real HTTP.

One fleet serves the module: the openai client through the router, the merged metrics, a replica
killed under load (scripts/loadtest.py's kill mode, in a reduced size) and its restart, then SIGTERM.
"""
from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path
from typing import Iterator

import httpx
import openai
import pytest

from scripts.loadtest import ServerProcess, healthy_workers, kill_under_load, replica_metrics

pytestmark = pytest.mark.e2e
MODEL = "smol"


@pytest.fixture(scope="module")
def fleet(smollm2_artifact: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    config = tmp_path_factory.mktemp("fleet") / "deploy.yaml"
    config.write_text(f"model: {{artifact: {smollm2_artifact}, name: {MODEL}}}\nkv_cache: {{num_blocks: 96}}\n"
                      "scheduler: {max_model_len: 512}\nserver: {port: 0, drain_timeout_s: 20}\n"
                      "fleet: {data_parallel_size: 2}\n")
    server = ServerProcess(str(config), 300)
    yield server
    server.stop(60)


def test_the_openai_client_runs_through_the_router_on_pinned_replicas(fleet: ServerProcess) -> None:
    client = openai.OpenAI(base_url=f"{fleet.url}/v1", api_key="none")
    assert [m.id for m in client.models.list().data] == [MODEL]
    text = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0)
    assert "Paris" in text.choices[0].text
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Name a colour."}],
                                          max_tokens=8, temperature=0)
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Name a colour."}], max_tokens=8, temperature=0,
        stream=True) if chunk.choices)
    assert chat.choices[0].message.content == streamed != ""
    # Disjoint cores, one each, and as many ONNX Runtime threads as cores (the replica's YAML).
    cores = [fleet.replica(i).cpu_affinity() for i in (0, 1)]
    assert all(len(c) == 1 for c in cores) and cores[0] != cores[1]
    by_replica = replica_metrics(httpx.Client(timeout=10), fleet.metrics_url)
    assert sorted(by_replica) == ["0", "1"]
    assert all(m["pagedgraph_fleet_replica_up"] == 1 for m in by_replica.values())
    assert sum(m.get("pagedgraph_requests_finished_total", 0) for m in by_replica.values()) >= 3


def test_a_replica_killed_under_load_fails_only_its_streams_and_rejoins(fleet: ServerProcess) -> None:
    args = argparse.Namespace(kill_replica=-1, specs=6, max_tokens=12, seed=3, requests=24, concurrency=24,
                              settle_timeout=60.0, startup_timeout=240.0)
    report = kill_under_load(fleet, args, {}, 49152)
    assert report["killed_in_flight"] > 0, report
    assert report["errors_elsewhere"] == 0 and report["mismatches"] == 0, report
    assert report["streams_cut_on_killed"] <= report["killed_in_flight"], report
    assert report["completed"] + report["streams_cut_on_killed"] == 24, report
    assert report["full_strength"], report  # back in the router's rotation, answering


def test_sigterm_drains_the_replicas(fleet: ServerProcess) -> None:
    """A request running when the fleet gets SIGTERM still finishes; the fleet exits 0 (both replicas did)."""
    with httpx.Client(base_url=fleet.url, timeout=60) as client:
        assert healthy_workers(client) == 2
        answer: dict[str, httpx.Response] = {}
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 48, "ignore_eos": True, "temperature": 0}
        sender = threading.Thread(target=lambda: answer.update(r=client.post("/v1/completions", json=body)))
        sender.start()
        deadline = time.monotonic() + 30
        while all(m["pagedgraph_http_requests_in_flight"] == 0 for m in replica_metrics(client, fleet.metrics_url)
                  .values()):
            assert time.monotonic() < deadline, "the request never reached a replica"
            time.sleep(0.05)
        assert fleet.stop(90) == 0
        sender.join()
    assert answer["r"].status_code == 200 and answer["r"].json()["usage"]["completion_tokens"] == 48
