"""GroupedMatmul: one matmul per expert over that expert's consecutive rows (aclnnGroupedMatmulV4, groupType 0).

x [M, K] holds the rows MoeInitRouting sorted by expert (graphs/ops/moe_routing.py); group_list [E] int64 says how
many rows each expert owns, as counts (group_list_type 1) or as a running sum (0); y[rows of e] = x[rows of e] @ W[e]^T.
Rows past the groups' total (none in a dropless layer, where the groups cover all T*k rows) are zero.

Weights are [E, N, K] (each expert's [out, in], ATB's transposeB layout and HF's and GGUF's stacked one); the
Ascend export stores them [E, K, N], GroupedMatmulV4's (exporter/mindspore/ascend_ops.py). Precision variants, as
for Linear: float32; bfloat16 weights (x rounded to bfloat16, float32 accumulation); block-quantized codes
(w8a16 / w4a16, and a GGUF's stacked expert blocks: Q4_0, Q4_1, Q4_K, Q8_0 kept as they are), each expert's parts
in Linear.block_quantized's layout with a leading expert axis (graphs/quant.stacked_graph_arrays).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

from .examples import normal
from .linear_bf16 import to_bfloat16
from .linear_block_quantized import example_forms
from .moe_routing import COUNT, CUMSUM, moe_init_routing, routing_example
from .op import Attributes, Example, Op, Tensor
from ..quant import ExpertStack, from_graph, stacked_graph_arrays, unstack

# group_list_type: GroupedMatmulV4's values
GROUP_CUMSUM, GROUP_COUNT = 0, 1


@dataclass(frozen=True)
class GroupedMatmulAttributes(Attributes):
    group_list_type: int  # GROUP_CUMSUM (0) or GROUP_COUNT (1)


@dataclass(frozen=True)
class GroupedMatmulBlockAttributes(Attributes):
    K: int  # noqa: N815 (Linear.block_quantized's names)
    N: int  # noqa: N815
    bits: int
    block_size: int
    accuracy_level: int
    group_list_type: int


def group_bounds(group_list: np.ndarray, group_list_type: int, rows: int) -> np.ndarray:
    """[E + 1] row offsets of the groups; a ValueError names a group list that is not one."""
    if group_list_type not in (GROUP_CUMSUM, GROUP_COUNT):
        raise ValueError(f"group_list_type = {group_list_type}: expected {GROUP_CUMSUM} (cumsum) or {GROUP_COUNT} "
                         "(counts)")
    ends = np.cumsum(group_list) if group_list_type == GROUP_COUNT else np.asarray(group_list)
    bounds = np.concatenate([[0], ends]).astype(np.int64)
    if np.any(np.diff(bounds) < 0) or bounds[-1] > rows:
        raise ValueError(f"group list {group_list.tolist()} ({'counts' if group_list_type else 'cumsum'}) does not "
                         f"split {rows} rows into consecutive groups")
    return bounds


def _grouped(x: np.ndarray, group_list: np.ndarray, group_list_type: int,
             expert_weight: Callable[[int], np.ndarray]) -> np.ndarray:
    bounds = group_bounds(group_list, group_list_type, len(x))
    y = np.zeros((len(x), expert_weight(0).shape[0]), np.float32)
    for e in range(len(group_list)):
        if bounds[e + 1] > bounds[e]:
            y[bounds[e]:bounds[e + 1]] = x[bounds[e]:bounds[e + 1]] @ expert_weight(e).T
    return y


def grouped_matmul(x: np.ndarray, weight: np.ndarray, group_list: np.ndarray, *, group_list_type: int) -> np.ndarray:
    return _grouped(x, group_list, group_list_type, lambda e: weight[e])


def grouped_matmul_bf16(x: np.ndarray, weight: np.ndarray, group_list: np.ndarray, *,
                        group_list_type: int) -> np.ndarray:
    rounded = to_bfloat16(x).astype(np.float32)
    return _grouped(rounded, group_list, group_list_type, lambda e: weight[e].astype(np.float32))


def grouped_matmul_block_quantized(x: np.ndarray, codes: np.ndarray, scales: np.ndarray,
                                   zero_points: np.ndarray | None, minimum_t: np.ndarray | None,
                                   group_list: np.ndarray, *, K: int, N: int, bits: int,  # noqa: N803
                                   block_size: int, accuracy_level: int, group_list_type: int) -> np.ndarray:
    parts = (codes, scales, zero_points, minimum_t)
    return _grouped(x, group_list, group_list_type,
                    lambda e: from_graph(*unstack(parts, e), bits, block_size).dequantize())


def _routed(rng: np.random.Generator, tokens: int, experts: int, k: int, width: int, skew: bool,
            group_list_type: int) -> tuple[np.ndarray, np.ndarray]:
    """Expanded rows and their group list as MoeInitRouting makes them."""
    flag = COUNT if group_list_type == GROUP_COUNT else CUMSUM
    expanded, _, tokens_per_expert = moe_init_routing(normal(rng, tokens, width),
                                                      routing_example(rng, tokens, experts, k, skew),
                                                      expert_num=experts, expert_tokens_count_or_cumsum_flag=flag)
    return expanded, tokens_per_expert


# (tokens, experts, top-k, skewed, group list type): decode, a batch with empty and crowded groups, prefill.
_ROUTINGS = ((1, 8, 2, False, GROUP_COUNT), (6, 16, 4, True, GROUP_CUMSUM), (37, 16, 4, True, GROUP_COUNT))


def _label(tokens: int, experts: int, k: int, skew: bool, kind: int) -> str:
    return (f"{tokens} tokens x top-{k} of {experts}{', skewed' if skew else ''}, "
            f"{'counts' if kind == GROUP_COUNT else 'cumsum'}")


def _examples() -> Iterator[Example]:
    rng = np.random.default_rng(5)
    k_in, n = 48, 40
    for tokens, experts, k, skew, kind in _ROUTINGS:
        x, groups = _routed(rng, tokens, experts, k, k_in, skew, kind)
        yield Example((x, normal(rng, experts, n, k_in, scale=0.2), groups), dict(group_list_type=kind), atol=1e-5,
                      label=_label(tokens, experts, k, skew, kind))
    x = normal(rng, 5, k_in)  # groups covering 3 of 5 rows: the rest stay zero
    yield Example((x, normal(rng, 2, n, k_in), np.array([1, 2], np.int64)), dict(group_list_type=GROUP_COUNT),
                  atol=1e-5, label="rows past the groups")


def _bf16_examples() -> Iterator[Example]:
    rng = np.random.default_rng(6)
    k_in, n = 96, 64
    for tokens, experts, k, skew, kind in _ROUTINGS:
        x, groups = _routed(rng, tokens, experts, k, k_in, skew, kind)
        weight = to_bfloat16(normal(rng, experts, n, k_in, scale=0.1))
        scale = float(np.abs(x).max() * np.abs(weight.astype(np.float32)).max() * k_in)
        yield Example((x, weight, groups), dict(group_list_type=kind), atol=2e-6 * scale, rtol=1e-5,
                      label=_label(tokens, experts, k, skew, kind))


def _block_examples() -> Iterator[Example]:
    """Each of Linear.block_quantized's forms (GGUF Q4_0/Q4_1/Q4_K/Q8_0, RTN int4/int8) as a stack of experts."""
    rng = np.random.default_rng(7)
    tokens, experts, k, kind = 6, 4, 2, GROUP_COUNT
    for label, w in example_forms():
        n, k_in = w.shape
        stack = [w.rows(rng.permutation(n)) for _ in range(experts)]  # distinct experts of one form
        arrays = stacked_graph_arrays("w", ExpertStack(tuple(stack)))
        x, groups = _routed(rng, tokens, experts, k, k_in, True, kind)
        scale = float(np.abs(x).max() * max(np.abs(e.dequantize()).max() for e in stack) * k_in)
        parts = (arrays["w.codes"], arrays["w.scales"], arrays.get("w.zero_points"), arrays.get("w.minimum_t"))
        attrs = dict(K=k_in, N=n, bits=w.bits, block_size=w.block_size, group_list_type=kind)
        yield Example((x, *parts, groups), {**attrs, "accuracy_level": 0}, atol=1e-6 * scale, rtol=1e-5,
                      label=f"{label}, float32 compute")
        # int8 activations per block of 32 (MatMulNBits' level 4): about 1/127 of each block's largest |x|
        yield Example((x, *parts, groups), {**attrs, "accuracy_level": 4}, atol=5e-3 * scale, rtol=0,
                      label=f"{label}, int8 compute")


_X = Tensor("x", ("M", "K"))
_GROUP_LIST = Tensor("group_list", ("E",), ("int64",))
_Y = Tensor("y", ("M", "N"))

GROUPED_MATMUL = Op(
    name="GroupedMatmul",
    atb="aclnnGroupedMatmulV4 (splitItem 3, groupType 0)",
    inputs=(_X, Tensor("weight", ("E", "N", "K")), _GROUP_LIST),
    outputs=(_Y,),
    reference=grouped_matmul,
    attributes=GroupedMatmulAttributes,
    examples=_examples,
    doc="each expert's rows times its weight: the experts' gate/up and down projections",
)

GROUPED_MATMUL_BF16 = Op(
    name="GroupedMatmul",
    variant="bfloat16",
    atb="aclnnGroupedMatmulV4, bfloat16 weights",
    inputs=(_X, Tensor("weight", ("E", "N", "K"), ("bfloat16",)), _GROUP_LIST),
    outputs=(_Y,),
    reference=grouped_matmul_bf16,
    attributes=GroupedMatmulAttributes,
    examples=_bf16_examples,
    doc="bfloat16 expert weights, x rounded to bfloat16, float32 accumulation and output",
)

GROUPED_MATMUL_BLOCK_QUANTIZED = Op(
    name="GroupedMatmul",
    variant="block_quantized",
    atb="aclnnGroupedMatmulV4 with antiquantScale/antiquantOffset (W8A16/W4A16)",
    inputs=(_X, Tensor("codes", ("E", "N", "K // block_size", "block_size * bits // 8"), ("uint8",)),
            Tensor("scales", ("E", "N", "K // block_size")),
            Tensor("zero_points", ("E", "N", "Z"), ("uint8",), optional=True),
            Tensor("minimum_t", ("E", "K // block_size", "N"), ("float16", "float32"), optional=True), _GROUP_LIST),
    outputs=(_Y,),
    reference=grouped_matmul_block_quantized,
    attributes=GroupedMatmulBlockAttributes,
    examples=_block_examples,
    doc="4/8-bit expert codes with per-block scales, zero points and minima (w8a16, w4a16, a GGUF's expert blocks)",
)
