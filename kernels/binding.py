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

from graphs import ops
from graphs.ops.op import Attributes, Lowering
from kernels.build import library_path


class KernelError(RuntimeError):
    """A kernel rejected its inputs (bad slot, block id, lengths); the message names the culprit."""


class _Dims(ctypes.Structure):
    _fields_ = [("head_num", ctypes.c_int64), ("kv_head_num", ctypes.c_int64), ("head_dim", ctypes.c_int64),
                ("qk_scale", ctypes.c_float)]


@lru_cache(maxsize=1)
def _library() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(library_path()))
    lib.pg_last_error.restype = ctypes.c_char_p
    return lib


def _ptr(array: np.ndarray, dtype: type) -> ctypes.c_void_p:
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
                      slot_mapping: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    f = np.float32
    _check(_library().pg_reshape_and_cache(
        _ptr(key, f), _ptr(value, f), _ptr(k_cache, f), _ptr(v_cache, f), _ptr(slot_mapping, np.int64),
        ctypes.c_int64(key.shape[0]), ctypes.c_int64(key.shape[1]), ctypes.c_int64(k_cache.shape[0]), None))
    return k_cache, v_cache


def paged_attention(query: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, block_tables: np.ndarray,
                    context_lens: np.ndarray, cu_seqlens_q: np.ndarray, *, head_num: int, kv_head_num: int,
                    head_dim: int, qk_scale: float, block_size: int) -> np.ndarray:
    f, i32 = np.float32, np.int32
    out = np.empty_like(query)
    _check(_library().pg_paged_attention(
        _ptr(query, f), _ptr(k_cache, f), _ptr(v_cache, f), _ptr(block_tables, i32), _ptr(context_lens, i32),
        _ptr(cu_seqlens_q, i32), _ptr(out, f), ctypes.c_int64(query.shape[0]), ctypes.c_int64(block_tables.shape[0]),
        ctypes.c_int64(block_tables.shape[1]), ctypes.c_int64(k_cache.shape[0]),
        _dims(query, head_num, kv_head_num, head_dim, qk_scale), ctypes.c_int64(block_size), None))
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


def _rope_query_key(query: np.ndarray, key: np.ndarray, cos: np.ndarray, sin: np.ndarray,
                    head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    return rope(query, cos, sin, head_dim), rope(key, cos, sin, head_dim)


KernelBody = Callable[[Sequence[np.ndarray], Attributes], Any]


def _body(kernel: Callable[..., Any]) -> KernelBody:
    """The kernel called as the op's reference is: inputs in order, the attributes as keywords."""
    return lambda inputs, attrs: kernel(*inputs, **dataclasses.asdict(attrs))


KERNELS: Lowering[KernelBody] = Lowering(
    "kernels", "kernels/*.cc (C API: kernels/kernels.h, ctypes: kernels/binding.py)",
    {ops.RESHAPE_AND_CACHE: _body(reshape_and_cache), ops.PAGED_ATTENTION: _body(paged_attention),
     ops.SELF_ATTENTION: _body(self_attention), ops.ROPE: _body(_rope_query_key), ops.SWIGLU: _body(swiglu)},
    partial=True)


def set_threads(count: int) -> None:
    """Threads of every later kernel call in this process, MindSpore's calls included (same library)."""
    _library().pg_set_threads(ctypes.c_int(count))
