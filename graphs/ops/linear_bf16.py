"""Linear.bfloat16 and Gather.bfloat16: `model.dtype: bfloat16` on CPU, weights stored as bfloat16.

Linear: y = bf16(x) @ bf16(W)^T in float32, W [N, K] in ATB's layout (so the tied LM head reads
the embedding's own table): x is rounded to bfloat16 (to nearest even) at the op's input, the products are
exact in float32 and accumulated in float32, the output is float32. That is what a bf16 GEMM unit computes
(oneDNN's brgemm with avx512_core_bf16 or AMX-BF16, Ascend's MatMul), so every other op of the graph
(RMS norm, rope, softmax, SwiGLU, the residual adds and the KV write) stays float32 and sees only the
rounding of the linears' operands.
No bias input: a model with biases adds them with Add (graphs/decoder.py), which keeps the fused node one
GEMM in every lowering.
Gather: rows of a bfloat16 table (the embedding) widened to float32, exactly.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import ml_dtypes
import numpy as np

from .examples import normal
from .op import Attributes, Example, Op, Tensor

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)


@dataclass(frozen=True)
class LinearBf16Attributes(Attributes):
    K: int  # noqa: N815 (the other weight-format linears' names)
    N: int  # noqa: N815


def to_bfloat16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16, round to nearest even (ONNX Cast's and oneDNN's rounding)."""
    return np.asarray(x, np.float32).astype(BFLOAT16)


def linear_bf16(x: np.ndarray, weight: np.ndarray, *, K: int, N: int) -> np.ndarray:  # noqa: N803
    return (to_bfloat16(x).astype(np.float32) @ weight.astype(np.float32).T).astype(np.float32)


def gather_bf16(table: np.ndarray, indices: np.ndarray) -> np.ndarray:
    return table[indices].astype(np.float32)


def _linear_examples() -> Iterator[Example]:
    rng = np.random.default_rng(3)
    # N = 200 splits into column chunks of unequal width; 70 tokens are a full row block plus a tail.
    k, n = 96, 200
    weight = to_bfloat16(normal(rng, n, k, scale=0.1))
    for tokens, label in ((1, "one token"), (5, "a few tokens"), (70, "row block and tail")):
        x = normal(rng, tokens, k)
        # float32 sums of exact products, in another order: a few ulps of the largest partial sum
        scale = float(np.abs(x).max() * np.abs(weight.astype(np.float32)).max() * k)
        yield Example((x, weight), dict(K=k, N=n), atol=2e-6 * scale, rtol=1e-5, label=label)


def _gather_examples() -> Iterator[Example]:
    rng = np.random.default_rng(4)
    yield Example((to_bfloat16(normal(rng, 10, 6)), np.array([3, 0, 9, 3], np.int64)), {}, atol=0, rtol=0,
                  label="repeated rows")


LINEAR_BF16 = Op(
    name="Linear",
    variant="bfloat16",
    atb="LinearOperation (transposeB, bfloat16 weights)",
    inputs=(Tensor("x", ("T", "K")), Tensor("weight", ("N", "K"), ("bfloat16",))),
    outputs=(Tensor("y", ("T", "N")),),
    reference=linear_bf16,
    attributes=LinearBf16Attributes,
    examples=_linear_examples,
    doc="bfloat16 weights, x rounded to bfloat16, float32 accumulation and output",
)

GATHER_BF16 = Op(
    name="Gather",
    variant="bfloat16",
    atb="GatherOperation (axis 0) + Cast",
    inputs=(Tensor("table", ("N", "W"), ("bfloat16",)), Tensor("indices", ("T",), ("int64",))),
    outputs=(Tensor("rows", ("T", "W")),),
    reference=gather_bf16,
    examples=_gather_examples,
    doc="rows of a bfloat16 table (the embedding shared with the tied LM head) as float32",
)
