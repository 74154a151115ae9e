"""The LLaMA family (LLaMA 2/3, Mistral, Qwen2, SmolLM2), defined once against the op set.

One graph serves every step: new tokens are written to the pool first, then every
query attends through the block table (prefill, chunked prefill, prefix hits and
decode alike), and only the rows in `logits_indices` reach the LM head.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Mapping, Sequence, TypeVar

import numpy as np

from . import contract as c
from . import ops, quant
from .config import ModelConfig
from .kv_cache import DEQUANT_INPUTS, QUANT_INPUTS, SCALE_FIELDS, cache_format, scale_weight_name
from .ops.linear_bf16 import BFLOAT16, to_bfloat16
from .ops.op import OpBuilder
from .quant import BlockForm, BlockQuantized, DenseForm, Int8Form, Int8PerChannel, Weight, WeightForm, concat_rows
from .rope_tables import rope_tables
from .tensor_parallel import rank_config

T = TypeVar("T")


# The weights a `model.dtype: bfloat16` graph stores as bfloat16: every linear's and the embedding (the tied LM
# head's table). Norm weights, biases and the rope tables stay float32, as their ops compute in float32.
BF16_WEIGHTS = ("embed", "lm_head", "qkv", "o_proj", "gate_up", "down")
ROPE_TABLES = ("rope_cos", "rope_sin")


def graph_weight_sources(config: ModelConfig) -> dict[str, tuple[str, ...]]:
    """Each graph parameter but the rope tables, and the canonical checkpoint tensors it is made of (fused along
    their rows in this order: QKV, gate/up)."""
    sources: dict[str, tuple[str, ...]] = {"embed": ("model.embed_tokens.weight",),
                                           "final_norm": ("model.norm.weight",)}
    if not config.tie_word_embeddings:
        sources["lm_head"] = ("lm_head.weight",)
    for i in range(config.num_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        sources[dst + "qkv"] = tuple(f"{src}self_attn.{p}_proj.weight" for p in "qkv")
        if config.attention_bias:
            sources[dst + "qkv_bias"] = tuple(f"{src}self_attn.{p}_proj.bias" for p in "qkv")
        sources |= {dst + "o_proj": (f"{src}self_attn.o_proj.weight",),
                    dst + "input_norm": (f"{src}input_layernorm.weight",),
                    dst + "post_norm": (f"{src}post_attention_layernorm.weight",),
                    dst + "gate_up": (f"{src}mlp.gate_proj.weight", f"{src}mlp.up_proj.weight"),
                    dst + "down": (f"{src}mlp.down_proj.weight",)}
    return sources


def graph_weight_names(config: ModelConfig) -> list[str]:
    """Every graph parameter's name (the rope tables after the embedding and the final norm)."""
    names = list(graph_weight_sources(config))
    return names[:2] + list(ROPE_TABLES) + names[2:]


def graph_weight(config: ModelConfig, tensors: Mapping[str, Weight], name: str, max_positions: int,
                 dtype: str = "float32") -> Weight:
    """One graph parameter from the canonical checkpoint tensors it is made of (`tensors` is read only for those).

    Block-quantized weights stay quantized (fused along their rows); `weight_arrays` lays one out for a graph.
    With `dtype` bfloat16 a float linear or the embedding is rounded to bfloat16 (BF16_WEIGHTS)."""
    if name in ROPE_TABLES:
        return rope_tables(config, max_positions)[ROPE_TABLES.index(name)]
    parts = [tensors[source] for source in graph_weight_sources(config)[name]]
    w = parts[0] if len(parts) == 1 else concat_rows(parts)
    if isinstance(w, (BlockQuantized, Int8PerChannel)):
        return w
    w = np.ascontiguousarray(w, dtype=np.float32)
    return to_bfloat16(w) if dtype == "bfloat16" and name.rsplit(".", 1)[-1] in BF16_WEIGHTS else w


def graph_weights(config: ModelConfig, tensors: Mapping[str, Weight], max_positions: int,
                  dtype: str = "float32") -> "GraphWeights":
    """Every graph parameter, each made (`graph_weight`) when read and not kept: iterating holds one at a time."""
    return GraphWeights(config, tensors, max_positions, dtype)


class GraphWeights(Mapping[str, Weight]):
    """The graph parameters of `tensors`, converted on each access (`graph_weights`)."""

    def __init__(self, config: ModelConfig, tensors: Mapping[str, Weight], max_positions: int, dtype: str) -> None:
        self._config, self._tensors, self._max_positions, self._dtype = config, tensors, max_positions, dtype
        self._names = graph_weight_names(config)

    def __getitem__(self, name: str) -> Weight:
        if name not in self._names:
            raise KeyError(name)
        return graph_weight(self._config, self._tensors, name, self._max_positions, self._dtype)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def weight_arrays(name: str, w: Weight) -> dict[str, np.ndarray]:
    """One graph parameter as the arrays a graph stores: a quantized weight as its packed parts (graphs/quant.py)."""
    if isinstance(w, BlockQuantized):
        return quant.graph_arrays(name, w, gathered=name == "embed")
    if isinstance(w, Int8PerChannel):
        return quant.int8_graph_arrays(name, w)
    return {name: w}


def graph_arrays(weights: Mapping[str, Weight]) -> dict[str, np.ndarray]:
    """Every graph parameter as arrays (`weight_arrays` of each)."""
    return {part: array for name, w in weights.items() for part, array in weight_arrays(name, w).items()}


@dataclass(frozen=True)
class WeightForms:
    """Each graph weight's form (graphs/quant.py: dense, block-quantized, int8 per channel), so `build` emits its
    op variants; a weight absent from `forms` is float32. `forms` may convert a weight when first asked for it
    (the streaming export's): nothing here needs the data."""

    forms: Mapping[str, WeightForm] = field(default_factory=dict)
    accuracy_level: int = 0  # MatMulNBits' compute for the quantized linears (export.accuracy_level)
    # Ascend: Linear.w8a8 weights with calibrated static input (scale, offset) -> Linear.w8a8_static (MindIE)
    w8a8_static: Mapping[str, tuple[float, int]] = field(default_factory=dict)

    @classmethod
    def of(cls, weights: Mapping[str, Weight], accuracy_level: int = 0,
           w8a8_static: Mapping[str, tuple[float, int]] | None = None) -> "WeightForms":
        return cls({k: quant.form_of(w) for k, w in weights.items()}, accuracy_level, dict(w8a8_static or {}))

    def linear(self, b: OpBuilder[T], x: T, name: str, bias: T | None = None) -> T:
        form = self.forms.get(name)
        if isinstance(form, DenseForm) and form.dtype == BFLOAT16.name:
            y = b.emit(ops.LINEAR_BF16, x, b.weight(name), K=form.shape[1], N=form.shape[0])
            return y if bias is None else b.emit(ops.ADD, y, bias)
        if isinstance(form, Int8Form) and name in self.w8a8_static:
            y = b.emit(ops.LINEAR_W8A8_STATIC, x, *(b.weight(p) for p in quant.w8a8_static_parts(name)),
                       K=form.shape[1], N=form.shape[0])
            return y if bias is None else b.emit(ops.ADD, y, bias)
        if isinstance(form, Int8Form):
            codes, scale = quant.int8_graph_parts(name)
            return b.emit(ops.LINEAR_W8A8, x, b.weight(codes), b.weight(scale), bias, K=form.shape[1],
                          N=form.shape[0])
        if not isinstance(form, BlockForm):
            return b.emit(ops.LINEAR, x, b.weight(name), bias)
        return b.emit(ops.LINEAR_BLOCK_QUANTIZED, x, *self._parts(b, name, form), bias, K=form.shape[1],
                      N=form.shape[0], bits=form.bits, block_size=form.block_size, accuracy_level=self.accuracy_level)

    def gather(self, b: OpBuilder[T], name: str, indices: T) -> T:
        form = self.forms.get(name)
        if isinstance(form, DenseForm) and form.dtype == BFLOAT16.name:
            return b.emit(ops.GATHER_BF16, b.weight(name), indices)
        if not isinstance(form, BlockForm):
            return b.emit(ops.GATHER, b.weight(name), indices)
        codes, scales, zero_points, minimum = self._parts(b, name, form, gathered=True)
        return b.emit(ops.GATHER_BLOCK_QUANTIZED, codes, scales, zero_points, minimum, indices, K=form.shape[1],
                      bits=form.bits, block_size=form.block_size)

    @staticmethod
    def _parts(b: OpBuilder[T], name: str, form: BlockForm, gathered: bool = False) -> list[T | None]:
        return [None if part is None else b.weight(part) for part in quant.graph_parts(name, form, gathered)]


def build(b: OpBuilder[T], config: ModelConfig, block_size: int, forms: WeightForms = WeightForms(),
          kv_cache_dtype: str = "float32", layers: Sequence[int] | None = None, head: bool = True,
          tensor_parallel_size: int = 1) -> None:
    """Emit one bucket graph following the bucket-graph contract; `forms` says which weights are quantized,
    `kv_cache_dtype` what the pools hold.

    With `tensor_parallel_size` N > 1 the graph is one rank's (graphs/tensor_parallel.py): its heads, KV heads and
    intermediate channels, over that rank's weights, with an AllReduce after o_proj and after down.

    The cache dtype picks the variants of ReshapeAndCache and PagedAttention; an int8 cache reads each
    layer's calibrated parameters as weights (graphs/kv_cache.py names them).

    `layers` (default: all, in order) makes a slice of the model, as export-time calibration and checks run a
    large model a few layers at a time: a slice that starts past layer 0 reads the residual stream and its
    normed copy (contract.SLICE_INPUTS) instead of embedding tokens, and one without the LM head (`head`; only
    the last layer may precede it) writes them out (contract.SLICE_OUTPUTS) instead of logits; no layers at all
    is the LM head alone, reading the final norm's output. Chained, slices compute what the whole graph does.
    """
    order = list(range(config.num_layers)) if layers is None else list(layers)
    if head and order and order[-1] + 1 != config.num_layers:
        raise ValueError(f"layers {order}: the LM head follows the last layer ({config.num_layers - 1}) only")
    if not order:
        x = b.input(c.SLICE_INPUTS[1])
    else:
        x, hidden = _layers(b, config, block_size, forms, kv_cache_dtype, order, tensor_parallel_size)
        if not head:
            for name, value in zip(c.SLICE_OUTPUTS, (hidden, x)):
                b.output(name, value)
            return
    last = b.emit(ops.GATHER, x, b.input(c.LOGITS_INDICES))  # norm rows, then gather: one op fewer than the reverse
    b.output(c.LOGITS, forms.linear(b, last, "embed" if config.tie_word_embeddings else "lm_head"))


def _layers(b: OpBuilder[T], config: ModelConfig, block_size: int, forms: WeightForms, kv_cache_dtype: str,
            order: list[int], tensor_parallel_size: int) -> tuple[T, T]:
    """Layers `order` (from the embedding when they start at 0): the normed residual stream and the stream."""
    config = rank_config(config, tensor_parallel_size)

    def reduced(partial: T) -> T:  # a row-parallel linear's partial sum, completed over the ranks
        return partial if tensor_parallel_size == 1 else b.emit(ops.ALL_REDUCE, partial,
                                                                rank_size=tensor_parallel_size)

    write, attend = ops.KV_CACHE_OPS[kv_cache_dtype]
    quantized = cache_format(kv_cache_dtype).quantized
    positions = b.input(c.POSITIONS)
    slot_mapping = b.input(c.SLOT_MAPPING)
    block_tables = b.input(c.BLOCK_TABLES)
    context_lens = b.input(c.CONTEXT_LENS)
    cu_seqlens_q = b.input(c.CU_SEQLENS_Q)
    cos = b.emit(ops.GATHER, b.weight("rope_cos"), positions)
    sin = b.emit(ops.GATHER, b.weight("rope_sin"), positions)
    attention = dict(head_num=config.num_heads, kv_head_num=config.num_kv_heads, head_dim=config.head_dim,
                     qk_scale=config.head_dim ** -0.5, block_size=block_size)
    norm = dict(epsilon=config.rms_norm_eps)

    if order[0] == 0:
        hidden = forms.gather(b, "embed", b.input(c.INPUT_IDS))
        x = b.emit(ops.RMS_NORM, hidden, b.weight("layers.0.input_norm"), **norm)
    else:
        hidden, x = (b.input(name) for name in c.SLICE_INPUTS)
    for position, i in enumerate(order):
        w = f"layers.{i}."
        qkv = forms.linear(b, x, w + "qkv", b.weight(w + "qkv_bias") if config.attention_bias else None)
        q, k, v = b.emit(ops.SPLIT, qkv, sizes=(config.q_size, config.kv_size, config.kv_size))
        q, k = b.emit(ops.ROPE, q, k, cos, sin, head_dim=config.head_dim)
        k_name, v_name = c.k_cache_name(i), c.v_cache_name(i)
        params = {f: b.weight(scale_weight_name(i, f)) for f in SCALE_FIELDS} if quantized else {}
        k_cache, v_cache = b.emit(write, k, v, b.input(k_name), b.input(v_name), slot_mapping,
                                  *(params[f] for f in QUANT_INPUTS if quantized))
        b.output(c.cache_output_name(k_name), k_cache)
        b.output(c.cache_output_name(v_name), v_cache)
        attn = b.emit(attend, q, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q,
                      *(params[f] for f in DEQUANT_INPUTS if quantized), **attention)
        # Each residual Add and the norm reading its sum are one AddRmsNorm (the last layer's feeds the final norm)
        x, hidden = b.emit(ops.ADD_RMS_NORM, reduced(forms.linear(b, attn, w + "o_proj")), hidden,
                           b.weight(w + "post_norm"), **norm)
        down = reduced(forms.linear(b, b.emit(ops.SWIGLU, forms.linear(b, x, w + "gate_up")), w + "down"))
        following = order[position + 1] if position + 1 < len(order) else i + 1
        after = f"layers.{following}.input_norm" if following < config.num_layers else "final_norm"
        x, hidden = b.emit(ops.ADD_RMS_NORM, down, hidden, b.weight(after), **norm)
    return x, hidden
