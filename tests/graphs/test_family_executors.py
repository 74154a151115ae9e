"""The families whose graphs hold ops LLaMA's do not (Qwen3's per-head q/k norms; Qwen3-MoE's and Mixtral's routing
and grouped matmuls) on every CPU executor: ONNX Runtime with pagedgraph's custom ops on and off, and MindSpore's CPU
MINDIR graphs, each equal to HF transformers fp32."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.graphs.test_tiny_models_vs_transformers import MIXTRAL, QWEN3_MOE, assert_engine_follows
from tests.mindspore_support import export_artifact, require_mindspore
from tests.tiny_models import make_tiny_hf_checkpoint

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
require_mindspore()

FAMILIES = {"qwen3": dict(arch="qwen3", tie=False, dims={"head_dim": 32}),
            "qwen3_moe": dict(arch="qwen3_moe", tie=False, dims=QWEN3_MOE | {"mlp_only_layers": [0]}),
            "mixtral": dict(arch="mixtral", tie=False, dims=MIXTRAL)}
EXECUTORS = {"custom-ops": dict(custom_ops="on"), "onnx-bodies": dict(custom_ops="off"),
             "mindspore-cpu": dict(executor="mindspore")}


@pytest.fixture(scope="module", params=FAMILIES)
def exported(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, Path]:
    root = tmp_path_factory.mktemp(request.param)
    model_dir = make_tiny_hf_checkpoint(root / "hf", **FAMILIES[request.param])
    artifact = export_artifact(str(model_dir), root / "artifact", ["onnx", "mindir"], decode=[1, 4], prefill=[64],
                               max_seqs=4, max_model_len=128)
    return request.param, model_dir, artifact


@pytest.mark.parametrize("executor", EXECUTORS)
def test_family_follows_transformers_on_every_executor(exported: tuple[str, Path, Path], executor: str,
                                                       custom_op_library: Path) -> None:
    family, model_dir, artifact = exported
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert_engine_follows(artifact, model, f"{family} on {executor}", **EXECUTORS[executor])
