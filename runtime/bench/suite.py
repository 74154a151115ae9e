"""One benchmark invocation: the workload on the paged engine, its comparison runs, and the fixed experiments.

Every comparison (the naive baseline, prefix caching off, the naive decode figures) runs in the
same process, right after the paged engine, so ratios hold when other processes take the cores.
"""
from __future__ import annotations

import gc
import os
import platform
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import onnxruntime as ort

from ...artifact.manifest import Manifest
from ...artifact.settings import default
from ...graphs.contract import PREFILL
from . import micro, workloads
from .kernels import profile_kernels
from .metrics import RunRecord, peak_rss_bytes, percentile, resident_bytes
from .naive import NaiveRunner
from .runner import run_engine, warm_up
from .workloads import BenchRequest
from ..deploy_config import Deployment, engine_config
from ..engine import EngineConfig, LLMEngine
from ..executors import CustomOps
from ..kv_pools import weights_bytes
from ..traffic import read_trace

DEFAULT_REQUESTS = {"mixed": 64, "poisson": 64, "shared-prefix": 32, "stress": 17, "copy": 9, "trace": None}
# Workloads compared with themselves (chunking on vs off; speculation on vs off), not with the naive engine.
NO_BASELINE = ("stress", "copy")
# Engine settings a workload implies: copy is a single stream (one request at a time, B=1).
WORKLOAD_CONFIG: dict[str, dict[str, Any]] = {"copy": {"max_num_seqs": 1}}
# The stress figures reported for both runs (the chunking-off run's with a `_chunking_off` suffix).
STRESS_KEYS = ("itl_p50_s", "itl_p99_s", "itl_max_s", "itl_p99_over_p50", "long_prompt_ttft_s", "total_s")


@dataclass(frozen=True)
class BenchOptions:
    artifact: str
    workload: str = "mixed"
    requests: int | None = None  # default: DEFAULT_REQUESTS[workload]
    rate: float = 2.0  # requests/s, poisson only
    seed: int = 0
    prompt_range: tuple[int, int] = (8, 1024)  # mixed/poisson prompt lengths (log-uniform)
    output_range: tuple[int, int] = (16, 256)  # mixed/poisson output lengths (uniform)
    prefix_words: int | None = None  # shared-prefix system prompt length; default: the workload's (~1,000 tokens)
    prefixes: int = 1  # shared-prefix: distinct system prompts
    trace: str | None = None  # trace: the JSON Lines file (runtime/traffic.py) replayed
    baseline: str | None = "naive"
    naive_batch: int = 16
    threads: int | None = None
    executor: str = default(Deployment, "executor.name")  # the paged engine's; the naive baseline runs on ONNX Runtime
    custom_ops: CustomOps = default(Deployment, "executor.custom_ops")  # the paged engine's; never the baseline's
    kv_cache_dtype: str = default(Deployment, "kv_cache.dtype")  # the paged engine's and the naive baseline's
    chunk_tokens: int = 16  # stress: long_prefill_token_threshold of the chunked run (16 decodes + 16 = a T=32 gear)
    # The paged engine's speculative_config (runtime/spec/config.py); the workload then also runs without it.
    speculative_config: dict[str, Any] | None = None
    # > 0: also this many rounds of the workload (seed + 1 + round) on two warmed engines, scheduler.batch_invariant
    # on and off, in alternating order: the cost of batch invariance as a ratio.
    invariance_rounds: int = 0
    # Also this many rounds of the workload on the artifact's gears and on the subset these deployment `buckets`
    # keys name (e.g. the ladders an artifact had before `pagedgraph plan`), alternating, on two warmed engines.
    compare_buckets: dict[str, list[int]] | None = None
    compare_rounds: int = 2
    stress: workloads.StressShape = workloads.StressShape()
    micro: bool = True
    contexts: tuple[int, ...] = (64, 1024)  # decode step time at these contexts ...
    decode_batch: int = 16  # ... with this many sequences
    concurrency: tuple[int, ...] = (1, 4, 8, 16)  # decode tok/s with this many requests at once
    concurrency_prompt: int = 32
    concurrency_tokens: int = 128

    def __post_init__(self) -> None:
        if self.workload not in workloads.WORKLOADS:
            raise ValueError(f"--workload {self.workload!r}: choose one of {', '.join(workloads.WORKLOADS)}")
        if self.baseline not in (None, "naive"):
            raise ValueError(f"--baseline {self.baseline!r}: choose naive or none")
        if self.workload in NO_BASELINE and (self.baseline or self.micro):
            raise ValueError(f"--workload {self.workload} is compared with itself (stress: chunked prefill on and off; "
                             f"copy: speculation on and off): pass --baseline none --no-micro (the naive baseline "
                             f"and the decode figures belong to the mixed workload)")
        if (self.workload == "trace") != (self.trace is not None):
            raise ValueError("--trace FILE goes with --workload trace (a trace of prompt_tokens and completion_tokens "
                             "per line, replayed at t=0), and --workload trace needs it")


def _requests(options: BenchOptions, engine: LLMEngine) -> list[BenchRequest]:
    count = options.requests or DEFAULT_REQUESTS[options.workload]
    if options.workload == "shared-prefix":
        requests = workloads.shared_prefix(engine.prompts.token_ids, count, options.prefix_words, options.seed,
                                           options.prefixes)
    elif options.workload == "copy":
        requests = workloads.copy_heavy(engine.prompts.token_ids, count, options.seed)
    elif options.workload == "trace":
        assert options.trace is not None
        trace = read_trace(options.trace, engine.max_model_len)
        requests = workloads.replayed(engine.model.vocab_size, trace[:count] if count else trace, options.seed)
    elif options.workload == "stress":
        requests = workloads.stress(engine.model.vocab_size, replace(options.stress, decoders=count - 1), options.seed)
    else:
        requests = workloads.mixed(engine.model.vocab_size, count, options.prompt_range, options.output_range,
                                   options.seed)
        if options.workload == "poisson":
            requests = workloads.poisson(requests, options.rate, options.seed)
    workloads.check_fits(requests, engine.max_model_len, options.workload)
    return requests


def _engine(options: BenchOptions, log: TextIO, **config: Any) -> tuple[LLMEngine, float | None]:
    """A warmed-up engine, and the wall time of its compile pass (None for ONNX Runtime).

    Other executors compile each gear on its first step, so their engines first serve look-alike
    requests (the next seed: no prefix hits on the measured ones), untimed.
    """
    config = {**WORKLOAD_CONFIG.get(options.workload, {}), **config}
    engine = LLMEngine(options.artifact, EngineConfig(threads=options.threads, executor=options.executor,
                                                      custom_ops=options.custom_ops,
                                                      kv_cache_dtype=options.kv_cache_dtype, **config))
    warm_up(engine)
    if options.executor == "onnxruntime":
        return engine, None
    print(f"{options.executor}: compiling the gears on a look-alike workload (seed {options.seed + 1}) ...", file=log)
    return engine, run_engine(engine, _requests(replace(options, seed=options.seed + 1), engine)).wall_s


def _machine() -> dict[str, Any]:
    return {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "python": platform.python_version(), "onnxruntime": ort.__version__, "numpy": np.__version__,
            "load_avg_1m_at_start": os.getloadavg()[0]}


def _measure_paged(options: BenchOptions, log: TextIO, **config: Any) -> tuple[RunRecord, list[BenchRequest], LLMEngine]:
    """The first engine of the process, so the process's peak RSS afterwards is the engine's."""
    engine, compile_pass_s = _engine(options, log, **config)
    requests = _requests(options, engine)
    print(f"paged engine ({options.executor}): {len(requests)} {options.workload} requests ...", file=log)
    record = run_engine(engine, requests)
    # Whether the fused ops ran as pagedgraph's custom ops ("auto" may have fallen back); None: not ONNX Runtime.
    record.extra.update(compile_pass_s=compile_pass_s, custom_ops=engine.runner.executor.custom_ops)
    record.peak_rss_bytes = peak_rss_bytes()
    weights = weights_bytes(Path(options.artifact))
    pools = engine.runner.pools
    record.extra.update(kv_cache_dtype=engine.kv_cache_dtype, kv_cache_blocks=pools.num_blocks,
                        kv_bytes_per_block=pools.bytes_per_block)
    resident = resident_bytes(pools.values())
    record.extra.update(weights_bytes=weights, kv_cache_bytes=pools.nbytes, kv_cache_resident_bytes=resident,
                        rss_beyond_kv_bytes=record.peak_rss_bytes - resident,
                        rss_beyond_weights_kv_bytes=record.peak_rss_bytes - resident - weights, load_s=engine.stats.load_s,
                        rss_budget_ratio=record.peak_rss_bytes / (weights + pools.nbytes))
    return record, requests, engine


def run_bench(options: BenchOptions, log: TextIO = sys.stderr) -> dict[str, Any]:
    """Run everything `options` asks for; returns the JSON-ready results (see docs/performance.md for the keys)."""
    manifest = Manifest.load(Path(options.artifact), verify=False)
    results: dict[str, Any] = {"workload": options.workload, "executor": options.executor,
                               "options": asdict(options), "machine": _machine(), "dtype": manifest.dtype,
                               "quantization": manifest.quantization, "weight_formats": manifest.weight_formats}

    if options.workload == "stress":
        results.update(_stress(options, log))
        results["machine"]["load_avg_1m_at_end"] = os.getloadavg()[0]
        return results
    spec = options.speculative_config
    paged, requests, engine = _measure_paged(options, log, **({"speculative_config": spec} if spec else {}))
    vocab_size = engine.model.vocab_size
    results.update(paged.figures())
    del engine
    gc.collect()
    if spec:
        print("paged engine, speculative decoding off ...", file=log)
        off_record = run_engine(_engine(options, log)[0], requests)
        off = off_record.figures()
        off["peak_rss_bytes"] = None  # the process's high-water mark is the first engine's
        results.update(spec_off=off, output_tok_s_spec_off=off["output_tok_s"],
                       speedup_vs_spec_off=results["output_tok_s"] / off["output_tok_s"],
                       outputs_equal_spec_off=paged.outputs == off_record.outputs)
        gc.collect()
    if options.invariance_rounds:
        results["batch_invariance_cost"] = _invariance_cost(options, log)
        gc.collect()
    if options.compare_buckets:
        results["compare_buckets"] = _compare_buckets(options, log)
        gc.collect()
    if options.workload == "shared-prefix":
        print("paged engine, prefix caching off ...", file=log)
        off = run_engine(_engine(options, log, enable_prefix_caching=False)[0], requests).figures()
        off["peak_rss_bytes"] = None  # the process's high-water mark is the first engine's, not this one's
        results.update(ttft_p50_s_cache_off=off["ttft_p50_s"], total_s_cache_off=off["total_s"], cache_off=off,
                       ttft_p50_speedup_prefix_cache=off["ttft_p50_s"] / results["ttft_p50_s"])
        gc.collect()
    naive = NaiveRunner(options.artifact, options.naive_batch, options.threads, options.kv_cache_dtype) \
        if options.baseline else None
    if naive is not None:
        naive.run(micro.random_requests(vocab_size, 1, 8, 2, options.seed))  # warm-up, as for the engine
        print(f"naive baseline: static batches of {options.naive_batch} ...", file=log)
        figures = naive.run(requests).figures()
        figures.update(kv_cache_bytes=naive.kv_cache_bytes, peak_rss_bytes=None)
        results.update(naive=figures, naive_throughput_tok_s=figures["throughput_tok_s"],
                       speedup_vs_naive=results["throughput_tok_s"] / figures["throughput_tok_s"],
                       cpu_speedup_vs_naive=figures["cpu_s"] / results["cpu_s"])
    if options.micro:
        results.update(_micro(options, naive, vocab_size, log))
    if options.executor == "onnxruntime":  # last: its session must not raise the engine's peak RSS
        print("profiling one decode and one prefill step (which kernels run) ...", file=log)
        results["kernels"] = profile_kernels(Path(options.artifact), options.threads, options.custom_ops)
    results["machine"]["load_avg_1m_at_end"] = os.getloadavg()[0]
    return results


def _invariance_cost(options: BenchOptions, log: TextIO) -> dict[str, Any]:
    """Throughput with scheduler.batch_invariant on against off, in alternating rounds on two warmed engines."""
    engines = {"batch_invariant on": _engine(options, log, batch_invariant=True)[0],
               "batch_invariant off": _engine(options, log, batch_invariant=False)[0]}
    runs = _alternating(options, engines, options.invariance_rounds, log)
    tok_s = {on: [f["throughput_tok_s"] for f in runs[f"batch_invariant {'on' if on else 'off'}"]] for on in (True, False)}
    cpu_s = {on: [f["cpu_s"] for f in runs[f"batch_invariant {'on' if on else 'off'}"]] for on in (True, False)}
    return {"rounds": options.invariance_rounds, "throughput_tok_s_on": tok_s[True],
            "throughput_tok_s_off": tok_s[False], "cpu_s_on": cpu_s[True], "cpu_s_off": cpu_s[False],
            "ratio_per_round": [a / b for a, b in zip(tok_s[True], tok_s[False])],
            "throughput_ratio": float(np.mean(tok_s[True]) / np.mean(tok_s[False])),
            "cpu_ratio": float(np.mean(cpu_s[False]) / np.mean(cpu_s[True]))}


def _alternating(options: BenchOptions, engines: dict[str, LLMEngine], rounds: int,
                 log: TextIO) -> dict[str, list[dict[str, Any]]]:
    """Each round's requests (a fresh seed: no prefix hits on earlier rounds) on every engine, the order turned
    round every other round, so a slow spell of the machine falls on all alike."""
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in engines}
    for r in range(rounds):
        requests = _requests(replace(options, seed=options.seed + 1 + r), next(iter(engines.values())))
        for name in list(engines) if r % 2 == 0 else reversed(list(engines)):
            print(f"round {r + 1}/{rounds}: {name} ...", file=log)
            runs[name].append(run_engine(engines[name], requests).figures())
    return runs


def _compare_buckets(options: BenchOptions, log: TextIO) -> dict[str, Any]:
    """Throughput on all of the artifact's gears against the subset `options.compare_buckets` names."""
    assert options.compare_buckets is not None
    deployment = Deployment.model_validate({"model": {"artifact": options.artifact},
                                            "buckets": options.compare_buckets})
    subset = engine_config(deployment, Manifest.load(Path(options.artifact), verify=False), "--compare-buckets").gears
    engines = {"all gears": _engine(options, log)[0], "compared": _engine(options, log, gears=subset)[0]}
    runs = _alternating(options, engines, options.compare_rounds, log)
    tok_s = {name: [f["throughput_tok_s"] for f in figures] for name, figures in runs.items()}
    return {"buckets": options.compare_buckets, "rounds": options.compare_rounds,
            "throughput_tok_s_all": tok_s["all gears"], "throughput_tok_s_compared": tok_s["compared"],
            "ratio_per_round": [a / b for a, b in zip(tok_s["all gears"], tok_s["compared"])],
            "throughput_ratio": float(np.mean(tok_s["all gears"]) / np.mean(tok_s["compared"])),
            "padding_waste_all": runs["all gears"][0]["padding_waste"],
            "padding_waste_compared": runs["compared"][0]["padding_waste"],
            "cpu_utilization_all": [f["cpu_utilization"] for f in runs["all gears"]],
            "cpu_utilization_compared": [f["cpu_utilization"] for f in runs["compared"]]}


def _stress(options: BenchOptions, log: TextIO) -> dict[str, Any]:
    """The decoders' inter-token latency while the long prompt is fed in chunks, then whole (chunking off).

    Both engines may put a whole request in one step (max_num_batched_tokens = max_model_len = the
    largest prefill gear), so the only difference is `long_prefill_token_threshold` against
    `enable_chunked_prefill=False`.
    """
    budget = max(g.tokens for g in Manifest.load(Path(options.artifact)).families[PREFILL].gears)
    limits = dict(max_num_batched_tokens=budget, max_model_len=budget)
    chunked, requests, engine = _measure_paged(options, log, long_prefill_token_threshold=options.chunk_tokens,
                                               **limits)
    del engine
    gc.collect()
    print("paged engine, chunked prefill off ...", file=log)
    whole = run_engine(_engine(options, log, enable_chunked_prefill=False, **limits)[0], requests)
    out = _stress_figures(chunked, len(requests))
    off = _stress_figures(whole, len(requests))
    off["peak_rss_bytes"] = None  # the process's high-water mark is the first engine's
    out["chunking_off"] = off
    out.update({key + "_chunking_off": off[key] for key in STRESS_KEYS})
    return out


def _stress_figures(record: RunRecord, num_requests: int) -> dict[str, Any]:
    """The run's figures, latencies of the decoders only (every request but the last, the long prompt)."""
    decoders, long = [f"bench-{i}" for i in range(num_requests - 1)], f"bench-{num_requests - 1}"
    itl = record.timeline.itl(decoders)
    figures = record.figures()
    figures.update(itl_p50_s=percentile(itl, 50), itl_p99_s=percentile(itl, 99), itl_max_s=max(itl),
                   long_prompt_ttft_s=record.timeline.ttft([long])[0])
    figures["itl_p99_over_p50"] = figures["itl_p99_s"] / figures["itl_p50_s"]
    return figures


def _micro(options: BenchOptions, naive: NaiveRunner | None, vocab_size: int, log: TextIO) -> dict[str, Any]:
    print(f"decode step time at {options.contexts} tokens of context, decode tok/s at {options.concurrency} "
          f"concurrent requests ...", file=log)
    engine, _ = _engine(options, log)
    batch, short, long = options.decode_batch, min(options.contexts), max(options.contexts)
    out: dict[str, Any] = {
        "decode_step_s": {str(ctx): micro.engine_decode_step_s(engine, [ctx] * batch, seed=options.seed)
                          for ctx in options.contexts},
        # All but one sequence short: a step that follows each sequence's context costs about the short one's.
        "decode_step_s_one_long": micro.engine_decode_step_s(engine, [short] * (batch - 1) + [long], seed=options.seed),
        "decode_tok_s": micro.engine_concurrency(engine, options.concurrency, options.concurrency_prompt,
                                                 options.concurrency_tokens, options.seed),
        "structured_output": micro.structured_output_cost(engine, batch, seed=options.seed),
    }
    del engine
    gc.collect()
    if naive is not None:
        out["naive_decode_step_s"] = {str(ctx): naive.decode_step_s(ctx, min(options.decode_batch, naive.batch_size))
                                      for ctx in options.contexts}
        out["naive_decode_tok_s"] = {
            str(n): micro.decode_tok_s(naive.run(micro.random_requests(
                vocab_size, n, options.concurrency_prompt, options.concurrency_tokens, options.seed)))
            for n in options.concurrency}
    return out
