"""Small fixed experiments beside the workload: decode step time vs context, decode tok/s vs concurrency."""
from __future__ import annotations

import json
import statistics
import time

import numpy as np

from .metrics import RunRecord
from .runner import bench_params, run_engine
from .workloads import FIRST_PLAIN_TOKEN, BenchRequest
from ..constraints import Constraint
from ..engine import LLMEngine
from ..sampling_params import SamplingParams

# An endless JSON array of records (no closing bracket, so no sequence finishes while it is timed): keys,
# enums, strings, integers and nesting, the mask states a JSON-schema request walks through.
RECORD = {"type": "object", "additionalProperties": False, "required": ["name", "age", "role", "tags", "address"],
          "properties": {"name": {"type": "string", "maxLength": 16}, "age": {"type": "integer", "maximum": 130},
                         "role": {"enum": ["admin", "user", "guest"]},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
                         "address": {"type": "object", "additionalProperties": False, "required": ["city"],
                                     "properties": {"city": {"type": "string", "maxLength": 20}}}}}
ENDLESS_RECORDS = Constraint("lark", f'start: "[" record (", " record)*\nrecord: %json {json.dumps(RECORD)}\n', "bench")


def random_requests(vocab_size: int, count: int, prompt_tokens: int, max_tokens: int, seed: int) -> list[BenchRequest]:
    """Distinct random prompts (no prefix-cache hits between them), all at t=0."""
    rng = np.random.default_rng(seed)
    return [BenchRequest(rng.integers(FIRST_PLAIN_TOKEN, vocab_size, prompt_tokens).tolist(), max_tokens)
            for _ in range(count)]


def engine_decode_step_s(engine: LLMEngine, contexts: list[int], steps: int = 8, seed: int = 0) -> float:
    """Fastest of `steps` decode steps of one sequence per entry of `contexts` (tokens held), all decoding.

    The minimum, not the median: when other processes take the cores, it is the step they disturbed least.
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


def structured_output_cost(engine: LLMEngine, batch: int, steps: int = 24, seed: int = 0) -> dict[str, float]:
    """Median decode step of `batch` sequences constrained by a JSON grammar, the part of it spent on their
    masks (the sampler's structured_output seconds), and the same batch unconstrained."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(FIRST_PLAIN_TOKEN, engine.model.vocab_size, 32).tolist() for _ in range(batch)]
    out: dict[str, float] = {}
    for name, constraint in (("constrained", ENDLESS_RECORDS), ("unconstrained", None)):
        params = SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True, structured_outputs=constraint)
        ids = [engine.add_request(p, params, f"structured-{name}-{i}").request_id for i, p in enumerate(prompts)]
        while sum(1 for s in engine.scheduler.running if s.output_token_ids) < batch:
            engine.step()
        step_s, mask_s = [], []
        for _ in range(steps):
            masks_before, start = engine.sampler.seconds.get("structured_output", 0.0), time.perf_counter()
            engine.step()
            step_s.append(time.perf_counter() - start)
            mask_s.append(engine.sampler.seconds.get("structured_output", 0.0) - masks_before)
        for request_id in ids:
            engine.abort(request_id)
        out[f"{name}_step_s"] = statistics.median(step_s)
        if constraint is not None:
            out["mask_s_per_step"] = statistics.median(mask_s)
    out["mask_over_step"] = out["mask_s_per_step"] / out["constrained_step_s"]
    return out


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
