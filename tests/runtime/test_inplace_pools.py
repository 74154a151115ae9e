"""The KV pools are written in place: same buffer every step, and no full-pool copy per step.

A copy shows up as step time growing with the pool: here the large pool (256 MiB) is 2048x the small one,
so a per-step copy would cost ~100x a step of the tiny model; the ratio bound is loose on purpose.
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from pagedgraph.graphs.contract import NULL_BLOCK
from pagedgraph.runtime.engine import EngineConfig, LLMEngine
from pagedgraph.runtime.sampling_params import SamplingParams

pytestmark = pytest.mark.unit


def _decode_seconds(artifact: Path, num_blocks: int) -> tuple[float, LLMEngine]:
    engine = LLMEngine(artifact, EngineConfig(num_blocks=num_blocks, threads=1))
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    for prompt in ([1, 2, 3], [4, 5, 6, 7], [8], [9, 10]):
        engine.add_request(prompt, params)
    engine.step()  # prefill
    addresses = {name: pool.ctypes.data for name, pool in engine.runner.executor.pools.items()}
    start = time.perf_counter()
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    elapsed = (time.perf_counter() - start) / steps
    assert {name: pool.ctypes.data for name, pool in engine.runner.executor.pools.items()} == addresses
    return elapsed, engine


def test_pools_written_in_place(tiny_artifact: Path) -> None:
    engine = LLMEngine(tiny_artifact, EngineConfig(num_blocks=9))
    seq = engine.add_request([3, 1, 4, 1, 5], SamplingParams(max_tokens=2, temperature=0))
    engine.step()
    block, size = seq.block_table[0], engine.manifest.block_size
    assert block != NULL_BLOCK
    pool = engine.runner.executor.pools["k_cache_0"]
    prompt_rows = set(range(block * size, block * size + 5))
    written = set(np.flatnonzero(np.abs(pool).sum(axis=1)).tolist())
    assert prompt_rows <= written, "ORT did not write this step's keys into our pool buffer"
    null_block = set(range(NULL_BLOCK * size, (NULL_BLOCK + 1) * size))  # padding tokens write there
    assert written - prompt_rows <= null_block, f"rows outside the prompt's slots were written: {sorted(written)}"


def test_step_time_does_not_grow_with_pool_size(tiny_artifact: Path) -> None:
    small, _ = _decode_seconds(tiny_artifact, num_blocks=16)
    large, engine = _decode_seconds(tiny_artifact, num_blocks=32768)
    pool_mib = engine.runner.pools.nbytes / 2**20
    assert pool_mib >= 256
    assert large < 3 * small + 0.002, f"decode step {large * 1e3:.2f} ms with a {pool_mib:.0f} MiB pool vs {small * 1e3:.2f} ms"
