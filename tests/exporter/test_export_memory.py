"""Export memory is bounded by the largest tensor, not by the model: a generated checkpoint of a few hundred MB
(scripts/make_checkpoint.py: 32 layers 512 wide, SmolLM2's 49k vocabulary, untied, float16) is exported in a child
process, whose peak RSS (resource.getrusage(RUSAGE_CHILDREN) in its parent) must stay within a bound set from the
tensor sizes: the interpreter with the exporter's libraries loaded (a child that imports them and parses the
checkpoint's tokenizer) plus 3.5 times the largest float32 graph weight (the embedding: its float32 copy, the
float16 source mapped while read, the quantizer's chunks). The model's float32 weights are 1.9x that margin; an
exporter holding every tensor at once fails it (docs/performance.md, "Real model sizes")."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.make_checkpoint import Preset, write_checkpoint
from tests.paths import REPO

pytestmark = pytest.mark.slow
SHAPE = Preset("llama", dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=32, num_attention_heads=8,
                             num_key_value_heads=2, tie_word_embeddings=False, max_position_embeddings=2048,
                             rope_theta=10000.0, rms_norm_eps=1e-5))
LADDER = {"max_model_len": 512, "buckets": {"decode_batch": [1, 4], "prefill_tokens": [64, 512], "prefill_max_seqs": 4}}
MiB = 1 << 20

EXPORT = """
import io, json, sys
from pagedgraph.exporter.config import ExportConfig
from pagedgraph.texts import shipped_text
config, out, slice_bytes = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3])
if out == "-":  # the baseline: the exporter's libraries loaded and the checkpoint's tokenizer parsed
    import onnxruntime, pagedgraph.exporter.export, tokenizers
    tokenizers.Tokenizer.from_file(config["model"]["source"] + "/tokenizer.json")
else:
    from pagedgraph.exporter.export import export
    if slice_bytes:  # calibration and the gear check a few layers at a time (exporter/onnx/slices.py)
        import pagedgraph.exporter.onnx.slices as slices
        slices.SLICE_BYTES = slice_bytes
    export(ExportConfig.model_validate(config), out, log=io.StringIO(), calibration_text=shipped_text("calibration"))
"""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("memory") / "ckpt", SHAPE, progress=False)


# The export runs in a grandchild started by this small process: a child's peak RSS includes its parent's at the
# fork (Linux keeps the high-water mark across exec), and pytest's own may be gigabytes.
MEASURE = """
import json, resource, subprocess, sys
code = subprocess.run([sys.executable, "-c", *sys.argv[1:]]).returncode
print(json.dumps({"returncode": code, "peak": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024}))
"""


def _peak_rss(config: dict, out: str, log: Path, slice_bytes: int = 0, timeout: float = 600) -> int:
    """Peak resident bytes of one process running EXPORT (resource.getrusage(RUSAGE_CHILDREN) of its parent)."""
    with log.open("w") as stderr:
        run = subprocess.run([sys.executable, "-c", MEASURE, EXPORT, json.dumps(config), out, str(slice_bytes)],
                             cwd=REPO, stdout=subprocess.PIPE, stderr=stderr, text=True, timeout=timeout)
    result = json.loads(run.stdout)
    assert result["returncode"] == 0, log.read_text()[-3000:]
    return result["peak"]


def _largest_float32_weight() -> int:
    """The embedding (and the LM head): vocabulary x hidden float32."""
    return 49152 * int(SHAPE.config["hidden_size"]) * 4  # type: ignore[call-overload]


@pytest.mark.parametrize("quantization", ["none", "w8a8"])
def test_export_peak_rss_follows_the_largest_tensor(checkpoint: Path, tmp_path: Path, quantization: str) -> None:
    config = {"model": {"source": str(checkpoint), "quantization": quantization},
              "export": {**LADDER, "verify_gears": False}}
    baseline = _peak_rss(config, "-", tmp_path / "baseline.log")
    peak = _peak_rss(config, str(tmp_path / "artifact"), tmp_path / "export.log")
    bound = baseline + 3.5 * _largest_float32_weight()
    weights = (tmp_path / "artifact" / "graphs" / "weights.bin").stat().st_size
    assert peak <= bound, (f"{quantization}: export peaked at {peak / MiB:.0f} MiB, over {bound / MiB:.0f} MiB "
                           f"(baseline {baseline / MiB:.0f} MiB; weights {weights / MiB:.0f} MiB)")


def test_calibration_and_gear_check_run_in_bounded_slices(checkpoint: Path, tmp_path: Path) -> None:
    """int8 KV-cache calibration and the gear check run a layer at a time (a 64 MiB slice budget: the embedding's
    and the LM head's slices are the largest, about 115 MB of weights); a session maps and prepacks its slice."""
    config = {"model": {"source": str(checkpoint), "quantization": "w8a8"},
              "export": {**LADDER, "kv_cache_dtypes": ["float32", "int8"]}}
    baseline = _peak_rss(config, "-", tmp_path / "baseline.log")
    peak = _peak_rss(config, str(tmp_path / "artifact"), tmp_path / "export.log", slice_bytes=64 * MiB)
    bound = baseline + 3.5 * _largest_float32_weight()
    assert peak <= bound, f"peaked at {peak / MiB:.0f} MiB, over {bound / MiB:.0f} MiB (baseline {baseline / MiB:.0f})"
    assert (tmp_path / "artifact" / "graphs" / "model.kv-int8.onnx").is_file()
