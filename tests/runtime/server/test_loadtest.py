"""scripts/loadtest.py in a reduced size: concurrent, cancelled and streamed requests lose and leak nothing, and
greedy ones return their solo text, at fp32 and at the shipped deployment's precision."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pagedgraph.artifact.settings import load_yaml
from pagedgraph.exporter.config import ExportConfig
from pagedgraph.runtime.deploy_config import load_deployment
from tests.paths import REPO

pytestmark = pytest.mark.e2e
SHIPPED = REPO / "configs" / "deploy-smollm2.yaml"


def _shipped_precision() -> tuple[str, str]:
    """The shipped deployment's weight quantization (from its export config) and KV-cache dtype."""
    deployment = load_deployment(SHIPPED)
    assert deployment.model.export_config is not None, f"{SHIPPED} must name the export config of its artifact"
    export = load_yaml(ExportConfig, deployment.model.export_config)
    return export.model.quantization, deployment.kv_cache.dtype


@pytest.mark.parametrize("precision", ["fp32", "shipped"])
def test_the_load_script_finds_no_errors_mismatches_or_leaks(precision: str, tmp_path: Path,
                                                             request: pytest.FixtureRequest) -> None:
    if precision == "fp32":
        artifact, kv_cache_dtype, expected = request.getfixturevalue("smollm2_artifact"), "float32", "float32 weights"
    else:
        quantization, kv_cache_dtype = _shipped_precision()
        assert quantization == "w8a8", "tests/conftest.py's smollm2_w8a8_artifact must follow the shipped export"
        artifact, expected = request.getfixturevalue("smollm2_w8a8_artifact"), f"{quantization} weights"
    config = tmp_path / "deploy.yaml"
    config.write_text(f"model: {{artifact: {artifact}, name: smol}}\n"
                      f"kv_cache: {{num_blocks: 128, dtype: {kv_cache_dtype}}}\n"
                      "scheduler: {max_model_len: 512}\nexecutor: {threads: 2}\nserver: {api_key: load-key}\n")
    out = tmp_path / "load.json"
    run = subprocess.run([sys.executable, str(REPO / "scripts" / "loadtest.py"), "--config", str(config),
                          "--requests", "40", "--concurrency", "16", "--cancel-fraction", "0.25", "--specs", "8",
                          "--max-tokens", "24", "--warmup", "16", "--json", str(out)],
                         capture_output=True, text=True, timeout=600)
    assert out.is_file(), run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert run.returncode == 0, json.dumps(report, indent=1)
    assert report["precision"] == f"{expected}, float32 compute, {kv_cache_dtype} KV"
    assert report["batch_variance"] is None
    assert (report["errors"], report["mismatches"], report["leaked_blocks"], report["exit_code"]) == (0, 0, 0, 0)
    assert report["failed_checks"] == []
    assert report["completed"] + report["cancelled"] == 40 and report["cancelled"] > 0
    assert report["greedy_compared"] > 10 and report["prefix_cache_hit_tokens"] > 0
    assert report["requests_per_s"] > 0 and report["p99_latency_s"] >= report["p50_latency_s"] > 0
    assert abs(report["rss_growth"]) <= 0.05
