"""Rope: rotate-half rotary embedding of query and key with per-token cos/sin rows."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np

from .examples import normal, rope_tables
from .op import Attributes, Example, Op, Tensor


@dataclass(frozen=True)
class RopeAttributes(Attributes):
    head_dim: int


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, head_dim: int) -> np.ndarray:
    """ATB RopeOperation in rotate-half layout: x [T, n*head_dim], cos/sin [T, head_dim] per token."""
    t = x.shape[0]
    heads = x.reshape(t, -1, head_dim)
    half = head_dim // 2
    rotated = np.concatenate([-heads[..., half:], heads[..., :half]], axis=-1)
    out = heads * cos[:, None, :] + rotated * sin[:, None, :]
    return out.reshape(t, -1).astype(np.float32)


def rope_query_key(query: np.ndarray, key: np.ndarray, cos: np.ndarray, sin: np.ndarray,
                   head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    return rope(query, cos, sin, head_dim), rope(key, cos, sin, head_dim)


def _examples() -> Iterator[Example]:
    """A small head, SmolLM2's heads, and enough rows for the kernels' parallel path."""
    for tokens, heads, kv_heads, head_dim in ((7, 4, 2, 16), (37, 9, 3, 64), (700, 9, 3, 64)):
        rng = np.random.default_rng(tokens)
        cos, sin = rope_tables(rng, tokens, head_dim, spread=100.0)
        yield Example((normal(rng, tokens, heads * head_dim), normal(rng, tokens, kv_heads * head_dim), cos, sin),
                      dict(head_dim=head_dim), label=f"{tokens} tokens, head_dim {head_dim}")


ROPE = Op(
    name="Rope",
    atb="RopeOperation",
    inputs=(Tensor("query", ("T", "Q")), Tensor("key", ("T", "K")), Tensor("cos", ("T", "head_dim")),
            Tensor("sin", ("T", "head_dim"))),
    outputs=(Tensor("query_out", ("T", "Q")), Tensor("key_out", ("T", "K"))),
    attributes=RopeAttributes,
    reference=rope_query_key,
    examples=_examples,
)
