"""The bodies both MindSpore targets share (Gather, Add, Split, Linear): Cells, their construct is graph code."""
from __future__ import annotations

from typing import Any

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


def antiquant_offset(zero_points, minimum, scales):
    """The additive offset on signed codes of an Ascend weight-quantized matmul (WeightQuantBatchMatmul,
    GroupedMatmulV4's antiquant): the zero point's, plus minimum / scale; None where the form has neither."""
    if minimum is None:
        return zero_points
    if zero_points is None:
        return minimum / scales
    return zero_points + minimum / scales


COMMON = {op_set.GATHER: Gather, op_set.ADD: Add, op_set.SPLIT: Split, op_set.LINEAR: Linear}
