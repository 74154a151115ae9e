"""/v1/embeddings (and vLLM's /v1/score and /v1/rerank) through the real HTTP server, on tiny random Qwen3 artifacts.

An embedding artifact's server answers OpenAI's request and response shapes (one text, a list, token ids, float or
base64, `dimensions` where the export allows it), equal to `LLM.embed` on the same artifact; 32 concurrent requests
of mixed lengths end with no error and every block free; the OpenAI client works as it does against vLLM; each
task's server refuses the other task's endpoints with a 400 naming the model.
"""
from __future__ import annotations

import base64
import io
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

import httpx
import numpy as np
import openai
import pytest

from pagedgraph.exporter.config import ExportConfig
from pagedgraph.exporter.export import export
from pagedgraph.runtime.engine import LLM
from pagedgraph.runtime.pooling_params import PoolingParams
from tests.runtime.server.serving import MODEL, ServerThread, assert_refused_before_running, idle, metrics, serve
from tests.tiny_models import make_tiny_hf_checkpoint

pytestmark = pytest.mark.unit
pytest.importorskip("transformers")
MAX_INPUTS = 8
TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog " * 4, "paged attention packs requests",
         "user: what is 2 + 2? assistant: 4", "fox"]
EXPORT = {"max_model_len": 256, "buckets": {"decode_batch": [1, 4, 16], "prefill_tokens": [16, 64, 256],
                                            "prefill_max_seqs": 16}}


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny Qwen3 exported for embeddings (Matryoshka, last-token pooling) and for generation."""
    root = tmp_path_factory.mktemp("embedding-server")
    source = make_tiny_hf_checkpoint(root / "hf", arch="qwen3", tie=False)
    options = {"embed": {"task": "embed", "pooling": {"type": "last", "matryoshka": True}}, "generate": {}}
    for task, extra in options.items():
        export(ExportConfig.model_validate({"model": {"source": str(source)}, "export": {**EXPORT, **extra}}),
               root / task, log=io.StringIO())
    return {task: root / task for task in options}


@pytest.fixture(scope="module")
def server(artifacts: dict[str, Path]) -> Iterator[ServerThread]:
    with serve(artifacts["embed"], kv_cache={"num_blocks": 96}, scheduler={"max_num_batched_tokens": 64},
               server={"max_prompts_per_request": MAX_INPUTS}) as thread:
        yield thread


@pytest.fixture(scope="module")
def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0)


@pytest.fixture(scope="module")
def offline(artifacts: dict[str, Path]) -> LLM:
    return LLM(artifacts["embed"], num_blocks=96)


def _post(server: ServerThread, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", content=json.dumps(body), headers={"Content-Type": "application/json"},
                      timeout=60)


def _close(got: list[float] | np.ndarray, want: np.ndarray) -> bool:
    return np.abs(np.asarray(got, np.float32) - want).max() <= 1e-5


def test_a_list_of_texts_is_answered_in_order_as_llm_embed_does(server: ServerThread, offline: LLM) -> None:
    answer = _post(server, "/v1/embeddings", {"model": MODEL, "input": TEXTS}).json()
    assert answer["object"] == "list" and answer["model"] == MODEL
    assert [d["index"] for d in answer["data"]] == list(range(len(TEXTS)))
    assert all(d["object"] == "embedding" for d in answer["data"])
    want = offline.embed(TEXTS)
    assert all(_close(d["embedding"], out.embedding) for d, out in zip(answer["data"], want))
    tokens = sum(len(out.prompt_token_ids) for out in want)
    assert answer["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}


def test_one_text_token_ids_and_lists_of_them(server: ServerThread, offline: LLM) -> None:
    ids = [[5, 17, 42], list(range(10, 60))]
    want = offline.embed([{"prompt_token_ids": p} for p in ids])
    one = _post(server, "/v1/embeddings", {"input": ids[0]}).json()["data"]
    several = _post(server, "/v1/embeddings", {"input": ids}).json()["data"]
    text = _post(server, "/v1/embeddings", {"input": TEXTS[0]}).json()["data"]
    assert len(one) == 1 and _close(one[0]["embedding"], want[0].embedding)
    assert [_close(d["embedding"], w.embedding) for d, w in zip(several, want)] == [True, True]
    assert len(text) == 1 and _close(text[0]["embedding"], offline.embed(TEXTS[0])[0].embedding)


def test_base64_is_the_float32_bytes_of_the_float_answer(server: ServerThread) -> None:
    floats = _post(server, "/v1/embeddings", {"input": TEXTS[:2]}).json()["data"]
    packed = _post(server, "/v1/embeddings", {"input": TEXTS[:2], "encoding_format": "base64"}).json()["data"]
    for f, b in zip(floats, packed):
        decoded = np.frombuffer(base64.b64decode(b["embedding"]), "<f4")
        assert decoded.tolist() == np.asarray(f["embedding"], np.float32).tolist()


def test_the_openai_client_embeds(client: openai.OpenAI, offline: LLM) -> None:
    """openai's `embeddings.create` asks for base64 by default and decodes it; with `dimensions`, the first d of a
    Matryoshka model's vector, normalised again."""
    answer = client.embeddings.create(model=MODEL, input=TEXTS[:3])
    want = offline.embed(TEXTS[:3])
    assert [len(d.embedding) for d in answer.data] == [64] * 3
    assert all(_close(d.embedding, w.embedding) for d, w in zip(answer.data, want))
    assert answer.usage.prompt_tokens == sum(len(w.prompt_token_ids) for w in want)
    cut = client.embeddings.create(model=MODEL, input=TEXTS[0], dimensions=16, encoding_format="float")
    assert _close(cut.data[0].embedding, offline.embed(TEXTS[0], PoolingParams(dimensions=16))[0].embedding)
    assert np.isclose(np.linalg.norm(cut.data[0].embedding), 1.0)


def test_32_concurrent_requests_of_mixed_lengths_end_with_no_error_and_every_block_free(server: ServerThread,
                                                                                        offline: LLM) -> None:
    rng = np.random.default_rng(0)
    bodies = [{"input": [int(t) for t in rng.integers(3, 290, int(rng.integers(1, 250)))]} if i % 3 == 0 else
              {"input": [TEXTS[(i + j) % len(TEXTS)] * int(rng.integers(1, 3)) for j in range(i % 4 + 1)]}
              for i in range(32)]
    with ThreadPoolExecutor(32) as pool:
        answers = list(pool.map(lambda body: _post(server, "/v1/embeddings", body), bodies))
    assert [a.status_code for a in answers] == [200] * 32, [a.text for a in answers if a.status_code != 200]
    for body, answer in zip(bodies, answers):
        inputs = body["input"] if isinstance(body["input"][0], str) else [{"prompt_token_ids": body["input"]}]
        want = offline.embed(inputs)
        assert all(_close(d["embedding"], w.embedding) for d, w in zip(answer.json()["data"], want, strict=True))
    now = idle(server)
    assert now["pagedgraph_kv_blocks_free"] == now["pagedgraph_kv_blocks_total"], "blocks leaked"


def test_score_and_rerank_are_the_cosine_similarities_of_the_vectors(server: ServerThread, offline: LLM) -> None:
    vectors = [out.embedding for out in offline.embed(TEXTS[:3])]
    score = _post(server, "/v1/score", {"text_1": TEXTS[0], "text_2": TEXTS[:3]}).json()
    assert [d["index"] for d in score["data"]] == [0, 1, 2]
    assert np.allclose([d["score"] for d in score["data"]], [float(vectors[0] @ v) for v in vectors], atol=1e-5)
    pairs = _post(server, "/v1/score", {"text_1": TEXTS[1:3], "text_2": TEXTS[:2]}).json()
    assert np.allclose([d["score"] for d in pairs["data"]], [float(vectors[1] @ vectors[0]),
                                                             float(vectors[2] @ vectors[1])], atol=1e-5)
    rerank = _post(server, "/v1/rerank", {"query": TEXTS[2], "documents": TEXTS[:3], "top_n": 2}).json()
    assert [r["index"] for r in rerank["results"]][0] == 2 and len(rerank["results"]) == 2
    assert rerank["results"][0]["document"] == {"text": TEXTS[2]}
    assert np.isclose(rerank["results"][0]["relevance_score"], 1.0, atol=1e-5)


@pytest.mark.parametrize("body, param, words", [
    ({"input": TEXTS[0], "dimensions": 65}, "dimensions", "dimensions: 65: this model's vectors have 64 dimensions"),
    ({"input": [[5, 6], [7, 400]]}, "input[1]", "input[1]: token ids must be integers in [0, 300)"),
    ({"input": [[5], []]}, "input[1]", "input[1]: is empty"),
    ({"input": [[1]] * (MAX_INPUTS + 1)}, "input", f"{MAX_INPUTS + 1} prompts in one request"),
    ({"input": [list(range(3, 260))]}, "input[0]", "input[0]: the prompt is 257 tokens; this model's max_model_len "
                                                   "is 256, so prompts must be at most 256 tokens"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format", "encoding_format = 'int8'"),
    ({"text_1": TEXTS[:2], "text_2": TEXTS[:3]}, "text_1", "text_1 has 2 texts and text_2 3"),
], ids=["dimensions", "vocabulary", "empty", "too-many", "too-long", "encoding", "score-pairs"])
def test_bad_input_is_a_400_naming_the_field_and_nothing_runs(server: ServerThread, body: dict[str, Any],
                                                              param: str, words: str) -> None:
    path = "/v1/score" if "text_1" in body else "/v1/embeddings"
    assert_refused_before_running(server, lambda: _post(server, path, body), param, words)


def test_the_embedding_server_says_its_task_and_refuses_completions(server: ServerThread,
                                                                    client: openai.OpenAI) -> None:
    card = httpx.get(f"{server.url}/v1/models").json()["data"][0]
    assert card["task"] == card["runtime"]["task"] == "embed"
    for call in (lambda: client.completions.create(model=MODEL, prompt="hi", max_tokens=2),
                 lambda: client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])):
        with pytest.raises(openai.BadRequestError) as refused:
            call()
        error = refused.value.response.json()["error"]
        assert error["param"] == "model" and error["code"] == "wrong_model_task"
        assert "is an embedding model (exported with export.task embed)" in error["message"]


def test_a_generation_server_refuses_embeddings(artifacts: dict[str, Path]) -> None:
    with serve(artifacts["generate"], kv_cache={"num_blocks": 32}) as generator:
        assert httpx.get(f"{generator.url}/v1/models").json()["data"][0]["task"] == "generate"
        for path, body in (("/v1/embeddings", {"input": "hi"}), ("/v1/score", {"text_1": "a", "text_2": "b"}),
                           ("/v1/rerank", {"query": "a", "documents": ["b"]})):
            response = _post(generator, path, body)
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["param"] == "model" and f"not {path}" in error["message"]
            assert "is a generation model (exported with export.task generate)" in error["message"]
