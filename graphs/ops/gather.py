"""Gather: rows of a table (axis 0) picked by indices: embeddings, rope rows, the LM head's rows."""
from __future__ import annotations

from typing import Iterator

import numpy as np

from .examples import normal
from .op import Example, Op, Tensor


def gather(table: np.ndarray, indices: np.ndarray) -> np.ndarray:
    return table[indices]


def _examples() -> Iterator[Example]:
    rng = np.random.default_rng(0)
    yield Example((normal(rng, 10, 6), np.array([3, 0, 9, 3], np.int64)), {}, atol=0, rtol=0, label="repeated rows")


GATHER = Op(
    name="Gather",
    atb="GatherOperation (axis 0)",
    inputs=(Tensor("table", ("N", "W")), Tensor("indices", ("T",), ("int64",))),
    outputs=(Tensor("rows", ("T", "W")),),
    reference=gather,
    examples=_examples,
)
