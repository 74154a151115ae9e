"""Memory: all buckets share one copy of the weights, and a long prefill step's transients stay small."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.paths import REPO

pytestmark = pytest.mark.e2e
PROBE = """
import os, sys
from pagedgraph.runtime.engine import EngineConfig, LLMEngine
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
before = rss()
LLMEngine(sys.argv[1], EngineConfig(num_blocks=64, max_model_len=1008))  # 64 blocks: the zeroed pools add ~23 MB at most
print(rss() - before)
"""


def _probe(script: str, artifact: Path) -> int:
    """Bytes the script prints last, run in a fresh process so its RSS is the engine's alone."""
    result = subprocess.run([sys.executable, "-c", script, str(artifact)], capture_output=True, text=True,
                            timeout=300, cwd=REPO)
    assert result.returncode == 0, result.stderr
    return int(result.stdout.split()[-1])


def test_weights_resident_once(smollm2_artifact: Path) -> None:
    weights = (smollm2_artifact / "graphs" / "weights.bin").stat().st_size
    grown = _probe(PROBE, smollm2_artifact)
    # Two sessions, or one prepacked copy per family, would be >= 2x the weights.
    assert grown < 1.4 * weights, f"loading grew RSS by {grown / 1e6:.0f} MB for {weights / 1e6:.0f} MB of weights"


# An engine past its first step, its pools touched, so what a probe measures next is one step's own memory.
WARM_ENGINE = """
import sys
from pagedgraph.runtime.engine import EngineConfig, LLMEngine
from pagedgraph.runtime.sampling_params import SamplingParams
engine = LLMEngine(sys.argv[1], EngineConfig(num_blocks=128))
for pool in engine.runner.executor.pools.values():
    pool.fill(0)
params = SamplingParams(max_tokens=1, temperature=0)
engine.add_request(list(range(100, 110)), params)
while engine.has_unfinished():
    engine.step()
"""

PREFILL_PROBE = WARM_ENGINE + """
def hwm():
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM:"))
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak so far (loading's) is reset to the current RSS: what follows is the step's alone
before = hwm()
engine.add_request(list(range(100, 1123)), params)
engine.step()
print(hwm() - before)
"""


def test_long_prefill_transients_stay_small(smollm2_artifact: Path) -> None:
    """A 1,023-token prefill step peaks at ~42 MiB over the loaded engine (the MLP's [T, 3072] rows).

    Attention runs one 64-query tile at a time (2.4 MB of scores); with all 16 tiles' scores
    alive at once, [16, 3, 192, 1024] floats each, this step grew RSS by 154 MiB.
    """
    grown = _probe(PREFILL_PROBE, smollm2_artifact)
    assert grown < 80 * 2**20, f"a 1,023-token prefill step grew peak RSS by {grown / 2**20:.0f} MiB"


MAPPED_PROBE = """
import sys
from pagedgraph.runtime.engine import EngineConfig, LLMEngine
engine = LLMEngine(sys.argv[1], EngineConfig(num_blocks=64, max_model_len=1008))  # kept: its session holds the mapping
resident, in_weights = 0, False
for line in open("/proc/self/smaps"):
    fields = line.split()
    if "-" in fields[0] and len(fields) >= 5:
        in_weights = line.rstrip().endswith("weights.bin")
    elif in_weights and fields[0] == "Rss:":
        resident += int(fields[1]) * 1024
print(resident)
"""


def test_prepacked_weights_file_pages_are_given_back(smollm2_artifact: Path, tmp_path: Path) -> None:
    """ORT keeps weights.bin mapped after prepacking its weights into its own buffers; the engine pages the file
    out once the session is built (executor_ort.page_out_weights), so the pages prepacking read do not stay
    resident beside the packed copies (without it: the 113 MB fp32 embedding and more, ~117 MiB). The probe loads a
    copy of its own: pages that other processes map (other test workers' engines) are not its to give back."""
    own = shutil.copytree(smollm2_artifact, tmp_path / "artifact")
    weights = (own / "graphs" / "weights.bin").stat().st_size
    resident = _probe(MAPPED_PROBE, own)
    assert resident < 0.05 * weights, f"{resident / 2**20:.0f} MiB of weights.bin resident after loading"


RELEASE_PROBE = WARM_ENGINE + """
def anonymous():
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("RssAnon:"))
before = anonymous()
engine.add_request(list(range(100, 1123)), params)
engine.step()
print(anonymous() - before)
"""


def test_a_long_prefill_step_gives_its_activations_back(smollm2_artifact: Path) -> None:
    """Once a 1,023-token prefill step returns, its activations are no longer resident.

    ORT's arena kept every region it grew, so the longest step's activations stayed for good (+41 MiB here, more
    on the bench's 2,048-token gears); the executor's run option frees the unused regions after each step and
    glibc unmaps them (executor_ort.run_options, unmap_large_blocks)."""
    grown = _probe(RELEASE_PROBE, smollm2_artifact)
    assert grown < 12 * 2**20, f"a 1,023-token prefill step left {grown / 2**20:.0f} MiB of anonymous memory resident"


RANDOM_PROBE = """
import sys
from pagedgraph.runtime.engine import EngineConfig, LLMEngine
engine = LLMEngine(sys.argv[1], EngineConfig(num_blocks=64, max_model_len=1008))  # kept: its session holds the mappings
mappings, advised, in_weights = 0, 0, False
for line in open("/proc/self/smaps"):
    fields = line.split()
    if "-" in fields[0] and len(fields) >= 5:
        in_weights = line.rstrip().endswith("weights.bin")
        mappings += in_weights
    elif in_weights and fields[0] == "VmFlags:":
        advised += "rr" in fields[1:]
print(mappings - advised)
"""


def test_weights_file_is_read_at_random(smollm2_artifact: Path) -> None:
    """Every weights.bin mapping is advised MADV_RANDOM (smaps flag `rr`): the embedding's Gather reads scattered
    rows, and with read-around each fault mapped ~64 KiB of neighbouring rows (a random-token workload brought back
    nearly all of the 113 MB float32 table; docs/performance.md, "Memory")."""
    assert _probe(RANDOM_PROBE, smollm2_artifact) == 0, "weights.bin mappings without MADV_RANDOM"
