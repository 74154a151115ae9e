"""A whole Mixture-of-Experts model's Ascend MINDIR read back (a tiny Qwen3-MoE with a dense layer): every sparse
layer holds MindFormers' chain (MoeGatingTopKSoftmax, MoeInitRoutingV2, two GroupedMatmulV4 over the expert stacks,
MoeTokenUnpermute) and the dense layer plain matmuls, in float16 and as w8a16 / w4a16 antiquant GroupedMatmulV4;
every gear takes the weights as graph inputs, stored once for the whole ladder, the stacks in GroupedMatmulV4's
[E, K, N] layout."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.graphs.test_tiny_models_vs_transformers import QWEN3_MOE
from tests.mindspore_support import export_artifact, require_mindspore
from tests.tiny_models import make_tiny_hf_checkpoint

require_mindspore()
pytest.importorskip("torch")

from pagedgraph.artifact.manifest import Manifest  # noqa: E402
from pagedgraph.artifact.mindir import WEIGHTS, MindirIndex, numpy_dtype  # noqa: E402
from pagedgraph.exporter.checkpoint import read_checkpoint  # noqa: E402
from pagedgraph.exporter.mindspore.ascend_moe import ascend_expert_arrays  # noqa: E402
from pagedgraph.exporter.mindspore.builder import weight_attribute as W  # noqa: E402
from pagedgraph.exporter.mindspore.readback import read_graph, read_ops  # noqa: E402
from pagedgraph.graphs import models  # noqa: E402

pytestmark = pytest.mark.unit

MAX_LEN = 64
CHAIN = ["MoeGatingTopKSoftmax", "MoeInitRoutingV2", "GroupedMatmulV4", "GroupedMatmulV4", "InnerMoeTokenUnpermute"]
DENSE_LAYER = 1


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_hf_checkpoint(tmp_path_factory.mktemp("qwen3-moe") / "hf", arch="qwen3_moe", tie=False,
                                   dims=QWEN3_MOE | {"mlp_only_layers": [DENSE_LAYER]})


@pytest.mark.parametrize("quantization", ["none", "w8a16", "w4a16"])
def test_every_sparse_layer_holds_the_moe_chain_and_one_weight_copy(checkpoint: Path, tmp_path: Path,
                                                                    quantization: str) -> None:
    art = export_artifact(str(checkpoint), tmp_path / "art", ["mindir"], decode=[2, 4], prefill=[16], max_seqs=2,
                          max_model_len=MAX_LEN, target="ascend", model={"quantization": quantization},
                          mindir_workers=1)
    index, model = MindirIndex.load(art), Manifest.load(art).model
    sparse = model.moe.sparse_layers
    assert sparse == tuple(i for i in range(model.num_layers) if i != DENSE_LAYER)
    for rel in (rel for graphs in index.graphs.values() for rel in graphs.values()):
        records = read_ops(art / rel, {*CHAIN, "MatMul", "WeightQuantBatchMatmul"})
        chain = [r.op_type for r in records if r.op_type in CHAIN]
        assert chain == CHAIN * len(sparse), rel  # in layer order, one chain per sparse layer
        for r in (r for r in records if r.op_type == "GroupedMatmulV4"):  # its tensors come as tuples (MakeTuple)
            assert (r.arguments["split_item"], r.arguments["group_type"], r.arguments["group_list_type"]) == (3, 0, 1)
            assert (r.arguments["antiquant_scale"] is None) == (quantization == "none")
        dense = {r.arguments.get("mat2", r.arguments.get("weight")) for r in records
                 if r.op_type in ("MatMul", "WeightQuantBatchMatmul")}
        suffix = "" if quantization == "none" else ".codes"
        assert {W(f"layers.{DENSE_LAYER}.{part}{suffix}") for part in ("gate_up", "down")} <= dense
        routers = [r for r in records if r.op_type == "MatMul" and r.arguments["mat2"] in
                   {W(f"layers.{i}.router") for i in sparse}]
        assert len(routers) == len(sparse)  # the router a plain matmul always, never quantized
        graph = read_graph(art / rel)
        assert graph.parameters == [] and graph.data_bytes < 4096, rel
        assert [a.name for a in graph.arguments] == [*index.inputs, *map(W, index.weight_inputs[index.dtype])]
        shapes = {a.name: a.shape for a in graph.arguments}
        codes = "" if quantization == "none" else ".codes"
        experts, hidden, width = model.moe.num_experts, model.hidden_size, model.moe.intermediate_size
        packed = 2 if quantization == "w4a16" else 1  # qint4x2: two codes a byte along N
        for layer in sparse:  # GroupedMatmulV4's [E, K, N]
            assert shapes[W(f"layers.{layer}.experts.gate_up{codes}")] == (experts, hidden, 2 * width // packed)
            assert shapes[W(f"layers.{layer}.experts.down{codes}")] == (experts, width, hidden // packed)
    _assert_stored_once(art, index)
    if quantization == "none":
        stored = index.read_weights(art)
        raw = read_checkpoint(str(checkpoint))
        weights = models.graph_weights(raw.config, raw.tensors, MAX_LEN)
        for name in (f"layers.{sparse[0]}.experts.gate_up", f"layers.{sparse[0]}.experts.down"):
            np.testing.assert_array_equal(stored[name], ascend_expert_arrays(weights[name], np.float16))


def _assert_stored_once(art: Path, index: MindirIndex) -> None:
    """Every weight entry where the previous one ended (64-byte aligned): each weight once for every gear."""
    ends = 64
    for entry in sorted(index.weights.values(), key=lambda e: e.offset):
        assert entry.offset == ends
        ends += -(-int(np.prod(entry.shape)) * numpy_dtype(entry.dtype or index.dtype).itemsize // 64) * 64
    assert ends == (art / WEIGHTS).stat().st_size
