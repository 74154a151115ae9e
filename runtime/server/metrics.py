"""/metrics through prometheus_client: pagedgraph's own gauges and counters, and vLLM's metric names.

Each app has its own `CollectorRegistry` (tests run several apps in one process). Engine state is
read on the engine thread (`EngineSnapshot`) once per scrape and exposed by a collector; per-request
histograms (time to first token, inter-token latency, end-to-end latency, queue time, prompt and
generation tokens) are observed when a request finishes, from its `RequestMetrics`. The `vllm:` names,
labels (`model_name`, `engine`) and buckets are vLLM's, so dashboards built for vLLM work unchanged.

Time spent in each of the sampler's logits processors (penalties; grammar masks) is
`pagedgraph_logits_processor_seconds_total{processor=...}`; a new processor appears there by its name.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Iterator

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ..engine import EngineSnapshot, RequestOutput

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's buckets (vllm/v1/metrics/loggers.py), so percentiles compare across engines.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                         20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)


def token_buckets(max_model_len: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_model_len, as vLLM buckets token counts."""
    buckets, scale = [], 1
    while True:
        for step in (1, 2, 5):
            if step * scale > max_model_len:
                return tuple(buckets)
            buckets.append(step * scale)
        scale *= 10


@dataclass
class ServerCounters:
    """Counted on the event loop, where requests enter and leave."""

    in_flight: int = 0
    rejected: int = 0  # over max_concurrent_requests
    prompt_tokens: int = 0
    cached_tokens: int = 0
    finished: Counter[str] = field(default_factory=Counter)  # by finish reason


@dataclass
class Scrape:
    """What one scrape reads besides the histograms: `tasks` and `threads` spot leaks."""

    snap: EngineSnapshot
    counters: ServerCounters
    tasks: int
    threads: int


class _StateCollector:
    """Gauges and counters from the latest `Scrape`, set just before `generate_latest` reads them."""

    def __init__(self, model_name: str, planned_padding_waste: float | None = None) -> None:
        self.labels = {"model_name": model_name, "engine": "0"}
        self.scrape: Scrape | None = None
        self.planned_padding_waste = planned_padding_waste

    def collect(self) -> Iterator[Metric]:
        if self.scrape is None:
            return
        snap, counters = self.scrape.snap, self.scrape.counters
        used = snap.kv_blocks_total - snap.kv_blocks_free
        gauges = [
            ("requests_running", "Requests in the running batch.", snap.running),
            ("requests_waiting", "Requests queued for their first step (or preempted).", snap.waiting),
            ("http_requests_in_flight", "Generation requests the server is answering.", counters.in_flight),
            ("kv_blocks_total", "KV cache blocks in the pool (the null block excluded).", snap.kv_blocks_total),
            ("kv_blocks_used", "KV cache blocks held by requests.", used),
            ("kv_blocks_free", "KV cache blocks free (evictable prefix-cache blocks included).", snap.kv_blocks_free),
            ("kv_blocks_cached", "KV cache blocks registered in the prefix cache (used or evictable).",
             snap.kv_blocks_cached),
            ("kv_cache_bytes_per_block", "Bytes of one KV block (K and V, every layer) in the cache dtype.",
             snap.kv_bytes_per_block),
            ("kv_cache_bytes_used", "KV cache bytes held by requests.", used * snap.kv_bytes_per_block),
            ("event_loop_tasks", "Tasks on the server's event loop (this scrape's included).", self.scrape.tasks),
            ("python_threads", "Python threads in the server process.", self.scrape.threads),
            ("padding_waste", "Token rows the graphs ran / real tokens - 1, since start: compare with "
                              "pagedgraph_planned_padding_waste to see traffic drift from the plan.",
             snap.tokens_computed / snap.tokens_real - 1 if snap.tokens_real else 0.0),
        ]
        if self.planned_padding_waste is not None:
            gauges.append(("planned_padding_waste", "The padding waste `pagedgraph plan` expected of the artifact's "
                                                    "ladders on the trace it fitted them to (export.buckets.plan).",
                           self.planned_padding_waste))
        for name, help_, value in gauges:
            yield GaugeMetricFamily(f"pagedgraph_{name}", help_, value=value)
        totals = [
            ("steps", "Engine steps (one bucket graph each).", snap.steps),
            ("generation_tokens", "Tokens sampled.", snap.generated),
            ("prompt_tokens", "Prompt tokens of accepted requests.", counters.prompt_tokens),
            ("prompt_cached_tokens", "Prompt tokens of finished requests served from the prefix cache.",
             counters.cached_tokens),
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", snap.prefix_queries),
            ("prefix_cache_hits", "Prompt tokens found in the prefix cache.", snap.prefix_hits),
            ("step_tokens", "Real tokens fed to the graphs.", snap.tokens_real),
            ("step_padded_tokens", "Token rows the graphs ran, padding included.", snap.tokens_computed),
            ("preemptions", "Sequences preempted (recomputed later) for lack of KV blocks.", snap.preemptions),
            ("requests_rejected", "Requests refused with 429 (max_concurrent_requests).", counters.rejected),
        ]
        for name, help_, value in totals:
            yield CounterMetricFamily(f"pagedgraph_{name}", help_, value=value)
        yield self._labelled("pagedgraph_step_seconds", "Time in engine steps: graph execution and host work.",
                             ["part"], [(["graph"], snap.graph_s), (["host"], snap.host_s)])
        yield self._labelled("pagedgraph_logits_processor_seconds",
                             "Host time in the sampler's logits processors (included in the host part of a step).",
                             ["processor"], [([name], s) for name, s in sorted(snap.processor_s.items())])
        hits = []
        for key, count in sorted(snap.bucket_hits.items()):
            family, _, gear = key.partition(":")
            hits.append(([family, gear], count))
        yield self._labelled("pagedgraph_bucket_hits", "Steps run per bucket gear.", ["family", "gear"], hits)
        yield self._labelled("pagedgraph_requests_finished", "Requests finished, by reason.", ["reason"],
                             [([reason], n) for reason, n in sorted(counters.finished.items())])
        yield from self._vllm(snap, counters, used)

    @staticmethod
    def _labelled(name: str, help_: str, labels: list[str], samples: list[tuple[list[str], float]]) -> Metric:
        family = CounterMetricFamily(name, help_, labels=labels)
        for values, value in samples:
            family.add_metric(values, value)
        return family

    def _vllm(self, snap: EngineSnapshot, counters: ServerCounters, used: int) -> Iterator[Metric]:
        keys, values = list(self.labels), list(self.labels.values())

        def one(kind: type[GaugeMetricFamily] | type[CounterMetricFamily], name: str, help_: str,
                value: float) -> Metric:
            family = kind(name, help_, labels=keys)
            family.add_metric(values, value)
            return family

        yield one(GaugeMetricFamily, "vllm:num_requests_running", "Number of requests in model execution batches.",
                  snap.running)
        yield one(GaugeMetricFamily, "vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                  snap.waiting)
        yield one(GaugeMetricFamily, "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                  used / snap.kv_blocks_total if snap.kv_blocks_total else 0.0)
        yield one(CounterMetricFamily, "vllm:prompt_tokens", "Number of prefill tokens processed.",
                  counters.prompt_tokens)
        yield one(CounterMetricFamily, "vllm:generation_tokens", "Number of generation tokens processed.",
                  snap.generated)
        yield one(CounterMetricFamily, "vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                  snap.preemptions)
        yield one(CounterMetricFamily, "vllm:prefix_cache_queries",
                  "Prefix cache queries, in terms of number of queried tokens.", snap.prefix_queries)
        yield one(CounterMetricFamily, "vllm:prefix_cache_hits",
                  "Prefix cache hits, in terms of number of cached tokens.", snap.prefix_hits)
        success = CounterMetricFamily("vllm:request_success", "Count of successfully processed requests.",
                                      labels=[*keys, "finished_reason"])
        for reason in ("stop", "length", "abort"):
            success.add_metric([*values, reason], counters.finished.get(reason, 0))
        yield success
        spec = snap.spec_decode
        if spec is None:
            return
        yield one(CounterMetricFamily, "vllm:spec_decode_num_drafts", "Number of spec decoding drafts.",
                  spec["num_drafts"])
        yield one(CounterMetricFamily, "vllm:spec_decode_num_draft_tokens", "Number of draft tokens.",
                  spec["num_draft_tokens"])
        yield one(CounterMetricFamily, "vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.",
                  spec["num_accepted_tokens"])
        per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                      "Accepted tokens per draft position.", labels=[*keys, "position"])
        for pos, count in enumerate(spec["accepted_per_pos"]):
            per_pos.add_metric([*values, str(pos)], count)
        yield per_pos


class Metrics:
    """One app's registry; `observe` a request when it finishes, `render` on each scrape."""

    def __init__(self, model_name: str, max_model_len: int, planned_padding_waste: float | None = None) -> None:
        self.registry = CollectorRegistry()
        self._state = _StateCollector(model_name, planned_padding_waste)
        self.registry.register(self._state)
        labels = self._state.labels

        def histogram(name: str, help_: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, help_, list(labels), buckets=buckets, registry=self.registry).labels(**labels)

        tokens = token_buckets(max_model_len)
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             TOKEN_LATENCY_BUCKETS)
        # vLLM's older name for the same per-token gaps, which existing dashboards still chart.
        self.tpot = histogram("vllm:time_per_output_token_seconds", "Histogram of time per output token in seconds.",
                              TOKEN_LATENCY_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             REQUEST_LATENCY_BUCKETS)
        self.queue = histogram("vllm:request_queue_time_seconds",
                               "Histogram of time spent in WAITING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.inference = histogram("vllm:request_inference_time_seconds",
                                   "Histogram of time spent in RUNNING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.prefill = histogram("vllm:request_prefill_time_seconds",
                                 "Histogram of time spent in PREFILL phase for request.", REQUEST_LATENCY_BUCKETS)
        self.decode = histogram("vllm:request_decode_time_seconds",
                                "Histogram of time spent in DECODE phase for request.", REQUEST_LATENCY_BUCKETS)
        self.prompt_tokens = histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.", tokens)
        self.generation_tokens = histogram("vllm:request_generation_tokens", "Number of generation tokens processed.",
                                           tokens)

    def observe(self, out: RequestOutput) -> None:
        """A finished request's timeline and sizes (requests aborted before they finished have none)."""
        m = out.metrics
        if m is None:
            return
        self.e2e.observe(m.finished_time - m.arrival_time)
        self.queue.observe(m.time_in_queue)
        self.prompt_tokens.observe(len(out.prompt_token_ids))
        self.generation_tokens.observe(sum(len(c.token_ids) for c in out.outputs) if out.outputs
                                       else len(out.token_ids))
        if m.first_token_time is None or m.first_scheduled_time is None or m.last_token_time is None:
            return
        self.ttft.observe(m.first_token_time - m.arrival_time)
        self.prefill.observe(m.first_token_time - m.first_scheduled_time)
        self.decode.observe(m.last_token_time - m.first_token_time)
        self.inference.observe(m.last_token_time - m.first_scheduled_time)
        for gap in m.inter_token_latencies:
            self.itl.observe(gap)
            self.tpot.observe(gap)

    def render(self, scrape: Scrape) -> bytes:
        self._state.scrape = scrape
        return generate_latest(self.registry)
