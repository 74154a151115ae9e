"""The Mixture-of-Experts FFN, written once against the op set: a family's feed-forward for its sparse layers.

router linear -> MoeGatingTopKSoftmax (softmax over the experts, top-k, renormalized for Qwen3-MoE's
norm_topk_prob and for Mixtral) -> MoeInitRouting (T*k rows sorted by expert, tokens per expert) -> GroupedMatmul
gate/up -> SwiGLU -> GroupedMatmul down -> MoeTokenUnpermute (the k rows of each token weighted and summed).
Shapes are static per bucket: T tokens give T*k expanded rows whatever the routing, and each expert multiplies only
the rows routed to it, so a decode step reads the k chosen experts of a layer, never all E.

Graph weights per sparse layer (the constructors below): `router` [E, H] (float32 always, Kind.ROUTER: routing
decides which weights a token reads, and a rounded logit may flip a choice), `experts.gate_up` [E, 2I, H] (each
expert's gate rows, then its up rows: SwiGLU's [gate | up]) and `experts.down` [E, H, I], stacked from the
checkpoint's per-expert tensors (graphs/weights.py). Tensor parallelism splits every expert by its intermediate
channels (Split.EXPERT_*): each rank holds I/n of each expert's gate, up and down, routes every token itself (the
router is replicated) and its unpermuted output is a partial sum completed by the decoder's AllReduce, as after a
dense layer's down projection.
"""
from __future__ import annotations

from typing import Callable, Sequence, TypeVar

from . import ops
from .config import ModelConfig, MoeConfig
from .decoder import swiglu_ffn
from .family import GraphWeight, Kind, Role, Source, Split
from .ops.moe_routing import COUNT
from .ops.op import OpBuilder
from .weight_forms import WeightForms

T = TypeVar("T")

ROUTER = Role(Kind.ROUTER)
EXPERTS_GATE_UP = Role(Kind.LINEAR, Split.EXPERT_HALVES_ROWS)
EXPERTS_DOWN = Role(Kind.LINEAR, Split.EXPERT_CHANNEL_COLUMNS)

# (expert id) -> that expert's checkpoint tensor names, in the order they are fused along the rows
ExpertNames = Callable[[int], Sequence[str]]
MOE_WEIGHTS = ("router", "experts.gate_up", "experts.down")


def moe_weight_names(i: int) -> list[str]:
    """Layer i's sparse-FFN graph weights: router, experts.gate_up, experts.down."""
    return [f"layers.{i}.{name}" for name in MOE_WEIGHTS]


def _moe(config: ModelConfig) -> MoeConfig:
    if config.moe is None:
        raise ValueError(f"{config.architecture}: a sparse layer needs ModelConfig.moe")
    return config.moe


def router(config: ModelConfig, i: int, source: str, aliases: Sequence[str] = ()) -> GraphWeight:
    """Layer i's router [E, H]; `aliases`: other names checkpoints give it (each a layout of its own)."""
    shape = (_moe(config).num_experts, config.hidden_size)
    return GraphWeight(moe_weight_names(i)[0], ROUTER, (Source(source, shape),), f"layers.{i}.post_norm",
                       layouts=tuple((Source(name, shape),) for name in aliases))


def experts_gate_up(config: ModelConfig, i: int, names: ExpertNames,
                    layouts: Sequence[Sequence[str]] = ()) -> GraphWeight:
    """Layer i's stacked gate/up [E, 2I, H] from each expert's gate and up tensors (`names(e)`), or from one of
    `layouts`: stacked tensors [E, 2I / len(layout), H] holding every expert's gate then up rows."""
    moe = _moe(config)
    rows, hidden = 2 * moe.intermediate_size, config.hidden_size
    per_expert = [n for e in range(moe.num_experts) for n in names(e)]
    return GraphWeight(moe_weight_names(i)[1], EXPERTS_GATE_UP,
                       tuple(Source(n, (rows * moe.num_experts // len(per_expert), hidden)) for n in per_expert),
                       f"layers.{i}.post_norm", moe.num_experts,
                       tuple(tuple(Source(n, (moe.num_experts, rows // len(layout), hidden)) for n in layout)
                             for layout in layouts))


def experts_down(config: ModelConfig, i: int, names: ExpertNames, layouts: Sequence[str] = ()) -> GraphWeight:
    """Layer i's stacked down projections [E, H, I] from each expert's tensor, or from a stacked tensor of
    `layouts`."""
    moe = _moe(config)
    shape = (config.hidden_size, moe.intermediate_size)
    return GraphWeight(moe_weight_names(i)[2], EXPERTS_DOWN,
                       tuple(Source(n, shape) for e in range(moe.num_experts) for n in names(e)),
                       experts=moe.num_experts, layouts=tuple((Source(n, (moe.num_experts, *shape)),) for n in layouts))


def moe_ffn(b: OpBuilder[T], config: ModelConfig, forms: WeightForms, x: T, i: int) -> T:
    """The sparse FFN of layer i on the normed stream x [T, H] (a FeedForward of graphs/decoder.py)."""
    return routed_experts(b, _moe(config), forms, x, i)


def routed_experts(b: OpBuilder[T], moe: MoeConfig, forms: WeightForms, x: T, i: int) -> T:
    """Layer i's router and experts on x [T, H]: [T, H] out (a partial sum on a tensor-parallel rank, completed by
    the decoder's AllReduce)."""
    router, gate_up, down = moe_weight_names(i)
    logits = b.emit(ops.LINEAR, x, b.weight(router))
    weights, expert_idx = b.emit(ops.MOE_GATING_TOP_K_SOFTMAX, logits, k=moe.top_k,
                                 renormalize=int(moe.norm_topk_prob))
    rows, row_idx, tokens = b.emit(ops.MOE_INIT_ROUTING, x, expert_idx, expert_num=moe.num_experts,
                                   expert_tokens_count_or_cumsum_flag=COUNT)
    hidden = b.emit(ops.SWIGLU, forms.grouped_linear(b, rows, gate_up, tokens))
    return b.emit(ops.MOE_TOKEN_UNPERMUTE, forms.grouped_linear(b, hidden, down, tokens), row_idx, weights)


def sparse_or_dense_ffn(b: OpBuilder[T], config: ModelConfig, forms: WeightForms, x: T, i: int) -> T:
    """A MoE model's feed-forward: the sparse FFN in its sparse layers, the dense SwiGLU MLP in the others."""
    if i in _moe(config).sparse_layers:
        return moe_ffn(b, config, forms, x, i)
    return swiglu_ffn(b, config, forms, x, i)


def expert_bytes(config: ModelConfig, bits_per_weight: float, rank_size: int = 1) -> int:
    """Bytes of every sparse layer's experts at `bits_per_weight` (32 float32, 16 bf16, 8.5 w8a16 and 4.5 w4a16
    with a float32 scale per 64, ...), per rank when split over `rank_size` ranks (tensor parallel: each holds 1/n
    of every expert; expert parallel: all of 1/n of the experts, the same bytes)."""
    moe = _moe(config)
    experts = len(moe.sparse_layers) * moe.num_experts * moe.expert_parameters(config.hidden_size)
    return int(experts * bits_per_weight / 8 / rank_size)
