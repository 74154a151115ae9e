"""The MindSpore CPU lowering: standard ops plus pagedgraph's C++ kernels as `ops.Custom(func_type="aot")`.

MindSpore has no CPU kernels for its own PagedAttention/ReshapeAndCache, so the fused ops run
cpu_kernels/ through the AOT interface. Float32; pools are [num_slots, kv_heads*head_dim] graph inputs
written in place. Each body is a Cell built from the op's attributes; construct is graph code,
parsed by GRAPH_MODE, not run by Python. Attributes reach the kernels as constant inputs.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from mindspore import Tensor, ops
from mindspore import dtype as mstype

from . import cpu_moe
from .common_ops import COMMON, Body
from ...graphs import ops as op_set
from ...graphs.ops.op import Lowering


def _kernel(library: Path, name: str, side_effect: bool = False, **attrs: object) -> ops.Custom:
    """An AOT op whose single output has the shape and dtype of its first input (or one float32)."""
    if side_effect:
        op = ops.Custom(f"{library}:{name}", out_shape=lambda *shapes: [1], out_dtype=lambda *types: mstype.float32,
                        func_type="aot")
        # Without it MindSpore drops the in-place pool write silently (measured).
        op.add_prim_attr("side_effect_mem", True)
    else:
        op = ops.Custom(f"{library}:{name}", out_shape=lambda *shapes: shapes[0],
                        out_dtype=lambda *types: types[0], func_type="aot")
    op.add_prim_attr("atb_op", name)
    for key, value in attrs.items():
        op.add_prim_attr(key, value)
    return op


class RmsNorm(Body):
    def __init__(self, attrs: Any, target: Any) -> None:
        super().__init__()
        self.epsilon = attrs.epsilon

    def construct(self, x, weight):
        return self.normalize(x, weight)

    def normalize(self, x, weight):
        variance = ops.mean(ops.square(x), -1, True)
        return x / ops.sqrt(variance + self.epsilon) * weight


class RmsNormHeads(RmsNorm):
    """Each head's RmsNorm: x viewed as [T * heads, head_dim] rows."""

    def __init__(self, attrs: Any, target: Any) -> None:
        super().__init__(attrs, target)
        self.head_dim = attrs.head_dim

    def construct(self, x, weight):
        return ops.reshape(self.normalize(ops.reshape(x, (-1, self.head_dim)), weight), x.shape)


class AddRmsNorm(RmsNorm):
    """The plain Add and RmsNorm: MindSpore's AddRmsNorm kernel is Ascend only."""

    def construct(self, x, residual, gamma):
        total = x + residual
        return self.normalize(total, gamma), total


class Rope(Body):
    def __init__(self, attrs: Any, target: Any) -> None:
        super().__init__()
        self.head_dim = attrs.head_dim

    def construct(self, query, key, cos, sin):
        return self.rotate(query, cos, sin), self.rotate(key, cos, sin)

    def rotate(self, x, cos, sin):
        tokens = x.shape[0]
        heads = ops.reshape(x, (tokens, -1, self.head_dim))
        first, second = ops.split(heads, self.head_dim // 2, -1)
        rotated = ops.concat((-second, first), -1)
        out = heads * ops.expand_dims(cos, 1) + rotated * ops.expand_dims(sin, 1)
        return ops.reshape(out, (tokens, -1))


class SwiGLU(Body):
    def construct(self, x):
        gate, up = ops.split(x, x.shape[-1] // 2, -1)
        return gate * ops.sigmoid(gate) * up


class ReshapeAndCache(Body):
    def __init__(self, attrs: Any, target: Any) -> None:
        super().__init__()
        self.write = _kernel(target.library, "ReshapeAndCache", side_effect=True)

    def construct(self, key, value, k_cache, v_cache, slot_mapping):
        token = self.write(key, value, k_cache, v_cache, slot_mapping)
        return ops.depend(k_cache, token), ops.depend(v_cache, token)


class PagedAttention(Body):
    def __init__(self, attrs: Any, target: Any) -> None:
        super().__init__()
        self.kernel = _kernel(target.library, "PagedAttention", head_num=attrs.head_num,
                              kv_head_num=attrs.kv_head_num, qk_scale=attrs.qk_scale, block_size=attrs.block_size)
        dims = [attrs.head_num, attrs.kv_head_num, attrs.block_size, attrs.head_dim]  # head_dim last: AOT reads it so
        self.dims = Tensor(np.array(dims, np.int64))
        self.scale = Tensor(np.array([attrs.qk_scale], np.float32))

    def construct(self, query, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q):
        return self.kernel(query, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q, self.dims, self.scale)


class SelfAttention(Body):
    def __init__(self, attrs: Any, target: Any) -> None:
        super().__init__()
        self.kernel = _kernel(target.library, "SelfAttention", head_num=attrs.head_num,
                              kv_head_num=attrs.kv_head_num, qk_scale=attrs.qk_scale)
        self.dims = Tensor(np.array([attrs.head_num, attrs.kv_head_num, attrs.head_dim], np.int64))
        self.scale = Tensor(np.array([attrs.qk_scale], np.float32))

    def construct(self, query, key, value, cu_seqlens_q):
        return self.kernel(query, key, value, cu_seqlens_q, self.dims, self.scale)


MINDSPORE_CPU: Lowering[Any] = Lowering(
    "mindspore-cpu", "exporter/mindspore/cpu_ops.py (shared: exporter/mindspore/common_ops.py)",
    {**COMMON, op_set.RMS_NORM: RmsNorm, op_set.RMS_NORM_HEADS: RmsNormHeads, op_set.ADD_RMS_NORM: AddRmsNorm,
     op_set.ROPE: Rope,
     op_set.SWIGLU: SwiGLU, op_set.RESHAPE_AND_CACHE: ReshapeAndCache, op_set.PAGED_ATTENTION: PagedAttention,
     op_set.SELF_ATTENTION: SelfAttention, op_set.MOE_GATING_TOP_K_SOFTMAX: cpu_moe.MoeGatingTopKSoftmax,
     op_set.MOE_INIT_ROUTING: cpu_moe.MoeInitRouting, op_set.GROUPED_MATMUL: cpu_moe.GroupedMatmul,
     op_set.MOE_TOKEN_UNPERMUTE: cpu_moe.MoeTokenUnpermute})
for _op in (op_set.LINEAR_BLOCK_QUANTIZED, op_set.GATHER_BLOCK_QUANTIZED, op_set.BLOCK_MINIMUM,
            op_set.GROUPED_MATMUL_BLOCK_QUANTIZED):
    MINDSPORE_CPU.refuse(_op, "MindSpore CPU has no 4/8-bit weight matmul kernel; quantized artifacts are ONNX only "
                              "(export refuses mindir with a quantization)")
MINDSPORE_CPU.refuse(op_set.LINEAR_W8A8_STATIC, "QuantBatchMatmul runs on Ascend only; the CPU graphs use "
                                                "Linear.w8a8 (ONNX)")
for _op in (op_set.LINEAR_W8A8, op_set.DYNAMIC_QUANT):
    MINDSPORE_CPU.refuse(_op, "MindSpore CPU has no int8 x int8 matmul kernel (QuantBatchMatmul is Ascend only); w8a8 "
                              "artifacts are ONNX only (export refuses mindir with a quantization)")
for _op in (op_set.LINEAR_BF16, op_set.GATHER_BF16, op_set.GROUPED_MATMUL_BF16):
    MINDSPORE_CPU.refuse(_op, "the MindSpore CPU graphs compute float32 (cpu_kernels/mindspore_aot.cc); bfloat16 compute "
                              "on CPU is the ONNX graphs' (oneDNN); export refuses mindir with model.dtype bfloat16")
for _write, _attend in (op_set.KV_CACHE_OPS[d] for d in ("bfloat16", "float16", "int8")):
    for _op in (_write, _attend):
        MINDSPORE_CPU.refuse(_op, "float32 pools only (cpu_kernels/mindspore_aot.cc); the ONNX graphs serve other caches")
MINDSPORE_CPU.refuse(op_set.ALL_REDUCE, "the CPU MINDIR is single-device (export refuses export.tensor_parallel_size "
                                        "> 1 with target cpu); tensor-parallel MINDIR is the Ascend target's (HCCL)")
