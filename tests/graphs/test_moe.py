"""graphs/moe.py's sparse FFN against transformers' own MoE blocks (Qwen3-MoE in both routing forms, Mixtral), in
ONNX Runtime with and without pagedgraph's custom ops; expert stacks made from per-expert checkpoint tensors; its
tensor-parallel split; its Ascend MINDIR's primitives."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest

from pagedgraph.exporter.onnx.graph_builder import FragmentBuilder
from pagedgraph.exporter.tensor_parallel import shard_weight
from pagedgraph.graphs import moe as moe_layer
from pagedgraph.graphs.config import ModelConfig, MoeConfig
from pagedgraph.graphs.moe import expert_bytes, moe_weight_names, routed_experts
from pagedgraph.graphs.tensor_parallel import shards
from pagedgraph.graphs.weight_forms import WeightForms
from pagedgraph.graphs.weights import graph_weight
from tests.mindspore_support import require_mindspore

pytestmark = pytest.mark.unit

torch = pytest.importorskip("torch")

HIDDEN, EXPERTS, INTERMEDIATE, TOKENS = 32, 8, 16, 7


def _hf_block(family: str, top_k: int, norm_topk_prob: bool) -> Any:
    """A transformers sparse MoE block with random weights (its experts are created uninitialized)."""
    torch.manual_seed(0)
    if family == "qwen3_moe":
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

        config = Qwen3MoeConfig(hidden_size=HIDDEN, num_experts=EXPERTS, num_experts_per_tok=top_k,
                                moe_intermediate_size=INTERMEDIATE, norm_topk_prob=norm_topk_prob)
        block = Qwen3MoeSparseMoeBlock(config)
    else:
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

        config = MixtralConfig(hidden_size=HIDDEN, num_local_experts=EXPERTS, num_experts_per_tok=top_k,
                               intermediate_size=INTERMEDIATE)
        block = MixtralSparseMoeBlock(config)
    for parameter in block.parameters():
        torch.nn.init.normal_(parameter, std=0.2)
    return block.eval()


def _graph_weights(block: Any) -> dict[str, np.ndarray]:
    router, gate_up, down = (t.detach().numpy() for t in (block.gate.weight, block.experts.gate_up_proj,
                                                          block.experts.down_proj))
    return dict(zip(moe_weight_names(0), (router, gate_up, down)))


def _moe(top_k: int, norm: bool, intermediate: int = INTERMEDIATE) -> MoeConfig:
    return MoeConfig(EXPERTS, top_k, intermediate, norm, (0,))


def _model(moe: MoeConfig, hidden: int = HIDDEN, layers: int = 1) -> ModelConfig:
    """A model config around one sparse layer (what the weight declarations and the split read of it)."""
    return ModelConfig("qwen3_moe", 64, hidden, 64, layers, 4, 2, hidden // 4, 1e-6, 1e4, 128, False,
                       moe=MoeConfig(moe.num_experts, moe.top_k, moe.intermediate_size, moe.norm_topk_prob,
                                     tuple(range(layers))))


def _ffn_model(weights: dict[str, np.ndarray], moe: MoeConfig) -> bytes:
    b = FragmentBuilder(weights)
    b.output("y", routed_experts(b, moe, WeightForms(), b.input("x"), 0))
    return b.model("moe").SerializeToString()


def _run(model: bytes, x: np.ndarray, library: Path | None = None) -> np.ndarray:
    options = ort.SessionOptions()
    if library:
        options.register_custom_ops_library(str(library))
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


@pytest.mark.parametrize("family,top_k,norm", [("qwen3_moe", 4, True), ("qwen3_moe", 4, False), ("mixtral", 2, True)],
                         ids=["qwen3-moe norm_topk_prob", "qwen3-moe softmax weights", "mixtral top-2"])
@pytest.mark.parametrize("custom_ops", [False, True], ids=["onnx bodies", "custom ops"])
def test_sparse_ffn_equals_transformers_block(family: str, top_k: int, norm: bool, custom_ops: bool,
                                              request: pytest.FixtureRequest) -> None:
    block = _hf_block(family, top_k, norm)
    x = np.random.default_rng(1).standard_normal((TOKENS, HIDDEN)).astype(np.float32)
    with torch.no_grad():
        want = block(torch.from_numpy(x)[None]).reshape(TOKENS, HIDDEN).numpy()
    library = request.getfixturevalue("onednn_custom_op_library") if custom_ops else None
    np.testing.assert_allclose(_run(_ffn_model(_graph_weights(block), _moe(top_k, norm)), x, library), want,
                               atol=2e-5, rtol=1e-5)


def _per_expert_tensors(block: Any) -> dict[str, np.ndarray]:
    """The block's experts as a released checkpoint stores them, one tensor each (graphs/models/qwen3_moe.py's
    names)."""
    gate_up, down = (t.detach().numpy() for t in (block.experts.gate_up_proj, block.experts.down_proj))
    tensors = {}
    for e in range(EXPERTS):
        tensors |= {f"gate.{e}": gate_up[e, :INTERMEDIATE], f"up.{e}": gate_up[e, INTERMEDIATE:], f"down.{e}": down[e]}
    return tensors


def _stack_specs(config: ModelConfig) -> tuple[Any, Any]:
    return (moe_layer.experts_gate_up(config, 0, lambda e: [f"gate.{e}", f"up.{e}"]),
            moe_layer.experts_down(config, 0, lambda e: [f"down.{e}"]))


def test_expert_stacks_match_per_expert_checkpoint_tensors() -> None:
    """HF checkpoints store each expert's gate, up and down: stacked as the family declares them (graphs/moe.py's
    constructors, graphs/weights.py), they are transformers' fused parameters, in float32 and in bfloat16."""
    block = _hf_block("qwen3_moe", 2, True)
    config = _model(_moe(2, True))
    tensors = _per_expert_tensors(block)
    for spec, want in zip(_stack_specs(config), (block.experts.gate_up_proj, block.experts.down_proj)):
        np.testing.assert_array_equal(graph_weight(config, spec, tensors, 16), want.detach().numpy())
        assert graph_weight(config, spec, tensors, 16, "bfloat16").shape == want.shape


def test_tensor_parallel_ranks_sum_to_the_whole_layer() -> None:
    """Each rank holds I/n of every expert (exporter/tensor_parallel.py cuts the stacks by their roles) and routes
    every token itself: the ranks' outputs are partial sums (the decoder's AllReduce completes them)."""
    block = _hf_block("qwen3_moe", 4, True)
    weights = _graph_weights(block)
    moe = _moe(4, True)
    config = _model(moe)
    x = np.random.default_rng(2).standard_normal((TOKENS, HIDDEN)).astype(np.float32)
    whole = _run(_ffn_model(weights, moe), x)
    router, gate_up, down = weights.values()
    partials = []
    for shard in shards(config, 2):
        parts = [shard_weight(config, spec, w, shard) for spec, w in zip(_stack_specs(config), (gate_up, down))]
        partials.append(_run(_ffn_model(dict(zip(moe_weight_names(0), (router, *parts))), _moe(4, True, 8)), x))
    np.testing.assert_allclose(sum(partials), whole, atol=2e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="experts' intermediate size = 16"):
        shards(config, 3)


def test_parameter_counts_and_memory_of_olmoe_and_qwen3_30b_a3b() -> None:
    """OLMoE-1B-7B's sparse layers (the scale target, scripts/make_checkpoint.py --preset olmoe) and Qwen3-30B-A3B's
    (docs/scale-out.md's memory plan)."""
    olmoe = MoeConfig(64, 8, 1024, False, tuple(range(16)))
    stored, read = olmoe.layer_parameters(2048)
    assert (16 * stored, 16 * read) == (6_444_548_096, 807_403_520)
    qwen = _model(MoeConfig(128, 8, 768, True, ()), hidden=2048, layers=48)
    assert expert_bytes(qwen, 16) == 57_982_058_496  # bf16 experts: 54 GiB of a 910B's 64 GB
    assert expert_bytes(qwen, 16, rank_size=8) == 57_982_058_496 // 8
    with pytest.raises(ValueError, match="num_experts_per_tok = 9 with 8 experts"):
        MoeConfig(8, 9, 16, True, ())


def test_ascend_mindir_of_the_sparse_ffn_holds_the_moe_chain(tmp_path: Path) -> None:
    """The sparse FFN recorded for Ascend exports to MINDIR and reads back as MindFormers' chain: the gating, V2
    routing, two grouped matmuls over the expert stacks as graph inputs [E, K, N], the unpermute."""
    require_mindspore()
    import mindspore as ms

    from pagedgraph.exporter.mindspore.ascend_ops import MINDSPORE_ASCEND
    from pagedgraph.exporter.mindspore.builder import MindSporeBuilder, MindSporeTarget, load_cell_class
    from pagedgraph.exporter.mindspore.readback import read_graph, read_ops
    from pagedgraph.graphs.contract import LOGITS

    b = MindSporeBuilder(MINDSPORE_ASCEND, MindSporeTarget("ascend"))
    b.output(LOGITS, routed_experts(b, _moe(2, True), WeightForms(), b.input("x"), 0))
    cell = load_cell_class(b.source(), tmp_path / "moe_cell.py")(b.cells)
    shapes = {"x": (TOKENS, HIDDEN), "layers.0.router": (EXPERTS, HIDDEN),
              "layers.0.experts.gate_up": (EXPERTS, HIDDEN, 2 * INTERMEDIATE),
              "layers.0.experts.down": (EXPERTS, INTERMEDIATE, HIDDEN)}
    args = [ms.Tensor(np.zeros(shapes[name], np.float16)) for name in b.inputs + b.weights]
    ms.export(cell, *args, file_name=str(tmp_path / "moe"), file_format="MINDIR")
    # MoeTokenUnpermute is stored under its inner primitive's name
    chain = ["MoeGatingTopKSoftmax", "MoeInitRoutingV2", "GroupedMatmulV4", "GroupedMatmulV4", "InnerMoeTokenUnpermute"]
    records = read_ops(tmp_path / "moe.mindir", set(chain))
    assert [r.op_type for r in records] == chain
    grouped = [r for r in records if r.op_type == "GroupedMatmulV4"]
    assert [(r.arguments["split_item"], r.arguments["group_type"], r.arguments["group_list_type"])
            for r in grouped] == [(3, 0, 1)] * 2
    arguments = {a.name: a.shape for a in read_graph(tmp_path / "moe.mindir").arguments}
    assert arguments["w_layers_0_experts_gate_up"] == (EXPERTS, HIDDEN, 2 * INTERMEDIATE)
