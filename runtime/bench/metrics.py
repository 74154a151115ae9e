"""What a benchmark run measures, and the figures (JSON keys) derived from it."""
from __future__ import annotations

import ctypes
import os
import resource
import sys
from dataclasses import dataclass, field
from typing import Any, Iterable

import numpy as np


def peak_rss_bytes() -> int:
    """The process's peak resident set so far (ru_maxrss is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def resident_bytes(arrays: Iterable[np.ndarray]) -> int:
    """Bytes of `arrays` in memory now (mincore): a KV pool's zero pages become resident only once written, so
    peak RSS minus the pool's size undercounts everything else; minus this it does not (pool pages stay)."""
    libc = ctypes.CDLL(None, use_errno=True)
    page = os.sysconf("SC_PAGE_SIZE")
    total = 0
    for array in arrays:
        start = array.ctypes.data // page * page
        length = array.ctypes.data + array.nbytes - start
        flags = np.zeros(-(-length // page), np.uint8)
        if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), flags.ctypes.data_as(ctypes.c_void_p)):
            raise OSError(ctypes.get_errno(), "mincore failed on a KV pool")
        total += int(np.count_nonzero(flags & 1)) * page
    return total


class Timeline:
    """Arrival and token timestamps per request, on one perf_counter clock."""

    def __init__(self) -> None:
        self.arrivals: dict[Any, float] = {}
        self.token_times: dict[Any, list[float]] = {}

    def arrive(self, key: Any, t: float) -> None:
        self.arrivals[key] = t
        self.token_times[key] = []

    def tokens(self, key: Any, count: int, t: float) -> None:
        self.token_times[key].extend([t] * count)

    def ttft(self, keys: Iterable[Any] | None = None) -> list[float]:
        return [times[0] - self.arrivals[key] for key, times in self._select(keys) if times]

    def itl(self, keys: Iterable[Any] | None = None) -> list[float]:
        """Gaps between consecutive tokens of each request (of `keys` only, if given)."""
        return np.concatenate([np.diff(times) for _, times in self._select(keys)] or [[]]).tolist()

    def _select(self, keys: Iterable[Any] | None) -> list[tuple[Any, list[float]]]:
        if keys is None:
            return list(self.token_times.items())
        return [(key, self.token_times[key]) for key in keys]


@dataclass
class RunRecord:
    """Raw measurements of one run; the paged engine and the naive baseline both fill one."""

    requests: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    wall_s: float = 0.0
    cpu_s: float = 0.0  # process CPU time (all threads): less sensitive than wall time to other load on the cores
    steps: int = 0
    host_s: float = 0.0
    graph_s: float = 0.0
    tokens_computed: int = 0  # rows the graphs ran, padding included
    tokens_real: int = 0
    kv_utilization: list[float] = field(default_factory=list)  # per step: tokens held / KV slots allocated
    context_fill: list[float] = field(default_factory=list)  # per step: real context / context attention reads
    bucket_hits: dict[str, int] = field(default_factory=dict)
    timeline: Timeline = field(default_factory=Timeline)
    outputs: dict[Any, list[int]] = field(default_factory=dict)  # generated token ids per request
    peak_rss_bytes: int = 0
    extra: dict[str, Any] = field(default_factory=dict)  # run-specific figures (prefix hit rate, preemptions)

    def sample_kv(self, held: int, allocated: int) -> None:
        if allocated:
            self.kv_utilization.append(held / allocated)

    def sample_context(self, real: int, read: int) -> None:
        if read:
            self.context_fill.append(real / read)

    def figures(self) -> dict[str, Any]:
        ttft, itl = self.timeline.ttft(), self.timeline.itl()
        total = self.prompt_tokens + self.output_tokens
        step_s = self.host_s + self.graph_s
        return {
            "throughput_tok_s": total / self.wall_s,
            "output_tok_s": self.output_tokens / self.wall_s,
            "total_tok_s": total / self.wall_s,
            "total_s": self.wall_s,
            "cpu_s": self.cpu_s,
            # CPU seconds per wall second per core: well below ORT's thread count / cores, others took the cores.
            "cpu_utilization": self.cpu_s / (self.wall_s * (os.cpu_count() or 1)),
            "ttft_p50_s": percentile(ttft, 50),
            "ttft_p99_s": percentile(ttft, 99),
            "itl_p50_s": percentile(itl, 50),
            "itl_p99_s": percentile(itl, 99),
            "kv_utilization": float(np.mean(self.kv_utilization)) if self.kv_utilization else 0.0,
            "context_fill": float(np.mean(self.context_fill)) if self.context_fill else 0.0,
            "padding_waste": self.tokens_computed / self.tokens_real - 1 if self.tokens_real else 0.0,
            "host_overhead_share": self.host_s / step_s if step_s else 0.0,
            "peak_rss_bytes": self.peak_rss_bytes,
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "steps": self.steps,
            "mean_step_s": step_s / self.steps if self.steps else 0.0,
            "bucket_hits": dict(sorted(self.bucket_hits.items())),
            **self.extra,
        }


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else 0.0
