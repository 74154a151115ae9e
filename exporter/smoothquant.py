"""SmoothQuant's migration (Xiao et al. 2023) for the static W8A8 form: activation outliers moved into weights.

A static per-tensor int8 scale must cover the input's largest channel, so a few outlier channels coarsen
every other one (held-out perplexity: docs/performance.md, "W8A8 on Ascend").
For a linear whose input is an RmsNorm's output, each input channel j is divided by
s_j = max|X_j|^alpha / max_n |W_nj|^(1 - alpha) and the weight's column multiplied by it: the product is
unchanged, and the division folds exactly into the norm's weight, so the graph gains no op.
"""
from __future__ import annotations

from typing import Iterator, Mapping

import numpy as np

from ..graphs import models
from ..graphs.config import ModelConfig
from ..graphs.family import GraphWeight
from ..graphs.quant import Weight


def smooth(config: ModelConfig, tensors: Mapping[str, Weight], ranges: Mapping[str, tuple[np.ndarray, np.ndarray]],
           alpha: float) -> tuple["SmoothedTensors", dict[str, tuple[np.ndarray, np.ndarray]]]:
    """Float checkpoint tensors with every norm-fed linear's input smoothed (applied as each tensor is read; the
    factors come from one pass over the linears, one tensor at a time), and the input ranges (`ranges`: graph
    linear name -> per-channel [min, max]) as they become. The linears an RmsNorm feeds are those whose graph
    weight names it as `fed_by` (graphs/family.py); linears sharing a norm share its factors."""
    table = models.weight_table(config)
    fed: dict[str, list[GraphWeight]] = {}
    for w in table.values():
        if w.fed_by is not None and w.name in ranges:
            fed.setdefault(w.fed_by, []).append(w)
    factors: dict[str, tuple[bool, np.ndarray]] = {}  # tensor -> (divided, s)
    moved = dict(ranges)
    for norm, linears in fed.items():
        low, high = ranges[linears[0].name]  # one input, one range
        parts = [source.name for w in linears for source in w.sources]
        activation = np.maximum(np.abs(low), np.abs(high)).astype(np.float64)
        weight = np.max([np.abs(np.asarray(tensors[p], np.float64)).max(axis=0) for p in parts], axis=0)
        s = np.where((activation > 0) & (weight > 0), activation ** alpha / np.maximum(weight, 1e-8) ** (1 - alpha),
                     1.0)
        factors[table[norm].sources[0].name] = (True, s)
        factors.update({p: (False, s) for p in parts})
        moved.update({w.name: ((low / s).astype(np.float32), (high / s).astype(np.float32)) for w in linears})
    return SmoothedTensors(tensors, factors), moved


class SmoothedTensors(Mapping[str, Weight]):
    """`tensors` with each smoothed norm weight divided by its factors and each linear's columns multiplied, as read."""

    def __init__(self, tensors: Mapping[str, Weight], factors: Mapping[str, tuple[bool, np.ndarray]]) -> None:
        self._tensors, self._factors = tensors, factors

    def __getitem__(self, name: str) -> Weight:
        if name not in self._factors:
            return self._tensors[name]
        divided, s = self._factors[name]
        w = np.asarray(self._tensors[name], np.float64)
        return (w / s if divided else w * s).astype(np.float32)

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)
