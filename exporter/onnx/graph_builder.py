"""OnnxBuilder: a model definition emitted as ONNX nodes through the ONNX lowering's bodies."""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .lowering import ONNX, OnnxBody, OnnxGraph
from ...graphs import contract as c
from ...graphs.config import ModelConfig
from ...graphs.kv_cache import cache_format
from ...graphs.ops.op import Lowering, Op

IR_VERSION = 10
NP_TO_ONNX = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.float16): TensorProto.FLOAT16,
               np.dtype(np.int64): TensorProto.INT64, np.dtype(np.int32): TensorProto.INT32,
               np.dtype(np.int8): TensorProto.INT8, np.dtype(np.uint8): TensorProto.UINT8}


def onnx_type(dtype: str | np.dtype) -> int:
    """The ONNX element type of a numpy dtype or dtype name (bfloat16 by name: MindSpore registers its own)."""
    name = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
    return TensorProto.BFLOAT16 if name == "bfloat16" else NP_TO_ONNX[np.dtype(name)]


Initializer = Callable[[str], onnx.TensorProto]


class OnnxBuilder(OnnxGraph):
    """Collects one graph with symbolic bucket dims.

    `initializer` gives each weight's TensorProto when the model definition first reads it: a reference into an
    external weights file (exporter/onnx/weights_file.py, which may convert and write the weight right then), or
    a small inline tensor (an int8 cache's scales). The graph is built from names and shapes: no proto here ever
    holds the weights' data."""

    lowering: Lowering[OnnxBody] = ONNX

    def __init__(self, config: ModelConfig, initializer: Initializer, kv_cache_dtype: str = "float32") -> None:
        super().__init__()
        self.config = config
        self.cache_type = cache_format(kv_cache_dtype).onnx_type  # the KV pools' element type
        self._initializer = initializer
        self.inputs: dict[str, onnx.ValueInfoProto] = {}
        self.outputs: list[onnx.ValueInfoProto] = []
        self.initializers: dict[str, onnx.TensorProto] = {}  # in the order the graph first reads them
        self._output_names: dict[str, str] = {}

    def emit(self, op: Op, *inputs: str | None, **attrs: Any) -> Any:
        return self.lowering.emit(self, op, inputs, attrs)

    def input(self, name: str) -> str:
        if name not in self.inputs:
            if name in c.INPUT_DTYPES:
                info = helper.make_tensor_value_info(name, NP_TO_ONNX[np.dtype(c.INPUT_DTYPES[name])],
                                                     list(c.INPUT_DIMS[name]))
            elif name in c.SLICE_INPUTS:
                info = helper.make_tensor_value_info(name, TensorProto.FLOAT, ["T", self.config.hidden_size])
            else:  # a KV pool
                info = helper.make_tensor_value_info(name, self.cache_type, ["num_slots", self.config.kv_size])
            self.inputs[name] = info
        return name

    def weight(self, name: str) -> str:
        if name not in self.initializers:
            self.initializers[name] = self._initializer(name)
        return name

    def output(self, name: str, value: str) -> None:
        self._output_names[value] = name  # renamed in model(): later nodes may still read `value`
        if name in c.HEAD_OUTPUTS:
            info = helper.make_tensor_value_info(name, TensorProto.FLOAT, ["B", c.head_output(self.config)[1]])
        elif name in c.SLICE_OUTPUTS:
            info = helper.make_tensor_value_info(name, TensorProto.FLOAT, ["T", self.config.hidden_size])
        else:
            info = helper.make_tensor_value_info(name, self.cache_type, ["num_slots", self.config.kv_size])
        self.outputs.append(info)

    def model(self, name: str) -> onnx.ModelProto:
        for value, output_name in self._output_names.items():
            self.n.rename(value, output_name)
        graph = helper.make_graph(self.n.nodes, name, list(self.inputs.values()), self.outputs,
                                  list(self.initializers.values()))
        return make_model(graph, self)


def make_model(graph: onnx.GraphProto, built: OnnxGraph) -> onnx.ModelProto:
    """The model around `graph`: the opsets and model-local functions its bodies used."""
    return helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid(domain, version) for domain, version in built.opsets.items()],
        functions=[f.proto() for f in built.functions.values()],
        ir_version=IR_VERSION,
        producer_name="pagedgraph",
    )


def op_model(op: Op, inputs: Sequence[np.ndarray | None], attrs: Mapping[str, Any]) -> onnx.ModelProto:
    """`op` alone, as the ONNX lowering emits it: inputs and outputs named as the op declares them, symbolic dims.

    The model the op-by-lowering walk runs (and the custom-op tests, whose kernels replace the node).
    """
    builder = OnnxGraph()
    names = [spec.name if x is not None else None for spec, x in zip(op.inputs, op.arguments(inputs))]
    outputs = ONNX.emit(builder, op, names, attrs)
    outputs = [outputs] if isinstance(outputs, str) else list(outputs)
    specs = [op.outputs[-1]] * len(outputs) if op.outputs[-1].variadic else list(op.outputs)
    out_names = [f"{t.name}_{i}" if t.variadic else t.name for i, t in enumerate(specs)]
    for value, out in zip(outputs, out_names):
        builder.n.rename(value, out)
    infos = [helper.make_tensor_value_info(name, onnx_type(x.dtype), [f"{name}_{i}" for i in range(x.ndim)])
             for name, x in zip(names, inputs) if x is not None]
    outs = [helper.make_tensor_value_info(o, onnx_type(t.dtypes[0]), [f"{o}_{i}" for i in range(len(t.shape))])
            for o, t in zip(out_names, specs)]
    return make_model(helper.make_graph(builder.n.nodes, op.key, infos, outs), builder)


class FragmentBuilder(OnnxGraph):
    """A fragment of a model definition (one FFN, one layer) as a standalone ONNX model, for tests and
    microbenchmarks: float32 inputs [rows, width] of symbolic rows, the weights inline as initializers, or with
    `inline` False as graph inputs of their shapes (a caller binds them with SessionOptions.add_initializer:
    weights larger than protobuf's 2 GiB, one copy shared by several sessions)."""

    def __init__(self, weights: Mapping[str, np.ndarray], inline: bool = True) -> None:
        super().__init__()
        self._weights, self._inline = weights, inline
        self.inputs: dict[str, onnx.ValueInfoProto] = {}
        self.initializers: dict[str, onnx.TensorProto] = {}
        self.outputs: list[onnx.ValueInfoProto] = []

    def emit(self, op: Op, *inputs: str | None, **attrs: Any) -> Any:
        return ONNX.emit(self, op, inputs, attrs)

    def input(self, name: str) -> str:
        self.inputs.setdefault(name, helper.make_tensor_value_info(name, TensorProto.FLOAT, [f"{name}_rows", None]))
        return name

    def weight(self, name: str) -> str:
        w = self._weights[name]
        if self._inline and name not in self.initializers:
            self.initializers[name] = numpy_helper.from_array(w, name)
        elif not self._inline:
            self.inputs.setdefault(name, helper.make_tensor_value_info(name, onnx_type(w.dtype), list(w.shape)))
        return name

    def output(self, name: str, value: str) -> None:
        self.n.rename(value, name)
        self.outputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, None))

    def model(self, name: str) -> onnx.ModelProto:
        graph = helper.make_graph(self.n.nodes, name, list(self.inputs.values()), self.outputs,
                                  list(self.initializers.values()))
        return make_model(graph, self)
