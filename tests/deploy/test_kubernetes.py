"""deploy/kubernetes/pagedgraph-fleet.yaml: parsed and checked against pagedgraph's and vllm-router's own parsers.

Nothing here runs Kubernetes: the checks are what a wrong edit would break (a replica config the server
refuses, router flags vllm-router refuses, selectors that match no pod, ports that do not line up).
"""
from __future__ import annotations

from typing import Any

import pytest
import yaml

from pagedgraph.artifact.settings import validate
from pagedgraph.cli import _parser
from pagedgraph.runtime.deploy_config import Deployment
from tests.paths import REPO

pytestmark = pytest.mark.unit
MANIFEST = REPO / "deploy" / "kubernetes" / "pagedgraph-fleet.yaml"


@pytest.fixture(scope="module")
def objects() -> dict[tuple[str, str], dict[str, Any]]:
    docs = [doc for doc in yaml.safe_load_all(MANIFEST.read_text()) if doc]
    return {(doc["kind"], doc["metadata"]["name"]): doc for doc in docs}


def _container(workload: dict[str, Any]) -> dict[str, Any]:
    (container,) = workload["spec"]["template"]["spec"]["containers"]
    return container


def _pod_labels(workload: dict[str, Any]) -> dict[str, str]:
    labels = workload["spec"]["template"]["metadata"]["labels"]
    assert workload["spec"]["selector"]["matchLabels"].items() <= labels.items()
    return labels


def test_each_replica_pod_serves_the_configmaps_deployment_on_its_probed_port(objects: dict) -> None:
    replica = objects["Deployment", "pagedgraph-replica"]
    container = _container(replica)
    args = _parser().parse_args(container["command"][1:])
    assert args.command == "serve" and args.data_parallel_size is None  # one replica per pod
    (mount,) = container["volumeMounts"]
    volume = {v["name"]: v for v in replica["spec"]["template"]["spec"]["volumes"]}[mount["name"]]
    config_map = objects["ConfigMap", volume["configMap"]["name"]]
    name = args.config.removeprefix(mount["mountPath"] + "/")
    deployment = validate(Deployment, yaml.safe_load(config_map["data"][name]), str(MANIFEST))
    assert not deployment.fleet.active and deployment.server.host == "0.0.0.0"
    (port,) = container["ports"]
    assert port["containerPort"] == deployment.server.port
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": port["name"]}
    resources = container["resources"]
    cpus = resources["requests"]["cpu"]
    assert cpus == resources["limits"]["cpu"] and cpus.isdigit()  # Guaranteed, whole cores: pinned by the kubelet
    assert deployment.executor.threads == int(cpus)
    grace = replica["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > deployment.server.drain_timeout_s


def test_the_router_finds_the_replicas_by_label_and_checks_their_health(objects: dict) -> None:
    launch = pytest.importorskip("vllm_router.launch_router")
    router = objects["Deployment", "pagedgraph-router"]
    container = _container(router)
    assert container["command"] == ["vllm-router"]
    parsed = launch.parse_router_args(container["args"])  # vllm-router's own parser: a bad flag fails here
    replica = objects["Deployment", "pagedgraph-replica"]
    assert parsed.service_discovery and parsed.selector.items() <= _pod_labels(replica).items()
    assert parsed.selector != {} and parsed.service_discovery_port == _container(replica)["ports"][0]["containerPort"]
    assert parsed.health_check_endpoint == "/health" and parsed.health_check_interval_secs == 1
    assert parsed.policy == "cache_aware"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert (ports["http"], ports["metrics"]) == (parsed.port, parsed.prometheus_port)
    account = router["spec"]["template"]["spec"]["serviceAccountName"]
    binding = objects["RoleBinding", account]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account}]
    (rule,) = objects["Role", binding["roleRef"]["name"]]["rules"]
    assert "pods" in rule["resources"] and {"list", "watch"} <= set(rule["verbs"])


def test_the_service_exposes_the_router(objects: dict) -> None:
    service = objects["Service", "pagedgraph"]
    router = objects["Deployment", "pagedgraph-router"]
    assert service["spec"]["selector"].items() <= _pod_labels(router).items()
    names = {p["name"] for p in _container(router)["ports"]}
    assert all(p["targetPort"] in names for p in service["spec"]["ports"])
