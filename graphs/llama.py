"""The LLaMA family (LLaMA 2/3, Mistral, Qwen2, SmolLM2), defined once against the op set.

One graph serves every step: new tokens are written to the pool first, then every
query attends through the block table (prefill, chunked prefill, prefix hits and
decode alike), and only the rows in `logits_indices` reach the LM head.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, TypeVar

import numpy as np

from . import contract as c
from . import ops, quant
from .config import ModelConfig
from .kv_cache import DEQUANT_INPUTS, QUANT_INPUTS, SCALE_FIELDS, cache_format, scale_weight_name
from .ops.linear_bf16 import BFLOAT16, to_bfloat16
from .ops.op import OpBuilder
from .quant import BlockQuantized, Int8PerChannel, Weight, concat_rows
from .rope_tables import rope_tables

T = TypeVar("T")


# The weights a `model.dtype: bfloat16` graph stores as bfloat16: every linear's and the embedding (the tied LM
# head's table). Norm weights, biases and the rope tables stay float32, as their ops compute in float32.
BF16_WEIGHTS = ("embed", "lm_head", "qkv", "o_proj", "gate_up", "down")


def graph_weights(config: ModelConfig, tensors: Mapping[str, Weight], max_positions: int,
                  dtype: str = "float32") -> dict[str, Weight]:
    """Canonical checkpoint tensors -> the graph's parameters (fused QKV and gate/up, rope tables).

    Block-quantized weights stay quantized (fused along their rows); `graph_arrays` lays them out for a graph.
    With `dtype` bfloat16 the float linears and the embedding are rounded to bfloat16 (BF16_WEIGHTS)."""
    cos, sin = rope_tables(config, max_positions)
    weights: dict[str, Weight] = {
        "embed": tensors["model.embed_tokens.weight"],
        "final_norm": tensors["model.norm.weight"],
        "rope_cos": cos,
        "rope_sin": sin,
    }
    if not config.tie_word_embeddings:
        weights["lm_head"] = tensors["lm_head.weight"]
    for i in range(config.num_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        attn = [tensors[f"{src}self_attn.{p}_proj.weight"] for p in "qkv"]
        weights[dst + "qkv"] = concat_rows(attn)
        if config.attention_bias:
            weights[dst + "qkv_bias"] = np.concatenate([tensors[f"{src}self_attn.{p}_proj.bias"] for p in "qkv"])
        weights[dst + "o_proj"] = tensors[f"{src}self_attn.o_proj.weight"]
        weights[dst + "input_norm"] = tensors[f"{src}input_layernorm.weight"]
        weights[dst + "post_norm"] = tensors[f"{src}post_attention_layernorm.weight"]
        weights[dst + "gate_up"] = concat_rows([tensors[f"{src}mlp.gate_proj.weight"], tensors[f"{src}mlp.up_proj.weight"]])
        weights[dst + "down"] = tensors[f"{src}mlp.down_proj.weight"]
    out = {name: w if isinstance(w, (BlockQuantized, Int8PerChannel)) else np.ascontiguousarray(w, dtype=np.float32)
           for name, w in weights.items()}
    if dtype == "bfloat16":
        out.update({name: to_bfloat16(w) for name, w in out.items()
                    if isinstance(w, np.ndarray) and name.rsplit(".", 1)[-1] in BF16_WEIGHTS})
    return out


def graph_arrays(weights: Mapping[str, Weight]) -> dict[str, np.ndarray]:
    """Every graph parameter as an array: a block-quantized weight becomes its packed parts (graphs/quant.py)."""
    out: dict[str, np.ndarray] = {}
    for name, w in weights.items():
        if isinstance(w, BlockQuantized):
            out.update(quant.graph_arrays(name, w, gathered=name == "embed"))
        elif isinstance(w, Int8PerChannel):
            out.update(quant.int8_graph_arrays(name, w))
        else:
            out[name] = w
    return out


@dataclass(frozen=True)
class WeightForms:
    """Which graph weights are block-quantized (and their form) or bfloat16, so `build` emits their op variants."""

    quantized: Mapping[str, BlockQuantized] = field(default_factory=dict)
    accuracy_level: int = 0  # MatMulNBits' compute for the quantized linears (export.accuracy_level)
    w8a8: Mapping[str, Int8PerChannel] = field(default_factory=dict)  # Linear.w8a8 weights
    # Ascend: Linear.w8a8 weights with calibrated static input (scale, offset) -> Linear.w8a8_static (MindIE)
    w8a8_static: Mapping[str, tuple[float, int]] = field(default_factory=dict)
    bfloat16: Mapping[str, tuple[int, ...]] = field(default_factory=dict)  # Linear/Gather.bfloat16: name -> shape

    @classmethod
    def of(cls, weights: Mapping[str, Weight], accuracy_level: int = 0,
           w8a8_static: Mapping[str, tuple[float, int]] | None = None) -> "WeightForms":
        return cls({k: w for k, w in weights.items() if isinstance(w, BlockQuantized)}, accuracy_level,
                   {k: w for k, w in weights.items() if isinstance(w, Int8PerChannel)}, dict(w8a8_static or {}),
                   {k: w.shape for k, w in weights.items() if isinstance(w, np.ndarray) and w.dtype == BFLOAT16})

    def linear(self, b: OpBuilder[T], x: T, name: str, bias: T | None = None) -> T:
        shape = self.bfloat16.get(name)
        if shape is not None:
            y = b.emit(ops.LINEAR_BF16, x, b.weight(name), K=shape[1], N=shape[0])
            return y if bias is None else b.emit(ops.ADD, y, bias)
        int8 = self.w8a8.get(name)
        if int8 is not None and name in self.w8a8_static:
            y = b.emit(ops.LINEAR_W8A8_STATIC, x, *(b.weight(p) for p in quant.w8a8_static_parts(name)),
                       K=int8.shape[1], N=int8.shape[0])
            return y if bias is None else b.emit(ops.ADD, y, bias)
        if int8 is not None:
            codes, scale = quant.int8_graph_parts(name)
            return b.emit(ops.LINEAR_W8A8, x, b.weight(codes), b.weight(scale), bias, K=int8.shape[1],
                          N=int8.shape[0])
        w = self.quantized.get(name)
        if w is None:
            return b.emit(ops.LINEAR, x, b.weight(name), bias)
        return b.emit(ops.LINEAR_BLOCK_QUANTIZED, x, *self._parts(b, name, w), bias, K=w.shape[1], N=w.shape[0],
                      bits=w.bits, block_size=w.block_size, accuracy_level=self.accuracy_level)

    def gather(self, b: OpBuilder[T], name: str, indices: T) -> T:
        if name in self.bfloat16:
            return b.emit(ops.GATHER_BF16, b.weight(name), indices)
        w = self.quantized.get(name)
        if w is None:
            return b.emit(ops.GATHER, b.weight(name), indices)
        codes, scales, zero_points, minimum = self._parts(b, name, w, gathered=True)
        return b.emit(ops.GATHER_BLOCK_QUANTIZED, codes, scales, zero_points, minimum, indices, K=w.shape[1],
                      bits=w.bits, block_size=w.block_size)

    @staticmethod
    def _parts(b: OpBuilder[T], name: str, w: BlockQuantized, gathered: bool = False) -> list[T | None]:
        return [None if part is None else b.weight(part) for part in quant.graph_parts(name, w, gathered)]


def build(b: OpBuilder[T], config: ModelConfig, block_size: int, forms: WeightForms = WeightForms(),
          kv_cache_dtype: str = "float32") -> None:
    """Emit one bucket graph following the bucket-graph contract; `forms` says which weights are quantized,
    `kv_cache_dtype` what the pools hold.

    The cache dtype picks the variants of ReshapeAndCache and PagedAttention; an int8 cache reads each
    layer's calibrated parameters as weights (graphs/kv_cache.py names them).
    """
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

    hidden = forms.gather(b, "embed", b.input(c.INPUT_IDS))
    x = b.emit(ops.RMS_NORM, hidden, b.weight("layers.0.input_norm"), **norm)
    for i in range(config.num_layers):
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
        x, hidden = b.emit(ops.ADD_RMS_NORM, forms.linear(b, attn, w + "o_proj"), hidden, b.weight(w + "post_norm"),
                           **norm)
        down = forms.linear(b, b.emit(ops.SWIGLU, forms.linear(b, x, w + "gate_up")), w + "down")
        after = f"layers.{i + 1}.input_norm" if i + 1 < config.num_layers else "final_norm"
        x, hidden = b.emit(ops.ADD_RMS_NORM, down, hidden, b.weight(after), **norm)

    last = b.emit(ops.GATHER, x, b.input(c.LOGITS_INDICES))  # norm rows, then gather: one op fewer than the reverse
    b.output(c.LOGITS, forms.linear(b, last, "embed" if config.tie_word_embeddings else "lm_head"))
