"""The families whose graphs hold ops LLaMA's do not (Qwen3's per-head q/k norms; Qwen3-MoE's and Mixtral's routing
and grouped matmuls) on every CPU executor: ONNX Runtime with pagedgraph's custom ops on and off, and MindSpore's CPU
MINDIR graphs, each equal to HF transformers fp32."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.graphs.test_tiny_models_vs_transformers import (MIXTRAL, QWEN3_MOE, Reference, assert_engine_follows,
                                                        hf_reference)
from tests.mindspore_support import export_artifact, require_mindspore
from tests.tiny_models import make_tiny_hf_checkpoint

pytestmark = pytest.mark.unit
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
require_mindspore()

FAMILIES = {"qwen3": dict(arch="qwen3", tie=False, dims={"head_dim": 32}),
            "qwen3_moe": dict(arch="qwen3_moe", tie=False, dims=QWEN3_MOE | {"mlp_only_layers": [0]}),
            "mixtral": dict(arch="mixtral", tie=False, dims=MIXTRAL)}
EXECUTORS = {"custom-ops": dict(custom_ops="on"), "onnx-bodies": dict(custom_ops="off"),
             "mindspore-cpu": dict(executor="mindspore")}


@pytest.fixture(scope="module", params=FAMILIES)
def exported(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, Reference]:
    """The family's artifact and transformers' reference on its weights, both shared by the executors."""
    root = tmp_path_factory.mktemp(request.param)
    model_dir = make_tiny_hf_checkpoint(root / "hf", **FAMILIES[request.param])
    artifact = export_artifact(str(model_dir), root / "artifact", ["onnx", "mindir"], decode=[1, 4], prefill=[64],
                               max_seqs=4, max_model_len=128)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return request.param, artifact, hf_reference(model)


@pytest.mark.parametrize("executor", EXECUTORS)
def test_family_follows_transformers_on_every_executor(exported: tuple[str, Path, Reference], executor: str,
                                                       custom_op_library: Path) -> None:
    family, artifact, reference = exported
    assert_engine_follows(artifact, reference, f"{family} on {executor}", **EXECUTORS[executor])


def test_qwen3_ascend_mindir_norms_each_head_and_keeps_one_weight_copy(tmp_path: Path) -> None:
    """The Ascend MINDIR reads back with an ATB RmsNorm over [T * heads, head_dim] rows for q and k in every layer,
    and every gear of the ladder takes the one copy of the weights as graph inputs."""
    from pagedgraph.artifact.mindir import MindirIndex
    from pagedgraph.exporter.mindspore.readback import read_ops
    from tests.exporter.test_mindspore_lowering import MAX_LEN, assert_one_copy_of_the_weights

    model_dir = make_tiny_hf_checkpoint(tmp_path / "hf", **FAMILIES["qwen3"])
    art = export_artifact(str(model_dir), tmp_path / "art", ["mindir"], decode=[2], prefill=[16], max_seqs=2,
                          max_model_len=MAX_LEN, target="ascend", model={"dtype": "float16"})
    assert_one_copy_of_the_weights(art, model_dir)
    from pagedgraph.exporter.mindspore.builder import weight_attribute as W

    head_dim = FAMILIES["qwen3"]["dims"]["head_dim"]
    index = MindirIndex.load(art)
    for family, graphs in index.graphs.items():
        for gear, rel in graphs.items():
            norms = {r.arguments["gamma"]: r for r in read_ops(art / rel, {"RmsNorm"})}
            for name in (f"layers.{i}.{qk}_norm" for i in range(2) for qk in "qk"):
                # the heads viewed as rows: RmsNorm's input is a Reshape, its weight one head's [head_dim]
                assert norms[W(name)].arguments["x"] == "<Reshape>", (family, gear, name)
                assert norms[W(name)].shapes["gamma"] == (head_dim,)
