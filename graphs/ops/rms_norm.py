"""RmsNorm over the last axis, and its per-head form (Qwen3's q/k norms)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np

from .examples import normal
from .op import Attributes, Example, Op, Tensor


@dataclass(frozen=True)
class RmsNormAttributes(Attributes):
    epsilon: float


@dataclass(frozen=True)
class RmsNormHeadsAttributes(Attributes):
    epsilon: float
    head_dim: int


def rms_norm(x: np.ndarray, weight: np.ndarray, epsilon: float) -> np.ndarray:
    """ATB RmsNormOperation: x / sqrt(mean(x^2) + eps) * weight over the last axis."""
    variance = np.mean(np.square(x), axis=-1, keepdims=True)
    return (x / np.sqrt(variance + np.float32(epsilon)) * weight).astype(np.float32)


def rms_norm_heads(x: np.ndarray, weight: np.ndarray, epsilon: float, head_dim: int) -> np.ndarray:
    """RmsNorm of each head of x [T, heads * head_dim] with one weight [head_dim] for all heads: ATB's
    RmsNormOperation over x viewed as [T * heads, head_dim], as MindIE runs Qwen3's q_norm and k_norm."""
    return rms_norm(x.reshape(-1, head_dim), weight, epsilon).reshape(x.shape)


def _examples() -> Iterator[Example]:
    rng = np.random.default_rng(0)
    for tokens, width in ((7, 48), (300, 576)):
        yield Example((normal(rng, tokens, width), normal(rng, width)), dict(epsilon=1e-5),
                      label=f"[{tokens}, {width}]")


def _head_examples() -> Iterator[Example]:
    """A tiny head, and Qwen3's head_dim 128 over 16 query heads."""
    rng = np.random.default_rng(1)
    for tokens, heads, head_dim in ((5, 4, 16), (70, 16, 128)):
        yield Example((normal(rng, tokens, heads * head_dim), 1 + 0.1 * normal(rng, head_dim)),
                      dict(epsilon=1e-6, head_dim=head_dim), label=f"{tokens} tokens, {heads} x {head_dim}")


RMS_NORM = Op(
    name="RmsNorm",
    atb="RmsNormOperation",
    inputs=(Tensor("x", ("T", "W")), Tensor("weight", ("W",))),
    outputs=(Tensor("y", ("T", "W")),),
    attributes=RmsNormAttributes,
    reference=rms_norm,
    examples=_examples,
)

RMS_NORM_HEADS = Op(
    name="RmsNormHeads",  # an op of its own, not a variant: both run in one graph (ONNX functions by name)
    atb="RmsNormOperation",
    inputs=(Tensor("x", ("T", "W")), Tensor("weight", ("head_dim",))),
    outputs=(Tensor("y", ("T", "W")),),
    attributes=RmsNormHeadsAttributes,
    reference=rms_norm_heads,
    examples=_head_examples,
    doc="per-head RMSNorm (Qwen3's q_norm / k_norm): one [head_dim] weight for every head of x",
)
