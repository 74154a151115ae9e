"""The engine loop (schedule -> pack -> run the bucket graph -> sample -> detokenize) and the `LLM` API."""
from __future__ import annotations

import itertools
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence as Seq

from ..artifact.manifest import Manifest
from ..graphs.contract import Gear
from ..graphs.kv_cache import cache_format
from .block_pool import CacheStats
from .executors import CustomOps, check_custom_ops, make_executor
from .kv_cache_manager import KVCacheManager, SharedKV
from .kv_pools import KVPools, PoolRequest, bytes_per_block, pool_blocks, weights_bytes
from .packer import Packer
from .logits_processors import Penalties
from .progress import RequestProgress
from .prompt_logprobs import PromptLogprobs, prompt_logprob_entries
from .sampler import Sampler, top_logprobs
from .sampling_params import (CONTEXT_LENGTH_EXCEEDED, DEFAULT_MAX_TOKENS, RequestError, SamplingParams,
                                     resolve_max_tokens)
from .scheduler import Scheduler
from .sequence import Sequence, SequenceStatus
from .spec.build import speculator_for
from .spec.config import SpeculativeConfig, speculative_config
from .structured_output import GrammarCompiler, StructuredOutputs
from .tokenizer import IncrementalDetokenizer, Prompt, PromptEncoder, Tokenizer


@dataclass(frozen=True)
class EngineConfig:
    # The KV pool's size: num_blocks wins over kv_cache_bytes; neither: sized from the model and the free memory
    # (runtime/kv_pools.py, pool_blocks). Too small for one max_model_len sequence is an error at start.
    num_blocks: int | None = None
    kv_cache_bytes: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # default: the artifact's
    threads: int | None = None
    gears: Mapping[str, Seq[Gear]] | None = None  # serve a subset of the exported gears (deployment buckets)
    enable_prefix_caching: bool = True
    prefix_cache_salt: str = ""  # mixed into every block hash: deployments with different salts share no blocks
    long_prefill_token_threshold: int | None = None  # cap on one prompt's chunk per step (see Scheduler)
    enable_chunked_prefill: bool = True  # false: every prompt in one step (needs max_num_batched_tokens >= max_model_len)
    # Greedy output independent of what else runs (Scheduler and Packer; docs/performance.md, "Batch invariance").
    batch_invariant: bool = True
    executor: str = "onnxruntime"  # or "mindspore": the artifact's CPU MINDIR graphs (runtime/executors.py)
    # ONNX Runtime only: the fused ops as pagedgraph's C++ custom ops; "auto" falls back (one warning) when they
    # cannot be built, "on" raises instead, "off" runs their ONNX function bodies. MindSpore ignores it: its
    # MINDIR graphs call pagedgraph's kernels themselves.
    custom_ops: CustomOps = "auto"
    # What the KV pools hold: "auto" (the artifact's compute dtype), float32, bfloat16, float16 or int8; the
    # artifact must have that dtype's graphs (export.kv_cache_dtypes). Pool sizing follows its bytes per block.
    kv_cache_dtype: str = "auto"
    # vLLM's speculative_config (runtime/spec/config.py): a SpeculativeConfig, or its keys as a mapping or JSON.
    speculative_config: SpeculativeConfig | Mapping[str, Any] | str | None = None

    def __post_init__(self) -> None:
        check_custom_ops(self.custom_ops)
        object.__setattr__(self, "speculative_config", speculative_config(self.speculative_config))
        if self.kv_cache_dtype != "auto":
            cache_format(self.kv_cache_dtype)  # a clear error for an unknown name


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


@dataclass(frozen=True)
class RequestMetrics:
    """A finished request's timeline (perf_counter seconds), as vLLM's RequestOutput.metrics reports it."""

    arrival_time: float
    first_scheduled_time: float | None  # None: never ran (aborted while waiting)
    first_token_time: float | None
    last_token_time: float | None
    finished_time: float
    inter_token_latencies: list[float]  # gap before each token after the first, per completion of the request

    @property
    def time_in_queue(self) -> float:
        return (self.first_scheduled_time or self.finished_time) - self.arrival_time


@dataclass
class CompletionOutput:
    """One of a request's `n` completions."""

    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[dict[int, float]] = field(default_factory=list)


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    error: str | None = None
    num_cached_tokens: int = 0
    logprobs: list[dict[int, float]] = field(default_factory=list)
    outputs: list[CompletionOutput] = field(default_factory=list)  # all n; token_ids/text above are the first's
    prompt_logprobs: PromptLogprobs | None = None  # with SamplingParams.prompt_logprobs: one entry per prompt token
    metrics: RequestMetrics | None = None  # set once the request has finished

    @property
    def finished(self) -> bool:
        if self.outputs:
            return all(o.finish_reason is not None for o in self.outputs)
        return self.finish_reason is not None


@dataclass
class EngineStats:
    """Cumulative counters for metrics and benchmarks."""

    steps: int = 0
    host_s: float = 0.0
    graph_s: float = 0.0
    tokens_computed: int = 0  # rows the graphs ran, padding included
    tokens_real: int = 0
    generated: int = 0
    bucket_hits: dict[str, int] = field(default_factory=dict)
    cache: CacheStats = field(default_factory=CacheStats)  # live KV counters: hit rate, evictions
    load_s: float = 0.0  # building the engine: manifest, tokenizer, KV pool, the executor's session


class LLMEngine:
    def __init__(self, artifact: str | Path, config: EngineConfig = EngineConfig(),
                 shared_kv: SharedKV | None = None) -> None:
        """`shared_kv`: another engine's KV pools and block manager to run on instead of its own (a draft of the same
        model runs on its target's, runtime/spec/draft.py); their cache dtype wins over `config.kv_cache_dtype`."""
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
        self.packer = Packer(self.manifest, config.batch_invariant)
        self.max_num_seqs, self.max_num_batched_tokens, self.max_logits_rows = self.packer.selector.fit_limits(
            config.max_num_seqs, config.max_num_batched_tokens)
        if not config.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(f"enable_chunked_prefill = false needs max_num_batched_tokens >= max_model_len, but "
                             f"max_num_batched_tokens is {self.max_num_batched_tokens} (clamped to the largest "
                             f"prefill gear) and max_model_len {self.max_model_len}: lower max_model_len, or "
                             f"enable chunked prefill")
        self.kv_cache_dtype = self.manifest.kv_cache_dtype(
            shared_kv.pools.kv_cache_dtype if shared_kv else config.kv_cache_dtype, self.artifact)
        if shared_kv is None:
            blocks = pool_blocks(PoolRequest(bytes_per_block(self.manifest, self.kv_cache_dtype),
                                             self.manifest.block_size, self.max_model_len, self.max_num_seqs,
                                             config.num_blocks, config.kv_cache_bytes, weights_bytes(self.artifact)))
            self.pools = KVPools(self.manifest, blocks, self.kv_cache_dtype)
            # The cache dtype is part of every block hash: blocks of two dtypes never match.
            self.kv = KVCacheManager(self.pools.num_blocks, self.manifest.block_size, config.enable_prefix_caching,
                                     f"kv_cache_dtype={self.kv_cache_dtype};".encode() +
                                     config.prefix_cache_salt.encode())
        else:
            self.pools, self.kv = shared_kv.pools, shared_kv.manager
        self.scheduler = Scheduler(self.kv, self.max_num_seqs, self.max_num_batched_tokens,
                                   config.long_prefill_token_threshold, config.enable_chunked_prefill,
                                   self.max_logits_rows, config.batch_invariant)
        self.executor = make_executor(config.executor, self.artifact, self.manifest, self.pools, config.threads,
                                      config.custom_ops)
        self.stats = EngineStats(cache=self.kv.stats)
        self.sampler = Sampler(self.model.vocab_size, [Penalties(self.model.vocab_size, self.tokenizer.eos_token_ids)])
        self.custom_ops_setting = config.custom_ops
        self.executor_name = config.executor
        self.structured = StructuredOutputs(GrammarCompiler(self.tokenizer, self.model.vocab_size))
        self.sampler.add(self.structured)
        # What a request without SamplingParams gets: the model's generation defaults (manifest), else ours.
        self.default_params = SamplingParams.from_defaults(self.manifest.sampling_defaults)
        self.speculator = speculator_for(config, self)
        self._detok: dict[Sequence, IncrementalDetokenizer] = {}
        self._groups: dict[str, list[Sequence]] = {}  # request id -> its sequences: the first, then its forks
        self._ids = itertools.count()
        self.stats.load_s = time.perf_counter() - start

    # -- requests ---------------------------------------------------------------------------
    def new_request_id(self) -> str:
        """The one request-id minter (the server's too); safe from any thread: `next` on a count is atomic."""
        return f"req-{next(self._ids)}"

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
        self._detok[seq] = self.tokenizer.detokenizer(skip_special_tokens=True)
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
        start = time.perf_counter()
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        batch = self.scheduler.schedule()
        if self.speculator is not None:
            self.speculator.scheduled(batch)
        if batch is None:
            return []
        family, gear = self.packer.select(batch)
        inputs = self.packer.pack(batch, gear)
        graph_start = time.perf_counter()
        try:
            if batch.copies:
                self.pools.copy_blocks(batch.copies)
            logits = self.executor.run(gear, inputs)
        except Exception as exc:  # a failed step fails its own requests only
            graph_end = time.perf_counter()
            groups = {s.request_id: self._groups[s.request_id] for s in batch.seqs}
            for seq in batch.seqs:
                seq.error = f"graph execution failed: {exc}"
                self._finish(seq, "error")
            outputs = [self._output(g) for g in groups.values()]
        else:
            graph_end = time.perf_counter()
            outputs = self._postprocess(batch.seqs, batch.num_tokens, logits, start)
        stats = self.stats
        stats.steps += 1
        stats.graph_s += graph_end - graph_start
        stats.host_s += (graph_start - start) + (time.perf_counter() - graph_end)
        stats.tokens_computed += gear.tokens
        stats.tokens_real += batch.total_tokens
        key = gear.label(family)
        stats.bucket_hits[key] = stats.bucket_hits.get(key, 0) + 1
        return outputs

    def _postprocess(self, seqs: list[Sequence], num_tokens: list[int], logits: Any,
                     start: float) -> list[RequestOutput]:
        rows, ready = [], []
        groups: dict[str, list[Sequence]] = {}
        in_order = True  # rows == 0, 1, 2, ...: every row sampled once, in order (decode steps)
        extra = len(seqs)  # the per-token rows (prompt logprobs, drafts) follow the per-sequence rows (ScheduledBatch)
        for i, (seq, n) in enumerate(zip(seqs, num_tokens)):
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = start
            if seq.num_draft_tokens:
                groups[seq.request_id] = self._groups[seq.request_id]  # before a finish can drop it
                self._verify(seq, logits, [extra + j for j in range(n - 1)] + [i])
                extra += n - 1
                in_order = False
                continue
            if seq.wants_prompt_logprobs:
                self._prompt_logprobs(seq, n, logits, i, extra)
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
                if seq.params.logprobs is not None:
                    seq.logprobs.append(top_logprobs(row, token, seq.params.logprobs))
                groups[seq.request_id] = self._groups[seq.request_id]
                self._append(seq, token)
        return [self._output(g) for g in groups.values()]

    def _verify(self, seq: Sequence, logits: Any, picks: list[int]) -> None:
        """Keep the drafts the target agrees with (runtime/spec): `picks` are the logits rows of the fed tokens."""
        assert self.speculator is not None
        rows = self.speculator.rows(logits, picks)
        tokens = self.speculator.verify(seq, rows)
        self.kv.rollback(seq, seq.num_computed_tokens + len(tokens))  # the fed token and the kept drafts
        for row, token in zip(rows, tokens):
            # The tokens so far have their K/V: register the blocks they fill, as a plain run's steps would have.
            self.kv.cache_blocks(seq, seq.num_tokens)
            if seq.params.logprobs is not None:
                seq.logprobs.append(top_logprobs(row, token, seq.params.logprobs))
            self.speculator.emitted(seq, token)
            self._append(seq, token)
            if seq.finished:
                return

    @staticmethod
    def _prompt_logprobs(seq: Sequence, n: int, logits: Any, row: int, extra: int) -> None:
        """Append the entries of the prompt tokens this step's chunk predicts.

        The chunk's positions s .. s+n-2 are at logits rows extra .. extra+n-2 and its last position at
        `row`; position p predicts token p+1. After a preemption the chunks start again at 0, so the
        positions whose entries are already there are skipped.
        """
        assert seq.prompt_logprobs is not None
        start, done = seq.num_computed_tokens, len(seq.prompt_logprobs)
        lo, hi = done - 1 - start, min(n, seq.num_prompt_tokens - 1 - start)
        if hi <= lo:
            return
        picks = [extra + i if i < n - 1 else row for i in range(lo, hi)]
        targets = seq.prompt_token_ids[start + lo + 1:start + hi + 1]
        seq.prompt_logprobs.extend(prompt_logprob_entries(logits[picks], targets, seq.params.prompt_logprobs))

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
            self._detok[child] = self.tokenizer.detokenizer(skip_special_tokens=True)
            group.append(child)
        return group

    def _append(self, seq: Sequence, token: int) -> None:
        now = time.perf_counter()
        if seq.last_token_time is None:
            seq.first_token_time = now
        else:
            seq.inter_token_latencies.append(now - seq.last_token_time)
        seq.last_token_time = now
        seq.token_ids.append(token)
        self.stats.generated += 1
        params = seq.params
        grammar = self.structured.state(seq) if params.structured_outputs is not None else None
        if grammar is not None and grammar.error is not None:
            seq.error = grammar.error
            return self._finish(seq, "error")
        # Before min_tokens the sampler masks EOS and stop_token_ids, and stop strings do not count (as in vLLM).
        if (token in params.stop_token_ids or (not params.ignore_eos and token in self.tokenizer.eos_token_ids)) \
                and len(seq.token_ids) - seq.num_prompt_tokens >= params.min_tokens:
            return self._finish(seq, "stop")
        piece = self._detok[seq].push(token)
        if piece:
            seen = len(seq.text)
            seq.text += piece
            for stop in params.stop if len(seq.token_ids) - seq.num_prompt_tokens > params.min_tokens else ():
                at = seq.text.find(stop, max(0, seen - len(stop) + 1))
                if at >= 0:
                    seq.text = seq.text[:at]
                    return self._finish(seq, "stop", flush=False)
        if grammar is not None and grammar.complete:  # nothing but EOS could follow
            return self._finish(seq, "stop")
        if len(seq.token_ids) - seq.num_prompt_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            self._finish(seq, "length")

    def _finish(self, seq: Sequence, reason: str, flush: bool = True) -> None:
        """`flush=False` when a stop string cut the text: held-back bytes lie past the cut."""
        seq.finish_reason = reason
        seq.finished_time = time.perf_counter()
        seq.drop_drafts()
        if self.speculator is not None:
            self.speculator.release(seq)
        detok = self._detok.pop(seq)
        if flush:
            seq.text += detok.flush()
        self.scheduler.finish(seq, keep_cached=reason != "error")
        if all(s.finished for s in self._groups[seq.request_id]):
            del self._groups[seq.request_id]

    @staticmethod
    def _output(group: list[Sequence]) -> RequestOutput:
        first = group[0]
        completions = [CompletionOutput(i, s.output_token_ids, s.text, s.finish_reason, s.logprobs)
                       for i, s in enumerate(group)]
        return RequestOutput(first.request_id, first.prompt_token_ids, first.output_token_ids, first.text,
                             first.finish_reason, next((s.error for s in group if s.error), None),
                             first.num_cached_tokens, first.logprobs, completions, first.prompt_logprobs,
                             LLMEngine._metrics(group) if all(s.finished for s in group) else None)

    @staticmethod
    def _metrics(group: list[Sequence]) -> RequestMetrics:
        first = [s.first_token_time for s in group if s.first_token_time is not None]
        last = [s.last_token_time for s in group if s.last_token_time is not None]
        return RequestMetrics(group[0].arrival, group[0].first_scheduled_time, min(first, default=None),
                              max(last, default=None), max(s.finished_time or 0.0 for s in group),
                              [gap for s in group for gap in s.inter_token_latencies])

    def runtime_info(self) -> RuntimeInfo:
        """The executor, whether the custom kernels run, and the precision (weights, KV cache)."""
        custom = self.executor.custom_ops
        return RuntimeInfo(executor=self.executor_name, custom_ops=True if custom is None else bool(custom),
                           custom_ops_setting=self.custom_ops_setting, dtype=self.manifest.dtype,
                           kv_cache_dtype=self.kv_cache_dtype,
                           quantization=None if self.manifest.quantization == "none" else self.manifest.quantization,
                           weight_formats=dict(self.manifest.weight_formats), batch_variance=self._batch_variance())

    def _batch_variance(self) -> str | None:
        if not self.scheduler.batch_invariant:
            return "scheduler.batch_invariant is false"
        if self.executor_name != "onnxruntime":
            return f"not checked on the {self.executor_name} executor"
        if self.executor.custom_ops is False:
            return ("the fused ops run as their ONNX function bodies (custom ops off or unbuilt), whose attention "
                    "reductions follow the batch")
        odd = self.packer.odd_widest_gears()
        if odd:
            return f"the widest gears {odd} have an odd T or B: MatMulNBits computes a lone last row another way"
        return None


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


__all__ = ["CompletionOutput", "EngineConfig", "LLM", "LLMEngine", "RequestMetrics", "RequestOutput", "RuntimeInfo",
           "SequenceStatus"]
