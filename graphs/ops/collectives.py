"""AllReduce: the sum over the ranks of a tensor-parallel group (ATB AllReduceOperation, HCCL/LCCL on Ascend).

Each rank holds a partial sum of a row-parallel linear's output (graphs/tensor_parallel.py); every rank gets the
total. The lowering decides what carries it: MindSpore's `ops.AllReduce` over HCCL on Ascend; in the ONNX graphs a
node with no body, which ONNX Runtime refuses to run alone, so a rank graph never silently yields its partial: the
runtime's single-process simulation (runtime/tp_executor.py) splits the rank graphs there and sums, and a collective
kernel registered for the node (NCCL, gloo) would run the graphs unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np

from .examples import normal
from .op import Attributes, Example, Op, Tensor


@dataclass(frozen=True)
class AllReduceAttributes(Attributes):
    """ATB's rankSize (the group's size; the rank itself is the process's, given by the launcher)."""

    rank_size: int


def all_reduce(x: np.ndarray, *, rank_size: int) -> np.ndarray:
    """What each rank receives when all `rank_size` ranks contribute `x`: their sum. (Distinct partials per rank:
    tests/runtime/test_tensor_parallel.py.)"""
    return (x * np.float32(rank_size)).astype(np.float32)


def _examples() -> Iterator[Example]:
    rng = np.random.default_rng(0)
    for size in (2, 4):
        yield Example((normal(rng, 5, 8),), dict(rank_size=size), label=f"{size} ranks")


ALL_REDUCE = Op(
    name="AllReduce",
    atb="AllReduceOperation (allReduceType sum)",
    inputs=(Tensor("x", ("T", "W")),),
    outputs=(Tensor("sum", ("T", "W")),),
    attributes=AllReduceAttributes,
    reference=all_reduce,
    examples=_examples,
    doc="sum over the tensor-parallel ranks",
)
