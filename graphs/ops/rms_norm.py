"""RmsNorm over the last axis."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np

from .examples import normal
from .op import Attributes, Example, Op, Tensor


@dataclass(frozen=True)
class RmsNormAttributes(Attributes):
    epsilon: float


def rms_norm(x: np.ndarray, weight: np.ndarray, epsilon: float) -> np.ndarray:
    """ATB RmsNormOperation: x / sqrt(mean(x^2) + eps) * weight over the last axis."""
    variance = np.mean(np.square(x), axis=-1, keepdims=True)
    return (x / np.sqrt(variance + np.float32(epsilon)) * weight).astype(np.float32)


def _examples() -> Iterator[Example]:
    rng = np.random.default_rng(0)
    for tokens, width in ((7, 48), (300, 576)):
        yield Example((normal(rng, tokens, width), normal(rng, width)), dict(epsilon=1e-5),
                      label=f"[{tokens}, {width}]")


RMS_NORM = Op(
    name="RmsNorm",
    atb="RmsNormOperation",
    inputs=(Tensor("x", ("T", "W")), Tensor("weight", ("W",))),
    outputs=(Tensor("y", ("T", "W")),),
    attributes=RmsNormAttributes,
    reference=rms_norm,
    examples=_examples,
)
