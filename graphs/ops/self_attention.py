"""SelfAttention: packed prefill attention over the step's own keys, causal within each sequence."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np

from .attention import attend
from .examples import normal
from .op import Attributes, Example, Op, Tensor


@dataclass(frozen=True)
class SelfAttentionAttributes(Attributes):
    head_num: int
    kv_head_num: int
    head_dim: int
    qk_scale: float


def self_attention(query: np.ndarray, key: np.ndarray, value: np.ndarray, cu_seqlens_q: np.ndarray, *,
                   head_num: int, kv_head_num: int, head_dim: int, qk_scale: float) -> np.ndarray:
    """ATB SelfAttentionOperation (calcType=PA_ENCODER); rows after the last sequence come back as zeros."""
    out = np.zeros_like(query)
    for b in range(len(cu_seqlens_q) - 1):
        lo, hi = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        if hi > lo:
            out[lo:hi] = attend(query[lo:hi], key[lo:hi], value[lo:hi], np.arange(hi - lo), qk_scale,
                                head_num, kv_head_num, head_dim)
    return out


def _examples() -> Iterator[Example]:
    """Sequences of one and of many query tiles, an empty one, padding rows; every head grouping."""
    cases = [((4, 2, 8), [0, 6, 7, 90, 90], 92), ((9, 3, 64), [0, 6, 7, 90, 90, 90], 93)]
    for seed, (heads, kv_heads) in enumerate(((4, 4), (6, 1), (8, 2))):
        rng = np.random.default_rng(100 + seed)
        q_lens = rng.integers(0, 40, size=int(rng.integers(1, 6)))
        cu = np.concatenate([[0], np.cumsum(q_lens)])
        cases.append(((heads, kv_heads, 64 if seed % 2 else 8), cu.tolist(), int(cu[-1]) + 3))
    for (heads, kv_heads, head_dim), cu, tokens in cases:
        rng = np.random.default_rng(tokens)
        inputs = (normal(rng, tokens, heads * head_dim), normal(rng, tokens, kv_heads * head_dim),
                  normal(rng, tokens, kv_heads * head_dim), np.array(cu, np.int32))
        yield Example(inputs, dict(head_num=heads, kv_head_num=kv_heads, head_dim=head_dim, qk_scale=0.35),
                      atol=1e-5, rtol=1e-4, label=f"{len(cu) - 1} sequences, {heads}/{kv_heads} heads")


SELF_ATTENTION = Op(
    name="SelfAttention",
    atb="SelfAttentionOperation (PA_ENCODER)",
    inputs=(Tensor("query", ("T", "head_num * head_dim")),
            Tensor("key", ("T", "kv_head_num * head_dim")),
            Tensor("value", ("T", "kv_head_num * head_dim")),
            Tensor("cu_seqlens_q", ("B_plus_1",), ("int32",))),
    outputs=(Tensor("out", ("T", "head_num * head_dim")),),
    attributes=SelfAttentionAttributes,
    reference=self_attention,
    examples=_examples,
    doc="packed prefill over the step's own keys, causal within each sequence",
)
