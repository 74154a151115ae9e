"""Drives an LLMEngine through a workload in real time: requests join at their arrival times."""
from __future__ import annotations

import time
from collections import deque
from dataclasses import replace

from .metrics import RunRecord
from .workloads import BenchRequest
from ..engine import LLMEngine
from ..sampling_params import SamplingParams

_COUNTERS = ("steps", "host_s", "graph_s", "tokens_computed", "tokens_real")  # EngineStats fields read as deltas


def bench_params(max_tokens: int) -> SamplingParams:
    """Greedy with EOS ignored, so every engine computes exactly the same number of tokens."""
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def warm_up(engine: LLMEngine) -> None:
    """One short request, so session start-up is not billed to the first measured step."""
    engine.add_request(list(range(100, 108)), bench_params(2), request_id="bench-warmup")
    while engine.has_unfinished():
        engine.step()


def run_engine(engine: LLMEngine, requests: list[BenchRequest]) -> RunRecord:
    """Serve `requests` (arrival_s after the start) and measure; the engine's counters are read as deltas."""
    stats, cache = engine.stats, engine.stats.cache
    counters_before = {name: getattr(stats, name) for name in _COUNTERS}
    hits_before, cache_before = dict(stats.bucket_hits), replace(cache)
    preemptions_before = engine.scheduler.num_preemptions
    spec = engine.speculator
    spec_before = spec.stats.to_dict() if spec is not None else None
    record = RunRecord(requests=len(requests), prompt_tokens=sum(len(r.prompt_token_ids) for r in requests),
                       output_tokens=sum(r.max_tokens for r in requests))
    timeline, seen = record.timeline, {}
    pending = deque(sorted(range(len(requests)), key=lambda i: requests[i].arrival_s))
    block_size = engine.kv.block_size
    start, cpu_start = time.perf_counter(), time.process_time()
    while pending or engine.has_unfinished():
        now = time.perf_counter()
        while pending and start + requests[pending[0]].arrival_s <= now:
            index = pending.popleft()
            request, request_id, arrival = requests[index], f"bench-{index}", start + requests[index].arrival_s
            engine.add_request(request.prompt_token_ids, bench_params(request.max_tokens), request_id, arrival)
            timeline.arrive(request_id, arrival)
            seen[request_id] = 0
        if not engine.has_unfinished():
            time.sleep(max(0.0, start + requests[pending[0]].arrival_s - time.perf_counter()))
            continue
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            if out.error:
                raise RuntimeError(f"benchmark request {out.request_id} failed: {out.error}")
            timeline.tokens(out.request_id, len(out.token_ids) - seen[out.request_id], now)
            seen[out.request_id] = len(out.token_ids)
            if out.finished:
                record.outputs[out.request_id] = list(out.token_ids)
        blocks = [len(s.block_table) for s in engine.scheduler.running]
        record.sample_kv(sum(s.num_computed_tokens for s in engine.scheduler.running), sum(blocks) * block_size)
        # Attention reads every sequence's context padded to the longest (before rounding up to an M gear).
        record.sample_context(sum(blocks), len(blocks) * max(blocks, default=0))
    record.wall_s, record.cpu_s = time.perf_counter() - start, time.process_time() - cpu_start
    for name, value in counters_before.items():
        setattr(record, name, getattr(stats, name) - value)
    record.bucket_hits = {k: v - hits_before.get(k, 0) for k, v in stats.bucket_hits.items()
                          if v > hits_before.get(k, 0)}
    queries = cache.queries - cache_before.queries
    record.extra = {"prefix_hit_rate": (cache.hits - cache_before.hits) / queries if queries else 0.0,
                    "preemptions": engine.scheduler.num_preemptions - preemptions_before}
    if spec is not None and spec_before is not None:
        record.extra["spec_decode"] = {**spec.stats.since(spec_before), "proposal_cost": spec.proposer.cost}
    return record
