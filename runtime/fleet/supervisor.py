"""`pagedgraph serve` with more than one replica: start the replicas and the router, keep them up, drain them.

Start: each local replica is `pagedgraph serve` on this deployment (fleet section cleared, its port,
its cores, intra-op threads = cores), all loading at once; once every /health answers, the router
starts in front of them (remote `fleet.replica_urls` included) and the merged /metrics begins. A
local replica that exits is restarted on the same port and cores, with a backoff, and rejoins when
the router's health check sees it (`fleet.restart`). The first SIGTERM or SIGINT drains: every local
replica gets SIGTERM (each answers new requests and /health with 503 and finishes its running ones,
`server.drain_timeout_s`), then the router stops. A second signal kills everything at once.
"""
from __future__ import annotations

import logging
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import FrameType

import yaml

from ...artifact.manifest import Manifest
from ...artifact.settings import ConfigError
from ..deploy_config import Deployment
from ..kv_pools import PoolRequest, bytes_per_block, free_memory_bytes, pool_blocks, weights_bytes
from .metrics import serve_metrics
from .plan import LOOPBACK, FleetPlan, ReplicaPlan, plan_fleet
from .process import Child, wait_ready
from .router import router_command

log = logging.getLogger("pagedgraph.fleet")
RESTART_BACKOFF_S = (1.0, 2.0, 5.0, 10.0, 30.0)  # after the 1st, 2nd, ... exit in a row
STABLE_S = 60.0  # a replica up this long has its backoff reset
ROUTER_STOP_S = 10.0


def replica_deployment(deployment: Deployment, replica: ReplicaPlan, num_blocks: int | None = None) -> dict:
    """The YAML a local replica serves: this deployment without its fleet, on its port, threads = its cores, and
    `num_blocks` when given. The API key stays out of the file (the replica reads $PAGEDGRAPH_API_KEY)."""
    data = deployment.model_dump(mode="json", exclude={"fleet": True, "server": {"api_key"}})
    data["server"].update(host=LOOPBACK, port=replica.port)
    if replica.cores is not None and deployment.executor.threads is None:
        data["executor"]["threads"] = len(replica.cores)
    if num_blocks is not None:
        data["kv_cache"]["num_blocks"] = num_blocks
    return data


def kv_share(deployment: Deployment, replicas: int, free_bytes: int | None = None) -> int | None:
    """Each local replica's KV pool in blocks when the deployment sets no size: the default of one server
    (kv_pools.pool_blocks) with the free memory split between the replicas, which start together and would each
    count all of it. `free_bytes`: default kv_pools.free_memory_bytes()."""
    kv, scheduler = deployment.kv_cache, deployment.scheduler
    if kv.num_blocks is not None or kv.kv_cache_bytes is not None or replicas < 2:
        return None
    artifact = Path(deployment.model.artifact)
    manifest = Manifest.load(artifact, verify=False)
    weights = weights_bytes(artifact)
    request = PoolRequest(bytes_per_block(manifest, manifest.kv_cache_dtype(kv.dtype, artifact)), manifest.block_size,
                          scheduler.max_model_len or manifest.max_model_len, scheduler.max_num_seqs,
                          weights_bytes=weights)
    free = free_memory_bytes() if free_bytes is None else free_bytes
    return pool_blocks(request, (free - (replicas - 1) * weights) // replicas)


class Fleet:
    def __init__(self, deployment: Deployment, plan: FleetPlan) -> None:
        self.deployment = deployment
        self.plan = plan
        self.stop = threading.Event()
        self._killed = False
        self._dir = Path(tempfile.mkdtemp(prefix="pagedgraph-fleet-"))
        env = {"PAGEDGRAPH_API_KEY": deployment.server.api_key} if deployment.server.api_key else {}
        self.replicas: list[tuple[ReplicaPlan, Child]] = []
        local = [replica for replica in plan.replicas if replica.local]
        blocks = kv_share(deployment, len(local))
        if blocks is not None:
            log.info("KV pool per replica: %d blocks (kv_cache.num_blocks; one server's default with the free memory "
                     "split %d ways); set kv_cache.num_blocks or kv_cache_bytes to choose", blocks, len(local))
        for replica in local:
            config = self._dir / f"replica-{replica.index}.yaml"
            config.write_text(yaml.safe_dump(replica_deployment(deployment, replica, blocks), sort_keys=False))
            command = [sys.executable, "-m", "pagedgraph.cli", "serve", "--config", str(config)]
            self.replicas.append((replica, Child(f"replica {replica.index}", command, replica.cores, env)))
        fleet = deployment.fleet
        self.router = Child("router", router_command(plan, fleet.router, fleet.startup_timeout_s),
                            env={"RUST_LOG": "warn"})  # its per-request info lines off; warnings and errors show
        self._metrics = None

    # -- start ------------------------------------------------------------------------------------
    def start(self) -> None:
        timeout = self.deployment.fleet.startup_timeout_s
        for replica, child in self.replicas:
            child.start()
            log.info("replica %d: pid %d on %s, cores %s", replica.index, child.pid, replica.url,
                     "unpinned" if replica.cores is None else ",".join(map(str, replica.cores)))
        for replica, child in self.replicas:
            wait_ready(child, f"{replica.url}/health", timeout, self.stop)
        self.router.start()
        wait_ready(self.router, f"{self.plan.router_url}/readiness", timeout, self.stop)
        self._metrics = serve_metrics(self.plan)
        router = self.deployment.fleet.router
        log.info("listening on %s (OpenAI API under /v1): vllm-router, policy %s, over %d replicas (%s); every "
                 "replica's /metrics on http://%s:%d/metrics", self.plan.router_url, router.policy,
                 len(self.plan.replicas), ", ".join(r.url for r in self.plan.replicas), self.plan.router_host,
                 self.plan.metrics_port)

    # -- run --------------------------------------------------------------------------------------
    def watch(self) -> None:
        """Restart local replicas that exit; returns when `stop` is set. A router that exits stops the fleet."""
        exits = {replica.index: 0 for replica, _ in self.replicas}
        due: dict[int, float] = {}
        up_since = {replica.index: time.monotonic() for replica, _ in self.replicas}
        while not self.stop.wait(0.2):
            if self.router.poll() is not None:
                raise RuntimeError(self.router.failure(f"exited with status {self.router.poll()}"))
            now = time.monotonic()
            for replica, child in self.replicas:
                i = replica.index
                if child.poll() is None:
                    if now - up_since[i] > STABLE_S:
                        exits[i] = 0
                    continue
                if i not in due:
                    delay = RESTART_BACKOFF_S[min(exits[i], len(RESTART_BACKOFF_S) - 1)]
                    exits[i] += 1
                    if not self.deployment.fleet.restart:
                        log.error("replica %d (pid %d) exited with status %s; fleet.restart is off, the router "
                                  "routes around it", i, child.pid, child.poll())
                        due[i] = float("inf")
                        continue
                    log.warning("replica %d (pid %d) exited with status %s; restarting it in %.0f s", i, child.pid,
                                child.poll(), delay)
                    due[i] = now + delay
                elif now >= due[i]:
                    del due[i]
                    child.start()
                    up_since[i] = now
                    log.info("replica %d restarted: pid %d on %s (it rejoins once the router's health check "
                             "passes)", i, child.pid, replica.url)

    # -- stop -------------------------------------------------------------------------------------
    def on_signal(self, sig: int, frame: FrameType | None) -> None:
        if self.stop.is_set():
            log.warning("signal %d again: killing the fleet", sig)
            self._killed = True
            for _, child in self.replicas:
                child.kill()
            self.router.kill()
            return
        log.info("signal %d: draining %d replicas (new requests get 503; running ones have %s s to finish)", sig,
                 len(self.replicas), self.deployment.server.drain_timeout_s)
        self.stop.set()

    def shutdown(self) -> int:
        """Drain the local replicas, then stop the router; 0 when every replica exited cleanly."""
        self.stop.set()
        for _, child in self.replicas:
            child.terminate()
        grace = self.deployment.server.drain_timeout_s + 15.0
        statuses = [child.wait(grace) if child.proc is not None else 0 for _, child in self.replicas]
        self.router.terminate()
        if self.router.proc is not None:
            self.router.wait(ROUTER_STOP_S)
        if self._metrics is not None:
            self._metrics.shutdown()
        for path in self._dir.iterdir():
            path.unlink()
        self._dir.rmdir()
        log.info("fleet stopped: replica exit statuses %s", statuses)
        return 0 if all(s == 0 for s in statuses) and not self._killed else 1


def run_fleet(deployment: Deployment) -> int:
    """Start, watch and drain the fleet of `deployment`; the process's exit status."""
    if not deployment.fleet.active:
        raise ConfigError("fleet: data_parallel_size 1 and no replica_urls is one server: `pagedgraph serve`")
    fleet = Fleet(deployment, plan_fleet(deployment))
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, fleet.on_signal)
    failed = False
    try:
        fleet.start()
        fleet.watch()
    except RuntimeError as exc:  # a part failed to start, or the router exited: not a drain
        failed = not fleet.stop.is_set()
        if failed:
            log.error("%s", exc)
    finally:
        status = fleet.shutdown()
    return 1 if failed else status
