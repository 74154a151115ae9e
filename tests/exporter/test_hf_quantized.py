"""HF checkpoints quantized with GPTQ / AWQ, read as they are: the blocks equal the packing library's own
dequantization bit for bit, the artifact holds them in MatMulNBits and follows HF transformers fp32 on the
dequantized weights, and what does not map is refused naming the field, the value and the fix."""
from __future__ import annotations

import io
import json
import types
from pathlib import Path
from typing import Any, Callable

import numpy as np
import onnx
import pytest

from pagedgraph.artifact.manifest import Manifest
from pagedgraph.artifact.settings import ConfigError
from pagedgraph.exporter.checkpoint import CheckpointError, read_hf_dir
from pagedgraph.exporter.config import ExportConfig
from pagedgraph.exporter.export import GRAPH, export
from pagedgraph.graphs.quant import BlockQuantized
from pagedgraph.texts import shipped_text
from scripts.library_modules import autoawq
from tests.exporter.hf_quantized_checkpoints import quantize_awq, write_awq, write_gptq
from tests.exporter.test_quantized import _bits, _written_weight
from tests.graphs.test_tiny_models_vs_transformers import assert_engine_follows, hf_reference
from tests.tiny_models import make_tiny_hf_checkpoint

pytestmark = pytest.mark.unit
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

Writer = Callable[[Path, Path], dict[str, np.ndarray]]
CASES: dict[str, Writer] = {
    "gptq-int4-sym-g32": lambda src, out: write_gptq(src, out, 4, 32, sym=True),
    "gptq-int4-asym-g32": lambda src, out: write_gptq(src, out, 4, 32, sym=False),
    "gptq-int8-per-row": lambda src, out: write_gptq(src, out, 8, -1, sym=True),
    # groups of 48 leave a partial last group (64 = 48 + 16, 128 = 48 + 48 + 32): MatMulNBits blocks of 16
    "gptq-int4-sym-g48": lambda src, out: write_gptq(src, out, 4, 48, sym=True),
    "gptq_v2-int4-asym-g64": lambda src, out: write_gptq(src, out, 4, 64, sym=False, checkpoint_format="gptq_v2"),
    "awq-int4-g32": lambda src, out: write_awq(src, out, 32),
}


@pytest.fixture(scope="module")
def float_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_hf_checkpoint(tmp_path_factory.mktemp("hf") / "llama")


def _method(case: str) -> str:
    return case.split("-")[0].split("_")[0]


@pytest.mark.parametrize("case", CASES)
def test_blocks_read_back_equal_the_librarys_dequantization(case: str, float_checkpoint: Path, tmp_path: Path) -> None:
    expected = CASES[case](float_checkpoint, tmp_path / case)
    checkpoint = read_hf_dir(tmp_path / case)
    assert checkpoint.quantization == _method(case)
    blocks = {name: w for name, w in checkpoint.tensors.items() if isinstance(w, BlockQuantized)}
    assert blocks.keys() == expected.keys() and len(blocks) == 14
    for name, weight in blocks.items():
        np.testing.assert_array_equal(_bits(weight.dequantize()), _bits(expected[name]), err_msg=name)
    # the scales are the file's fp16 ones, widened, each over the MatMulNBits blocks of its group
    from safetensors.numpy import load_file

    stored = load_file(str(tmp_path / case / "model.safetensors"))
    down = blocks["model.layers.1.mlp.down_proj.weight"]
    scales = stored["model.layers.1.mlp.down_proj.scales"].astype(np.float32).T
    group = json.loads((tmp_path / case / "config.json").read_text())["quantization_config"]["group_size"]
    k = down.shape[1]
    np.testing.assert_array_equal(down.scale, scales[:, np.arange(k // down.block_size) * down.block_size
                                                     // (k if group == -1 else group)])
    if "asym" in case or case.startswith("awq"):
        assert len(np.unique(down.zero_point)) > 1  # per-group zero points, not the default one


def _export(source: Path, quantization: str, out: Path, log: io.StringIO) -> Manifest:
    """A small artifact of `source` computing in float32 on the blocks (accuracy_level 0), as HF fp32 does."""
    config = ExportConfig.model_validate({
        "model": {"source": str(source), "quantization": quantization},
        "export": {"max_model_len": 128, "accuracy_level": 0,
                   "buckets": {"decode_batch": [1, 4], "prefill_tokens": [16, 64, 128], "prefill_max_seqs": 4}}})
    return export(config, out, log=log)


EXPORTS = [("gptq-int4-asym-g32", "none"), ("gptq-int8-per-row", "gptq"), ("gptq-int4-sym-g48", "gptq"),
           ("awq-int4-g32", "awq")]


@pytest.mark.parametrize(("case", "quantization"), EXPORTS, ids=[f"{c}-as-{q}" for c, q in EXPORTS])
def test_artifact_holds_the_checkpoints_blocks_and_follows_transformers(case: str, quantization: str,
                                                                       float_checkpoint: Path, tmp_path: Path) -> None:
    expected = CASES[case](float_checkpoint, tmp_path / "checkpoint")
    log = io.StringIO()
    manifest = _export(tmp_path / "checkpoint", quantization, tmp_path / "artifact", log)
    method = _method(case)
    assert manifest.quantization == method and manifest.export_config["model"]["quantization"] == method
    assert (f"model.quantization: {method} (the checkpoint's own blocks" in log.getvalue()) == (quantization == "none")
    source = next(w.source for w in read_hf_dir(tmp_path / "checkpoint").tensors.values()
                  if isinstance(w, BlockQuantized))
    assert manifest.weight_formats == {source: 14, "float32": 6}
    model = onnx.load_model(tmp_path / "artifact" / GRAPH)
    assert [n.op_type for n in model.graph.node].count("MatMulNBits") == 2 * 4
    for layer in range(2):
        p = f"model.layers.{layer}."
        want = np.concatenate([expected[p + f"self_attn.{x}_proj.weight"] for x in "qkv"])
        np.testing.assert_array_equal(_bits(_written_weight(model, f"layers.{layer}.qkv").dequantize()), _bits(want))
        np.testing.assert_array_equal(_bits(_written_weight(model, f"layers.{layer}.down").dequantize()),
                                      _bits(expected[p + "mlp.down_proj.weight"]))

    hf = transformers.AutoModelForCausalLM.from_pretrained(float_checkpoint, dtype=torch.float32)
    hf.load_state_dict({name: torch.from_numpy(w) for name, w in expected.items()}, strict=False)
    assert_engine_follows(tmp_path / "artifact", hf_reference(hf), case)


# v_proj's outputs (2 KV heads of 32) a multiple of 64: AutoAWQ's clipping search takes output rows in batches of 64
AWQ_DIMS = {"hidden_size": 128, "intermediate_size": 256}
# Two windows of 64 calibration tokens: the searches' cost grows with the tokens, and what the test checks (scales
# folded into the norms, clipped weights, the file and its serving) holds on any calibration.
AWQ_WINDOWS, AWQ_WINDOW = 2, 64


def test_autoawqs_own_quantizer_is_read_as_it_is(tmp_path: Path) -> None:
    """AutoAWQ's real quantizer (scripts/awq_checkpoint.py's path), not a min-max packing: its scale search folds
    per-channel scales into the norms and up_proj, its clipping search shrinks the weights, and save_quantized
    writes the file and config its own way. The file is what AWQ promises, and the artifact follows transformers
    fp32 on it: its float tensors and autoawq's dequantization of its blocks."""
    from safetensors.torch import load_file

    src = make_tiny_hf_checkpoint(tmp_path / "float", dims=AWQ_DIMS)
    ids = transformers.AutoTokenizer.from_pretrained(src)(shipped_text("calibration"))["input_ids"]
    expected = quantize_awq(src, tmp_path / "awq", 32, [ids[begin:begin + AWQ_WINDOW] for begin in range(0, AWQ_WINDOWS * AWQ_WINDOW, AWQ_WINDOW)])
    assert json.loads((tmp_path / "awq" / "config.json").read_text())["quantization_config"] | {
        "modules_to_not_convert": None} == {"quant_method": "awq", "zero_point": True, "group_size": 32, "bits": 4,
                                            "version": "gemm", "modules_to_not_convert": None}
    saved, original = load_file(str(tmp_path / "awq" / "model.safetensors")), load_file(str(src / "model.safetensors"))
    floats = {name: t for name, t in saved.items() if not name.endswith((".qweight", ".qzeros", ".scales"))}
    norm = "model.layers.0.post_attention_layernorm.weight"
    assert not torch.equal(floats[norm], original[norm])  # the searched scales were folded into the norm
    # AWQ's promise, which AutoAWQ 0.2.9 breaks on CPU without scripts/awq_checkpoint.awq_quantize's fix (there
    # 11% of these values agree): q/k_proj (never clipped) hold AutoAWQ's own min-max grid of the float weight
    # times the scales folded into input_layernorm.
    grid = types.SimpleNamespace(group_size=32, zero_point=True, w_bit=4)
    for layer in range(2):
        p = f"model.layers.{layer}."
        scales = original[p + "input_layernorm.weight"] / floats[p + "input_layernorm.weight"]
        for proj in ("q_proj", "k_proj"):
            name = p + f"self_attn.{proj}.weight"
            want = autoawq("awq.quantize.quantizer").AwqQuantizer.pseudo_quantize_tensor(
                grid, (original[name] * scales).half())[0]
            assert (torch.from_numpy(expected[name]).half() == want).float().mean() > 0.99, name

    checkpoint = read_hf_dir(tmp_path / "awq")
    assert checkpoint.quantization == "awq"
    for name, weight in expected.items():
        np.testing.assert_array_equal(_bits(checkpoint.tensors[name].dequantize()), _bits(weight), err_msg=name)
    manifest = _export(tmp_path / "awq", "none", tmp_path / "artifact", io.StringIO())
    assert manifest.quantization == "awq"
    hf = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    missing = hf.load_state_dict(floats | {name: torch.from_numpy(w) for name, w in expected.items()}, strict=False)
    assert missing.missing_keys == ["lm_head.weight"] and not missing.unexpected_keys  # tied to the embedding
    assert_engine_follows(tmp_path / "artifact", hf_reference(hf), "autoawq")


@pytest.fixture(scope="module")
def gptq_checkpoint(float_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("gptq") / "gptq"
    write_gptq(float_checkpoint, out, 4, 32, sym=False)
    return out


def _copy(src: Path, out: Path, quantization_config: dict[str, Any] | None = None) -> Path:
    import shutil

    shutil.copytree(src, out)
    if quantization_config is not None:
        config = json.loads((out / "config.json").read_text())
        config["quantization_config"] |= quantization_config
        (out / "config.json").write_text(json.dumps(config))
    return out


REFUSED = [
    ({"quant_method": "bitsandbytes"}, "quantization_config.quant_method = 'bitsandbytes' is not read here"),
    ({"bits": 3}, "quantization_config.bits = 3: gptq maps onto MatMulNBits at 4 or 8 bits"),
    ({"group_size": 100}, "quantization_config.group_size = 100: MatMulNBits takes blocks"),
    ({"checkpoint_format": "marlin"}, "quantization_config.checkpoint_format = 'marlin': only GPTQ's own layouts"),
    ({"dynamic": {"-:.*down_proj": {}}}, "quantization_config.dynamic = .*per-module overrides"),
    ({"quant_method": "awq", "version": "gemv"}, "quantization_config.version = 'gemv': only AWQ's GEMM layout"),
    ({"quant_method": "awq", "bits": 8}, "quantization_config.bits = 8: awq maps onto MatMulNBits at 4 bits"),
    ({"group_size": 64}, r"model.layers.0.mlp.down_proj.qzeros has shape \[4, 8\] but its gptq blocks imply \[2, 8\]"),
]


@pytest.mark.parametrize(("edit", "says"), REFUSED, ids=[str(e) for e, _ in REFUSED])
def test_what_does_not_map_is_refused_naming_the_field(edit: dict[str, Any], says: str, gptq_checkpoint: Path,
                                                      tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=says):
        read_hf_dir(_copy(gptq_checkpoint, tmp_path / "edited", edit))


def test_act_order_groups_are_refused_naming_g_idx(gptq_checkpoint: Path, tmp_path: Path) -> None:
    from safetensors.numpy import load_file, save_file

    path = _copy(gptq_checkpoint, tmp_path / "act_order", {"desc_act": True})
    tensors = load_file(str(path / "model.safetensors"))
    name = "model.layers.1.self_attn.o_proj.g_idx"
    tensors[name] = np.random.default_rng(0).permutation(tensors[name])
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"o_proj.g_idx: act-order groups \(quantization_config.desc_act = "
                                              r"true\).* re-quantize the model with desc_act false"):
        read_hf_dir(path)


def test_float_weights_under_a_quantization_config_are_refused(float_checkpoint: Path, tmp_path: Path) -> None:
    path = _copy(float_checkpoint, tmp_path / "float")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "quantization_config": {
        "quant_method": "gptq", "bits": 4, "group_size": 32}}))
    with pytest.raises(CheckpointError, match="no linear is stored as gptq blocks .* remove quantization_config"):
        read_hf_dir(path)


@pytest.mark.parametrize(("asked", "own", "says"), [
    ("w4a16", "gptq", "model.quantization = 'w4a16', but .* already quantized with GPTQ .* nearest valid: gptq"),
    ("awq", "gptq", "model.quantization = 'awq', but .* already quantized with GPTQ"),
    ("gptq", "none", "has no quantization_config .* nearest valid: w4a16"),
])
def test_quantization_that_does_not_fit_the_checkpoint_is_refused(asked: str, own: str, says: str) -> None:
    config = ExportConfig.model_validate({"model": {"source": "some/hf_dir", "quantization": asked}})
    with pytest.raises(ConfigError, match=says):
        config.for_checkpoint(own)


def test_a_gptq_checkpoint_read_as_none_is_validated_as_gptq() -> None:
    """`none` becomes the checkpoint's own method, and the combination is checked again (bfloat16 compute needs
    float weights); what the YAML left out stays unset (implied defaults still apply)."""
    config = ExportConfig.model_validate({"model": {"source": "some/hf_dir"}})
    own = config.for_checkpoint("gptq")
    assert own.model.quantization == "gptq" and "max_model_len" not in own.export.model_fields_set
    assert config.for_checkpoint("none") is config
    bf16 = ExportConfig.model_construct(model=config.model.model_copy(update={"dtype": "bfloat16"}),
                                        export=config.export.model_copy(update={"kv_cache_dtypes": ["bfloat16"]}))
    with pytest.raises(ConfigError, match="model.dtype = 'bfloat16' with model.quantization = 'gptq'"):
        bf16.for_checkpoint("gptq")
