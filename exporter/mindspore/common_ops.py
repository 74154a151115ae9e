"""The bodies both MindSpore targets share (Gather, Add, Split, Linear, SegmentSum): Cells, their construct is graph
code."""
from __future__ import annotations

from typing import Any

from mindspore import dtype as mstype
from mindspore import nn, ops

from ...graphs import ops as op_set


class Body(nn.Cell):
    """A body Cell is built from the op's typed attributes and the target (MindSporeTarget); these need neither."""

    def __init__(self, attrs: Any = None, target: Any = None) -> None:
        super().__init__()


class Gather(Body):
    def construct(self, table, indices):
        return ops.gather(table, indices, 0)


class Add(Body):
    def construct(self, a, b):
        return a + b


class Split(Body):
    def __init__(self, attrs: Any, target: Any) -> None:
        super().__init__()
        self.sizes = attrs.sizes

    def construct(self, x):
        return ops.split(x, self.sizes, -1)


class Linear(Body):
    def __init__(self, attrs: Any, target: Any) -> None:
        super().__init__()
        self.matmul_t = ops.MatMul(transpose_b=True)  # ATB's [out, in] weights; a tied LM head reads the embedding

    def construct(self, x, weight, bias):
        y = self.matmul_t(x, weight)
        if bias is None:
            return y
        return y + bias


class SegmentSum(Body):
    """As the ONNX body: the [B, T] 0/1 matrix of the rows each sequence owns, times x, in float32 (the contract's
    dtype, whatever the compute dtype)."""

    def construct(self, x, cu_seqlens_q):
        rows = ops.arange(0, x.shape[0], dtype=mstype.int32).reshape(1, -1)
        owned = ops.logical_and(rows >= cu_seqlens_q[:-1].reshape(-1, 1), rows < cu_seqlens_q[1:].reshape(-1, 1))
        return ops.matmul(ops.cast(owned, mstype.float32), ops.cast(x, mstype.float32))


def antiquant_offset(zero_points, minimum, scales):
    """The additive offset on signed codes of an Ascend weight-quantized matmul (WeightQuantBatchMatmul,
    GroupedMatmulV4's antiquant): the zero point's, plus minimum / scale; None where the form has neither."""
    if minimum is None:
        return zero_points
    if zero_points is None:
        return minimum / scales
    return zero_points + minimum / scales


COMMON = {op_set.GATHER: Gather, op_set.ADD: Add, op_set.SPLIT: Split, op_set.LINEAR: Linear,
          op_set.SEGMENT_SUM: SegmentSum}
