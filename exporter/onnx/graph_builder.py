"""OnnxBuilder: the op vocabulary emitted as ONNX nodes, fused ops as `atb` function calls."""
from __future__ import annotations

from typing import Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from exporter.onnx.functions import FUNCTIONS
from exporter.onnx.nodes import ATB_DOMAIN, OPSET, Nodes
from graphs import contract as c
from graphs.builder import OpBuilder
from graphs.config import ModelConfig

IR_VERSION = 10
_NP_TO_ONNX = {np.int64: TensorProto.INT64, np.int32: TensorProto.INT32}


class OnnxBuilder(OpBuilder[str]):
    """Collects one graph with symbolic bucket dims; weights stay numpy until `model()`."""

    def __init__(self, config: ModelConfig, weights: dict[str, np.ndarray]) -> None:
        self.config = config
        self.weights = weights
        self.n = Nodes(prefix="n")
        self.inputs: dict[str, onnx.ValueInfoProto] = {}
        self.outputs: list[onnx.ValueInfoProto] = []
        self.used_weights: list[str] = []
        self.used_functions: list[str] = []
        self._output_names: dict[str, str] = {}

    def _fused(self, op_type: str, *inputs: str, outputs: int = 1, **attrs: object) -> object:
        if op_type not in self.used_functions:
            self.used_functions.append(op_type)
        return self.n.op(op_type, *inputs, outputs=outputs, domain=ATB_DOMAIN, **attrs)

    def input(self, name: str) -> str:
        if name not in self.inputs:
            if name in c.INPUT_DTYPES:
                info = helper.make_tensor_value_info(name, _NP_TO_ONNX[c.INPUT_DTYPES[name]], list(c.INPUT_DIMS[name]))
            else:  # a KV pool
                info = helper.make_tensor_value_info(name, TensorProto.FLOAT, ["num_slots", self.config.kv_size])
            self.inputs[name] = info
        return name

    def weight(self, name: str) -> str:
        if name not in self.used_weights:
            self.used_weights.append(name)
        return name

    def output(self, name: str, value: str) -> None:
        self._output_names[value] = name  # renamed in model(): later nodes may still read `value`
        if name == c.LOGITS:
            info = helper.make_tensor_value_info(name, TensorProto.FLOAT, ["B", self.config.vocab_size])
        else:
            info = helper.make_tensor_value_info(name, TensorProto.FLOAT, ["num_slots", self.config.kv_size])
        self.outputs.append(info)

    def gather(self, table: str, indices: str) -> str:
        return self.n.op("Gather", table, indices, axis=0)

    def add(self, a: str, b: str) -> str:
        return self.n.op("Add", a, b)

    def split(self, x: str, sizes: Sequence[int]) -> list[str]:
        return self.n.op("Split", x, self.n.const(list(sizes)), axis=-1, outputs=len(sizes))

    def linear(self, x: str, weight: str, bias: str | None = None) -> str:
        # Gemm with transB keeps ATB's [out, in] layout, so a tied LM head reads the embedding itself.
        return self.n.op("Gemm", x, weight, *([bias] if bias else []), transB=1)

    def rms_norm(self, x: str, weight: str, epsilon: float) -> str:
        return self._fused("RmsNorm", x, weight, epsilon=float(epsilon))

    def rope(self, query: str, key: str, cos: str, sin: str, head_dim: int) -> tuple[str, str]:
        q, k = self._fused("Rope", query, key, cos, sin, outputs=2)
        return q, k

    def swiglu(self, x: str) -> str:
        return self._fused("SwiGLU", x)

    def reshape_and_cache(self, key: str, value: str, k_cache: str, v_cache: str, slot_mapping: str) -> tuple[str, str]:
        k, v = self._fused("ReshapeAndCache", key, value, k_cache, v_cache, slot_mapping, outputs=2)
        return k, v

    def paged_attention(self, query: str, k_cache: str, v_cache: str, block_tables: str, context_lens: str,
                        cu_seqlens_q: str | None, *, head_num: int, kv_head_num: int, qk_scale: float,
                        block_size: int) -> str:
        if cu_seqlens_q is None:
            raise ValueError("the ONNX PagedAttention always takes cu_seqlens_q (decode passes one query per sequence)")
        return self._fused("PagedAttention", query, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q,
                           head_num=head_num, kv_head_num=kv_head_num, head_dim=self.config.head_dim,
                           qk_scale=float(qk_scale), block_size=block_size)

    def self_attention(self, query: str, key: str, value: str, cu_seqlens_q: str, *, head_num: int,
                       kv_head_num: int, qk_scale: float) -> str:
        return self._fused("SelfAttention", query, key, value, cu_seqlens_q,
                           head_num=head_num, kv_head_num=kv_head_num, head_dim=self.config.head_dim,
                           qk_scale=float(qk_scale))

    def model(self, name: str) -> onnx.ModelProto:
        for value, output_name in self._output_names.items():
            self.n.rename(value, output_name)
        initializers = [numpy_helper.from_array(self.weights[w], w) for w in self.used_weights]
        graph = helper.make_graph(self.n.nodes, name, list(self.inputs.values()), self.outputs, initializers)
        return helper.make_model(
            graph,
            opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(ATB_DOMAIN, 1)],
            functions=[FUNCTIONS[f]() for f in self.used_functions],
            ir_version=IR_VERSION,
            producer_name="pagedgraph",
        )
