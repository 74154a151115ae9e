"""Tensor-parallel graphs (export.tensor_parallel_size) run in the single-process simulation equal the whole graph.

A tiny random Llama whose 8 heads, 4 KV heads and 128 intermediate channels split over 2 and 4 ranks is exported
at TP = 1, 2, 4 and served on the reference prompts: greedy tokens equal TP=1's and every step's logits lie within
1e-4 of TP=1's. Each rank's weights file is its 1/N of the split linears plus the replicated rest, and its KV pools
hold its KV heads: TP=1's pool columns for them.
"""
from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from pagedgraph.artifact.manifest import Manifest, rank_file
from pagedgraph.cli import main
from pagedgraph.exporter.config import ExportConfig
from pagedgraph.exporter.export import GRAPH, WEIGHTS, export
from pagedgraph.graphs import models
from pagedgraph.graphs.contract import k_cache_name
from pagedgraph.graphs.family import Split
from pagedgraph.graphs.tensor_parallel import TensorParallelError
from pagedgraph.inspect import describe, text
from pagedgraph.runtime.engine import LLM
from pagedgraph.runtime.sampling_params import SamplingParams
from tests.paths import DATA
from tests.random_checkpoint import write_random_llama
from tests.tiny_models import TINY_DIMS

pytestmark = pytest.mark.e2e
DIMS = {**TINY_DIMS, "hidden_size": 128, "num_attention_heads": 8, "num_key_value_heads": 4}  # head_dim 16
SIZES = (1, 2, 4)
MAX_TOKENS = 8


def _export(checkpoint: Path, out: Path, size: int, quantization: str = "none", **options: Any) -> Path:
    model = {"source": str(checkpoint), "quantization": quantization}
    config = ExportConfig.model_validate({"model": model, "export": {"tensor_parallel_size": size, "max_model_len": 128,
        "buckets": {"decode_batch": [4], "prefill_tokens": [64], "prefill_max_seqs": 4}, **options}})
    export(config, out, log=io.StringIO())
    return out


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("tp")
    checkpoint = write_random_llama(root / "hf", dims=DIMS)
    return {size: _export(checkpoint, root / f"tp{size}", size) for size in SIZES}


class _Recorder:
    """An executor that keeps a copy of every step's logits."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.pools, self.custom_ops, self.logits = inner, inner.pools, inner.custom_ops, []

    def run(self, gear: Any, inputs: dict[str, np.ndarray]) -> np.ndarray:
        out = self.inner.run(gear, inputs)
        self.logits.append(out.copy())
        return out


def _serve(artifact: Path) -> tuple[list[list[int]], list[np.ndarray], LLM]:
    llm = LLM(artifact, threads=1)
    recorder = llm.engine.runner.executor = _Recorder(llm.engine.runner.executor)
    prompts = [json.loads(line)["prompt"] for line in (DATA / "reference_prompts.jsonl").read_text().splitlines()[:6]]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outputs], recorder.logits, llm


@pytest.fixture(scope="module")
def served(artifacts: dict[int, Path]) -> dict[int, tuple[list[list[int]], list[np.ndarray], LLM]]:
    return {size: _serve(path) for size, path in artifacts.items()}


@pytest.mark.parametrize("size", [2, 4])
def test_greedy_output_and_logits_equal_tp1(served: dict, size: int) -> None:
    tokens, logits, _ = served[size]
    want_tokens, want_logits, _ = served[1]
    assert all(len(t) == MAX_TOKENS for t in want_tokens)
    assert tokens == want_tokens
    assert len(logits) == len(want_logits) > 1
    worst = max(float(np.abs(got - want).max()) for got, want in zip(logits, want_logits))
    assert worst <= 1e-4, f"TP={size} logits differ from TP=1's by up to {worst:.2e}"


@pytest.mark.parametrize("size", [2, 4])
def test_each_rank_pool_holds_its_kv_heads(served: dict, artifacts: dict[int, Path], size: int) -> None:
    whole = served[1][2].engine.runner.pools
    pools = served[size][2].engine.runner.pools
    rank_layout = Manifest.load(artifacts[size], verify=False).ranks
    head_dim = DIMS["hidden_size"] // DIMS["num_attention_heads"]
    assert pools.nbytes == whole.nbytes and pools.num_blocks == whole.num_blocks
    name = k_cache_name(1)
    assert np.abs(whole[name]).max() > 0, "nothing was cached"
    for layout in rank_layout:
        pool = pools.rank(layout.rank)[name]
        assert pool.shape == (whole.num_slots, whole[name].shape[1] // size)
        start, stop = (h * head_dim for h in layout.kv_heads)
        np.testing.assert_allclose(pool, whole[name][:, start:stop], atol=1e-5)


def test_block_quantized_weights_split_alike(tmp_path: Path) -> None:
    """w4a16 (int4 groups of 32, cut at whole groups), computed on the dequantized blocks (accuracy_level 0): a
    rank's linears are TP=1's, cut. (With int8 activations, accuracy_level 4, each rank quantizes its own slice of
    a row-parallel input, so logits differ as two quantizations do.)"""
    checkpoint = write_random_llama(tmp_path / "hf", dims=DIMS)
    options = {"accuracy_level": 0}
    runs = {size: _serve(_export(checkpoint, tmp_path / f"tp{size}", size, quantization="w4a16", **options))
            for size in (1, 2)}
    assert runs[2][0] == runs[1][0]
    assert max(float(np.abs(a - b).max()) for a, b in zip(runs[2][1], runs[1][1])) <= 1e-4


def _initializer_bytes(graph: Path) -> dict[str, int]:
    model = onnx.load_model(graph, load_external_data=False)
    return {t.name: int(next(e.value for e in t.external_data if e.key == "length")) for t in model.graph.initializer}


@pytest.mark.parametrize("size", [2, 4])
def test_rank_weights_are_their_share_plus_the_replicated_parts(artifacts: dict[int, Path], size: int) -> None:
    whole = _initializer_bytes(artifacts[1] / GRAPH)
    table = models.weight_table(Manifest.load(artifacts[1]).model)
    replicated = sum(n for name, n in whole.items() if table[name].role.split is Split.REPLICATED)
    split = sum(whole.values()) - replicated
    assert replicated and split
    manifest = Manifest.load(artifacts[size])
    assert manifest.tensor_parallel_size == size and [r.rank for r in manifest.ranks] == list(range(size))
    for layout in manifest.ranks:
        stored = (artifacts[size] / rank_file(WEIGHTS, layout.folder)).stat().st_size
        assert stored == split // size + replicated, f"rank {layout.rank}: {stored} bytes"
    shown = text(describe(artifacts[size], verify=False))
    assert f"tensor        parallel over {size} ranks" in shown
    assert f"rank {size - 1}: heads {8 - 8 // size}-7, KV heads {4 - 4 // size}-3" in shown


def test_a_rank_graph_has_two_allreduces_per_layer_and_refuses_to_run_alone(artifacts: dict[int, Path]) -> None:
    manifest = Manifest.load(artifacts[2], verify=False)
    path = artifacts[2] / manifest.graph_for("decode", "float32", 1)
    nodes = onnx.load_model(path, load_external_data=False).graph.node
    reduces = [n for n in nodes if n.op_type == "AllReduce"]
    assert len(reduces) == 2 * DIMS["num_hidden_layers"]
    assert {a.i for n in reduces for a in n.attribute if a.name == "rank_size"} == {2}
    with pytest.raises(Exception, match="AllReduce"):
        ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def test_a_size_that_does_not_divide_the_heads_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    checkpoint = write_random_llama(tmp_path / "hf", dims=DIMS)
    with pytest.raises(TensorParallelError, match=r"export.tensor_parallel_size = 3 must divide the model's "
                                                  r"num_heads = 8, num_kv_heads = 4, intermediate_size = 128 .*"
                                                  r"valid sizes for this model: \[1, 2, 4\]"):
        _export(checkpoint, tmp_path / "out", 3)
    assert not (tmp_path / "out").exists()
    assert main(["export", "--model", str(checkpoint), "--out", str(tmp_path / "cli"), "-tp", "3"]) == 2
    assert "export.tensor_parallel_size = 3 must divide" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"tensor_parallel_size = 2 with export.kv_cache_dtypes"):
        ExportConfig.model_validate({"export": {"tensor_parallel_size": 2, "kv_cache_dtypes": ["float32", "int8"]}})


def test_ascend_rank_mindir_holds_its_heads_and_hccl_allreduce(tmp_path: Path) -> None:
    """The Ascend MINDIR of each rank: MindSpore's AllReduce (HCCL, sum over the world group) after o_proj and down,
    PagedAttention over its own heads, pools of its KV heads (read back; nothing here runs Ascend kernels)."""
    pytest.importorskip("mindspore")
    from pagedgraph.exporter.mindspore.readback import read_graph, read_ops

    checkpoint = write_random_llama(tmp_path / "hf", dims=DIMS)
    artifact = _export(checkpoint, tmp_path / "out", 2, formats=["mindir"], target="ascend", mindir_workers=1,
                       buckets={"decode_batch": [4], "prefill_tokens": [64], "prefill_max_seqs": 4,
                                "context_blocks": [8]})
    manifest = Manifest.load(artifact)
    for layout in manifest.ranks:
        index = json.loads((artifact / manifest.graph_for("decode", manifest.dtype, layout.rank)).read_text())
        (graph,) = index["graphs"]["decode"].values()
        assert graph.startswith(f"{layout.folder}/mindir/")
        reduces = read_ops(artifact / graph, {"AllReduce"})
        assert len(reduces) == 2 * DIMS["num_hidden_layers"]
        assert {(r.attributes["op"], r.attributes["group"]) for r in reduces} == {("sum", "hccl_world_group")}
        (attention, *_) = read_ops(artifact / graph, {"PagedAttention"})
        assert (attention.arguments["head_num"], attention.arguments["kv_head_num"]) == (4, 2)
        pools = [a for a in read_graph(artifact / graph).arguments if a.name == k_cache_name(0)]
        assert pools[0].shape[2:] == (2, DIMS["hidden_size"] // DIMS["num_attention_heads"])


def test_smollm2_over_3_ranks_equals_tp1_and_follows_hf(smollm2_artifact: Path, tmp_path: Path) -> None:
    """SmolLM2-135M (9 heads, 3 KV heads: TP=3 is its one split) with the session artifact's settings, so both run
    the same gears: greedy tokens equal TP=1's and HF's (up to HF's own near ties), logits within 1e-4 of TP=1's."""
    from tests.conftest import _NO_BASELINE
    from tests.runtime.test_reference_e2e import _matches_reference

    config = ExportConfig.model_validate({"export": {**_NO_BASELINE, "tensor_parallel_size": 3}})
    export(config, tmp_path / "tp3", log=io.StringIO())
    reference = json.loads((DATA / "reference_smollm2.json").read_text())[:3]
    runs = {}
    for size, artifact in ((1, smollm2_artifact), (3, tmp_path / "tp3")):
        llm = LLM(artifact, threads=2)
        recorder = llm.engine.runner.executor = _Recorder(llm.engine.runner.executor)
        outputs = llm.generate([r["prompt_token_ids"] for r in reference],
                               SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
        runs[size] = [o.outputs[0].token_ids for o in outputs], recorder.logits
    assert runs[3][0] == runs[1][0]
    assert max(float(np.abs(a - b).max()) for a, b in zip(runs[3][1], runs[1][1])) <= 1e-4
    for tokens, ref in zip(runs[3][0], reference):
        ok, why = _matches_reference(tokens, ref["token_ids"][:MAX_TOKENS], ref["top2_gap"])
        assert ok, why
