"""A model's graph as slices of consecutive layers, so export-time calibration and checks stay bounded at any size.

Each slice is the model definition built for a few layers (graphs/decoder.py's `layers`) over weights that lie in
a file (the artifact's weights.bin, or a scratch file with the slice's float32 weights), and runs in its own ONNX
Runtime session: its weights are mapped while it runs and released after. Slices pass the residual stream on
(contract.SLICE_OUTPUTS -> SLICE_INPUTS), so chained they compute what the whole graph does. A model whose
weights fit one slice runs as one graph, exactly as it is served.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np
import onnx

from .graph_builder import Initializer, OnnxBuilder
from .weights_file import StreamedWeights, WeightsFile
from ...graphs import contract as c
from ...graphs import models
from ...graphs.config import ModelConfig
from ...graphs.family import GraphOptions
from ...graphs.weight_forms import WeightForms
from ...graphs.weights import graph_weight
from ...graphs.quant import BlockForm, Int8Form, Weight
from ...cpu_kernels.int8_gemm import cpu_session

# Weights per slice: a session maps them and prepacks its matmuls' (about twice this resident while it runs).
SLICE_BYTES = 1 << 30


@dataclass(frozen=True)
class Slice:
    """Layers `layers` of a model, and its LM head if `head` (none but the head: the last slice of a model whose
    last layer and head did not fit one): the whole graph's file, or a slice built in memory over weights in
    `folder`. `prepack`: its session prepacks its matmuls' weights (see `session`)."""

    layers: tuple[int, ...]
    head: bool
    graph: Path | onnx.ModelProto
    folder: Path
    prepack: bool = True

    def proto(self) -> onnx.ModelProto:
        """The graph without its weights' data."""
        if isinstance(self.graph, Path):
            return onnx.load_model(self.graph, load_external_data=False)
        return self.graph

    def session(self, model: onnx.ModelProto | None = None) -> Any:
        """An ONNX Runtime session over the slice (or over `model`, the slice edited: extra outputs).

        A prepacking session keeps a packed copy of its matmuls' weights beside the mapped file, about twice the
        slice's weights resident: it stays on where the slice has quantized linears (unpacked int8 and 4-bit
        matmuls ran the gear check 3x slower, docs/performance.md) and is off for float ones, which a session of a
        few steps packs per call at about the cost of packing once (a float32 Qwen3-1.7B export peaked at 3.1 GiB
        on its LM head's packed copy)."""
        import onnxruntime as ort

        options = ort.SessionOptions()
        if not self.prepack:
            options.add_session_config_entry("session.disable_prepacking", "1")
        if model is None and isinstance(self.graph, Path):
            return cpu_session(self.graph, options)
        return cpu_session(model or self.proto(), options, self.folder)

    @property
    def carried(self) -> list[str]:
        """The residual-stream outputs it hands on (none from a slice with the head: it writes logits)."""
        return [] if self.head else list(c.SLICE_OUTPUTS)


def layer_groups(model: ModelConfig, nbytes: Callable[[str], int], budget: int | None = None) -> list[tuple[int, ...]]:
    """Consecutive layers grouped so each group's weights (`nbytes(graph weight)`; the first group also holds the
    embedding, the last the LM head) stay within `budget` (default SLICE_BYTES), at least one layer each. The head
    goes alone, as a last empty group, where it does not fit with the last layer; the last group runs the head."""
    budget = SLICE_BYTES if budget is None else budget
    names = list(models.weight_table(model))
    per_layer = [sum(nbytes(n) for n in names if n.startswith(f"layers.{i}.")) for i in range(model.num_layers)]
    per_layer[0] += nbytes("embed")
    per_layer[-1] += nbytes("final_norm")
    groups: list[list[int]] = [[]]
    used = 0
    for layer, size in enumerate(per_layer):
        if groups[-1] and used + size > budget:
            groups.append([])
            used = 0
        groups[-1].append(layer)
        used += size
    head = nbytes("embed" if model.tie_word_embeddings else "lm_head")
    if len(groups) > 1 and used + head > budget:
        groups.append([])
    return [tuple(g) for g in groups]


def built_slice(model: ModelConfig, block_size: int, forms: WeightForms, kv_cache_dtype: str,
                layers: Sequence[int], head: bool, initializer: Initializer) -> onnx.ModelProto:
    builder = OnnxBuilder(model, initializer, kv_cache_dtype)
    models.build(builder, model, GraphOptions(block_size, forms, kv_cache_dtype, layers, head))
    return builder.model("pagedgraph-slice")


def artifact_slices(graph: Path, model: ModelConfig, block_size: int, forms: WeightForms, kv_cache_dtype: str,
                    initializers: Mapping[str, onnx.TensorProto], groups: Sequence[tuple[int, ...]]
                    ) -> Iterator[Slice]:
    """`graph` (an exported graph whose weights lie beside it) in `groups` of layers (layer_groups'); `initializers`:
    its weights' references (and an int8 cache's inline scales)."""
    if len(groups) == 1:
        yield Slice(groups[0], True, graph, graph.parent, _quantized(forms, list(forms.forms)))
        return
    for index, layers in enumerate(groups):
        head = index + 1 == len(groups)
        yield Slice(layers, head, built_slice(model, block_size, forms, kv_cache_dtype, layers, head,
                                              initializers.__getitem__), graph.parent,
                    _quantized(forms, slice_weights(model, layers, head)))


def checkpoint_slices(model: ModelConfig, tensors: Mapping[str, Weight], max_positions: int, block_size: int,
                      accuracy_level: int, scratch: Path, groups: Sequence[tuple[int, ...]]) -> Iterator[Slice]:
    """The float32-compute graph of checkpoint `tensors` as read, in `groups` of layers (layer_groups'; an empty
    one, the head alone, is left out: calibration reads the layers): each slice's weights are converted into a
    scratch file in `scratch` when it is reached and deleted after it."""
    sources, table = graph_sources(model), models.weight_table(model)
    runs = [layers for layers in groups if layers]
    for index, layers in enumerate(runs):
        path = scratch / "weights.bin"
        head = index + 1 == len(groups)
        with WeightsFile(path) as out:
            store = StreamedWeights(sources, lambda name: graph_weight(model, table[name], tensors, max_positions), out)
            proto = built_slice(model, block_size, WeightForms(store.forms, accuracy_level), "float32", layers,
                                head, store.initializer)
        try:
            yield Slice(layers, head, proto, scratch, prepack=False)  # float32 weights
        finally:
            path.unlink()


def _quantized(forms: WeightForms, names: Sequence[str]) -> bool:
    """Whether any of graph weights `names` is stored quantized (block-quantized or int8 per channel)."""
    return any(isinstance(forms.forms.get(name), (BlockForm, Int8Form)) for name in names)


def slice_weights(model: ModelConfig, layers: Sequence[int], head: bool) -> list[str]:
    """The graph weights a slice reads (the embedding from layer 0, the final norm and the LM head with the head)."""
    names = [n for n in models.weight_table(model) if any(n.startswith(f"layers.{i}.") for i in layers)]
    if layers and layers[0] == 0:
        names.append("embed")
    if head:
        names += ["final_norm", "embed" if model.tie_word_embeddings else "lm_head"]
    return names


def graph_sources(model: ModelConfig) -> dict[str, tuple[str, ...]]:
    """Every graph weight and the checkpoint tensors it is made of (none for the rope tables)."""
    return {name: tuple(s.name for s in w.sources) for name, w in models.weight_table(model).items()}


def slice_feed(session: Any, feed: Mapping[str, np.ndarray], carried: Mapping[str, np.ndarray]) -> dict[str, Any]:
    """What `session` takes of a step's `feed` and of the previous slice's residual stream (`carried`)."""
    names = {i.name for i in session.get_inputs()}
    return {name: value for name, value in {**feed, **carried}.items() if name in names}


def carry(values: Sequence[np.ndarray]) -> dict[str, np.ndarray]:
    """A slice's residual-stream outputs as the next slice's inputs."""
    return dict(zip(c.SLICE_INPUTS, values))
