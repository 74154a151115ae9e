"""Calibration's compute is bounded by the model's size (kv_calibration.CALIBRATION_BUDGET): a model too large for
every window of the calibration text runs a few, spread over the text, and the export says so; a small model runs
them all, as before."""
from __future__ import annotations

import io
import re
from pathlib import Path

import pytest

from pagedgraph.exporter import kv_calibration
from pagedgraph.exporter.checkpoint import read_checkpoint
from pagedgraph.exporter.config import ExportConfig
from pagedgraph.exporter.export import export
from pagedgraph.exporter.kv_calibration import CALIBRATION_BUDGET, calibration_windows
from pagedgraph.exporter.resources import graph_weight_params
from pagedgraph.graphs.config import ModelConfig
from pagedgraph.graphs.contract import Gear
from pagedgraph.texts import shipped_text
from tests.exporter.test_export_resources import LLAMA_7B
from tests.random_checkpoint import write_random_llama

pytestmark = pytest.mark.unit
GEARS = [Gear(512, 4, 32)]
TINYLLAMA = ModelConfig(architecture="llama", vocab_size=49152, hidden_size=2048, intermediate_size=5632,
                        num_layers=22, num_heads=32, num_kv_heads=4, head_dim=64, rms_norm_eps=1e-5,
                        rope_theta=10000.0, max_position_embeddings=2048, tie_word_embeddings=False)


def test_windows_are_bounded_by_the_models_size() -> None:
    tokens = list(range(4000))
    every = calibration_windows(tokens, 512, GEARS, 16)
    assert len(every) == 8
    assert calibration_windows(tokens, 512, GEARS, 16, params=10 ** 6) == every
    room_for_three = int(CALIBRATION_BUDGET // (3 * 512))
    assert calibration_windows(tokens, 512, GEARS, 16, params=room_for_three) == [every[0], every[2], every[5]]
    assert calibration_windows(tokens, 512, GEARS, 16, params=10 ** 12) == [every[0]]  # one at least


@pytest.mark.parametrize(("model", "windows"), [(TINYLLAMA, 8), (LLAMA_7B, 1)])
def test_the_shipped_text_is_kept_whole_at_1b_and_cut_to_one_window_at_7b(model: ModelConfig, windows: int) -> None:
    params = sum(graph_weight_params(model, 2048).values())
    assert len(calibration_windows(list(range(3909)), 512, GEARS, 16, params)) == windows


def test_a_bounded_export_calibrates_on_fewer_windows_and_says_so(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    checkpoint = write_random_llama(tmp_path / "ckpt")
    config = ExportConfig.model_validate({"model": {"source": str(checkpoint)}, "export": {
        "max_model_len": 128, "kv_cache_dtypes": ["float32", "int8"], "verify_gears": False,
        "buckets": {"decode_batch": [1], "prefill_tokens": [128], "prefill_max_seqs": 1}}})
    params = sum(graph_weight_params(read_checkpoint(str(checkpoint)).config, 128).values())
    monkeypatch.setattr(kv_calibration, "CALIBRATION_BUDGET", 3 * 128 * params)
    log = io.StringIO()
    export(config, tmp_path / "art", log=log, calibration_text=shipped_text("calibration"))
    found = re.search(r"calibrated int8 KV-cache scales on the default calibration text: (\d+) of (\d+) tokens in "
                      r"3 windows \(bounded by the model's size", log.getvalue())
    assert found, log.getvalue()
    assert int(found[1]) == 3 * 128 < int(found[2])
