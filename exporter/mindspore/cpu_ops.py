"""The op set on MindSpore CPU: standard ops plus pagedgraph's C++ kernels as `ops.Custom(func_type="aot")`.

MindSpore has no CPU kernels for its own PagedAttention/ReshapeAndCache, so the fused ops run
kernels/ through the AOT interface. Method bodies are MindSpore graph code: they are
parsed by GRAPH_MODE, not run by Python.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
from mindspore import Tensor, ops
from mindspore import dtype as mstype

from exporter.mindspore.common_ops import CommonOps


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


class CpuOps(CommonOps):
    """Float32 lowering; pools are [num_slots, kv_heads*head_dim] graph inputs written in place."""

    def __init__(self, library: Path) -> None:
        super().__init__()
        self.library = library
        self.cache_write = _kernel(library, "ReshapeAndCache", side_effect=True)
        self.paged = None
        self.packed = None

    def prepare_attention(self, head_num: int, kv_head_num: int, qk_scale: float, block_size: int) -> None:
        """Called while recording, before the graph runs: attributes become constant kernel inputs."""
        attrs = dict(head_num=head_num, kv_head_num=kv_head_num, qk_scale=qk_scale)
        self.paged = _kernel(self.library, "PagedAttention", block_size=block_size, **attrs)
        self.packed = _kernel(self.library, "SelfAttention", **attrs)
        self.paged_dims = Tensor(np.array([head_num, kv_head_num, block_size], np.int64))
        self.packed_dims = Tensor(np.array([head_num, kv_head_num], np.int64))
        self.scale = Tensor(np.array([qk_scale], np.float32))

    def rms_norm(self, x, weight, epsilon):
        variance = ops.mean(ops.square(x), -1, True)
        return x / ops.sqrt(variance + epsilon) * weight

    def rope(self, query, key, cos, sin, head_dim):
        return self._rotate(query, cos, sin, head_dim), self._rotate(key, cos, sin, head_dim)

    def _rotate(self, x, cos, sin, head_dim):
        tokens = x.shape[0]
        heads = ops.reshape(x, (tokens, -1, head_dim))
        first, second = ops.split(heads, head_dim // 2, -1)
        rotated = ops.concat((-second, first), -1)
        out = heads * ops.expand_dims(cos, 1) + rotated * ops.expand_dims(sin, 1)
        return ops.reshape(out, (tokens, -1))

    def swiglu(self, x):
        gate, up = ops.split(x, x.shape[-1] // 2, -1)
        return gate * ops.sigmoid(gate) * up

    def reshape_and_cache(self, key, value, k_cache, v_cache, slot_mapping):
        token = self.cache_write(key, value, k_cache, v_cache, slot_mapping)
        return ops.depend(k_cache, token), ops.depend(v_cache, token)

    def paged_attention(self, query, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q):
        return self.paged(query, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q, self.paged_dims,
                          self.scale)

    def self_attention(self, query, key, value, cu_seqlens_q):
        return self.packed(query, key, value, cu_seqlens_q, self.packed_dims, self.scale)

    def logits(self, x):
        return x
