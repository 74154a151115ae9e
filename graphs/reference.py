"""Evaluates a model definition eagerly with the numpy op references (the lowerings' oracle)."""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from graphs import ops
from graphs.builder import OpBuilder


class NumpyBuilder(OpBuilder[np.ndarray]):
    """Runs each op as it is emitted; pools are updated in place like the real executors."""

    def __init__(self, inputs: Mapping[str, np.ndarray], weights: Mapping[str, np.ndarray]) -> None:
        self.inputs = inputs
        self.weights = weights
        self.outputs: dict[str, np.ndarray] = {}

    def input(self, name: str) -> np.ndarray:
        return self.inputs[name]

    def weight(self, name: str) -> np.ndarray:
        return self.weights[name]

    def output(self, name: str, value: np.ndarray) -> None:
        self.outputs[name] = value

    def gather(self, table: np.ndarray, indices: np.ndarray) -> np.ndarray:
        return table[indices]

    def add(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return a + b

    def split(self, x: np.ndarray, sizes: Sequence[int]) -> list[np.ndarray]:
        return np.split(x, np.cumsum(sizes)[:-1], axis=-1)

    def linear(self, x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
        return ops.linear(x, weight, bias)

    def rms_norm(self, x: np.ndarray, weight: np.ndarray, epsilon: float) -> np.ndarray:
        return ops.rms_norm(x, weight, epsilon)

    def rope(self, query: np.ndarray, key: np.ndarray, cos: np.ndarray, sin: np.ndarray,
             head_dim: int) -> tuple[np.ndarray, np.ndarray]:
        return ops.rope(query, cos, sin, head_dim), ops.rope(key, cos, sin, head_dim)

    def swiglu(self, x: np.ndarray) -> np.ndarray:
        return ops.swiglu(x)

    def reshape_and_cache(self, key: np.ndarray, value: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                          slot_mapping: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return ops.reshape_and_cache(key, value, k_cache, v_cache, slot_mapping)

    def paged_attention(self, query: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, block_tables: np.ndarray,
                        context_lens: np.ndarray, cu_seqlens_q: np.ndarray | None, **attrs: Any) -> np.ndarray:
        return ops.paged_attention(query, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q, **attrs)

    def self_attention(self, query: np.ndarray, key: np.ndarray, value: np.ndarray, cu_seqlens_q: np.ndarray,
                       **attrs: Any) -> np.ndarray:
        return ops.self_attention(query, key, value, cu_seqlens_q, **attrs)
