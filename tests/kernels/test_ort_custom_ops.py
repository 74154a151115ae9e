"""pagedgraph's ONNX Runtime custom ops (cpu_kernels/ort_ops.cc) in real ORT sessions, beyond their results.

Each op's results against its numpy reference, and that the kernel runs in place of the function
body, are the "onnxruntime-custom" column of tests/graphs/test_op_walk.py. Here: the pools are written in
place under IOBinding aliasing, older artifacts load, errors are statuses, the registration modes,
the header fetch, and a whole bucket graph gives the same logits with the custom ops on and off.
CI must build them (scripts/test.sh fetches the header): there a missing header fails instead of skipping.
"""
from __future__ import annotations

import io
import json
import logging
import tarfile
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from pagedgraph.graphs import contract as c
from pagedgraph.graphs import ops
from pagedgraph.graphs.ops.examples import packed_step
from pagedgraph.exporter.onnx.graph_builder import op_model
from pagedgraph.graphs.ops.op import Op
from pagedgraph.cpu_kernels import ort_headers
from pagedgraph.cpu_kernels.ort_headers import INCLUDE_ENV, OrtHeaderError
from pagedgraph.runtime.engine import EngineConfig, LLMEngine
from pagedgraph.runtime.executor_ort import register_custom_ops
from pagedgraph.runtime.sampling_params import SamplingParams
from tests.mindspore_support import RecordingExecutor

pytestmark = pytest.mark.unit
HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16  # SmolLM2-135M's grouped-query attention
ATTRS = {"head_num": HEADS, "kv_head_num": KV_HEADS, "head_dim": HEAD_DIM, "qk_scale": HEAD_DIM ** -0.5}


@pytest.fixture(scope="module")
def library(custom_op_library: Path) -> Path:
    return custom_op_library


def _model(op: Op, inputs: dict[str, np.ndarray], **attrs: object) -> bytes:
    return op_model(op, list(inputs.values()), attrs).SerializeToString()


def _session(model: bytes, library: Path | None, options: ort.SessionOptions | None = None) -> ort.InferenceSession:
    options = options or ort.SessionOptions()
    if library:
        options.register_custom_ops_library(str(library))
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


def _paged_batch(seed: int) -> dict[str, np.ndarray]:
    """Packer order: prefill chunks (fresh, over cached context, several tiles), decodes, then padding."""
    step = packed_step(np.random.default_rng(seed), [5, 20, 70, 1, 1, 1], [5, 37, 150, 33, 1, 16], heads=HEADS,
                       kv_heads=KV_HEADS, head_dim=HEAD_DIM, block_size=BLOCK_SIZE, max_blocks=10, pad_seqs=2,
                       pad_tokens=3)
    return dict(zip([t.name for t in ops.PAGED_ATTENTION.inputs], step))


def _paged_model(inputs: dict[str, np.ndarray]) -> bytes:
    return _model(ops.PAGED_ATTENTION, inputs, block_size=BLOCK_SIZE, **ATTRS)


def test_paged_attention_without_head_dim_attribute(library: Path) -> None:
    """Artifacts exported before head_dim was an attribute still load: the kernel takes it from the query."""
    inputs = _paged_batch(4)
    model = op_model(ops.PAGED_ATTENTION, list(inputs.values()), dict(ATTRS, block_size=BLOCK_SIZE))
    (node,) = model.graph.node
    node.attribute.remove(next(a for a in node.attribute if a.name == "head_dim"))
    (got,) = _session(model.SerializeToString(), library).run(None, inputs)
    want = ops.paged_attention(*inputs.values(), block_size=BLOCK_SIZE, **ATTRS)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def _cache_inputs(seed: int, num_slots: int = 40 * BLOCK_SIZE) -> dict[str, np.ndarray]:
    """This step's rows: distinct real slots, then padding tokens into the null block (identical rows there)."""
    rng = np.random.default_rng(seed)
    real, padding, width = 23, 3, KV_HEADS * HEAD_DIM
    key, value = (rng.standard_normal((real + padding, width), dtype=np.float32) for _ in range(2))
    key[real:], value[real:] = key[real], value[real]
    slots = np.concatenate([rng.choice(np.arange(BLOCK_SIZE, num_slots), real, replace=False),
                            np.full(padding, c.NULL_BLOCK * BLOCK_SIZE)])
    return {"key": key, "value": value, "k_cache": rng.standard_normal((num_slots, width), dtype=np.float32),
            "v_cache": rng.standard_normal((num_slots, width), dtype=np.float32), "slot_mapping": slots}


def test_reshape_and_cache_equals_reference_without_aliasing(library: Path) -> None:
    """A plain run gives fresh output pools (a full copy plus the rows) and leaves the inputs as they were."""
    inputs = _cache_inputs(4)
    before = {k: v.copy() for k, v in inputs.items()}
    got = _session(_model(ops.RESHAPE_AND_CACHE, inputs), library).run(None, inputs)
    want = ops.reshape_and_cache(*(v.copy() for v in inputs.values()))
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    for name, array in inputs.items():
        np.testing.assert_array_equal(array, before[name])


def test_reshape_and_cache_in_place_under_iobinding_aliasing(library: Path) -> None:
    """Pools bound as input and output: ORT hands the kernel the pool's own buffer; only the slot rows change."""
    inputs = _cache_inputs(5)
    before = {k: inputs[k].copy() for k in ("k_cache", "v_cache")}
    session = _session(_model(ops.RESHAPE_AND_CACHE, inputs), library)
    binding = session.io_binding()
    for name, array in inputs.items():
        value = ort.OrtValue.ortvalue_from_numpy(array)
        binding.bind_ortvalue_input(name, value)
        if name in before:
            binding.bind_ortvalue_output(f"{name}_out", value)
    session.run_with_iobinding(binding)
    want_k, want_v = ops.reshape_and_cache(inputs["key"], inputs["value"], before["k_cache"].copy(),
                                           before["v_cache"].copy(), inputs["slot_mapping"])
    np.testing.assert_array_equal(inputs["k_cache"], want_k)  # the numpy pools themselves were written
    np.testing.assert_array_equal(inputs["v_cache"], want_v)
    changed = np.flatnonzero((inputs["k_cache"] != before["k_cache"]).any(axis=1))
    assert set(changed) <= set(inputs["slot_mapping"].tolist())
    outputs = binding.get_outputs()
    assert [o.data_ptr() for o in outputs] == [inputs["k_cache"].ctypes.data, inputs["v_cache"].ctypes.data]


def test_the_kernel_runs_not_the_function_body(library: Path, tmp_path: Path) -> None:
    """ORT's profile shows one PagedAttention node with the library and the body's standard ops without."""
    inputs = _paged_batch(6)
    op_names = {}
    for use in (True, False):
        options = ort.SessionOptions()
        options.enable_profiling = True
        options.profile_file_prefix = str(tmp_path / f"profile_{use}")
        session = _session(_paged_model(inputs), library if use else None, options)
        session.run(None, inputs)
        events = json.loads(Path(session.end_profiling()).read_text())
        op_names[use] = {e["args"]["op_name"] for e in events if e.get("cat") == "Node"}
    assert op_names[True] == {"PagedAttention"}
    assert "PagedAttention" not in op_names[False] and "MatMul" in op_names[False]


@pytest.mark.parametrize("bits, block_size, k", [(4, 32, 96), (8, 32, 96), (4, 96, 192), (8, 256, 512), (4, 64, 128)])
def test_grouped_matmul_nbits_int8_rows_are_batch_invariant(library: Path, bits: int, block_size: int, k: int) -> None:
    """accuracy_level 4: a row alone and the same row among 7 of its expert's (tiles of 4, 2 and 1) give the same bits;
    shapes where two chunks of 32 straddle blocks, an odd chunk count, and column counts off the kernel's steps."""
    rng = np.random.default_rng(bits * block_size + k)
    experts, n, blocks = 3, 38, k // block_size
    inputs = {"x": rng.standard_normal((9, k), dtype=np.float32),
              "codes": rng.integers(0, 256, (experts, n, blocks, block_size * bits // 8), dtype=np.uint8),
              "scales": rng.random((experts, n, blocks), dtype=np.float32) * 0.02,
              "zero_points": rng.integers(0, 256, (experts, n, -(-blocks * bits // 8)), dtype=np.uint8),
              "minimum_t": rng.standard_normal((experts, blocks, n)).astype(np.float16) * np.float16(0.1),
              "group_list": np.array([7, 0, 2], np.int64)}
    attrs = {"K": k, "N": n, "bits": bits, "block_size": block_size, "accuracy_level": 4, "group_list_type": 1}
    session = _session(_model(ops.GROUPED_MATMUL_BLOCK_QUANTIZED, inputs, **attrs), library)
    (batched,) = session.run(None, inputs)
    want = ops.GROUPED_MATMUL_BLOCK_QUANTIZED.reference(*inputs.values(), **attrs)
    weight = 255 * inputs["scales"].max() + np.abs(inputs["minimum_t"]).max()  # |w| at most
    np.testing.assert_allclose(batched, want, atol=5e-3 * np.abs(inputs["x"]).max() * weight * k, rtol=0)  # the op's
    for row in range(9):
        alone = {**inputs, "x": inputs["x"][row:row + 1],
                 "group_list": np.array([1, 0, 0] if row < 7 else [0, 0, 1], np.int64)}
        np.testing.assert_array_equal(session.run(None, alone)[0][0], batched[row])


def test_kernel_errors_are_statuses(library: Path) -> None:
    """A bad block id is the kernel's own error (the function body would report a Gather), never a crash."""
    inputs = _paged_batch(7)
    inputs["block_tables"][1, 0] = 10_000
    with pytest.raises(ort.capi.onnxruntime_pybind11_state.InvalidArgument, match=r"block_tables\[1, 0\]"):
        _session(_paged_model(inputs), library).run(None, inputs)
    inputs = _paged_batch(7)
    model = _paged_model({**inputs, "query": inputs["query"][:, :HEAD_DIM]})  # query narrower than head_num heads
    with pytest.raises(ort.capi.onnxruntime_pybind11_state.InvalidArgument, match="query has shape"):
        _session(model, library).run(None, {**inputs, "query": np.ascontiguousarray(inputs["query"][:, :HEAD_DIM])})


def test_register_modes(library: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                        caplog: pytest.LogCaptureFixture) -> None:
    assert register_custom_ops(ort.SessionOptions(), "auto")
    assert not register_custom_ops(ort.SessionOptions(), "off")
    monkeypatch.setenv(INCLUDE_ENV, str(tmp_path))  # holds no header
    with pytest.raises(OrtHeaderError, match=INCLUDE_ENV):
        register_custom_ops(ort.SessionOptions(), "on")
    with caplog.at_level(logging.WARNING):
        assert not register_custom_ops(ort.SessionOptions(), "auto")
    assert "python -m pagedgraph.cpu_kernels.ort_headers" in caplog.text
    with pytest.raises(ValueError, match="custom_ops"):
        register_custom_ops(ort.SessionOptions(), "yes")  # type: ignore[arg-type]


def _ar(members: dict[str, bytes]) -> bytes:
    out = b"!<arch>\n"
    for name, data in members.items():
        out += f"{name:<16}{0:<12}{0:<6}{0:<6}{100644:<8}{len(data):<10}`\n".encode() + data + b"\n" * (len(data) % 2)
    return out


def test_header_is_extracted_from_a_deb() -> None:
    """The fetcher's own ar and tar reading (offline): only the C API header is taken from data.tar.xz."""
    data = io.BytesIO()
    with tarfile.open(fileobj=data, mode="w:xz") as tar:
        for name, text in ((f"./{ort_headers.MEMBER}", b"#define ORT_API_VERSION 21\n"),
                           ("./usr/include/onnxruntime/onnxruntime_cxx_api.h", b"other")):
            info = tarfile.TarInfo(name)
            info.size = len(text)
            tar.addfile(info, io.BytesIO(text))
    deb = _ar({"debian-binary": b"2.0\n", "control.tar.xz": b"x", "data.tar.xz": data.getvalue()})
    assert ort_headers._header_from_deb(deb) == b"#define ORT_API_VERSION 21\n"
    with pytest.raises(OrtHeaderError, match="no data.tar"):
        ort_headers._header_from_deb(_ar({"debian-binary": b"2.0\n"}))


def _run(artifact: Path, custom_ops: str, prompts: list[list[int]]) -> RecordingExecutor:
    """The engine (its own scheduler and packer) serving `prompts` greedily, every step's logits recorded."""
    engine = LLMEngine(artifact, EngineConfig(num_blocks=16, threads=2, custom_ops=custom_ops))
    recorder = engine.runner.executor = RecordingExecutor(engine.runner.executor)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    for prompt in prompts:
        engine.add_request(prompt, params)
    while engine.has_unfinished():
        engine.step()
    return recorder


def test_bucket_graph_same_logits_with_custom_ops_on_and_off(library: Path, tiny_artifact: Path) -> None:
    prompts = [list(range(3, 40)), [7, 8, 9], list(range(50, 70))]
    runs = {mode: _run(tiny_artifact, mode, prompts) for mode in ("on", "off")}
    assert runs["on"].custom_ops and not runs["off"].custom_ops
    assert [g for g, _ in runs["on"].steps] == [g for g, _ in runs["off"].steps]
    assert {g.tokens > g.seqs for g, _ in runs["on"].steps} == {True, False}, "a prefill gear, then decode gears"
    for (gear, on), (_, off) in zip(runs["on"].steps, runs["off"].steps):
        assert on.std() > 0.1
        np.testing.assert_allclose(on, off, rtol=1e-4, atol=1e-4, err_msg=f"gear {gear}")
    for name, pool in runs["on"].pools.items():
        np.testing.assert_allclose(pool, runs["off"].pools[name], rtol=1e-5, atol=1e-5)
