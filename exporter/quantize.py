"""Round-to-nearest weight quantization (export `quantization: w8a16 | w4a16 | w8a8`).

Which tensors are quantized, and how, follows each one's role in its family (graphs/family.py): every linear and the
embedding tables. w8a16 / w4a16 give `BlockQuantized` (MatMulNBits); w8a8 gives the linears whose role takes int8
activations (q/k/v, o_proj and gate/up) as `Int8PerChannel` (Linear.w8a8: activations quantized per token in the
graph) and keeps down_proj and the embedding / tied LM head in the w8a16 form: down_proj's inputs (the SwiGLU products) carry the outlier channels, and per-token int8 there
alone moved held-out perplexity from 1.015x to 1.033x fp32 (docs/performance.md); MatMulNBits at
export.accuracy_level 4 still computes it in int8, with a scale per block of 32 inputs.

- int8: symmetric, one scale per output row (max |w| / 127), codes + 128 with MatMulNBits' default zero
  point 128. The row's scale is repeated over the row's blocks (MatMulNBits is block-wise).
- int4: asymmetric per group of `group_size` inputs: scale (max - min) / 15 and the group's min (rounded down to
  a float16 value, as Q4_1 stores it) as minimum.
Both never saturate a row's or group's largest weight (what RTN keeps exact is its range).
"""
from __future__ import annotations

from typing import Iterator, Mapping

import numpy as np

from ..graphs import models
from ..graphs.config import ModelConfig
from ..graphs.family import Kind, Role
from ..graphs.quant import BlockQuantized, Int8PerChannel, Weight, row_chunks

# MatMulNBits' MLAS kernels take blocks of 16..256 (powers of two).
BLOCK_SIZES = (256, 128, 64, 32, 16)


def _row_block(k: int) -> int:
    """The largest MatMulNBits block dividing k (the blocks of a per-row scale)."""
    for size in BLOCK_SIZES:
        if k % size == 0:
            return size
    raise ValueError(f"input width {k} is not a multiple of 16: MatMulNBits cannot hold this weight")


def int8_per_channel(w: np.ndarray) -> BlockQuantized:
    n, k = w.shape
    block = _row_block(k)
    q, scale = np.empty((n, k), np.uint8), np.empty((n, 1), np.float32)
    for rows in row_chunks(n, k):  # row by row, exactly: every value depends on its row alone; in one buffer
        buffer = np.abs(w[rows])
        part = buffer.max(axis=1, keepdims=True).astype(np.float32) / np.float32(127)
        part[part == 0] = 1
        np.rint(np.divide(w[rows], part, out=buffer), out=buffer)
        q[rows], scale[rows] = np.add(np.clip(buffer, -127, 127, out=buffer), 128, out=buffer), part
    blocks = k // block
    return BlockQuantized(q, np.repeat(scale, blocks, axis=1), np.full((n, blocks), 128, np.uint8), None, 8, block,
                          "rtn-int8-per-channel")


def _float16_at_most(x: np.ndarray) -> np.ndarray:
    """The largest float16 values <= x, as float32: a group minimum the graph stores exactly in float16 (GGUF Q4_1's
    precision, half the bytes BlockMinimum reads per step) that still lies below every weight of its group."""
    half = x.astype(np.float16)
    half = np.where(half.astype(np.float32) > x, np.nextafter(half, np.float16(-np.inf)), half)
    return half.astype(np.float32)


def int4_groupwise(w: np.ndarray, group_size: int) -> BlockQuantized:
    n, k = w.shape
    if k % group_size:
        fits = [s for s in BLOCK_SIZES if k % s == 0]
        raise ValueError(f"model.group_size = {group_size} does not divide this model's input width {k}; "
                         f"use {fits[0] if fits else 16} or another power of two dividing {k}")
    blocks = k // group_size
    q, low, scale = np.empty((n, blocks, group_size), np.uint8), np.empty((n, blocks), np.float32), \
        np.empty((n, blocks), np.float32)
    for rows in row_chunks(n, k):  # group by group, exactly
        groups = w[rows].reshape(-1, blocks, group_size)
        low[rows] = _float16_at_most(groups.min(axis=2).astype(np.float32))
        scale[rows] = (groups.max(axis=2).astype(np.float32) - low[rows]) / np.float32(15)
        scale[rows][scale[rows] == 0] = 1
        buffer = np.subtract(groups, low[rows][:, :, None])
        np.rint(np.divide(buffer, scale[rows][:, :, None], out=buffer), out=buffer)
        q[rows] = np.clip(buffer, 0, 15, out=buffer)
    # The group's min as an exact additive term (GGUF Q4_1's form) rather than a rounded zero point: a zero point
    # must be an integer code, so a group not spanning 0 loses levels (measured: perplexity 1.22x fp32 at groups
    # of 32 with zero points, docs/performance.md).
    return BlockQuantized(q.reshape(n, k), scale, np.zeros(scale.shape, np.uint8), low, 4, group_size,
                          f"rtn-int4-g{group_size}")


def quantize_tensor(role: Role, w: Weight, quantization: str, group_size: int) -> Weight:
    """One checkpoint tensor of `role` in its quantized form (see `quantize_weights`)."""
    dense = np.asarray(w.dequantize() if isinstance(w, BlockQuantized) else w, np.float32)
    if not role.kind.matrix:
        return dense
    if role.kind is not Kind.LINEAR:  # the embedding tables
        return int8_per_channel(dense)
    if quantization == "w8a8":
        return Int8PerChannel.quantize(dense) if role.int8_activations else int8_per_channel(dense)
    return int8_per_channel(dense) if quantization == "w8a16" else int4_groupwise(dense, group_size)


class QuantizedTensors(Mapping[str, Weight]):
    """Checkpoint tensors quantized when read (`quantize_tensor`), one at a time: nothing is kept."""

    def __init__(self, roles: Mapping[str, Role], tensors: Mapping[str, Weight], quantization: str,
                 group_size: int) -> None:
        self._roles, self._tensors, self._quantization, self._group_size = roles, tensors, quantization, group_size

    def __getitem__(self, name: str) -> Weight:
        return quantize_tensor(self._roles[name], self._tensors[name], self._quantization, self._group_size)

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)


def quantize_weights(config: ModelConfig, tensors: Mapping[str, Weight], quantization: str,
                     group_size: int) -> QuantizedTensors:
    """`config`'s checkpoint tensors with every linear (and the embedding) quantized round-to-nearest, each when read.

    w4a16 keeps the embedding / tied LM head at int8 per channel: it is read for every token's logits,
    and at 4 bits it costs the most perplexity for the least size (measured in docs/performance.md).
    """
    roles = {name: w.role for name, w in models.source_weights(config).items()}
    return QuantizedTensors(roles, tensors, quantization, group_size)
