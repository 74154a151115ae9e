"""The ONNX lowering: one body per op of graphs/ops, registered in `ONNX`.

Standard ops (Gather, Add, Split, Linear) become their ONNX nodes. A fused op stays ONE node
of domain `atb` with ATB's name and the op's attributes (what ATC and readers see), calling a
model-local function whose formal inputs, outputs and attributes are the op's declaration;
ONNX Runtime inlines the body, or runs pagedgraph's custom op of that name when registered.
Body rule measured here: a pool input feeds ScatterND directly and ScatterND's output is the
graph output, so under IOBinding aliasing the write happens in place (docs/performance.md).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Sequence

import numpy as np
from onnx import FunctionProto, TensorProto, helper

from . import attention, moe, quantized
from .kv_cache import to_cache
from .nodes import OPSET, Nodes
from ...graphs import ops
from ...graphs.kv_cache import cache_format
from ...graphs.ops.op import Attributes, Lowering, Op


class OnnxGraph:
    """What a body writes into: the graph's nodes, the model-local functions they call, the opsets they use.

    A body emitting a contrib op adds its domain: `g.opsets.setdefault("com.microsoft", 1)`.
    """

    def __init__(self) -> None:
        self.n = Nodes(prefix="n")
        self.functions: dict[str, Function] = {}
        self.opsets: dict[str, int] = {"": OPSET, ops.OP_SET_DOMAIN: 1}

    def use_function(self, function: "Function") -> None:
        self.functions.setdefault(function.op.key, function)


OnnxBody = Callable[[OnnxGraph, Sequence[Any], Attributes], Sequence[str]]


@dataclass(frozen=True)
class Function:
    """A fused op's body: one `atb` node in the graph, `body` as its model-local function."""

    op: Op
    body: Callable[[Nodes], list[str]]
    name: str = ""  # the node's and function's name where it is not the op's (GroupedMatmulNBits)

    @property
    def node_name(self) -> str:
        return self.name or self.op.name

    def proto(self) -> FunctionProto:
        n = Nodes(prefix="")
        for result, out in zip(self.body(n), self.op.outputs):
            n.rename(result, out.name)  # no trailing Identity: a pool write must stay the op that outputs it
        return helper.make_function(ops.OP_SET_DOMAIN, self.node_name, [t.name for t in self.op.inputs],
                                    [t.name for t in self.op.outputs], n.nodes, [helper.make_opsetid("", OPSET)],
                                    attributes=list(self.op.attribute_names))

    def __call__(self, g: OnnxGraph, inputs: Sequence[str], attrs: Attributes) -> list[str]:
        g.use_function(self)
        out = g.n.op(self.node_name, *inputs, outputs=len(self.op.outputs), domain=ops.OP_SET_DOMAIN,
                     **dataclasses.asdict(attrs))
        return [out] if isinstance(out, str) else out


def _gather(g: OnnxGraph, inputs: Sequence[str], attrs: Attributes) -> list[str]:
    return [g.n.op("Gather", *inputs, axis=0)]


def _add(g: OnnxGraph, inputs: Sequence[str], attrs: Attributes) -> list[str]:
    return [g.n.op("Add", *inputs)]


def _add_rms_norm(g: OnnxGraph, inputs: Sequence[str], attrs: Any) -> list[str]:
    """ONNX Runtime's contrib op, one CPU kernel, as a graph node (like MatMulNBits: ONNX's checker cannot type
    a function output computed by a contrib op). Outputs (output, mean, inv_std_var, input_skip_bias_sum): the
    sum is the fourth; the statistics stay unnamed and are not written. Float32 like every activation (a bfloat16
    model's too: only its linears' weights are bfloat16)."""
    g.opsets.setdefault(quantized.MS_DOMAIN, 1)
    y, total = g.n.fresh("y"), g.n.fresh("sum")
    g.n.nodes.append(helper.make_node("SkipSimplifiedLayerNormalization", list(inputs), [y, "", "", total], name=y,
                                      domain=quantized.MS_DOMAIN, epsilon=attrs.epsilon))
    return [y, total]


def _split(g: OnnxGraph, inputs: Sequence[str], attrs: Any) -> list[str]:
    return g.n.op("Split", inputs[0], g.n.const(list(attrs.sizes)), axis=-1, outputs=len(attrs.sizes))


def _all_reduce(g: OnnxGraph, inputs: Sequence[str], attrs: Any) -> list[str]:
    """One `atb` node without a function body: ONNX Runtime refuses a rank graph unless a kernel for it is
    registered (a collective) or the runtime splits the graph there and sums (runtime/tp_executor.py)."""
    return [g.n.op(ops.ALL_REDUCE.name, *inputs, domain=ops.OP_SET_DOMAIN, rank_size=attrs.rank_size)]


def _segment_sum(g: OnnxGraph, inputs: Sequence[str], attrs: Attributes) -> list[str]:
    """A [B, T] 0/1 matrix of which rows each sequence owns (cu[b] <= row < cu[b + 1]) times x: one MatMul, summed
    in float32 as the matmul accumulates, at a cost of B x T x W, small beside a layer's."""
    n = g.n
    x, cu = inputs
    rows = n.unsqueeze(n.op("Range", n.const(0), n.op("Squeeze", n.shape_dim(x, 0)), n.const(1)), [0])
    bounds = n.cast(cu)
    starts = n.unsqueeze(n.op("Slice", bounds, n.const([0]), n.const([-1])), [1])
    ends = n.unsqueeze(n.op("Slice", bounds, n.const([1]), n.const([np.iinfo(np.int64).max])), [1])
    owned = n.op("And", n.op("GreaterOrEqual", rows, starts), n.op("Less", rows, ends))
    return [n.op("MatMul", n.cast(owned, TensorProto.FLOAT), x)]


def _linear(g: OnnxGraph, inputs: Sequence[str | None], attrs: Attributes) -> list[str]:
    # Gemm with transB keeps ATB's [out, in] layout, so a tied LM head reads the embedding itself.
    return [g.n.op("Gemm", *(i for i in inputs if i is not None), transB=1)]


def _linear_bf16_body(n: Nodes) -> list[str]:
    """The portable body: x rounded to bfloat16 and both operands widened, then float32 Gemm (ONNX Runtime has
    no bfloat16 GEMM on x86; the custom-op library runs oneDNN's instead)."""
    x = n.op("Cast", n.op("Cast", "x", to=TensorProto.BFLOAT16), to=TensorProto.FLOAT)
    return [n.op("Gemm", x, n.op("Cast", "weight", to=TensorProto.FLOAT), transB=1)]


def _gather_bf16(g: OnnxGraph, inputs: Sequence[str], attrs: Attributes) -> list[str]:
    return [g.n.op("Cast", g.n.op("Gather", *inputs, axis=0), to=TensorProto.FLOAT)]


def _reshape_and_cache_for(kv_cache_dtype: str) -> Callable[[Nodes], list[str]]:
    """The write into pools of `kv_cache_dtype`: rows as they are (float32), cast, or quantized (int8)."""
    fmt = cache_format(kv_cache_dtype)

    def body(n: Nodes) -> list[str]:
        index = n.unsqueeze("slot_mapping", [1])
        key, value = (to_cache(n, fmt, x, f"{kv}_inv_scale", f"{kv}_offset") for x, kv in (("key", "k"), ("value", "v")))
        return [n.op("ScatterND", "k_cache", index, key), n.op("ScatterND", "v_cache", index, value)]
    return body


def _normalized(n: Nodes, x: str) -> str:
    """x / sqrt(mean(x^2) + epsilon) * weight over the last axis."""
    mean_square = n.op("ReduceMean", n.op("Pow", x, n.const(2.0, dtype="float32")), axes=[-1], keepdims=1)
    eps = n.attr_const("epsilon", "float")
    return n.op("Mul", n.op("Div", x, n.op("Sqrt", n.op("Add", mean_square, eps))), "weight")


def _rms_norm(n: Nodes) -> list[str]:
    return [_normalized(n, "x")]


def _rms_norm_heads(n: Nodes) -> list[str]:
    """x viewed as [T * heads, head_dim] rows, normed, and viewed back."""
    head_dim = n.unsqueeze(n.attr_const("head_dim", "int"), [0])
    rows = n.op("Reshape", "x", n.op("Concat", n.const([-1]), head_dim, axis=0))
    return [n.op("Reshape", _normalized(n, rows), n.op("Shape", "x"))]


def _rope(n: Nodes) -> list[str]:
    head_dim = n.unsqueeze(n.attr_const("head_dim", "int"), [0])
    cos, sin = n.unsqueeze("cos", [1]), n.unsqueeze("sin", [1])
    heads_shape = n.op("Concat", n.const([0, -1]), head_dim, axis=0)
    rotated = []
    for x in ("query", "key"):
        heads = n.op("Reshape", x, heads_shape)
        first, second = n.op("Split", heads, axis=-1, outputs=2)
        swapped = n.op("Concat", n.op("Neg", second), first, axis=-1)
        out = n.op("Add", n.op("Mul", heads, cos), n.op("Mul", swapped, sin))
        rotated.append(n.op("Reshape", out, n.const([0, -1])))
    return rotated


def _swiglu(n: Nodes) -> list[str]:
    gate, up = n.op("Split", "x", axis=-1, outputs=2)
    return [n.op("Mul", n.op("Mul", gate, n.op("Sigmoid", gate)), up)]


_FUNCTIONS: dict[Op, Callable[[Nodes], list[str]]] = {
    ops.BLOCK_MINIMUM: quantized.block_minimum, ops.DYNAMIC_QUANT: quantized.dynamic_quant,
    ops.LINEAR_BF16: _linear_bf16_body,
    ops.RMS_NORM: _rms_norm, ops.RMS_NORM_HEADS: _rms_norm_heads, ops.ROPE: _rope, ops.SWIGLU: _swiglu,
    ops.SELF_ATTENTION: attention.self_attention,
    ops.MOE_GATING_TOP_K_SOFTMAX: moe.moe_gating_top_k_softmax, ops.MOE_INIT_ROUTING: moe.moe_init_routing,
    ops.GROUPED_MATMUL: moe.grouped_matmul, ops.GROUPED_MATMUL_BF16: moe.grouped_matmul_bf16,
    ops.MOE_TOKEN_UNPERMUTE: moe.moe_token_unpermute,
    **{write: _reshape_and_cache_for(dtype) for dtype, (write, _) in ops.KV_CACHE_OPS.items()},
    **{attend: attention.paged_attention_for(dtype) for dtype, (_, attend) in ops.KV_CACHE_OPS.items()},
}
_FUNCTION_BODIES = {op: Function(op, body) for op, body in _FUNCTIONS.items()}
# GroupedMatmul.block_quantized's core once every part is present (exporter/onnx/moe.py): its own name, as the
# float GroupedMatmul's function may sit in the same model
GROUPED_MATMUL_NBITS = Function(ops.GROUPED_MATMUL_BLOCK_QUANTIZED, moe.grouped_matmul_nbits, "GroupedMatmulNBits")
ONNX: Lowering[OnnxBody] = Lowering(
    "onnx", "exporter/onnx/lowering.py (attention: exporter/onnx/attention.py)",
    {ops.GATHER: _gather, ops.ADD: _add, ops.ADD_RMS_NORM: _add_rms_norm, ops.SPLIT: _split, ops.LINEAR: _linear,
     ops.LINEAR_BLOCK_QUANTIZED: partial(quantized.linear_block_quantized,
                                         block_minimum=_FUNCTION_BODIES[ops.BLOCK_MINIMUM]),
     ops.GATHER_BLOCK_QUANTIZED: quantized.gather_block_quantized,
     ops.LINEAR_W8A8: partial(quantized.linear_w8a8, dynamic_quant=_FUNCTION_BODIES[ops.DYNAMIC_QUANT]),
     ops.GATHER_BF16: _gather_bf16, ops.ALL_REDUCE: _all_reduce, ops.SEGMENT_SUM: _segment_sum,
     ops.GROUPED_MATMUL_BLOCK_QUANTIZED: partial(moe.grouped_matmul_block_quantized, nbits=GROUPED_MATMUL_NBITS),
     **_FUNCTION_BODIES})
ONNX.refuse(ops.LINEAR_W8A8_STATIC, "MindIE's static W8A8 format is the Ascend form (QuantBatchMatmul); the ONNX "
                                    "graphs quantize activations per token (Linear.w8a8)")
