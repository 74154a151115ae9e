"""The model registry: every family pagedgraph converts, one file each in this folder (a module holding a
`FAMILY`), looked up by name, Hugging Face class or GGUF architecture. Nothing outside a family file names a
checkpoint tensor, and adding a family touches no other file (docs/design.md, "How to add a model").
"""
from __future__ import annotations

import importlib
import pkgutil
from typing import Any, Collection, Mapping, Sequence

from ..config import ModelConfig
from ..family import GraphOptions, GraphWeight, ModelFamily, SourceSlice, layout_slices
from ..ops.op import OpBuilder
from ..quant import Weight
from ..weights import GraphWeights


def _discovered() -> dict[str, ModelFamily]:
    """Every module of this package that defines a `FAMILY`, by family name, in module order."""
    found: dict[str, ModelFamily] = {}
    for module in pkgutil.iter_modules(__path__):
        family = getattr(importlib.import_module(f"{__name__}.{module.name}"), "FAMILY", None)
        if isinstance(family, ModelFamily):
            if family.name in found:
                raise ValueError(f"two model families are named {family.name!r}: rename one (graphs/models)")
            found[family.name] = family
    return found


FAMILIES: dict[str, ModelFamily] = _discovered()


class UnknownArchitecture(ValueError):
    """A model no registered family converts; the message lists the families."""


def family(name: str) -> ModelFamily:
    """The family of ModelConfig.architecture `name`."""
    if name not in FAMILIES:
        raise UnknownArchitecture(f"architecture {name!r} is not supported; registered families: "
                                  f"{', '.join(FAMILIES)}")
    return FAMILIES[name]


def for_hf_classes(declared: Sequence[str]) -> ModelFamily:
    """The family of a config.json's `architectures` (its first class a family declares)."""
    for name in declared:
        for candidate in FAMILIES.values():
            if name in candidate.hf_classes:
                return candidate
    raise UnknownArchitecture(f"architectures {list(declared)!r} not supported; supported Hugging Face classes: "
                              f"{', '.join(c for f in FAMILIES.values() for c in f.hf_classes)} "
                              f"(registered families: {', '.join(FAMILIES)})")


def for_gguf(architecture: object) -> ModelFamily:
    """The family whose GGUF files say general.architecture = `architecture`."""
    for candidate in FAMILIES.values():
        if candidate.gguf_architecture is not None and candidate.gguf_architecture == architecture:
            return candidate
    readable = [f"{f.gguf_architecture} ({f.name})" for f in FAMILIES.values() if f.gguf_architecture]
    raise UnknownArchitecture(f"general.architecture is {architecture!r}; GGUF architectures read: "
                              f"{', '.join(readable)} (registered families: {', '.join(FAMILIES)}; export the others "
                              "from their HF safetensors directory)")


def weight_table(config: ModelConfig) -> dict[str, GraphWeight]:
    """Every graph weight of `config`'s model, by name, in the family's order."""
    return {w.name: w for w in family(config.architecture).weights(config)}


def checkpoint_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every checkpoint tensor `config`'s family reads, under its Hugging Face name, with its shape."""
    return {s.name: s.shape for w in weight_table(config).values() for s in w.sources}


def layout_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the other layouts `config`'s family accepts (GraphWeight.layouts), with its shape."""
    return {t.name: t.shape for w in weight_table(config).values() for layout in w.layouts for t in layout}


def relayout(config: ModelConfig, found: Collection[str]) -> dict[str, SourceSlice]:
    """Where each checkpoint tensor lies in a checkpoint holding another layout of its weight (`found`: the names
    it holds): the sources of every weight whose own tensors are absent and one of whose layouts is whole, as slices
    of that layout's tensors. A ValueError names a weight stored in two layouts at once."""
    slices: dict[str, SourceSlice] = {}
    for w in weight_table(config).values():
        whole = [layout for layout in w.layouts if all(t.name in found for t in layout)]
        own = [s.name for s in w.sources if s.name in found]
        if whole and own:
            raise ValueError(f"{w.name} is stored twice: as {own[0]} ... and as {', '.join(t.name for t in whole[0])}; "
                             "keep one of them")
        if whole:
            slices.update(layout_slices(w, whole[0]))
    return slices


def source_weights(config: ModelConfig) -> dict[str, GraphWeight]:
    """The graph weight each checkpoint tensor goes into, by the tensor's Hugging Face name."""
    return {s.name: w for w in weight_table(config).values() for s in w.sources}


def graph_weights(config: ModelConfig, tensors: Mapping[str, Weight], max_positions: int,
                  dtype: str = "float32") -> GraphWeights:
    """Every graph parameter of `config`'s model over checkpoint `tensors`, each made when read (graphs/weights.py)."""
    return GraphWeights(config, list(weight_table(config).values()), tensors, max_positions, dtype)


def build(b: OpBuilder[Any], config: ModelConfig, options: GraphOptions) -> None:
    """Emit one bucket graph of `config`'s model (its family's `build`)."""
    family(config.architecture).build(b, config, options)
