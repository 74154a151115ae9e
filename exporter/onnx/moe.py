"""ONNX bodies of the MoE ops (graphs/ops/moe_routing.py, graphs/ops/grouped_matmul.py): the reference semantics
in standard ops, so an artifact runs in plain ONNX Runtime; pagedgraph's custom ops replace the `atb` nodes where
their library is registered (cpu_kernels/ort_ops.py).

Routing sorts the T*k (token, slot) pairs by expert with one TopK over unique keys expert * T*k + pair (a stable
sort), so every shape is static per bucket. GroupedMatmul loops over the experts that received rows (NonZero of
the group sizes): each iteration multiplies its consecutive rows by its expert's weight, so a decode step reads only
the experts its tokens chose, and the group outputs are concatenated in expert order.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
from onnx import TensorProto, helper

from .nodes import Nodes

ExpertWeight = Callable[[Nodes, str], str]  # (loop body nodes, expert id) -> that expert's float32 [N, K]


def moe_gating_top_k_softmax(n: Nodes) -> list[str]:
    """Softmax, TopK (ties to the lower index, as ONNX specifies), and the k weights divided by
    renormalize * their sum + (1 - renormalize): by exactly 1 without renormalization."""
    k = n.unsqueeze(n.attr_const("k", "int"), [0])
    values, indices = n.op("TopK", n.op("Softmax", "x", axis=-1), k, axis=-1, largest=1, sorted=1, outputs=2)
    renormalize = n.cast(n.attr_const("renormalize", "int"), TensorProto.FLOAT)
    total = n.op("ReduceSum", values, n.const([-1]), keepdims=1)
    divisor = n.op("Add", n.op("Mul", total, renormalize), n.op("Sub", n.const(1.0, np.float32), renormalize))
    return [n.op("Div", values, divisor), n.cast(indices, TensorProto.INT32)]


def moe_init_routing(n: Nodes) -> list[str]:
    pairs = n.cast(n.op("Reshape", "expert_idx", n.const([-1])))  # [R] int64, R = T*k
    count = n.shape_dim(pairs, 0)
    positions = n.op("Range", n.const(0), n.op("Squeeze", count), n.const(1))
    keys = n.op("Add", n.op("Mul", pairs, count), positions)  # unique: a stable sort by expert
    _, order = n.op("TopK", keys, count, axis=0, largest=0, sorted=1, outputs=2)
    row_idx = n.op("ScatterElements", n.op("ConstantOfShape", count, value=helper.make_tensor("", TensorProto.INT64,
                                                                                                [1], [0])),
                   order, positions, axis=0)
    expanded = n.op("Gather", "x", n.op("Div", order, n.shape_dim("expert_idx", 1)), axis=0)
    experts = n.unsqueeze(n.attr_const("expert_num", "int"), [0])
    zeros = n.op("ConstantOfShape", experts, value=helper.make_tensor("", TensorProto.INT64, [1], [0]))
    counts = n.op("ScatterElements", zeros, pairs, n.op("Expand", n.const([1]), count), axis=0, reduction="add")
    # flag 1 (cumsum) or 2 (counts): counts + (2 - flag) * (cumsum - counts)
    cumsum_wanted = n.op("Sub", n.const(2), n.attr_const("expert_tokens_count_or_cumsum_flag", "int"))
    tokens = n.op("Add", counts, n.op("Mul", cumsum_wanted, n.op("Sub", n.op("CumSum", counts, n.const(0)), counts)))
    return [expanded, n.cast(row_idx, TensorProto.INT32), tokens]


def moe_token_unpermute(n: Nodes) -> list[str]:
    rows = n.op("Gather", "permuted_tokens", "sorted_indices", axis=0)  # [T*k, H], token-major
    shape = n.op("Concat", n.shape_dim("probs", 0), n.shape_dim("probs", 1), n.const([-1]), axis=0)
    weighted = n.op("Mul", n.op("Reshape", rows, shape), n.unsqueeze("probs", [2]))
    return [n.op("ReduceSum", weighted, n.const([1]), keepdims=0)]


def group_ends(n: Nodes, group_list: str, group_list_type: str) -> str:
    """The groups' exclusive row ends from a group list of type `group_list_type` (a node: 0 cumsum, 1 counts)."""
    running = n.op("CumSum", group_list, n.const(0))
    return n.op("Add", group_list, n.op("Mul", group_list_type, n.op("Sub", running, group_list)))


def expert_loop(n: Nodes, x: str, group_list: str, group_list_type: str, width: str,
                expert_weight: ExpertWeight) -> str:
    """y [M, width]: for each expert with rows, its rows of `x` times its weight (Gemm, transB); rows past the
    groups' total are zero. The loop runs once per expert that has rows, each iteration appending its group's
    output to a sequence, concatenated in expert order at the end."""
    ends = group_ends(n, group_list, group_list_type)
    starts = n.op("Concat", n.const([0]), n.op("Slice", ends, n.const([0]), n.const([-1])), axis=0)
    used = n.op("Reshape", n.op("NonZero", n.op("Greater", n.op("Sub", ends, starts), n.const(0))), n.const([-1]))
    empty = n.op("ConstantOfShape", n.op("Concat", n.const([0]), width, axis=0),
                 value=helper.make_tensor("", TensorProto.FLOAT, [1], [0.0]))
    body = Nodes(prefix=n.fresh("expert_"))
    i, cond, seq = body.fresh("i"), body.fresh("cond"), body.fresh("seq")
    expert = body.op("Gather", used, i, axis=0)
    rows = body.op("Slice", x, body.unsqueeze(body.op("Gather", starts, expert, axis=0), [0]),
                   body.unsqueeze(body.op("Gather", ends, expert, axis=0), [0]), body.const([0]))
    out = body.op("SequenceInsert", seq, body.op("Gemm", rows, expert_weight(body, expert), transB=1))
    graph = helper.make_graph(
        body.nodes + [helper.make_node("Identity", [cond], [body.prefix + "cond_out"])], body.prefix + "body",
        [helper.make_tensor_value_info(i, TensorProto.INT64, []), helper.make_tensor_value_info(cond, TensorProto.BOOL, []),
         helper.make_tensor_sequence_value_info(seq, TensorProto.FLOAT, None)],
        [helper.make_tensor_value_info(body.prefix + "cond_out", TensorProto.BOOL, []),
         helper.make_tensor_sequence_value_info(out, TensorProto.FLOAT, None)])
    trips = n.op("Squeeze", n.shape_dim(used, 0))
    groups = n.op("Loop", trips, "", n.op("SequenceConstruct", empty), body=graph)
    y = n.op("ConcatFromSequence", groups, axis=0)
    missing = n.op("Sub", n.shape_dim(x, 0), n.op("Slice", ends, n.const([-1]), n.const([2 ** 62])))
    return n.op("Pad", y, n.op("Concat", n.const([0, 0]), missing, n.const([0]), axis=0))


def grouped_matmul(n: Nodes) -> list[str]:
    width = n.shape_dim("weight", 1)
    kind = n.attr_const("group_list_type", "int")
    return [expert_loop(n, "x", "group_list", kind, width, lambda b, e: b.op("Gather", "weight", e, axis=0))]


def grouped_matmul_bf16(n: Nodes) -> list[str]:
    """x rounded to bfloat16, each chosen expert's bfloat16 weight widened to float32, float32 Gemm."""
    x = n.cast(n.cast("x", TensorProto.BFLOAT16), TensorProto.FLOAT)
    width = n.shape_dim("weight", 1)
    kind = n.attr_const("group_list_type", "int")
    return [expert_loop(n, x, "group_list", kind, width,
                        lambda b, e: b.cast(b.op("Gather", "weight", e, axis=0), TensorProto.FLOAT))]


def grouped_matmul_block_quantized(g: Any, inputs: Sequence[str | None], attrs: Any, *, nbits: Any) -> list[str]:
    """One GroupedMatmulNBits node (`nbits`, its Function: exporter/onnx/lowering.py binds it) over every part:
    zero points and minima the form leaves out are given as their defaults (2**(bits-1) and 0), one constant for all
    experts ([1, N, Z] and [1, blocks, N], broadcast over the expert axis), so one function body and one custom
    kernel (cpu_kernels/grouped_matmul_nbits.cc) serve every form."""
    x, codes, scales, zero_points, minimum_t, group_list = inputs
    n = g.n
    blocks = attrs.K // attrs.block_size
    if not zero_points:  # MatMulNBits' packing: a byte each (8 bits), two 4-bit points a byte
        width, default = (blocks, 128) if attrs.bits == 8 else ((blocks + 1) // 2, 0x88)
        zero_points = n.const(np.full((1, attrs.N, width), default), np.uint8)
    if not minimum_t:
        minimum_t = n.const(np.zeros((1, blocks, attrs.N)), np.float16)
    return nbits(g, [x, codes, scales, zero_points, minimum_t, group_list], attrs)


def grouped_matmul_nbits(n: Nodes) -> list[str]:
    """GroupedMatmulNBits's function body: each chosen expert's codes, zero points, scales and minima (zero points
    and minima of shape [1, ...] serve every expert) gathered and
    dequantized in gguf's order of operations ((code - zero point) * scale + minimum), then float32 Gemm; a whole
    expert per group (the reference semantics in plain ONNX Runtime). The 4/8-bit unpacking follows the `bits`
    attribute: 8 / bits codes a byte, code i = floor(byte / 2**(bits * i)) mod 2**bits, exact in float32."""
    bits = n.cast(n.attr_const("bits", "int"), TensorProto.FLOAT)
    levels = n.op("Pow", n.const(2.0, np.float32), bits)
    per_byte = n.op("Div", n.const(8.0, np.float32), bits)
    powers = n.op("Pow", levels, n.op("Range", n.const(0.0, np.float32), per_byte, n.const(1.0, np.float32)))
    block = n.unsqueeze(n.attr_const("block_size", "int"), [0])
    k = n.unsqueeze(n.attr_const("K", "int"), [0])
    blocks = n.op("Div", k, block)

    def unpacked(b: Nodes, packed: str) -> str:
        """uint8 [..., bytes] -> float codes [..., bytes * 8 / bits], low bits first."""
        shifted = b.op("Floor", b.op("Div", b.unsqueeze(b.cast(packed, TensorProto.FLOAT), [-1]), powers))
        codes = b.op("Sub", shifted, b.op("Mul", b.op("Floor", b.op("Div", shifted, levels)), levels))
        return b.op("Reshape", codes, b.const([0, 0, -1]))

    def shared(b: Nodes, part: str, e: str) -> str:
        """Expert e's index into `part`, 0 where one entry serves every expert (a default broadcast)."""
        return b.op("Min", e, b.op("Sub", b.op("Squeeze", b.shape_dim(part, 0)), b.const(1)))

    def weight(b: Nodes, e: str) -> str:
        codes = b.op("Reshape", unpacked(b, b.op("Gather", "codes", e, axis=0)),
                     b.op("Concat", b.const([0]), blocks, block, axis=0))  # [N, blocks, block_size]
        zero = unpacked(b, b.unsqueeze(b.op("Gather", "zero_points", shared(b, "zero_points", e), axis=0), [1]))
        zero = b.op("Slice", b.op("Reshape", zero, b.const([0, -1])), b.const([0]), blocks, b.const([1]))
        values = b.op("Mul", b.op("Sub", codes, b.unsqueeze(zero, [2])),
                      b.unsqueeze(b.op("Gather", "scales", e, axis=0), [2]))
        minimum = b.op("Transpose", b.cast(b.op("Gather", "minimum_t", shared(b, "minimum_t", e), axis=0),
                                           TensorProto.FLOAT), perm=[1, 0])
        return b.op("Reshape", b.op("Add", values, b.unsqueeze(minimum, [2])), b.op("Concat", b.const([0]), k, axis=0))

    width = n.unsqueeze(n.attr_const("N", "int"), [0])
    return [expert_loop(n, "x", "group_list", n.attr_const("group_list_type", "int"), width, weight)]
