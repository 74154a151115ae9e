#!/usr/bin/env python
"""One replica with N cores against N one-core replicas behind vllm-router, on `pagedgraph bench --url`.

    python scripts/fleet_bench.py --config DEPLOY.yaml --replicas 2 --requests 64 --prefixes 8 \\
        --json docs/bench/fleet.json

In one invocation: the deployment as one server on N cores, then as a fleet of N one-core replicas with
the router's cache_aware policy, then with round_robin, each answering the same shared-prefix chats
(`--prefixes` system prompts); then the router's added latency: `--latency-requests` chats through the
router and as many straight to the replica it routes them to, one at a time, alternating request by
request (`--latency-only` runs this part alone). Prints the ratios the fleet's targets are stated in
(docs/scale-out.md).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx
import yaml

from loadtest import ServerProcess, replica_metrics, replica_url

from pagedgraph.runtime.bench.http import UrlOptions, alternating_ttft, run_url_bench, url_table


def _config(base: dict[str, Any], folder: Path, name: str, cores: int, **fleet: Any) -> str:
    data = {**base, "server": {**base.get("server", {}), "port": 0},
            "executor": {**base.get("executor", {}), "threads": cores}}
    if fleet:
        data["fleet"] = fleet
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def _bench(url: str, args: argparse.Namespace, **options: Any) -> dict[str, Any]:
    results = run_url_bench(UrlOptions(url, **{"requests": args.requests, "prefixes": args.prefixes,
                                               "seed": args.seed, **options}))
    print(url_table(results), flush=True)
    return results


def _served(fleet: ServerProcess) -> dict[str, float]:
    with httpx.Client(timeout=10) as client:
        return {r: m.get("pagedgraph_requests_finished_total", 0.0)
                for r, m in replica_metrics(client, fleet.metrics_url).items()}


def _router_latency(fleet: ServerProcess, args: argparse.Namespace) -> dict[str, Any]:
    """Router against direct on the replica the router picks for the latency chats' system prompt."""
    seed = args.seed + 100
    before = _served(fleet)
    alternating_ttft({"router": fleet.url}, 0, seed=seed)  # its one warm-up chat puts the prompt on a replica
    primed = _served(fleet)
    replica = max(primed, key=lambda r: primed[r] - before.get(r, 0.0))
    with httpx.Client(timeout=10) as client:
        direct = replica_url(client, fleet.metrics_url, int(replica))
    out = alternating_ttft({"router": fleet.url, "direct": direct}, args.latency_requests, seed=seed)
    served = _served(fleet)
    out["replica"], out["requests_by_replica"] = replica, {r: v - primed.get(r, 0.0) for r, v in served.items()}
    p50 = out["ttft_p50_s"]
    print(f"router latency: TTFT p50 {p50['router']:.3f} s through the router, {p50['direct']:.3f} s straight to "
          f"replica {replica} ({args.latency_requests} chats each; load {out['load_avg_1m']})", flush=True)
    return out


def _fleet(base: dict[str, Any], folder: Path, policy: str, n: int) -> ServerProcess:
    return ServerProcess(_config(base, folder, policy, 1, data_parallel_size=n, cores_per_replica=1,
                                 router={"policy": policy}), 300)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="deployment YAML of one replica (its fleet section ignored)")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prefixes", type=int, default=8)
    parser.add_argument("--latency-requests", type=int, default=32, help="router-latency chats per side")
    parser.add_argument("--latency-only", action="store_true", help="only the router latency (cache_aware fleet)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write every run's figures here")
    args = parser.parse_args(argv)
    base = yaml.safe_load(Path(args.config).read_text())
    base.pop("fleet", None)
    base["model"]["artifact"] = str((Path(args.config).parent / base["model"]["artifact"]).resolve())
    n = args.replicas
    out: dict[str, Any] = {"config": args.config, "replicas": n, "load_avg_1m_at_start": os.getloadavg()[0],
                           "cpu_flags": next((line.split(":", 1)[1].split() for line in
                                              Path("/proc/cpuinfo").read_text().splitlines()
                                              if line.startswith("flags")), [])}
    with tempfile.TemporaryDirectory(prefix="fleet-bench-") as tmp:
        folder = Path(tmp)
        if not args.latency_only:
            single = ServerProcess(_config(base, folder, "single", n), 300)
            try:
                out["single"] = _bench(single.url, args)
            finally:
                single.stop(60)
        for policy in ("cache_aware",) if args.latency_only else ("cache_aware", "round_robin"):
            fleet = _fleet(base, folder, policy, n)
            try:
                if not args.latency_only:
                    before = _served(fleet)
                    out[policy] = _bench(fleet.url, args)
                    out[policy]["requests_by_replica"] = {r: v - before.get(r, 0.0) for r, v in _served(fleet).items()}
                if policy == "cache_aware":
                    out["router_latency"] = _router_latency(fleet, args)
            finally:
                fleet.stop(90)
    p50 = out["router_latency"]["ttft_p50_s"]
    out["ratios"] = {"ttft_p50_router_over_direct": p50["router"] / p50["direct"]}
    if not args.latency_only:
        one, ca, rr = out["single"], out["cache_aware"], out["round_robin"]
        out["ratios"].update({
            "hit_rate_cache_aware_over_single": ca["prefix_hit_rate"] / one["prefix_hit_rate"],
            "hit_rate_round_robin_over_single": rr["prefix_hit_rate"] / one["prefix_hit_rate"],
            "output_tok_s_cache_aware_over_single": ca["output_tok_s"] / one["output_tok_s"],
            "lost": one["lost"] + ca["lost"] + rr["lost"]})
    out["load_avg_1m_at_end"] = os.getloadavg()[0]
    print(json.dumps(out["ratios"], indent=2))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
