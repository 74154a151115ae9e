"""The MoE ops on Ascend: MindSpore's own primitives, the chain MindFormers' inference runs.

MoeGatingTopKSoftmax -> MoeInitRoutingV2 (dropless, group sizes as counts or cumsum) -> GroupedMatmulV4
(split_item 3, group_type 0) -> MoeTokenUnpermute. They export to MINDIR on a CPU host (MindSpore infers their
types and shapes) and run on Ascend only. Expert weights are graph inputs in GroupedMatmulV4's layout [E, K, N]:
the Ascend export writes each stack transposed once (`ascend_expert_arrays`), so a gear reads them as they lie.
"""
from __future__ import annotations

from typing import Any

import numpy as np
from mindspore import ops
from mindspore import dtype as mstype
from mindspore.ops import auto_generate as prims

from .common_ops import Body, antiquant_offset
from ...graphs.quant import from_graph, unstack


class MoeGatingTopKSoftmax(Body):
    def __init__(self, attrs: Any, target: Any) -> None:
        super().__init__()
        self.k, self.renormalize = attrs.k, bool(attrs.renormalize)
        self.gating = prims.MoeGatingTopKSoftmax()

    def construct(self, x):
        y, expert_idx, _ = self.gating(x, None, self.k)
        if self.renormalize:
            y = y / ops.sum(y, -1, True)
        return y, expert_idx


class MoeInitRouting(Body):
    def __init__(self, attrs: Any, target: Any) -> None:
        super().__init__()
        self.expert_num, self.flag = attrs.expert_num, attrs.expert_tokens_count_or_cumsum_flag
        self.routing = prims.MoeInitRoutingV2()

    def construct(self, x, expert_idx):
        active = expert_idx.shape[0] * expert_idx.shape[1]
        expanded_x, row_idx, tokens, _ = self.routing(x, expert_idx, active, 0, self.expert_num, 0, self.flag, False)
        return expanded_x, row_idx, ops.cast(tokens, mstype.int64)


class GroupedMatmul(Body):
    """Weights [E, K, N] (ascend_expert_arrays); GroupedMatmulV4's group_list_type has the op's values."""

    def __init__(self, attrs: Any, target: Any) -> None:
        super().__init__()
        self.group_list_type = attrs.group_list_type
        self.matmul = prims.GroupedMatmulV4()

    def construct(self, x, weight, group_list):
        return self.matmul([x], [weight], None, None, None, None, None, None, group_list, None, None, None, 3, 0,
                           self.group_list_type)[0]


class GroupedMatmulBlockQuantized(GroupedMatmul):
    """W8A16 / W4A16 experts: GroupedMatmulV4's antiquant form, (codes + offset) * scale per group of inputs, the
    codes [E, K, N] signed (int8, or int4 packed two a byte), scales, zero-point offsets and minima [E, groups, N] in
    the compute dtype (ascend_expert_block_arrays)."""

    def construct(self, x, codes, scales, zero_points, minimum_t, group_list):
        offset = antiquant_offset(zero_points, minimum_t, scales)
        if offset is None:
            return self.matmul([x], [codes], None, None, None, [scales], None, None, group_list, None, None, None, 3,
                               0, self.group_list_type)[0]
        return self.matmul([x], [codes], None, None, None, [scales], [offset], None, group_list, None, None, None,
                           3, 0, self.group_list_type)[0]


class MoeTokenUnpermute(Body):
    def __init__(self, attrs: Any, target: Any) -> None:
        super().__init__()
        self.unpermute = prims.MoeTokenUnpermute()

    def construct(self, permuted_tokens, sorted_indices, probs):
        return self.unpermute(permuted_tokens, sorted_indices, probs, False, None)


def ascend_expert_arrays(weight: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """A float expert stack [E, N, K] as GroupedMatmulV4 reads it: [E, K, N] in the compute dtype."""
    return np.ascontiguousarray(weight.transpose(0, 2, 1).astype(dtype))


def ascend_expert_block_arrays(codes: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None,
                               minimum_t: np.ndarray | None, bits: int, block_size: int,
                               dtype: np.dtype) -> list[np.ndarray | None]:
    """A block-quantized expert stack (graphs/quant.stacked_graph_arrays) as GroupedMatmulBlockQuantized takes it:
    signed codes [E, K, N] (code - 2**(bits-1); int4 packed two a byte along N), and per group of `block_size`
    inputs the scales, the zero points' offsets 2**(bits-1) - zero point (None where every one is the default) and
    the minima, each [E, groups, N] in `dtype`."""
    experts = [from_graph(*unstack((codes, scales, zero_points, minimum_t), e), bits, block_size)
               for e in range(codes.shape[0])]
    half = 1 << (bits - 1)
    signed = np.stack([(w.q.astype(np.int16) - half).astype(np.int8).T for w in experts])  # [E, K, N]
    if bits == 4:
        nibbles = signed.astype(np.uint8) & 0x0F
        signed = (nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)).view(np.int8)

    def per_group(values: list[np.ndarray]) -> np.ndarray:
        return np.ascontiguousarray(np.stack([v.T for v in values]).astype(dtype))

    return [np.ascontiguousarray(signed), per_group([w.scale for w in experts]),
            None if zero_points is None else per_group([half - w.zero_point.astype(np.float32) for w in experts]),
            None if minimum_t is None else per_group([w.minimum for w in experts])]
