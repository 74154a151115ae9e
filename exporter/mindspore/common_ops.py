"""The ops both MindSpore targets lower the same way (gather, add, split, linear). Graph code."""
from __future__ import annotations

from mindspore import nn, ops


class CommonOps(nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.matmul_t = ops.MatMul(transpose_b=True)  # ATB's [out, in] weights; a tied LM head reads the embedding

    def gather(self, table, indices):
        return ops.gather(table, indices, 0)

    def add(self, a, b):
        return a + b

    def split(self, x, sizes):
        return ops.split(x, sizes, -1)

    def linear(self, x, weight, bias):
        y = self.matmul_t(x, weight)
        if bias is None:
            return y
        return y + bias
