#!/usr/bin/env python
"""Drive a real `pagedgraph serve` with concurrent clients and check that nothing is lost or leaked.

    python scripts/loadtest.py --config configs/deploy-smollm2.yaml --requests 200 --concurrency 64 \\
        --cancel-fraction 0.2 --json loadtest.json

The server runs as a subprocess on a free port. The requests mix chat prompts that share a long system
prompt (prefix caching), completions of random token ids of log-uniform length (chunked prefill, the big
gears) and short text prompts; streaming and not; greedy and sampled (n = 1 or 2); and a fraction is
cancelled by the client mid-way. Each distinct greedy request is first run alone, then:

- every greedy request that completes under load must return exactly its solo text (`mismatches`), at the
  deployment's precision (`precision`: weights, compute and KV-cache dtypes, as the server reports them); where the
  server says why its output may follow the batch (`batch_variance`, e.g. `scheduler.batch_invariant: false`),
  mismatches are counted and named with that reason but do not fail the run;
- no valid request may fail (`errors`);
- once idle, every KV block is free again (cached-but-evictable counts as free; `leaked_blocks`), the
  event loop holds as many tasks and the process as many threads as after the warm-up, and RSS is
  within `--rss-tolerance` of its post-warm-up value;
- SIGTERM then drains and the server exits 0.

The JSON holds `requests_per_s` (completed requests per second of load), `errors`, `mismatches`,
`leaked_blocks`, `p99_latency_s` and the measurements behind each check; the exit status is 0 when all pass.

With `--kill-replica I` and a deployment with a fleet section, the load (no cancellations) goes through
the router and local replica I is SIGKILLed while it serves part of it. Then only streams it was
serving may fail (`streams_cut_on_killed`, at most its requests in flight; the router retries the
others), every other request must succeed with its solo text (`errors_elsewhere`, `mismatches`), the
restarted replica must be back in the router's rotation (`rejoin_s`) and answer (`full_strength`; where
fresh prompts through the router went is `fresh_requests_by_replica`), and SIGTERM must drain the fleet to
exit 0.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

from pagedgraph.artifact.manifest import Manifest
from pagedgraph.runtime.deploy_config import Deployment, load_deployment
from pagedgraph.runtime.workloads import shared_prefix_workload

FIRST_PLAIN_TOKEN = 100  # random prompts avoid the special tokens at the bottom of the vocabulary


@dataclass(frozen=True)
class Spec:
    """A distinct request body; `greedy` ones have one right answer, their solo-run text."""

    path: str
    body: dict[str, Any]

    @property
    def greedy(self) -> bool:
        return self.body.get("temperature") == 0


@dataclass(frozen=True)
class Planned:
    spec: int
    stream: bool
    cancel_at: float | None  # the client hangs up after this fraction of `scale` seconds, if not done by then


@dataclass
class Result:
    spec: int
    outcome: str  # "completed", "cancelled" or "error"
    latency_s: float = 0.0
    texts: list[str] = field(default_factory=list)
    detail: str = ""


# -- the workload -----------------------------------------------------------------------------------
def make_specs(count: int, max_tokens: int, max_model_len: int, vocab_size: int, seed: int) -> list[Spec]:
    """`count` distinct bodies cycling chat / token ids / text, three in four greedy, all fitting max_model_len."""
    rng = random.Random(seed)
    room = max_model_len - max_tokens - 1
    chats = shared_prefix_workload(num_requests=count, prefix_words=max(8, int((room - 80) / 1.5)),
                                   max_tokens=max_tokens, seed=seed)
    specs = []
    for i, chat in enumerate(chats):
        greedy = i % 4 != 3
        sampling: dict[str, Any] = {"max_tokens": rng.randint(max(1, max_tokens // 4), max_tokens),
                                    "temperature": 0 if greedy else 0.8}
        if not greedy:
            sampling.update(top_p=0.95, seed=rng.randrange(1 << 30), n=rng.choice((1, 2)))
        kind = i % 3
        if kind == 0:
            specs.append(Spec("/v1/chat/completions", {"messages": chat["messages"], **sampling}))
        elif kind == 1:
            length = int(math.exp(rng.uniform(math.log(8), math.log(max(9, room // 2)))))
            specs.append(Spec("/v1/completions", {"prompt": _random_ids(rng, length, vocab_size), **sampling}))
        else:
            specs.append(Spec("/v1/completions", {"prompt": chat["messages"][1]["content"], **sampling}))
    return specs


def _random_ids(rng: random.Random, length: int, vocab_size: int) -> list[int]:
    return [rng.randrange(FIRST_PLAIN_TOKEN, vocab_size) for _ in range(length)]


def pool_fillers(pool_tokens: int, max_model_len: int, vocab_size: int, seed: int) -> list[Spec]:
    """Prefill-only prompts of distinct random tokens that together fill every KV block once.

    The pools are zeroed lazily (calloc): a block's pages become resident when first written. With
    prefix caching the free queue hands out never-used blocks before it evicts, so these requests
    make the whole pool resident before RSS is measured, and growth after that is not first-touch.
    """
    rng = random.Random(seed + 13)
    length = min(max_model_len - 1, 1024)
    return [Spec("/v1/completions", {"prompt": _random_ids(rng, length, vocab_size), "max_tokens": 1,
                                     "temperature": 0}) for _ in range(pool_tokens // length + 2)]


def plan(count: int, num_specs: int, cancel_fraction: float, seed: int) -> list[Planned]:
    rng = random.Random(seed + 1)
    return [Planned(rng.randrange(num_specs), rng.random() < 0.5,
                    rng.uniform(0.02, 1.0) if rng.random() < cancel_fraction else None) for _ in range(count)]


# -- the server -------------------------------------------------------------------------------------
# The server's own lines (a fleet relays its replicas' lines behind "replica N | ", which these never match).
LISTENING = re.compile(r"^\S+ \S+ INFO pagedgraph\.(server|fleet): listening on (http://\S+)"
                       r"(?: .*metrics on (http://\S+))?")
READY = re.compile(r"^(INFO: +Application startup complete|\S+ \S+ INFO pagedgraph\.fleet: listening on)")


class ServerProcess:
    """`pagedgraph serve --config CONFIG --port 0` as a subprocess; its output goes to a log file.

    With a fleet section the URL is the router's, `metrics_url` every replica's metrics, and `replica(i)`
    the process of local replica i."""

    def __init__(self, config: str, timeout_s: float) -> None:
        self.log_path = Path(tempfile.mkstemp(prefix="pagedgraph-loadtest-", suffix=".log")[1])
        self.proc = subprocess.Popen([sys.executable, "-m", "pagedgraph.cli", "serve", "--config", config,
                                      "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.process = psutil.Process(self.proc.pid)
        self._started = threading.Event()
        self._url: str | None = None
        self.metrics_url: str | None = None
        self._reader = threading.Thread(target=self._read_log, daemon=True)
        self._reader.start()
        if not self._started.wait(timeout_s) or self._url is None:
            self.proc.kill()
            raise RuntimeError(f"the server did not start within {timeout_s} s; log: {self.log_path}\n"
                               f"{self.log_path.read_text()[-3000:]}")
        self.url = self._url

    def _read_log(self) -> None:
        assert self.proc.stdout is not None
        with open(self.log_path, "w") as log:
            for line in self.proc.stdout:
                log.write(line)
                log.flush()
                found = LISTENING.match(line)
                if found:
                    self._url = found.group(2).replace("0.0.0.0", "127.0.0.1").replace("[::]", "[::1]")
                    self.metrics_url = found.group(3)
                if READY.match(line):
                    self._started.set()
        self._started.set()

    def rss(self) -> int:
        return self.process.memory_info().rss

    def replica(self, index: int) -> psutil.Process:
        """A fleet's local replica `index` as it runs now (a restart is a new process)."""
        for child in self.process.children():
            if any(part.endswith(f"replica-{index}.yaml") for part in child.cmdline()):
                return child
        raise LookupError(f"replica {index} is not running")

    def stop(self, timeout_s: float) -> int:
        """SIGTERM (a drain with nothing running) and the exit status."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return -9


def metrics(client: httpx.Client) -> dict[str, float]:
    text = client.get("/metrics").text
    return {m[1]: float(m[2]) for m in re.finditer(r"^pagedgraph_(\w+) (\S+)$", text, re.M)}


def settle(client: httpx.Client, timeout_s: float) -> dict[str, float]:
    """Metrics once nothing runs, waits or is in flight (or the last ones seen at the timeout)."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = metrics(client)
        idle = m["requests_running"] == m["requests_waiting"] == m["http_requests_in_flight"] == 0
        if (idle and m["kv_blocks_used"] == 0) or time.monotonic() > deadline:
            return m
        time.sleep(0.1)


# -- the clients ------------------------------------------------------------------------------------
def _texts(response: dict[str, Any], texts: dict[int, str]) -> None:
    """Accumulate each choice's text from a response or a stream chunk."""
    if "error" in response:
        raise RuntimeError(json.dumps(response["error"]))
    for choice in response.get("choices", []):
        part = choice.get("text")
        if part is None:
            part = (choice.get("message") or choice.get("delta") or {}).get("content") or ""
        texts[choice["index"]] = texts.get(choice["index"], "") + part


async def _send(client: httpx.AsyncClient, spec: Spec, stream: bool) -> list[str]:
    texts: dict[int, str] = {}
    if not stream:
        response = await client.post(spec.path, json=spec.body)
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.text[:300]}")
        _texts(response.json(), texts)
    else:
        async with client.stream("POST", spec.path, json={**spec.body, "stream": True}) as response:
            if response.status_code != 200:
                raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:300]!r}")
            done = False
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    _texts(json.loads(line[6:]), texts)
            if not done:
                raise RuntimeError("the stream ended without [DONE]")
    return [texts[i] for i in sorted(texts)]


async def _one(client: httpx.AsyncClient, specs: list[Spec], item: Planned, gate: asyncio.Semaphore,
               scale: float) -> Result:
    async with gate:
        start = time.perf_counter()
        task = asyncio.ensure_future(_send(client, specs[item.spec], item.stream))
        try:
            texts = await asyncio.wait_for(asyncio.shield(task), None if item.cancel_at is None else
                                           item.cancel_at * scale)
        except TimeoutError:
            task.cancel()  # closes the connection: the server must abort the request and free its blocks
            await asyncio.gather(task, return_exceptions=True)
            return Result(item.spec, "cancelled")
        except Exception as exc:
            return Result(item.spec, "error", detail=f"{type(exc).__name__}: {exc}")
        return Result(item.spec, "completed", time.perf_counter() - start, texts)


async def run_load(url: str, headers: dict[str, str], specs: list[Spec], items: list[Planned],
                   concurrency: int, scale: float = 1.0) -> tuple[list[Result], float]:
    """Send `items` from `concurrency` clients; cancellations fall within `scale` seconds of sending."""
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=600, limits=limits) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(_one(client, specs, item, gate, scale) for item in items))
        return list(results), time.perf_counter() - start


def solo(url: str, headers: dict[str, str], specs: list[Spec]) -> dict[int, list[str]]:
    """Each greedy spec's texts when it runs alone; a spec the server refuses stops the test here."""
    answers = {}
    for i, spec in enumerate(specs):
        if spec.greedy:
            result = asyncio.run(run_load(url, headers, specs, [Planned(i, False, None)], 1))[0][0]
            if result.outcome != "completed":
                raise RuntimeError(f"spec {i} ({spec.path}) failed alone: {result.detail}")
            answers[i] = result.texts
    return answers


# -- the report -------------------------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


@dataclass
class Snapshot:
    """The server idle: its metrics, RSS and OS threads."""

    metrics: dict[str, float]
    rss: int
    os_threads: int


@dataclass
class Measured:
    runtime: dict[str, Any]  # the server's /v1/models `runtime`: executor, precision, batch_variance
    answers: dict[int, list[str]]
    load: list[Planned]
    results: list[Result]
    wall_s: float
    before: Snapshot
    after: Snapshot


def idle(server: ServerProcess, client: httpx.Client, timeout_s: float) -> Snapshot:
    return Snapshot(settle(client, timeout_s), server.rss(), server.process.num_threads())


def measure(server: ServerProcess, args: argparse.Namespace, headers: dict[str, str], vocab_size: int,
            block_size: int) -> Measured:
    """Solo runs, pool fill and warm-up, the idle baseline, the load, the idle state after it."""
    with httpx.Client(base_url=server.url, headers=headers, timeout=60) as client:
        card = client.get("/v1/models").json()["data"][0]
        max_model_len = card["max_model_len"]
        specs = make_specs(args.specs, args.max_tokens, max_model_len, vocab_size, args.seed)
        answers = solo(server.url, headers, specs)
        fillers = pool_fillers(int(metrics(client)["kv_blocks_total"]) * block_size, max_model_len, vocab_size,
                               args.seed)
        asyncio.run(run_load(server.url, headers, fillers, [Planned(i, False, None) for i in range(len(fillers))],
                             args.concurrency))
        warmup = plan(args.warmup, len(specs), args.cancel_fraction, args.seed + 7)
        warm, _ = asyncio.run(run_load(server.url, headers, specs, warmup, args.concurrency))
        # Cancel within the typical latency under this load, so clients hang up while queued and mid-stream.
        scale = percentile([r.latency_s for r in warm if r.outcome == "completed"], 0.5)
        before = idle(server, client, args.settle_timeout)
        load = plan(args.requests, len(specs), args.cancel_fraction, args.seed)
        results, wall = asyncio.run(run_load(server.url, headers, specs, load, args.concurrency, scale))
        return Measured(card["runtime"], answers, load, results, wall, before,
                        idle(server, client, args.settle_timeout))


def precision(runtime: dict[str, Any]) -> str:
    """What the server computes in, e.g. "w8a8 weights, float32 compute, int8 KV"."""
    return f"{runtime['quantization'] or runtime['dtype']} weights, {runtime['dtype']} compute, " \
           f"{runtime['kv_cache_dtype']} KV"


def summarize(m: Measured, exit_code: int, rss_tolerance: float) -> dict[str, Any]:
    completed = [r for r in m.results if r.outcome == "completed"]
    errors = [r for r in m.results if r.outcome == "error"]
    compared = [r for r in completed if r.spec in m.answers]
    mismatched = [r for r in compared if r.texts != m.answers[r.spec]]
    latencies = [r.latency_s for r in completed]
    before, after = m.before.metrics, m.after.metrics
    report = {
        "requests_per_s": round(len(completed) / m.wall_s, 3),
        "errors": len(errors),
        "mismatches": len(mismatched),
        "precision": precision(m.runtime),
        "batch_variance": m.runtime.get("batch_variance"),
        "leaked_blocks": int(after["kv_blocks_total"] - after["kv_blocks_free"]),
        "p99_latency_s": round(percentile(latencies, 0.99), 3),
        "p50_latency_s": round(percentile(latencies, 0.50), 3),
        "wall_s": round(m.wall_s, 2),
        "completed": len(completed),
        "cancelled": sum(r.outcome == "cancelled" for r in m.results),  # planned ones that finished first complete
        "cancels_planned": sum(item.cancel_at is not None for item in m.load),
        "greedy_compared": len(compared),
        "preemptions": int(after["preemptions_total"] - before["preemptions_total"]),
        "prefix_cache_hit_tokens": int(after["prefix_cache_hits_total"] - before["prefix_cache_hits_total"]),
        "kv_blocks_total": int(after["kv_blocks_total"]),
        "kv_blocks_free_before": int(before["kv_blocks_free"]),
        "kv_blocks_free_after": int(after["kv_blocks_free"]),
        "rss_post_warmup_mb": round(m.before.rss / 2**20, 1),
        "rss_after_mb": round(m.after.rss / 2**20, 1),
        "rss_growth": round(m.after.rss / m.before.rss - 1, 4),
        "python_threads": [int(before["python_threads"]), int(after["python_threads"])],
        "os_threads": [m.before.os_threads, m.after.os_threads],
        "event_loop_tasks": [int(before["event_loop_tasks"]), int(after["event_loop_tasks"])],
        "exit_code": exit_code,
        "first_errors": [asdict(r) for r in errors[:5]],
        "first_mismatches": [{"spec": r.spec, "got": r.texts, "solo": m.answers[r.spec]} for r in mismatched[:3]],
    }
    checks = {
        "errors": report["errors"] == 0,
        "mismatches": report["mismatches"] == 0 or report["batch_variance"] is not None,
        "leaked_blocks": report["leaked_blocks"] == 0,
        "rss": abs(report["rss_growth"]) <= rss_tolerance,
        "python_threads": len(set(report["python_threads"])) == 1,
        "os_threads": len(set(report["os_threads"])) == 1,
        "event_loop_tasks": len(set(report["event_loop_tasks"])) == 1,
        "exit_code": exit_code == 0,
    }
    report["failed_checks"] = [name for name, ok in checks.items() if not ok]
    return report


def start(args: argparse.Namespace) -> tuple[Deployment, dict[str, str], Manifest, ServerProcess]:
    """The deployment, the headers its API key needs, its artifact's manifest, and the server started on it."""
    deployment = load_deployment(args.config)
    headers = {"Authorization": f"Bearer {deployment.server.api_key}"} if deployment.server.api_key else {}
    manifest = Manifest.load(Path(deployment.model.artifact), verify=False)
    return deployment, headers, manifest, ServerProcess(args.config, args.startup_timeout)


def run(args: argparse.Namespace) -> dict[str, Any]:
    _, headers, manifest, server = start(args)
    try:
        measured = measure(server, args, headers, manifest.model.vocab_size, manifest.block_size)
    finally:
        exit_code = server.stop(args.settle_timeout)
    return {"config": args.config, "requests": args.requests, "concurrency": args.concurrency,
            "cancel_fraction": args.cancel_fraction, "server_log": str(server.log_path),
            **summarize(measured, exit_code, args.rss_tolerance)}


# -- a fleet: one replica killed under load ---------------------------------------------------------
def replica_metrics(client: httpx.Client, metrics_url: str) -> dict[str, dict[str, float]]:
    """The fleet's merged /metrics by replica: each sample name's values summed over its other labels."""
    by_replica: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(client.get(metrics_url).text):
        for sample in family.samples:
            replica = sample.labels.get("replica")
            if replica is not None:
                values = by_replica.setdefault(replica, {})
                values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return by_replica


def replica_url(client: httpx.Client, metrics_url: str, replica: int) -> str:
    """Replica `replica`'s own URL, from the fleet's `pagedgraph_fleet_replica_up{replica, url}`."""
    for family in text_string_to_metric_families(client.get(metrics_url).text):
        for sample in family.samples:
            if sample.name == "pagedgraph_fleet_replica_up" and sample.labels["replica"] == str(replica):
                return sample.labels["url"]
    raise LookupError(f"the fleet has no replica {replica}")


def healthy_workers(client: httpx.Client) -> int:
    """Replicas the router routes to now (vllm-router's /workers)."""
    return sum(w["is_healthy"] for w in client.get("/workers").json()["workers"])


def _cut_stream(item: Planned, result: Result) -> bool:
    """A stream that broke after its 200: only a replica that died cuts one (the router forwards bytes as they come)."""
    return result.outcome == "error" and item.stream and not result.detail.startswith("RuntimeError: HTTP ")


def kill_under_load(server: ServerProcess, args: argparse.Namespace, headers: dict[str, str], vocab_size: int
                    ) -> dict[str, Any]:
    """Solo answers, then the load; replica `--kill-replica` (-1: the one holding the most) is SIGKILLed once it
    serves part of it; then the wait for its restart to rejoin the router's rotation and answer again."""
    assert server.metrics_url is not None, "--kill-replica needs a deployment with a fleet section"
    with httpx.Client(base_url=server.url, headers=headers, timeout=60) as client:
        max_model_len = client.get("/v1/models").json()["data"][0]["max_model_len"]
        replicas = len(replica_metrics(client, server.metrics_url))
        specs = make_specs(args.specs, args.max_tokens, max_model_len, vocab_size, args.seed)
        answers = solo(server.url, headers, specs)
        load = plan(args.requests, len(specs), 0.0, args.seed)
        box: dict[str, Any] = {}
        sender = threading.Thread(target=lambda: box.update(
            out=asyncio.run(run_load(server.url, headers, specs, load, args.concurrency))))
        sender.start()
        # Kill once the victim holds its share of the load, or any of it after a few seconds (a cache-aware
        # router may keep most prompts on another replica).
        in_flight, started, victim = 0.0, time.monotonic(), max(args.kill_replica, 0)
        while sender.is_alive() and time.monotonic() < started + args.settle_timeout:
            held = {int(r): m["pagedgraph_http_requests_in_flight"]
                    for r, m in replica_metrics(client, server.metrics_url).items()}
            victim = args.kill_replica if args.kill_replica >= 0 else max(held, key=held.__getitem__)
            in_flight = held[victim]
            share = max(1, args.concurrency // (2 * replicas))
            if in_flight >= share or (in_flight and time.monotonic() > started + 5):
                break
            time.sleep(0.1)
        killed = server.replica(victim)
        killed.kill()
        killed_at = time.monotonic()
        sender.join()
        results, wall = box["out"]
        rejoin_s = None
        while time.monotonic() < killed_at + args.startup_timeout:
            if healthy_workers(client) == replicas:
                rejoin_s = time.monotonic() - killed_at
                break
            time.sleep(0.2)
        # Where a cache-aware router sends prompts it has never seen depends on its trees, so the restarted
        # replica's own answer is the check; the fresh prompts through the router show where they went.
        restarted = client.post(f"{replica_url(client, server.metrics_url, victim)}/v1/completions",
                                json={"prompt": "Hello", "max_tokens": 2}).status_code == 200
        before = replica_metrics(client, server.metrics_url)
        fresh = pool_fillers(4 * replicas * 256, 257, vocab_size, args.seed + 99)  # distinct 256-token prompts
        asyncio.run(run_load(server.url, headers, fresh, [Planned(i, False, None) for i in range(len(fresh))],
                             len(fresh)))
        after = replica_metrics(client, server.metrics_url)
    finished = "pagedgraph_requests_finished_total"  # no sample yet on a replica that has finished none
    served = {r: after[r].get(finished, 0.0) - before.get(r, {}).get(finished, 0.0) for r in after}
    cut = [r for item, r in zip(load, results) if _cut_stream(item, r)]
    other = [r for item, r in zip(load, results) if r.outcome == "error" and not _cut_stream(item, r)]
    completed = [r for r in results if r.outcome == "completed"]
    mismatched = [r for r in completed if r.spec in answers and r.texts != answers[r.spec]]
    return {"replicas": replicas, "killed_replica": victim, "killed_in_flight": int(in_flight),
            "requests": len(results), "completed": len(completed), "streams_cut_on_killed": len(cut),
            "errors_elsewhere": len(other), "mismatches": len(mismatched), "wall_s": round(wall, 2),
            "rejoin_s": None if rejoin_s is None else round(rejoin_s, 2), "fresh_requests_by_replica": served,
            "restarted_answers": restarted, "full_strength": rejoin_s is not None and restarted,
            "first_errors": [asdict(r) for r in (other or cut)[:5]]}


def run_kill(args: argparse.Namespace) -> dict[str, Any]:
    deployment, headers, manifest, server = start(args)
    try:
        report = kill_under_load(server, args, headers, manifest.model.vocab_size)
    finally:
        exit_code = server.stop(args.settle_timeout + deployment.server.drain_timeout_s)
    report.update(config=args.config, concurrency=args.concurrency, exit_code=exit_code,
                  server_log=str(server.log_path))
    checks = {"errors_elsewhere": report["errors_elsewhere"] == 0, "mismatches": report["mismatches"] == 0,
              "streams_cut": report["streams_cut_on_killed"] <= report["killed_in_flight"],
              "full_strength": report["full_strength"], "exit_code": exit_code == 0}
    report["failed_checks"] = [name for name, ok in checks.items() if not ok]
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="deployment YAML (as for `pagedgraph serve`)")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=64, help="clients sending at once")
    parser.add_argument("--cancel-fraction", type=float, default=0.2, help="share of requests cancelled mid-way")
    parser.add_argument("--specs", type=int, default=24, help="distinct request bodies the requests draw from")
    parser.add_argument("--max-tokens", type=int, default=64, help="the longest max_tokens a request asks for")
    parser.add_argument("--warmup", type=int, default=64, help="requests sent (like the load) before measuring")
    parser.add_argument("--rss-tolerance", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--startup-timeout", type=float, default=300.0)
    parser.add_argument("--settle-timeout", type=float, default=60.0, help="how long the server may take to idle")
    parser.add_argument("--kill-replica", type=int, dest="kill_replica",
                        help="a fleet (the deployment's fleet section): SIGKILL this local replica (-1: the one "
                             "holding the most requests) under the load, then check that only its streams failed "
                             "and that it rejoins (no cancellations)")
    parser.add_argument("--json", help="write the report here")
    args = parser.parse_args(argv)
    report = run(args) if args.kill_replica is None else run_kill(args)
    text = json.dumps(report, indent=2)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text + "\n")
    print(text)
    if report["failed_checks"]:
        print(f"FAILED: {', '.join(report['failed_checks'])}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
