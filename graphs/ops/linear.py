"""Linear in ATB's layout: weight [out, in] (transposeB), optional bias."""
from __future__ import annotations

from typing import Iterator

import numpy as np

from .examples import normal
from .op import Example, Op, Tensor


def linear(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    out = x @ weight.T
    if bias is not None:
        out = out + bias
    return out.astype(np.float32)


def _examples() -> Iterator[Example]:
    rng = np.random.default_rng(0)
    x, weight = normal(rng, 5, 16), normal(rng, 24, 16)
    yield Example((x, weight, None), {}, label="no bias")
    yield Example((x, weight, normal(rng, 24)), {}, label="bias")


LINEAR = Op(
    name="Linear",
    atb="LinearOperation (transposeB)",
    inputs=(Tensor("x", ("T", "K")), Tensor("weight", ("N", "K")), Tensor("bias", ("N",), optional=True)),
    outputs=(Tensor("y", ("T", "N")),),
    reference=linear,
    examples=_examples,
)
