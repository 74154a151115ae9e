"""`pagedgraph bench --url`: the shared-prefix workload over HTTP, against one server or a fleet's router.

The same chats as the in-process workload (runtime/workloads.py), streamed as chat completions with
EOS ignored, all sent at t=0 (or `concurrency` at a time). The prefix hit rate is read from the answers
(`usage.prompt_tokens_details.cached_tokens` over `prompt_tokens`), so it means the same for one server
and for N replicas behind a router, whichever replica each request reached. A request that fails is
counted as lost, with its error. `alternating_ttft` times one chat at a time against several URLs in turn:
the router's added latency, against the replica it routes to.
"""
from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import asdict, dataclass
from typing import Any, Mapping

import httpx

from ..workloads import shared_prefix_workload
from .metrics import Timeline, percentile

WARMUP_REQUESTS = 4  # short chats first, so no replica bills its first-request set-up to the measured ones


@dataclass(frozen=True)
class UrlOptions:
    url: str
    requests: int = 32
    prefixes: int = 1
    prefix_words: int | None = None  # default: the workload's (~1,000 tokens)
    max_tokens: int = 32
    concurrency: int | None = None  # default: every request at once
    seed: int = 0
    api_key: str | None = None
    timeout_s: float = 600.0


async def _chat(client: httpx.AsyncClient, model: str, item: dict[str, Any], max_tokens: int, timeline: Timeline,
                key: int) -> dict[str, int]:
    """One streamed chat; its usage. Raises RuntimeError with the server's answer if it fails."""
    body = {"model": model, "messages": item["messages"], "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    timeline.arrive(key, time.perf_counter())
    usage: dict[str, Any] = {}
    done = False
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(json.dumps(chunk["error"]))
                if any(choice["delta"].get("content") for choice in chunk.get("choices", [])):
                    timeline.tokens(key, 1, time.perf_counter())
                usage = chunk.get("usage") or usage
    if not done or not usage:
        raise RuntimeError("the stream ended without its usage and [DONE]")
    return {"prompt": usage["prompt_tokens"], "completion": usage["completion_tokens"],
            "cached": (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0}


async def _run(options: UrlOptions) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {options.api_key}"} if options.api_key else {}
    words = {} if options.prefix_words is None else {"prefix_words": options.prefix_words}
    items = shared_prefix_workload(options.requests, max_tokens=options.max_tokens, seed=options.seed,
                                   prefixes=options.prefixes, **words)
    concurrency = options.concurrency or len(items)
    limits = httpx.Limits(max_connections=concurrency + WARMUP_REQUESTS, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=options.url, headers=headers, timeout=options.timeout_s,
                                 limits=limits) as client:
        models = (await client.get("/v1/models")).raise_for_status().json()["data"]
        model = models[0]["id"]
        warm = [{"messages": [{"role": "user", "content": f"Say {word}."}]} for word in ("one", "two", "three", "four")]
        await asyncio.gather(*(_chat(client, model, item, 2, Timeline(), 0) for item in warm))
        timeline, gate = Timeline(), asyncio.Semaphore(concurrency)

        async def one(key: int, item: dict[str, Any]) -> dict[str, int] | str:
            async with gate:
                try:
                    return await _chat(client, model, item, options.max_tokens, timeline, key)
                except (RuntimeError, httpx.HTTPError) as exc:
                    return f"{type(exc).__name__}: {exc}"

        start = time.perf_counter()
        outcomes = await asyncio.gather(*(one(i, item) for i, item in enumerate(items)))
        total_s = time.perf_counter() - start
    done = [o for o in outcomes if isinstance(o, dict)]
    lost = [o for o in outcomes if isinstance(o, str)]
    prompt = sum(o["prompt"] for o in done)
    ttft = timeline.ttft([i for i, o in enumerate(outcomes) if isinstance(o, dict)])
    return {"model": model, "requests": len(items), "completed": len(done), "lost": len(lost),
            "first_errors": lost[:3], "total_s": total_s, "prompt_tokens": prompt,
            "cached_tokens": sum(o["cached"] for o in done),
            "prefix_hit_rate": sum(o["cached"] for o in done) / prompt if prompt else 0.0,
            "output_tok_s": sum(o["completion"] for o in done) / total_s,
            "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99)}


def run_url_bench(options: UrlOptions) -> dict[str, Any]:
    """The workload against `options.url`; JSON-ready figures, with the load average around them."""
    before = os.getloadavg()[0]
    figures = asyncio.run(_run(options))
    return {"workload": "shared-prefix", "url": options.url,
            "options": {k: v for k, v in asdict(options).items() if k != "api_key"}, **figures,
            "machine": {"cores": len(os.sched_getaffinity(0)), "load_avg_1m_at_start": before,
                        "load_avg_1m_at_end": os.getloadavg()[0]}}


async def _alternate(urls: Mapping[str, str], requests: int, prefix_words: int | None, max_tokens: int,
                     seed: int) -> dict[str, Any]:
    names = list(urls)
    words = {} if prefix_words is None else {"prefix_words": prefix_words}
    items = shared_prefix_workload(len(names) * (requests + 1), max_tokens=max_tokens, seed=seed, **words)
    clients = {name: httpx.AsyncClient(base_url=url, timeout=600.0) for name, url in urls.items()}
    try:
        model = (await clients[names[0]].get("/v1/models")).raise_for_status().json()["data"][0]["id"]
        for name, item in zip(names, items):  # the system prompt cached, each connection open, before any timing
            await _chat(clients[name], model, item, max_tokens, Timeline(), 0)
        timeline, loads = Timeline(), []
        sent: dict[str, list[int]] = {name: [] for name in names}
        cached: dict[str, list[int]] = {name: [] for name in names}
        for pair in range(requests):
            turn = names[pair % len(names):] + names[:pair % len(names)]  # each URL first as often
            for name in turn:
                key = len(names) * (pair + 1) + names.index(name)
                usage = await _chat(clients[name], model, items[key], max_tokens, timeline, key)
                sent[name].append(key)
                cached[name].append(usage["cached"])
            loads.append(os.getloadavg()[0])
        ttft = {name: timeline.ttft(keys) for name, keys in sent.items()}
    finally:
        for client in clients.values():
            await client.aclose()
    return {"ttft_s": ttft, "cached_tokens": cached,
            "ttft_p50_s": {name: percentile(values, 50) for name, values in ttft.items()},
            "load_avg_1m": {"min": min(loads, default=0.0), "max": max(loads, default=0.0)}}


def alternating_ttft(urls: Mapping[str, str], requests: int, prefix_words: int | None = None, max_tokens: int = 32,
                     seed: int = 0) -> dict[str, Any]:
    """TTFT of `requests` chats per URL on one system prompt, one chat at a time, the URLs taking turns.

    Each chat is sent once (a repeat would find its whole prompt cached), so every timed request hits the
    cached system prompt and computes its own question; each round starts at the next URL, so no URL always
    follows another. Interleaving request by request is what keeps the comparison level on a shared machine.
    """
    return asyncio.run(_alternate(urls, requests, prefix_words, max_tokens, seed))


def url_table(results: dict[str, Any]) -> str:
    rows = [("requests completed / lost", f"{results['completed']} / {results['lost']}"),
            ("prefix hit rate (cached / prompt tokens)", f"{results['prefix_hit_rate']:.3f}"),
            ("TTFT p50 s", f"{results['ttft_p50_s']:.3f}"), ("TTFT p99 s", f"{results['ttft_p99_s']:.3f}"),
            ("output tok/s", f"{results['output_tok_s']:.1f}"), ("wall time s", f"{results['total_s']:.2f}")]
    width = max(len(name) for name, _ in rows)
    lines = [f"{results['url']}: {results['requests']} shared-prefix chats, {results['options']['prefixes']} "
             f"prefix(es)"] + [f"  {name:<{width}}  {value}" for name, value in rows]
    return "\n".join(lines + [f"  lost: {error}" for error in results["first_errors"]])
