"""SmoothQuant's migration (Xiao et al. 2023) for the static W8A8 form: activation outliers moved into weights.

A static per-tensor int8 scale must cover the input's largest channel, so a few outlier channels coarsen
every other one (held-out perplexity: docs/performance.md, "W8A8 on Ascend").
For a linear whose input is an RmsNorm's output, each input channel j is divided by
s_j = max|X_j|^alpha / max_n |W_nj|^(1 - alpha) and the weight's column multiplied by it: the product is
unchanged, and the division folds exactly into the norm's weight, so the graph gains no op.
"""
from __future__ import annotations

from typing import Mapping

import numpy as np

from ..graphs.quant import Weight

# The linears an RmsNorm feeds (graph name -> (norm weight, the weights sharing its input)), per layer.
_FED_BY_NORM = {"qkv": ("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                "gate_up": ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"))}


def smooth(tensors: Mapping[str, Weight], num_layers: int,
           ranges: Mapping[str, tuple[np.ndarray, np.ndarray]], alpha: float
           ) -> tuple[dict[str, Weight], dict[str, tuple[np.ndarray, np.ndarray]]]:
    """Float checkpoint tensors with every norm-fed linear's input smoothed, and the input ranges (`ranges`:
    graph linear name -> per-channel [min, max]) as they become."""
    out, moved = dict(tensors), dict(ranges)
    for i in range(num_layers):
        for linear, (norm, parts) in _FED_BY_NORM.items():
            name = f"layers.{i}.{linear}"
            if name not in ranges:
                continue
            low, high = ranges[name]
            weights = [f"model.layers.{i}.{part}.weight" for part in parts]
            activation = np.maximum(np.abs(low), np.abs(high)).astype(np.float64)
            weight = np.max([np.abs(np.asarray(out[w], np.float64)).max(axis=0) for w in weights], axis=0)
            s = np.where((activation > 0) & (weight > 0),
                         activation ** alpha / np.maximum(weight, 1e-8) ** (1 - alpha), 1.0)
            gamma = f"model.layers.{i}.{norm}.weight"
            out[gamma] = (np.asarray(out[gamma], np.float64) / s).astype(np.float32)
            for w in weights:
                out[w] = (np.asarray(out[w], np.float64) * s).astype(np.float32)
            moved[name] = ((low / s).astype(np.float32), (high / s).astype(np.float32))
    return out, moved
