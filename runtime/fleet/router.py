"""vllm-router's command line for a fleet (the router is vLLM's, from PyPI: `pip install pagedgraph[fleet]`).

The router routes by the request text (cache_aware keeps a prefix tree per replica), health-checks each
replica's /health, retries a request on another replica while its response has not started, and
forwards the client's Authorization header, so a deployment's `server.api_key` holds through it.
"""
from __future__ import annotations

import importlib.util
import sys

from ...artifact.settings import ConfigError
from ..deploy_config import RouterSection
from .plan import LOOPBACK, FleetPlan

ROUTER_MODULE = "vllm_router.launch_router"
ROUTER_PACKAGE = "vllm-router"


def router_command(plan: FleetPlan, router: RouterSection, startup_timeout_s: float) -> list[str]:
    if importlib.util.find_spec("vllm_router") is None:
        raise ConfigError(f"fleet: the router ({ROUTER_PACKAGE}) is not installed: pip install 'pagedgraph[fleet]' "
                          f"(or pip install {ROUTER_PACKAGE}), or serve one replica (fleet.data_parallel_size: 1)")
    return [sys.executable, "-m", ROUTER_MODULE,
            "--host", plan.router_host, "--port", str(plan.router_port),
            "--worker-urls", *(r.url for r in plan.replicas),
            "--policy", router.policy, "--cache-threshold", str(router.cache_threshold),
            "--health-check-endpoint", "/health",
            "--health-check-interval-secs", str(router.health_check_interval_s),
            "--health-failure-threshold", str(router.health_failure_threshold),
            "--health-success-threshold", str(router.health_success_threshold),
            "--cb-timeout-duration-secs", str(router.circuit_open_s), "--retry-max-retries", str(router.max_retries),
            "--worker-startup-timeout-secs", str(int(startup_timeout_s)), "--worker-startup-check-interval", "1",
            "--prometheus-host", LOOPBACK, "--prometheus-port", str(plan.router_metrics_port),
            "--log-level", "warning", *router.extra_args]
