"""The op set on Ascend: MindSpore's own primitives, which run ATB/internal kernels there.

Nothing here can run on a CPU host ("Unsupported op [PagedAttention] on CPU"): these graphs are
exported here, read back and checked, and run on Ascend. Float16 throughout (ATB's
PagedAttention has no float32 kernel); logits are cast back to float32. Pools are graph inputs in
ATB's layout [num_blocks, block_size, kv_heads, head_dim], so the write lands in the caller's
memory with no Reshape in between. Method bodies are MindSpore graph code.
"""
from __future__ import annotations

import numpy as np
from mindspore import Tensor, ops
from mindspore import dtype as mstype
from mindspore.ops import auto_generate as prims

from exporter.mindspore.common_ops import CommonOps

# FlashAttentionScore's causal sparse modes read a compressed 2048x2048 mask (ones above the diagonal).
_CAUSAL_MASK_SIZE = 2048
_MASKED = -10000.0


class AscendOps(CommonOps):
    """`multi_query`: the prefill family, whose sequences feed several query tokens (q_seq_lens + mask)."""

    def __init__(self, multi_query: bool) -> None:
        super().__init__()
        self.multi_query = multi_query
        self.cache_write = prims.ReshapeAndCache()
        self.swiglu_op = prims.Swiglu()
        self.rope_op = prims.RotaryPositionEmbedding()
        self.paged = None
        self.packed = None

    def prepare_attention(self, head_num: int, kv_head_num: int, qk_scale: float, block_size: int) -> None:
        """Called while recording: the primitives carry ATB's attributes (headNum, qkScale, kvHeadNum)."""
        self.head_num, self.kv_head_num, self.block_size = head_num, kv_head_num, block_size
        self.paged = prims.PagedAttention(head_num, qk_scale, kv_head_num)
        self.packed = prims.FlashAttentionScore(head_num, scale_value=qk_scale, input_layout="TND", sparse_mode=3)
        self.causal = Tensor(np.triu(np.ones((_CAUSAL_MASK_SIZE, _CAUSAL_MASK_SIZE), np.uint8), 1))

    def rms_norm(self, x, weight, epsilon):
        return prims.RmsNorm(epsilon)(x, weight)[0]

    def rope(self, query, key, cos, sin, head_dim):
        return self._rotate(query, cos, sin, head_dim), self._rotate(key, cos, sin, head_dim)

    def _rotate(self, x, cos, sin, head_dim):
        tokens = x.shape[0]
        heads = ops.reshape(x, (1, tokens, -1, head_dim))  # BSND
        angles = (1, tokens, 1, head_dim)
        out = self.rope_op(heads, ops.reshape(cos, angles), ops.reshape(sin, angles), 0)  # mode 0: rotate-half
        return ops.reshape(out, (tokens, -1))

    def swiglu(self, x):
        return self.swiglu_op(x, -1)

    def reshape_and_cache(self, key, value, k_cache, v_cache, slot_mapping):
        token = self.cache_write(key, value, k_cache, v_cache, ops.cast(slot_mapping, mstype.int32))
        return ops.depend(k_cache, token), ops.depend(v_cache, token)

    def paged_attention(self, query, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q):
        tokens = query.shape[0]
        heads = ops.reshape(query, (tokens, self.head_num, -1))
        if self.multi_query:
            q_seq_lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
            mask = self._causal_rows(cu_seqlens_q, context_lens, tokens, block_tables.shape[1] * self.block_size)
            out = self.paged(heads, k_cache, v_cache, block_tables, context_lens, None, None, mask, q_seq_lens)
        else:
            out = self.paged(heads, k_cache, v_cache, block_tables, context_lens)
        return ops.reshape(out, (tokens, -1))

    def _causal_rows(self, cu_seqlens_q, context_lens, tokens, keys):
        """[T, keys] additive mask: packed row r (position p in its sequence) sees keys 0..p."""
        rows = ops.arange(0, tokens, dtype=mstype.int32)
        ends = cu_seqlens_q[1:]
        seq = ops.reduce_sum(ops.cast(ops.expand_dims(rows, 1) >= ops.expand_dims(ends, 0), mstype.int32), 1)
        seq = ops.minimum(seq, ends.shape[0] - 1)
        position = ops.gather(context_lens, seq, 0) - ops.gather(ends, seq, 0) + rows
        hidden = ops.expand_dims(ops.arange(0, keys, dtype=mstype.int32), 0) > ops.expand_dims(position, 1)
        return ops.cast(hidden, mstype.float16) * _MASKED

    def self_attention(self, query, key, value, cu_seqlens_q):
        tokens = query.shape[0]
        ends = ops.cast(cu_seqlens_q[1:], mstype.int64)
        out = self.packed(ops.reshape(query, (tokens, self.head_num, -1)),
                          ops.reshape(key, (tokens, self.kv_head_num, -1)),
                          ops.reshape(value, (tokens, self.kv_head_num, -1)),
                          None, None, None, self.causal, None, ends, ends)[3]
        return ops.reshape(out, (tokens, -1))

    def logits(self, x):
        return ops.cast(x, mstype.float32)
