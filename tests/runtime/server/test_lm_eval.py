"""lm-evaluation-harness (the `clients` extra) against the real server, as its users run it.

Two tiny tasks are written as lm-eval custom tasks (a YAML each, `dataset_path: json` on a local JSONL: no
dataset hub): a multiple-choice one, scored by loglikelihood (`echo` + `logprobs` over lists of token-id
prompts), and a generation one. `local-completions` runs both at `--batch_size` 1 and 4, tokenizing through
the server (`/tokenizer_info`, `/tokenize`); `local-chat-completions` runs the generation task on the chat
endpoint. Batching must change nothing, and each loglikelihood must equal the one `pagedgraph eval` computes
for the same tokens (`runtime/perplexity.py`).
"""
from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from pagedgraph.runtime.engine import EngineConfig, LLMEngine
from pagedgraph.runtime.perplexity import perplexity
from tests.runtime.server.serving import MODEL, ServerThread, client_library, serve

pytestmark = pytest.mark.e2e
evaluator = client_library("lm_eval.evaluator")
lm_eval_tasks = client_library("lm_eval.tasks")
lm_eval_utils = client_library("lm_eval.utils")

CHOICE_DOCS = [
    {"question": "What is the capital of France?", "choices": ["Paris", "London", "Rome"], "answer": 0},
    {"question": "How many legs does a spider have?", "choices": ["six", "eight", "ten"], "answer": 1},
    {"question": "What colour is the sky on a clear day?", "choices": ["green", "red", "blue"], "answer": 2},
    {"question": "Which animal says moo?", "choices": ["a cow", "a cat", "a dog"], "answer": 0},
    {"question": "What do bees make?", "choices": ["milk", "honey", "silk"], "answer": 1},
]
GENERATE_DOCS = [
    {"question": "What is the capital of France?", "answer": "Paris"},
    {"question": "What is two plus two?", "answer": "four"},
    {"question": "What do bees make?", "answer": "honey"},
    {"question": "Which planet do we live on?", "answer": "Earth"},
    {"question": "What colour is grass?", "answer": "green"},
]
# What makes a task: lm-eval reads a local JSONL through `datasets`' json loader, into a cache of our own.
TASK_SOURCE = """task: pagedgraph_{name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
  cache_dir: {cache}
test_split: test
"""
CHOICE_TASK = """output_type: multiple_choice
doc_to_text: "Question: {{question}}\\nAnswer:"
doc_to_choice: choices
doc_to_target: answer
metric_list:
  - metric: acc
"""
GENERATE_TASK = """output_type: generate_until
doc_to_text: "Q: {{question}}\\nA:"
doc_to_target: answer
generation_kwargs:
  until: ["\\n", "."]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
    ignore_case: true
    ignore_punctuation: true
"""


@pytest.fixture(scope="module")
def server(smollm2_artifact: Path) -> Iterator[ServerThread]:
    with serve(smollm2_artifact, kv_cache={"num_blocks": 128}, scheduler={"max_model_len": 256}) as thread:
        yield thread


@pytest.fixture(scope="module")
def tasks(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The two tasks as lm-eval finds custom ones: YAML files in an include path, data in local JSONL files."""
    root = tmp_path_factory.mktemp("lm_eval_tasks")
    for name, docs, task in (("choice", CHOICE_DOCS, CHOICE_TASK), ("generate", GENERATE_DOCS, GENERATE_TASK)):
        data = root / f"{name}.jsonl"
        data.write_text("".join(json.dumps(doc) + "\n" for doc in docs))
        (root / f"{name}.yaml").write_text(TASK_SOURCE.format(name=name, data=data, cache=root / "datasets") + task)
    return lm_eval_tasks.TaskManager(include_path=str(root))


def _evaluate(server: ServerThread, tasks: Any, model: str, names: list[str], batch_size: int) -> dict[str, Any]:
    endpoint = "chat/completions" if model == "local-chat-completions" else "completions"
    args = {"base_url": f"{server.url}/v1/{endpoint}", "model": MODEL, "max_length": 256, "max_retries": 1}
    return evaluator.simple_evaluate(model=model, model_args=args, tasks=names, batch_size=batch_size,
                                     task_manager=tasks, apply_chat_template=model == "local-chat-completions",
                                     bootstrap_iters=0, log_samples=True, verbosity="WARNING")


def _loglikelihoods(results: dict[str, Any]) -> list[list[float]]:
    """Per document, the loglikelihood of each choice."""
    return [[resp[0] for resp in sample["filtered_resps"]] for sample in results["samples"]["pagedgraph_choice"]]


def _generations(results: dict[str, Any], task: str) -> list[str]:
    return [sample["filtered_resps"][0] for sample in results["samples"][task]]


@pytest.fixture(scope="module")
def completions(server: ServerThread, tasks: Any) -> dict[int, dict[str, Any]]:
    """Both tasks through local-completions, at batch sizes 1 and 4; `sent`: the prompts of each request it sent."""
    requests = client_library("lm_eval.models.api_models").requests
    runs = {}
    for size in (1, 4):
        sent: list[int] = []
        post = requests.post

        def counted(url: str, json: dict[str, Any], **kwargs: Any) -> Any:
            sent.append(len(json["prompt"]))
            return post(url, json=json, **kwargs)

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(requests, "post", counted)
            runs[size] = {**_evaluate(server, tasks, "local-completions", ["pagedgraph_choice", "pagedgraph_generate"],
                                      size), "sent": sent}
    return runs


def test_lm_eval_tokenizes_through_the_server(server: ServerThread) -> None:
    info = httpx.get(f"{server.url}/tokenizer_info").json()
    assert lm_eval_utils.check_remote_tokenizer_support(f"{server.url}/v1/completions")
    tokenizer = lm_eval_utils.RemoteTokenizer(f"{server.url}/v1/completions")
    assert tokenizer.eos_token == info["eos_token"] == "<|im_end|>"
    assert tokenizer.decode(tokenizer.encode("Question: why?")) == "Question: why?"


def test_batch_size_4_scores_exactly_as_batch_size_1(completions: dict[int, dict[str, Any]]) -> None:
    one, four = completions[1], completions[4]
    assert set(one["sent"]) == {1} and max(four["sent"]) == 4 and sum(four["sent"]) == sum(one["sent"])
    assert _loglikelihoods(four) == _loglikelihoods(one)
    assert four["results"]["pagedgraph_choice"]["acc,none"] == one["results"]["pagedgraph_choice"]["acc,none"]
    assert _generations(four, "pagedgraph_generate") == _generations(one, "pagedgraph_generate")
    assert all(text for text in _generations(one, "pagedgraph_generate"))
    assert four["results"]["pagedgraph_generate"] == one["results"]["pagedgraph_generate"]


def test_loglikelihoods_equal_pagedgraph_eval_on_the_same_tokens(completions: dict[int, dict[str, Any]],
                                                                  server: ServerThread,
                                                                  smollm2_artifact: Path) -> None:
    """lm-eval scores a choice as log P(continuation | context) from the server's echoed prompt logprobs;
    `pagedgraph eval` scores a text as the sum of its tokens' log-probabilities after the first. So the first
    equals eval(context + continuation) - eval(context), on the token ids lm-eval sent."""
    engine = LLMEngine(smollm2_artifact, EngineConfig(num_blocks=64, threads=2, max_model_len=256))

    @functools.cache
    def total(ids: tuple[int, ...]) -> float:
        result = perplexity(engine, list(ids), context=len(ids))
        return -result.nll * result.num_scored

    def encode(text: str) -> tuple[int, ...]:
        return tuple(httpx.post(f"{server.url}/tokenize", json={"prompt": text, "add_special_tokens": False}
                                ).json()["tokens"])

    samples = completions[4]["samples"]["pagedgraph_choice"]
    assert len(samples) == len(CHOICE_DOCS)
    for sample in samples:
        for (context, continuation), (loglikelihood, _) in zip(sample["arguments"], sample["filtered_resps"]):
            whole, head = encode(context + continuation), encode(context)
            assert whole[:len(head)] == head
            assert loglikelihood == pytest.approx(total(whole) - total(head), abs=1e-5)
    assert completions[4]["results"]["pagedgraph_choice"]["acc,none"] >= 0.6  # a 135M model knows these


def test_local_chat_completions_generates_through_the_chat_template(server: ServerThread, tasks: Any) -> None:
    results = _evaluate(server, tasks, "local-chat-completions", ["pagedgraph_generate"], 1)
    texts = _generations(results, "pagedgraph_generate")
    assert len(texts) == len(GENERATE_DOCS) and all(text.strip() for text in texts)
    messages = [{"role": "user", "content": f"Q: {GENERATE_DOCS[0]['question']}\nA:"}]
    alone = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0, "stop": ["\n", "."]}).json()
    assert texts[0] == alone["choices"][0]["message"]["content"]
