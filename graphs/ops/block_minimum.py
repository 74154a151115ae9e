"""BlockMinimum: y + (x summed over each block of `block_size` inputs) @ minimum_t.

The additive term of a block-quantized linear whose blocks carry a minimum (GGUF Q4_1, Q4_K): with
W[n, j] = W0[n, j] + minimum[n, j // block_size], x @ W^T = x @ W0^T + blocksum(x) @ minimum^T exactly, so the
weights stay the file's while MatMulNBits (which has no additive term) runs W0. The ONNX body of
Linear.block_quantized adds it as this one node: as standard ops it is four (Reshape, ReduceSum, MatMul, Add),
about a third of a B = 1 decode step of a Q4_1 model (docs/performance.md, 'Precision'). The minima come
transposed, one row per block, so the kernel reads output columns contiguously, and as float16 where that is exact
(Q4_1's own precision; float32 otherwise, e.g. Q4_K's dmin * m): stored so, ONNX Runtime makes no folded copy of
them, and a step reads half the bytes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np

from .examples import normal
from .op import Attributes, Example, Op, Tensor


@dataclass(frozen=True)
class BlockMinimumAttributes(Attributes):
    block_size: int


def block_minimum(y: np.ndarray, x: np.ndarray, minimum_t: np.ndarray, block_size: int) -> np.ndarray:
    sums = x.reshape(x.shape[0], -1, block_size).sum(axis=2, dtype=np.float64)
    return (y + sums @ minimum_t.astype(np.float64)).astype(np.float32)


def _examples() -> Iterator[Example]:
    """Token counts around the kernel's tiles of 4, column counts around its steps of 32, blocks of 32 and 16,
    float16 and float32 minima; one tile wide enough that its columns go out in slices of 64 across the pool,
    the last slice ragged (1003 = 15 * 64 + 5 vectors + 3, 522 = 8 * 64 + 1 vector + 2)."""
    rng = np.random.default_rng(0)
    for tokens, k, n, block, dtype in ((1, 576, 96, 32, np.float16), (6, 128, 44, 16, np.float16),
                                       (37, 1536, 64, 32, np.float16), (3, 64, 5, 16, np.float16),
                                       (5, 576, 72, 32, np.float32), (1, 64, 13, 16, np.float32),
                                       (1, 576, 1003, 32, np.float16), (3, 1536, 522, 32, np.float32)):
        y, x = normal(rng, tokens, n), normal(rng, tokens, k)
        minimum_t = normal(rng, k // block, n, scale=0.05).astype(dtype)
        scale = float(np.abs(block_minimum(y, x, minimum_t, block)).max())
        yield Example((y, x, minimum_t), dict(block_size=block), atol=1e-6 * scale, rtol=1e-5,
                      label=f"[{tokens}, {k}] blocks of {block}, N {n}, {np.dtype(dtype).name} minima")


BLOCK_MINIMUM = Op(
    name="BlockMinimum",
    atb="none: the minimum term of Linear.block_quantized's ONNX body (MatMulNBits has none)",
    inputs=(Tensor("y", ("T", "N")), Tensor("x", ("T", "K")),
            Tensor("minimum_t", ("K // block_size", "N"), ("float16", "float32"))),
    outputs=(Tensor("out", ("T", "N")),),
    attributes=BlockMinimumAttributes,
    reference=block_minimum,
    examples=_examples,
)
