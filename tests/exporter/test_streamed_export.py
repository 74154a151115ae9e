"""The streamed export (one graph weight converted, written and dropped at a time; the graph built from names and
shapes) writes byte for byte what the whole-model path writes: every graph weight of the checkpoint in memory at
once, the model proto holding them, and onnx.save_model's own external-data writer. Checked on SmolLM2 for fp32,
w8a8 and the GGUF's own blocks; and calibration run a layer at a time gives the int8 KV-cache scales it gives on
the whole graph."""
from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from pagedgraph.artifact.manifest import Manifest
from pagedgraph.exporter.checkpoint import read_checkpoint
from pagedgraph.exporter.config import ExportConfig
from pagedgraph.exporter.export import GRAPH, WEIGHTS, export
from pagedgraph.exporter.onnx import slices
from pagedgraph.exporter.onnx.graph_builder import OnnxBuilder
from pagedgraph.exporter.quantize import quantize_weights
from pagedgraph.graphs import models
from pagedgraph.graphs.family import GraphOptions
from pagedgraph.graphs.weight_forms import WeightForms
from pagedgraph.graphs.weights import graph_arrays
from pagedgraph.graphs.quant import form_of
from pagedgraph.texts import shipped_text
from tests.random_checkpoint import write_random_llama

pytestmark = pytest.mark.e2e
def _whole_model_files(artifact: Path, out: Path) -> tuple[bytes, bytes]:
    """GRAPH and WEIGHTS as the whole-model path writes them for `artifact`'s export config."""
    manifest = Manifest.load(artifact, verify=False)
    config = ExportConfig.model_validate(manifest.export_config)
    quantization = config.model.quantization
    raw = read_checkpoint(config.model.source, keep_blocks=quantization == "gguf")
    tensors = quantize_weights(raw.config, raw.tensors, quantization, config.model.group_size) \
        if quantization in ("w8a16", "w4a16", "w8a8") else raw.tensors
    weights = dict(models.graph_weights(raw.config, tensors, config.export.max_model_len, config.model.dtype))
    arrays = graph_arrays(weights)
    forms = WeightForms({name: form_of(w) for name, w in weights.items()}, config.export.accuracy_level)
    builder = OnnxBuilder(raw.config, lambda name: numpy_helper.from_array(arrays[name], name), config.model.dtype)
    models.build(builder, raw.config, GraphOptions(config.export.block_size, forms, config.model.dtype))
    (out / GRAPH).parent.mkdir(parents=True)
    onnx.save_model(builder.model("pagedgraph"), out / GRAPH, save_as_external_data=True,
                    all_tensors_to_one_file=True, location=Path(WEIGHTS).name, size_threshold=0)
    return (out / GRAPH).read_bytes(), (out / WEIGHTS).read_bytes()


@pytest.mark.parametrize("artifact", ["smollm2_artifact", "smollm2_w8a8_artifact", "smollm2_gguf_artifact"])
def test_streamed_artifact_is_byte_identical_to_the_whole_model_one(artifact: str, request: pytest.FixtureRequest,
                                                                    tmp_path: Path) -> None:
    streamed = request.getfixturevalue(artifact)
    graph, weights = _whole_model_files(streamed, tmp_path)
    assert (streamed / WEIGHTS).read_bytes() == weights
    assert (streamed / GRAPH).read_bytes() == graph


def _int8_scales(artifact: Path) -> dict[str, np.ndarray]:
    proto = onnx.load_model(artifact / "graphs" / "model.kv-int8.onnx", load_external_data=False)
    return {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer if not t.external_data}


def test_calibration_a_layer_at_a_time_gives_the_whole_graphs_scales(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Each layer its own slice (the residual stream handed from slice to slice) against one slice; the gear check
    runs both ways."""
    checkpoint = write_random_llama(tmp_path / "ckpt")
    config = ExportConfig.model_validate({"model": {"source": str(checkpoint)}, "export": {
        "max_model_len": 128, "kv_cache_dtypes": ["float32", "int8"],
        "buckets": {"decode_batch": [1, 4], "prefill_tokens": [64, 128], "prefill_max_seqs": 4}}})
    export(config, tmp_path / "whole", log=io.StringIO(), calibration_text=shipped_text("calibration"))
    monkeypatch.setattr(slices, "SLICE_BYTES", 1)
    log = io.StringIO()
    export(config, tmp_path / "sliced", log=log, calibration_text=shipped_text("calibration"))
    assert "verifying in 3 slices of layers" in log.getvalue()  # each layer, then the LM head alone
    whole, sliced = _int8_scales(tmp_path / "whole"), _int8_scales(tmp_path / "sliced")
    assert whole.keys() == sliced.keys() and whole
    for name in whole:  # float32 runs of the same ops on the same rows: equal to rounding, at most
        np.testing.assert_allclose(sliced[name], whole[name], rtol=1e-6, atol=0, err_msg=name)
    assert (tmp_path / "whole" / WEIGHTS).read_bytes() == (tmp_path / "sliced" / WEIGHTS).read_bytes()


def test_a_weight_with_nan_is_refused_naming_its_checkpoint_tensor(tmp_path: Path) -> None:
    from safetensors.numpy import load_file, save_file

    from pagedgraph.exporter.onnx.weights_file import NonFiniteWeight

    checkpoint = write_random_llama(tmp_path / "ckpt")
    tensors = load_file(str(checkpoint / "model.safetensors"))
    tensors["model.layers.1.mlp.up_proj.weight"][3, 5] = np.nan
    save_file(tensors, str(checkpoint / "model.safetensors"))
    config = ExportConfig.model_validate({"model": {"source": str(checkpoint)}, "export": {"max_model_len": 64}})
    with pytest.raises(NonFiniteWeight, match=r"model.layers.1.mlp.gate_proj.weight, model.layers.1.mlp.up_proj.weight "
                                              r"\(graph weight layers.1.gate_up\) hold NaN or Inf"):
        export(config, tmp_path / "out", log=io.StringIO())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
