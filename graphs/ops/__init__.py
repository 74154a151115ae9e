"""The op set: ATB names, contracts and numpy references.

Every lowering implements exactly these ops; the numpy references are the ground truth
the lowerings are tested against. Bump OP_SET_VERSION when a contract changes: artifacts
record it and the runtime refuses a mismatch.
"""
from graphs.ops.attention import paged_attention, self_attention
from graphs.ops.cache import reshape_and_cache
from graphs.ops.elementwise import rms_norm, rope, swiglu
from graphs.ops.linear import linear

OP_SET_VERSION = 1
FUSED_OPS = ("ReshapeAndCache", "PagedAttention", "SelfAttention", "RmsNorm", "Rope", "SwiGLU")

__all__ = [
    "OP_SET_VERSION",
    "FUSED_OPS",
    "linear",
    "paged_attention",
    "reshape_and_cache",
    "rms_norm",
    "rope",
    "self_attention",
    "swiglu",
]
