"""The MoE ops on MindSpore CPU, in MindSpore's own ops (static shapes: T*k expanded rows per gear).

GroupedMatmul gathers each expanded row's expert weight and multiplies row by row (BatchMatMul), so a decode step
reads the k experts each token chose and never the others; a long prefill gear holds T*k expert matrices at
once, so the CPU MINDIR suits decode-sized gears and small models (the ONNX graphs serve MoE prefill on CPU).
"""
from __future__ import annotations

from typing import Any

from mindspore import ops
from mindspore import dtype as mstype

from .common_ops import Body


class MoeGatingTopKSoftmax(Body):
    def __init__(self, attrs: Any, target: Any) -> None:
        super().__init__()
        self.k, self.renormalize = attrs.k, bool(attrs.renormalize)

    def construct(self, x):
        y, expert_idx = ops.topk(ops.softmax(x, -1), self.k, -1, True, True)
        if self.renormalize:
            y = y / ops.sum(y, -1, True)
        return y, ops.cast(expert_idx, mstype.int32)


class MoeInitRouting(Body):
    """The pairs sorted by the unique key expert * T*k + pair (stable), the inverse permutation by a second sort."""

    def __init__(self, attrs: Any, target: Any) -> None:
        super().__init__()
        self.expert_num, self.cumsum = attrs.expert_num, attrs.expert_tokens_count_or_cumsum_flag == 1

    def construct(self, x, expert_idx):
        tokens, k = expert_idx.shape
        pairs = ops.reshape(expert_idx, (-1,))
        positions = ops.arange(0, tokens * k, dtype=mstype.int32)
        _, order = ops.sort(ops.cast(pairs * (tokens * k) + positions, mstype.float32))
        _, row_idx = ops.sort(ops.cast(order, mstype.float32))
        expanded = ops.gather(x, order // k, 0)
        counts = ops.reduce_sum(ops.one_hot(pairs, self.expert_num, ops.ones((), mstype.float32),
                                            ops.zeros((), mstype.float32)), 0)
        if self.cumsum:
            counts = ops.cumsum(counts, 0)
        return expanded, ops.cast(row_idx, mstype.int32), ops.cast(counts, mstype.int64)


class GroupedMatmul(Body):
    def __init__(self, attrs: Any, target: Any) -> None:
        super().__init__()
        self.counts = attrs.group_list_type == 1
        self.matmul = ops.BatchMatMul(transpose_b=True)

    def construct(self, x, weight, group_list):
        ends = ops.cumsum(group_list, 0) if self.counts else group_list
        rows = ops.arange(0, x.shape[0], dtype=mstype.int64)
        owner = ops.reduce_sum(ops.cast(ops.expand_dims(rows, 1) >= ops.expand_dims(ends, 0), mstype.int32), 1)
        grouped = ops.cast(owner < weight.shape[0], mstype.float32)  # rows past the groups' total stay zero
        picked = ops.gather(weight, ops.minimum(owner, weight.shape[0] - 1), 0)  # [M, N, K]
        y = ops.squeeze(self.matmul(ops.expand_dims(x, 1), picked), 1)
        return y * ops.expand_dims(grouped, 1)


class MoeTokenUnpermute(Body):
    def construct(self, permuted_tokens, sorted_indices, probs):
        tokens, k = probs.shape
        rows = ops.reshape(ops.gather(permuted_tokens, sorted_indices, 0), (tokens, k, -1))
        return ops.reduce_sum(rows * ops.expand_dims(probs, 2), 1)
