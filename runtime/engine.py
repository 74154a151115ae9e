"""The engine (schedule -> run the bucket graph -> sample -> detokenize, one step at a time) and the `LLM` API."""
from __future__ import annotations

import itertools
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence as Seq

import numpy as np

from ..artifact.manifest import Manifest
from ..graphs.contract import DECODE, PREFILL
from .constraints import Constraint
from .deploy_config import EngineConfig
from .kv_cache_manager import CacheStats, KVCacheManager
from .kv_pools import KVPools
from .logits_processors import Penalties
from .model_runner import GraphError, ModelRunner, RunStats, step_limits
from .output_processor import CompletionOutput, OutputProcessor, RequestMetrics, RequestOutput
from .progress import RequestProgress
from .sampler import Sampler
from .sampling_params import (CONTEXT_LENGTH_EXCEEDED, DEFAULT_MAX_TOKENS, RequestError, SamplingParams,
                              resolve_max_tokens)
from .scheduler import ScheduledBatch, Scheduler, Sequence, SequenceStatus
from .spec.build import Target, speculator_for
from .structured_output import GrammarCompiler, StructuredOutputs
from .tokenizer import Prompt, PromptEncoder, Tokenizer


@dataclass(frozen=True)
class RuntimeInfo:
    """What runs a model: reported by `LLM.runtime_info` and the server's /v1/models and /version."""

    executor: str  # "onnxruntime" or "mindspore"
    custom_ops: bool  # the fused ops run as pagedgraph's C++ kernels (MindSpore's MINDIR graphs always call them)
    custom_ops_setting: str  # what was asked for: auto, on or off (auto may have fallen back)
    dtype: str  # weights and activations, from the artifact's manifest
    kv_cache_dtype: str
    quantization: str | None  # None: unquantized weights
    weight_formats: dict[str, int] = field(default_factory=dict)  # checkpoint tensors per stored form (manifest)
    # Why greedy output may depend on the batch, chunking or prefix hits; None: it does not (docs/performance.md,
    # "Batch invariance": the fused ops' C++ kernels and scheduler.batch_invariant together make it so).
    batch_variance: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class EngineStats(RunStats):
    """Cumulative counters for metrics and benchmarks: the runner's (steps, graph time, gears hit) and the engine's."""

    host_s: float = 0.0
    generated: int = 0
    cache: CacheStats = field(default_factory=CacheStats)  # live KV counters: hit rate, evictions
    load_s: float = 0.0  # building the engine: manifest, tokenizer, KV pool, the executor's session


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine's state in one call (`LLMEngine.snapshot`, on the engine's thread): what the server's /metrics
    reads, so it never reaches into the engine's parts."""

    running: int
    waiting: int
    kv_blocks_total: int  # the null block excluded
    kv_blocks_free: int  # evictable prefix-cache blocks included
    kv_blocks_cached: int  # registered in the prefix cache, used or evictable
    steps: int
    graph_s: float
    host_s: float
    tokens_computed: int
    tokens_real: int
    generated: int
    preemptions: int
    prefix_queries: int  # prompt tokens looked up in the prefix cache
    prefix_hits: int
    bucket_hits: dict[str, int] = field(default_factory=dict)
    processor_s: dict[str, float] = field(default_factory=dict)  # seconds per logits processor of the sampler
    kv_bytes_per_block: int = 0  # K and V of every layer for one block, in the pools' dtype
    spec_decode: dict[str, Any] | None = None  # SpecDecodeStats.to_dict(); None: no speculative decoding


class LLMEngine:
    """Requests in, outputs out, one step at a time: the scheduler picks what runs, the model runner runs its gear,
    the sampler (or a speculative verification) picks tokens, the output processor appends them."""

    def __init__(self, artifact: str | Path, config: EngineConfig = EngineConfig()) -> None:
        start = time.perf_counter()
        self.artifact = Path(artifact)
        self.manifest = Manifest.load(self.artifact)
        if config.gears is not None:
            self.manifest = replace(self.manifest, families={name: replace(f, gears=tuple(config.gears[name]))
                                                             for name, f in self.manifest.families.items()})
        self.model = self.manifest.model
        self.tokenizer = Tokenizer.from_dir(self.artifact)
        self.max_model_len = min(config.max_model_len or self.manifest.max_model_len, self.manifest.max_model_len)
        self.prompts = PromptEncoder(self.tokenizer, self.max_model_len)
        self.max_num_seqs, self.max_num_batched_tokens, self.max_logits_rows = step_limits(
            self.manifest, config.max_num_seqs, config.max_num_batched_tokens)
        if not config.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(f"enable_chunked_prefill = false needs max_num_batched_tokens >= max_model_len, but "
                             f"max_num_batched_tokens is {self.max_num_batched_tokens} (clamped to the largest "
                             f"prefill gear) and max_model_len {self.max_model_len}: lower max_model_len, or "
                             f"enable chunked prefill")
        self.kv_cache_dtype = self.manifest.kv_cache_dtype(config.kv_cache_dtype, self.artifact)
        pools = KVPools.sized(self.artifact, self.manifest, self.kv_cache_dtype, self.max_model_len, self.max_num_seqs,
                              config.num_blocks, config.kv_cache_bytes)
        self.stats = EngineStats()
        self.runner = ModelRunner(self.artifact, self.manifest, pools, config.executor, config.threads,
                                  config.custom_ops, config.batch_invariant, self.stats)
        self.kv = KVCacheManager.for_pools(pools, config.enable_prefix_caching, config.prefix_cache_salt)
        self.stats.cache = self.kv.stats
        self.scheduler = Scheduler(self.kv, self.max_num_seqs, self.max_num_batched_tokens,
                                   config.long_prefill_token_threshold, config.enable_chunked_prefill,
                                   self.max_logits_rows, config.batch_invariant)
        self.custom_ops_setting = config.custom_ops
        self._wire_sampling(config)
        self._groups: dict[str, list[Sequence]] = {}  # request id -> its sequences: the first, then its forks
        self._ids = itertools.count()
        self.stats.load_s = time.perf_counter() - start

    def _wire_sampling(self, config: EngineConfig) -> None:
        """The sampler with its logits processors, the output processor, the defaults and the speculator."""
        vocab = self.model.vocab_size
        self.sampler = Sampler(vocab, [Penalties(vocab, self.tokenizer.eos_token_ids)])
        self.structured = StructuredOutputs(GrammarCompiler(self.tokenizer, vocab))
        self.sampler.add(self.structured)
        self.outputs = OutputProcessor(self.tokenizer, self.max_model_len, self.structured)
        # What a request without SamplingParams gets: the model's generation defaults (manifest), else ours.
        self.default_params = SamplingParams.from_defaults(self.manifest.sampling_defaults)
        target = Target(self.artifact, self.manifest, self.max_model_len, self.max_logits_rows, self.tokenizer,
                        self.runner, self.kv, self.structured,
                        lambda seq: not self.sampler.wants(seq, ignoring=self.structured))
        self.speculator = speculator_for(config, target)

    # -- requests ---------------------------------------------------------------------------
    def new_request_id(self) -> str:
        """The one request-id minter (the server's too); safe from any thread: `next` on a count is atomic."""
        return f"req-{next(self._ids)}"

    def compile_grammar(self, constraint: Constraint) -> None:
        """Compile a request's constraint ahead of `add_request`, which then finds it cached; thread-safe, so the
        server compiles on its tokenizer thread (a bad one raises RequestError, a large one never stalls a step)."""
        self.structured.compiler.compile(constraint)

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, arrival: float | None = None,
                    default_max_tokens: int = DEFAULT_MAX_TOKENS) -> Sequence:
        """Check and queue a request: the one place it is checked; raises RequestError (nothing queued).

        `params.max_tokens` None is `default_max_tokens` (a deployment's sampling.max_tokens) capped to the
        context left after the prompt; a max_tokens that was given and does not fit is refused.
        """
        if isinstance(prompt_token_ids, (str, Mapping)):
            raise TypeError("add_request takes token ids; turn text or chat messages into them with "
                            "engine.prompts.token_ids(prompt)")
        params = params or self.default_params
        ids, limit = prompt_token_ids, self.max_model_len
        if not ids:
            raise RequestError("prompt", "is empty")
        if any(not isinstance(t, int) or not 0 <= t < self.model.vocab_size for t in ids):
            raise RequestError("prompt_token_ids", f"token ids must be integers in [0, {self.model.vocab_size})")
        params.check_vocab(self.model.vocab_size)
        if len(ids) >= limit:
            raise RequestError("prompt", f"the prompt is {len(ids)} tokens; this model's max_model_len is {limit}, "
                                         f"so prompts must be at most {limit - 1} tokens", CONTEXT_LENGTH_EXCEEDED)
        # Within max_model_len, so it fits the pool alone (checked at start) and preemption can never deadlock.
        params = replace(params, max_tokens=resolve_max_tokens(params.max_tokens, len(ids), limit, default_max_tokens))
        if params.prompt_logprobs is not None and not self.scheduler.chunked_prefill \
                and len(ids) > self.max_logits_rows:
            raise RequestError("prompt_logprobs", f"a {len(ids)}-token prompt needs as many logits rows in one step "
                                                  f"without chunked prefill, but the gears return at most "
                                                  f"{self.max_logits_rows}; enable chunked prefill or shorten it")
        request_id = request_id or self.new_request_id()
        if request_id in self._groups:
            raise RequestError("request_id", f"{request_id!r} is already in flight")
        seq = Sequence(request_id, list(ids), params, arrival if arrival is not None else time.perf_counter())
        if params.structured_outputs is not None:  # compiled (or found cached) here: a bad one queues nothing
            self.structured.start(seq)
        self._groups[request_id] = [seq]
        self.scheduler.add(seq)
        return seq

    def abort(self, request_id: str) -> None:
        for seq in self._groups.get(request_id, []):
            if not seq.finished:
                self._finish(seq, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # -- the loop ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one bucket graph; returns the requests that progressed (finished ones included)."""
        start, graph_s = time.perf_counter(), self.stats.graph_s
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        batch = self.scheduler.schedule()
        if self.speculator is not None:
            self.speculator.scheduled(batch)
        if batch is None:
            return []
        try:
            logits = self.runner.run(batch)
        except GraphError as exc:  # a failed step fails its own requests only
            outputs = self._fail(batch, f"graph execution failed: {exc}")
        else:
            outputs = self._postprocess(batch, logits, start)
        self.stats.host_s += time.perf_counter() - start - (self.stats.graph_s - graph_s)
        return outputs

    def _fail(self, batch: ScheduledBatch, error: str) -> list[RequestOutput]:
        groups = {s.request_id: self._groups[s.request_id] for s in batch.seqs}
        for seq in batch.seqs:
            seq.error = error
            self._finish(seq, "error")
        return [self.outputs.output(g) for g in groups.values()]

    def _postprocess(self, batch: ScheduledBatch, logits: np.ndarray, start: float) -> list[RequestOutput]:
        rows, ready = [], []
        groups: dict[str, list[Sequence]] = {}
        in_order = True  # rows == 0, 1, 2, ...: every row sampled once, in order (decode steps)
        extra = len(batch.seqs)  # the per-token rows (prompt logprobs, drafts) follow the per-sequence rows
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_tokens)):
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = start
            if seq.num_draft_tokens:
                groups[seq.request_id] = self._groups[seq.request_id]  # before a finish can drop it
                self._verify(seq, logits, [extra + j for j in range(n - 1)] + [i])
                extra += n - 1
                in_order = False
                continue
            if seq.wants_prompt_logprobs:
                self.outputs.prompt_logprobs(seq, n, logits, i, extra)
                extra += n - 1
            seq.num_computed_tokens += n
            if seq.num_computed_tokens == seq.num_tokens:
                for s in self._fork(seq):
                    in_order = in_order and i == len(rows)
                    rows.append(i)
                    ready.append(s)
        if ready:
            # In order, a view instead of a per-step copy of B x vocab floats (docs/performance.md, "Kernel and graph
            # choices").
            sampled = logits[:len(rows)] if in_order else logits[rows]
            for row, seq, token in zip(sampled, ready, self.sampler.sample(sampled, ready)):
                groups[seq.request_id] = self._groups[seq.request_id]
                self._append(seq, token, row)
        return [self.outputs.output(g) for g in groups.values()]

    def _verify(self, seq: Sequence, logits: np.ndarray, picks: list[int]) -> None:
        """Keep the drafts the target agrees with (runtime/spec): `picks` are the logits rows of the fed tokens."""
        assert self.speculator is not None
        rows = self.speculator.rows(logits, picks)
        tokens = self.speculator.verify(seq, rows)
        self.kv.rollback(seq, seq.num_computed_tokens + len(tokens))  # the fed token and the kept drafts
        for row, token in zip(rows, tokens):
            # The tokens so far have their K/V: register the blocks they fill, as a plain run's steps would have.
            self.kv.cache_blocks(seq, seq.num_tokens)
            self.speculator.emitted(seq, token)
            self._append(seq, token, row)
            if seq.finished:
                return

    def _fork(self, seq: Sequence) -> list[Sequence]:
        """`seq`, plus its n - 1 forks when its prompt has just been computed for the first time.

        Forks share every block (copy-on-write on the first write into a shared partial block) and
        sample from the same logits row, each with its own generator spawned from the request's seed.
        """
        group = self._groups[seq.request_id]
        n = seq.params.n
        if len(group) == n:
            return [seq]
        rngs = seq.rng.spawn(n - 1) if seq.rng is not None else [None] * (n - 1)
        for rng in rngs:
            child = Sequence(seq.request_id, seq.prompt_token_ids, seq.params, seq.arrival,
                             token_ids=list(seq.token_ids), num_cached_tokens=seq.num_cached_tokens, rng=rng,
                             prompt_logprobs=seq.prompt_logprobs, first_scheduled_time=seq.first_scheduled_time)
            self.scheduler.fork(seq, child)
            group.append(child)
        return group

    def _append(self, seq: Sequence, token: int, row: np.ndarray) -> None:
        self.stats.generated += 1
        reason = self.outputs.append(seq, token, row)
        if reason is not None:
            self._finish(seq, reason)

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.outputs.finish(seq, reason)
        seq.drop_drafts()
        if self.speculator is not None:
            self.speculator.release(seq)
        self.scheduler.finish(seq, keep_cached=reason != "error")
        if all(s.finished for s in self._groups[seq.request_id]):
            del self._groups[seq.request_id]

    # -- what the engine reports ------------------------------------------------------------
    def snapshot(self) -> EngineSnapshot:
        """Counters and the KV pool's state now (call it on the engine's thread)."""
        stats, cache, kv, scheduler = self.stats, self.stats.cache, self.kv.usage(), self.scheduler
        return EngineSnapshot(scheduler.num_running, scheduler.num_waiting, kv.total, kv.free, kv.cached,
                              stats.steps, stats.graph_s, stats.host_s, stats.tokens_computed, stats.tokens_real,
                              stats.generated, scheduler.num_preemptions, cache.queries, cache.hits,
                              dict(stats.bucket_hits), dict(self.sampler.seconds), self.runner.pools.bytes_per_block,
                              self.speculator.stats.to_dict() if self.speculator is not None else None)

    def describe(self) -> list[str]:
        """What was loaded, in words (the server logs it): the gears served, the KV pool, the scheduler limits."""
        prefill, decode = self.runner.gears[PREFILL], self.runner.gears[DECODE]
        pools = self.runner.pools
        return [f"buckets: prefill T={sorted({g.tokens for g in prefill})} (B<={max(g.seqs for g in prefill)}), "
                f"decode B={sorted({g.seqs for g in decode})}, context M={sorted({g.blocks for g in prefill + decode})}"
                f"; {len(prefill)} prefill + {len(decode)} decode gears",
                f"KV pool: {pools.num_blocks} blocks x {pools.block_size} tokens = {pools.num_slots} token slots, "
                f"{pools.nbytes / 2**20:.1f} MiB of {pools.kv_cache_dtype} ({pools.bytes_per_block} bytes per block)",
                f"scheduler: max_num_seqs {self.max_num_seqs}, max_num_batched_tokens {self.max_num_batched_tokens}, "
                f"max_model_len {self.max_model_len} (limits clamped to the gears)"]

    def runtime_info(self) -> RuntimeInfo:
        """The executor, whether the custom kernels run, and the precision (weights, KV cache)."""
        custom = self.runner.executor.custom_ops
        variance = "scheduler.batch_invariant is false" if not self.scheduler.batch_invariant \
            else self.runner.batch_variance()
        return RuntimeInfo(executor=self.runner.executor_name, custom_ops=True if custom is None else bool(custom),
                           custom_ops_setting=self.custom_ops_setting, dtype=self.manifest.dtype,
                           kv_cache_dtype=self.kv_cache_dtype,
                           quantization=None if self.manifest.quantization == "none" else self.manifest.quantization,
                           weight_formats=dict(self.manifest.weight_formats), batch_variance=variance)


class LLM:
    """Offline batch generation: every prompt is served together by the continuous-batching engine."""

    def __init__(self, artifact: str | Path, **config: Any) -> None:
        self.engine = LLMEngine(artifact, EngineConfig(**config))

    @property
    def runtime_info(self) -> RuntimeInfo:
        """Which executor and kernels serve this model, at which precision."""
        return self.engine.runtime_info()

    def generate(self, prompts: Prompt | Iterable[Prompt],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 progress: bool = False) -> list[RequestOutput]:
        """One output per prompt, in order; a prompt that cannot be served gets `error` set, the rest still run."""
        if isinstance(prompts, (str, Mapping)) or (isinstance(prompts, Seq) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        params = (sampling_params if isinstance(sampling_params, Seq)
                  else [sampling_params or self.engine.default_params] * len(prompts))
        results: dict[int, RequestOutput] = {}
        index: dict[str, int] = {}
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            try:
                index[self.engine.add_request(self.engine.prompts.token_ids(prompt), p).request_id] = i
            except RequestError as exc:
                results[i] = RequestOutput(f"rejected-{i}", [], [], "", "error", error=str(exc))
        shown = RequestProgress(len(prompts)) if progress else None
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.finished:
                    results[index[out.request_id]] = out
            if shown is not None:
                shown.update(len(results))
        if shown is not None:
            shown.update(len(results))
            shown.close()
        return [results[i] for i in range(len(prompts))]


__all__ = ["CompletionOutput", "EngineConfig", "EngineSnapshot", "LLM", "LLMEngine", "RequestMetrics", "RequestOutput",
           "RuntimeInfo", "SequenceStatus"]
