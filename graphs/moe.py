"""The Mixture-of-Experts FFN, written once against the op set (a family file's MLP when the layer is sparse).

router linear -> MoeGatingTopKSoftmax (softmax over the experts, top-k, renormalized for Qwen3-MoE's
norm_topk_prob and for Mixtral) -> MoeInitRouting (T*k rows sorted by expert, tokens per expert) -> GroupedMatmul
gate/up -> SwiGLU -> GroupedMatmul down -> MoeTokenUnpermute (the k rows of each token weighted and summed).
Shapes are static per bucket: T tokens give T*k expanded rows whatever the routing, and each expert multiplies only
the rows routed to it, so a decode step reads the k chosen experts of a layer, never all E.

Graph weights per sparse layer (`moe_weight_names`): `router` [E, H] (float32 always: routing decides which
weights a token reads, and a rounded logit may flip a choice), `experts.gate_up` [E, 2I, H] (each expert's gate
rows, then its up rows: SwiGLU's [gate | up]) and `experts.down` [E, H, I]. Tensor parallelism splits every expert
by its intermediate channels (`shard_experts`): each rank holds I/n of each expert's gate, up and down, routes
every token itself (the router is replicated) and its unpermuted output is a partial sum completed by one
AllReduce, as after a dense layer's down projection.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence, TypeVar

import numpy as np

from . import ops, quant
from .ops.grouped_matmul import GROUP_COUNT
from .ops.linear_bf16 import BFLOAT16
from .ops.moe_routing import COUNT
from .ops.op import OpBuilder
from .quant import BlockForm, DenseForm, WeightForm

T = TypeVar("T")

MOE_WEIGHTS = ("router", "experts.gate_up", "experts.down")


@dataclass(frozen=True)
class MoeShape:
    """What a sparse layer's graph needs: its experts, how many each token reads, their width, the routing form."""

    hidden_size: int
    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's (Qwen3-MoE's moe_intermediate_size, Mixtral's intermediate_size)
    norm_topk_prob: bool  # renormalize the k weights (Mixtral always does)

    def __post_init__(self) -> None:
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok = {self.top_k} with {self.num_experts} experts: each token reads "
                             f"between 1 and num_experts experts")

    def expert_parameters(self) -> int:
        """Parameters of one expert (gate, up and down)."""
        return 3 * self.hidden_size * self.intermediate_size

    def layer_parameters(self) -> tuple[int, int]:
        """(stored, read per token) parameters of one sparse layer's FFN: the router and all E experts, or k of them."""
        router = self.num_experts * self.hidden_size
        return router + self.num_experts * self.expert_parameters(), router + self.top_k * self.expert_parameters()


def moe_weight_names(layer: int) -> list[str]:
    return [f"layers.{layer}.{name}" for name in MOE_WEIGHTS]


def moe_ffn(b: OpBuilder[T], forms: Mapping[str, WeightForm], x: T, layer: int, moe: MoeShape) -> T:
    """The sparse FFN of layer `layer` on the normed stream x [T, H]: [T, H] out (a partial sum on a tensor-parallel
    rank, completed by the caller's AllReduce). `forms` gives each expert stack's form (float32 where absent)."""
    w = f"layers.{layer}."
    logits = b.emit(ops.LINEAR, x, b.weight(w + "router"))
    weights, expert_idx = b.emit(ops.MOE_GATING_TOP_K_SOFTMAX, logits, k=moe.top_k,
                                 renormalize=int(moe.norm_topk_prob))
    rows, row_idx, tokens = b.emit(ops.MOE_INIT_ROUTING, x, expert_idx, expert_num=moe.num_experts,
                                   expert_tokens_count_or_cumsum_flag=COUNT)
    hidden = b.emit(ops.SWIGLU, grouped_linear(b, forms, rows, w + "experts.gate_up", tokens))
    return b.emit(ops.MOE_TOKEN_UNPERMUTE, grouped_linear(b, forms, hidden, w + "experts.down", tokens), row_idx,
                  weights)


def grouped_linear(b: OpBuilder[T], forms: Mapping[str, WeightForm], x: T, name: str, group_list: T) -> T:
    """GroupedMatmul in the variant of the stack's form: float32, bfloat16 or block-quantized (a block form's shape
    is one expert's [N, K])."""
    form = forms.get(name)
    if isinstance(form, DenseForm) and form.dtype == BFLOAT16.name:
        return b.emit(ops.GROUPED_MATMUL_BF16, x, b.weight(name), group_list, group_list_type=GROUP_COUNT)
    if isinstance(form, BlockForm):
        parts = [None if part is None else b.weight(part) for part in quant.graph_parts(name, form)]
        return b.emit(ops.GROUPED_MATMUL_BLOCK_QUANTIZED, x, *parts, group_list, K=form.shape[1], N=form.shape[0],
                      bits=form.bits, block_size=form.block_size, accuracy_level=0, group_list_type=GROUP_COUNT)
    return b.emit(ops.GROUPED_MATMUL, x, b.weight(name), group_list, group_list_type=GROUP_COUNT)


def stack_experts(gate: Sequence[np.ndarray], up: Sequence[np.ndarray],
                  down: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Per-expert checkpoint tensors (HF's [out, in]: gate and up [I, H], down [H, I]) -> the graph's stacks
    experts.gate_up [E, 2I, H] and experts.down [E, H, I]."""
    if not len(gate) == len(up) == len(down):
        raise ValueError(f"{len(gate)} gate, {len(up)} up and {len(down)} down projections: one of each per expert")
    gate_up = np.stack([np.concatenate([g, u]) for g, u in zip(gate, up)]).astype(np.float32)
    return gate_up, np.stack(down).astype(np.float32)


def shard_experts(gate_up: np.ndarray, down: np.ndarray, rank: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Rank `rank` of `size`'s slices of the expert stacks: intermediate channels [r*I/n, (r+1)*I/n) of every
    expert's gate, up (so its gate_up stays [gate | up]) and down."""
    intermediate = down.shape[2]
    if intermediate % size:
        raise ValueError(f"expert intermediate size {intermediate} does not split over tensor_parallel_size {size}: "
                         "pick a size that divides it")
    width = intermediate // size
    part = slice(rank * width, (rank + 1) * width)
    gate, up = gate_up[:, :intermediate], gate_up[:, intermediate:]
    return (np.ascontiguousarray(np.concatenate([gate[:, part], up[:, part]], axis=1)),
            np.ascontiguousarray(down[:, :, part]))


def expert_bytes(moe: MoeShape, sparse_layers: int, bits_per_weight: float, rank_size: int = 1) -> int:
    """Bytes of the expert stacks of `sparse_layers` layers at `bits_per_weight` (32 float32, 16 bf16, 8.5 w8a16 and
    4.5 w4a16 with a float32 scale per 64, ...), per rank when split over `rank_size` ranks (tensor parallel: each
    holds 1/n of every expert; expert parallel: all of 1/n of the experts, the same bytes)."""
    return int(sparse_layers * moe.num_experts * moe.expert_parameters() * bits_per_weight / 8 / rank_size)
