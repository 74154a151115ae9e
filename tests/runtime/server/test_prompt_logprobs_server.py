"""vLLM's `prompt_logprobs` on /v1/completions, through the real server on the real model."""
from __future__ import annotations

import pytest

from pagedgraph.runtime.engine import LLM
from tests.runtime.server.test_server_sampling import KEY, MODEL, _params, _post, llm, server  # noqa: F401 (fixtures)
from tests.runtime.server.serving import ServerThread

pytestmark = pytest.mark.e2e


def test_completions_report_prompt_logprobs_in_vllms_shape(server: ServerThread, llm: LLM) -> None:  # noqa: F811
    prompt = "Bees fly about three kilometres to find flowers"
    body = _post(server, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0,
                                             "prompt_logprobs": 2}).json()
    offline = llm.generate(prompt, _params(max_tokens=1, prompt_logprobs=2))[0]
    (choice,) = body["choices"]
    entries = choice["prompt_logprobs"]
    assert len(entries) == len(offline.prompt_token_ids) == body["usage"]["prompt_tokens"]
    assert entries[0] is None and choice["logprobs"] is None
    for token, entry, expected in zip(offline.prompt_token_ids[1:], entries[1:], offline.prompt_logprobs[1:]):
        assert set(entry) == {str(t) for t in expected} and str(token) in entry
        assert len(entry) in (2, 3)  # the prompt token plus the top 2 (one of which it may be)
        for t, lp in expected.items():
            assert entry[str(t)]["logprob"] == pytest.approx(lp.logprob, abs=1e-4)
            assert entry[str(t)]["rank"] == lp.rank
            assert entry[str(t)]["decoded_token"] == llm.engine.tokenizer.decode([t])
    assert "".join(e[str(t)]["decoded_token"] for t, e in zip(offline.prompt_token_ids[1:], entries[1:])) \
        == llm.engine.tokenizer.decode(offline.prompt_token_ids[1:])


def test_prompt_logprobs_are_not_streamed(server: ServerThread) -> None:  # noqa: F811
    answer = _post(server, "/v1/completions", {"model": MODEL, "prompt": "hi", "stream": True, "prompt_logprobs": 1})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "prompt_logprobs"
    answer = _post(server, "/v1/completions", {"model": MODEL, "prompt": "hi", "prompt_logprobs": 21})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "prompt_logprobs"
