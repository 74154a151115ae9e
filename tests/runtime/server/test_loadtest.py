"""scripts/loadtest.py in a reduced size: concurrent, cancelled and streamed requests lose and leak nothing."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.paths import REPO



def test_the_load_script_finds_no_errors_mismatches_or_leaks(smollm2_artifact: Path, tmp_path: Path) -> None:
    config = tmp_path / "deploy.yaml"
    config.write_text(f"model: {{artifact: {smollm2_artifact}, name: smol}}\nkv_cache: {{num_blocks: 128}}\n"
                      "scheduler: {max_model_len: 512}\nexecutor: {threads: 2}\nserver: {api_key: load-key}\n")
    out = tmp_path / "load.json"
    run = subprocess.run([sys.executable, str(REPO / "scripts" / "loadtest.py"), "--config", str(config),
                          "--requests", "40", "--concurrency", "16", "--cancel-fraction", "0.25", "--specs", "8",
                          "--max-tokens", "24", "--warmup", "16", "--json", str(out)],
                         capture_output=True, text=True, timeout=600)
    assert out.is_file(), run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert run.returncode == 0, json.dumps(report, indent=1)
    assert (report["errors"], report["mismatches"], report["leaked_blocks"], report["exit_code"]) == (0, 0, 0, 0)
    assert report["failed_checks"] == []
    assert report["completed"] + report["cancelled"] == 40 and report["cancelled"] > 0
    assert report["greedy_compared"] > 10 and report["prefix_cache_hit_tokens"] > 0
    assert report["requests_per_s"] > 0 and report["p99_latency_s"] >= report["p50_latency_s"] > 0
    assert abs(report["rss_growth"]) <= 0.05
