"""Round-to-nearest weight quantization (export `quantization: w8a16 | w4a16 | w8a8`).

w8a16 / w4a16 give `BlockQuantized` (MatMulNBits); w8a8 gives q/k/v, o_proj and gate/up as `Int8PerChannel`
(Linear.w8a8: activations quantized per token in the graph) and keeps down_proj and the embedding / tied LM head
in the w8a16 form: down_proj's inputs (the SwiGLU products) carry the outlier channels, and per-token int8 there
alone moved held-out perplexity from 1.015x to 1.033x fp32 (docs/performance.md); MatMulNBits at
export.accuracy_level 4 still computes it in int8, with a scale per block of 32 inputs.

- int8: symmetric, one scale per output row (max |w| / 127), codes + 128 with MatMulNBits' default zero
  point 128. The row's scale is repeated over the row's blocks (MatMulNBits is block-wise).
- int4: asymmetric per group of `group_size` inputs: scale (max - min) / 15 and the group's min (rounded down to
  a float16 value, as Q4_1 stores it) as minimum.
Both never saturate a row's or group's largest weight (what RTN keeps exact is its range).
"""
from __future__ import annotations

from typing import Mapping

import numpy as np

from ..graphs.quant import BlockQuantized, Int8PerChannel, Weight

# MatMulNBits' MLAS kernels take blocks of 16..256 (powers of two).
BLOCK_SIZES = (256, 128, 64, 32, 16)

# Tensors quantized: every linear of the layers, and the embedding (the tied LM head reads it too).
_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
            "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def _row_block(k: int) -> int:
    """The largest MatMulNBits block dividing k (the blocks of a per-row scale)."""
    for size in BLOCK_SIZES:
        if k % size == 0:
            return size
    raise ValueError(f"input width {k} is not a multiple of 16: MatMulNBits cannot hold this weight")


def int8_per_channel(w: np.ndarray) -> BlockQuantized:
    n, k = w.shape
    block = _row_block(k)
    scale = np.abs(w).max(axis=1, keepdims=True).astype(np.float32) / np.float32(127)
    scale[scale == 0] = 1
    q = (np.clip(np.rint(w / scale), -127, 127) + 128).astype(np.uint8)
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
    groups = w.reshape(n, k // group_size, group_size)
    low = _float16_at_most(groups.min(axis=2).astype(np.float32))
    scale = (groups.max(axis=2).astype(np.float32) - low) / np.float32(15)
    scale[scale == 0] = 1
    q = np.clip(np.rint((groups - low[:, :, None]) / scale[:, :, None]), 0, 15).astype(np.uint8)
    # The group's min as an exact additive term (GGUF Q4_1's form) rather than a rounded zero point: a zero point
    # must be an integer code, so a group not spanning 0 loses levels (measured: perplexity 1.22x fp32 at groups
    # of 32 with zero points, docs/performance.md).
    return BlockQuantized(q.reshape(n, k), scale, np.zeros(scale.shape, np.uint8), low, 4, group_size,
                          f"rtn-int4-g{group_size}")


def quantize_weights(tensors: Mapping[str, Weight], quantization: str, group_size: int) -> dict[str, Weight]:
    """Canonical checkpoint tensors with every linear (and the embedding) quantized round-to-nearest.

    w4a16 keeps the embedding / tied LM head at int8 per channel: it is read for every token's logits,
    and at 4 bits it costs the most perplexity for the least size (measured in docs/performance.md).
    """
    out: dict[str, Weight] = {}
    for name, w in tensors.items():
        dense = np.asarray(w.dequantize() if isinstance(w, BlockQuantized) else w, np.float32)
        if name.endswith(".weight") and any(f".{part}." in name for part in _LINEARS):
            if quantization == "w8a8":
                out[name] = int8_per_channel(dense) if ".mlp.down_proj." in name else Int8PerChannel.quantize(dense)
            else:
                out[name] = int8_per_channel(dense) if quantization == "w8a16" else int4_groupwise(dense, group_size)
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            out[name] = int8_per_channel(dense)
        else:
            out[name] = dense
    return out
