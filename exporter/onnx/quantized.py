"""ONNX bodies of Linear.block_quantized (`com.microsoft.MatMulNBits`), Gather.block_quantized, Linear.w8a8 and
DynamicQuant.

Linear: MatMulNBits(x, codes, scales[, zero points]) runs the blocks as they are (ORT's MLAS kernel; the
op's inputs are already in its layout). A form with a per-block minimum (GGUF Q4_1, Q4_K) adds
sum_b(x over block b) * minimum[n, b] as one BlockMinimum node (graphs/ops/block_minimum.py; pagedgraph's
custom op, else its function body): MatMulNBits has no additive term, and folding the minimum into a float
zero point would round it (and drops MLAS's int8 path), so the minimum stays exact.

Gather: rows of the codes (the SAME initializer the tied LM head's MatMulNBits reads) are gathered, then
dequantized in gguf's order of operations ((code - zero point) * scale + minimum).
"""
from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence

import numpy as np
from onnx import TensorProto

from .nodes import Nodes
from ...graphs.ops.block_minimum import BlockMinimumAttributes
from ...graphs.ops.linear_w8a8 import ROW_MAX_FLOOR
from ...graphs.ops.op import NoAttributes
from ...cpu_kernels.int8_gemm import MS_DOMAIN


class OnnxGraph(Protocol):
    """What these bodies write into (exporter.onnx.lowering.OnnxGraph): nodes and the opsets they use."""

    n: Nodes
    opsets: dict[str, int]


def linear_block_quantized(g: OnnxGraph, inputs: Sequence[str | None], attrs: Any, *,
                           block_minimum: Callable[[Any, Sequence[str], Any], Sequence[str]]) -> list[str]:
    """`block_minimum` is BlockMinimum's body (exporter/onnx/lowering.py binds it: the function lives there)."""
    x, codes, scales, zero_points, minimum_t, bias = inputs
    n = g.n
    g.opsets.setdefault(MS_DOMAIN, 1)
    nbits_inputs = [x, codes, scales] + ([zero_points] if zero_points else [])
    out = n.op("MatMulNBits", *nbits_inputs, domain=MS_DOMAIN, K=attrs.K, N=attrs.N, bits=attrs.bits,
               block_size=attrs.block_size, accuracy_level=attrs.accuracy_level)
    if minimum_t:  # stored in BlockMinimum's layout (graphs/quant.pack_minimum): nothing for ORT to fold
        out = block_minimum(g, [out, x, minimum_t], BlockMinimumAttributes(attrs.block_size))[0]
    return [n.op("Add", out, bias) if bias else out]


def block_minimum(n: Nodes) -> list[str]:
    """BlockMinimum's function body: y + ReduceSum(x in blocks) @ float32(minimum_t)."""
    block = n.unsqueeze(n.attr_const("block_size", "int"), [0])
    blocks = n.op("Reshape", "x", n.op("Concat", n.const([0, -1]), block, axis=0))
    sums = n.op("ReduceSum", blocks, n.const([2]), keepdims=0)
    return [n.op("Add", "y", n.op("MatMul", sums, n.op("Cast", "minimum_t", to=TensorProto.FLOAT)))]


def gather_block_quantized(g: OnnxGraph, inputs: Sequence[str | None], attrs: Any) -> list[str]:
    codes, scales, zero_points, minimum, indices = inputs
    n = g.n
    blocks = attrs.K // attrs.block_size
    values = n.op("Cast", n.op("Gather", codes, indices, axis=0), to=TensorProto.FLOAT)  # [T, blocks, bytes]
    if attrs.bits == 4:  # split each byte into its two codes, low first, exactly in float32
        high = n.op("Floor", n.op("Div", values, n.const(16.0, np.float32)))
        low = n.op("Sub", values, n.op("Mul", high, n.const(16.0, np.float32)))
        pairs = n.op("Concat", n.unsqueeze(low, [3]), n.unsqueeze(high, [3]), axis=3)
        values = n.op("Reshape", pairs, n.const([0, blocks, attrs.block_size]))
    if zero_points:
        zero_point = n.unsqueeze(n.op("Cast", n.op("Gather", zero_points, indices, axis=0), to=TensorProto.FLOAT), [2])
    else:
        zero_point = n.const(float(1 << (attrs.bits - 1)), np.float32)
    values = n.op("Mul", n.op("Sub", values, zero_point), n.unsqueeze(n.op("Gather", scales, indices, axis=0), [2]))
    if minimum:
        values = n.op("Add", values, n.unsqueeze(n.op("Gather", minimum, indices, axis=0), [2]))
    return [n.op("Reshape", values, n.const([0, attrs.K]))]


def linear_w8a8(g: OnnxGraph, inputs: Sequence[str | None], attrs: Any, *,
                dynamic_quant: Callable[[Any, Sequence[str], Any], Sequence[str]]) -> list[str]:
    """One DynamicQuant node (the per-token quantize; `dynamic_quant` is its body, bound in exporter/onnx/lowering.py),
    then `com.microsoft.MatMulIntegerToFloat` (MLAS's u8s8 int8 GEMM with the per-column weight scale fused) and
    the per-row activation scale.

    The symmetric codes (-127..127) are shifted by 128 into uint8 with one zero point for every row: ORT takes
    only a scalar activation zero point, and its u8s8 kernel is the fast one (s8s8 falls back, measured in
    docs/performance.md)."""
    x, weight, scale, bias = inputs
    n = g.n
    g.opsets.setdefault(MS_DOMAIN, 1)
    codes, row_scale = dynamic_quant(g, [x], NoAttributes())
    out = n.op("MatMulIntegerToFloat", codes, weight, n.const(1.0, np.float32), scale, n.const(128, np.uint8),
               domain=MS_DOMAIN)
    out = n.op("Mul", out, row_scale)
    return [n.op("Add", out, bias) if bias else out]


def dynamic_quant(n: Nodes) -> list[str]:
    """DynamicQuant's function body: the row scale max(max |x|, floor) / 127, then round(x / scale) + 128 as uint8."""
    row_max = n.op("Max", n.op("ReduceMax", n.op("Abs", "x"), axes=[1], keepdims=1),
                   n.const(ROW_MAX_FLOOR, np.float32))
    row_scale = n.op("Div", row_max, n.const(127.0, np.float32))
    codes = n.op("Add", n.op("Round", n.op("Div", "x", row_scale)), n.const(128.0, np.float32))
    return [n.op("Cast", codes, to=TensorProto.UINT8), row_scale]
