"""KV-cache dtypes: how a pool row is stored, and the int8 form's quantization (ATB's contract).

A cache dtype is a variant of ReshapeAndCache and PagedAttention, not a new op: the pools of a
bucket graph are typed by it, ReshapeAndCache converts the new K/V rows to it before the write and
PagedAttention reads them back as float32 inside the op. For int8 (ATB's quantized cache, MindIE's
"C8") the conversion is per channel over kv_heads * head_dim:

    write:  q = clamp(round(x * inv_scale + offset), -128, 127)      (ReshapeAndCache)
    read:   x = (q - offset) * scale                                 (PagedAttention: kDescale, kOffset)

with `scale`, `inv_scale = 1 / scale` and integer `offset` per layer and per K/V, calibrated at export.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import ml_dtypes
import numpy as np

KVCacheDType = Literal["float32", "bfloat16", "float16", "int8"]
KV_CACHE_DTYPES: tuple[KVCacheDType, ...] = get_args(KVCacheDType)
INT8_MIN, INT8_MAX = -128, 127


@dataclass(frozen=True)
class CacheFormat:
    """How one cache dtype is stored: element bytes, numpy dtype, ONNX element type (TensorProto enum)."""

    name: KVCacheDType
    itemsize: int
    numpy_dtype: np.dtype
    onnx_type: int  # onnx.TensorProto.DataType; an int so graphs/ does not import onnx
    quantized: bool


_FORMATS = {
    "float32": CacheFormat("float32", 4, np.dtype(np.float32), 1, False),
    "bfloat16": CacheFormat("bfloat16", 2, np.dtype(ml_dtypes.bfloat16), 16, False),
    "float16": CacheFormat("float16", 2, np.dtype(np.float16), 10, False),
    "int8": CacheFormat("int8", 1, np.dtype(np.int8), 3, True),
}


def cache_format(name: str) -> CacheFormat:
    """The format of cache dtype `name`; a clear error for anything else."""
    if name not in _FORMATS:
        raise ValueError(f"kv cache dtype {name!r}: choose one of {', '.join(KV_CACHE_DTYPES)}")
    return _FORMATS[name]


def bytes_per_block(name: str, num_layers: int, block_size: int, kv_size: int) -> int:
    """K and V pools of every layer for one block (int8 scales are per layer, not per block)."""
    return 2 * num_layers * block_size * kv_size * cache_format(name).itemsize


# An int8 layer's parameters, each [kv_heads * head_dim] (float32 scales, int32 offsets), in the order
# ReshapeAndCache.int8 takes its quantization's (k_inv_scale, k_offset, v_inv_scale, v_offset) and
# PagedAttention.int8 its dequantization's (k_scale, k_offset, v_scale, v_offset: ATB's kDescale/kOffset,
# vDescale/vOffset; MindIE's kv_cache_scale/kv_cache_offset).
QUANT_INPUTS = ("k_inv_scale", "k_offset", "v_inv_scale", "v_offset")
DEQUANT_INPUTS = ("k_scale", "k_offset", "v_scale", "v_offset")
SCALE_FIELDS = ("k_scale", "k_inv_scale", "k_offset", "v_scale", "v_inv_scale", "v_offset")


def scale_weight_name(layer: int, field: str) -> str:
    """The graph parameter holding one layer's `field` (e.g. `layers.3.k_cache_scale`)."""
    kv, rest = field.split("_", 1)
    return f"layers.{layer}.{kv}_cache_{rest}"


def int8_params(low: np.ndarray, high: np.ndarray) -> dict[str, np.ndarray]:
    """Asymmetric per-channel int8 parameters covering [low, high] of each channel (calibrated ranges).

    The 256 levels span [min(low, 0), max(high, 0)], so 0 is representable; offset is the integer
    that 0.0 maps to. Returns scale, inv_scale (float32) and offset (int32).
    """
    low = np.minimum(np.asarray(low, np.float64), 0.0)
    high = np.maximum(np.asarray(high, np.float64), 0.0)
    scale = np.maximum((high - low) / (INT8_MAX - INT8_MIN), 1e-8)
    offset = np.clip(np.round(INT8_MIN - low / scale), INT8_MIN, INT8_MAX)
    scale32 = scale.astype(np.float32)
    return {"scale": scale32, "inv_scale": (1.0 / scale32).astype(np.float32), "offset": offset.astype(np.int32)}


def quantize(x: np.ndarray, inv_scale: np.ndarray, offset: np.ndarray) -> np.ndarray:
    """ReshapeAndCache's int8 write: clamp(round(x * inv_scale + offset)), round half to even (as ONNX Round)."""
    q = np.round(x.astype(np.float32) * inv_scale + offset.astype(np.float32))
    return np.clip(q, INT8_MIN, INT8_MAX).astype(np.int8)


def dequantize(q: np.ndarray, scale: np.ndarray, offset: np.ndarray) -> np.ndarray:
    """PagedAttention's int8 read: (q - offset) * scale, in float32."""
    return (q.astype(np.float32) - offset.astype(np.float32)) * scale


def to_cache(x: np.ndarray, dtype: np.dtype, inv_scale: np.ndarray | None = None,
             offset: np.ndarray | None = None) -> np.ndarray:
    """Rows in the pool's dtype: quantized for int8 (needs inv_scale/offset), a rounding cast otherwise."""
    if dtype == np.int8:
        if inv_scale is None or offset is None:
            raise ValueError("an int8 cache write needs its layer's inv_scale and offset")
        return quantize(x, inv_scale, offset)
    return x.astype(dtype)


def from_cache(rows: np.ndarray, scale: np.ndarray | None = None, offset: np.ndarray | None = None) -> np.ndarray:
    """Pool rows as float32: dequantized for int8 (needs scale/offset), a widening cast otherwise."""
    if rows.dtype == np.int8:
        if scale is None or offset is None:
            raise ValueError("an int8 cache read needs its layer's scale and offset")
        return dequantize(rows, scale, offset)
    return rows.astype(np.float32)
