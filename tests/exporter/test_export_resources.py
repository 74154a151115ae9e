"""Export checks the disk and the memory before any work starts, and says what it needs (exporter/resources.py)."""
from __future__ import annotations

import io
import re
from pathlib import Path

import pytest

from pagedgraph.exporter import resources
from pagedgraph.exporter.config import ExportConfig
from pagedgraph.exporter.export import export
from pagedgraph.exporter.resources import ExportResourceError, Needs, check_resources, export_needs
from pagedgraph.graphs.config import ModelConfig
from tests.random_checkpoint import write_random_llama

pytestmark = pytest.mark.unit
GiB = 1 << 30
# LLaMA-2-7B's layout (scripts/make_checkpoint.py's 7b preset, 49k vocabulary)
LLAMA_7B = ModelConfig(architecture="llama", vocab_size=49152, hidden_size=4096, intermediate_size=11008,
                       num_layers=32, num_heads=32, num_kv_heads=32, head_dim=128, rms_norm_eps=1e-5,
                       rope_theta=10000.0, max_position_embeddings=4096, tie_word_embeddings=False)


def _needs(quantization: str, dtype: str = "float32") -> Needs:
    config = ExportConfig.model_validate({"model": {"quantization": quantization, "dtype": dtype},
                                          "export": {"max_model_len": 1024}})
    return export_needs(LLAMA_7B, config, checkpoint_bytes=int(12.8 * GiB))


def test_the_artifact_estimate_follows_the_precision() -> None:
    fp32, bf16, w8a8, w4a16 = (_needs("none").artifact, _needs("none", "bfloat16").artifact, _needs("w8a8").artifact,
                               _needs("w4a16").artifact)
    params = 6.7e9
    assert 4 * params <= fp32 <= 4.2 * params  # float32 weights and a margin for the graphs
    assert 2 * params <= bf16 < fp32 / 1.9
    assert params <= w8a8 <= 1.3 * params
    assert 0.5 * params <= w4a16 < w8a8
    assert _needs("none").memory < 5 * GiB  # a slice of layers, not the model


def test_a_short_disk_or_memory_is_refused_with_the_figure(tmp_path: Path) -> None:
    needs = _needs("none")
    with pytest.raises(ExportResourceError, match=r"needs about 25\.\d GiB free at .* \(the artifact 25\.\d GiB\), "
                                                  r"and 10\.0 GiB is free: free some space"):
        check_resources(needs, tmp_path, tmp_path, memory=64 * GiB, free={tmp_path: 10 * GiB})
    with pytest.raises(ExportResourceError, match=r"needs about \d\.\d GiB of memory at its peak, and 1\.0 GiB is "
                                                  r"available"):
        check_resources(needs, tmp_path, tmp_path, memory=GiB, free={tmp_path: 100 * GiB})
    check_resources(needs, tmp_path, tmp_path, memory=64 * GiB, free={tmp_path: 100 * GiB})


def test_export_refuses_before_writing_anything(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    checkpoint = write_random_llama(tmp_path / "ckpt")
    real = resources.shutil.disk_usage
    monkeypatch.setattr(resources.shutil, "disk_usage", lambda path: real(path)._replace(free=1 << 20))
    config = ExportConfig.model_validate({"model": {"source": str(checkpoint)}, "export": {"max_model_len": 64}})
    with pytest.raises(ExportResourceError, match=r"needs about \d+ MiB free at .*, and 1 MiB is free"):
        export(config, tmp_path / "out", log=io.StringIO())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"], "nothing written, no staging left"


def test_an_artifact_too_large_to_check_here_is_written_and_says_it_did_not_verify(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where not even one slice of layers runs in the available memory (a 7B float32 export needs 27 GB), the
    export completes, without the gear check, and says so and why; and that the weights will not be served here."""
    from pagedgraph.artifact.manifest import Manifest
    from pagedgraph.exporter import export as export_module

    checkpoint = write_random_llama(tmp_path / "ckpt")
    monkeypatch.setattr(export_module, "available_memory", lambda: 1 << 16)
    config = ExportConfig.model_validate({"model": {"source": str(checkpoint)}, "export": {"max_model_len": 64}})
    log = io.StringIO()
    export(config, tmp_path / "out", log=log)
    printed = log.getvalue()
    assert re.search(r"did not verify the gears: running the largest slice of layers maps and prepacks about "
                     r"0\.\d GiB, and 0\.0 GiB is available; the artifact is complete", printed), printed
    assert "[verify" not in printed
    assert re.search(r"note: serving this artifact holds its 0\.\d GiB of weights in memory \(plus the KV pool\), "
                     r"and this machine has 0\.0 GiB available: it will not run here", printed), printed
    assert "\r" not in printed and re.search(r"^converting weights: 100%\|.*\]$", printed, re.M), printed  # off a TTY
    Manifest.load(tmp_path / "out")  # whole: every file's checksum as recorded


def test_a_stage_bar_off_a_terminal_writes_whole_lines_at_its_interval_and_a_last_one() -> None:
    from pagedgraph.exporter.progress import stage_bar

    stream = io.StringIO()
    with stage_bar(stream, 1000, "quantizing", "B") as bar:
        for _ in range(1000):
            bar.update(1)
    lines = stream.getvalue().split("\n")
    assert "\r" not in stream.getvalue() and lines[-1] == "" and len(lines) == 3, lines  # start, end (30 s apart)
    assert lines[0].startswith("quantizing:   0%|") and lines[1].startswith("quantizing: 100%|"), lines
