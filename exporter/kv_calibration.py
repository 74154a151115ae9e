"""Static int8 parameters calibrated by running the float32 graph over a calibration text: the KV cache's
per-channel scales, and W8A8's per-tensor activation scales (MindIE's input_scale / input_offset).

The text is cut into windows, each prefilled as its own sequence from position 0 (as prompts are
served), and every layer's K and V rows are read back from the float32 pools. A large model runs in slices of a
few layers (exporter/onnx/slices.py), every window through one slice before the next: memory stays bounded.
Each channel's [min, max] over all windows becomes one asymmetric int8 range (graphs/kv_cache.int8_params): ATB's
static kDescale/kOffset form, so the same numbers serve ONNX Runtime here and MindIE on Ascend.
"""
from __future__ import annotations

import math
from typing import Callable, Iterable, Sequence

import numpy as np
import onnx

from ..graphs import contract as c
from ..graphs.config import ModelConfig
from ..graphs.contract import Gear
from ..graphs.kv_cache import INT8_MAX, INT8_MIN, SCALE_FIELDS, int8_params, scale_weight_name
from .onnx.slices import Slice, carry, slice_feed


# Calibration's compute, bounded: windows x window tokens x the model's parameters at most this, and at least one
# window. The shipped text's 8 windows of 512 tokens are kept whole up to 1.4B parameters; a 7B model runs one
# (each window costs a 512-token prefill of the whole model: eight took longer than the rest of a 7B export here).
CALIBRATION_BUDGET = 6e12


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


def calibration_windows(token_ids: Sequence[int], window: int, gears: Sequence[Gear], block_size: int,
                        params: int | None = None) -> list[Sequence[int]]:
    """The calibration text cut into prompts of `window` tokens (at most what one prefill gear holds); a
    trailing piece shorter than 16 tokens is dropped unless it is all there is. With the model's `params`, at most
    the windows CALIBRATION_BUDGET allows, spread evenly over the text (the first of each stretch)."""
    window = min(window, max(g.tokens for g in gears), max(g.blocks for g in gears) * block_size)
    windows = [token_ids[i:i + window] for i in range(0, len(token_ids), window)]
    windows = [w for w in windows if len(w) >= min(window, 16)] or windows[:1]
    if not windows or not windows[0]:
        raise ValueError("the calibration text is empty: give export.kv_cache_calibration a text file")
    keep = len(windows) if params is None else max(1, int(CALIBRATION_BUDGET // (window * params)))
    return [windows[i * len(windows) // keep] for i in range(keep)] if keep < len(windows) else windows


def channel_ranges(slices: Iterable[Slice], model: ModelConfig, gears: Sequence[Gear], block_size: int,
                   windows: Sequence[Sequence[int]], outputs: Callable[[Slice, onnx.ModelProto], dict[str, int]],
                   progress: Callable[[], None] = lambda: None) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per-channel [min, max] of graph values over the calibration windows, each prefilled on its own, through the
    float32 graph's `slices` in order (each slice's session made, run over every window, then dropped).

    `outputs(slice, proto)` names the values to read in a slice (it may add them to `proto` as graph outputs) and
    the row its window's first token lands in (pools: block_size; a graph value of the step's tokens: 0); each
    window's rows follow."""
    ranges: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    carried: list[dict[str, np.ndarray]] = [{} for _ in windows]
    for part in slices:
        if not part.layers:  # the LM head alone: nothing calibrated reads it
            continue
        proto = part.proto()
        wanted = outputs(part, proto)
        session = part.session(proto)
        handed_on = part.carried
        names = [c.k_cache_name(i) for i in part.layers] + [c.v_cache_name(i) for i in part.layers]
        for w, tokens in enumerate(windows):
            gear = min(g for g in gears if g.tokens >= len(tokens) and g.blocks * block_size >= len(tokens))
            pools = {name: np.zeros(((gear.blocks + 1) * block_size, model.kv_size), np.float32) for name in names}
            feed = slice_feed(session, {**window_feed(gear, tokens, block_size), **pools}, carried[w])
            values = session.run(list(wanted) + handed_on, feed)
            carried[w] = carry(values[len(wanted):])
            for (name, first), value in zip(wanted.items(), values):
                rows = value[first:first + len(tokens)]
                low, high = ranges.get(name, (np.full(rows.shape[1], np.inf, np.float32),
                                              np.full(rows.shape[1], -np.inf, np.float32)))
                ranges[name] = (np.minimum(low, rows.min(axis=0)), np.maximum(high, rows.max(axis=0)))
            progress()
        del session
    return ranges


def calibrate_kv_scales(slices: Iterable[Slice], model: ModelConfig, gears: Sequence[Gear], block_size: int,
                        windows: Sequence[Sequence[int]], progress: Callable[[], None] = lambda: None
                        ) -> dict[str, np.ndarray]:
    """int8 scale parameters of every layer (graph parameter name -> array) from the float32 graph's `slices` run
    over the calibration `windows` (calibration_windows')."""
    ranges = channel_ranges(slices, model, gears, block_size, windows,
                            lambda part, proto: {c.cache_output_name(n): block_size
                                                 for i in part.layers for n in (c.k_cache_name(i), c.v_cache_name(i))},
                            progress)
    weights: dict[str, np.ndarray] = {}
    for layer in range(model.num_layers):
        for kv, name in (("k", c.k_cache_name(layer)), ("v", c.v_cache_name(layer))):
            params = int8_params(*ranges[c.cache_output_name(name)])
            for field in SCALE_FIELDS:
                if field.startswith(kv + "_"):
                    weights[scale_weight_name(layer, field)] = params[field.split("_", 1)[1]]
    return weights


def linear_input_ranges(slices: Iterable[Slice], model: ModelConfig, gears: Sequence[Gear], block_size: int,
                        windows: Sequence[Sequence[int]], linears: Sequence[str],
                        progress: Callable[[], None] = lambda: None) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per-channel [min, max] of the input of each of `linears` (graph weight names) over the calibration
    `windows` in the float32 graph's `slices` (whose Gemm nodes read those weights)."""
    inputs: dict[str, str] = {}

    def probe(part: Slice, proto: onnx.ModelProto) -> dict[str, int]:
        """The inputs of the slice's Gemm nodes reading `linears`, added to its outputs."""
        found = {node.input[1]: node.input[0] for node in proto.graph.node
                 if node.op_type == "Gemm" and node.input[1] in linears}
        inputs.update(found)
        proto.graph.output.extend(onnx.helper.make_tensor_value_info(x, onnx.TensorProto.FLOAT, None)
                                  for x in dict.fromkeys(found.values()))
        return {x: 0 for x in found.values()}

    ranges = channel_ranges(slices, model, gears, block_size, windows, probe, progress)
    missing = sorted(set(linears) - set(inputs))
    if missing:
        raise ValueError(f"the calibration graph has no Gemm reading {missing}")
    return {name: ranges[x] for name, x in inputs.items()}


def static_input_params(low: np.ndarray, high: np.ndarray) -> tuple[float, int]:
    """W8A8's static per-tensor activation parameters (MindIE's input_scale, input_offset) covering the
    channels' [low, high] and 0: x_q = clip(round(x / scale) + offset, -128, 127)."""
    lo, hi = min(float(np.min(low)), 0.0), max(float(np.max(high)), 0.0)
    scale = max((hi - lo) / (INT8_MAX - INT8_MIN), 1e-8)
    return scale, int(np.clip(np.rint(INT8_MIN - lo / scale), INT8_MIN, INT8_MAX))
