"""AddRmsNorm: the residual Add fused with the RmsNorm that reads its sum (ATB's and MindIE's AddRmsNorm).

Each decoder layer adds a block's output to the residual stream and normalizes the sum; as one op that is one
kernel instead of two, which is what a B = 1 decode step pays for (docs/performance.md, "Precision").
"""
from __future__ import annotations

from typing import Iterator

import numpy as np

from .examples import normal
from .op import Example, Op, Tensor
from .rms_norm import RmsNormAttributes, rms_norm


def add_rms_norm(x: np.ndarray, residual: np.ndarray, gamma: np.ndarray,
                 epsilon: float) -> tuple[np.ndarray, np.ndarray]:
    """ATB AddRmsNormOperation: sum = x + residual, y = RmsNorm(sum) * gamma; both returned (the sum is the next
    residual)."""
    total = x + residual
    return rms_norm(total, gamma, epsilon), total


def _examples() -> Iterator[Example]:
    """A residual stream much larger than the block output added to it (as in a deep model), and a prefill size."""
    rng = np.random.default_rng(0)
    for tokens, width, scale in ((1, 48, 1.0), (7, 576, 20.0), (300, 576, 4.0)):
        yield Example((normal(rng, tokens, width), normal(rng, tokens, width, scale=scale), normal(rng, width)),
                      dict(epsilon=1e-5), label=f"[{tokens}, {width}]")


ADD_RMS_NORM = Op(
    name="AddRmsNorm",
    atb="AddRmsNormOperation",
    inputs=(Tensor("x", ("T", "W")), Tensor("residual", ("T", "W")), Tensor("gamma", ("W",))),
    outputs=(Tensor("y", ("T", "W")), Tensor("sum", ("T", "W"))),
    attributes=RmsNormAttributes,
    reference=add_rms_norm,
    examples=_examples,
)
