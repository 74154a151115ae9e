"""prompt_logprobs: every prompt token's log-probability given its prefix, through the real bucket graphs.

The reference for position j is the plain sampling path: a request whose prompt is the first j
tokens, whose one sampled row (recorded from the executor) is log-softmaxed in numpy. The tiny
artifact's prefill gear returns 4 logits rows, so a 37-token prompt is fed in chunks of at most 4
tokens, none block-aligned, beside other requests.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pagedgraph.runtime.engine import LLMEngine, EngineConfig
from pagedgraph.runtime.sampling_params import RequestError, SamplingParams
from tests.mindspore_support import RecordingExecutor

pytestmark = pytest.mark.unit
PROMPT = [int(t) for t in np.random.default_rng(7).integers(3, 200, 37)]


def _log_softmax(row: np.ndarray) -> np.ndarray:
    row = row.astype(np.float64)
    return row - row.max() - np.log(np.exp(row - row.max()).sum())


def _reference(artifact: Path, prompt: list[int]) -> list[np.ndarray]:
    """log-softmax of the logits after each prefix prompt[:j], j = 1 .. len - 1, one request at a time."""
    engine = LLMEngine(artifact, EngineConfig(enable_prefix_caching=False))
    recorder = engine.runner.executor = RecordingExecutor(engine.runner.executor)
    rows = []
    for j in range(1, len(prompt)):
        engine.add_request(prompt[:j], SamplingParams(max_tokens=1, temperature=0))
        while engine.has_unfinished():
            engine.step()
        rows.append(_log_softmax(recorder.steps[-1][1][0]))
    return rows


@pytest.fixture(scope="module")
def reference(tiny_artifact: Path) -> list[np.ndarray]:
    return _reference(tiny_artifact, PROMPT)


def _check(entries: list, reference: list[np.ndarray], k: int) -> None:
    assert len(entries) == len(PROMPT) and entries[0] is None
    for j in range(1, len(PROMPT)):
        logp, entry, token = reference[j - 1], entries[j], PROMPT[j]
        assert entry[token].logprob == pytest.approx(logp[token], abs=1e-4), j
        assert entry[token].rank == int((logp > logp[token]).sum()) + 1
        best = np.argsort(-logp)[:k].tolist()
        assert set(entry) == {token, *best}
        for rank, alt in enumerate(best, 1):
            assert entry[alt].logprob == pytest.approx(logp[alt], abs=1e-4)
            if alt != token:
                assert entry[alt].rank == rank


def test_prompt_logprobs_equal_the_prefix_runs(tiny_artifact: Path, reference: list[np.ndarray]) -> None:
    engine = LLMEngine(tiny_artifact)
    recorder = engine.runner.executor = RecordingExecutor(engine.runner.executor)
    others = [engine.add_request([5 + i] * (3 + 20 * i), SamplingParams(max_tokens=12,
                                                                                           temperature=0))
              for i in range(2)]
    target = engine.add_request(PROMPT, SamplingParams(max_tokens=3, temperature=0,
                                                                             prompt_logprobs=2))
    outputs = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id] = out
    _check(outputs[target.request_id].prompt_logprobs, reference, 2)
    assert all(outputs[s.request_id].prompt_logprobs is None for s in others)
    # The chunks share steps with the other requests and never overflow the 4 rows the gear returns.
    assert max(gear.seqs for gear, _ in recorder.steps) == 4
    # The others' tokens are those of a run without prompt logprobs.
    plain = LLMEngine(tiny_artifact)
    for i, seq in enumerate(others):
        plain.add_request(seq.prompt_token_ids, SamplingParams(max_tokens=12, temperature=0),
                          request_id=seq.request_id)
    alone = {}
    while plain.has_unfinished():
        for out in plain.step():
            alone[out.request_id] = out.token_ids
    assert {s.request_id: outputs[s.request_id].token_ids for s in others} == alone


def test_prompt_logprobs_survive_preemption_and_skip_the_prefix_cache(tiny_artifact: Path,
                                                                      reference: list[np.ndarray]) -> None:
    # 5 usable blocks of 16 (max_model_len 80 fits them): the long decoders outgrow the pool and the latest arrival is preempted.
    engine = LLMEngine(tiny_artifact, EngineConfig(num_blocks=6, max_model_len=80))
    engine.add_request(PROMPT, SamplingParams(max_tokens=1, temperature=0))
    while engine.has_unfinished():
        engine.step()  # PROMPT's blocks are now in the prefix cache
    first = engine.add_request([9] * 20, SamplingParams(max_tokens=40, temperature=0,
                                                                              ignore_eos=True))
    target = engine.add_request(PROMPT, SamplingParams(max_tokens=20, temperature=0,
                                                                             ignore_eos=True, prompt_logprobs=0))
    outputs = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id] = out
    assert engine.scheduler.num_preemptions >= 1
    assert outputs[target.request_id].num_cached_tokens == 0
    assert len(outputs[first.request_id].token_ids) == 40
    _check(outputs[target.request_id].prompt_logprobs, reference, 0)


def test_prompt_logprobs_validation(tiny_artifact: Path) -> None:
    with pytest.raises(RequestError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
    engine = LLMEngine(tiny_artifact, EngineConfig(enable_chunked_prefill=False, max_num_batched_tokens=64,
                                                   max_model_len=64))
    with pytest.raises(RequestError, match="prompt_logprobs"):
        engine.add_request(PROMPT, SamplingParams(prompt_logprobs=0))
