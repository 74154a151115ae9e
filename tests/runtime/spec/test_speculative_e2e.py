"""Speculative decoding on the real model: greedy output equals the plain engine's token for token (n-gram and a
draft model), the KV state after rejections equals a plain run's, the engine's other features keep working, and
bad configurations name their key."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedgraph.artifact.manifest import Manifest
from pagedgraph.artifact.settings import ConfigError
from pagedgraph.runtime.engine import EngineConfig, LLMEngine
from pagedgraph.runtime.sampling_params import SamplingParams
from pagedgraph.runtime.spec.build import shares_kv
from tests.paths import DATA

pytestmark = pytest.mark.e2e
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "disable_by_batch_size": 16}
COPY_PROMPT = [{"role": "user", "content": "Repeat this list exactly, twice: alpha beta gamma delta epsilon zeta "
                                           "eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau."}]
DRAFT = {"method": "draft_model", "num_speculative_tokens": 3}
GREEDY = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
JSON_PROMPT = [{"role": "user", "content": 'Return this JSON unchanged: {"name": "alpha", "items": ["beta", "gamma", '
                                           '"delta"], "owner": "alpha"}'}]


@pytest.fixture(scope="module")
def reference() -> list[dict]:
    return json.loads((DATA / "reference_smollm2.json").read_text())


def _engine(artifact: Path, spec: dict | None = None, **config: object) -> LLMEngine:
    return LLMEngine(artifact, EngineConfig(threads=2, max_num_batched_tokens=1024, speculative_config=spec,
                                            **config))  # type: ignore[arg-type]


def _speculating(artifact: Path, proposer: str, request: pytest.FixtureRequest, **config: object) -> LLMEngine:
    """`artifact` with n-gram lookup, or with the w4a16 export of the same model (the draft docs/usage.md suggests)
    drafting on its pools: int4 weights and int8 activations make it disagree at times (the float32-compute GGUF one,
    on the target's exact K/V, agrees at every position of these prompts, so no rollback would be tested). Its cost
    is set to 0 so that it drafts as long as the pace allows, whatever this machine's timing
    (test_long_output_and_draft_model_greedy_equal_plain)."""
    if proposer == "ngram":
        return _engine(artifact, NGRAM, **config)
    draft = {**DRAFT, "model": str(request.getfixturevalue("smollm2_w4a16_artifact")), "disable_by_batch_size": 16}
    engine = _engine(artifact, draft, **config)
    assert engine.speculator.proposer.shared, "the same model at another precision drafts on the target's pools"
    engine.speculator.proposer.cost = 0.0
    return engine


def _staggered(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    """Four requests join before each of the first steps, as in tests/runtime/test_reference_e2e.py."""
    pending, ids, results = list(enumerate(prompts)), {}, {}
    while pending or engine.has_unfinished():
        for i, prompt in pending[:4]:
            ids[engine.add_request(prompt, params).request_id] = i
        pending = pending[4:]
        for out in engine.step():
            if out.finished:
                results[ids[out.request_id]] = out.token_ids
    assert engine.kv.num_free_blocks == engine.kv.pool.num_blocks - 1, "blocks leaked"
    return [results[i] for i in range(len(prompts))]


def _check_spoke(engine: LLMEngine) -> None:
    stats = engine.speculator.stats
    assert stats.num_drafts and stats.num_accepted_tokens, "nothing was proposed, or nothing kept"
    assert stats.num_accepted_tokens < stats.num_draft_tokens, "no proposal was rejected: rollback untested"


@pytest.fixture(scope="module")
def plain_reference_run(smollm2_spec_artifact: Path, reference: list[dict]) -> tuple[list[list[int]], set[bytes]]:
    """The plain engine's tokens for the 16 reference prompts, staggered, and the block hashes its cache ends with:
    what both proposers' runs are compared with."""
    plain = _engine(smollm2_spec_artifact)
    return _staggered(plain, [r["prompt_token_ids"] for r in reference], GREEDY), set(plain.kv.pool.cached)


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_greedy_equals_plain_on_the_reference_prompts(smollm2_spec_artifact: Path, reference: list[dict],
                                                      plain_reference_run: tuple[list[list[int]], set[bytes]],
                                                      request: pytest.FixtureRequest, proposer: str) -> None:
    """The 16 reference prompts, staggered, with n-gram lookup and with a draft (`_speculating`)."""
    want, cached = plain_reference_run
    spec = _speculating(smollm2_spec_artifact, proposer, request)
    assert _staggered(spec, [r["prompt_token_ids"] for r in reference], GREEDY) == want
    _check_spoke(spec)
    assert set(spec.kv.pool.cached) == cached, "the prefix cache holds other blocks"
    assert not any(k.startswith("prefill:T8x") or k.startswith("prefill:T16x") for k in spec.stats.bucket_hits), \
        "batch invariance verifies drafts as decode rows, in decode gears"


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_rejected_drafts_leave_the_cache_as_a_plain_run(smollm2_spec_artifact: Path, request: pytest.FixtureRequest,
                                                        proposer: str) -> None:
    """Step by step at B=1: whenever both runs hold the same tokens, refcounts, hashes and free blocks agree. The
    draft runs on the target's pools: the slots it borrows for its drafts are given back."""
    plain, spec = _engine(smollm2_spec_artifact), _speculating(smollm2_spec_artifact, proposer, request)
    prompt = spec.prompts.token_ids({"messages": COPY_PROMPT})
    params = SamplingParams(max_tokens=160, temperature=0, ignore_eos=True)
    a, b = plain.add_request(prompt, params), spec.add_request(prompt, params)
    compared = 0
    while spec.has_unfinished():
        spec.step()
        while plain.has_unfinished() and a.num_tokens < b.num_tokens:
            plain.step()
        assert a.token_ids == b.token_ids
        if not b.finished:
            assert [plain.kv.pool.blocks[x].ref_cnt for x in a.block_table] == \
                   [spec.kv.pool.blocks[x].ref_cnt for x in b.block_table]
            assert (a.num_computed_tokens, plain.kv.num_free_blocks) == (b.num_computed_tokens, spec.kv.num_free_blocks)
            assert set(plain.kv.pool.cached) == set(spec.kv.pool.cached)
            compared += 1
    _check_spoke(spec)
    assert compared >= 10


def test_long_output_and_draft_model_greedy_equal_plain(smollm2_spec_artifact: Path,
                                                         smollm2_gguf_artifact: Path) -> None:
    """A 256-token copy-heavy output with n-gram lookup, then the GGUF artifact drafting for the fp32 one."""
    plain = _engine(smollm2_spec_artifact)
    prompt = plain.prompts.token_ids({"messages": COPY_PROMPT})
    long = SamplingParams(max_tokens=256, temperature=0, ignore_eos=True)
    want = _staggered(plain, [prompt], long)
    ngram = _engine(smollm2_spec_artifact, NGRAM)
    assert _staggered(ngram, [prompt], long) == want
    _check_spoke(ngram)
    draft = _engine(smollm2_spec_artifact, {**DRAFT, "model": str(smollm2_gguf_artifact)})
    assert draft.speculator.proposer.cost > 0, "a draft token's cost in target decode steps, timed at load"
    assert draft.speculator.proposer.shared, "the GGUF export of the target's model drafts on the target's pools"
    # Drafts as long as the pace allows, whatever this machine's draft costs (this GGUF export computes in float32,
    # slower than the fp32 target, so the cost rule would stop it): the check is on verifying several positions.
    draft.speculator.proposer.cost = 0.0
    prompts = [prompt, prompt[:20]]
    assert _staggered(draft, prompts, GREEDY) == _staggered(plain, prompts, GREEDY)
    assert draft.speculator.stats.num_accepted_tokens > draft.speculator.stats.num_drafts  # > 1 kept per draft


def test_a_draft_that_cannot_share_the_cache_keeps_its_own(smollm2_w8a8_artifact: Path,
                                                           smollm2_gguf_artifact: Path) -> None:
    """The shipped precision's target on its int8 cache, for which the GGUF draft has no graphs: the draft prefills
    into a float32 pool of its own, its cache rolling back with its drafts; greedy output is still the plain run's."""
    plain = _engine(smollm2_w8a8_artifact, kv_cache_dtype="int8")
    draft = _engine(smollm2_w8a8_artifact, {**DRAFT, "model": str(smollm2_gguf_artifact)}, kv_cache_dtype="int8")
    proposer = draft.speculator.proposer
    assert not proposer.shared and proposer.runner.pools.kv_cache_dtype == "float32"
    # Nor would a draft with int8 graphs share it: the target's int8 rows are read with the target's own scales.
    assert not shares_kv(Manifest.load(smollm2_w8a8_artifact), draft)
    proposer.cost = 0.0
    prompt = plain.prompts.token_ids({"messages": COPY_PROMPT})
    prompts = [prompt, prompt[:30]]
    assert _staggered(draft, prompts, GREEDY) == _staggered(plain, prompts, GREEDY)
    _check_spoke(draft)
    own = proposer.kv
    assert own.num_free_blocks == own.pool.num_blocks - 1, "the draft's own pool leaked blocks"


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_forks_preemption_chunks_and_grammars_keep_working(smollm2_spec_artifact: Path, request: pytest.FixtureRequest,
                                                           proposer: str) -> None:
    """n=2 forks (copy-on-write), a pool small enough to preempt, 16-token prefill chunks and a JSON grammar (its
    drafts cut to what the grammar allows, each verified position masked). The draft borrows its slots from that
    small pool, the forks' included, and gives them back before the scheduler preempts."""
    config = {"num_blocks": 20, "max_model_len": 256, "long_prefill_token_threshold": 16}
    plain, spec = _engine(smollm2_spec_artifact, **config), _speculating(smollm2_spec_artifact, proposer, request,
                                                                         **config)
    prompt = spec.prompts.token_ids({"messages": COPY_PROMPT})
    two = SamplingParams(n=2, max_tokens=64, temperature=0, ignore_eos=True)
    json_params = SamplingParams(max_tokens=40, temperature=0, structured_outputs={"json": {"type": "object"}})
    json_prompt = spec.prompts.token_ids({"messages": JSON_PROMPT})
    outs = {}
    for name, engine in (("plain", plain), ("spec", spec)):
        for p, params in ((prompt, two), (prompt[:-5], two), (json_prompt, json_params)):
            engine.add_request(p, params)
        done = {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = [c.token_ids for c in out.outputs]
        outs[name] = sorted(done.values())
        assert len(outs[name]) == 3 and all(len(c) == 2 for c in outs[name][:2])
        assert engine.scheduler.num_preemptions, "the pool was large enough: preemption untested"
        assert engine.kv.num_free_blocks == engine.kv.pool.num_blocks - 1
    assert outs["spec"] == outs["plain"]
    _check_spoke(spec)


def test_bad_configs_name_their_key(smollm2_spec_artifact: Path, tiny_artifact: Path) -> None:
    with pytest.raises(ConfigError, match="method"):
        EngineConfig(speculative_config={"method": "eagle", "num_speculative_tokens": 2})
    with pytest.raises(ConfigError, match="num_speculative_tokens = 40"):
        _engine(smollm2_spec_artifact, {"method": "ngram", "num_speculative_tokens": 40})
    with pytest.raises(ConfigError, match="speculative_config.model.*vocabulary"):
        _engine(smollm2_spec_artifact, {"method": "draft_model", "num_speculative_tokens": 2,
                                        "model": str(tiny_artifact)})


def test_the_copy_bench_compares_speculation_on_and_off(smollm2_spec_artifact: Path) -> None:
    """One copy-heavy request; the JSON carries the spec_decode counters and the run without speculation."""
    from pagedgraph.runtime.bench.report import text_table
    from pagedgraph.runtime.bench.suite import BenchOptions, run_bench

    results = run_bench(BenchOptions(str(smollm2_spec_artifact), workload="copy", requests=1, baseline=None,
                                     micro=False, threads=2, speculative_config=NGRAM))
    json.dumps(results)
    spec = results["spec_decode"]
    assert spec["num_drafts"] > 0 and 0 < spec["acceptance_rate"] <= 1 and spec["mean_acceptance_length"] > 1
    assert results["outputs_equal_spec_off"] and results["speedup_vs_spec_off"] > 0
    assert "paged/spec off" in text_table(results) and "mean acceptance length" in text_table(results)
