"""With the real model: prefix caching, chunked prefill, preemption and n > 1 forks change no output.

Every run serves the same shared-prefix workload; greedy tokens must equal those of a run with
caching off and a pool large enough that nothing is ever preempted.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pagedgraph.cli import main
from pagedgraph.runtime.engine import LLM, RequestOutput
from pagedgraph.runtime.sampling_params import SamplingParams
from pagedgraph.runtime.workloads import shared_prefix_workload

pytestmark = pytest.mark.e2e
MAX_TOKENS = 16
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def requests() -> list[dict[str, Any]]:
    return shared_prefix_workload(num_requests=6, prefix_words=100, max_tokens=MAX_TOKENS, seed=1)


def generate(llm: LLM, requests: list[dict[str, Any]], params: SamplingParams = GREEDY) -> list[RequestOutput]:
    outputs = llm.generate([{"messages": r["messages"]} for r in requests], params)
    assert all(o.error is None and o.finished for o in outputs)
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.pool.num_blocks - 1, "blocks leaked"
    return outputs


def run(artifact: Path, requests: list[dict[str, Any]], params: SamplingParams = GREEDY,
        **config: Any) -> tuple[list[RequestOutput], LLM]:
    llm = LLM(artifact, threads=2, **config)
    return generate(llm, requests, params), llm


def demand_blocks(outputs: list[RequestOutput], n: int = 1, block_size: int = 16) -> int:
    return n * sum(-(-(len(o.prompt_token_ids) + MAX_TOKENS) // block_size) for o in outputs)


def squeezed_pool(blocks: int, block_size: int = 16) -> dict[str, int]:
    """A pool of `blocks`, with the max_model_len it holds (the engine refuses a pool too small for the artifact's)."""
    return {"num_blocks": blocks, "max_model_len": (blocks - 1) * block_size}


@pytest.fixture(scope="module")
def baseline(smollm2_artifact: Path, requests: list[dict[str, Any]]) -> list[RequestOutput]:
    outputs, llm = run(smollm2_artifact, requests, enable_prefix_caching=False, num_blocks=512)
    assert llm.engine.stats.cache.hits == 0 and llm.engine.scheduler.num_preemptions == 0
    return outputs


@pytest.fixture(scope="module")
def cached_llm(smollm2_artifact: Path) -> LLM:
    """Prefix caching on (the default) and a roomy pool, shared by the tests that need no special limits."""
    return LLM(smollm2_artifact, threads=2, num_blocks=512)


def tokens(outputs: list[RequestOutput]) -> list[list[int]]:
    return [o.token_ids for o in outputs]


def test_prefix_caching_on_gives_the_same_tokens_and_counts_hits(
        cached_llm: LLM, requests: list[dict[str, Any]], baseline: list[RequestOutput]) -> None:
    outputs = generate(cached_llm, requests)
    assert tokens(outputs) == tokens(baseline)
    cache = cached_llm.engine.stats.cache
    assert outputs[0].num_cached_tokens == 0
    assert min(o.num_cached_tokens for o in outputs[1:]) >= 112, [o.num_cached_tokens for o in outputs]
    assert cache.hits == sum(o.num_cached_tokens for o in outputs) and 0.5 < cache.hit_rate < 1


def test_chunked_prefill_gives_the_same_tokens(
        smollm2_artifact: Path, requests: list[dict[str, Any]], baseline: list[RequestOutput]) -> None:
    outputs, llm = run(smollm2_artifact, requests, num_blocks=512, max_num_batched_tokens=48,
                       enable_prefix_caching=False)
    assert tokens(outputs) == tokens(baseline)
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    assert llm.engine.stats.steps >= prompt_tokens // 48  # the prompts went in 48-token chunks


def test_a_pool_of_a_quarter_of_the_demand_preempts_and_gives_the_same_tokens(
        smollm2_artifact: Path, requests: list[dict[str, Any]], baseline: list[RequestOutput]) -> None:
    outputs, llm = run(smollm2_artifact, requests, **squeezed_pool(demand_blocks(baseline) // 4 + 1))
    assert tokens(outputs) == tokens(baseline)
    assert llm.engine.scheduler.num_preemptions > 0


def test_cli_reproduces_the_preemption_run_with_caching_off(
        smollm2_artifact: Path, requests: list[dict[str, Any]], baseline: list[RequestOutput], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({**r, "ignore_eos": True}) + "\n" for r in requests))
    pool = squeezed_pool(demand_blocks(baseline) // 4 + 1)
    assert main(["generate", "--artifact", str(smollm2_artifact), "--input", str(src), "--output", str(out),
                 "--num-blocks", str(pool["num_blocks"]), "--max-model-len", str(pool["max_model_len"]),
                 "--no-prefix-caching", "--threads", "2"]) == 0
    got = [json.loads(line)["token_ids"] for line in out.read_text().splitlines()]
    assert got == tokens(baseline)


def test_n_greedy_forks_equal_the_single_output(cached_llm: LLM, requests: list[dict[str, Any]],
                                               baseline: list[RequestOutput]) -> None:
    outputs = generate(cached_llm, requests[:3], SamplingParams(max_tokens=MAX_TOKENS, temperature=0,
                                                                ignore_eos=True, n=3))
    for out, want in zip(outputs, baseline):
        assert [c.token_ids for c in out.outputs] == [want.token_ids] * 3
        assert out.token_ids == want.token_ids


def test_sampled_forks_are_independent_and_reproducible_under_preemption(
        smollm2_artifact: Path, cached_llm: LLM, requests: list[dict[str, Any]], baseline: list[RequestOutput]) -> None:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=7, ignore_eos=True, n=4)
    free = generate(cached_llm, requests[:2], params)
    squeezed, llm = run(smollm2_artifact, requests[:2], params,
                        **squeezed_pool(demand_blocks(baseline[:2], n=4) // 4 + 1))
    assert llm.engine.scheduler.num_preemptions > 0
    completions = [[c.token_ids for c in o.outputs] for o in free]
    assert [[c.token_ids for c in o.outputs] for o in squeezed] == completions
    assert all(len(c) == 4 and len({tuple(t) for t in c}) > 1 for c in completions)


def test_forks_copy_the_shared_partial_block_before_writing(cached_llm: LLM, requests: list[dict[str, Any]]) -> None:
    """Each fork's first sampled token lands in its own copy of the prompt's last, partly filled block.

    Layer 0's K row of a token depends only on the token and its position, so forks that sampled
    different tokens must hold different rows there, and every copy keeps the prompt's rows.
    """
    engine = cached_llm.engine
    bs = engine.kv.block_size
    prompt = next(ids for ids in (engine.prompts.encode_chat(r["messages"])[1] for r in requests) if len(ids) % bs)
    engine.add_request(prompt, SamplingParams(max_tokens=4, temperature=1.0, seed=3, n=4, ignore_eos=True))
    forks: list = []
    while len(forks) < 4 or any(len(s.output_token_ids) < 2 for s in forks):
        assert engine.has_unfinished()
        engine.step()
        forks = list(engine.scheduler.running)
    k0 = engine.runner.executor.pools["k_cache_0"]
    prompt_len = forks[0].num_prompt_tokens

    def row(seq: Any, pos: int) -> Any:
        return k0[seq.block_table[pos // bs] * bs + pos % bs]

    tails = {s.block_table[prompt_len // bs] for s in forks}
    assert len(tails) == 4, "forks still share the block they write into"
    for pos in range(prompt_len // bs * bs, prompt_len):
        assert all((row(s, pos) == row(forks[0], pos)).all() for s in forks), "a copy lost prompt rows"
    firsts = {s.output_token_ids[0]: row(s, prompt_len) for s in forks}
    rows = list(firsts.values())
    assert len(rows) > 1 and all((a != b).any() for i, a in enumerate(rows) for b in rows[i + 1:])
    while engine.has_unfinished():
        engine.step()
