"""Prometheus text exposition (format 0.0.4) of the engine snapshot and the server's own counters."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from runtime.server.engine_loop import EngineSnapshot

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass
class ServerCounters:
    """Counted on the event loop, where requests enter and leave."""

    in_flight: int = 0
    rejected: int = 0  # over max_concurrent_requests
    prompt_tokens: int = 0
    cached_tokens: int = 0
    finished: Counter[str] = field(default_factory=Counter)  # by finish reason


def _metric(lines: list[str], name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
    lines.append(f"# HELP pagedgraph_{name} {help_}")
    lines.append(f"# TYPE pagedgraph_{name} {kind}")
    lines.extend(f"pagedgraph_{name}{labels} {value}" for labels, value in samples)


def render(snap: EngineSnapshot, counters: ServerCounters, tasks: int, threads: int) -> str:
    """`tasks` and `threads` are the event loop's tasks and the process's Python threads, to spot leaks."""
    lines: list[str] = []
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
        ("event_loop_tasks", "Tasks on the server's event loop (this scrape's included).", tasks),
        ("python_threads", "Python threads in the server process.", threads),
    ]
    for name, help_, value in gauges:
        _metric(lines, name, "gauge", help_, [("", value)])
    totals = [
        ("steps_total", "Engine steps (one bucket graph each).", snap.steps),
        ("generation_tokens_total", "Tokens sampled.", snap.generated),
        ("prompt_tokens_total", "Prompt tokens of accepted requests.", counters.prompt_tokens),
        ("prompt_cached_tokens_total", "Prompt tokens of finished requests served from the prefix cache.",
         counters.cached_tokens),
        ("prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.", snap.prefix_queries),
        ("prefix_cache_hits_total", "Prompt tokens found in the prefix cache.", snap.prefix_hits),
        ("step_tokens_total", "Real tokens fed to the graphs.", snap.tokens_real),
        ("step_padded_tokens_total", "Token rows the graphs ran, padding included.", snap.tokens_computed),
        ("preemptions_total", "Sequences preempted (recomputed later) for lack of KV blocks.", snap.preemptions),
        ("requests_rejected_total", "Requests refused with 429 (max_concurrent_requests).", counters.rejected),
    ]
    for name, help_, value in totals:
        _metric(lines, name, "counter", help_, [("", value)])
    _metric(lines, "step_seconds_total", "counter", "Time in engine steps: graph execution and host work.",
            [('{part="graph"}', snap.graph_s), ('{part="host"}', snap.host_s)])
    hits = []
    for key, count in sorted(snap.bucket_hits.items()):
        family, _, gear = key.partition(":")
        hits.append((f'{{family="{family}",gear="{gear}"}}', count))
    _metric(lines, "bucket_hits_total", "counter", "Steps run per bucket gear.", hits)
    _metric(lines, "requests_finished_total", "counter", "Requests finished, by reason.",
            [(f'{{reason="{reason}"}}', n) for reason, n in sorted(counters.finished.items())])
    return "\n".join(lines) + "\n"
