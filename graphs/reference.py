"""Evaluates a model definition eagerly with the numpy op references (the lowerings' oracle)."""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import numpy as np

from .ops.op import Op


class NumpyBuilder:
    """Runs each op's reference as it is emitted; pools are updated in place like the real executors."""

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

    def emit(self, op: Op, *inputs: np.ndarray | None, **attrs: Any) -> Any:
        out = op.reference(*op.arguments(inputs), **dataclasses.asdict(op.attrs(**attrs)))
        return op.result(out if isinstance(out, (tuple, list)) else [out])
