"""ReshapeAndCache and PagedAttention for pools of bfloat16, float16 or int8 (graphs/kv_cache.py: the formats).

Each cache dtype is a variant row of the two ops (`ReshapeAndCache.int8`, `PagedAttention.bfloat16`, ...):
the pools are typed by it, ReshapeAndCache converts the step's rows before the write (int8: ATB's
per-channel quantization, clamp(round(x * inv_scale + offset))), and PagedAttention reads the rows back
as float32 inside the op (int8: (q - offset) * scale with ATB's kDescale/kOffset, vDescale/vOffset).
The references say exactly that: convert, then the float32 op.
"""
from __future__ import annotations

from typing import Iterator

import numpy as np

from ..kv_cache import (DEQUANT_INPUTS, QUANT_INPUTS, CacheFormat, KVCacheDType, cache_format, from_cache,
                             int8_params, to_cache)
from .op import Example, Op, Tensor
from .paged_attention import PAGED_ATTENTION, paged_attention
from .reshape_and_cache import RESHAPE_AND_CACHE


def reshape_and_cache_typed(key: np.ndarray, value: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                            slot_mapping: np.ndarray, k_inv_scale: np.ndarray | None = None,
                            k_offset: np.ndarray | None = None, v_inv_scale: np.ndarray | None = None,
                            v_offset: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """ReshapeAndCache into pools of their own dtype: rows cast (16-bit) or quantized per channel (int8)."""
    k_cache[slot_mapping] = to_cache(key, k_cache.dtype, k_inv_scale, k_offset)
    v_cache[slot_mapping] = to_cache(value, v_cache.dtype, v_inv_scale, v_offset)
    return k_cache, v_cache


def paged_attention_typed(query: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, block_tables: np.ndarray,
                          context_lens: np.ndarray, cu_seqlens_q: np.ndarray, k_scale: np.ndarray | None = None,
                          k_offset: np.ndarray | None = None, v_scale: np.ndarray | None = None,
                          v_offset: np.ndarray | None = None, **attrs: object) -> np.ndarray:
    """The float32 PagedAttention over the pools read back: widened (16-bit) or dequantized per channel (int8)."""
    return paged_attention(query, from_cache(k_cache, k_scale, k_offset), from_cache(v_cache, v_scale, v_offset),
                           block_tables, context_lens, cu_seqlens_q, **attrs)  # type: ignore[arg-type]


def example_scales(rng: np.random.Generator, width: int) -> list[np.ndarray]:
    """Per-channel int8 parameters of calibrated-looking ranges (channels differ in scale and centre):
    [scale, inv_scale, offset] for K, then for V."""
    params = []
    for _ in "kv":
        centre, spread = rng.normal(0, 1, width), rng.uniform(0.5, 4, width)
        p = int8_params(centre - spread, centre + spread)
        params += [p["scale"], p["inv_scale"], p["offset"]]
    return params


def _in_dtype(rng: np.random.Generator, dtype: str, k_cache: np.ndarray, v_cache: np.ndarray
              ) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """Example pools converted to `dtype` (every value one the dtype holds), and int8's parameters."""
    fmt = cache_format(dtype)
    params = example_scales(rng, k_cache.shape[1]) if fmt.quantized else [None] * 6
    k_scale, k_inv, k_off, v_scale, v_inv, v_off = params
    return (to_cache(k_cache * 2, fmt.numpy_dtype, k_inv, k_off), to_cache(v_cache * 2, fmt.numpy_dtype, v_inv, v_off),
            params if fmt.quantized else [])


def _write_examples(dtype: str) -> Iterator[Example]:
    """The float32 op's examples (distinct slots, padding into the null block) into pools of `dtype`; bit-exact."""
    for i, base in enumerate(RESHAPE_AND_CACHE.examples()):
        rng = np.random.default_rng(100 + i)
        key, value, k_cache, v_cache, slots = base.inputs
        k_cache, v_cache, params = _in_dtype(rng, dtype, k_cache, v_cache)
        extra = [params[1], params[2], params[4], params[5]] if params else []  # inv_scale, offset of K then V
        yield Example((key * 3, value * 3, k_cache, v_cache, slots, *extra), {}, atol=0, rtol=0,
                      label=f"{dtype} {base.label}")


# The float32 op's examples the variants run too: GQA groupings, mixed prefill chunks and decodes with padding
# (null-block table entries), a long chunk over a cached prefix, decodes split across threads.
_ATTENTION_EXAMPLES = ("mixed 4/4 heads", "mixed 9/3 heads", "SmolLM2 heads, mixed", "long chunk after a cached prefix",
                       "decodes at [700]", "decodes at [64, 200, 129]", "random prefill 8/2 heads",
                       "random decode 6/1 heads")


def _attention_examples(dtype: str) -> Iterator[Example]:
    for i, base in enumerate(e for e in PAGED_ATTENTION.examples() if e.label in _ATTENTION_EXAMPLES):
        rng = np.random.default_rng(200 + i)
        query, k_cache, v_cache, *step = base.inputs
        k_cache, v_cache, params = _in_dtype(rng, dtype, k_cache, v_cache)
        extra = [params[0], params[2], params[3], params[5]] if params else []  # scale, offset of K then V
        yield Example((query, k_cache, v_cache, *step, *extra), base.attrs, atol=base.atol, rtol=base.rtol,
                      label=f"{dtype} {base.label}")


def _pool(name: str, width: str, dtype: str) -> Tensor:
    return Tensor(name, ("num_slots", width), (dtype,))


def _params(fmt: CacheFormat, names: tuple[str, ...], width: str) -> tuple[Tensor, ...]:
    """int8's per-channel inputs (float32 scales, int32 offsets); none for the other dtypes."""
    if not fmt.quantized:
        return ()
    return tuple(Tensor(name, (width,), ("int32",) if name.endswith("offset") else ("float32",)) for name in names)


def reshape_and_cache_variant(dtype: KVCacheDType) -> Op:
    fmt = cache_format(dtype)
    params = _params(fmt, QUANT_INPUTS, "W")
    base = RESHAPE_AND_CACHE
    return Op(
        name=base.name, variant=dtype,
        atb=f"ReshapeAndCacheOperation ({dtype} cache" + (", K/V quantized per channel before the write)"
                                                          if fmt.quantized else ")"),
        inputs=(*base.inputs[:2], _pool("k_cache", "W", dtype), _pool("v_cache", "W", dtype), base.inputs[4], *params),
        outputs=(_pool("k_cache_out", "W", dtype), _pool("v_cache_out", "W", dtype)),
        reference=reshape_and_cache_typed, examples=lambda: _write_examples(dtype), writes=base.writes,
        doc=f"{base.doc}; rows converted to {dtype} first" + (" (clamp(round(x * inv_scale + offset)))"
                                                               if fmt.quantized else ""))


def paged_attention_variant(dtype: KVCacheDType) -> Op:
    fmt = cache_format(dtype)
    width = "kv_head_num * head_dim"
    params = _params(fmt, DEQUANT_INPUTS, width)
    base = PAGED_ATTENTION
    return Op(
        name=base.name, variant=dtype,
        atb=f"PagedAttentionOperation ({dtype} cache" + (", quantType: kDescale/kOffset, vDescale/vOffset)"
                                                         if fmt.quantized else ")"),
        inputs=(base.inputs[0], _pool("k_cache", width, dtype), _pool("v_cache", width, dtype), *base.inputs[3:],
                *params),
        outputs=base.outputs, attributes=base.attributes, reference=paged_attention_typed,
        examples=lambda: _attention_examples(dtype),
        doc=f"{base.doc}; the {dtype} cache read back as float32 inside the op" + (
            " ((q - offset) * scale per channel)" if fmt.quantized else ""))


RESHAPE_AND_CACHE_BF16, RESHAPE_AND_CACHE_F16, RESHAPE_AND_CACHE_INT8 = (
    reshape_and_cache_variant(d) for d in ("bfloat16", "float16", "int8"))
PAGED_ATTENTION_BF16, PAGED_ATTENTION_F16, PAGED_ATTENTION_INT8 = (
    paged_attention_variant(d) for d in ("bfloat16", "float16", "int8"))
# Cache dtype -> (its ReshapeAndCache, its PagedAttention): what a model definition emits for its pools.
KV_CACHE_OPS: dict[str, tuple[Op, Op]] = {
    "float32": (RESHAPE_AND_CACHE, PAGED_ATTENTION),
    "bfloat16": (RESHAPE_AND_CACHE_BF16, PAGED_ATTENTION_BF16),
    "float16": (RESHAPE_AND_CACHE_F16, PAGED_ATTENTION_F16),
    "int8": (RESHAPE_AND_CACHE_INT8, PAGED_ATTENTION_INT8),
}
