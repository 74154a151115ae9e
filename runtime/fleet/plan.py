"""Which cores and ports each part of a fleet gets, decided once before anything starts.

Local replicas listen on loopback ports chosen here and kept for the fleet's life, so a restarted
replica comes back at the URL the router already checks. Each gets its own cores: pinning keeps two
replicas' ONNX Runtime thread pools from contending for one core, and the replica's intra-op threads
are set to its core count.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from ...artifact.settings import ConfigError
from ..deploy_config import Deployment

LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class ReplicaPlan:
    index: int
    url: str
    port: int | None  # None: a replica elsewhere, not started by the fleet
    cores: tuple[int, ...] | None  # None: not pinned

    @property
    def local(self) -> bool:
        return self.port is not None


@dataclass(frozen=True)
class FleetPlan:
    replicas: tuple[ReplicaPlan, ...]
    router_host: str
    router_port: int
    router_metrics_port: int  # vllm-router's own Prometheus endpoint, on loopback
    metrics_port: int  # every replica's /metrics, labelled by replica

    @property
    def router_url(self) -> str:
        host = f"[{self.router_host}]" if ":" in self.router_host else self.router_host
        return f"http://{LOOPBACK if host in ('0.0.0.0', '[::]') else host}:{self.router_port}"


def free_port(host: str = LOOPBACK) -> int:
    """A port nothing listens on now (the OS's pick for port 0)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def split_cores(available: list[int], replicas: int, per_replica: int | None) -> list[tuple[int, ...]]:
    """Disjoint core sets, in core order; raises ConfigError naming the fleet keys when they do not fit."""
    per = per_replica or len(available) // replicas
    where = f"this process may use {len(available)} cores ({available})"
    share = "or set fleet.pin_cores: false to let the replicas share cores"
    if per < 1:
        raise ConfigError(f"fleet.data_parallel_size = {replicas}: {where}, fewer than one per replica; lower it, "
                          f"{share}")
    if per * replicas > len(available):
        raise ConfigError(f"fleet.data_parallel_size = {replicas} x fleet.cores_per_replica = {per} needs "
                          f"{per * replicas} cores: {where}; lower either, {share}")
    return [tuple(available[i * per:(i + 1) * per]) for i in range(replicas)]


def plan_fleet(deployment: Deployment) -> FleetPlan:
    fleet, server = deployment.fleet, deployment.server
    count = fleet.data_parallel_size
    cores: list[tuple[int, ...] | None] = [None] * count
    if fleet.pin_cores:
        cores = list(split_cores(sorted(os.sched_getaffinity(0)), count, fleet.cores_per_replica))
    local = []
    for i in range(count):
        port = free_port()
        local.append(ReplicaPlan(i, f"http://{LOOPBACK}:{port}", port, cores[i]))
    remote = [ReplicaPlan(count + i, url, None, None) for i, url in enumerate(fleet.replica_urls)]
    router_port = server.port or free_port(server.host)
    metrics_port = fleet.metrics_port if fleet.metrics_port is not None else (server.port + 1 if server.port else 0)
    return FleetPlan(tuple(local + remote), server.host, router_port, free_port(),
                     metrics_port or free_port(server.host))
