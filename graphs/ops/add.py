"""Add: the residual connection."""
from __future__ import annotations

from typing import Iterator

import numpy as np

from .examples import normal
from .op import Example, Op, Tensor


def add(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return a + b


def _examples() -> Iterator[Example]:
    rng = np.random.default_rng(0)
    yield Example((normal(rng, 5, 8), normal(rng, 5, 8)), {}, label="[5, 8]")


ADD = Op(
    name="Add",
    atb="ElewiseOperation (ADD)",
    inputs=(Tensor("a", ("T", "W")), Tensor("b", ("T", "W"))),
    outputs=(Tensor("sum", ("T", "W")),),
    reference=add,
    examples=_examples,
)
