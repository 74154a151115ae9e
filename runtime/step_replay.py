"""Replays a trace through the engine's own scheduler, KV cache manager and packer, without running a graph.

What each step asks of its gear (`StepShape`: family, packed tokens, sequences, blocks) follows from the
scheduler's limits and the requests alone: the gears in between the largest never change what is scheduled.
So one replay gives every step of a trace, and any ladder's padding is then exact arithmetic over those steps
(`padding`), the same arithmetic the engine's `stats.tokens_computed` adds up when it serves the trace: what
`pagedgraph bench --workload trace` measures as `padding_waste`.

The replay serves the trace the way the bench does: every request waiting at t=0, greedy, exactly
`completion_tokens` each (EOS ignored), prompts with no prefix in common, no speculative decoding.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Iterable, Mapping

from ..artifact.settings import default
from ..graphs.contract import Gear
from .deploy_config import Deployment
from .kv_cache_manager import KVCacheManager
from .kv_pools import PoolRequest
from .model_runner import GearSelector, StepShape, step_shape
from .sampling_params import SamplingParams
from .scheduler import Scheduler, Sequence
from .traffic import TraceRequest


@dataclass(frozen=True)
class ServeLimits:
    """The deployment settings that decide what a step holds (the `scheduler` and `kv_cache` sections), with the
    deployment schema's defaults."""

    max_model_len: int
    block_size: int
    max_num_seqs: int = default(Deployment, "scheduler.max_num_seqs")
    max_num_batched_tokens: int = default(Deployment, "scheduler.max_num_batched_tokens")
    long_prefill_token_threshold: int | None = default(Deployment, "scheduler.long_prefill_token_threshold")
    enable_chunked_prefill: bool = default(Deployment, "scheduler.enable_chunked_prefill")
    batch_invariant: bool = default(Deployment, "scheduler.batch_invariant")
    enable_prefix_caching: bool = default(Deployment, "kv_cache.enable_prefix_caching")
    # None: the engine's when memory allows, every sequence at full length
    num_blocks: int | None = default(Deployment, "kv_cache.num_blocks")


@dataclass(frozen=True)
class Padding:
    """A ladder's cost on a replayed trace: tokens the graphs compute against real ones, per family."""

    real: Mapping[str, int]
    computed: Mapping[str, int]
    steps: Mapping[str, int]
    hits: Mapping[str, int]  # steps per gear, by `Gear.label` (the engine's bucket_hits)
    real_blocks: int = 0  # blocks of each step's longest block table, summed over the steps ...
    computed_blocks: int = 0  # ... and of the gears that ran them (M): what an attention over the gear's M reads

    @property
    def waste(self) -> float:
        """Computed tokens / real tokens - 1: the bench's `padding_waste`."""
        return sum(self.computed.values()) / sum(self.real.values()) - 1

    @property
    def context_waste(self) -> float:
        return self.computed_blocks / self.real_blocks - 1 if self.real_blocks else 0.0

    def family_waste(self, family: str) -> float:
        return self.computed[family] / self.real[family] - 1 if self.real.get(family) else 0.0


def replay(requests: Iterable[TraceRequest], gears: Mapping[str, Iterable[Gear]], limits: ServeLimits,
           block_quantized: bool = False) -> list[StepShape]:
    """Every step the engine takes to serve `requests` on an artifact with these gears (only their largest matter:
    they clamp the scheduler's limits, as in the engine), in order."""
    selector = GearSelector(gears, limits.batch_invariant and block_quantized)
    max_seqs, max_tokens, max_rows = selector.fit_limits(limits.max_num_seqs, limits.max_num_batched_tokens)
    num_blocks = limits.num_blocks or PoolRequest(0, limits.block_size, limits.max_model_len, max_seqs).full_blocks
    kv = KVCacheManager(num_blocks, limits.block_size, limits.enable_prefix_caching)
    scheduler = Scheduler(kv, max_seqs, max_tokens, limits.long_prefill_token_threshold,
                          limits.enable_chunked_prefill, max_rows, limits.batch_invariant)
    for i, request in enumerate(requests):
        # One token id per request: no two prompts share a block, as with the bench's random prompts.
        params = SamplingParams(max_tokens=request.completion_tokens, temperature=0.0, ignore_eos=True)
        scheduler.add(Sequence(f"trace-{i}", [i] * request.prompt_tokens, params, 0.0))
    steps = []
    while scheduler.has_work():
        batch = scheduler.schedule()
        if batch is None:
            raise RuntimeError("the replay scheduled nothing while requests wait: the KV pool holds too few blocks "
                               "for one request (kv_cache.num_blocks)")
        steps.append(step_shape(batch, limits.batch_invariant))
        for seq, n in zip(batch.seqs, batch.num_tokens):  # the engine's postprocessing, one sampled token each
            seq.num_computed_tokens += n
            if seq.num_computed_tokens < seq.num_tokens:
                continue
            seq.token_ids.append(seq.token_ids[-1])
            if seq.num_tokens - seq.num_prompt_tokens >= seq.params.max_tokens or seq.num_tokens >= limits.max_model_len:
                scheduler.finish(seq)
    return steps


def padding(steps: Iterable[StepShape], gears: Mapping[str, Iterable[Gear]], even_gears: bool = False) -> Padding:
    """What the packer computes for `steps` with these gears: the smallest gear holding each step."""
    selector = GearSelector(gears, even_gears)
    real: Counter[str] = Counter()
    computed: Counter[str] = Counter()
    count: Counter[str] = Counter()
    hits: Counter[str] = Counter()
    real_blocks = computed_blocks = 0
    for step in steps:
        family, gear = selector.fit(step)
        real[family] += step.tokens
        computed[family] += gear.tokens
        count[family] += 1
        hits[gear.label(family)] += 1
        real_blocks += step.blocks
        computed_blocks += gear.blocks
    return Padding(dict(real), dict(computed), dict(count), dict(hits), real_blocks, computed_blocks)
