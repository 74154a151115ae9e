"""What a model family declares: its classes, its weights with their roles, and its graph.

A family is one file in graphs/models/ holding a `ModelFamily` (the registry: graphs/models/__init__.py).
Everything that handles weights (the checkpoint readers, quantization, SmoothQuant, tensor parallelism, the
resource estimates, the writers) asks the family's `GraphWeight` table instead of spelling out tensor names, as
llama.cpp keeps one tensor table per architecture and vLLM one `load_weights` per model file.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from .config import ModelConfig
from .ops.op import OpBuilder
from .weight_forms import WeightForms


class ConfigError(ValueError):
    """A checkpoint configuration a family cannot export faithfully; the message names the field and the fix."""


class Kind(enum.Enum):
    """What a graph weight is, which decides its precision: linears and the embedding tables are stored in bfloat16
    or quantized where the export asks; norms, biases and the rope tables stay float32."""

    EMBEDDING = "embedding"  # gathered by token id; a tied LM head reads it too
    LM_HEAD = "lm_head"
    LINEAR = "linear"
    NORM = "norm"
    BIAS = "bias"
    TABLE = "table"  # computed from the config (rope cos/sin), not read from the checkpoint
    ROUTER = "router"  # a MoE layer's router: float32 always (its logits choose the experts; graphs/moe.py)

    @property
    def matrix(self) -> bool:
        """bfloat16 and the quantizers apply (graphs/weights.py, exporter/quantize.py)."""
        return self in (Kind.EMBEDDING, Kind.LM_HEAD, Kind.LINEAR)


class Split(enum.Enum):
    """How tensor parallelism cuts a graph weight over ranks (graphs/tensor_parallel.py lays out the ranks)."""

    REPLICATED = "replicated"
    QKV_ROWS = "qkv rows"  # column-parallel: a rank's query heads, then its K heads, then its V heads
    HALVES_ROWS = "halves rows"  # column-parallel: a rank's channels of the first half (gate), then of the second (up)
    HEAD_COLUMNS = "head columns"  # row-parallel: a rank's query heads' inputs (o_proj)
    CHANNEL_COLUMNS = "channel columns"  # row-parallel: a rank's intermediate channels (down)
    # a stack of experts [E, out, in], each cut as its dense counterpart over MoeConfig.intermediate_size
    EXPERT_HALVES_ROWS = "expert halves rows"
    EXPERT_CHANNEL_COLUMNS = "expert channel columns"


@dataclass(frozen=True)
class Role:
    kind: Kind
    split: Split = Split.REPLICATED
    # w8a8 makes this linear Linear.w8a8 (int8 activations per token); False keeps it weight-only (down_proj: the
    # SwiGLU products carry outlier channels, exporter/quantize.py)
    int8_activations: bool = False


@dataclass(frozen=True)
class Source:
    """One checkpoint tensor under the family's Hugging Face name, with its [out, in] shape. `gguf` names it in a
    GGUF file where gguf's own TensorNameMap does not (None: the map's name)."""

    name: str
    shape: tuple[int, ...]
    gguf: str | None = None


@dataclass(frozen=True)
class GraphWeight:
    """One graph parameter: the checkpoint tensors it is made of (fused along their rows, in order), its role, and
    the norm whose output is its input (`fed_by`, a graph weight; SmoothQuant folds its factors into that norm).

    A stack of `experts` (a MoE layer's, GroupedMatmul's weight [E, out, in]) lists each expert's tensors in turn
    (`sources`: expert 0's parts, then expert 1's, ...; each expert's parts fused along their rows, then stacked),
    as the released checkpoints store them. `layouts` names other ways checkpoints store the same weight: other
    names of the same tensors (Mixtral's router, `block_sparse_moe.gate` or `mlp.gate`), or, for a stack, tensors
    [E, rows, in] whose rows, expert by expert, are those of `sources` in order (transformers' fused
    `experts.gate_up_proj`; llama.cpp's `ffn_*_exps`, under the names its converter gives the merged experts). A
    reader that finds another layout presents its slices under the `sources` names (`layout_slices`), so everything
    past the readers sees one layout."""

    name: str
    role: Role
    sources: tuple[Source, ...] = ()
    fed_by: str | None = None
    experts: int = 0
    layouts: tuple[tuple[Source, ...], ...] = ()

    def expert_sources(self, expert: int) -> tuple[Source, ...]:
        """Expert `expert`'s parts of a stack."""
        parts = len(self.sources) // self.experts
        return self.sources[expert * parts:(expert + 1) * parts]


@dataclass(frozen=True)
class SourceSlice:
    """Where one of a weight's `sources` lies in another layout: rows `rows` of `tensor` (of its expert `expert`
    where `tensor` is a stack [E, rows, in])."""

    tensor: str
    expert: int | None
    rows: slice


def layout_slices(weight: GraphWeight, layout: Sequence[Source]) -> dict[str, SourceSlice]:
    """Each of `weight.sources` as a slice of the tensors of `layout` (one of `weight.layouts`); a ValueError where a
    source would straddle two of them."""
    axis = 1 if weight.experts else 0  # the rows of a stack [E, rows, in]
    bounds, start = [], 0
    for tensor in layout:
        bounds.append((start, start + tensor.shape[axis], tensor.name))
        start += tensor.shape[axis]
    groups = [(e, weight.expert_sources(e)) for e in range(weight.experts)] if weight.experts \
        else [(None, weight.sources)]
    found: dict[str, SourceSlice] = {}
    for expert, parts in groups:
        row = 0
        for source in parts:
            end = row + source.shape[0]
            owner = next(((first, name) for first, last, name in bounds if first <= row and end <= last), None)
            if owner is None:
                raise ValueError(f"{weight.name}: {source.name} straddles the tensors "
                                 f"{', '.join(t.name for t in layout)}")
            found[source.name] = SourceSlice(owner[1], expert, slice(row - owner[0], end - owner[0]))
            row = end
    return found


@dataclass(frozen=True)
class GraphOptions:
    """How one graph of a model is built: the pools' block size and dtype, each weight's form (default: float32), and
    which part of the model (`layers`, `head`: graphs/decoder.py) for which tensor-parallel rank count."""

    block_size: int
    forms: WeightForms = WeightForms()
    kv_cache_dtype: str = "float32"
    layers: Sequence[int] | None = None
    head: bool = True
    tensor_parallel_size: int = 1


@dataclass(frozen=True)
class ModelFamily:
    """One model family, as the registry (graphs/models/__init__.py) holds it.

    `config` reads a Hugging Face config.json (as a dict) into the ModelConfig the graphs take, refusing what the
    family cannot run; `weights` lists the graph weights of a config; `build` emits one bucket graph."""

    name: str  # ModelConfig.architecture, the manifest's label
    hf_classes: tuple[str, ...]
    gguf_architecture: str | None  # general.architecture of its GGUF files (None: none read)
    config: Callable[[Mapping[str, Any]], ModelConfig]
    weights: Callable[[ModelConfig], Sequence[GraphWeight]]
    build: Callable[[OpBuilder[Any], ModelConfig, GraphOptions], None]
    # llama.cpp's converter interleaves the rope pairs of Q and K rows for this architecture (LLaMA's), which the
    # GGUF reader undoes
    gguf_rope_permuted: bool = False
