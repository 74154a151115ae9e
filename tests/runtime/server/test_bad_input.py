"""Bad input gets a clear 4xx naming the field, and leaves the server healthy with every KV block free.

One real server (SmolLM2) serves the module. Property tests throw random bodies at the request validator
(any answer must be 200 or a well-formed 4xx, never a 5xx) and random operation sequences at the
scheduler and KV manager (pool invariants and K/V contents hold after every operation).
"""
from __future__ import annotations

import json
import logging
import re
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagedgraph.runtime.kv_cache_manager import KVCacheManager
from pagedgraph.runtime.scheduler import Scheduler
from pagedgraph.runtime.scheduler import Sequence
from tests.runtime.kv_sim import Shadow, check_invariants, make_seq
from tests.runtime.server.serving import MODEL, ServerThread, serve, wait_for

pytestmark = pytest.mark.e2e
MAX_MODEL_LEN = 256
MAX_BODY = 1 << 20
VOCAB = 49152
CHAT = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def server(smollm2_artifact: Path) -> Iterator[ServerThread]:
    with serve(smollm2_artifact,
               kv_cache={"num_blocks": 128},
               scheduler={"max_model_len": MAX_MODEL_LEN, "max_num_seqs": 4},
               sampling={"max_tokens": 2},
               server={"max_body_bytes": MAX_BODY}) as thread:
        yield thread


@pytest.fixture(scope="module")
def http(server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def _post(http: httpx.Client, path: str, body: Any) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return http.post(path, content=content, headers={"Content-Type": "application/json"})


def _error(response: httpx.Response) -> dict[str, Any]:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["message"], body
    return body["error"]


def assert_idle_and_healthy(server: ServerThread) -> None:
    """/health is ok, nothing is in flight and every KV block is free (after at most a few steps)."""
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    wait_for(server, lambda m: m["pagedgraph_kv_blocks_used"] == m["pagedgraph_http_requests_in_flight"] == 0)


BAD_COMPLETIONS = [
    # (body, status, param, code, words the message must contain)
    (b'{"prompt": "hi",', 400, None, None, "not valid JSON"),
    (b'{"prompt": "caf\xe9"}', 400, None, None, "UnicodeDecodeError"),
    (b'[1, 2]', 400, None, None, "valid dictionary"),
    (b'[' * 100_000 + b']' * 100_000, 400, None, None, "RecursionError"),
    (b'{"prompt": "hi", "max_tokens": 1' + b'0' * 5000 + b'}', 400, None, None, "integer string conversion"),
    ({"prompt": 5}, 400, "prompt", None, "prompt"),
    ({"prompt": "hi", "max_tokens": "8"}, 400, "max_tokens", None, "integer"),
    ({"prompt": "hi", "stream": "yes"}, 400, "stream", None, "boolean"),
    ({"prompt": "hi", "max_tokens": -1}, 400, "max_tokens", None, ">= 1"),
    ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens", None, ">= 1"),
    ({"prompt": "hi", "max_tokens": 10 ** 30}, 400, "max_tokens", "context_length_exceeded", "max_model_len"),
    ({"prompt": "hi", "max_tokens": MAX_MODEL_LEN}, 400, "max_tokens", "context_length_exceeded", "at most"),
    ({"prompt": "hi", "temperature": -0.1}, 400, "temperature", None, ">= 0"),
    (b'{"prompt": "hi", "temperature": Infinity}', 400, "temperature", None, "finite"),
    ({"prompt": "hi", "top_p": 0}, 400, "top_p", None, "(0, 1]"),
    ({"prompt": "hi", "top_p": 1.5}, 400, "top_p", None, "(0, 1]"),
    (b'{"prompt": "hi", "top_p": NaN}', 400, "top_p", None, "finite"),
    ({"prompt": "hi", "top_k": -2}, 400, "top_k", None, ">= -1"),
    ({"prompt": "hi", "n": 0}, 400, "n", None, ">= 1"),
    ({"prompt": "hi", "n": 10 ** 6}, 400, "n", None, "at most 4"),
    ({"prompt": "hi", "seed": -1}, 400, "seed", None, "greater than or equal to 0"),
    ({"prompt": "hi", "logprobs": 21}, 400, "logprobs", None, "[0, 20]"),
    ({"prompt": "hi", "stop": [""]}, 400, "stop", None, "non-empty"),
    ({"prompt": ""}, 400, "prompt", None, "empty"),
    ({"prompt": []}, 400, "prompt", None, "empty"),
    ({"prompt": [1, VOCAB]}, 400, "prompt_token_ids", None, f"[0, {VOCAB})"),
    ({"prompt": [-1, 5]}, 400, "prompt_token_ids", None, f"[0, {VOCAB})"),
    ({"prompt": "a\ud800b"}, 400, "prompt", None, "not valid Unicode"),
    ({"prompt": " word" * MAX_MODEL_LEN}, 400, "prompt", "context_length_exceeded", f"{MAX_MODEL_LEN} tokens"),
    ({"prompt": [7] * MAX_MODEL_LEN}, 400, "prompt", "context_length_exceeded", f"{MAX_MODEL_LEN} tokens"),
    ({"prompt": "x" * 500_000}, 400, "prompt", "context_length_exceeded", "characters"),
    ({"prompt": "hi", "model": "gpt-4"}, 404, "model", "model_not_found", "does not exist"),
    ({"prompt": "hi", "frobnicate": 1}, 400, "frobnicate", None, "unknown field"),
]


@pytest.mark.parametrize("body, status, param, code, words", BAD_COMPLETIONS,
                         ids=[f"{i}-{b if isinstance(b, bytes) else list(b)[-1]}"[:40]
                              for i, (b, *_) in enumerate(BAD_COMPLETIONS)])
def test_bad_completion_bodies_get_a_clear_4xx(http: httpx.Client, body: Any, status: int, param: str | None,
                                               code: str | None, words: str) -> None:
    response = _post(http, "/v1/completions", body)
    assert response.status_code == status, response.text
    error = _error(response)
    assert (error["param"], error["code"]) == (param, code)
    assert words in error["message"], error["message"]


@pytest.mark.parametrize("body, param, words", [
    ({"messages": []}, "messages", "at least 1"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role", "'system'"),
    ({"messages": [{"role": "user", "content": 3}]}, "messages.0.content", "string"),
    ({"messages": [{"role": "user", "content": "a\udc00"}]}, "messages", "not valid Unicode"),
    ({"messages": CHAT, "logprobs": True, "top_logprobs": -1}, "top_logprobs", "greater than or equal to 0"),
    ({"messages": CHAT, "max_completion_tokens": 10 ** 9}, "max_tokens", "max_model_len"),
])
def test_bad_chat_bodies_get_a_clear_400(http: httpx.Client, body: dict[str, Any], param: str, words: str) -> None:
    response = _post(http, "/v1/chat/completions", body)
    assert response.status_code == 400, response.text
    error = _error(response)
    assert error["param"] == param and words in error["message"], error


def test_bodies_over_the_cap_get_413_before_parsing(http: httpx.Client) -> None:
    start = time.monotonic()
    big = _post(http, "/v1/completions", {"prompt": "word " * 2_000_000})  # 10 MB, Content-Length declared
    assert big.status_code == 413 and _error(big)["code"] == "request_too_large"
    assert "server.max_body_bytes = 1048576" in _error(big)["message"]

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted while it arrives
        yield b'{"prompt": "'
        for _ in range(40):
            yield b"x" * 65536
        yield b'"}'

    chunked = http.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
    assert chunked.status_code == 413 and "over 1048576 bytes" in _error(chunked)["message"]
    assert time.monotonic() - start < 10


def test_the_server_is_healthy_after_bad_input_and_still_answers(server: ServerThread, http: httpx.Client) -> None:
    assert_idle_and_healthy(server)
    response = _post(http, "/v1/completions", {"prompt": "The capital of France is", "temperature": 0})
    assert response.status_code == 200 and response.json()["choices"][0]["finish_reason"] == "length"


def test_request_logs_show_prompt_text_only_when_asked(server: ServerThread, http: httpx.Client,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    """A refusal's message may quote the request back to its client, but the log keeps to status and field."""
    secret = "zebra-crossing-4711"
    frontend = server.app.state.frontend
    with caplog.at_level(logging.INFO, logger="pagedgraph.server"):
        refused = _post(http, "/v1/completions", {"prompt": [1, secret]})
        assert refused.status_code == 400 and secret in _error(refused)["message"]
        assert _post(http, "/v1/completions", {"prompt": f"Say {secret}"}).status_code == 200
        quiet = caplog.text
        frontend.limits = frontend.limits.model_copy(update={"log_prompts": True})
        try:
            assert _post(http, "/v1/completions", {"prompt": f"Say {secret}"}).status_code == 200
        finally:
            frontend.limits = frontend.limits.model_copy(update={"log_prompts": False})
    assert "refused: 400 invalid_request_error (param prompt)" in quiet
    assert re.search(r"req-\d+ /v1/completions: \d+ prompt \+ 2 completion tokens, length", quiet)
    assert secret not in quiet
    assert f"prompt 'Say {secret}'" in caplog.text[len(quiet):]


# -- property: random bodies at the validator ------------------------------------------------------
_SCALARS = st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.floats() | st.text(max_size=8)
_JSON = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                         max_size=3), max_leaves=6)
_VALUES = {
    "prompt": st.text(max_size=40) | st.lists(st.integers(-5, VOCAB + 5), max_size=6) | _JSON,
    "max_tokens": st.integers(-3, 4) | st.sampled_from([MAX_MODEL_LEN, 10 ** 20]) | _JSON,
    "temperature": st.floats(-1, 3) | _JSON,
    "top_p": st.floats(-0.5, 1.5) | _JSON,
    "top_k": st.integers(-3, VOCAB + 3),
    "n": st.integers(-1, 6),
    "seed": st.integers(-5, 2 ** 65),
    "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=3),
    "logprobs": st.integers(-2, 25),
    "stream": st.booleans() | _JSON,
    "model": st.sampled_from([MODEL, "other"]),
    "echo": st.booleans(),
    "presence_penalty": st.floats(-1, 1),
}


def _body() -> st.SearchStrategy[Any]:
    fields = st.fixed_dictionaries({}, optional={**_VALUES, "junk": _JSON})
    return st.one_of(fields.map(lambda d: {"prompt": "Hi", **d}), fields, _JSON)


def _must_refuse(body: Any) -> str | None:
    """The rule a body breaks that the server must refuse it for (a partial oracle), or None."""
    if not isinstance(body, dict):
        return "not an object"
    # max_tokens null is OpenAI's "the default" (protocol.py: `int | None`), not a bad value
    checks = [("max_tokens", lambda v: v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1)),
              ("temperature", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and not v >= 0),
              ("top_p", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and not 0 < v <= 1),
              ("n", lambda v: v < 1 or v > 4), ("seed", lambda v: v < 0), ("model", lambda v: v != MODEL),
              ("junk", lambda v: True), ("prompt", lambda v: v in ("", []))]
    return next((name for name, broken in checks if name in body and broken(body[name])), None)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(body=_body())
@example(body={"prompt": "Hi", "max_tokens": None})
def test_random_bodies_get_200_or_a_well_formed_4xx(http: httpx.Client, body: Any) -> None:
    if isinstance(body, dict) and body.get("stream") is True:
        body = {**body, "stream": False}  # one JSON answer per body keeps the check simple
    try:
        content = json.dumps(body, allow_nan=True).encode()
    except (UnicodeEncodeError, ValueError):
        return
    response = _post(http, "/v1/completions", content)
    assert response.status_code in (200, 400, 404), (body, response.text)
    if response.status_code == 200:
        broken = _must_refuse(body)
        assert broken is None, f"accepted a body with a bad {broken}: {body}"
        assert response.json()["choices"]
    else:
        error = _error(response)
        assert error["type"] == "invalid_request_error"


def test_the_server_is_healthy_after_the_random_bodies(server: ServerThread) -> None:
    assert_idle_and_healthy(server)


# -- property: random operations at the scheduler and the KV manager -------------------------------
BS = 4
MAX_SEQ_TOKENS = 24  # 6 of the 11 usable blocks: one sequence alone always fits, as the engine ensures


class SchedulerMachine(RuleBasedStateMachine):
    """The engine's use of the scheduler (add, step, abort, fail a step, fork) against a content shadow."""

    def __init__(self) -> None:
        super().__init__()
        self.num_blocks = 12  # small: admissions evict cached blocks and decodes preempt
        self.kv = KVCacheManager(self.num_blocks, BS, enable_prefix_caching=True, salt=b"prop")
        self.sched = Scheduler(self.kv, max_num_seqs=4, max_num_batched_tokens=16)
        self.shadow = Shadow(self.num_blocks, BS)
        self.live: list[Sequence] = []
        self.count = 0

    @rule(prefix=st.sampled_from([[1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9, 9, 1], []]),
          tail=st.lists(st.integers(0, 30), min_size=1, max_size=10))
    def add(self, prefix: list[int], tail: list[int]) -> None:
        """Requests fit the pool whole (as the engine checks at admission), so preemption always resolves."""
        seq = make_seq(prefix + tail, f"r{self.count}", arrival=self.count)
        self.count += 1
        self.sched.add(seq)
        self.live.append(seq)

    @precondition(lambda self: self.sched.has_work())
    @rule(fail=st.sampled_from([False, False, False, True]), stop=st.integers(0, 6))
    def step(self, fail: bool, stop: int) -> None:
        """One step; a failed one ends all its sequences with keep_cached=False, as LLMEngine.step does."""
        batch = self.sched.schedule()
        assert batch is not None, "work left but nothing schedulable"
        assert batch.total_tokens <= 16 and len(batch.seqs) <= 4
        if fail:
            for seq in batch.seqs:
                self._end(seq, keep_cached=False)
            return
        self.shadow.copy(batch.copies)
        for seq, n in zip(batch.seqs, batch.num_tokens):
            self.shadow.write(seq, seq.num_computed_tokens, n)
            seq.num_computed_tokens += n
            self.shadow.check(seq)
            if seq.num_computed_tokens == seq.num_tokens:
                seq.token_ids.append(len(seq.token_ids) % 31)
                if len(seq.output_token_ids) > stop or seq.num_tokens >= MAX_SEQ_TOKENS:
                    self._end(seq, keep_cached=True)

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 100))
    def abort(self, index: int) -> None:
        self._end(self.live[index % len(self.live)], keep_cached=True)

    @precondition(lambda self: any(s.output_token_ids and s.num_uncomputed == 1 for s in self.sched.running))
    @rule(index=st.integers(0, 100))
    def fork(self, index: int) -> None:
        parents = [s for s in self.sched.running if s.output_token_ids and s.num_uncomputed == 1]
        parent = parents[index % len(parents)]
        child = make_seq(parent.token_ids, f"{parent.request_id}/f{self.count}", arrival=parent.arrival)
        self.count += 1
        self.sched.fork(parent, child)
        self.live.append(child)

    def _end(self, seq: Sequence, keep_cached: bool) -> None:
        self.sched.finish(seq, keep_cached)
        self.live.remove(seq)

    @invariant()
    def pool_is_consistent(self) -> None:
        check_invariants(self.kv, self.sched.running)
        assert all(not s.block_table for s in self.sched.waiting), "a waiting sequence holds blocks"
        assert set(self.sched.running) | set(self.sched.waiting) == set(self.live)

    def teardown(self) -> None:
        for seq in list(self.live):
            self._end(seq, keep_cached=True)
        assert self.kv.num_free_blocks == self.num_blocks - 1, "blocks leaked"


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
