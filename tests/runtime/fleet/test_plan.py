"""The fleet's plan and the commands it starts, without starting anything."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from pagedgraph.artifact.settings import ConfigError
from pagedgraph.runtime.deploy_config import Deployment, KVCacheSection
from pagedgraph.runtime.fleet.plan import plan_fleet, split_cores
from pagedgraph.runtime.fleet.router import router_command
from pagedgraph.runtime.fleet.supervisor import kv_share, replica_deployment
from pagedgraph.artifact.manifest import Manifest
from pagedgraph.runtime.kv_pools import bytes_per_block, weights_bytes

pytestmark = pytest.mark.unit


def _deployment(**fleet: object) -> Deployment:
    return Deployment.model_validate({"model": {"artifact": "/a"}, "server": {"port": 9000, "api_key": "secret"},
                                      "fleet": fleet})


def test_cores_split_into_disjoint_sets_or_the_error_names_the_keys() -> None:
    assert split_cores([0, 1, 2, 3], 2, None) == [(0, 1), (2, 3)]
    assert split_cores([4, 5, 6], 3, 1) == [(4,), (5,), (6,)]
    with pytest.raises(ConfigError, match=r"data_parallel_size = 3: .* 2 cores \(\[0, 1\]\).*pin_cores: false"):
        split_cores([0, 1], 3, None)
    with pytest.raises(ConfigError, match="data_parallel_size = 2 x fleet.cores_per_replica = 2 needs 4 cores"):
        split_cores([0, 1, 2], 2, 2)


def test_a_replica_serves_the_deployment_without_its_fleet_on_its_port_and_cores() -> None:
    deployment = _deployment(data_parallel_size=2, pin_cores=False, replica_urls=["http://other:8000/"])
    plan = plan_fleet(deployment)
    assert [r.local for r in plan.replicas] == [True, True, False] and plan.replicas[2].url == "http://other:8000"
    assert (plan.router_port, plan.metrics_port) == (9000, 9001)
    local = plan.replicas[0]
    data = replica_deployment(deployment, local)
    assert "fleet" not in data and "api_key" not in data["server"]  # the key travels in the environment
    assert data["server"]["port"] == local.port and data["executor"]["threads"] is None  # unpinned: all cores
    assert Deployment.model_validate(yaml.safe_load(yaml.safe_dump(data))).server.port == local.port
    pinned = replica_deployment(deployment, local.__class__(0, local.url, local.port, (3, 4)), 640)
    assert pinned["executor"]["threads"] == 2 and pinned["kv_cache"]["num_blocks"] == 640


def test_replicas_split_the_free_memory_for_their_default_pools(tiny_artifact: Path) -> None:
    deployment = Deployment.model_validate({"model": {"artifact": str(tiny_artifact)},
                                            "scheduler": {"max_num_seqs": 4}})
    manifest = Manifest.load(tiny_artifact, verify=False)
    per_block = bytes_per_block(manifest)
    weights = weights_bytes(tiny_artifact)
    full = (4 * -(-manifest.max_model_len // manifest.block_size)) + 1  # every sequence at max_model_len
    assert kv_share(deployment, 2, 2 * weights + 1000 * full * per_block) == full  # plenty: one server's default
    # Each replica's share is (free - weights) / 2; after its own weights, half of what is left is the pool.
    assert kv_share(deployment, 2, 3 * weights + 2 * full * per_block) == full // 2
    assert kv_share(deployment, 1) is None
    assert kv_share(deployment.model_copy(update={"kv_cache": KVCacheSection(num_blocks=64)}), 2) is None


def test_the_router_gets_every_replica_and_checks_their_health_each_interval() -> None:
    launch = pytest.importorskip("vllm_router.launch_router")
    deployment = _deployment(data_parallel_size=2, pin_cores=False, router={"policy": "round_robin"})
    plan = plan_fleet(deployment)
    command = router_command(plan, deployment.fleet.router, 60)
    assert command[1:3] == ["-m", "vllm_router.launch_router"]
    parsed = launch.parse_router_args(command[3:])  # vllm-router's own parser
    assert parsed.worker_urls == [r.url for r in plan.replicas] and parsed.policy == "round_robin"
    assert (parsed.health_check_endpoint, parsed.health_check_interval_secs, parsed.health_failure_threshold) == \
        ("/health", 1, 1)
    assert (parsed.port, parsed.prometheus_port) == (plan.router_port, plan.router_metrics_port)


def test_one_replica_is_not_a_fleet_and_bad_fleet_values_are_named() -> None:
    assert not _deployment().fleet.active and _deployment(data_parallel_size=2).fleet.active
    assert _deployment(replica_urls=["http://a:1", "http://b:2"]).fleet.active
    with pytest.raises(ValueError, match="is not a URL"):
        _deployment(replica_urls=["a:1"])
