"""Graph weights made from checkpoint tensors, one at a time: a family's `GraphWeight` table (graphs/family.py)
says what each is made of; here the tensors are fused, rounded to bfloat16 where asked, and laid out as the arrays a
graph stores."""
from __future__ import annotations

from typing import Iterator, Mapping, Sequence

import numpy as np

from . import quant
from .config import ModelConfig
from .family import GraphWeight, Kind
from .ops.linear_bf16 import to_bfloat16
from .quant import BlockQuantized, ExpertStack, Int8PerChannel, Weight, concat_rows
from .rope_tables import ROPE_TABLES, rope_tables


def graph_weight(config: ModelConfig, spec: GraphWeight, tensors: Mapping[str, Weight], max_positions: int,
                 dtype: str = "float32") -> Weight:
    """One graph parameter from the checkpoint tensors it is made of (`tensors` is read only for those).

    Block-quantized weights stay quantized (fused along their rows; a MoE router, float32 always, is dequantized);
    `weight_arrays` lays one out for a graph. With `dtype` bfloat16 a float linear or embedding table is rounded to
    bfloat16."""
    if spec.role.kind is Kind.TABLE:
        return rope_tables(config, max_positions)[ROPE_TABLES.index(spec.name)]
    if spec.experts:
        return _expert_stack(spec, tensors, dtype)
    parts = [tensors[source.name] for source in spec.sources]
    w = parts[0] if len(parts) == 1 else concat_rows(parts)
    if isinstance(w, (BlockQuantized, Int8PerChannel)):
        if spec.role.kind.matrix:
            return w
        w = w.dequantize()  # a router a file stores quantized: float32 as its graph reads it
    return _float(np.ascontiguousarray(w, dtype=np.float32), spec, dtype)


def _float(w: np.ndarray, spec: GraphWeight, dtype: str) -> np.ndarray:
    return to_bfloat16(w) if dtype == "bfloat16" and spec.role.kind.matrix else w


def _expert_stack(spec: GraphWeight, tensors: Mapping[str, Weight], dtype: str) -> Weight:
    """A stack of experts [E, out, in], read one expert at a time: float experts are written into one array as
    each is read (the stack and one expert in memory, never a list of all of them), quantized ones kept as they
    are (an ExpertStack)."""
    stack: np.ndarray | None = None
    quantized: list[BlockQuantized] = []
    for e in range(spec.experts):
        parts = [tensors[source.name] for source in spec.expert_sources(e)]
        w = parts[0] if len(parts) == 1 else concat_rows(parts)
        if isinstance(w, BlockQuantized):
            quantized.append(w)
            continue
        if isinstance(w, Int8PerChannel) or quantized:
            raise ValueError(f"{spec.name}: expert {e} is {getattr(w, 'source', 'float')} among other forms; a "
                             "stack of experts is float or block-quantized throughout")
        if stack is None:
            stack = np.empty((spec.experts, *w.shape), np.float32)
        stack[e] = w
    if quantized:
        if len(quantized) != spec.experts:
            raise ValueError(f"{spec.name}: some experts are block-quantized and some float; quantize them alike")
        return ExpertStack(tuple(quantized))
    return _float(stack, spec, dtype)  # type: ignore[arg-type]


class GraphWeights(Mapping[str, Weight]):
    """Every graph parameter of `table` over checkpoint `tensors`, each made (`graph_weight`) when read and not
    kept: iterating holds one at a time."""

    def __init__(self, config: ModelConfig, table: Sequence[GraphWeight], tensors: Mapping[str, Weight],
                 max_positions: int, dtype: str = "float32") -> None:
        self._config, self._tensors, self._max_positions, self._dtype = config, tensors, max_positions, dtype
        self._specs = {spec.name: spec for spec in table}

    def __getitem__(self, name: str) -> Weight:
        return graph_weight(self._config, self._specs[name], self._tensors, self._max_positions, self._dtype)

    def __iter__(self) -> Iterator[str]:
        return iter(self._specs)

    def __len__(self) -> int:
        return len(self._specs)


def weight_arrays(name: str, w: Weight) -> dict[str, np.ndarray]:
    """One graph parameter as the arrays a graph stores: a quantized weight as its packed parts (graphs/quant.py)."""
    if isinstance(w, ExpertStack):
        return quant.stacked_graph_arrays(name, w)
    if isinstance(w, BlockQuantized):
        return quant.graph_arrays(name, w, gathered=name == "embed")
    if isinstance(w, Int8PerChannel):
        return quant.int8_graph_arrays(name, w)
    return {name: w}


def graph_arrays(weights: Mapping[str, Weight]) -> dict[str, np.ndarray]:
    """Every graph parameter as arrays (`weight_arrays` of each)."""
    return {part: array for name, w in weights.items() for part, array in weight_arrays(name, w).items()}
