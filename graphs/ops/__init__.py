"""The op set: each op declared once (ATB name, attributes, inputs/outputs, numpy reference).

Every lowering registers one body per op (graphs/ops/op.py: `Lowering`); the numpy references
are the ground truth the lowerings are tested against (tests/graphs/test_op_walk.py). Bump
OP_SET_VERSION when a contract changes: artifacts record it and the runtime refuses a mismatch.
"""
from .add import ADD, add
from .add_rms_norm import ADD_RMS_NORM, add_rms_norm
from .block_minimum import BLOCK_MINIMUM
from .collectives import ALL_REDUCE, all_reduce
from .gather import GATHER, gather
from .grouped_matmul import GROUPED_MATMUL, GROUPED_MATMUL_BF16, GROUPED_MATMUL_BLOCK_QUANTIZED
from .kv_cache_variants import (KV_CACHE_OPS, PAGED_ATTENTION_BF16, PAGED_ATTENTION_F16, PAGED_ATTENTION_INT8,
                                          RESHAPE_AND_CACHE_BF16, RESHAPE_AND_CACHE_F16, RESHAPE_AND_CACHE_INT8)
from .linear import LINEAR, linear
from .linear_bf16 import GATHER_BF16, LINEAR_BF16
from .linear_block_quantized import GATHER_BLOCK_QUANTIZED, LINEAR_BLOCK_QUANTIZED
from .linear_w8a8 import DYNAMIC_QUANT, LINEAR_W8A8
from .linear_w8a8_static import LINEAR_W8A8_STATIC
from .moe_routing import MOE_GATING_TOP_K_SOFTMAX, MOE_INIT_ROUTING, MOE_TOKEN_UNPERMUTE
from .op import Op
from .paged_attention import PAGED_ATTENTION, paged_attention
from .reshape_and_cache import RESHAPE_AND_CACHE, reshape_and_cache
from .rms_norm import RMS_NORM, RMS_NORM_HEADS, rms_norm, rms_norm_heads
from .rope import ROPE, rope
from .segment_sum import SEGMENT_SUM, segment_sum
from .self_attention import SELF_ATTENTION, self_attention
from .split import SPLIT, split
from .swiglu import SWIGLU, swiglu

OP_SET_VERSION = 1
# The ONNX domain of the op set's nodes and functions (ATB's name for it); cpu_kernels/ort_ops.cc registers its custom
# ops under the same string.
OP_SET_DOMAIN = "atb"
# Every op and op variant, in the order docs/design.md lists them; a new one is added here.
OPS: tuple[Op, ...] = (GATHER, GATHER_BLOCK_QUANTIZED, GATHER_BF16, ADD, SPLIT, LINEAR, LINEAR_BLOCK_QUANTIZED,
                       LINEAR_W8A8, DYNAMIC_QUANT, LINEAR_W8A8_STATIC, LINEAR_BF16, BLOCK_MINIMUM, RMS_NORM,
                       RMS_NORM_HEADS, ADD_RMS_NORM, ROPE, SWIGLU,
                       RESHAPE_AND_CACHE, RESHAPE_AND_CACHE_BF16, RESHAPE_AND_CACHE_F16, RESHAPE_AND_CACHE_INT8,
                       PAGED_ATTENTION, PAGED_ATTENTION_BF16, PAGED_ATTENTION_F16, PAGED_ATTENTION_INT8, SELF_ATTENTION,
                       ALL_REDUCE, SEGMENT_SUM, MOE_GATING_TOP_K_SOFTMAX, MOE_INIT_ROUTING, GROUPED_MATMUL,
                       GROUPED_MATMUL_BF16, GROUPED_MATMUL_BLOCK_QUANTIZED, MOE_TOKEN_UNPERMUTE)

__all__ = [
    "ADD", "ADD_RMS_NORM", "ALL_REDUCE", "BLOCK_MINIMUM", "DYNAMIC_QUANT", "GATHER", "GATHER_BF16",
    "GATHER_BLOCK_QUANTIZED", "GROUPED_MATMUL", "GROUPED_MATMUL_BF16", "GROUPED_MATMUL_BLOCK_QUANTIZED",
    "KV_CACHE_OPS", "LINEAR", "LINEAR_BF16", "LINEAR_BLOCK_QUANTIZED", "LINEAR_W8A8", "LINEAR_W8A8_STATIC",
    "MOE_GATING_TOP_K_SOFTMAX", "MOE_INIT_ROUTING", "MOE_TOKEN_UNPERMUTE", "OPS", "OP_SET_DOMAIN", "OP_SET_VERSION",
    "PAGED_ATTENTION", "PAGED_ATTENTION_BF16",
    "PAGED_ATTENTION_F16", "PAGED_ATTENTION_INT8", "RESHAPE_AND_CACHE", "RESHAPE_AND_CACHE_BF16",
    "RESHAPE_AND_CACHE_F16", "RESHAPE_AND_CACHE_INT8", "RMS_NORM", "RMS_NORM_HEADS", "ROPE", "SEGMENT_SUM",
    "SELF_ATTENTION", "SPLIT", "SWIGLU",
    "Op", "add", "add_rms_norm", "all_reduce", "gather", "linear", "paged_attention", "reshape_and_cache",
    "rms_norm", "rms_norm_heads", "rope", "segment_sum", "self_attention", "split", "swiglu",
]
