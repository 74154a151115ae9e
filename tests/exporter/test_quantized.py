"""Block-quantized weights: GGUF blocks kept bit for bit, RTN quantizers, the MatMulNBits lowering, config refusals."""
from __future__ import annotations

import io
from pathlib import Path

import gguf
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize
from onnx import helper, numpy_helper

from pagedgraph.exporter.checkpoint.gguf_blocks import from_gguf
from pagedgraph.exporter.checkpoint.gguf_reader import read_gguf
from pagedgraph.exporter.config import ExportConfig
from pagedgraph.exporter.export import GRAPH, export
from pagedgraph.exporter.quantize import int4_groupwise, int8_per_channel
from pagedgraph.graphs import contract as c
from pagedgraph.graphs import quant
from pagedgraph.artifact.manifest import Manifest
from pagedgraph.graphs.quant import BlockQuantized, Int8PerChannel
from pagedgraph.artifact.settings import ConfigError, validate
from pagedgraph.cpu_kernels.int8_gemm import fit_int8_gemm
from tests.exporter.tiny_gguf import write_tiny_gguf

pytestmark = pytest.mark.unit
LINEAR_KINDS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
GGUF_BLOCK_TYPES = (Q.Q4_0, Q.Q4_1, Q.Q8_0)


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, np.float32).view(np.uint32)


def _tiny_quantized_gguf(path: Path, qtype: Q) -> dict[str, np.ndarray]:
    kinds = {kind: qtype for kind in (*LINEAR_KINDS, "token_embd", "output")}
    return write_tiny_gguf(path, hidden=64, ffn=128, quant=kinds)


@pytest.mark.parametrize("qtype", GGUF_BLOCK_TYPES, ids=lambda t: t.name)
def test_gguf_blocks_read_back_equal_gguf_dequantize(tmp_path: Path, qtype: Q) -> None:
    expected = _tiny_quantized_gguf(tmp_path / "tiny.gguf", qtype)
    checkpoint = read_gguf(tmp_path / "tiny.gguf", keep_blocks=True)
    blocks = {k: w for k, w in checkpoint.tensors.items() if isinstance(w, BlockQuantized)}
    assert len(blocks) == 2 * len(LINEAR_KINDS) + 2 and {w.source for w in blocks.values()} == {qtype.name}
    for name, weight in checkpoint.tensors.items():
        got = weight.dequantize() if isinstance(weight, BlockQuantized) else weight
        np.testing.assert_array_equal(_bits(got), _bits(expected[name]), err_msg=name)


def _written_weight(model: onnx.ModelProto, name: str) -> BlockQuantized:
    """The weight `name` as the artifact stores it, decoded from its initializers and its MatMulNBits node alone."""
    init = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    node = next(n for n in model.graph.node if n.op_type == "MatMulNBits" and n.input[1] == f"{name}.codes")
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    return quant.from_graph(init[f"{name}.codes"], init[f"{name}.scales"], init.get(f"{name}.zero_points"),
                            init.get(f"{name}.minimum_t"), attrs["bits"], attrs["block_size"])


@pytest.mark.parametrize("qtype", GGUF_BLOCK_TYPES, ids=lambda t: t.name)
def test_gguf_artifact_holds_the_files_blocks_and_matches_dequantized_fp32(tmp_path: Path, qtype: Q) -> None:
    expected = _tiny_quantized_gguf(tmp_path / "tiny.gguf", qtype)
    logits = {}
    for quantization in ("gguf", "none"):
        manifest = _export_tiny(tmp_path, quantization)
        assert manifest.quantization == quantization
        model = onnx.load_model(tmp_path / quantization / GRAPH)
        logits[quantization] = _prefill_logits(model, manifest, [1, 2, 3, 4, 1, 3, 2])
        if quantization == "gguf":
            assert manifest.weight_formats == {qtype.name: 16, "float32": 5}
            assert Manifest.load(tmp_path / quantization).precision().startswith("float32, quantization gguf")
            nodes = [n.op_type for n in model.graph.node]
            assert nodes.count("MatMulNBits") == 2 * 4 + 1 and "Gemm" not in nodes
            for layer in range(2):
                p = f"model.layers.{layer}."
                want = np.concatenate([expected[p + f"self_attn.{x}_proj.weight"] for x in "qkv"])
                got = _written_weight(model, f"layers.{layer}.qkv").dequantize()
                np.testing.assert_array_equal(_bits(got), _bits(want))
                got = _written_weight(model, f"layers.{layer}.down").dequantize()
                np.testing.assert_array_equal(_bits(got), _bits(expected[p + "mlp.down_proj.weight"]))
    # accuracy_level 0: float32 compute on the dequantized blocks, so only summation order differs (Q4_1's
    # minimum term sums each block first: measured 6e-6 of the largest logit).
    assert np.abs(logits["gguf"] - logits["none"]).max() <= 1e-5 * np.abs(logits["none"]).max()


def test_q4_1_minimum_is_one_block_minimum_node_and_kernel_and_body_match_fp32(tmp_path: Path,
                                                                              custom_op_library: Path) -> None:
    """Each Q4_1 linear is MatMulNBits plus ONE BlockMinimum node; with pagedgraph's kernels registered and with
    the function bodies inlined, the logits match the dequantized fp32 artifact's."""
    _tiny_quantized_gguf(tmp_path / "tiny.gguf", Q.Q4_1)
    tokens = [1, 2, 3, 4, 1, 3, 2]
    fp32 = _export_tiny(tmp_path, "none")
    reference = _prefill_logits(onnx.load_model(tmp_path / "none" / GRAPH), fp32, tokens)
    manifest = _export_tiny(tmp_path, "gguf")
    model = onnx.load_model(tmp_path / "gguf" / GRAPH)
    nodes = [n.op_type for n in model.graph.node]
    assert nodes.count("BlockMinimum") == nodes.count("MatMulNBits") == 2 * 4 + 1  # and the Q4_1 LM head
    assert "ReduceSum" not in nodes and "Transpose" not in nodes
    minima = {t.name: t for t in model.graph.initializer if t.name.endswith(".minimum_t")}
    # stored in BlockMinimum's layout, in the file's float16 (ORT has nothing to fold into a float32 copy)
    assert len(minima) == 2 * 4 + 1 and {t.data_type for t in minima.values()} == {onnx.TensorProto.FLOAT16}
    body = _prefill_logits(model, manifest, tokens)
    kernel = _prefill_logits(model, manifest, tokens, custom_op_library)
    scale = np.abs(reference).max()
    for logits in (body, kernel):  # summation order only (the kernels' own, measured 9e-6 of the largest logit)
        assert np.abs(logits - reference).max() <= 1e-5 * scale


def _export_tiny(tmp_path: Path, quantization: str) -> Manifest:
    """tmp_path/tiny.gguf exported with `quantization` into tmp_path/<quantization>, one small gear per family."""
    config = ExportConfig.model_validate({"model": {"source": str(tmp_path / "tiny.gguf"), "quantization": quantization},
                                          "export": {"max_model_len": 64, "accuracy_level": 0, "buckets": {
                                              "decode_batch": [2], "prefill_tokens": [16], "prefill_max_seqs": 2}}})
    return export(config, tmp_path / quantization, log=io.StringIO())


def test_w8a8_artifact_holds_int8_per_channel_weights_and_tracks_fp32(tmp_path: Path, custom_op_library: Path
                                                                       ) -> None:
    expected = write_tiny_gguf(tmp_path / "tiny.gguf", hidden=64, ffn=128)
    logits, tokens = {}, [1, 2, 3, 4, 1, 3, 2]
    for quantization in ("w8a8", "none"):
        manifest = _export_tiny(tmp_path, quantization)
        model = onnx.load_model(tmp_path / quantization / GRAPH)
        logits[quantization] = _prefill_logits(model, manifest, tokens)
    assert manifest.quantization == "none"
    manifest = Manifest.load(tmp_path / "w8a8")
    assert manifest.quantization == "w8a8"
    assert manifest.weight_formats == {"int8-per-channel": 12, "rtn-int8-per-channel": 4, "float32": 5}
    model = onnx.load_model(tmp_path / "w8a8" / GRAPH)
    nodes = [n.op_type for n in model.graph.node]
    # qkv, o_proj, gate_up per layer; down_proj (weight-only int8) and the untied LM head through MatMulNBits
    assert nodes.count("MatMulIntegerToFloat") == 2 * 3 and nodes.count("MatMulNBits") == 2 + 1
    # each per-token quantize is ONE DynamicQuant node; with the custom ops (its kernel, and the attention's and
    # SwiGLU's in their own summation order) the logits stay the function bodies'
    assert nodes.count("DynamicQuant") == 2 * 3 and "Round" not in nodes
    kernel = _prefill_logits(model, manifest, tokens, custom_op_library)
    assert np.abs(kernel - logits["w8a8"]).max() <= 1e-5 * np.abs(logits["w8a8"]).max()
    init = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    o_proj = Int8PerChannel.quantize(expected["model.layers.1.self_attn.o_proj.weight"])
    np.testing.assert_array_equal(init["layers.1.o_proj.int8_t"], o_proj.q.T)
    np.testing.assert_array_equal(init["layers.1.o_proj.scale"], o_proj.scale)
    # The op's numerics are checked exactly against numpy in the op walk; here the wiring: int8 noise of this
    # random 2-layer model measures 7% of the largest logit, a transposed or mis-scaled weight gives ~100%.
    assert np.abs(logits["w8a8"] - logits["none"]).max() <= 0.15 * np.abs(logits["none"]).max()


def _prefill_logits(model: onnx.ModelProto, manifest: Manifest, tokens: list[int],
                    custom_ops: Path | None = None) -> np.ndarray:
    """One sequence's prefill through the artifact's graph (with the custom-op library `custom_ops` registered,
    if given), all rows' logits (one row per position)."""
    options = ort.SessionOptions()
    if custom_ops is not None:
        options.register_custom_ops_library(str(custom_ops))
    model = onnx.ModelProto.FromString(model.SerializeToString())
    fit_int8_gemm(model)  # as the runtime loads it on this CPU
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    t, bs = len(tokens), manifest.block_size
    feed = {c.INPUT_IDS: np.array(tokens, np.int64), c.POSITIONS: np.arange(t, dtype=np.int64),
            c.SLOT_MAPPING: bs + np.arange(t, dtype=np.int64), c.BLOCK_TABLES: np.array([[1]], np.int32),
            c.CONTEXT_LENS: np.array([t], np.int32), c.CU_SEQLENS_Q: np.array([0, t], np.int32),
            c.LOGITS_INDICES: np.array([t - 1], np.int64)}
    pool = np.zeros((2 * bs, manifest.model.kv_size), np.float32)
    return session.run([c.LOGITS], {**feed, **{name: pool for name in c.cache_names(manifest.model.num_layers)}})[0]


@pytest.mark.parametrize("qtype", (Q.Q4_K, Q.Q6_K), ids=lambda t: t.name)
def test_k_quant_blocks_equal_gguf_dequantize(tmp_path: Path, qtype: Q) -> None:
    """gguf-py has no K-quant quantizer: random blocks with finite fp16 scales, written with the writer."""
    rng = np.random.default_rng(1)
    size = {Q.Q4_K: 144, Q.Q6_K: 210}[qtype]
    raw = rng.integers(0, 256, size=(8, 2 * size), dtype=np.uint8)
    scales = np.float16(rng.random((16, 2)) * 0.01).view(np.uint8).reshape(16, 4)
    blocks = raw.reshape(16, size)
    if qtype == Q.Q4_K:
        blocks[:, 0:4] = scales  # d and dmin
    else:
        blocks[:, 208:210] = scales[:, :2]
    writer = gguf.GGUFWriter(tmp_path / "k.gguf", "llama")
    writer.add_tensor("w", raw, raw_shape=raw.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    info = gguf.GGUFReader(tmp_path / "k.gguf").tensors[0]
    weight = from_gguf(np.asarray(info.data), info.tensor_type, (8, 512))
    np.testing.assert_array_equal(_bits(weight.dequantize()), _bits(dequantize(np.asarray(info.data), qtype)))


def test_rtn_quantizers_keep_every_weight_within_half_a_step() -> None:
    rng = np.random.default_rng(4)
    w = rng.standard_normal((32, 192)).astype(np.float32) * np.linspace(0.01, 3, 32, dtype=np.float32)[:, None]
    int8 = int8_per_channel(w)
    assert int8.bits == 8 and int8.q.min() >= 1 and (int8.scale == int8.scale[:, :1]).all()  # one scale per row
    assert (np.abs(int8.dequantize() - w) <= int8.scale[:, :1] / 2 * (1 + 1e-6)).all()
    int4 = int4_groupwise(w, 64)
    assert int4.q.max() <= 15 and int4.minimum is not None and int4.scale.shape == (32, 3)
    # the group minima are float16 values (stored so, exactly) at or below every weight of their group
    assert quant.minimum_dtype(int4.minimum) == np.float16
    assert (int4.minimum <= w.reshape(32, 3, 64).min(axis=2)).all()
    step = np.repeat(int4.scale, 64, axis=1)
    assert (np.abs(int4.dequantize() - w) <= step * (0.5 + 1e-5)).all()
    with pytest.raises(ValueError, match="group_size = 128 does not divide .* 192; use 64"):
        int4_groupwise(w, 128)


@pytest.mark.parametrize(("data", "says"), [
    ({"model": {"source": "some/hf_dir", "quantization": "gguf"}}, "not a .gguf file; nearest valid: w4a16"),
    ({"model": {"dtype": "bfloat16"}, "export": {"formats": ["onnx", "mindir"]}},
     "model.dtype = 'bfloat16' is not built .* nearest valid: bfloat16 with export.formats \\[onnx\\]"),
    ({"model": {"dtype": "float16"}}, "model.dtype = 'float16' is not built .* nearest valid: bfloat16"),
    ({"model": {"dtype": "bfloat16", "quantization": "w8a16"}}, "float32 activations .* nearest valid: quantization none"),
    ({"model": {"dtype": "bfloat16"}, "export": {"baseline": "naive"}}, "export.baseline = 'naive'"),
    ({"model": {"dtype": "float16"}, "export": {"formats": ["onnx", "mindir"], "target": "ascend"}},
     "the ONNX graphs compute in float32; the Ascend MINDIR alone"),
    ({"export": {"formats": ["mindir"], "target": "ascend", "kv_cache_dtypes": ["float32", "bfloat16"]}},
     r"computes in float16 .* so \['bfloat16'\] cannot be served there"),
    ({"export": {"formats": ["mindir"], "kv_cache_dtypes": ["float32", "int8"]}},
     "CPU MINDIR holds float32 pools only"),
    ({"model": {"quantization": "w8a8"}, "export": {"formats": ["mindir"]}}, "ONNX only .*MindSpore CPU"),
    ({"model": {"quantization": "gguf"}, "export": {"formats": ["mindir"], "target": "ascend"}},
     "Ascend MINDIR builds w8a16, w4a16 .* not a GGUF's blocks"),
    ({"model": {"quantization": "w4a16", "group_size": 16}, "export": {"formats": ["mindir"], "target": "ascend"}},
     "group_size = 16: Ascend's WeightQuantBatchMatmul .* nearest valid: 32"),
    ({"model": {"quantization": "w4a16", "group_size": 100}}, "group_size = 100.* nearest valid: 128"),
    ({"model": {"quantization": "gguf"}, "export": {"formats": ["onnx", "mindir"]}}, "lowered to ONNX only"),
    ({"model": {"quantization": "w8a16"}, "export": {"baseline": "naive"}}, "export.baseline = 'naive'"),
    ({"model": {"quantization": "int8"}}, "quantization = 'int8'"),
    ({"model": {"source": "m.gguf", "quantization": "gptq"}}, "reads a Hugging Face checkpoint directory .* gguf"),
    ({"model": {"source": "hf_dir", "quantization": "awq"}, "export": {"formats": ["mindir"], "target": "ascend"}},
     "nor a GPTQ/AWQ checkpoint's"),
])
def test_invalid_precisions_are_refused_with_the_nearest_valid_choice(data: dict, says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        validate(ExportConfig, data, "export.yaml")
