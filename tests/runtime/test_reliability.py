"""Faults and shutdown on the real model: a failing graph run, SIGTERM drains, secrets stay out of logs.

- A graph run that fails inside ONNX Runtime (an out-of-range token id fed to the embedding Gather)
  fails exactly the requests of that step, frees their blocks, and the engine keeps serving: the
  others still produce their solo outputs.
- `pagedgraph serve` on SIGTERM: running requests finish, new ones get 503, a request still running at
  `server.drain_timeout_s` ends with a 503 error event, and the process exits 0; its log never shows
  the API key or the prompt text.
"""
from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import numpy as np
import pytest
from starlette.requests import Request

from pagedgraph.artifact.settings import ConfigError
from pagedgraph.graphs.contract import INPUT_IDS
from pagedgraph.runtime.deploy_config import engine_config, load_deployment
from pagedgraph.runtime.engine import EngineConfig, LLMEngine, RequestOutput
from pagedgraph.runtime.sampling_params import SamplingParams
from pagedgraph.runtime.server import app as server_app
from tests.runtime.kv_sim import check_invariants
from tests.runtime.test_deploy_config import _manifest

pytestmark = pytest.mark.e2e
PROMPTS = ["The capital of France is", "List three fruits:", "Once upon a time", "2 + 2 ="]
# Long enough for 24 tokens on a loaded 2-core machine; far too short for the 1,200-token request on any CPU.
DRAIN_S = 10
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


class FailingExecutor:
    """The real executor; `fail_at` runs later, one run fails inside the graph (and writes nothing)."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.fail_at: int | None = None
        self.runs = 0

    def run(self, gear: Any, inputs: dict[str, np.ndarray]) -> np.ndarray:
        self.runs += 1
        if self.runs - 1 != self.fail_at:
            return self.real.run(gear, inputs)
        ids = inputs[INPUT_IDS]
        saved = int(ids[0])
        ids[0] = 1 << 40  # the embedding Gather refuses it before any layer writes the pools
        try:
            return self.real.run(gear, inputs)
        finally:
            ids[0] = saved

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


@pytest.fixture(scope="module")
def engine(smollm2_artifact: Path) -> LLMEngine:
    """Two sequences a step, so two of four requests wait while the others run."""
    engine = LLMEngine(smollm2_artifact, EngineConfig(num_blocks=64, max_num_seqs=2, max_model_len=256, threads=2))
    engine.runner.executor = FailingExecutor(engine.runner.executor)
    return engine


def _drain(engine: LLMEngine) -> dict[str, RequestOutput]:
    done = {}
    while engine.has_unfinished():
        done.update({out.request_id: out for out in engine.step() if out.finished})
    return done


@pytest.fixture(scope="module")
def solo(engine: LLMEngine) -> dict[str, str]:
    texts = {}
    for prompt in PROMPTS:
        engine.add_request(engine.prompts.encode(prompt), GREEDY, "solo")
        texts[prompt] = _drain(engine)["solo"].text
    return texts


@pytest.mark.parametrize("fail_at", [0, 3])  # the first prefill; a later decode step
def test_a_failed_graph_run_fails_only_its_step_and_frees_its_blocks(engine: LLMEngine, solo: dict[str, str],
                                                                     fail_at: int) -> None:
    executor = engine.runner.executor
    assert isinstance(executor, FailingExecutor)
    free_before = engine.kv.usage().free  # cached-but-evictable blocks count as free
    scheduled: list[set[str]] = []
    real_schedule = engine.scheduler.schedule

    def recording() -> Any:
        batch = real_schedule()
        scheduled.append({s.request_id for s in batch.seqs} if batch else set())
        return batch

    engine.scheduler.schedule = recording  # type: ignore[method-assign]
    executor.fail_at, executor.runs = fail_at, 0
    try:
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(engine.prompts.encode(prompt), GREEDY, f"r{i}")
        outputs = _drain(engine)
    finally:
        del engine.scheduler.schedule
        executor.fail_at = None
    failed = {rid for rid, out in outputs.items() if out.error}
    assert failed == scheduled[fail_at] and len(failed) == 2
    for rid in failed:
        assert outputs[rid].finish_reason == "error"
        assert outputs[rid].error.startswith("graph execution failed: ")
        assert "Gather" in outputs[rid].error or "indices" in outputs[rid].error, outputs[rid].error
    for i, prompt in enumerate(PROMPTS):
        if f"r{i}" not in failed:
            assert outputs[f"r{i}"].text == solo[prompt], "a request outside the failed step changed"
    assert engine.kv.usage().free == free_before, "the failed requests kept blocks"
    check_invariants(engine.kv, [])
    engine.add_request(engine.prompts.encode(PROMPTS[0]), GREEDY, "after")
    assert _drain(engine)["after"].text == solo[PROMPTS[0]], "the engine no longer serves correctly"


def test_the_api_key_is_compared_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    compared: list[tuple[bytes, bytes]] = []
    real = server_app.hmac.compare_digest
    monkeypatch.setattr(server_app.hmac, "compare_digest", lambda a, b: compared.append((a, b)) or real(a, b))
    check = server_app._bearer("sk-right")
    for header, ok in ((b"Bearer sk-right", True), (b"Bearer sk-wrong", False), (b"", False)):
        request = Request({"type": "http", "headers": [(b"authorization", header)] if header else []})
        try:
            asyncio.run(check(request))
            accepted = True
        except server_app.APIError as exc:
            accepted = False
            assert exc.status == 401
        assert accepted is ok
    assert compared == [(b"Bearer sk-right", b"Bearer sk-right"), (b"Bearer sk-wrong", b"Bearer sk-right"),
                        (b"", b"Bearer sk-right")]


def test_the_deployment_yaml_sets_the_executor_salt_and_limits(tmp_path: Path) -> None:
    path = tmp_path / "deploy.yaml"
    path.write_text("model: {artifact: a}\n")
    server = load_deployment(path).server
    assert (server.host, server.max_body_bytes, server.log_prompts, server.drain_timeout_s) == \
        ("127.0.0.1", 1 << 20, False, 30.0)
    path.write_text("model: {artifact: a}\nkv_cache: {prefix_cache_salt: tenant-a}\nexecutor: {name: mindspore}\n")
    config = engine_config(load_deployment(path), _manifest(), str(path))
    assert (config.executor, config.prefix_cache_salt) == ("mindspore", "tenant-a")
    for text, expected in (("executor: {name: tensorrt}", "executor.name = 'tensorrt': Input should be"),
                           ("server: {max_body_bytes: 10}", "server.max_body_bytes = 10: Input should be greater"),
                           ("server: {drain_timeout_s: -1}", "server.drain_timeout_s = -1")):
        path.write_text(f"model: {{artifact: a}}\n{text}\n")
        with pytest.raises(ConfigError, match=re.escape(expected)):
            load_deployment(path)


# -- SIGTERM ----------------------------------------------------------------------------------------
KEY = "sk-do-not-log-4711"
SECRET = "purple-elephant-prompt-0042"


class Serve:
    """`pagedgraph serve` as a subprocess; its combined output is collected line by line."""

    def __init__(self, config: Path) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "pagedgraph.cli", "serve", "--config", str(config)],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self.started = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        assert self.started.wait(120), "".join(self.lines)
        found = re.search(r"listening on (http://\S+) ", self.log)
        assert found, self.log
        self.url = found.group(1)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            if "Application startup complete" in line:
                self.started.set()
        self.started.set()

    @property
    def log(self) -> str:
        return "".join(self.lines)


def _stream(url: str, body: dict[str, Any], events: list[dict[str, Any] | str], first: threading.Event) -> None:
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=120,
                      headers={"Authorization": f"Bearer {KEY}"}) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
                first.set()
    first.set()


@pytest.fixture
def served(smollm2_artifact: Path, tmp_path: Path) -> Iterator[Serve]:
    config = tmp_path / "deploy.yaml"
    config.write_text(f"model: {{artifact: {smollm2_artifact}, name: smol}}\nkv_cache: {{num_blocks: 256}}\n"
                      "buckets: {decode_batch: [1, 4]}\nexecutor: {threads: 2}\n"
                      f"server: {{port: 0, api_key: {KEY}, drain_timeout_s: {DRAIN_S}}}\n")
    serve = Serve(config)
    yield serve
    if serve.proc.poll() is None:
        serve.proc.kill()
        serve.proc.wait()


def test_sigterm_drains_then_exits_zero_and_the_log_keeps_secrets(served: Serve) -> None:
    url, auth = served.url, {"Authorization": f"Bearer {KEY}"}
    assert url.startswith("http://127.0.0.1:"), "the default host must be loopback only"
    short: list[Any] = []
    long: list[Any] = []
    started = [threading.Event(), threading.Event()]
    clients = [threading.Thread(target=_stream, args=(url, {"prompt": f"Say {SECRET}.", "max_tokens": 24,
                                                           "ignore_eos": True}, short, started[0])),
               threading.Thread(target=_stream, args=(url, {"prompt": "Count to a thousand.", "max_tokens": 1200,
                                                           "ignore_eos": True}, long, started[1]))]
    for client in clients:
        client.start()
    assert all(event.wait(60) for event in started)
    served.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 5
    while httpx.get(f"{url}/health").status_code == 200:
        assert time.monotonic() < deadline, "SIGTERM did not start a drain"
        time.sleep(0.05)
    assert httpx.get(f"{url}/health").json() == {"status": "draining"}
    refused = httpx.post(f"{url}/v1/completions", json={"prompt": "late", "max_tokens": 2}, headers=auth)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "server_shutting_down"
    assert served.proc.wait(60) == 0, served.log
    for client in clients:
        client.join(10)

    assert short[-1] == "[DONE]" and short[-2]["choices"][0]["finish_reason"] == "length", short[-3:]
    assert "".join(e["choices"][0]["text"] for e in short if isinstance(e, dict) and e["choices"])
    assert long[-1] == "[DONE]" and long[-2]["error"]["code"] == "server_shutting_down", long[-3:]
    assert f"drain_timeout_s = {DRAIN_S}" in long[-2]["error"]["message"]

    log = served.log
    assert "draining" in log and re.search(r"req-\d+ /v1/completions: \d+ prompt \+ 24 completion tokens, length", log)
    assert KEY not in log and SECRET not in log, "the log shows the API key or prompt text"
