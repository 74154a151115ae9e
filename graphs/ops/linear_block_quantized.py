"""Linear.block_quantized and Gather.block_quantized: the weight held as integer codes with per-block scales.

W[n, j] = (code[n, j] - zero_point[n, b]) * scale[n, b] + minimum[n, b], b = j // block_size (graphs/quant.py),
in ONNX Runtime's MatMulNBits layout: codes uint8 [N, K / block_size, block_size * bits / 8] (4-bit codes two per
byte, low nibble first), float32 scales [N, blocks], optional packed uint8 zero points (default 2**(bits-1)),
and optional minima (GGUF Q4_1 / Q4_K): the linear's transposed, minimum_t [blocks, N], float16 where that is
exact (Q4_1's own precision) else float32 (graphs/quant.pack_minimum), BlockMinimum's layout; the gather's as float32
rows [V, blocks]. The references dequantize, then run the fp32 op.
ATB counterparts: LinearOperation with W4A16/W8A16 weights (MindSpore WeightQuantBatchMatmul on Ascend).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np

from .examples import normal
from .op import Attributes, Example, Op, Tensor
from ..quant import BlockQuantized, from_graph, graph_arrays, unpack_codes


@dataclass(frozen=True)
class BlockQuantizedAttributes(Attributes):
    K: int  # noqa: N815 (MatMulNBits' attribute names)
    N: int  # noqa: N815
    bits: int
    block_size: int
    accuracy_level: int  # MatMulNBits: 0 float32 compute on the dequantized blocks, 4 int8 activations per block


@dataclass(frozen=True)
class GatherBlockQuantizedAttributes(Attributes):
    K: int  # noqa: N815
    bits: int
    block_size: int


def linear_block_quantized(x: np.ndarray, codes: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None,
                           minimum_t: np.ndarray | None, bias: np.ndarray | None, *, K: int,  # noqa: N803
                           N: int, bits: int, block_size: int, accuracy_level: int) -> np.ndarray:  # noqa: N803
    w = from_graph(codes, scales, zero_points, minimum_t, bits, block_size).dequantize()
    out = x @ w.T
    return (out if bias is None else out + bias).astype(np.float32)


def gather_block_quantized(codes: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None,
                           minimum: np.ndarray | None, indices: np.ndarray, *, K: int, bits: int,  # noqa: N803
                           block_size: int) -> np.ndarray:
    rows, blocks = scales.shape
    zp = np.full((rows, blocks), 1 << (bits - 1), np.uint8) if zero_points is None else zero_points
    picked = BlockQuantized(unpack_codes(codes[indices], bits), scales[indices], zp[indices],
                            None if minimum is None else minimum[indices], bits, block_size, "graph")
    return picked.dequantize()


def example_forms() -> Iterator[tuple[str, BlockQuantized]]:
    """The forms the exporter writes, with random codes: GGUF Q4_0 (zero point 8), Q4_1 / RTN int4 (zero point 0
    plus a float16 minimum), Q4_K (a float32 minimum), Q8_0 and RTN int8 (zero point 128), int4 with a zero point per
    group, and 8-bit zero points."""
    rng = np.random.default_rng(0)
    n, k = 40, 128

    def form(label: str, bits: int, block: int, zero_point: np.ndarray | int,
             minimum: str | None = None) -> tuple[str, BlockQuantized]:
        blocks = (n, k // block)
        zp = np.full(blocks, zero_point, np.uint8) if isinstance(zero_point, int) else zero_point
        low = None if minimum is None else normal(rng, *blocks, scale=0.1).astype(minimum).astype(np.float32)
        return label, BlockQuantized(rng.integers(0, 1 << bits, (n, k), dtype=np.uint8),
                                     rng.uniform(0.001, 0.05, blocks).astype(np.float32), zp, low, bits, block, label)

    yield form("4-bit, zero point 8 (Q4_0)", 4, 32, 8)
    yield form("4-bit, float16 minimum (Q4_1, RTN int4)", 4, 32, 0, "float16")
    yield form("4-bit, float32 minimum (Q4_K)", 4, 32, 0, "float32")
    yield form("8-bit, zero point 128 (Q8_0, int8 RTN)", 8, 32, 128)
    yield form("4-bit, zero point per group", 4, 64, rng.integers(0, 16, (n, 2), dtype=np.uint8))
    yield form("8-bit, zero point per block (Q6_K-like)", 8, 16, rng.integers(0, 256, (n, 8), dtype=np.uint8))


def _linear_inputs(w: BlockQuantized) -> tuple[np.ndarray | None, ...]:
    arrays = graph_arrays("w", w)
    return (arrays["w.codes"], arrays["w.scales"], arrays.get("w.zero_points"), arrays.get("w.minimum_t"))


def _linear_examples() -> Iterator[Example]:
    rng = np.random.default_rng(1)
    x = normal(rng, 5, 128)
    for label, w in example_forms():
        bias = normal(rng, w.shape[0])
        attrs = dict(K=w.shape[1], N=w.shape[0], bits=w.bits, block_size=w.block_size)
        scale = float(np.abs(x @ w.dequantize().T).max())
        yield Example((x, *_linear_inputs(w), bias), {**attrs, "accuracy_level": 0}, atol=1e-5 * scale, rtol=1e-5,
                      label=f"{label}, float32 compute")
        # int8 activations per block of 32: about 1/127 of each block's largest |x| per product
        yield Example((x, *_linear_inputs(w), None), {**attrs, "accuracy_level": 4}, atol=2e-2 * scale, rtol=0,
                      label=f"{label}, int8 compute")


def _gather_examples() -> Iterator[Example]:
    indices = np.array([3, 0, 39, 3], np.int64)
    for label, w in example_forms():
        arrays = graph_arrays("w", w, gathered=True)
        zero_points = arrays.get("w.zero_point_rows", arrays.get("w.zero_points"))
        yield Example((arrays["w.codes"], arrays["w.scales"], zero_points, arrays.get("w.minimum"), indices),
                      dict(K=w.shape[1], bits=w.bits, block_size=w.block_size), atol=0, rtol=0, label=label)


_CODES = Tensor("codes", ("N", "K // block_size", "block_size * bits // 8"), ("uint8",))
_SCALES = Tensor("scales", ("N", "K // block_size"))
_MINIMUM_T = Tensor("minimum_t", ("K // block_size", "N"), ("float16", "float32"), optional=True)

LINEAR_BLOCK_QUANTIZED = Op(
    name="Linear",
    variant="block_quantized",
    atb="LinearOperation, W4A16/W8A16 weights (MatMulNBits on CPU)",
    inputs=(Tensor("x", ("T", "K")), _CODES, _SCALES, Tensor("zero_points", ("N", "Z"), ("uint8",), optional=True),
            _MINIMUM_T, Tensor("bias", ("N",), optional=True)),
    outputs=(Tensor("y", ("T", "N")),),
    reference=linear_block_quantized,
    attributes=BlockQuantizedAttributes,
    examples=_linear_examples,
    doc="4/8-bit codes, per-block scales, zero points and minima (GGUF Q4_0/Q4_1/Q8_0/Q4_K/Q6_K, RTN w8a16/w4a16)",
)

GATHER_BLOCK_QUANTIZED = Op(
    name="Gather",
    variant="block_quantized",
    atb="GatherOperation on a quantized table, dequantized rows",
    inputs=(Tensor("codes", ("V", "K // block_size", "block_size * bits // 8"), ("uint8",)),
            Tensor("scales", ("V", "K // block_size")),
            Tensor("zero_points", ("V", "K // block_size"), ("uint8",), optional=True),
            Tensor("minimum", ("V", "K // block_size"), optional=True), Tensor("indices", ("T",), ("int64",))),
    outputs=(Tensor("rows", ("T", "K")),),
    reference=gather_block_quantized,
    attributes=GatherBlockQuantizedAttributes,
    examples=_gather_examples,
    doc="embedding rows of a block-quantized table (the tied LM head's codes), in gguf's order of operations",
)
