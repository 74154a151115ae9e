"""The kernels' C API called from numpy (ctypes), with the signatures of the graphs/ops references.

`KERNELS` registers each as the op's body of the "kernels" lowering, which the ONNX Runtime custom
ops and the MindSpore CPU target both call: the op-by-lowering walk checks them directly.
"""
from __future__ import annotations

import ctypes
import dataclasses
from functools import lru_cache
from typing import Any, Callable, Sequence

import numpy as np

from ..graphs import ops
from ..graphs.kv_cache import KV_CACHE_DTYPES, cache_format
from ..graphs.ops.op import Attributes, Lowering
from .build import library_path


class KernelError(RuntimeError):
    """A kernel rejected its inputs (bad slot, block id, lengths); the message names the culprit."""


class _Cache(ctypes.Structure):
    """kernels.h's pg_kv_cache: the pools' dtype and an int8 cache's per-channel parameters."""

    _fields_ = [("dtype", ctypes.c_int32)] + [(f, ctypes.c_void_p) for f in (
        "k_scale", "k_inv_scale", "v_scale", "v_inv_scale", "k_offset", "v_offset")]


_CACHE_CODES = {cache_format(name).numpy_dtype: code for code, name in enumerate(KV_CACHE_DTYPES)}  # pg_cache_dtype


def _cache(k_cache: np.ndarray, v_cache: np.ndarray, **params: np.ndarray | None) -> _Cache:
    """The pools' pg_kv_cache; int8 pools need their parameters (float32 scales, int32 offsets)."""
    if k_cache.dtype != v_cache.dtype or k_cache.dtype not in _CACHE_CODES or not k_cache.flags.c_contiguous \
            or not v_cache.flags.c_contiguous:
        raise TypeError(f"KV pools must be C-contiguous arrays of one of {', '.join(KV_CACHE_DTYPES)}, got "
                        f"{k_cache.dtype} and {v_cache.dtype}")
    cache = _Cache(_CACHE_CODES[k_cache.dtype])
    if k_cache.dtype == np.int8:
        missing = [name for name, value in params.items() if value is None]
        if missing:
            raise TypeError(f"an int8 KV cache needs its per-channel {', '.join(missing)}")
        for name, value in params.items():
            setattr(cache, name, _ptr(value, np.int32 if name.endswith("offset") else np.float32))
    return cache


class _Dims(ctypes.Structure):
    _fields_ = [("head_num", ctypes.c_int64), ("kv_head_num", ctypes.c_int64), ("head_dim", ctypes.c_int64),
                ("qk_scale", ctypes.c_float)]


@lru_cache(maxsize=1)
def _library() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(library_path()))
    lib.pg_last_error.restype = ctypes.c_char_p
    return lib


def _ptr(array: np.ndarray, dtype: type | np.dtype) -> ctypes.c_void_p:
    if array.dtype != dtype or not array.flags.c_contiguous:
        raise TypeError(f"kernel arguments must be C-contiguous {np.dtype(dtype).name} arrays, got {array.dtype}")
    return ctypes.c_void_p(array.ctypes.data)


def _check(rc: int) -> None:
    if rc:
        raise KernelError(_library().pg_last_error().decode())


def _dims(query: np.ndarray, head_num: int, kv_head_num: int, head_dim: int, qk_scale: float) -> _Dims:
    if query.ndim != 2 or query.shape[1] != head_num * head_dim:
        raise KernelError(f"query has shape {query.shape}, expected [tokens, head_num * head_dim] = "
                          f"[tokens, {head_num} * {head_dim}]")
    return _Dims(head_num, kv_head_num, head_dim, qk_scale)


def reshape_and_cache(key: np.ndarray, value: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                      slot_mapping: np.ndarray, k_inv_scale: np.ndarray | None = None, k_offset: np.ndarray | None = None,
                      v_inv_scale: np.ndarray | None = None, v_offset: np.ndarray | None = None
                      ) -> tuple[np.ndarray, np.ndarray]:
    """Pools of any cache dtype; int8 ones are written quantized with the given parameters."""
    f = np.float32
    cache = _cache(k_cache, v_cache, k_inv_scale=k_inv_scale, k_offset=k_offset, v_inv_scale=v_inv_scale,
                   v_offset=v_offset)
    _check(_library().pg_reshape_and_cache(
        _ptr(key, f), _ptr(value, f), _ptr(k_cache, k_cache.dtype), _ptr(v_cache, v_cache.dtype),
        _ptr(slot_mapping, np.int64), ctypes.c_int64(key.shape[0]), ctypes.c_int64(key.shape[1]),
        ctypes.c_int64(k_cache.shape[0]), cache, None))
    return k_cache, v_cache


def paged_attention(query: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, block_tables: np.ndarray,
                    context_lens: np.ndarray, cu_seqlens_q: np.ndarray, k_scale: np.ndarray | None = None,
                    k_offset: np.ndarray | None = None, v_scale: np.ndarray | None = None,
                    v_offset: np.ndarray | None = None, *, head_num: int, kv_head_num: int, head_dim: int,
                    qk_scale: float, block_size: int) -> np.ndarray:
    """Pools of any cache dtype, read directly; int8 ones dequantized with the given parameters (K's offset
    drops out of the softmax, so the kernel never reads it)."""
    f, i32 = np.float32, np.int32
    out = np.empty_like(query)
    cache = _cache(k_cache, v_cache, k_scale=k_scale, v_scale=v_scale, v_offset=v_offset)
    _check(_library().pg_paged_attention(
        _ptr(query, f), _ptr(k_cache, k_cache.dtype), _ptr(v_cache, v_cache.dtype), _ptr(block_tables, i32),
        _ptr(context_lens, i32),
        _ptr(cu_seqlens_q, i32), _ptr(out, f), ctypes.c_int64(query.shape[0]), ctypes.c_int64(block_tables.shape[0]),
        ctypes.c_int64(block_tables.shape[1]), ctypes.c_int64(k_cache.shape[0]),
        _dims(query, head_num, kv_head_num, head_dim, qk_scale), ctypes.c_int64(block_size), cache, None))
    return out


def self_attention(query: np.ndarray, key: np.ndarray, value: np.ndarray, cu_seqlens_q: np.ndarray, *,
                   head_num: int, kv_head_num: int, head_dim: int, qk_scale: float) -> np.ndarray:
    f = np.float32
    out = np.empty_like(query)
    _check(_library().pg_self_attention(
        _ptr(query, f), _ptr(key, f), _ptr(value, f), _ptr(cu_seqlens_q, np.int32), _ptr(out, f),
        ctypes.c_int64(query.shape[0]), ctypes.c_int64(len(cu_seqlens_q) - 1),
        _dims(query, head_num, kv_head_num, head_dim, qk_scale), None))
    return out


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, head_dim: int) -> np.ndarray:
    f = np.float32
    out = np.empty_like(x)
    _check(_library().pg_rope(_ptr(x, f), _ptr(cos, f), _ptr(sin, f), _ptr(out, f), ctypes.c_int64(x.shape[0]),
                              ctypes.c_int64(x.shape[1] // head_dim), ctypes.c_int64(head_dim), None))
    return out


def swiglu(x: np.ndarray) -> np.ndarray:
    f = np.float32
    out = np.empty((x.shape[0], x.shape[1] // 2), np.float32)
    _check(_library().pg_swiglu(_ptr(x, f), _ptr(out, f), ctypes.c_int64(x.shape[0]), ctypes.c_int64(out.shape[1]),
                                None))
    return out


def block_minimum(y: np.ndarray, x: np.ndarray, minimum_t: np.ndarray, block_size: int) -> np.ndarray:
    """`minimum_t` float16 or float32 (kernels.h's pg_cache_dtype codes name them)."""
    f = np.float32
    out = np.empty_like(y)
    if minimum_t.dtype not in (np.float16, np.float32):
        raise TypeError(f"block_minimum: minimum_t is {minimum_t.dtype}, expected float16 or float32")
    _check(_library().pg_block_minimum(_ptr(y, f), _ptr(x, f), _ptr(minimum_t, minimum_t.dtype),
                                       ctypes.c_int32(_CACHE_CODES[minimum_t.dtype]), _ptr(out, f),
                                       ctypes.c_int64(y.shape[0]), ctypes.c_int64(y.shape[1]),
                                       ctypes.c_int64(x.shape[1]), ctypes.c_int64(block_size), None))
    return out


def dynamic_quant(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    codes = np.empty(x.shape, np.uint8)
    row_scale = np.empty((x.shape[0], 1), np.float32)
    _check(_library().pg_dynamic_quant(_ptr(x, np.float32), _ptr(codes, np.uint8), _ptr(row_scale, np.float32),
                                       ctypes.c_int64(x.shape[0]), ctypes.c_int64(x.shape[1]), None))
    return codes, row_scale


def _rope_query_key(query: np.ndarray, key: np.ndarray, cos: np.ndarray, sin: np.ndarray,
                    head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    return rope(query, cos, sin, head_dim), rope(key, cos, sin, head_dim)


KernelBody = Callable[[Sequence[np.ndarray], Attributes], Any]


def _body(kernel: Callable[..., Any]) -> KernelBody:
    """The kernel called as the op's reference is: inputs in order, the attributes as keywords."""
    return lambda inputs, attrs: kernel(*inputs, **dataclasses.asdict(attrs))


KERNELS: Lowering[KernelBody] = Lowering(
    "kernels", "cpu_kernels/*.cc (C API: cpu_kernels/kernels.h, ctypes: cpu_kernels/binding.py)",
    {**{write: _body(reshape_and_cache) for write, _ in ops.KV_CACHE_OPS.values()},
     **{attend: _body(paged_attention) for _, attend in ops.KV_CACHE_OPS.values()},
     ops.SELF_ATTENTION: _body(self_attention), ops.ROPE: _body(_rope_query_key), ops.SWIGLU: _body(swiglu),
     ops.BLOCK_MINIMUM: _body(block_minimum), ops.DYNAMIC_QUANT: _body(dynamic_quant)},
    partial=True)


def set_threads(count: int) -> None:
    """Threads of every later kernel call in this process, MindSpore's calls included (same library)."""
    _library().pg_set_threads(ctypes.c_int(count))
