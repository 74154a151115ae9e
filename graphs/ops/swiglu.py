"""SwiGLU: silu(gate) * up of x = [gate | up]."""
from __future__ import annotations

from typing import Iterator

import numpy as np

from .examples import normal
from .op import Example, Op, Tensor


def swiglu(x: np.ndarray) -> np.ndarray:
    """ATB SwiGLU: x = [gate | up] along the last axis; silu(gate) * up."""
    gate, up = np.split(x, 2, axis=-1)
    return (gate / (1.0 + np.exp(-gate)) * up).astype(np.float32)


def _examples() -> Iterator[Example]:
    """Values far into silu's tails (products up to ~200: float32 rounding allows 5e-5); the kernels' parallel path."""
    rng = np.random.default_rng(0)
    for tokens, width, scale in ((7, 24, 1.0), (37, 96, 6.0), (700, 1536, 8.0)):
        yield Example((normal(rng, tokens, 2 * width, scale=scale),), {}, atol=5e-5, label=f"[{tokens}, 2 x {width}]")


SWIGLU = Op(
    name="SwiGLU",
    atb="ActivationOperation (SWIGLU_FORWARD)",
    inputs=(Tensor("x", ("T", "G")),),  # G = [gate | up]
    outputs=(Tensor("y", ("T", "G // 2")),),
    reference=swiglu,
    examples=_examples,
)
