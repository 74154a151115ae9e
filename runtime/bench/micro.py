"""Small fixed experiments beside the workload: decode step time vs context, decode tok/s vs concurrency."""
from __future__ import annotations

import time

import numpy as np

from runtime.bench.metrics import RunRecord
from runtime.bench.runner import bench_params, run_engine
from runtime.bench.workloads import FIRST_PLAIN_TOKEN, BenchRequest
from runtime.engine import LLMEngine


def random_requests(vocab_size: int, count: int, prompt_tokens: int, max_tokens: int, seed: int) -> list[BenchRequest]:
    """Distinct random prompts (no prefix-cache hits between them), all at t=0."""
    rng = np.random.default_rng(seed)
    return [BenchRequest(rng.integers(FIRST_PLAIN_TOKEN, vocab_size, prompt_tokens).tolist(), max_tokens)
            for _ in range(count)]


def engine_decode_step_s(engine: LLMEngine, contexts: list[int], steps: int = 8, seed: int = 0) -> float:
    """Fastest of `steps` decode steps of one sequence per entry of `contexts` (tokens held), all decoding.

    The minimum, not the median: on a shared machine it is the step least disturbed by other load.
    Outputs are long enough that no sequence finishes (shrinking the batch) before the timed steps end.
    """
    rng = np.random.default_rng(seed)
    prefill_steps = -(-sum(contexts) // engine.max_num_batched_tokens) + len(contexts)
    ids = [f"decode-{i}" for i in range(len(contexts))]
    for request_id, context in zip(ids, contexts):
        prompt = rng.integers(FIRST_PLAIN_TOKEN, engine.model.vocab_size, context - 1).tolist()
        engine.add_request(prompt, bench_params(steps + prefill_steps), request_id)
    first_tokens = 0
    while first_tokens < len(contexts):  # prefill, possibly in several chunks beside early decodes
        first_tokens += sum(1 for out in engine.step() if len(out.token_ids) == 1)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    for request_id in ids:
        engine.abort(request_id)
    return min(times)


def decode_tok_s(record: RunRecord) -> float:
    """Tokens generated after every request had its first token, per second of that decode phase."""
    times = [t for t in record.timeline.token_times.values() if t]
    start, end = max(t[0] for t in times), max(t[-1] for t in times)
    decoded = sum(1 for ts in times for t in ts if t > start)
    return decoded / (end - start) if end > start else 0.0


def engine_concurrency(engine: LLMEngine, counts: tuple[int, ...], prompt_tokens: int, max_tokens: int,
                       seed: int = 0) -> dict[str, float]:
    """Decode tok/s with 1, 4, ... requests served together (short prompts, `max_tokens` outputs each)."""
    vocab = engine.model.vocab_size
    return {str(n): decode_tok_s(run_engine(engine, random_requests(vocab, n, prompt_tokens, max_tokens, seed)))
            for n in counts}
