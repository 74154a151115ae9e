"""The decoder every family composes: its weights' declarations and its graph, written once against the op set.

One graph serves every step: new tokens are written to the pool first, then every query attends through the block
table (prefill, chunked prefill, prefix hits and decode alike), and only the rows in `logits_indices` reach the LM
head. A family picks its attention (q/k/v bias, per-head q/k norms) and its feed-forward (`FeedForward`: the dense
SwiGLU here, a Mixture-of-Experts layer elsewhere), and names its checkpoint tensors.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Generic, Sequence, TypeVar

from . import contract as c
from . import ops
from .config import ModelConfig
from .family import GraphOptions, GraphWeight, Kind, Role, Source, Split
from .kv_cache import DEQUANT_INPUTS, QUANT_INPUTS, SCALE_FIELDS, cache_format, scale_weight_name
from .ops.op import OpBuilder
from .tensor_parallel import rank_config
from .rope_tables import ROPE_TABLES
from .weight_forms import WeightForms

T = TypeVar("T")

NORM = Role(Kind.NORM)
QKV = Role(Kind.LINEAR, Split.QKV_ROWS, int8_activations=True)
QKV_BIAS = Role(Kind.BIAS, Split.QKV_ROWS)
O_PROJ = Role(Kind.LINEAR, Split.HEAD_COLUMNS, int8_activations=True)
GATE_UP = Role(Kind.LINEAR, Split.HALVES_ROWS, int8_activations=True)
DOWN = Role(Kind.LINEAR, Split.CHANNEL_COLUMNS)


# --- weights --------------------------------------------------------------------------------


def model_weights(config: ModelConfig, layer: Callable[[ModelConfig, int], list[GraphWeight]]) -> list[GraphWeight]:
    """The embedding, final norm, rope tables and LM head (absent when tied) under HF's names, then each layer's
    weights as `layer(config, i)` declares them."""
    vocab = (config.vocab_size, config.hidden_size)
    ends = [GraphWeight("embed", Role(Kind.EMBEDDING), (Source("model.embed_tokens.weight", vocab),)),
            norm("final_norm", "model.norm.weight", config.hidden_size),
            *(GraphWeight(name, Role(Kind.TABLE)) for name in ROPE_TABLES)]
    if not config.tie_word_embeddings:
        ends.append(GraphWeight("lm_head", Role(Kind.LM_HEAD), (Source("lm_head.weight", vocab),)))
    return ends + [w for i in range(config.num_layers) for w in layer(config, i)]


def norm(name: str, source: str, width: int) -> GraphWeight:
    return GraphWeight(name, NORM, (Source(source, (width,)),))


def qkv(config: ModelConfig, i: int, sources: Sequence[str], bias: bool = False) -> GraphWeight:
    """Layer i's fused QKV projection (or its bias) from the q, k and v tensors, or from one tensor holding all
    three (Phi-3's qkv_proj)."""
    rows = (config.q_size, config.kv_size, config.kv_size)
    if len(sources) == 1:
        rows = (sum(rows),)
    shapes = [(n,) if bias else (n, config.hidden_size) for n in rows]
    return GraphWeight(f"layers.{i}.qkv" + ("_bias" if bias else ""), QKV_BIAS if bias else QKV,
                       tuple(Source(n, s) for n, s in zip(sources, shapes)),
                       None if bias else f"layers.{i}.input_norm")


def o_proj(config: ModelConfig, i: int, source: str) -> GraphWeight:
    return GraphWeight(f"layers.{i}.o_proj", O_PROJ, (Source(source, (config.hidden_size, config.q_size)),))


def gate_up(config: ModelConfig, i: int, sources: Sequence[str]) -> GraphWeight:
    """Layer i's fused gate/up projection from the gate and up tensors, or from one tensor holding both (Phi-3's
    gate_up_proj, gate rows first)."""
    rows = config.intermediate_size * (2 if len(sources) == 1 else 1)
    return GraphWeight(f"layers.{i}.gate_up", GATE_UP, tuple(Source(n, (rows, config.hidden_size)) for n in sources),
                       f"layers.{i}.post_norm")


def down(config: ModelConfig, i: int, source: str) -> GraphWeight:
    return GraphWeight(f"layers.{i}.down", DOWN, (Source(source, (config.hidden_size, config.intermediate_size)),))


def qk_norms(config: ModelConfig, i: int, q_source: str, k_source: str) -> list[GraphWeight]:
    """Qwen3's per-head RMSNorm weights of q and k ([head_dim], shared by every head)."""
    return [norm(f"layers.{i}.{name}", source, config.head_dim)
            for name, source in (("q_norm", q_source), ("k_norm", k_source))]


# --- the graph ------------------------------------------------------------------------------

# A layer's feed-forward: its normed input -> its output before the tensor-parallel AllReduce.
FeedForward = Callable[[OpBuilder[T], ModelConfig, WeightForms, T, int], T]


def swiglu_ffn(b: OpBuilder[T], config: ModelConfig, forms: WeightForms, x: T, i: int) -> T:
    """The dense SwiGLU MLP: gate/up, SiLU(gate) * up, down."""
    return forms.linear(b, b.emit(ops.SWIGLU, forms.linear(b, x, f"layers.{i}.gate_up")), f"layers.{i}.down")


@dataclass(frozen=True)
class Decoder:
    """What a family chooses of the decoder: per-head q/k norms (Qwen3) and the feed-forward of each layer. The q/k/v
    bias follows ModelConfig.attention_bias."""

    qk_norm: bool = False
    ffn: FeedForward = swiglu_ffn

    def build(self, b: OpBuilder[T], config: ModelConfig, options: GraphOptions) -> None:
        """Emit one bucket graph following the bucket-graph contract; `options.forms` says which weights are
        quantized, `options.kv_cache_dtype` what the pools hold.

        With `tensor_parallel_size` N > 1 the graph is one rank's (graphs/tensor_parallel.py): its heads, KV heads
        and intermediate channels, over that rank's weights, with an AllReduce after o_proj and after the
        feed-forward. The cache dtype picks the variants of ReshapeAndCache and PagedAttention; an int8 cache reads
        each layer's calibrated parameters as weights (graphs/kv_cache.py names them).

        `layers` (default: all, in order) makes a slice of the model, as export-time calibration and checks run a
        large model a few layers at a time: a slice that starts past layer 0 reads the residual stream and its
        normed copy (contract.SLICE_INPUTS) instead of embedding tokens, and one without the LM head (`head`; only
        the last layer may precede it) writes them out (contract.SLICE_OUTPUTS) instead of logits; no layers at all
        is the LM head alone, reading the final norm's output. Chained, slices compute what the whole graph does.
        """
        order = list(range(config.num_layers)) if options.layers is None else list(options.layers)
        if options.head and order and order[-1] + 1 != config.num_layers:
            raise ValueError(f"layers {order}: the LM head follows the last layer ({config.num_layers - 1}) only")
        if not order:
            x = b.input(c.SLICE_INPUTS[1])
        else:
            x, hidden = self._layers(b, config, options, order)
            if not options.head:
                for name, value in zip(c.SLICE_OUTPUTS, (hidden, x)):
                    b.output(name, value)
                return
        last = b.emit(ops.GATHER, x, b.input(c.LOGITS_INDICES))  # norm rows, then gather: one op fewer than reverse
        b.output(c.LOGITS, options.forms.linear(b, last, "embed" if config.tie_word_embeddings else "lm_head"))

    def _layers(self, b: OpBuilder[T], config: ModelConfig, options: GraphOptions, order: list[int]) -> tuple[T, T]:
        """Layers `order` (from the embedding when they start at 0): the normed residual stream and the stream."""
        size, forms = options.tensor_parallel_size, options.forms
        local = rank_config(config, size)

        def reduced(partial: T) -> T:  # a row-parallel linear's partial sum, completed over the ranks
            return partial if size == 1 else b.emit(ops.ALL_REDUCE, partial, rank_size=size)

        step = _StepInputs(b, options)
        norm_eps = dict(epsilon=config.rms_norm_eps)
        if order[0] == 0:
            hidden = forms.gather(b, "embed", b.input(c.INPUT_IDS))
            x = b.emit(ops.RMS_NORM, hidden, b.weight("layers.0.input_norm"), **norm_eps)
        else:
            hidden, x = (b.input(name) for name in c.SLICE_INPUTS)
        for position, i in enumerate(order):
            attn = self._attention(b, local, options, step, x, i)
            # Each residual Add and the norm reading its sum are one AddRmsNorm (the last layer's feeds the final norm)
            x, hidden = b.emit(ops.ADD_RMS_NORM, reduced(forms.linear(b, attn, f"layers.{i}.o_proj")), hidden,
                               b.weight(f"layers.{i}.post_norm"), **norm_eps)
            following = order[position + 1] if position + 1 < len(order) else i + 1
            after = f"layers.{following}.input_norm" if following < config.num_layers else "final_norm"
            x, hidden = b.emit(ops.ADD_RMS_NORM, reduced(self.ffn(b, local, forms, x, i)), hidden, b.weight(after),
                               **norm_eps)
        return x, hidden

    def _attention(self, b: OpBuilder[T], config: ModelConfig, options: GraphOptions, step: "_StepInputs[T]", x: T,
                   i: int) -> T:
        """Layer i's attention over the paged cache, after writing this step's K/V (`config`: the rank's heads)."""
        w = f"layers.{i}."
        bias = b.weight(w + "qkv_bias") if config.attention_bias else None
        q, k, v = b.emit(ops.SPLIT, options.forms.linear(b, x, w + "qkv", bias),
                         sizes=(config.q_size, config.kv_size, config.kv_size))
        if self.qk_norm:
            q, k = (b.emit(ops.RMS_NORM_HEADS, t, b.weight(w + name), epsilon=config.rms_norm_eps,
                           head_dim=config.head_dim) for t, name in ((q, "q_norm"), (k, "k_norm")))
        q, k = b.emit(ops.ROPE, q, k, step.cos, step.sin, head_dim=config.head_dim)
        write, attend = ops.KV_CACHE_OPS[options.kv_cache_dtype]
        quantized = cache_format(options.kv_cache_dtype).quantized
        params = {f: b.weight(scale_weight_name(i, f)) for f in SCALE_FIELDS} if quantized else {}
        k_name, v_name = c.k_cache_name(i), c.v_cache_name(i)
        k_cache, v_cache = b.emit(write, k, v, b.input(k_name), b.input(v_name), step.slot_mapping,
                                  *(params[f] for f in QUANT_INPUTS if quantized))
        b.output(c.cache_output_name(k_name), k_cache)
        b.output(c.cache_output_name(v_name), v_cache)
        return b.emit(attend, q, k_cache, v_cache, step.block_tables, step.context_lens, step.cu_seqlens_q,
                      *(params[f] for f in DEQUANT_INPUTS if quantized), head_num=config.num_heads,
                      kv_head_num=config.num_kv_heads, head_dim=config.head_dim, qk_scale=config.head_dim ** -0.5,
                      block_size=options.block_size)


class _StepInputs(Generic[T]):
    """The contract inputs every layer's attention reads, and the rope rows of this step's positions."""

    def __init__(self, b: OpBuilder[T], options: GraphOptions) -> None:
        positions = b.input(c.POSITIONS)
        self.slot_mapping = b.input(c.SLOT_MAPPING)
        self.block_tables = b.input(c.BLOCK_TABLES)
        self.context_lens = b.input(c.CONTEXT_LENS)
        self.cu_seqlens_q = b.input(c.CU_SEQLENS_Q)
        self.cos = b.emit(ops.GATHER, b.weight("rope_cos"), positions)
        self.sin = b.emit(ops.GATHER, b.weight("rope_sin"), positions)
