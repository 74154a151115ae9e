"""The MindSpore Ascend lowering: MindSpore's own primitives, which run ATB/internal kernels there.

Nothing here can run on a CPU host ("Unsupported op [PagedAttention] on CPU"): these graphs are
exported here, read back and checked, and run on Ascend. Float16 or bfloat16 throughout (`target.dtype`:
ATB's PagedAttention has no float32 kernel); logits are cast back to float32. Pools are graph inputs in
ATB's layout [num_blocks, block_size, kv_heads, head_dim], so the write lands in the caller's
memory with no Reshape in between. Each body is a Cell built from the op's attributes (the
primitives carry ATB's headNum, qkScale, kvHeadNum); construct is graph code.
"""
from __future__ import annotations

from typing import Any

import numpy as np
from mindspore import Tensor, ops
from mindspore import dtype as mstype
from mindspore.ops import auto_generate as prims

from . import ascend_moe
from .common_ops import COMMON, Body, antiquant_offset
from ...artifact.mindir import numpy_dtype
from ...graphs.ops.linear_w8a8_static import mindie_tensors
from ...graphs.quant import Int8PerChannel, from_graph
from ...graphs import ops as op_set
from ...graphs.ops.op import Lowering

# FlashAttentionScore's causal sparse modes read a compressed 2048x2048 mask (ones above the diagonal).
_CAUSAL_MASK_SIZE = 2048
_MASKED = -10000.0


class RmsNorm(Body):
    def __init__(self, attrs: Any, target: Any) -> None:
        super().__init__()
        self.norm = prims.RmsNorm(attrs.epsilon)

    def construct(self, x, weight):
        return self.norm(x, weight)[0]


class RmsNormHeads(RmsNorm):
    """ATB's RmsNorm over x viewed as [T * heads, head_dim] rows, as MindIE runs Qwen3's q_norm and k_norm."""

    def __init__(self, attrs: Any, target: Any) -> None:
        super().__init__(attrs, target)
        self.head_dim = attrs.head_dim

    def construct(self, x, weight):
        return ops.reshape(self.norm(ops.reshape(x, (-1, self.head_dim)), weight)[0], x.shape)


class AddRmsNorm(Body):
    """ATB's AddRmsNorm (MindSpore's `ops.add_rms_norm`): outputs (y, rstd, x1 + x2); rstd is dropped."""

    def __init__(self, attrs: Any, target: Any) -> None:
        super().__init__()
        self.epsilon = attrs.epsilon
        self.norm = prims.AddRmsNorm()

    def construct(self, x, residual, gamma):
        y, _, total = self.norm(x, residual, gamma, self.epsilon)
        return y, total


class Rope(Body):
    def __init__(self, attrs: Any, target: Any) -> None:
        super().__init__()
        self.head_dim = attrs.head_dim
        self.rope = prims.RotaryPositionEmbedding()

    def construct(self, query, key, cos, sin):
        return self.rotate(query, cos, sin), self.rotate(key, cos, sin)

    def rotate(self, x, cos, sin):
        tokens = x.shape[0]
        heads = ops.reshape(x, (1, tokens, -1, self.head_dim))  # BSND
        angles = (1, tokens, 1, self.head_dim)
        out = self.rope(heads, ops.reshape(cos, angles), ops.reshape(sin, angles), 0)  # mode 0: rotate-half
        return ops.reshape(out, (tokens, -1))


class SwiGLU(Body):
    def __init__(self, attrs: Any, target: Any) -> None:
        super().__init__()
        self.swiglu = prims.Swiglu()

    def construct(self, x):
        return self.swiglu(x, -1)


class ReshapeAndCache(Body):
    def __init__(self, attrs: Any, target: Any) -> None:
        super().__init__()
        self.write = prims.ReshapeAndCache()

    def construct(self, key, value, k_cache, v_cache, slot_mapping):
        return self.store(key, value, k_cache, v_cache, slot_mapping)

    def store(self, key, value, k_cache, v_cache, slot_mapping):
        token = self.write(key, value, k_cache, v_cache, ops.cast(slot_mapping, mstype.int32))
        return ops.depend(k_cache, token), ops.depend(v_cache, token)


class ReshapeAndCacheInt8(ReshapeAndCache):
    """ATB's int8 cache write (MindIE's C8): K and V quantized per channel by QuantV2, round(x * inv_scale +
    offset) saturated to int8 with inv_scale and offset in the compute dtype, then the same ReshapeAndCache
    writes the int8 rows into int8 pools."""

    def __init__(self, attrs: Any, target: Any) -> None:
        super().__init__(attrs, target)
        self.quant = prims.QuantV2()

    def construct(self, key, value, k_cache, v_cache, slot_mapping, k_inv_scale, k_offset, v_inv_scale, v_offset):
        key = self.quant(key, k_inv_scale, k_offset, False, "ROUND", mstype.int8)
        value = self.quant(value, v_inv_scale, v_offset, False, "ROUND", mstype.int8)
        return self.store(key, value, k_cache, v_cache, slot_mapping)


class PagedAttention(Body):
    """`target.multi_query`: the prefill family, whose sequences feed several queries (q_seq_lens + mask)."""

    def __init__(self, attrs: Any, target: Any) -> None:
        super().__init__()
        self.multi_query = target.multi_query
        self.head_num, self.head_dim, self.block_size = attrs.head_num, attrs.head_dim, attrs.block_size
        self.mask_dtype = _ms_dtype(target.dtype)
        self.paged = prims.PagedAttention(attrs.head_num, attrs.qk_scale, attrs.kv_head_num)

    def construct(self, query, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q):
        return self.attend(query, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q, None, None)

    def attend(self, query, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q, antiquant_scale,
               antiquant_offset):
        tokens = query.shape[0]
        heads = ops.reshape(query, (tokens, self.head_num, self.head_dim))
        if self.multi_query:
            q_seq_lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
            mask = self.causal_rows(cu_seqlens_q, context_lens, tokens, block_tables.shape[1] * self.block_size)
            out = self.paged(heads, k_cache, v_cache, block_tables, context_lens, antiquant_scale, antiquant_offset,
                             mask, q_seq_lens)
        else:
            out = self.paged(heads, k_cache, v_cache, block_tables, context_lens, antiquant_scale, antiquant_offset)
        return ops.reshape(out, (tokens, -1))

    def causal_rows(self, cu_seqlens_q, context_lens, tokens, keys):
        """[T, keys] additive mask: packed row r (position p in its sequence) sees keys 0..p."""
        rows = ops.arange(0, tokens, dtype=mstype.int32)
        ends = cu_seqlens_q[1:]
        seq = ops.reduce_sum(ops.cast(ops.expand_dims(rows, 1) >= ops.expand_dims(ends, 0), mstype.int32), 1)
        seq = ops.minimum(seq, ends.shape[0] - 1)
        position = ops.gather(context_lens, seq, 0) - ops.gather(ends, seq, 0) + rows
        hidden = ops.expand_dims(ops.arange(0, keys, dtype=mstype.int32), 0) > ops.expand_dims(position, 1)
        return ops.cast(hidden, self.mask_dtype) * _MASKED


class PagedAttentionInt8(PagedAttention):
    """ATB's int8 cache read (MindIE's C8): PagedAttention with kv_cache_quant_mode DEFAULT (per channel over
    kv_heads * head_dim) dequantizes in the kernel as antiquant does, scale * (q + antiquant_offset): so
    antiquant_offset is minus the contract's offset, and K's and V's rows are stacked into ATB's [2, W] inputs.
    MindSpore's infer takes (float16, float16) or (float32, int32) scale/offset pairs: float16 models take the
    first, bfloat16 ones the second (see int8_cache_parameters)."""

    def __init__(self, attrs: Any, target: Any) -> None:
        super().__init__(attrs, target)
        self.offset_dtype = mstype.float16 if target.dtype == "float16" else mstype.int32
        self.paged = prims.PagedAttention(attrs.head_num, attrs.qk_scale, attrs.kv_head_num, "DEFAULT")

    def construct(self, query, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q, k_scale, k_offset,
                  v_scale, v_offset):
        scale = ops.stack((k_scale, v_scale))
        offset = ops.cast(ops.stack((-k_offset, -v_offset)), self.offset_dtype)
        return self.attend(query, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q, scale, offset)


def int8_cache_parameters(params: dict[str, np.ndarray], dtype: str) -> dict[str, np.ndarray]:
    """The calibrated int8 KV-cache parameters (graphs/kv_cache.py, float32 scales and int32 offsets) in the
    dtypes the Ascend bodies take: QuantV2's inv_scale and offset in the compute dtype (float16's inv_scale
    saturated at its largest finite value), PagedAttention's scale in float16 (float16 models) or float32."""
    compute = numpy_dtype(dtype)
    out = {}
    for name, value in params.items():
        if name.endswith("_inv_scale"):
            limit = float(np.finfo(np.float16).max) if dtype == "float16" else np.inf
            out[name] = np.minimum(value, limit).astype(compute)
        elif name.endswith("_offset"):
            out[name] = value.astype(compute)
        else:
            out[name] = value.astype(np.float16 if dtype == "float16" else np.float32)
    return out


def _ms_dtype(name: str) -> Any:
    return {"float16": mstype.float16, "bfloat16": mstype.bfloat16}[name]


class SelfAttention(Body):
    """FlashAttentionScore in TND layout with the sequences' host lengths, as ATB's SelfAttention reads them."""

    def __init__(self, attrs: Any, target: Any) -> None:
        super().__init__()
        self.head_num, self.kv_head_num, self.head_dim = attrs.head_num, attrs.kv_head_num, attrs.head_dim
        self.packed = prims.FlashAttentionScore(attrs.head_num, scale_value=attrs.qk_scale, input_layout="TND",
                                                sparse_mode=3)
        self.causal = Tensor(np.triu(np.ones((_CAUSAL_MASK_SIZE, _CAUSAL_MASK_SIZE), np.uint8), 1))

    def construct(self, query, key, value, cu_seqlens_q):
        tokens = query.shape[0]
        ends = ops.cast(cu_seqlens_q[1:], mstype.int64)
        out = self.packed(ops.reshape(query, (tokens, self.head_num, self.head_dim)),
                          ops.reshape(key, (tokens, self.kv_head_num, self.head_dim)),
                          ops.reshape(value, (tokens, self.kv_head_num, self.head_dim)),
                          None, None, None, self.causal, None, ends, ends)[3]
        return ops.reshape(out, (tokens, -1))


class AllReduce(Body):
    """HCCL's sum over the world group: the launcher (msrun, a rank table) gives each process its rank and device;
    `rank_size` is the group's size, which the graph does not need (docs/scale-out.md)."""

    def __init__(self, attrs: Any, target: Any) -> None:
        super().__init__()
        self.all_reduce = ops.AllReduce(ops.ReduceOp.SUM)

    def construct(self, x):
        return self.all_reduce(x)


class Float32Logits(Body):
    """The graph's logits leave in float32 (the contract), computed in float16."""

    def construct(self, x):
        return ops.cast(x, mstype.float32)


class LinearW8A8Static(Body):
    """MindIE's W8A8: x quantized with the calibrated per-tensor scale/offset (Div, Round, Add, Clip, Cast:
    ATB's AscendQuant pattern), then QuantBatchMatmul (int8 x int8 [n, k] transposed, int32 quant_bias,
    per-channel deq_scale) back to the compute dtype."""

    def __init__(self, attrs: Any, target: Any) -> None:
        super().__init__()
        self.matmul = prims.QuantBatchMatmul(transpose_x1=False, transpose_x2=True, dtype=_ms_dtype(target.dtype))

    def construct(self, x, weight, input_scale, input_offset, quant_bias, deq_scale):
        codes = ops.clamp(ops.round(x / input_scale) + input_offset, -128.0, 127.0)
        return self.matmul(ops.cast(codes, mstype.int8), weight, deq_scale, None, quant_bias, None)


class LinearBlockQuantized(Body):
    """W8A16 / W4A16: WeightQuantBatchMatmul on int8 or int4 codes [n, k] (ATB's layout, transpose_weight),
    y = x @ ((codes + antiquant_offset) * antiquant_scale).T per group of `block_size` inputs. The weights
    come as `ascend_block_arrays` writes them; a minimum (GGUF Q4_1's form, stored transposed as minimum_t, the ONNX
    graphs' layout) joins the offset as minimum / scale."""

    def __init__(self, attrs: Any, target: Any) -> None:
        super().__init__()
        # one group spanning the row is per-channel (group size 0); groups are multiples of 32 (ascend_block_arrays)
        self.matmul = prims.WeightQuantBatchMatmul(False, True, 0 if attrs.block_size == attrs.K else attrs.block_size)

    def construct(self, x, codes, scales, zero_points, minimum_t, bias):
        minimum = None if minimum_t is None else ops.transpose(minimum_t, (1, 0))
        return self.matmul(x, codes, scales, antiquant_offset(zero_points, minimum, scales), None, None, bias)


class GatherBlockQuantized(Body):
    """Embedding rows of an int8 table: the rows' codes gathered, then (codes + offset) * scale per block."""

    def __init__(self, attrs: Any, target: Any) -> None:
        super().__init__()
        self.block_size, self.dtype = attrs.block_size, _ms_dtype(target.dtype)

    def construct(self, codes, scales, zero_points, minimum, indices):
        rows = ops.cast(ops.gather(codes, indices, 0), self.dtype)
        tokens, width = rows.shape
        blocks = (tokens, width // self.block_size, self.block_size)
        offset = antiquant_offset(zero_points, minimum, scales)
        if offset is not None:
            rows = ops.reshape(rows, blocks) + ops.expand_dims(ops.gather(offset, indices, 0), -1)
        out = ops.reshape(rows, blocks) * ops.expand_dims(ops.gather(scales, indices, 0), -1)
        return ops.reshape(out, (tokens, width))


def ascend_block_arrays(codes: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None,
                        minimum_t: np.ndarray | None, bits: int, block_size: int, dtype: str) -> list[np.ndarray | None]:
    """A linear's block-quantized graph arrays (MatMulNBits' layout, graphs/quant.py) as the Ascend bodies take
    them: signed codes (code - 2**(bits-1)), int8 [n, k] or int4 packed two a byte [n, k / 2] (MindSpore's
    qint4x2), scales and minimum_t in the compute dtype, and for zero points the offset 2**(bits-1) - zero_point
    on those codes (None where it is 0 everywhere)."""
    if block_size % 32 and scales.shape[1] != 1:
        raise ValueError(f"blocks of {block_size}: WeightQuantBatchMatmul takes groups of a multiple of 32 inputs")
    w = from_graph(codes, scales, zero_points, minimum_t, bits, block_size)
    compute = numpy_dtype(dtype)
    offset = (1 << (bits - 1)) - w.zero_point.astype(np.float32)
    signed = (w.q.astype(np.int16) - (1 << (bits - 1))).astype(np.int8)
    if bits == 4:  # qint4x2: two's-complement nibbles, the even code low (as MindFormers packs, unconfirmed here)
        nibbles = signed.astype(np.uint8) & 0x0F
        signed = (nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)).view(np.int8)
    return [signed, w.scale.astype(compute),
            None if zero_points is None else offset.astype(compute),
            None if minimum_t is None else minimum_t.astype(compute)]


def w8a8_static_arrays(w: Int8PerChannel, input_scale: float, input_offset: int, dtype: str) -> list[np.ndarray]:
    """MindIE's W8A8 tensors of one linear as LinearW8A8Static takes them: int8 weight [n, k], input_scale and
    input_offset [1] in the compute dtype (x's, for the quantization), int32 quant_bias, deq_scale int64
    (float16 models) or float32 (bfloat16)."""
    weight, scale, offset, quant_bias, deq_scale = mindie_tensors(w, None, input_scale, input_offset,
                                                                  dtype == "float16")
    compute = numpy_dtype(dtype)
    return [weight, scale.astype(compute), offset.astype(compute), quant_bias, deq_scale]


MINDSPORE_ASCEND: Lowering[Any] = Lowering(
    "mindspore-ascend", "exporter/mindspore/ascend_ops.py (shared: exporter/mindspore/common_ops.py)",
    {**COMMON, op_set.RMS_NORM: RmsNorm, op_set.RMS_NORM_HEADS: RmsNormHeads, op_set.ADD_RMS_NORM: AddRmsNorm,
     op_set.ROPE: Rope,
     op_set.SWIGLU: SwiGLU, op_set.RESHAPE_AND_CACHE: ReshapeAndCache, op_set.PAGED_ATTENTION: PagedAttention,
     op_set.RESHAPE_AND_CACHE_F16: ReshapeAndCache, op_set.PAGED_ATTENTION_F16: PagedAttention,
     op_set.RESHAPE_AND_CACHE_BF16: ReshapeAndCache, op_set.PAGED_ATTENTION_BF16: PagedAttention,
     op_set.RESHAPE_AND_CACHE_INT8: ReshapeAndCacheInt8, op_set.PAGED_ATTENTION_INT8: PagedAttentionInt8,
     op_set.SELF_ATTENTION: SelfAttention, op_set.LINEAR_W8A8_STATIC: LinearW8A8Static,
     op_set.LINEAR_BLOCK_QUANTIZED: LinearBlockQuantized, op_set.GATHER_BLOCK_QUANTIZED: GatherBlockQuantized,
     op_set.ALL_REDUCE: AllReduce, op_set.MOE_GATING_TOP_K_SOFTMAX: ascend_moe.MoeGatingTopKSoftmax,
     op_set.MOE_INIT_ROUTING: ascend_moe.MoeInitRouting, op_set.GROUPED_MATMUL: ascend_moe.GroupedMatmul,
     op_set.GROUPED_MATMUL_BLOCK_QUANTIZED: ascend_moe.GroupedMatmulBlockQuantized,
     op_set.MOE_TOKEN_UNPERMUTE: ascend_moe.MoeTokenUnpermute})
MINDSPORE_ASCEND.refuse(op_set.BLOCK_MINIMUM, "the Ascend Linear.block_quantized body takes a minimum into "
                                             "WeightQuantBatchMatmul's antiquant offset; BlockMinimum is the ONNX "
                                             "body's exact term")
for _op in (op_set.LINEAR_W8A8, op_set.DYNAMIC_QUANT):
    MINDSPORE_ASCEND.refuse(_op, "per-token dynamic activations are the CPU form; Ascend's W8A8 is "
                                 "Linear.w8a8_static (MindIE's format, QuantBatchMatmul)")
for _op in (op_set.LINEAR_BF16, op_set.GATHER_BF16, op_set.GROUPED_MATMUL_BF16):
    MINDSPORE_ASCEND.refuse(_op, "not needed: the Ascend MINDIR casts its float weights to the compute dtype and "
                                 "runs the float op (MatMul and GroupedMatmul take bfloat16 natively); the "
                                 ".bfloat16 variants are the ONNX CPU form")
