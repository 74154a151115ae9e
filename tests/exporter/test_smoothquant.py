"""SmoothQuant's migration (exporter/smoothquant.py): the smoothed layer computes what the float layer did, and
the input's outlier channel shrinks to the others' scale."""
from __future__ import annotations

import numpy as np
import pytest

from pagedgraph.exporter.smoothquant import smooth
from pagedgraph.graphs.config import ModelConfig
from pagedgraph.graphs.ops.rms_norm import rms_norm

pytestmark = pytest.mark.unit


def test_smoothing_keeps_the_layer_and_flattens_the_input_channels() -> None:
    rng = np.random.default_rng(0)
    k = 16
    names = [f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv"]
    tensors = {name: rng.normal(0, 0.1, (n, k)).astype(np.float32) for name, n in zip(names, (16, 8, 8))}
    tensors["model.layers.0.input_layernorm.weight"] = rng.uniform(0.5, 2, k).astype(np.float32)
    tensors["model.layers.0.input_layernorm.weight"][3] *= 30  # an outlier channel, as norm weights make them
    hidden = rng.normal(0, 1, (40, k)).astype(np.float32)
    gamma = "model.layers.0.input_layernorm.weight"
    x = rms_norm(hidden, tensors[gamma], epsilon=1e-5)
    config = ModelConfig("llama", 32, k, 32, 1, 2, 1, 8, 1e-5, 1e4, 64, True)  # qkv [16 + 8 + 8, 16]
    smoothed, ranges = smooth(config, tensors, {"layers.0.qkv": (x.min(0), x.max(0))}, 0.5)
    x_smooth = rms_norm(hidden, smoothed[gamma], epsilon=1e-5)
    for name in names:
        np.testing.assert_allclose(x_smooth @ smoothed[name].T, x @ tensors[name].T, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(ranges["layers.0.qkv"][0], x_smooth.min(0), rtol=1e-5, atol=1e-6)
    spread = lambda a: np.abs(a).max(0).max() / np.median(np.abs(a).max(0))  # noqa: E731
    assert spread(x_smooth) < spread(x) / 3
