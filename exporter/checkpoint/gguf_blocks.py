"""GGUF quantized tensors -> `BlockQuantized`, without dequantizing: the file's own codes, scales and mins.

The bit layouts follow `gguf.quants` (each block: fp16 scale first, then the packed codes). Every form maps
to codes + per-block float32 scale (+ zero point, + minimum) exactly: an fp16 scale widens to float32
without rounding, and a K-quant's sub-block scale `d * sc` (an 11-bit mantissa times a 6-bit integer) is
exact in float32, so `BlockQuantized.dequantize` equals `gguf.quants.dequantize` bit for bit.

| GGUF | bits | block | zero point | minimum |
|---|---|---|---|---|
| Q4_0 | 4 | 32 | 8 | - |
| Q4_1 | 4 | 32 | 0 | m |
| Q8_0 | 8 | 32 | 128 (codes + 128) | - |
| Q4_K | 4 | 32 | 0 | -dmin * m |
| Q6_K | 8 (6 used) | 16 | 32 | - |
"""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf.quants import Q4_K

from ...graphs.quant import BlockQuantized

MAPPED = (Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q6_K)


def _f16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """Bytes [..., r] -> codes [..., 2r]: the low nibbles of the r bytes, then their high nibbles."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def from_gguf(data: np.ndarray, qtype: Q, shape: tuple[int, int]) -> BlockQuantized:
    """One GGUF tensor's raw rows (uint8 [n, bytes per row]) as a `BlockQuantized` of `shape` [n, k]."""
    n, k = shape
    raw = np.ascontiguousarray(data, dtype=np.uint8).reshape(n, -1)
    if qtype == Q.Q4_0 or qtype == Q.Q4_1:
        head = 2 if qtype == Q.Q4_0 else 4
        blocks = raw.reshape(n, k // 32, head + 16)
        scale = _f16(blocks[..., :2]).reshape(n, -1)
        q = _nibbles(blocks[..., head:]).reshape(n, k)
        if qtype == Q.Q4_0:
            return BlockQuantized(q, scale, np.full(scale.shape, 8, np.uint8), None, 4, 32, "Q4_0")
        minimum = _f16(blocks[..., 2:4]).reshape(n, -1)
        return BlockQuantized(q, scale, np.zeros(scale.shape, np.uint8), minimum, 4, 32, "Q4_1")
    if qtype == Q.Q8_0:
        blocks = raw.reshape(n, k // 32, 34)
        scale = _f16(blocks[..., :2]).reshape(n, -1)
        q = (blocks[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8).reshape(n, k)
        return BlockQuantized(q, scale, np.full(scale.shape, 128, np.uint8), None, 8, 32, "Q8_0")
    if qtype == Q.Q4_K:
        blocks = raw.reshape(n * (k // 256), 144)
        d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
        sc, m = Q4_K.get_scale_min(blocks[:, 4:16])
        scale = (d * sc.astype(np.float32)).reshape(n, -1)
        minimum = -(dmin * m.astype(np.float32)).reshape(n, -1)
        q = _nibbles(blocks[:, 16:].reshape(-1, 4, 32)).reshape(n, k)
        return BlockQuantized(q, scale, np.zeros(scale.shape, np.uint8), minimum, 4, 32, "Q4_K")
    if qtype == Q.Q6_K:
        blocks = raw.reshape(n * (k // 256), 210)
        ql, qh = blocks[:, :128], blocks[:, 128:192]
        sc = blocks[:, 192:208].view(np.int8).astype(np.float32)
        d = _f16(blocks[:, 208:210])
        low = (ql.reshape(-1, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 0x0F
        high = (qh.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 0x03
        q = (low.reshape(-1, 8, 32) | (high.reshape(-1, 8, 32) << 4)).reshape(n, k)
        scale = (d * sc).reshape(n, -1)
        return BlockQuantized(q, scale, np.full(scale.shape, 32, np.uint8), None, 8, 16, "Q6_K")
    names = ", ".join(t.name for t in MAPPED)
    raise ValueError(f"GGUF tensor type {qtype.name} has no block-quantized form here (mapped: {names})")
