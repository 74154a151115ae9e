"""Benchmark workloads: fixed-seed request sets with exact prompt/output lengths and arrival times."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping

import numpy as np

from ..traffic import TraceRequest
from ..workloads import copy_heavy_workload, shared_prefix_workload

WORKLOADS = ("mixed", "poisson", "shared-prefix", "stress", "copy", "trace")
FIRST_PLAIN_TOKEN = 100  # random prompts avoid the special tokens at the bottom of the vocabulary


@dataclass(frozen=True)
class BenchRequest:
    """One request: its prompt, exactly `max_tokens` outputs (EOS ignored), and its arrival after t=0."""

    prompt_token_ids: list[int]
    max_tokens: int
    arrival_s: float = 0.0

    @property
    def total_tokens(self) -> int:
        return len(self.prompt_token_ids) + self.max_tokens


def mixed(vocab_size: int, num_requests: int = 64, prompt_range: tuple[int, int] = (8, 1024),
          output_range: tuple[int, int] = (16, 256), seed: int = 0) -> list[BenchRequest]:
    """Prompt lengths log-uniform in `prompt_range`, outputs uniform in `output_range`, all at t=0."""
    rng = np.random.default_rng(seed)
    low, high = prompt_range
    lengths = np.exp(rng.uniform(math.log(low), math.log(high + 1), num_requests)).astype(int).clip(low, high)
    outputs = rng.integers(output_range[0], output_range[1] + 1, num_requests)
    return [BenchRequest(rng.integers(FIRST_PLAIN_TOKEN, vocab_size, int(n)).tolist(), int(m))
            for n, m in zip(lengths, outputs)]


def replayed(vocab_size: int, trace: list[TraceRequest], seed: int = 0) -> list[BenchRequest]:
    """A trace's requests (runtime/traffic.py) with random prompts of their lengths, all at t=0: what
    `pagedgraph plan` replays to estimate a ladder's padding."""
    rng = np.random.default_rng(seed)
    return [BenchRequest(rng.integers(FIRST_PLAIN_TOKEN, vocab_size, r.prompt_tokens).tolist(), r.completion_tokens)
            for r in trace]


def poisson(requests: list[BenchRequest], rate: float, seed: int = 0) -> list[BenchRequest]:
    """The same requests arriving as a Poisson process of `rate` requests per second."""
    if rate <= 0:
        raise ValueError(f"--rate = {rate}: the Poisson arrival rate must be > 0 requests/s")
    gaps = np.random.default_rng(seed + 1).exponential(1.0 / rate, len(requests))
    return [replace(r, arrival_s=float(t)) for r, t in zip(requests, np.cumsum(gaps) - gaps[0])]


def shared_prefix(encode: Callable[[Mapping[str, Any]], list[int]], num_requests: int = 32,
                  prefix_words: int | None = None, seed: int = 0, prefixes: int = 1) -> list[BenchRequest]:
    """runtime.workloads' chats sharing `prefixes` system prompts (~1,000 tokens by default), as token ids, at t=0."""
    words = {} if prefix_words is None else {"prefix_words": prefix_words}
    items = shared_prefix_workload(num_requests=num_requests, seed=seed, prefixes=prefixes, **words)
    return [BenchRequest(encode({"messages": item["messages"]}), int(item["max_tokens"])) for item in items]


def copy_heavy(encode: Callable[[Any], list[int]], num_requests: int = 8, seed: int = 0) -> list[BenchRequest]:
    """runtime.workloads' copy-heavy chats at t=0; each asks for as many tokens as the text its answer quotes."""
    return [BenchRequest(encode({"messages": messages}), len(encode(quoted)))
            for messages, quoted in copy_heavy_workload(num_requests, seed)]


@dataclass(frozen=True)
class StressShape:
    """`decoders` requests decoding when one long prompt arrives (`long_arrival_s` after t=0)."""

    decoders: int = 16
    decoder_prompt: int = 32
    decoder_tokens: int = 640  # outlasting the long prompt's chunks, so most of their gaps are plain decodes
    long_prompt: int = 4000
    long_tokens: int = 32
    long_arrival_s: float = 3.0  # after the decoders' prompts (one step of 16 x 32 tokens) are done


def stress(vocab_size: int, shape: StressShape = StressShape(), seed: int = 0) -> list[BenchRequest]:
    """The decoders at t=0, then the long prompt: always the last request."""
    rng = np.random.default_rng(seed)

    def prompt(n: int) -> list[int]:
        return rng.integers(FIRST_PLAIN_TOKEN, vocab_size, n).tolist()

    decoders = [BenchRequest(prompt(shape.decoder_prompt), shape.decoder_tokens) for _ in range(shape.decoders)]
    return decoders + [BenchRequest(prompt(shape.long_prompt), shape.long_tokens, shape.long_arrival_s)]


def check_fits(requests: list[BenchRequest], max_model_len: int, workload: str) -> None:
    """Every request must fit the artifact whole; mixed needs max_model_len >= 1280, stress 4096."""
    longest = max(r.total_tokens for r in requests)
    if longest > max_model_len:
        raise ValueError(f"the {workload} workload has a request of {longest} tokens (prompt + max_tokens) but the "
                         f"artifact's max_model_len is {max_model_len}; re-export with export.max_model_len >= "
                         f"{longest} (configs/smollm2.yaml has 2048, configs/smollm2-long.yaml 4096) or pass fewer/shorter "
                         f"requests")
