"""One walk over ops x lowerings (as llama.cpp's test-backend-ops): every body against the op's numpy reference.

The rows are graphs/ops.OPS and each op's examples; the columns are exporter.lowerings.lowerings().
A lowering that registers a body for an op is run on every example of it, so a new op or op
variant (a dtype, a quantized form) is checked by every lowering that claims it, and a lowering
that lacks a body fails the registry check below. How each lowering runs one op:
- onnx: the op alone as the exporter emits it (`op_model`), in ONNX Runtime without custom ops (AllReduce, which
  has no body there, on its ranks in the runtime's simulation);
- onnxruntime-custom: the same model with pagedgraph's library registered, and ORT's profile must
  show the op itself ran (the C++ kernel), not its function body;
- contiguous: the baseline's bodies on the example converted to its [B, KV, max_len, D] cache
  layout (where the example has a shape that layout can express: one query run length per row);
- mindspore-cpu: the op's body Cell alone in GRAPH_MODE (static shapes, the AOT kernels);
- mindspore-ascend: no Ascend device here, so the body Cell is exported to MINDIR in float16 (bfloat16 for
  the bfloat16 cache variants; MindSpore infers every primitive's types and shapes) and the primitives are
  read back;
- kernels: the C API through ctypes (cpu_kernels/binding.py).
"""
from __future__ import annotations

import ctypes
import dataclasses
import json
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from pagedgraph.exporter.lowerings import BEGIN, END, lowerings, registry_report, with_table
from pagedgraph.exporter.onnx.graph_builder import make_model, onnx_type, op_model
from pagedgraph.graphs import ops
from pagedgraph.graphs.config import ModelConfig
from pagedgraph.graphs.contract import INPUT_IDS
from pagedgraph.graphs.kv_cache import cache_format
from pagedgraph.graphs.ops import OPS
from pagedgraph.graphs.ops.op import Example, Op
from pagedgraph.cpu_kernels.int8_gemm import fit_int8_gemm
from pagedgraph.cpu_kernels.ort_ops import ORT_CUSTOM_OPS
from tests.mindspore_support import require_mindspore
from tests.paths import REPO

require_mindspore()

pytestmark = pytest.mark.unit
LOWERINGS = {lowering.name: lowering for lowering in lowerings()}


def _cases() -> Iterator[Any]:
    for lowering in LOWERINGS.values():
        for op in OPS:
            if lowering.own(op) is None:
                continue
            examples = list(op.examples())
            if lowering.name == "contiguous":
                examples = [e for e in examples if _fits_contiguous(op, e)]
            if lowering.name == "mindspore-ascend":  # export-only: one shape per op says the body builds
                examples = [e for e in examples if op.variant != "block_quantized" or e.attrs["bits"] == 8][:1]
            for i, example in enumerate(examples):
                yield pytest.param(lowering.name, op, example, id=f"{lowering.name}-{op.key}-{i}-{example.label}")


def _fits_contiguous(op: Op, example: Example) -> bool:
    """The contiguous layout holds one query run length per row and no padding rows."""
    if op.name != "PagedAttention":
        return True
    query, cu = example.inputs[0], example.inputs[5]
    return len(set(np.diff(cu))) == 1 and cu[-1] == len(query)


def _feed(op: Op, inputs: tuple[np.ndarray | None, ...]) -> dict[str, np.ndarray]:
    return {spec.name: x for spec, x in zip(op.inputs, inputs) if x is not None}


def _run_onnx(op: Op, example: Example, library: Path | None = None,
              profile: Path | None = None) -> list[np.ndarray]:
    model = op_model(op, example.inputs, example.attrs)
    onnx.checker.check_model(model, full_check=True)
    fit_int8_gemm(model)  # as the runtime loads it on this CPU
    options = ort.SessionOptions()
    if library:
        options.register_custom_ops_library(str(library))
    if profile:
        options.enable_profiling = True
        options.profile_file_prefix = str(profile)
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    outputs = _session_run(session, _feed(op, example.inputs), [t.dtypes[0] for t in op.outputs])
    if profile:
        events = json.loads(Path(session.end_profiling()).read_text())
        ran = {e["args"]["op_name"] for e in events if e.get("cat") == "Node"}
        assert ran == {ORT_CUSTOM_OPS.own(op).node_name}, \
            f"the custom kernel did not run in place of the function body: {sorted(ran)}"
    return outputs


def _run_simulated(op: Op, example: Example) -> list[np.ndarray]:
    """A collective: the op alone on `rank_size` ranks, each holding the example's inputs, through the runtime's
    single-process simulation (runtime/tp_executor.py), which sums the ranks' partials at the node."""
    from pagedgraph.runtime.tp_executor import RankGraph, run_ranks

    model = op_model(op, example.inputs, example.attrs)
    onnx.checker.check_model(model, full_check=True)
    ranks = [RankGraph(model, ort.SessionOptions()) for _ in range(example.attrs["rank_size"])]
    values = run_ranks(ranks, [_feed(op, example.inputs)] * len(ranks))
    return [values[0][t.name] for t in op.outputs]


def _ortvalue(array: np.ndarray) -> ort.OrtValue:
    """numpy -> OrtValue; bfloat16 (ml_dtypes) goes by its bits, which ORT's numpy bridge does not know."""
    if array.dtype.name == "bfloat16":
        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(array.view(np.uint16), TensorProto.BFLOAT16)
    return ort.OrtValue.ortvalue_from_numpy(array)


def _session_run(session: ort.InferenceSession, feed: dict[str, np.ndarray], output_dtypes: list[str]
                 ) -> list[np.ndarray]:
    """session.run, or through OrtValues when a bfloat16 tensor is involved (ORT's numpy bridge lacks it)."""
    if "bfloat16" not in output_dtypes and all(x.dtype.name != "bfloat16" for x in feed.values()):
        return session.run(None, feed)
    binding = session.io_binding()
    for name, array in feed.items():
        binding.bind_ortvalue_input(name, _ortvalue(array))
    for out in session.get_outputs():
        binding.bind_output(out.name)
    session.run_with_iobinding(binding)
    return [_numpy(value, dtype) for value, dtype in zip(binding.get_outputs(), output_dtypes)]


def _numpy(value: ort.OrtValue, dtype: str) -> np.ndarray:
    """An output as numpy; bfloat16 copied out by its bits into ml_dtypes' bfloat16 (the references' type)."""
    if dtype != "bfloat16":
        return value.numpy()
    count = int(np.prod(value.shape()))
    bits = np.ctypeslib.as_array((ctypes.c_uint16 * count).from_address(value.data_ptr()))
    return bits.copy().view(cache_format("bfloat16").numpy_dtype).reshape(value.shape())


def _contiguous(op: Op, example: Example) -> tuple[list[np.ndarray], tuple[np.ndarray, ...]]:
    """The baseline's body on the example in its cache layout; its outputs and the reference's, in that layout."""
    from pagedgraph.exporter.onnx.contiguous import CONTIGUOUS, ContiguousBuilder

    attrs = op.attrs(**example.attrs)
    reference = op.run_reference(example.inputs, attrs)
    base = len(ops.RESHAPE_AND_CACHE.inputs if op.name == "ReshapeAndCache" else ops.PAGED_ATTENTION.inputs)
    params = {spec.name: x for spec, x in zip(op.inputs[base:], example.inputs[base:])}  # a cache dtype's own inputs
    if op.name == "ReshapeAndCache":  # one row holding every slot: slot = position
        key, value, k_cache, v_cache, slots = example.inputs[:base]
        to_rows = lambda pool: pool[None, None]  # noqa: E731 - [1, 1, num_slots, W]
        inputs = {"key": key, "value": value, "k_cache": to_rows(k_cache), "v_cache": to_rows(v_cache),
                  "slot_mapping": slots}
        kv_heads, head_dim, expected = 1, key.shape[1], tuple(to_rows(x) for x in reference)
    else:
        query, k_cache, v_cache, tables, context_lens, cu = example.inputs[:base]
        block = attrs.block_size
        positions = np.arange(tables.shape[1] * block)
        slots = tables[:, positions // block].astype(np.int64) * block + positions % block  # [B, max_len]

        def to_rows(pool: np.ndarray) -> np.ndarray:
            rows = pool[slots].reshape(*slots.shape, attrs.kv_head_num, attrs.head_dim)
            return np.ascontiguousarray(rows.transpose(0, 2, 1, 3))

        inputs = {"query": query, "k_cache": to_rows(k_cache), "v_cache": to_rows(v_cache), "block_tables": tables,
                  "context_lens": context_lens, "cu_seqlens_q": cu, INPUT_IDS: np.zeros(len(query), np.int64)}
        kv_heads, head_dim, expected = attrs.kv_head_num, attrs.head_dim, reference
    config = ModelConfig("llama", 1, kv_heads * head_dim, 1, 1, kv_heads, kv_heads, head_dim, 1e-5, 1e4, 1, True)
    inputs.update(params)
    builder = ContiguousBuilder(config, {}, op.variant or "float32")
    names = [spec.name for spec in op.inputs]
    out = CONTIGUOUS.emit(builder, op, names, example.attrs)
    outs = [f"out_{i}" for i in range(len(op.outputs))]
    for value, name in zip([out] if isinstance(out, str) else out, outs):
        builder.n.rename(value, name)
    infos = [helper.make_tensor_value_info(k, onnx_type(v.dtype), list(v.shape)) for k, v in inputs.items()]
    out_dtypes = [t.dtypes[0] for t in op.outputs]
    graph = helper.make_graph(builder.n.nodes, op.key, infos,
                              [helper.make_tensor_value_info(o, onnx_type(d), None) for o, d in zip(outs, out_dtypes)])
    session = ort.InferenceSession(make_model(graph, builder).SerializeToString(), providers=["CPUExecutionProvider"])
    used = {i.name for i in session.get_inputs()}
    return _session_run(session, {k: v for k, v in inputs.items() if k in used}, out_dtypes), expected


def _run_mindspore_cpu(op: Op, example: Example) -> list[np.ndarray]:
    import mindspore as ms

    from pagedgraph.exporter.mindspore.builder import MindSporeTarget
    from pagedgraph.exporter.mindspore.cpu_ops import MINDSPORE_CPU
    from pagedgraph.cpu_kernels.build import library_path

    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    cell = MINDSPORE_CPU.body(op)(op.attrs(**example.attrs), MindSporeTarget("cpu", library=library_path()))
    tensors = [None if x is None else ms.Tensor(x.copy()) for x in example.inputs]
    out = cell(*tensors)
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    for output, written in op.writes:  # read the written pools themselves: the write is in place
        outs[output] = tensors[written]
    return [o.asnumpy() for o in outs]


def _export_mindspore_ascend(op: Op, example: Example, tmp_path: Path) -> None:
    import mindspore as ms

    from pagedgraph.exporter.mindspore.ascend_moe import ascend_expert_arrays, ascend_expert_block_arrays
    from pagedgraph.exporter.mindspore.ascend_ops import (MINDSPORE_ASCEND, ascend_block_arrays,
                                                           int8_cache_parameters)
    from pagedgraph.exporter.mindspore.builder import MindSporeTarget
    from pagedgraph.exporter.mindspore.readback import read_ops
    from pagedgraph.graphs.kv_cache import SCALE_FIELDS

    attrs = op.attrs(**example.attrs)
    # The export's context: infer_boost on (PagedAttention takes an int8 cache only then). A bfloat16 cache
    # variant is built in a bfloat16 graph; the int8 parameters come in the dtypes the Ascend export writes.
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU", jit_config={"infer_boost": "on"})
    dtype = "bfloat16" if op.variant == "bfloat16" else "float16"
    cell = MINDSPORE_ASCEND.body(op)(attrs, MindSporeTarget("ascend", multi_query=True, dtype=dtype))
    params = int8_cache_parameters({spec.name: x for spec, x in zip(op.inputs, example.inputs)
                                    if spec.name in SCALE_FIELDS}, dtype)
    compute = cache_format(dtype).numpy_dtype
    inputs = [None if x is None else params[spec.name] if spec.name in params else
              x.astype(compute) if x.dtype == np.float32 else x for spec, x in zip(op.inputs, example.inputs)]
    if op.name == "GroupedMatmul" and op.variant == "block_quantized":  # the expert stack as the export writes it
        inputs[1:5] = ascend_expert_block_arrays(*example.inputs[1:5], attrs.bits, attrs.block_size, compute)
    elif op.name == "GroupedMatmul":
        inputs[1] = ascend_expert_arrays(example.inputs[1], compute)
    elif op.variant == "block_quantized":  # the weight as the Ascend export writes it
        first = 0 if op.name == "Gather" else 1
        inputs[first:first + 4] = ascend_block_arrays(*example.inputs[first:first + 4], attrs.bits, attrs.block_size,
                                                      dtype)
    if op.name in ("ReshapeAndCache", "PagedAttention"):  # ATB's pool layout [blocks, block_size, kv_heads, D]
        writes = op.name == "ReshapeAndCache"
        pools = (2, 3) if writes else (1, 2)
        block, kv_heads = (16, 1) if writes else (attrs.block_size, attrs.kv_head_num)
        for i in pools:
            inputs[i] = inputs[i].reshape(-1, block, kv_heads, inputs[i].shape[1] // kv_heads)
    path = tmp_path / op.key.replace(".", "_")  # ms.export appends .mindir; a variant key has a dot
    try:
        ms.export(cell, *(None if x is None else ms.Tensor(x) for x in inputs), file_name=str(path),
                  file_format="MINDIR")
    finally:
        ms.set_context(jit_config={"infer_boost": "off"})
    assert read_ops(path.with_suffix(".mindir")), "the exported graph holds no primitive"


def _run_kernels(op: Op, example: Example) -> list[np.ndarray]:
    from pagedgraph.cpu_kernels.binding import KERNELS

    out = KERNELS.body(op)([None if x is None else x.copy() for x in example.inputs], op.attrs(**example.attrs))
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _custom_op_library(op: Op, request: pytest.FixtureRequest) -> Path:
    """The custom-op library; an op built only with oneDNN (Linear.bfloat16, GroupedMatmul) also needs oneDNN's
    headers."""
    from pagedgraph.cpu_kernels.ort_ops import ORT_CUSTOM_OPS, bf16_linear_supported

    if not ORT_CUSTOM_OPS.own(op).onednn:
        return request.getfixturevalue("custom_op_library")
    library = request.getfixturevalue("onednn_custom_op_library")
    if op.variant == "bfloat16" and not bf16_linear_supported():
        pytest.skip("oneDNN has no bfloat16 matmul on this CPU (it needs AVX-512 BF16 or AMX): the library leaves "
                    f"{op.key} to its ONNX body, checked by the onnx lowering's case")
    return library


@pytest.mark.parametrize("lowering,op,example", list(_cases()))
def test_body_equals_reference(lowering: str, op: Op, example: Example, tmp_path: Path,
                               request: pytest.FixtureRequest) -> None:
    attrs = op.attrs(**example.attrs)
    op.check(example.inputs, op.run_reference(example.inputs, attrs), attrs)  # the example fits the declaration
    expected = op.run_reference(example.inputs, attrs)
    runners: dict[str, Callable[[], Any]] = {
        "onnx": lambda: _run_simulated(op, example) if op is ops.ALL_REDUCE else _run_onnx(op, example),
        "onnxruntime-custom": lambda: _run_onnx(op, example, _custom_op_library(op, request), tmp_path / "profile"),
        "mindspore-cpu": lambda: _run_mindspore_cpu(op, example),
        "kernels": lambda: _run_kernels(op, example),
    }
    if lowering == "mindspore-ascend":
        _export_mindspore_ascend(op, example, tmp_path)
        return
    if lowering == "contiguous":
        got, expected = _contiguous(op, example)
    else:
        got = runners[lowering]()
    assert len(got) == len(expected), f"{lowering} gave {len(got)} outputs, the reference {len(expected)}"
    for i, (g, want) in enumerate(zip(got, expected)):
        assert g.shape == want.shape, f"output {i}: {g.shape} vs the reference's {want.shape}"
        assert g.dtype.name == want.dtype.name, f"output {i}: {g.dtype} vs the reference's {want.dtype}"
        g, want = (x.astype(np.float32) if x.dtype.name == "bfloat16" else x for x in (g, want))
        np.testing.assert_allclose(g, want, atol=example.atol, rtol=example.rtol, err_msg=f"output {i}")


def test_every_lowering_has_a_body_for_every_op() -> None:
    assert registry_report() == {}


def test_every_op_has_examples_that_fit_its_declaration() -> None:
    for op in OPS:
        examples = list(op.examples())
        assert examples, f"{op.key} has no examples: the walk cannot check it"
        for example in examples:
            attrs = op.attrs(**example.attrs)
            op.check(example.inputs, op.run_reference(example.inputs, attrs), attrs)


def test_design_doc_table_is_current() -> None:
    doc = (REPO / "docs" / "design.md").read_text()
    assert BEGIN in doc and END in doc
    assert with_table(doc) == doc, "the op table is stale: python -m pagedgraph.exporter.lowerings --write docs/design.md"


def test_declarations_reject_wrong_attributes_and_shapes() -> None:
    """The errors a lowering or the model gets name the op, the field and what it takes."""
    with pytest.raises(TypeError, match=r"PagedAttention takes attributes .*missing \['head_dim'\]"):
        ops.PAGED_ATTENTION.attrs(head_num=4, kv_head_num=2, qk_scale=0.3, block_size=16)
    with pytest.raises(TypeError, match=r"RmsNorm.epsilon = 'x': expected <class 'float'>"):
        ops.RMS_NORM.attrs(epsilon="x")
    example = next(ops.PAGED_ATTENTION.examples())
    attrs = dataclasses.replace(ops.PAGED_ATTENTION.attrs(**example.attrs), head_dim=16)
    with pytest.raises(ValueError, match=r"PagedAttention: query has shape .* with head_num \* head_dim = 64"):
        ops.PAGED_ATTENTION.check(example.inputs, [], attrs)
    with pytest.raises(TypeError, match="PagedAttention: input cu_seqlens_q is required"):
        ops.PAGED_ATTENTION.arguments(example.inputs[:5])


def test_registry_check_names_missing_bodies_and_refusals() -> None:
    """A lowering without a body for an op is reported; one that refuses an op on purpose shows why instead."""
    from pagedgraph.graphs.ops.op import Lowering, body_table, missing_bodies

    partial = Lowering("new-target", "exporter/new_target.py", {op: object() for op in OPS if op is not ops.ROPE})
    assert missing_bodies(OPS, [partial]) == {"new-target": ["Rope"]}
    with pytest.raises(NotImplementedError, match=r"new-target has no body for Rope: register one in "
                                                   r"exporter/new_target.py"):
        partial.body(ops.ROPE)
    partial.refuse(ops.ROPE, "no rotary kernel on this target")
    assert missing_bodies(OPS, [partial]) == {}
    assert "| `Rope` | RopeOperation | no: no rotary kernel on this target |" in body_table(OPS, [partial])
    with pytest.raises(NotImplementedError, match="new-target cannot run Rope: no rotary kernel"):
        partial.body(ops.ROPE)
