"""The fleet's /metrics: every replica's, scraped when this is scraped and labelled `replica`, plus the router's.

vllm-router forwards /metrics to one replica and keeps its own on a separate port, so a fleet of N
would otherwise need N + 1 scrape targets. A replica that does not answer shows as
`pagedgraph_fleet_replica_up{replica} 0` and contributes nothing else to that scrape.
"""
from __future__ import annotations

import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from .plan import FleetPlan

SCRAPE_TIMEOUT_S = 5.0


def _fetch(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=SCRAPE_TIMEOUT_S) as response:
            return response.read().decode()
    except (urllib.error.URLError, OSError, ValueError):
        return None


class FleetCollector:
    def __init__(self, plan: FleetPlan) -> None:
        self.replicas = [(str(r.index), r.url) for r in plan.replicas]
        self.router = f"http://127.0.0.1:{plan.router_metrics_port}/metrics"
        self._pool = ThreadPoolExecutor(len(self.replicas) + 1, thread_name_prefix="fleet-scrape")

    def collect(self) -> Iterator[Metric]:
        texts = list(self._pool.map(_fetch, [f"{url}/metrics" for _, url in self.replicas] + [self.router]))
        up = GaugeMetricFamily("pagedgraph_fleet_replica_up", "1 if the replica answered this scrape, else 0.",
                               labels=["replica", "url"])
        merged: dict[str, Metric] = {}
        for (replica, url), text in zip(self.replicas, texts):
            up.add_metric([replica, url], 0.0 if text is None else 1.0)
            for family in text_string_to_metric_families(text or ""):
                into = merged.setdefault(family.name, Metric(family.name, family.documentation, family.type))
                for sample in family.samples:
                    into.add_sample(sample.name, {**sample.labels, "replica": replica}, sample.value,
                                    sample.timestamp, sample.exemplar)
        yield up
        yield from merged.values()
        yield from text_string_to_metric_families(texts[-1] or "")


def serve_metrics(plan: FleetPlan) -> WSGIServer:
    """The merged /metrics on plan.metrics_port, in a daemon thread of prometheus_client's; `shutdown()` stops it."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(FleetCollector(plan))
    return start_http_server(plan.metrics_port, addr=plan.router_host, registry=registry)[0]
