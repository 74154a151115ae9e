"""The MindSpore lowering on a tiny random Llama: CPU MINDIR graphs vs the numpy references and vs
ONNX Runtime, the generated Ascend graphs read back. (Each op's body alone: tests/graphs/test_op_walk.py.)"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.mindspore_support import RecordingExecutor, export_artifact, require_mindspore

require_mindspore()

from pagedgraph.artifact.manifest import ArtifactError, Manifest  # noqa: E402
from pagedgraph.artifact.mindir import WEIGHTS, MindirIndex, gear_key, numpy_dtype  # noqa: E402
from pagedgraph.exporter.checkpoint import read_checkpoint  # noqa: E402
from pagedgraph.exporter.mindspore.builder import MindSporeTarget  # noqa: E402
from pagedgraph.exporter.mindspore.builder import weight_attribute as W  # noqa: E402
from pagedgraph.exporter.mindspore.readback import read_graph, read_ops  # noqa: E402
from pagedgraph.graphs import contract as c  # noqa: E402
from pagedgraph.graphs import models, ops  # noqa: E402
from pagedgraph.graphs.family import GraphOptions  # noqa: E402
from pagedgraph.graphs.contract import Gear  # noqa: E402
from pagedgraph.graphs.reference import NumpyBuilder  # noqa: E402
from pagedgraph.runtime.engine import EngineConfig, LLMEngine  # noqa: E402
from pagedgraph.runtime.executor_mindspore import MindSporeExecutor  # noqa: E402
from pagedgraph.runtime.kv_pools import KVPools  # noqa: E402
from pagedgraph.runtime.sampling_params import SamplingParams  # noqa: E402
from tests.paths import REPO  # noqa: E402
from tests.random_checkpoint import write_random_llama  # noqa: E402

pytestmark = pytest.mark.unit
BLOCK = 16
MAX_LEN = 64
ATOL = 1e-4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_llama(tmp_path_factory.mktemp("random_llama"))


@pytest.fixture(scope="module")
def artifact(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ONNX and CPU MINDIR side by side: prefill gear (16, 2, 4), decode gear (2, 2, 4)."""
    return export_artifact(str(checkpoint), tmp_path_factory.mktemp("tiny") / "art", ["onnx", "mindir"],
                           decode=[2], prefill=[16], max_seqs=2, max_model_len=MAX_LEN)


_BUFFERS: dict[Gear, dict[str, np.ndarray]] = {}


def _step(gear: Gear, seqs: list[tuple[list[int], int, list[int]]]) -> dict[str, np.ndarray]:
    """Contract inputs for (new tokens, first position, block ids) per sequence; padding -> null block.

    Like the packer, one set of buffers per gear, refilled in place: executors bind them once.
    """
    feed = _BUFFERS.setdefault(gear, {n: np.zeros(s, c.INPUT_DTYPES[n]) for n, s in gear.input_shapes().items()})
    for array in feed.values():
        array.fill(0)
    row = 0
    for b, (tokens, start, blocks) in enumerate(seqs):
        pos = np.arange(start, start + len(tokens))
        feed[c.INPUT_IDS][row:row + len(tokens)] = tokens
        feed[c.POSITIONS][row:row + len(tokens)] = pos
        feed[c.SLOT_MAPPING][row:row + len(tokens)] = np.array(blocks)[pos // BLOCK] * BLOCK + pos % BLOCK
        feed[c.BLOCK_TABLES][b, :len(blocks)] = blocks
        feed[c.CONTEXT_LENS][b] = start + len(tokens)
        feed[c.CU_SEQLENS_Q][b] = row
        row += len(tokens)
        feed[c.LOGITS_INDICES][b] = row - 1
    feed[c.CU_SEQLENS_Q][len(seqs):] = row
    return feed


def test_cpu_graphs_match_numpy_references_step_by_step(artifact: Path, checkpoint: Path) -> None:
    """Prefill, then a chunk after cached tokens beside a decode, then pure decode: logits and pools."""
    manifest = Manifest.load(artifact)
    model = manifest.model
    weights = models.graph_weights(model, read_checkpoint(str(checkpoint)).tensors, MAX_LEN)
    executor = MindSporeExecutor(artifact, manifest, KVPools(manifest, 6))
    reference_pools = {name: np.zeros_like(pool) for name, pool in executor.pools.items()}
    steps = [
        (Gear(16, 2, 4), [([5, 9, 14, 3, 7], 0, [1]), ([11, 12, 13], 0, [3, 5])]),
        (Gear(16, 2, 4), [([8], 5, [1]), ([20, 21, 22, 23], 3, [3, 5])]),
        (Gear(2, 2, 4), [([30], 6, [1]), ([31], 7, [3, 5])]),
    ]
    for gear, seqs in steps:
        feed = _step(gear, seqs)
        expected = NumpyBuilder({**feed, **reference_pools}, weights)
        models.build(expected, model, GraphOptions(manifest.block_size))
        logits = executor.run(gear, feed)
        np.testing.assert_allclose(logits, expected.outputs[c.LOGITS], atol=ATOL, rtol=0)
        for name, pool in executor.pools.items():
            np.testing.assert_allclose(pool, reference_pools[name], atol=1e-5, rtol=0, err_msg=name)
    assert executor.pools["k_cache_1"][3 * BLOCK + 6].any(), "the chunk's last key must be in block 3"


def test_executor_binds_pools_of_any_size_and_copies_blocks(artifact: Path) -> None:
    manifest = Manifest.load(artifact)
    executor = MindSporeExecutor(artifact, manifest, KVPools(manifest, 40))
    gear = Gear(2, 2, 4)
    executor.run(gear, _step(gear, [([4], 0, [37]), ([6], 0, [2])]))
    written = executor.pools["v_cache_0"][37 * BLOCK].copy()
    assert written.any()
    executor.pools.copy_blocks([(37, 39)])
    np.testing.assert_array_equal(executor.pools["v_cache_0"][39 * BLOCK], written)


def _engine_run(artifact: Path, executor: str, prompts: list[list[int]]) -> tuple[RecordingExecutor, list[list[int]]]:
    engine = LLMEngine(artifact, EngineConfig(num_blocks=24, executor=executor))
    recorder = engine.runner.executor = RecordingExecutor(engine.runner.executor)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    outputs = [o.token_ids for o in _generate(engine, prompts, params)]
    return recorder, outputs


def _generate(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> list[Any]:
    ids = [engine.add_request(p, params).request_id for p in prompts]
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    return [done[i] for i in ids]


def test_engine_with_mindspore_executor_equals_onnxruntime(artifact: Path) -> None:
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 300, size=n).tolist() for n in (3, 12, 25, 7)]  # 25 > T=16: chunked prefill
    ort, ort_tokens = _engine_run(artifact, "onnxruntime", prompts)
    ms, ms_tokens = _engine_run(artifact, "mindspore", prompts)
    assert [g for g, _ in ms.steps] == [g for g, _ in ort.steps]
    assert {g for g, _ in ms.steps} == {Gear(16, 2, 4), Gear(2, 2, 4)}
    worst = max(float(np.abs(a - b).max()) for (_, a), (_, b) in zip(ms.steps, ort.steps))
    assert worst <= ATOL, f"MindSpore vs ONNX Runtime logits differ by {worst:.2e}"
    assert ms_tokens == ort_tokens


def test_executor_refuses_an_artifact_without_cpu_mindir(checkpoint: Path, tmp_path: Path) -> None:
    art = export_artifact(str(checkpoint), tmp_path / "onnx_only", ["onnx"], decode=[2], prefill=[16], max_seqs=2,
                          max_model_len=MAX_LEN)
    with pytest.raises(ArtifactError, match="--format onnx,mindir --target cpu"):
        LLMEngine(art, EngineConfig(num_blocks=8, executor="mindspore"))


@pytest.fixture(scope="module")
def ascend_artifact(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export_artifact(str(checkpoint), tmp_path_factory.mktemp("ascend") / "art", ["mindir"], decode=[2],
                           prefill=[16], max_seqs=2, max_model_len=MAX_LEN, target="ascend")


FUSED = {"ReshapeAndCache", "PagedAttention", "RmsNorm", "AddRmsNorm", "RotaryPositionEmbedding", "Swiglu",
         "MatMul"}


def test_ascend_mindir_holds_atb_primitives_with_their_attributes(ascend_artifact: Path, checkpoint: Path) -> None:
    index = MindirIndex.load(ascend_artifact)
    model = Manifest.load(ascend_artifact).model
    assert index.target == "ascend" and index.dtype == "float16"
    for family, graphs in index.graphs.items():
        records = read_ops(ascend_artifact / next(iter(graphs.values())), FUSED)
        print(f"\n{family}:")
        for op_type in sorted(FUSED):
            found = [r for r in records if r.op_type == op_type]
            print(f"  {op_type} x{len(found)}: {found[0].attributes or ''} {found[0].arguments}")
        kinds = {r.op_type: [x for x in records if x.op_type == r.op_type] for r in records}
        assert set(kinds) == FUSED
        assert len(kinds["ReshapeAndCache"]) == len(kinds["PagedAttention"]) == model.num_layers
        assert len(kinds["RmsNorm"]) == 1 and len(kinds["AddRmsNorm"]) == 2 * model.num_layers  # every residual Add
        write = kinds["ReshapeAndCache"][0]
        assert write.attributes["side_effect_mem"] is True
        assert write.arguments["key_cache"] == "k_cache_0" and write.arguments["value_cache"] == "v_cache_0"
        assert write.shapes["key_cache"] == (5, BLOCK, model.num_kv_heads, model.head_dim)  # ATB's layout
        attention = kinds["PagedAttention"][0].arguments
        assert (attention["head_num"], attention["kv_head_num"]) == (model.num_heads, model.num_kv_heads)
        assert attention["scale_value"] == pytest.approx(model.head_dim ** -0.5)
        assert attention["block_tables"] == c.BLOCK_TABLES and attention["context_lens"] == c.CONTEXT_LENS
        assert (attention["query"], attention["key_cache"], attention["value_cache"]) == ("<Reshape>", "k_cache_0",
                                                                                          "v_cache_0")
        multi_query = family == c.PREFILL  # only prefill passes per-sequence query lengths and a causal mask
        assert (attention["q_seq_lens"] == "<Sub>") == multi_query and (attention["q_seq_lens"] is None) != multi_query
        assert (attention["attn_mask"] is None) != multi_query
        assert kinds["RmsNorm"][0].arguments["epsilon"] == pytest.approx(1e-5)
        assert kinds["AddRmsNorm"][0].arguments["epsilon"] == pytest.approx(1e-5)
        assert kinds["RotaryPositionEmbedding"][0].arguments["mode"] == 0  # rotate-half
        assert all(r.arguments["transpose_b"] for r in kinds["MatMul"])  # ATB's [out, in] weights
        assert kinds["MatMul"][0].arguments["mat2"] == W("layers.0.qkv")  # a graph input, not a Parameter


# model.dtype -> (export.formats, export.kv_cache_dtypes, the Ascend MINDIR's compute dtype)
ASCEND_CACHES = {"float32": (["onnx", "mindir"], ["float32", "int8"], "float16"),
                 "bfloat16": (["mindir"], ["bfloat16", "int8"], "bfloat16")}
# PagedAttention's (antiquant_scale, antiquant_offset) dtypes per compute dtype: pairs MindSpore's infer takes
ANTIQUANT = {"float16": ("float16", "float16"), "bfloat16": ("float32", "int32")}
CACHE_OPS = {"QuantV2", "ReshapeAndCache", "PagedAttention", "MatMul", "Neg"}


@pytest.fixture(scope="module", params=list(ASCEND_CACHES))
def ascend_caches(request: pytest.FixtureRequest, checkpoint: Path,
                  tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """An Ascend MINDIR with a compute-dtype cache and an int8 one (float32 beside the ONNX int8 graph)."""
    formats, caches, _ = ASCEND_CACHES[request.param]
    art = export_artifact(str(checkpoint), tmp_path_factory.mktemp(f"ascend_{request.param}") / "art", formats,
                          decode=[2], prefill=[16], max_seqs=2, max_model_len=MAX_LEN, target="ascend",
                          model={"dtype": request.param}, kv_cache_dtypes=caches,
                          kv_cache_calibration=str(REPO / "pagedgraph" / "data" / "calibration.txt"))
    return request.param, art


def test_ascend_mindir_holds_a_graph_set_per_cache_dtype_with_atb_int8_cache(ascend_caches: tuple[str, Path]) -> None:
    """Per cache dtype, the primitives, their attributes and their input dtypes read back: the compute dtype's
    cache as it is; int8 as ATB's C8 (QuantV2 then ReshapeAndCache into int8 pools, PagedAttention with
    kv_cache_quant_mode DEFAULT and the antiquant scale/offset)."""
    from mindspore.ops.auto_generate.gen_ops_prim import str_to_enum

    model_dtype, art = ascend_caches
    _, caches, compute = ASCEND_CACHES[model_dtype]
    index, manifest = MindirIndex.load(art), Manifest.load(art)
    model = manifest.model
    assert (index.dtype, set(index.kv_cache_graphs), manifest.kv_cache_dtypes) == (compute, {"int8"}, tuple(caches))
    default = str_to_enum("PagedAttention", "kv_cache_quant_mode", "DEFAULT")
    for cache, graph_set in ((compute, index.graphs), ("int8", index.kv_cache_graphs["int8"])):
        pool = "int8" if cache == "int8" else compute
        for family, graphs in graph_set.items():
            records = read_ops(art / next(iter(graphs.values())), CACHE_OPS)
            kinds = {k: [r for r in records if r.op_type == k] for k in CACHE_OPS}
            print(f"\n{cache} cache, {family}:")
            for op_type, found in sorted(kinds.items()):
                if found:
                    print(f"  {op_type} x{len(found)}: {found[0].arguments} dtypes {found[0].dtypes} "
                          f"-> {found[0].output_dtype}")
            assert all(r.dtypes == {"input": compute, "mat2": compute} and r.output_dtype == compute
                       for r in kinds["MatMul"])
            assert len(kinds["ReshapeAndCache"]) == len(kinds["PagedAttention"]) == model.num_layers
            write, attention = kinds["ReshapeAndCache"][0], kinds["PagedAttention"][0]
            assert write.dtypes == {"key": pool, "value": pool, "key_cache": pool, "value_cache": pool,
                                    "slot_mapping": "int32"}
            assert write.shapes["key_cache"] == (5, BLOCK, model.num_kv_heads, model.head_dim)
            args = attention.arguments
            assert (attention.dtypes["query"], attention.dtypes["key_cache"], attention.output_dtype) == (
                compute, pool, compute)
            assert args["kv_cache_quant_mode"] == default and (args["head_num"], args["kv_head_num"]) == (
                model.num_heads, model.num_kv_heads)
            assert (args["attn_mask"] is None) == (family == c.DECODE)
            if cache != "int8":
                assert not kinds["QuantV2"] and not kinds["Neg"]
                assert args["antiquant_scale"] is None and args["antiquant_offset"] is None
                continue
            assert (write.arguments["key"], write.arguments["value"]) == ("<QuantV2>", "<QuantV2>")
            assert len(kinds["QuantV2"]) == 2 * model.num_layers
            for quant, kv in zip(kinds["QuantV2"][:2], "kv"):
                assert (quant.arguments["scale"], quant.arguments["offset"]) == (
                    W(f"layers.0.{kv}_cache_inv_scale"), W(f"layers.0.{kv}_cache_offset"))
                assert quant.dtypes == {"x": compute, "scale": compute, "offset": compute}
                assert quant.output_dtype == "int8" and quant.shapes["scale"] == (model.kv_size,)
            assert args["antiquant_scale"] == "<Stack>"  # K's and V's rows stacked: ATB's [2, kv_heads * head_dim]
            # antiquant computes scale * (q + offset): the offset it takes is minus the contract's
            negated = [r.arguments["input"] for r in kinds["Neg"][:2]]
            assert negated == [W("layers.0.k_cache_offset"), W("layers.0.v_cache_offset")]
            assert (attention.dtypes["antiquant_scale"], attention.dtypes["antiquant_offset"]) == ANTIQUANT[compute]


def test_ascend_int8_cache_parameters_are_the_calibrated_ones(ascend_caches: tuple[str, Path]) -> None:
    """The MINDIR's int8 parameters are the ONNX int8 graph's calibrated numbers, in the dtypes Ascend reads."""
    import onnx
    from onnx import numpy_helper

    model_dtype, art = ascend_caches
    _, _, compute = ASCEND_CACHES[model_dtype]
    index = MindirIndex.load(art)
    weights = index.read_weights(art)
    scale, inv, offset = (weights[f"layers.0.k_cache_{f}"] for f in ("scale", "inv_scale", "offset"))
    assert (inv.dtype.name, offset.dtype.name, scale.dtype.name) == (compute, compute, ANTIQUANT[compute][0])
    wide = {name: w.astype(np.float32) for name, w in weights.items() if "_cache_" in name}
    assert {name.split(".", 2)[2] for name in wide} == {f"{kv}_cache_{f}" for kv in "kv"
                                                        for f in ("scale", "inv_scale", "offset")}
    for name, w in wide.items():
        if name.endswith("offset"):
            assert (w == np.round(w)).all() and w.min() >= -128 and w.max() <= 127
    np.testing.assert_allclose(wide["layers.0.k_cache_scale"] * wide["layers.0.k_cache_inv_scale"], 1, rtol=1e-2)
    if model_dtype != "float32":
        return
    graph = onnx.load_model(art / "graphs" / "model.kv-int8.onnx", load_external_data=False)
    calibrated = {t.name: numpy_helper.to_array(t) for t in graph.graph.initializer if t.name in wide}
    assert set(calibrated) == set(wide)
    for name, value in calibrated.items():
        np.testing.assert_allclose(wide[name], value, rtol=1e-3, err_msg=name)


def _ascend_weight(weights: dict[str, np.ndarray], name: str, bits: int) -> np.ndarray:
    """A weight as WeightQuantBatchMatmul computes it from the stored parts: (codes + offset) * scale per group,
    the offset being the zero point's plus minimum / scale; int4 codes unpacked from qint4x2 (even one low)."""
    codes = weights[f"{name}.codes"]
    if bits == 4:
        nibbles = codes.view(np.uint8)
        codes = np.stack([nibbles & 0x0F, nibbles >> 4], axis=-1).reshape(codes.shape[0], -1)
        codes = np.where(codes > 7, codes.astype(np.int16) - 16, codes)
    scale = weights[f"{name}.scales"].astype(np.float32)
    offset = weights.get(f"{name}.zero_points", np.zeros_like(scale)).astype(np.float32)
    if f"{name}.minimum_t" in weights:
        offset = offset + weights[f"{name}.minimum_t"].astype(np.float32).T / scale
    group = codes.shape[1] // scale.shape[1]
    return (codes.astype(np.float32) + np.repeat(offset, group, 1)) * np.repeat(scale, group, 1)


@pytest.mark.parametrize(("quantization", "dtype"), [("w8a16", "bfloat16"), ("w4a16", "float16")])
def test_ascend_weight_only_lowers_to_weight_quant_batch_matmul(checkpoint: Path, tmp_path: Path, quantization: str,
                                                                dtype: str) -> None:
    """w8a16 / w4a16 on Ascend: every linear is WeightQuantBatchMatmul on int8 or qint4x2 codes [n, k]
    (transpose_weight) with antiquant scales in the compute dtype (w8a16 per channel, w4a16 per group of 32 with
    its minimum in the offset), the embedding a gather of int8 rows; the stored parts give back the export's
    round-to-nearest weights."""
    from pagedgraph.exporter.quantize import quantize_weights

    bits = 8 if quantization == "w8a16" else 4
    art = export_artifact(str(checkpoint), tmp_path / "art", ["mindir"], decode=[2], prefill=[16], max_seqs=2,
                          max_model_len=MAX_LEN, target="ascend", model={"dtype": dtype, "quantization": quantization})
    index, model = MindirIndex.load(art), Manifest.load(art).model
    records = read_ops(art / index.graphs[c.DECODE][gear_key(Gear(2, 2, 4))],
                       {"WeightQuantBatchMatmul", "MatMul", "Gather"})
    matmuls = [r for r in records if r.op_type == "WeightQuantBatchMatmul"]
    print(f"\nWeightQuantBatchMatmul x{len(matmuls)}: {matmuls[0].arguments} dtypes {matmuls[0].dtypes} "
          f"shapes {matmuls[0].shapes} -> {matmuls[0].output_dtype}")
    assert not [r for r in records if r.op_type == "MatMul"] and len(matmuls) == 4 * model.num_layers + 1
    layers, head = matmuls[:-1], matmuls[-1]
    for r in layers:
        args = r.arguments
        n, packed_k = r.shapes["weight"]
        assert (args["transpose_x"], args["transpose_weight"]) == (False, True) and r.output_dtype == dtype
        if bits == 8:  # RTN int8: one scale per row, zero point 128 (signed codes, no offset)
            assert args["antiquant_group_size"] == 0 and args["antiquant_offset"] is None
            assert r.dtypes == {"x": dtype, "weight": "int8", "antiquant_scale": dtype}
            assert r.shapes["antiquant_scale"] == (n, 1)
        else:  # groups of 32 with the group's minimum
            assert args["antiquant_group_size"] == 32 and args["antiquant_offset"] == "<Add>"
            assert r.dtypes == {"x": dtype, "weight": "qint4x2", "antiquant_scale": dtype, "antiquant_offset": dtype}
            assert r.shapes["antiquant_scale"] == (n, packed_k * 2 // 32)
    assert head.arguments["weight"] == W("embed.codes") and head.dtypes["weight"] == "int8"  # the tied LM head: int8
    (embed,) = [r for r in records if r.op_type == "Gather" and r.arguments["input_params"] == W("embed.codes")]
    assert embed.dtypes["input_params"] == "int8"
    weights = index.read_weights(art)
    raw = read_checkpoint(str(checkpoint))
    expected = quantize_weights(raw.config, raw.tensors, quantization, 32)
    rtn = expected["model.layers.0.self_attn.o_proj.weight"].dequantize()
    tolerance = 1e-2 if dtype == "bfloat16" else 2e-3  # the scales in the compute dtype
    np.testing.assert_allclose(_ascend_weight(weights, "layers.0.o_proj", bits), rtn, rtol=tolerance,
                               atol=tolerance * np.abs(rtn).max())


def test_ascend_w8a8_lowers_to_quant_batch_matmul_with_calibrated_input_scales(checkpoint: Path,
                                                                              tmp_path: Path) -> None:
    """w8a8 on Ascend: q/k/v, o_proj and gate/up are QuantBatchMatmul with MindIE's tensors, their static input
    scale/offset calibrated on the float32 graph (layer 0's input is RmsNorm of the embedding rows, so numpy
    recomputes its range; SmoothQuant off, tests/exporter/test_smoothquant.py checks it); down_proj and the tied LM head stay weight-only (WeightQuantBatchMatmul)."""
    from tokenizers import Tokenizer

    from pagedgraph.exporter.kv_calibration import calibration_windows

    text = REPO / "pagedgraph" / "data" / "calibration.txt"
    art = export_artifact(str(checkpoint), tmp_path / "art", ["mindir"], decode=[2], prefill=[16], max_seqs=2,
                          max_model_len=MAX_LEN, target="ascend", model={"dtype": "float16", "quantization": "w8a8"},
                          kv_cache_calibration=str(text), w8a8_smoothing=None)
    index, model = MindirIndex.load(art), Manifest.load(art).model
    records = read_ops(art / index.graphs[c.PREFILL][gear_key(Gear(16, 2, 4))],
                       {"QuantBatchMatmul", "WeightQuantBatchMatmul", "MatMul"})
    static = [r for r in records if r.op_type == "QuantBatchMatmul"]
    weight_only = [r for r in records if r.op_type == "WeightQuantBatchMatmul"]
    print(f"\nQuantBatchMatmul x{len(static)}: {static[0].arguments} dtypes {static[0].dtypes} -> "
          f"{static[0].output_dtype}\nWeightQuantBatchMatmul x{len(weight_only)}: {weight_only[0].arguments}")
    assert len(static) == 3 * model.num_layers and len(weight_only) == model.num_layers + 1
    assert not [r for r in records if r.op_type == "MatMul"]
    assert [r.arguments["x2"] for r in static[:3]] == [W("layers.0.qkv.weight"), W("layers.0.o_proj.weight"),
                                                      W("layers.0.gate_up.weight")]
    for r in static:
        assert (r.arguments["transpose_x2"], r.arguments["dtype"], r.output_dtype) == (True, 42, "float16")
        assert r.dtypes == {"x1": "int8", "x2": "int8", "scale": "int64", "bias": "int32"}
    assert weight_only[0].arguments["weight"] == W("layers.0.down.codes")
    weights = index.read_weights(art)
    assert weights["layers.0.qkv.input_scale"].dtype == np.float16
    ck = read_checkpoint(str(checkpoint))
    tokens = Tokenizer.from_str(ck.tokenizer.tokenizer_json).encode(text.read_text(), add_special_tokens=False).ids
    windows = calibration_windows(tokens, 512, [Gear(16, 2, 4)], BLOCK)
    x = ck.tensors["model.embed_tokens.weight"][np.concatenate(windows)].astype(np.float64)
    normed = x / np.sqrt((x * x).mean(-1, keepdims=True) + model.rms_norm_eps) \
        * ck.tensors["model.layers.0.input_layernorm.weight"]
    low, high = min(normed.min(), 0.0), max(normed.max(), 0.0)
    scale = (high - low) / 255
    np.testing.assert_allclose(float(weights["layers.0.qkv.input_scale"][0]), scale, rtol=1e-3)
    assert float(weights["layers.0.qkv.input_offset"][0]) == np.rint(-128 - low / scale)


def assert_one_copy_of_the_weights(art: Path, checkpoint: Path) -> None:
    """Every gear of every cache dtype holds no weight data and no Parameter (a loaded GraphCell would keep a
    private copy of each): it takes the weights as graph inputs after the contract inputs and pools, each with
    the shape and dtype of its one entry in the weights file, which holds every weight once, as exported."""
    index = MindirIndex.load(art)
    data = (art / WEIGHTS).read_bytes()
    graph_sets = {index.dtype: index.graphs, **index.kv_cache_graphs}
    for cache, graph_set in graph_sets.items():
        expected = [*index.inputs, *map(W, index.weight_inputs[cache])]
        for rel in (rel for graphs in graph_set.values() for rel in graphs.values()):
            record = read_graph(art / rel)
            assert record.parameters == [] and record.data_bytes < 4096, rel
            assert [a.name for a in record.arguments] == expected, rel
            for name, argument in zip(index.weight_inputs[cache], record.arguments[len(index.inputs):]):
                entry = index.weights[name]
                assert (argument.shape, argument.dtype) == (entry.shape, entry.dtype or index.dtype), name
    assert {w for order in index.weight_inputs.values() for w in order} == set(index.weights)
    ends = 64  # after the header, each entry where the previous one ended, 64-byte aligned: nothing stored twice
    for entry in sorted(index.weights.values(), key=lambda e: e.offset):
        assert entry.offset == ends
        ends += -(-int(np.prod(entry.shape)) * numpy_dtype(entry.dtype or index.dtype).itemsize // 64) * 64
    assert ends == len(data)
    stored = index.read_weights(art)
    ck = read_checkpoint(str(checkpoint))
    for name, w in models.graph_weights(ck.config, ck.tensors, MAX_LEN).items():
        np.testing.assert_array_equal(stored[name], w.astype(stored[name].dtype), err_msg=name)


def test_cpu_ladder_references_one_copy_of_the_weights(artifact: Path, checkpoint: Path) -> None:
    assert_one_copy_of_the_weights(artifact, checkpoint)


def test_ascend_ladder_references_one_copy_of_the_weights(ascend_caches: tuple[str, Path], checkpoint: Path) -> None:
    """Both cache dtypes' graph sets (the int8 one takes the calibrated cache parameters besides)."""
    assert_one_copy_of_the_weights(ascend_caches[1], checkpoint)


def test_activation_peak_counts_the_live_tensors_in_graph_order(tmp_path: Path) -> None:
    """Three [64, 64] float32 tensors (16 KiB each) are live at once in `c = (a + 1) * a` over a view of `a`;
    the input is the caller's, a Reshape a view, and each tensor is freed after its last reader."""
    import mindspore as ms
    from mindspore import nn
    from mindspore import ops as msops

    class Chain(nn.Cell):
        def construct(self, x):
            a = x * 2
            b = a + 1
            c = msops.reshape(b, (64, 64)) * msops.reshape(a, (64, 64))
            return c - 1

    ms.export(Chain(), ms.Tensor(np.zeros(4096, np.float32)), file_name=str(tmp_path / "chain"), file_format="MINDIR")
    record = read_graph(tmp_path / "chain.mindir")
    assert [(a.shape, a.dtype) for a in record.arguments] == [((4096,), "float32")]
    assert record.activation_bytes == 3 * 4096 * 4


def test_self_attention_lowers_to_flash_attention_tnd_on_ascend(tmp_path: Path) -> None:
    """The Ascend body reads back as FlashAttentionScore in TND layout with host sequence lengths, as ATB does.

    (Its CPU body's results are tests/graphs/test_op_walk.py's.)
    """
    import mindspore as ms
    from mindspore.ops.auto_generate.gen_ops_prim import str_to_enum  # MINDIR stores the layout as an enum

    from pagedgraph.exporter.mindspore.ascend_ops import MINDSPORE_ASCEND

    attrs = ops.SELF_ATTENTION.attrs(head_num=4, kv_head_num=2, head_dim=16, qk_scale=0.25)
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((14, w)).astype(np.float16) for w in (64, 32, 32))
    cu = np.array([0, 5, 5, 12], np.int32)
    cell = MINDSPORE_ASCEND.body(ops.SELF_ATTENTION)(attrs, MindSporeTarget("ascend"))
    path = tmp_path / "self_attention"
    ms.export(cell, *(ms.Tensor(x) for x in (q, k, v, cu)), file_name=str(path), file_format="MINDIR")
    (record,) = read_ops(path.with_suffix(".mindir"), {"FlashAttentionScore"})
    args = record.arguments
    tnd = str_to_enum("FlashAttentionScore", "input_layout", "TND")
    assert (args["head_num"], args["input_layout"], args["sparse_mode"]) == (4, tnd, 3)
    assert args["actual_seq_qlen"] == args["actual_seq_kvlen"] == "<TensorToTuple>"  # host lengths, as ATB reads
    assert args["scale_value"] == pytest.approx(0.25)


@pytest.mark.parametrize("fp16", [True, False], ids=["int64 deq_scale (fp16 model)", "float32 deq_scale (bf16 model)"])
def test_w8a8_static_lowers_to_quant_batch_matmul_with_mindie_tensors(tmp_path: Path, fp16: bool) -> None:
    """MindIE's W8A8 tensors reach QuantBatchMatmul as they are: int8 x and weight [n, k] (transpose_x2),
    deq_scale as `scale` (int64 for fp16 models, float32 for bf16), int32 quant_bias, float16 out."""
    import mindspore as ms
    from mindspore.train.mind_ir_pb2 import ModelProto, TensorProto

    from pagedgraph.exporter.mindspore.ascend_ops import MINDSPORE_ASCEND
    from pagedgraph.graphs.ops.linear_w8a8_static import mindie_tensors
    from pagedgraph.graphs.quant import Int8PerChannel

    rng = np.random.default_rng(0)
    w = Int8PerChannel.quantize(rng.standard_normal((24, 64)).astype(np.float32))
    inputs = (rng.standard_normal((5, 64)).astype(np.float16),
              *mindie_tensors(w, None, 0.02, 3, fp16))
    inputs = tuple(x.astype(np.float16) if x.dtype == np.float32 and x.shape != (24,) else x for x in inputs)
    cell = MINDSPORE_ASCEND.body(ops.LINEAR_W8A8_STATIC)(ops.LINEAR_W8A8_STATIC.attrs(K=64, N=24),
                                                         MindSporeTarget("ascend"))
    path = tmp_path / "w8a8_static"
    ms.export(cell, *(ms.Tensor(x) for x in inputs), file_name=str(path), file_format="MINDIR")
    (record,) = read_ops(path.with_suffix(".mindir"), {"QuantBatchMatmul"})
    args = record.arguments
    assert (args["transpose_x1"], args["transpose_x2"]) == (False, True)
    assert args["dtype"] == 42  # MindSpore's TypeId kNumberTypeFloat16: the output dtype
    assert (args["x2"], args["scale"], args["bias"]) == ("weight", "deq_scale", "quant_bias")
    assert args["x1"] == "<Cast>" and args["offset"] is None and args["pertokenScaleOptional"] is None
    model = ModelProto()
    model.ParseFromString(path.with_suffix(".mindir").read_bytes())
    dtypes = {i.name.split(":")[-1]: TensorProto.DataType.Name(i.tensor[0].data_type) for i in model.graph.input}
    assert (dtypes["weight"], dtypes["quant_bias"]) == ("INT8", "INT32")
    assert dtypes["deq_scale"] == ("INT64" if fp16 else "FLOAT")
