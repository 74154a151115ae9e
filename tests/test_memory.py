"""All buckets share one copy of the weights in memory: RSS after loading stays near the weights' size."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

PROBE = """
import os, sys
from runtime.engine import EngineConfig, LLMEngine
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
before = rss()
LLMEngine(sys.argv[1], EngineConfig(num_blocks=64))  # 64 blocks: the zeroed pools add ~23 MB at most
print(rss() - before)
"""


def test_weights_resident_once(smollm2_artifact: Path) -> None:
    weights = (smollm2_artifact / "graphs" / "weights.bin").stat().st_size
    result = subprocess.run([sys.executable, "-c", PROBE, str(smollm2_artifact)], capture_output=True, text=True,
                            timeout=300, cwd=Path(__file__).parent.parent)
    assert result.returncode == 0, result.stderr
    grown = int(result.stdout.split()[-1])
    # Two sessions, or one prepacked copy per family, would be >= 2x the weights.
    assert grown < 1.4 * weights, f"loading grew RSS by {grown / 1e6:.0f} MB for {weights / 1e6:.0f} MB of weights"
