"""Per-channel int8 KV-cache scales, calibrated by running the float32 graph over a calibration text.

The text is cut into windows, each prefilled as its own sequence from position 0 (as prompts are
served), and every layer's K and V rows are read back from the float32 pools. Each channel's
[min, max] over all windows becomes one asymmetric int8 range (graphs/kv_cache.int8_params): ATB's
static kDescale/kOffset form, so the same numbers serve ONNX Runtime here and MindIE on Ascend.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

import numpy as np

from ..graphs import contract as c
from ..graphs.config import ModelConfig
from ..graphs.contract import Gear
from ..graphs.kv_cache import SCALE_FIELDS, int8_params, scale_weight_name


def window_feed(gear: Gear, tokens: Sequence[int], block_size: int) -> dict[str, np.ndarray]:
    """One sequence of `tokens` from position 0 in blocks 1, 2, ... of a pool; the rest of the gear is padding."""
    n = len(tokens)
    feed = {name: np.zeros(shape, c.INPUT_DTYPES[name]) for name, shape in gear.input_shapes().items()}
    feed[c.INPUT_IDS][:n] = tokens
    feed[c.POSITIONS][:n] = np.arange(n)
    feed[c.SLOT_MAPPING][:n] = block_size + np.arange(n)  # padding tokens write into the null block (slot 0)
    used = math.ceil(n / block_size)
    feed[c.BLOCK_TABLES][0, :used] = np.arange(1, used + 1)
    feed[c.CONTEXT_LENS][0] = n
    feed[c.CU_SEQLENS_Q][1:] = n
    feed[c.LOGITS_INDICES][0] = n - 1
    return feed


def calibrate_kv_scales(graph: Path, model: ModelConfig, gears: Sequence[Gear], block_size: int,
                        token_ids: Sequence[int], window: int) -> tuple[dict[str, np.ndarray], int]:
    """int8 scale parameters of every layer (graph parameter name -> array) from the float32 `graph`, and
    the number of windows they were fitted on."""
    import onnxruntime as ort

    prefill = list(gears)
    window = min(window, max(g.tokens for g in prefill), max(g.blocks for g in prefill) * block_size)
    windows = [token_ids[i:i + window] for i in range(0, len(token_ids), window)]
    windows = [w for w in windows if len(w) >= min(window, 16)] or windows[:1]
    if not windows or not windows[0]:
        raise ValueError("the KV-cache calibration text is empty: give export.kv_cache_calibration a text file")
    session = ort.InferenceSession(str(graph), providers=["CPUExecutionProvider"])
    names = c.cache_names(model.num_layers)
    low = {name: np.full(model.kv_size, np.inf, np.float32) for name in names}
    high = {name: np.full(model.kv_size, -np.inf, np.float32) for name in names}
    for tokens in windows:
        gear = min(g for g in prefill if g.tokens >= len(tokens) and g.blocks * block_size >= len(tokens))
        pools = {name: np.zeros(((gear.blocks + 1) * block_size, model.kv_size), np.float32) for name in names}
        outputs = session.run([c.cache_output_name(n) for n in names], {**window_feed(gear, tokens, block_size), **pools})
        for name, pool in zip(names, outputs):
            rows = pool[block_size:block_size + len(tokens)]
            low[name] = np.minimum(low[name], rows.min(axis=0))
            high[name] = np.maximum(high[name], rows.max(axis=0))
    weights: dict[str, np.ndarray] = {}
    for layer in range(model.num_layers):
        for kv, name in (("k", c.k_cache_name(layer)), ("v", c.v_cache_name(layer))):
            params = int8_params(low[name], high[name])
            for field in SCALE_FIELDS:
                if field.startswith(kv + "_"):
                    weights[scale_weight_name(layer, field)] = params[field.split("_", 1)[1]]
    return weights, len(windows)
