"""Mixture-of-Experts checkpoints: a `qwen3moe` GGUF with its stacked expert blocks kept, the expert precisions
(router float32 always), tensor parallelism over the experts' channels, and the refusals of what the graphs lack.

Each served artifact is checked against HF transformers fp32 on the weights it holds (greedy tokens and logprobs
within 1e-4, tests/graphs/test_tiny_models_vs_transformers.py): for GGUF and RTN precisions, a copy of the tiny
checkpoint whose tensors are the dequantized blocks, exported at accuracy_level 0 (float32 compute).
"""
from __future__ import annotations

import io
import json
import shutil
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import onnx
import pytest
from gguf import GGMLQuantizationType

from pagedgraph.exporter.checkpoint import CheckpointError, read_checkpoint
from pagedgraph.exporter.config import ExportConfig
from pagedgraph.exporter.export import GRAPH, export
from pagedgraph.exporter.quantize import quantize_tensor
from pagedgraph.graphs import models
from pagedgraph.graphs.quant import BlockQuantized
from tests.exporter.tiny_gguf import write_qwen3_moe_gguf
from tests.graphs.test_tiny_models_vs_transformers import (MIXTRAL, QWEN3_MOE, Reference, assert_engine_follows,
                                                        hf_reference)
from tests.tiny_models import make_tiny_hf_checkpoint

pytestmark = pytest.mark.unit

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

LADDERS = {"max_model_len": 128, "buckets": {"decode_batch": [1, 4], "prefill_tokens": [16, 64, 128],
                                             "prefill_max_seqs": 4}}


def _export(source: Path | str, out: Path, model: Mapping[str, Any] | None = None, **export_options: Any) -> Path:
    config = ExportConfig.model_validate({"model": {"source": str(source), **(model or {})},
                                          "export": {**LADDERS, **export_options}})
    export(config, out, log=io.StringIO())
    return out


def _reference_with(model_dir: Path, tensors: Mapping[str, np.ndarray], out: Path) -> Reference:
    """transformers' reference (hf_reference) for the HF model of `model_dir` with `tensors` (per-expert names, as
    the checkpoint stores them) in place of its own: saved as a checkpoint of its own and loaded by transformers."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(model_dir, out)
    weights = load_file(out / "model.safetensors") | {n: np.ascontiguousarray(t, np.float32) for n, t in tensors.items()}
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return hf_reference(transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32))


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every layer sparse (as a qwen3moe GGUF holds them), the k weights renormalized (as llama.cpp routes)."""
    return make_tiny_hf_checkpoint(tmp_path_factory.mktemp("qwen3-moe") / "hf", arch="qwen3_moe", tie=False,
                                   dims=QWEN3_MOE)


@pytest.mark.parametrize("expert_type,router_type", [(GGMLQuantizationType.Q8_0, None),
                                                     (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q8_0)],
                         ids=["q8_0 experts", "q4_0 experts, q8_0 router"])
def test_qwen3moe_gguf_keeps_its_stacked_expert_blocks(qwen3_moe: Path, tmp_path: Path,
                                                       expert_type: GGMLQuantizationType,
                                                       router_type: GGMLQuantizationType | None) -> None:
    """The experts' blocks kept, an expert at a time; a router stored quantized read back as float32 (the graph's
    router is float32 always)."""
    path = tmp_path / "tiny-qwen3moe.gguf"
    held = write_qwen3_moe_gguf(qwen3_moe, path, expert_type, router_type)
    checkpoint = read_checkpoint(path, keep_blocks=True)
    moe = checkpoint.config.moe
    assert checkpoint.config.architecture == "qwen3_moe" and moe is not None
    assert (moe.num_experts, moe.top_k, moe.intermediate_size, moe.norm_topk_prob, moe.sparse_layers) == \
        (QWEN3_MOE["num_experts"], QWEN3_MOE["num_experts_per_tok"], QWEN3_MOE["moe_intermediate_size"], True, (0, 1))
    expert = checkpoint.tensors["model.layers.1.mlp.experts.5.down_proj.weight"]  # one expert of a stacked tensor
    assert isinstance(expert, BlockQuantized) and expert.source == expert_type.name
    np.testing.assert_array_equal(expert.dequantize(), held["model.layers.1.mlp.experts.5.down_proj.weight"])
    artifact = _export(path, tmp_path / "artifact", {"quantization": "gguf"}, accuracy_level=0)
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert manifest["weight_formats"][expert_type.name] == 2 * 3 * QWEN3_MOE["num_experts"]
    reference = _reference_with(qwen3_moe, held, tmp_path / "dequantized")
    assert_engine_follows(artifact, reference, f"gguf {expert_type.name}")


@pytest.mark.parametrize("quantization", ["w8a16", "w4a16", "bfloat16"])
def test_expert_precisions_keep_the_router_in_float32(qwen3_moe: Path, tmp_path: Path, quantization: str) -> None:
    """Experts in w8a16 / w4a16 blocks or bfloat16 (GroupedMatmul's variants), the router float32: the engine follows
    transformers on the weights the artifact holds (quantized: dequantized RTN codes, float32 compute; bfloat16:
    within bfloat16's rounding of x, greedy tokens only)."""
    model = {"dtype": "bfloat16"} if quantization == "bfloat16" else {"quantization": quantization, "group_size": 32}
    artifact = _export(qwen3_moe, tmp_path / "artifact", model, accuracy_level=0)
    graph = onnx.load_model(artifact / GRAPH, load_external_data=False)
    stored = {t.name: t for t in graph.graph.initializer}
    assert stored["layers.0.router"].data_type == onnx.TensorProto.FLOAT
    kinds = {n.op_type for n in graph.graph.node} | {n.op_type for f in graph.functions for n in f.node}
    assert ("GroupedMatmul" if quantization == "bfloat16" else "GroupedMatmulNBits") in kinds
    if quantization == "bfloat16":
        assert stored["layers.0.experts.gate_up"].data_type == onnx.TensorProto.BFLOAT16
        return
    assert list(stored["layers.0.experts.gate_up.codes"].dims)[0] == QWEN3_MOE["num_experts"]
    checkpoint = read_checkpoint(qwen3_moe)
    roles = {name: w.role for name, w in models.source_weights(checkpoint.config).items()}
    held = {name: _dequantized(quantize_tensor(roles[name], checkpoint.tensors[name], quantization, 32))
            for name in checkpoint.tensors}
    assert_engine_follows(artifact, _reference_with(qwen3_moe, held, tmp_path / "dequantized"), quantization)


def _dequantized(w: Any) -> np.ndarray:
    return w.dequantize() if isinstance(w, BlockQuantized) else np.asarray(w)


def test_tensor_parallel_experts_follow_transformers(tmp_path: Path) -> None:
    """Two ranks, each with half of every expert's channels and of the dense layer's (an AllReduce after each
    feed-forward), simulated in one process, equal transformers."""
    model_dir = make_tiny_hf_checkpoint(tmp_path / "hf", arch="qwen3_moe", tie=False,
                                        dims=QWEN3_MOE | {"mlp_only_layers": [1]})
    artifact = _export(model_dir, tmp_path / "artifact", tensor_parallel_size=2)
    reference = hf_reference(transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32))
    assert_engine_follows(artifact, reference, "qwen3-moe tp=2")


def test_mixtral_router_and_experts_under_transformers_5_fused_names(tmp_path: Path) -> None:
    """transformers 5 with save_original_format=False writes Mixtral's router as mlp.gate and its experts fused:
    read as the same weights as the released names."""
    per_expert = read_checkpoint(make_tiny_hf_checkpoint(tmp_path / "a", arch="mixtral", tie=False, dims=MIXTRAL))
    fused = read_checkpoint(make_tiny_hf_checkpoint(tmp_path / "b", arch="mixtral", tie=False, dims=MIXTRAL,
                                                    fused_experts=True))
    assert set(per_expert.tensors) == set(fused.tensors)
    for name in per_expert.tensors:
        np.testing.assert_array_equal(fused.tensors[name], per_expert.tensors[name], err_msg=name)


def test_experts_stored_twice_are_refused(qwen3_moe: Path, tmp_path: Path) -> None:
    from safetensors.numpy import load_file, save_file

    model_dir = shutil.copytree(qwen3_moe, tmp_path / "hf")
    tensors = load_file(model_dir / "model.safetensors")
    fused = np.stack([tensors[f"model.layers.0.mlp.experts.{e}.down_proj.weight"]
                      for e in range(QWEN3_MOE["num_experts"])])
    save_file(tensors | {"model.layers.0.mlp.experts.down_proj": fused}, model_dir / "model.safetensors")
    with pytest.raises(CheckpointError, match="layers.0.experts.down is stored twice"):
        read_checkpoint(model_dir)


@pytest.mark.parametrize("config,missing", [
    ({"architectures": ["Qwen2MoeForCausalLM"], "shared_expert_intermediate_size": 5632}, "shared experts"),
    ({"architectures": ["DeepseekV3ForCausalLM"], "n_shared_experts": 1, "n_group": 8, "topk_group": 4,
      "topk_method": "noaux_tc", "scoring_func": "sigmoid", "routed_scaling_factor": 2.5},
     "shared experts .*DeepSeek's grouped routing .*an expert score bias"),
    ({"architectures": ["Qwen3MoeForCausalLM"], "n_group": 4, "topk_group": 2}, "grouped routing"),
])
def test_moe_variants_are_refused_naming_what_is_missing(tmp_path: Path, config: dict[str, Any],
                                                         missing: str) -> None:
    model_dir = make_tiny_hf_checkpoint(tmp_path / "hf", arch="qwen3_moe", tie=False, dims=QWEN3_MOE)
    hf = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps(hf | config))
    with pytest.raises(CheckpointError, match=f"config.json: .*{missing}"):
        read_checkpoint(model_dir)
