"""KV caches in bfloat16, float16 and int8.

The lowerings of every cache-dtype variant of ReshapeAndCache and PagedAttention are checked against the
numpy references by the op walk (tests/graphs/test_op_walk.py: ONNX bodies, custom ops, contiguous baseline,
kernels); here: ATB's int8 contract itself, the custom ops writing each dtype's pools in place under
IOBinding aliasing, and the export of one graph per cache dtype with calibrated int8 scales.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto

from pagedgraph.exporter.onnx.graph_builder import op_model
from pagedgraph.graphs import ops
from pagedgraph.graphs.kv_cache import KV_CACHE_DTYPES, cache_format, dequantize, int8_params, quantize

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def library(custom_op_library: Path) -> str:
    """The custom-op library: fails in CI, skips elsewhere without the header (tests/conftest.py)."""
    return str(custom_op_library)


def _ortvalue(array: np.ndarray) -> ort.OrtValue:
    if array.dtype == cache_format("bfloat16").numpy_dtype:
        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(array.view(np.uint16), TensorProto.BFLOAT16)
    return ort.OrtValue.ortvalue_from_numpy(array)


def test_int8_quantization_follows_atb() -> None:
    """clamp(round(x * inv_scale + offset)) per channel; 0.0 is exact; reading back errs by at most scale / 2."""
    rng = np.random.default_rng(0)
    x = rng.normal(1.5, 2.0, (256, 8)).astype(np.float32)
    p = int8_params(x.min(axis=0), x.max(axis=0))
    q = quantize(x, p["inv_scale"], p["offset"])
    assert q.dtype == np.int8 and q.min() == -128 and q.max() == 127
    np.testing.assert_array_equal(quantize(np.zeros((1, 8), np.float32), p["inv_scale"], p["offset"])[0], p["offset"])
    assert np.all(np.abs(dequantize(q, p["scale"], p["offset"]) - x) <= p["scale"] * 0.5001)
    outside = quantize(np.full((1, 8), 1e6, np.float32), p["inv_scale"], p["offset"])
    np.testing.assert_array_equal(outside, 127)  # clamped, never wrapped


@pytest.mark.parametrize("dtype", KV_CACHE_DTYPES)
@pytest.mark.parametrize("custom_ops", [False, True])
def test_reshape_and_cache_writes_each_dtype_in_place(dtype: str, custom_ops: bool,
                                                      request: pytest.FixtureRequest) -> None:
    """The pools bound as both input and output (as the executor binds them) are written in place, bit-equal
    to the reference, by the function body and by the custom op."""
    write, _ = ops.KV_CACHE_OPS[dtype]
    example = next(write.examples())
    options = ort.SessionOptions()
    if custom_ops:
        options.register_custom_ops_library(request.getfixturevalue("library"))
    session = ort.InferenceSession(op_model(write, example.inputs, example.attrs).SerializeToString(), options,
                                   providers=["CPUExecutionProvider"])
    inputs = [x.copy() for x in example.inputs]
    binding = session.io_binding()
    for spec, array in zip(write.inputs, inputs):
        binding.bind_ortvalue_input(spec.name, value := _ortvalue(array))
        if spec.name in ("k_cache", "v_cache"):
            binding.bind_ortvalue_output(f"{spec.name}_out", value)
    session.run_with_iobinding(binding)
    want = write.run_reference(example.inputs, write.attrs(**example.attrs))
    for got, expected in zip(inputs[2:4], want):
        assert got.dtype == expected.dtype
        np.testing.assert_array_equal(got.view(np.uint8), expected.view(np.uint8))


@pytest.fixture(scope="module")
def kv_artifact(tmp_path_factory: pytest.TempPathFactory):
    """A tiny random Llama exported with every KV-cache dtype (and their naive baselines)."""
    import io

    from pagedgraph.exporter.config import ExportConfig
    from pagedgraph.exporter.export import export
    from tests.random_checkpoint import write_random_llama

    root = tmp_path_factory.mktemp("kv")
    text = root / "calibration.txt"
    text.write_text("the quick brown fox jumps over the lazy dog, and the dog sleeps on. " * 40)
    config = ExportConfig.model_validate({"model": {"source": str(write_random_llama(root / "hf"))}, "export": {
        "max_model_len": 128, "buckets": {"decode_batch": [4], "prefill_tokens": [64], "prefill_max_seqs": 4},
        "baseline": "naive", "kv_cache_dtypes": list(KV_CACHE_DTYPES), "kv_cache_calibration": str(text),
        "kv_cache_calibration_window": 64}})
    export(config, root / "artifact", log=io.StringIO())
    return root / "artifact", text


def test_export_writes_one_graph_per_cache_dtype_sharing_the_weights(kv_artifact) -> None:
    import onnx

    from pagedgraph.artifact.manifest import Manifest

    artifact, _ = kv_artifact
    manifest = Manifest.load(artifact)
    assert manifest.served_kv_cache_dtypes == KV_CACHE_DTYPES
    assert manifest.kv_cache_dtype("auto") == "float32"
    for dtype in KV_CACHE_DTYPES:
        for family in manifest.families:
            path = manifest.graph_for(family, dtype)
            assert path in manifest.files
            graph = onnx.load_model(artifact / path, load_external_data=False).graph
            pools = [i for i in graph.input if i.name.startswith(("k_cache_", "v_cache_"))]
            assert {p.type.tensor_type.elem_type for p in pools} == {cache_format(dtype).onnx_type}
            external = {t.name for t in graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL}
            inline = {t.name for t in graph.initializer} - external
            assert "embed" in external  # the weights are read from the one weights file
            assert all(".k_cache_" in n or ".v_cache_" in n for n in inline)  # only int8 scales are the graph's own
            assert bool(inline) == cache_format(dtype).quantized
        naive = "graphs/naive.onnx" if dtype == "float32" else f"graphs/naive.kv-{dtype}.onnx"
        assert naive in manifest.files
    with pytest.raises(ValueError, match="kv_cache.dtype = 'int4'"):
        manifest.kv_cache_dtype("int4")


def test_int8_scales_cover_the_calibrated_ranges(kv_artifact) -> None:
    """Re-running the float32 graph over the calibration text: every K/V value lies in its channel's int8 range."""
    import onnx
    from onnx import numpy_helper
    from tokenizers import Tokenizer

    from pagedgraph.artifact.manifest import Manifest
    from pagedgraph.exporter.kv_calibration import window_feed
    from pagedgraph.graphs import contract as c

    artifact, text = kv_artifact
    manifest = Manifest.load(artifact)
    graph = onnx.load_model(artifact / manifest.graph_for("prefill", "int8"), load_external_data=False).graph
    params = {t.name: numpy_helper.to_array(t) for t in graph.initializer if t.data_location != onnx.TensorProto.EXTERNAL}
    tokens = Tokenizer.from_file(str(artifact / "tokenizer.json")).encode(text.read_text(), add_special_tokens=False).ids
    gear = max(manifest.families["prefill"].gears)
    model, block_size = manifest.model, manifest.block_size
    session = ort.InferenceSession(str(artifact / "graphs/model.onnx"), providers=["CPUExecutionProvider"])
    names = c.cache_names(model.num_layers)
    pools = {n: np.zeros(((gear.blocks + 1) * block_size, model.kv_size), np.float32) for n in names}
    window = tokens[64:128]
    outputs = session.run([c.cache_output_name(n) for n in names], {**window_feed(gear, window, block_size), **pools})
    for layer in range(model.num_layers):
        for kv, pool in zip("kv", outputs[2 * layer: 2 * layer + 2]):
            rows = pool[block_size:block_size + len(window)]
            scale, offset = params[f"layers.{layer}.{kv}_cache_scale"], params[f"layers.{layer}.{kv}_cache_offset"]
            np.testing.assert_allclose(params[f"layers.{layer}.{kv}_cache_inv_scale"], 1 / scale, rtol=1e-6)
            low, high = (-128 - offset) * scale, (127 - offset) * scale
            assert np.all(rows >= low - scale) and np.all(rows <= high + scale)
            assert np.all(high - low <= 2 * np.abs(rows).max(axis=0) * 3 + 1e-6)  # ranges are fitted, not huge


@pytest.mark.parametrize("dtypes,error", [(["int8"], "must include the compute dtype"),
                                          (["float32", "int8", "int8"], "list each dtype once"),
                                          (["float32", "fp8"], "kv_cache_dtypes")])
def test_export_config_refuses_bad_cache_dtype_lists(dtypes: list[str], error: str) -> None:
    from pagedgraph.artifact.settings import ConfigError, validate
    from pagedgraph.exporter.config import ExportConfig

    with pytest.raises(ConfigError, match=error):
        validate(ExportConfig, {"export": {"kv_cache_dtypes": dtypes}}, "export.yaml")


def _prompts(vocab: int) -> list[list[int]]:
    """Three prompts sharing a 40-token prefix (2.5 blocks: the third block is partly shared), distinct tails."""
    rng = np.random.default_rng(5)
    prefix = rng.integers(3, vocab, 40).tolist()
    return [prefix + rng.integers(3, vocab, n).tolist() for n in (5, 9, 13)]


GREEDY_KW = dict(max_tokens=12, temperature=0.0, ignore_eos=True)


def _generate(artifact, dtype: str, prompts: list[list[int]], n: int = 1, **config):
    from pagedgraph.runtime.engine import LLM
    from pagedgraph.runtime.sampling_params import SamplingParams

    llm = LLM(artifact, threads=2, kv_cache_dtype=dtype, **config)
    outputs = llm.generate(prompts, SamplingParams(n=n, **GREEDY_KW))
    assert all(o.error is None and o.finished for o in outputs)
    return outputs, llm.engine


@pytest.mark.parametrize("dtype", ["int8", "bfloat16"])
def test_prefix_hits_forks_and_preemption_give_the_cold_tokens(kv_artifact, dtype: str) -> None:
    """On a quantized (or 16-bit) cache, a prefix hit, copy-on-write forks and preemption recompute change nothing."""
    artifact, _ = kv_artifact
    from pagedgraph.artifact.manifest import Manifest

    prompts = _prompts(Manifest.load(artifact).model.vocab_size)
    cold, engine = _generate(artifact, dtype, prompts, enable_prefix_caching=False, num_blocks=64)
    assert engine.runner.pools["k_cache_0"].dtype == cache_format(dtype).numpy_dtype
    want = [o.token_ids for o in cold]

    from pagedgraph.runtime.engine import LLM
    from pagedgraph.runtime.sampling_params import SamplingParams

    warm = LLM(artifact, threads=2, kv_cache_dtype=dtype, num_blocks=64)
    assert warm.generate(prompts[:1], SamplingParams(**GREEDY_KW))[0].token_ids == want[0]
    rest = warm.generate(prompts, SamplingParams(**GREEDY_KW))  # every prompt now hits the cached prefix
    assert warm.engine.stats.cache.hits >= 3 * 32  # two full blocks of the shared prefix, per prompt
    assert [o.token_ids for o in rest] == want

    forked, _ = _generate(artifact, dtype, prompts, n=3, num_blocks=64)
    assert [[c.token_ids for c in o.outputs] for o in forked] == [[w] * 3 for w in want]

    squeezed, engine = _generate(artifact, dtype, prompts, num_blocks=6,
                                 max_model_len=80)  # 3 x 4 blocks wanted, 5 usable
    assert engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in squeezed] == want


def test_pool_sizing_follows_the_cache_dtype(kv_artifact) -> None:
    """One kv_cache_bytes budget: 4x the float32 blocks in int8, 2x in 16-bit; the block hash covers the dtype."""
    from pagedgraph.runtime.engine import EngineConfig, LLMEngine

    artifact, _ = kv_artifact
    budget = 1 << 22
    engines = {d: LLMEngine(artifact, EngineConfig(threads=1, kv_cache_bytes=budget, kv_cache_dtype=d))
               for d in ("auto", *KV_CACHE_DTYPES)}
    blocks = {d: e.runner.pools.num_blocks for d, e in engines.items()}
    assert engines["auto"].kv_cache_dtype == "float32" and blocks["auto"] == blocks["float32"]
    assert blocks["int8"] == 4 * blocks["float32"]
    assert blocks["bfloat16"] == blocks["float16"] == 2 * blocks["float32"]
    for d, e in engines.items():
        assert e.runner.pools.nbytes == e.runner.pools.num_blocks * e.runner.pools.bytes_per_block <= budget
        assert e.runtime_info().kv_cache_dtype == e.kv_cache_dtype
    roots = {e.kv_cache_dtype: e.kv._root for e in engines.values()}
    assert len(set(roots.values())) == len(KV_CACHE_DTYPES)  # blocks of two dtypes never share a hash


def test_cache_dtype_errors_name_the_fix(kv_artifact, tiny_artifact) -> None:
    from pagedgraph.artifact.manifest import ArtifactError, Manifest
    from pagedgraph.artifact.settings import ConfigError
    from pagedgraph.runtime.deploy_config import Deployment, engine_config
    from pagedgraph.runtime.engine import EngineConfig, LLMEngine

    with pytest.raises(ArtifactError, match=r"kv_cache.dtype = 'int8'.*\['float32'\].*export.kv_cache_dtypes"):
        LLMEngine(tiny_artifact, EngineConfig(kv_cache_dtype="int8"))
    with pytest.raises(ValueError, match="kv cache dtype 'fp8'"):
        EngineConfig(kv_cache_dtype="fp8")
    deployment = Deployment.model_validate({"model": {"artifact": str(tiny_artifact)}, "kv_cache": {"dtype": "int8"}})
    with pytest.raises(ConfigError, match="kv_cache.dtype = int8: .* re-export with int8 in export.kv_cache_dtypes"):
        engine_config(deployment, Manifest.load(tiny_artifact), "deploy.yaml")
    artifact, _ = kv_artifact
    ok = Deployment.model_validate({"model": {"artifact": str(artifact)}, "kv_cache": {"dtype": "int8"}})
    assert engine_config(ok, Manifest.load(artifact), "deploy.yaml").kv_cache_dtype == "int8"


def test_bfloat16_compute_exports_and_serves_an_int8_cache(tmp_path: Path, onednn_custom_op_library: Path) -> None:
    """model.dtype bfloat16 with export.kv_cache_dtypes [bfloat16, int8]: the main graph's pools are bfloat16,
    so the int8 scales are fitted on the float32 graph (feeding it float32 pools failed), and both caches serve."""
    import io

    from pagedgraph.exporter.config import ExportConfig
    from pagedgraph.exporter.export import export
    from pagedgraph.runtime.engine import LLM
    from pagedgraph.runtime.sampling_params import SamplingParams
    from tests.random_checkpoint import write_random_llama

    text = tmp_path / "calibration.txt"
    text.write_text("the quick brown fox jumps over the lazy dog, and the dog sleeps on. " * 40)
    config = ExportConfig.model_validate({"model": {"source": str(write_random_llama(tmp_path / "hf")),
                                                    "dtype": "bfloat16"}, "export": {
        "max_model_len": 128, "buckets": {"decode_batch": [4], "prefill_tokens": [64], "prefill_max_seqs": 4},
        "kv_cache_dtypes": ["bfloat16", "int8"], "kv_cache_calibration": str(text),
        "kv_cache_calibration_window": 64}})
    export(config, tmp_path / "artifact", log=io.StringIO())
    for dtype in ("bfloat16", "int8"):
        llm = LLM(tmp_path / "artifact", threads=2, kv_cache_dtype=dtype, num_blocks=32)
        out = llm.generate([[5, 17, 42, 9]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
        assert out.error is None and len(out.token_ids) == 8, dtype
        assert llm.engine.runner.pools["k_cache_0"].dtype == cache_format(dtype).numpy_dtype
