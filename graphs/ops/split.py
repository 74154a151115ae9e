"""Split: consecutive pieces of the last axis (fused QKV -> Q, K, V)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np

from .examples import normal
from .op import Attributes, Example, Op, Tensor


@dataclass(frozen=True)
class SplitAttributes(Attributes):
    sizes: tuple[int, ...]


def split(x: np.ndarray, sizes: tuple[int, ...]) -> list[np.ndarray]:
    return np.split(x, np.cumsum(sizes)[:-1], axis=-1)


def _examples() -> Iterator[Example]:
    rng = np.random.default_rng(0)
    yield Example((normal(rng, 4, 12),), dict(sizes=(6, 3, 3)), atol=0, rtol=0, label="q, k, v")


SPLIT = Op(
    name="Split",
    atb="SplitOperation",
    inputs=(Tensor("x", ("T", "W")),),
    outputs=(Tensor("pieces", ("T", "P"), variadic=True),),
    attributes=SplitAttributes,
    reference=split,
    count=lambda attrs: len(attrs.sizes),
    examples=_examples,
)
